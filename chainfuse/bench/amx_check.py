"""The AMX speed lines, in one table: ``python -m chainfuse.bench.amx_check`` (``bash
scripts/amx_check.sh`` runs it with the bit-exact tests).

bf16, random operands, chainfuse's kernel and PyTorch's unfused ops timed interleaved in one
process, on 1 and 2 threads (``--threads``):

- GEMM chains on the paper's 12 attention-shaped workloads, none / relu / gelu between, against
  ``torch.bmm`` x 2 (and the activation between);
- attention on the same 12, against bf16 ``F.scaled_dot_product_attention``;
- BERT-base / ViT-base MLPs (768 -> 3072 -> 768, GELU) of 128-2048 tokens, against ``F.linear``,
  ``F.gelu``, ``F.linear``;
- the same MLPs as a model holds them (``linear-mlp``): nn.Linear's ``[out, in]`` weights and
  biases, chainfuse's with the weights packed once (``ops.pack_weights``, as the torch backend
  packs frozen weights) and packed per call, against ``F.linear`` with biases (oneDNN's);
- ResNet-50's bottleneck chains (1x1 -> relu -> 3x3, one image, channels-last) on the AMX conv
  kernel, its weights packed once (``ops.pack_conv_weights``, as the backend packs a frozen
  model's) and per call, against bf16 ``F.conv2d``, ``relu``, ``F.conv2d`` (oneDNN's).

Every chainfuse result is checked against the float64 reference first (the project's one
tolerance rule). % of peak is of the AMX probe (TDPBF16PS throughput, measured before and after
on real AMX: `bench.amx.probe_gflops`); without AMX the table says so and gives no % of peak.
The targets of the AMX kernels are printed under the table. ``--smoke``: tiny shapes, one
round, one thread, for a run through the emulation (``CHAINFUSE_AMX=emulate``) on any host:
what a test exercises.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from chainfuse import builders, reference
from chainfuse.bench import amx, workloads
from chainfuse.bench.harness import set_threads
from chainfuse.bench.results import geomean
from chainfuse.bench.timing import interleave
from chainfuse.compiler import compile, compile_conv
from chainfuse.ir import Chain
from chainfuse.kernels.amx import amx_mode, amx_status

__all__ = ["Line", "main", "run"]

#: (suite, geomean target, least ratio) of the AMX kernels against PyTorch's bf16 ops
TARGETS = {
    "gemm-chain": (2.0, 1.3),
    "attention": (3.0, 1.5),
    "mlp": (1.5, None),
    "linear-mlp": (1.3, None),
    "conv-chain": (1.0, None),
}
#: share of the AMX peak at least half of the GEMM-chain and attention cases should reach
PEAK_SHARE = 0.40
MLP_TOKENS = (128, 197, 256, 512, 577, 1024, 2048)
MLP_DIMS = (768, 3072)  # BERT-base and ViT-base: 768 -> 3072 -> 768
#: ResNet-50's bottlenecks' 1x1 -> 3x3 (input channels, width, image side), one image
RESNET_CHAINS = ((256, 64, 56), (512, 128, 28), (1024, 256, 14), (2048, 512, 7))


@dataclass(frozen=True)
class Case:
    suite: str
    workload: str
    variant: str
    chain: Chain


@dataclass(frozen=True)
class Line:
    """One row of the table."""

    suite: str
    workload: str
    variant: str
    threads: int
    path: str  # Kernel.arithmetic's path: amx-bf16, amx-bf16 (emulated), fp32-fma
    chainfuse_ms: float
    torch_ms: float
    gflop: float
    peak_share: float | None  # of the AMX probe times the threads; None without one

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.chainfuse_ms


def cases(smoke: bool) -> list[Case]:
    """The table's rows (before threads)."""
    bf16 = "bfloat16"
    if smoke:
        return [
            Case("gemm-chain", "tiny", "relu", builders.gemm_chain(2, 40, 32, 48, 72, "relu", bf16)),
            Case("attention", "tiny", "softmax",
                 builders.attention_chain(1, 2, 40, 40, 32, 32, dtype=bf16)),
            Case("mlp", "tiny-33", "gelu", builders.gemm_chain(1, 33, 64, 64, 128, "gelu", bf16)),
            Case("linear-mlp", "tiny-33", "packed", _linear_mlp(33, 64, 128)),
            Case("conv-chain", "tiny-9", "packed", _bottleneck(40, 24, 9)),
        ]  # fmt: skip
    shaped = [w for w in workloads.GEMM if w.attention_shaped]
    out = [
        Case("gemm-chain", w.name, between, w.chain(between, bf16))
        for w in shaped
        for between in ("none", "relu", "gelu")
    ]
    out += [
        Case("attention", w.name, "softmax",
             builders.attention_chain(1, w.batch, w.M, w.L, w.K, w.N, dtype=bf16))
        for w in shaped
    ]  # fmt: skip
    dim, hidden = MLP_DIMS
    out += [
        Case("mlp", f"bert-vit-base-{t}", "gelu",
             builders.gemm_chain(1, t, dim, dim, hidden, "gelu", bf16))
        for t in MLP_TOKENS
    ]  # fmt: skip
    out += [
        Case("linear-mlp", f"bert-vit-base-{t}", variant, _linear_mlp(t, dim, hidden))
        for t in MLP_TOKENS
        for variant in ("packed", "per-call")
    ]
    out += [
        Case("conv-chain", f"resnet50-{side}x{side}", variant, _bottleneck(c, width, side))
        for c, width, side in RESNET_CHAINS
        for variant in ("packed", "per-call")
    ]
    return out


def _bottleneck(channels: int, width: int, side: int) -> Chain:
    """A ResNet bottleneck's 1x1 -> relu -> 3x3 (padding 1) on one bf16 image."""
    return builders.conv_chain_spec(1, channels, side, side, width, 1, 1, width, 3, 3,
                                    padding=(0, 1), between="relu", dtype="bfloat16")  # fmt: skip


def _linear_mlp(tokens: int, dim: int, hidden: int) -> Chain:
    """`F.linear(gelu(F.linear(x, W1, b1)), W2, b2)` as a chain: weights stored `[out, in]`."""
    return builders.gemm_chain(1, tokens, dim, dim, hidden, "gelu", "bfloat16", b_transposed=True,
                               d_transposed=True, bias1=True, bias2=True)  # fmt: skip


def _torch_fn(case: Case, args: Sequence[Any]) -> Callable[[], Any]:
    """PyTorch's unfused bf16 ops for the case."""
    import torch

    F = torch.nn.functional
    if case.suite == "attention":
        q, k, v = args
        return lambda: F.scaled_dot_product_attention(q, k, v)
    if case.suite == "linear-mlp":
        x, w1, w2, b1, b2 = args  # (x [1, M, K], W1 [1, L, K], W2 [1, N, L]: as stored)
        W1, W2 = w1[0], w2[0]
        return lambda: F.linear(F.gelu(F.linear(x[0], W1, b1)), W2, b2)
    if case.suite == "conv-chain":
        x, w1, w2 = args
        return lambda: F.conv2d(torch.relu(F.conv2d(x, w1)), w2, padding=1)
    if case.suite == "mlp":
        x, w1, w2 = args
        W1, W2 = w1[0].t().contiguous(), w2[0].t().contiguous()  # (nn.Linear's weights)
        return lambda: F.linear(F.gelu(F.linear(x[0], W1)), W2)
    A, B, D = args
    act = {"none": lambda t: t, "relu": torch.relu, "gelu": F.gelu}[case.variant]
    return lambda: torch.bmm(act(torch.bmm(A, B)), D)


def _linear_mlp_fn(case: Case, args: Sequence[Any]) -> Callable[[], Any]:
    """chainfuse's call of a model's MLP (`ops.gemm_chain` on the weights' `.T` views), the
    weights packed once (variant "packed") or per call ("per-call")."""
    from chainfuse import ops

    x, w1, w2, b1, b2 = args
    B, D = w1[0].t(), w2[0].t()
    packed = ops.pack_weights(B, D) if case.variant == "packed" else None
    return lambda: ops.gemm_chain(x[0], B, D, "gelu", bias1=b1, bias2=b2, packed=packed)


def _conv_fn(case: Case, args: Sequence[Any]) -> Callable[[], Any]:
    """chainfuse's conv chain on the images and weights, the weights packed once (variant
    "packed") or per call ("per-call")."""
    from chainfuse import ops

    x, w1, w2 = args
    packed = None
    if case.variant == "packed":
        packed = ops.pack_conv_weights(x, w1, w2, padding=(0, 1), between="relu")
    return lambda: ops.conv_chain(x, w1, w2, padding=(0, 1), between="relu", packed=packed)


def _line(case: Case, threads: int, rounds: int, peak: float | None) -> Line:
    import torch

    set_threads(threads)
    chain = case.chain
    inputs = reference.random_inputs(chain, seed=0)
    args = [torch.from_numpy(inputs[t.name]).to(torch.bfloat16) for t in chain.inputs]
    conv = case.suite == "conv-chain"
    if conv:  # (channels-last images: what a compiled conv net runs)
        args[0] = args[0].contiguous(memory_format=torch.channels_last)
    kernel = compile_conv(chain, threads=threads) if conv else compile(chain, threads=threads)
    ours: Callable[[], Any] = lambda: kernel(*args)  # noqa: E731
    if case.suite == "linear-mlp":
        ours = _linear_mlp_fn(case, args)
    elif conv:
        ours = _conv_fn(case, args)
    got = ours()
    widened = {t.name: a.float().numpy().astype(np.float64) for t, a in zip(chain.inputs, args, strict=True)}  # fmt: skip
    if conv:
        want = reference.run_conv_chain(chain, widened)
    else:
        want = reference.run(chain, widened)[chain.outputs[0].name]
    reference.assert_close(got.float().numpy().reshape(want.shape), want, chain)
    timing = interleave({"chainfuse": ours, "torch": _torch_fn(case, args)}, rounds,
                        best=threads > 1)  # fmt: skip
    gflop = _flops(chain) / 1e9
    ms = timing["chainfuse"].ms
    share = None if peak is None else gflop / (ms / 1e3) / (peak * threads)
    path = kernel.arithmetic.split(":")[0]
    return Line(case.suite, case.workload, case.variant, threads, path, ms,
                timing["torch"].ms, gflop, share)  # fmt: skip


def _flops(chain: Chain) -> int:
    """Useful flops: 2 per multiply-add of each contraction."""
    ext = chain.extents
    return sum(2 * math.prod(ext[n] for n in op.loops) for op in chain.contractions)


def run(threads: Sequence[int], rounds: int, smoke: bool) -> tuple[list[Line], dict[str, Any]]:
    """Every case on every thread count, and the run's facts (probes, AMX state)."""
    usable, why = amx_status()
    facts: dict[str, Any] = {"amx": why if usable else f"no AMX: {why}", "mode": amx_mode().value}
    before = amx.probe_gflops() if usable else None
    lines = [_line(c, n, rounds, before) for n in threads for c in cases(smoke)]
    if before is not None:
        after = amx.probe_gflops()
        facts["amx_probe_gflops"] = {"before": before, "after": after}
        peak = max(before, after or 0.0)  # the better probe: a busy moment lowers one
        lines = [
            Line(**{**asdict(x), "peak_share": x.gflop / (x.chainfuse_ms / 1e3) / (peak * x.threads)})
            for x in lines
        ]  # fmt: skip
    return lines, facts


def table(lines: Sequence[Line], facts: dict[str, Any]) -> str:
    """The table and the summary against the targets."""
    head = ("suite", "workload", "variant", "thr", "path", "chainfuse ms", "torch ms", "speedup",
            "GFLOP/s", "% AMX peak")  # fmt: skip
    rows = [head]
    for x in lines:
        gflops = x.gflop / (x.chainfuse_ms / 1e3)
        share = "no AMX" if x.peak_share is None else f"{x.peak_share:.0%}"
        rows.append((x.suite, x.workload, x.variant, str(x.threads), x.path,
                     f"{x.chainfuse_ms:.3f}", f"{x.torch_ms:.3f}", f"{x.speedup:.2f}x",
                     f"{gflops:.1f}", share))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    out = [f"AMX: {facts['amx']}; CHAINFUSE_AMX={facts['mode']}"]
    if "amx_probe_gflops" in facts:
        p = facts["amx_probe_gflops"]
        out.append(f"AMX probe, GFLOP/s per core: before {p['before']:.1f}, after {p['after']:.1f}")
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    out.append("")
    for suite in dict.fromkeys(x.suite for x in lines):
        for n in sorted({x.threads for x in lines if x.suite == suite}):
            sel = [x for x in lines if x.suite == suite and x.threads == n]
            ratios = [x.speedup for x in sel]
            target, least = TARGETS[suite]
            text = (f"{suite:<10} {n}t: geomean {geomean(ratios):.2f}x (target >= {target}x), "
                    f"min {min(ratios):.2f}x" + (f" (target >= {least}x)" if least else ""))  # fmt: skip
            shares = [x.peak_share for x in sel if x.peak_share is not None]
            if shares and suite not in ("mlp", "linear-mlp"):
                hit = sum(s >= PEAK_SHARE for s in shares)
                text += f"; {hit} of {len(sel)} at >= {PEAK_SHARE:.0%} of the AMX peak"
            out.append(text)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chainfuse.bench.amx_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    parser.add_argument("--rounds", type=int, default=15, help="timing rounds per case")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, 1 round, 1 thread")
    parser.add_argument("--out", type=Path, help="also write the lines as JSON here")
    args = parser.parse_args(argv)
    try:
        threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        parser.error(f"--threads: expected integers like 1,2, got {args.threads!r}")
    if args.rounds < 1 or min(threads) < 1:
        parser.error("--rounds and --threads must be positive")
    if args.smoke:
        threads, rounds = [1], 1
    else:
        rounds = args.rounds
    lines, facts = run(threads, rounds, args.smoke)
    print(table(lines, facts))
    if args.smoke or not amx_status()[0]:
        print("(no AMX unit measured: the timings above are not the AMX speed lines)")
    if args.out is not None:
        args.out.write_text(json.dumps({**facts, "lines": [asdict(x) for x in lines]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
