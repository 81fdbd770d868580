"""`chainfuse bench gemm-chain`: the paper's GEMM chains against PyTorch and numpy.

For every workload (x between none / relu): compile, check against the float64 reference, then
time chainfuse, `torch.bmm` twice into preallocated outputs, `torch.bmm` with fresh outputs and
numpy, interleaved round-robin in this one process. 1 thread reports medians; more threads report
the best of the rounds (a shared machine only ever slows a run down). Each figure is also given as
a fraction of the FP32 FMA peak measured by a probe in the same run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.compiler import compile
from chainfuse.runtime import set_num_threads

__all__ = ["Row", "main", "numpy_baseline", "run", "set_threads", "torch_baselines"]

QUICK = ("bert-base", "vit-huge-14", "mixer-l-32-s", "mixer-b-32-c")


@dataclass
class Row:
    """One workload at one thread count: milliseconds per implementation, and derived figures."""

    workload: str
    between: str
    threads: int
    gflop: float
    ms: dict[str, float] = field(default_factory=dict)
    tiles: str = ""

    def speedup(self, baseline: str) -> float:
        return self.ms[baseline] / self.ms["chainfuse"]


def torch_baselines(
    between: str | None, args: Sequence[np.ndarray[Any, Any]]
) -> dict[str, Callable[[], object]]:
    try:
        import torch
    except ImportError:
        return {}
    A, B, D = (torch.from_numpy(a) for a in args)
    b, M, _ = A.shape
    C = torch.empty(b, M, B.shape[2])
    E = torch.empty(b, M, D.shape[2])

    def act(x: Any) -> Any:
        if between == "relu":
            return torch.relu_(x)
        if between == "gelu":
            return x.copy_(torch.nn.functional.gelu(x))
        if between == "softmax":
            return torch.softmax(x, dim=-1, out=x)
        return x

    def prealloc() -> object:
        torch.bmm(A, B, out=C)
        act(C)
        return torch.bmm(C, D, out=E)

    def fresh() -> object:
        return torch.bmm(act(torch.bmm(A, B)), D)

    return {"torch_prealloc": prealloc, "torch": fresh}


def numpy_baseline(
    between: str | None, args: Sequence[np.ndarray[Any, Any]]
) -> Callable[[], object] | None:
    """numpy's `matmul` twice with the op between; None for gelu (numpy has no erf)."""
    if between == "gelu":
        return None
    A, B, D = args

    def run() -> object:
        C = A @ B
        if between == "relu":
            np.maximum(C, 0, out=C)
        elif between == "softmax":
            C -= C.max(axis=-1, keepdims=True)
            np.exp(C, out=C)
            C /= C.sum(axis=-1, keepdims=True)
        return C @ D

    return run


def _call(kernel: Any, args: Sequence[Any], out: Any) -> Callable[[], object]:
    return lambda: kernel(*args, out=out)


def set_threads(n: int) -> None:
    """The same thread count for everyone: chainfuse, PyTorch and numpy's BLAS.

    numpy's BLAS would otherwise use every core in a "1 thread" row, and its idle workers spin
    between calls, taking a core from whatever is timed next.
    """
    set_num_threads(n)
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        print("note: threadpoolctl is not installed; numpy's BLAS uses its default threads")
        return
    threadpool_limits(limits=n, user_api="blas")


def _time(fns: dict[str, Callable[[], object]], rounds: int, best: bool) -> dict[str, float]:
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    deadline = time.perf_counter() + 20.0
    for r in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        if r >= 2 and time.perf_counter() > deadline:
            break
    pick = min if best else statistics.median
    return {k: pick(v) * 1e3 for k, v in samples.items()}


def fp32_peak_gflops() -> float:
    """This core's FP32 FMA peak, measured now by a probe (12 independent FMA chains)."""
    from chainfuse.bench.microkernel import measure

    return measure(seconds=0.05, repeat=5).probe_gflops


def compile_times() -> dict[str, float]:
    """Cold compile (empty cache) and warm first call (cached, in a new process), seconds."""
    with tempfile.TemporaryDirectory(prefix="chainfuse-bench-") as tmp:
        env = {**os.environ, "CHAINFUSE_CACHE_DIR": tmp}
        code = (
            "import time, numpy as np\n"
            "t0 = time.perf_counter()\n"
            "import chainfuse\n"
            "from chainfuse import reference\n"
            "c = chainfuse.gemm_chain(12, 512, 64, 64, 512, 'relu')\n"
            "x = reference.random_inputs(c)\n"
            "t1 = time.perf_counter()\n"
            "k = chainfuse.compile(c)\n"
            "t2 = time.perf_counter()\n"
            "k(x['A'], x['B'], x['D'])\n"
            "t3 = time.perf_counter()\n"
            "print(t2 - t1, t3 - t1, k.cached)\n"
        )
        cold = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout.split()  # fmt: skip
        warm = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout.split()  # fmt: skip
    return {
        "cold_compile_s": float(cold[0]),
        "warm_first_call_s": float(warm[1]),
        "warm_was_cached": float(warm[2] == "True"),
    }


def run(
    names: Sequence[str], betweens: Sequence[str | None], threads: Sequence[int], rounds: int
) -> list[Row]:
    rows: list[Row] = []
    for name in names:
        for between in betweens:
            chain = workloads.chain_of(name, between)
            kernel = compile(chain)
            inputs = reference.random_inputs(chain, seed=7)
            args = [inputs[t.name] for t in chain.inputs]
            out = np.empty(chain.outputs[0].shape, dtype=np.float32)
            kernel(*args, out=out)
            reference.assert_close(out, reference.run(chain, inputs)["E"], chain)
            fns: dict[str, Callable[[], object]] = {"chainfuse": _call(kernel, args, out)}
            fns.update(torch_baselines(between, args))
            np_fn = numpy_baseline(between, args)
            if np_fn is not None:
                fns["numpy"] = np_fn
            spec = kernel.spec
            for n in threads:
                set_threads(n)
                row = Row(name, between or "none", n, chain.flops() / 1e9,
                          tiles=f"{spec.T_M}/{spec.T_L}/{spec.T_K}/{spec.T_N}")  # fmt: skip
                row.ms = _time(fns, rounds, best=n > 1)
                rows.append(row)
                _print_row(row)
    return rows


_PEAK: list[float] = []


def _print_row(row: Row) -> None:
    cf = row.ms["chainfuse"]
    gf = row.gflop / (cf / 1e3)
    peak = _PEAK[0] * row.threads if _PEAK else math.nan
    parts = [f"{row.workload:<14} {row.between:<8} {row.threads}t  chainfuse {cf:8.3f} ms "
             f"{gf:6.1f} GF/s ({gf / peak:5.1%} of peak)"]  # fmt: skip
    for base in ("torch_prealloc", "torch", "numpy"):
        if base in row.ms:
            parts.append(f"{base} {row.ms[base]:8.3f} ms x{row.speedup(base):.2f}")
    print("  ".join(parts), flush=True)


def summarise(rows: Sequence[Row]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in sorted({r.threads for r in rows}):
        sel = [r for r in rows if r.threads == n and "torch_prealloc" in r.ms]
        if not sel:
            continue
        att = [r for r in sel if workloads.find(r.workload).attention_shaped]  # type: ignore[union-attr]
        mlp = [r for r in sel if r not in att]
        ratios = [r.speedup("torch_prealloc") for r in att]
        peak = _PEAK[0] * n if _PEAK else math.nan
        out[f"{n}t"] = {
            "attention_shaped_geomean_vs_torch_prealloc": _geomean(ratios),
            "attention_shaped_min_vs_torch_prealloc": min(ratios) if ratios else math.nan,
            "attention_shaped_at_or_above_85pct_peak": sum(
                r.gflop / (r.ms["chainfuse"] / 1e3) >= 0.85 * peak for r in att
            ),
            "attention_shaped_count": len(att),
            "mlp_min_vs_torch_prealloc": min(
                (r.speedup("torch_prealloc") for r in mlp), default=math.nan
            ),
        }
    return out


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="chainfuse bench gemm-chain", description=__doc__)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--between", default="none,relu")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default="bench-out", help="directory for gemm_chain.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f}: another job is running; figures will be low")
    _PEAK[:] = [fp32_peak_gflops()]
    print(f"FP32 FMA peak, measured now: {_PEAK[0]:.1f} GFLOP/s per core")
    times = compile_times()
    print(f"cold compile {times['cold_compile_s']:.2f} s; warm first call (new process, cached)"
          f" {times['warm_first_call_s'] * 1e3:.1f} ms")  # fmt: skip
    names = QUICK if args.quick else tuple(w.name for w in workloads.GEMM)
    betweens = [None if b == "none" else b for b in args.between.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    rows = run(names, betweens, threads, args.rounds)
    summary = summarise(rows)
    for key, value in summary.items():
        print(key, json.dumps(value))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_chain.json").write_text(json.dumps(
        {"peak_gflops_per_core": _PEAK[0], "compile": times, "summary": summary,
         "rows": [asdict(r) for r in rows]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
