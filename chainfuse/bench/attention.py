"""`chainfuse bench attention`: fused attention against PyTorch's SDPA and unfused PyTorch.

The 12 attention-shaped paper workloads as `softmax(Q Kᵀ / sqrt(d)) V` with 4-D inputs
[1, heads, seq, d] (so PyTorch takes its fused CPU kernel), plus short sequences (32, 64, 128;
12 heads of 64), decoding (one query against 512 keys, 12 heads of 64, and 1024 keys, 32 heads
of 128: the row path) and a long sequence (`LONG`: Whisper-base's encoder, 8 heads of 64 over
1500 frames, whose keys take several tiles: the online softmax across them). Every result is
checked against the float64 reference first; then chainfuse, `F.scaled_dot_product_attention`
and matmul-softmax-matmul are timed interleaved in one process, medians at 1 thread and best-of
at more. chainfuse is timed as a drop-in for SDPA (`chainfuse.ops.attention` on the same
tensors, allocating its output as SDPA does).

Masked cases follow (`MASKED`): a causal prompt (GPT-2's 12 heads of 64, 1024 tokens), BERT-base
with a padding mask over the keys ([1, 1, 1, 512], float) and with a boolean mask that differs
from query to query ([1, 1, 512, 512], shared by the heads). The same mask goes to all three;
the unfused baseline adds it (or fills -inf where a boolean or causal mask is False, the causal
one built once, as models keep it). A causal case's GFLOP/s count the scores it keeps. Two
masks with structure, as models without `is_causal` pass them (`STRUCTURED`): a causal mask
over GPT-2's prompt and a sliding window of 512 keys over 2048 (Mistral's and Gemma 2's local
layers), additive, filled with `finfo(float32).min`; their GFLOP/s count every score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chainfuse import ops, reference
from chainfuse.bench import workloads
from chainfuse.bench.harness import model_facts, predicted_ms, set_threads
from chainfuse.bench.results import HALF_SUFFIX, Result, geomean, suite_name
from chainfuse.bench.timing import interleave
from chainfuse.builders import attention_chain
from chainfuse.compiler import compile
from chainfuse.ir import Chain
from chainfuse.model import causal_softmax, computed_share

__all__ = [
    "LONG",
    "MASKED",
    "cases",
    "chain_of",
    "run",
    "summarise",
    "useful_gflop",
    "variant",
]

SUITE = "attention"
SHORT = (32, 64, 128)
DECODE = (("decode-512", 12, 512, 64), ("decode-1024", 32, 1024, 128))  # one query
LONG = (("long-1500", 8, 1500, 64),)  # (name, heads, seq, head dim); not in the quick set
# masked cases: name -> (heads, seq, head dim, causal, mask kind, mask shape); the last is in
# the quick set
MASKED: dict[str, tuple[int, int, int, bool, str | None, tuple[int, ...] | None]] = {
    "padded-512": (12, 512, 64, False, "additive", (1, 1, 1, 512)),
    "bool-512": (12, 512, 64, False, "bool", (1, 1, 512, 512)),
    "causal-1024": (12, 1024, 64, True, None, None),
    "causal-mask-1024": (12, 1024, 64, False, "additive", (1, 1, 1024, 1024)),
    "window-2048": (8, 2048, 128, False, "additive", (1, 1, 2048, 2048)),
}
#: masked cases whose mask has structure (keys each query keeps: those at or before it, and
#: at most this many of them; None: no limit), not random values
STRUCTURED: dict[str, int | None] = {"causal-mask-1024": None, "window-2048": 512}


def structured_mask(seq: int, window: int | None) -> np.ndarray:
    """[1, 1, seq, seq] float32: 0 where query i keeps key j (j <= i, and i - j < window),
    `finfo(float32).min` elsewhere, as models fill their masks."""
    i = np.arange(seq)
    keep = i[None, :] <= i[:, None]
    if window is not None:
        keep &= i[:, None] - i[None, :] < window
    low = np.finfo(np.float32).min
    return np.where(keep, np.float32(0.0), low).astype(np.float32)[None, None]


BASELINES = ("sdpa", "unfused")


def cases(quick: bool = False) -> list[tuple[str, int, int, int, int, int]]:
    """(name, heads, seq_q, seq_k, head_dim_qk, head_dim_v) of every case: the 12
    attention-shaped paper workloads (batch as heads; Mixer-S has seq_q != seq_k), then the
    short sequences, then decoding steps (one query), then the long sequence (`LONG`), then the
    masked cases (`MASKED`)."""
    out = [(w.name, w.batch, w.M, w.L, w.K, w.N) for w in workloads.GEMM if w.attention_shaped]
    if quick:
        out = out[1:2] + out[5:6]
    out += [(f"seq-{s}", 12, s, s, 64, 64) for s in SHORT]
    decode = DECODE[:1] if quick else DECODE
    out += [(name, heads, 1, keys, d, d) for name, heads, keys, d in decode]
    if not quick:
        out += [(name, heads, seq, seq, d, d) for name, heads, seq, d in LONG]
    masked = [(n, c) for n, c in MASKED.items() if n == "causal-1024" or not quick]
    return out + [(name, heads, seq, seq, d, d) for name, (heads, seq, d, *_) in masked]


def variant(name: str) -> str:
    """A case's variant in the report: "softmax", or its mask ("causal", "additive", "bool")."""
    if name not in MASKED:
        return "softmax"
    causal, kind = MASKED[name][3:5]
    return "causal" if causal else str(kind)


def chain_of(name: str, dtype: str = "float32") -> Chain:
    """The attention chain of a case name of `cases()`."""
    for case, heads, seq_q, seq_k, dqk, dv in cases():
        if case == name:
            causal, kind, shape = MASKED[name][3:] if name in MASKED else (False, None, None)
            return attention_chain(1, heads, seq_q, seq_k, dqk, dv, causal=causal, mask=kind,
                                   mask_shape=shape, dtype=dtype)  # fmt: skip
    raise ValueError(f"unknown attention case {name!r}; known: {[c[0] for c in cases()]}")


def useful_gflop(chain: Chain) -> float:
    """A call's work in 1e9 FLOPs: the chain's, or for a causal one the share of the scores it
    keeps (query i sees keys 0..i: `model.computed_share` with rows one at a time)."""
    return chain.flops() / 1e9 * computed_share(chain, dict.fromkeys(chain.extents, 1))


def _torch_fns(args: Sequence[Any], causal: bool = False) -> dict[str, Callable[[], object]]:
    """SDPA and unfused PyTorch on q, k, v (and a mask: `args`' fourth, if there)."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {}

    q, k, v, *rest = (a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in args)
    mask = rest[0] if rest else None
    scale = 1.0 / math.sqrt(q.shape[-1])
    # (where a boolean mask is False, or above the diagonal, the scores are filled with -inf)
    hidden = None
    if causal:
        hidden = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
    elif mask is not None and mask.dtype == torch.bool:
        hidden = ~mask

    def unfused() -> object:
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if hidden is not None:
            s = s.masked_fill(hidden, -math.inf)
        elif mask is not None:
            s = s + mask
        return torch.matmul(torch.softmax(s, -1), v)

    def sdpa() -> object:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

    return {"sdpa": sdpa, "unfused": unfused}


def _drop_in(args: Sequence[Any], causal: bool = False) -> Callable[[], object]:
    """chainfuse as a user calls it in SDPA's place: `ops.attention` on the tensors SDPA gets
    (and the mask, `args`' fourth if there), a fresh output each call (SDPA allocates one
    too), the kernel found by its sizes."""
    try:
        import torch
    except ImportError:
        qkv = list(args)
    else:
        qkv = [a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in args]
    q, k, v, *rest = qkv
    mask = rest[0] if rest else None
    return lambda: ops.attention(q, k, v, attn_mask=mask, is_causal=causal)


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
        causal = causal_softmax(chain) is not None
        inputs = reference.random_inputs(chain, seed=5)
        if name in STRUCTURED:
            inputs["mask"] = structured_mask(chain.extents["m"], STRUCTURED[name])
        qkv: list[Any] = [inputs[n] for n in ("Q", "K", "V", "mask") if n in inputs]
        if half:
            import torch

            qkv = [torch.from_numpy(a).to(torch.bool if a.dtype == np.bool_ else
                                          getattr(torch, dtype)) for a in qkv]  # fmt: skip
        want = reference.run(chain, inputs)["O"]
        baselines = _torch_fns(qkv, causal)
        for n in threads:
            set_threads(n)
            kernel = compile(chain, threads=n)  # planned for the threads it runs on
            drop_in = _drop_in(qkv, causal)
            out: Any = drop_in()
            reference.assert_close(np.asarray(out.float() if half else out), want, chain)
            fns: dict[str, Callable[[], object]] = {"chainfuse": drop_in}
            fns.update(baselines)
            facts = model_facts(chain, kernel)
            spec = kernel.spec
            timing = interleave(fns, rounds, best=n > 1)
            results.append(Result(
                suite_name(SUITE, dtype), name, variant(name), n, useful_gflop(chain),
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
    """The headline figures per thread count: the paper workloads against SDPA (geomean, min,
    how many reach 80 % of the peak) and the extra cases' minimum speedups."""
    out: dict[str, Any] = {}
    for n in sorted({r.threads for r in results}):
        mine = [r for r in results if r.threads == n and "sdpa" in r.ms]
        extra = ("seq-", "decode-", "long-")
        paper = [r for r in mine if not r.workload.startswith(extra) and r.workload not in MASKED]
        short = [r for r in mine if r.workload.startswith("seq-")]
        decode = [r for r in mine if r.workload.startswith("decode-")]
        long = [r for r in mine if r.workload.startswith("long-")]
        masked = [r for r in mine if r.workload in MASKED]
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
            "long_min_vs_sdpa": min((r.speedup("sdpa") for r in long), default=math.nan),
            "masked_min_vs_sdpa": min((r.speedup("sdpa") for r in masked), default=math.nan),
        }
    return out
