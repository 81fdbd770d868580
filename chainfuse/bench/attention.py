"""`chainfuse bench attention`: fused attention against PyTorch's SDPA and unfused PyTorch.

The 12 attention-shaped paper workloads as `softmax(Q Kᵀ / sqrt(d)) V` with 4-D inputs
[1, heads, seq, d] (so PyTorch takes its fused CPU kernel), plus short sequences (32, 64, 128;
12 heads of 64) and decoding (one query against 512 keys, 12 heads of 64, and 1024 keys, 32
heads of 128: the row path). Every result is checked against the float64 reference first; then
chainfuse, `F.scaled_dot_product_attention` and matmul-softmax-matmul are timed interleaved in
one process, medians at 1 thread and best-of at more. chainfuse is timed as a drop-in for SDPA
(`chainfuse.ops.attention` on the same tensors, allocating its output as SDPA does).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chainfuse import ops, reference
from chainfuse.bench import workloads
from chainfuse.bench.gemm_chain import model_facts, predicted_ms, set_threads
from chainfuse.bench.results import HALF_SUFFIX, Result, geomean, suite_name
from chainfuse.bench.timing import interleave
from chainfuse.compiler import compile
from chainfuse.ir import Chain, attention_chain

__all__ = ["cases", "chain_of", "main", "run", "summarise"]

SUITE = "attention"
SHORT = (32, 64, 128)
DECODE = (("decode-512", 12, 512, 64), ("decode-1024", 32, 1024, 128))  # one query
BASELINES = ("sdpa", "unfused")


def cases(quick: bool = False) -> list[tuple[str, int, int, int, int, int]]:
    """(name, heads, seq_q, seq_k, head_dim_qk, head_dim_v) of every case: the 12
    attention-shaped paper workloads (batch as heads; Mixer-S has seq_q != seq_k), then the
    short sequences, then decoding steps (one query)."""
    out = [(w.name, w.batch, w.M, w.L, w.K, w.N) for w in workloads.GEMM if w.attention_shaped]
    if quick:
        out = out[1:2] + out[5:6]
    out += [(f"seq-{s}", 12, s, s, 64, 64) for s in SHORT]
    decode = DECODE[:1] if quick else DECODE
    return out + [(name, heads, 1, keys, d, d) for name, heads, keys, d in decode]


def chain_of(name: str, dtype: str = "float32") -> Chain:
    """The attention chain of a case name of `cases()`."""
    for case, heads, seq_q, seq_k, dqk, dv in cases():
        if case == name:
            return attention_chain(1, heads, seq_q, seq_k, dqk, dv, dtype=dtype)
    raise ValueError(f"unknown attention case {name!r}; known: {[c[0] for c in cases()]}")


def _torch_fns(args: Sequence[Any]) -> dict[str, Callable[[], object]]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}

    q, k, v = (a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in args)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def unfused() -> object:
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, -1), v)

    return {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v), "unfused": unfused}


def _drop_in(args: Sequence[Any]) -> Callable[[], object]:
    """chainfuse as a user calls it in SDPA's place: `ops.attention` on the tensors SDPA gets,
    a fresh output each call (SDPA allocates one too), the kernel found by its sizes."""
    try:
        import torch
    except ImportError:
        qkv = list(args)
    else:
        qkv = [a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in args]
    return lambda: ops.attention(*qkv)


def run(
    names: Sequence[str],
    threads: Sequence[int],
    rounds: int,
    progress: Callable[[str], None] | None = None,
    dtype: str = "float32",
) -> list[Result]:
    """Compile, check and time every case at every thread count (bf16 or fp16: suite
    "attention-bf16" / "-fp16", 16-bit tensors for chainfuse, SDPA and the unfused PyTorch
    alike)."""
    half = dtype in HALF_SUFFIX
    results: list[Result] = []
    for name in names:
        chain = chain_of(name, dtype)
        inputs = reference.random_inputs(chain, seed=5)
        qkv: list[Any] = [inputs[n] for n in ("Q", "K", "V")]
        if half:
            import torch

            qkv = [torch.from_numpy(a).to(getattr(torch, dtype)) for a in qkv]
        want = reference.run(chain, inputs)["O"]
        baselines = _torch_fns(qkv)
        for n in threads:
            set_threads(n)
            kernel = compile(chain, threads=n)  # planned for the threads it runs on
            drop_in = _drop_in(qkv)
            out: Any = drop_in()
            reference.assert_close(np.asarray(out.float() if half else out), want, chain)
            fns: dict[str, Callable[[], object]] = {"chainfuse": drop_in}
            fns.update(baselines)
            facts = model_facts(chain, kernel)
            spec = kernel.spec
            timing = interleave(fns, rounds, best=n > 1)
            results.append(Result(
                suite_name(SUITE, dtype), name, "softmax", n, chain.flops() / 1e9,
                ms={k: t.ms for k, t in timing.items()}, baselines=BASELINES,
                spread={k: t.spread for k, t in timing.items()},
                best_ms={k: t.best_ms for k, t in timing.items()}, dtype=dtype,
                tiles=f"T_M={spec.T_M} T_L={spec.T_L} T_K={spec.T_K} T_N={spec.T_N}",
                predicted_ms=predicted_ms(chain, kernel.plan, n), **facts,
            ))  # fmt: skip
            if progress is not None:
                progress(f"{name} {n}t {dtype}")
    return results


def summarise(results: Sequence[Result], peak: float) -> dict[str, Any]:
    """The figures issue 4's acceptance lines are stated in, per thread count."""
    out: dict[str, Any] = {}
    for n in sorted({r.threads for r in results}):
        mine = [r for r in results if r.threads == n and "sdpa" in r.ms]
        paper = [r for r in mine if not r.workload.startswith(("seq-", "decode-"))]
        short = [r for r in mine if r.workload.startswith("seq-")]
        decode = [r for r in mine if r.workload.startswith("decode-")]
        ratios = [r.speedup("sdpa") for r in paper]
        out[f"{n}t"] = {
            "paper_geomean_vs_sdpa": geomean(ratios),
            "paper_min_vs_sdpa": min(ratios, default=math.nan),
            "paper_at_or_above_80pct_peak": sum(r.gflops() >= 0.8 * peak * n for r in paper),
            "paper_at_or_above_80pct_peak_fastest_call": sum(
                r.best_gflops() >= 0.8 * peak * n for r in paper
            ),
            "paper_count": len(paper),
            "short_min_vs_best_torch": min((r.speedup() for r in short), default=math.nan),
            "decode_min_vs_best_torch": min((r.speedup() for r in decode), default=math.nan),
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`chainfuse bench attention ...`: the shared runner with this suite."""
    from chainfuse.bench import runner

    return runner.main(["attention", *(argv or [])])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
