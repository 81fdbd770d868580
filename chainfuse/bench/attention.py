"""`chainfuse bench attention`: fused attention against PyTorch's SDPA and unfused PyTorch.

The 12 attention-shaped paper workloads as `softmax(Q Kᵀ / sqrt(d)) V` with 4-D inputs
[1, heads, seq, d] (so PyTorch takes its fused CPU kernel), plus short sequences (32, 64, 128;
12 heads of 64). Every result is checked against the float64 reference first; then chainfuse,
`F.scaled_dot_product_attention` and matmul-softmax-matmul are timed interleaved in one process,
medians at 1 thread and best-of at more.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.bench.gemm_chain import _call, _geomean, _time, fp32_peak_gflops, set_threads
from chainfuse.compiler import compile
from chainfuse.ir import attention_chain

__all__ = ["main"]

SHORT = (32, 64, 128)


def _cases(quick: bool) -> list[tuple[str, int, int, int]]:
    """(name, heads, seq, head_dim) of every case."""
    out = [
        (w.name, w.batch, w.M, w.K)
        for w in workloads.GEMM
        if w.attention_shaped and w.M == w.L and w.K == w.N
    ]
    if quick:
        out = out[1:2] + out[5:6]
    return out + [(f"seq-{s}", 12, s, 64) for s in SHORT]


def _torch_fns(args: Sequence[np.ndarray[Any, Any]]) -> dict[str, Callable[[], object]]:
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(a) for a in args)
    scale = 1.0 / math.sqrt(q.shape[-1])

    def unfused() -> object:
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, -1), v)

    return {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v), "unfused": unfused}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="chainfuse bench attention", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="bench-out")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    peak = fp32_peak_gflops()
    print(f"FP32 FMA peak, measured now: {peak:.1f} GFLOP/s per core")
    threads = [int(t) for t in args.threads.split(",")]
    rows: list[dict[str, Any]] = []
    for name, heads, seq, dim in _cases(args.quick):
        chain = attention_chain(1, heads, seq, seq, dim, dim)
        kernel = compile(chain)
        inputs = reference.random_inputs(chain, seed=5)
        qkv = [inputs[n] for n in ("Q", "K", "V")]
        out = np.empty(chain.outputs[0].shape, dtype=np.float32)
        kernel(*qkv, out=out)
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain)
        fns: dict[str, Callable[[], object]] = {"chainfuse": _call(kernel, qkv, out)}
        fns.update(_torch_fns(qkv))
        gflop = chain.flops() / 1e9
        for n in threads:
            set_threads(n)
            ms = _time(fns, args.rounds, best=n > 1)
            cf = ms["chainfuse"]
            row = {"case": name, "threads": n, "gflop": gflop, "ms": ms}
            rows.append(row)
            gf = gflop / (cf / 1e3)
            print(f"{name:<14} {n}t chainfuse {cf:8.3f} ms {gf:6.1f} GF/s ({gf / (peak * n):5.1%})"
                  f"  sdpa {ms['sdpa']:8.3f} ms x{ms['sdpa'] / cf:.2f}"
                  f"  unfused {ms['unfused']:8.3f} ms x{ms['unfused'] / cf:.2f}", flush=True)  # fmt: skip
    summary = {}
    for n in threads:
        paper = [r for r in rows if r["threads"] == n and not r["case"].startswith("seq-")]
        ratios = [r["ms"]["sdpa"] / r["ms"]["chainfuse"] for r in paper]
        short = [r for r in rows if r["threads"] == n and r["case"].startswith("seq-")]
        summary[f"{n}t"] = {
            "paper_geomean_vs_sdpa": _geomean(ratios),
            "paper_min_vs_sdpa": min(ratios) if ratios else math.nan,
            "short_min_vs_best_torch": min(
                (min(r["ms"]["sdpa"], r["ms"]["unfused"]) / r["ms"]["chainfuse"] for r in short),
                default=math.nan,
            ),
        }
        print(f"{n}t", json.dumps(summary[f"{n}t"]))
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "attention.json").write_text(
        json.dumps({"peak_gflops_per_core": peak, "summary": summary, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
