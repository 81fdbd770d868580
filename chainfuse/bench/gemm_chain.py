"""`chainfuse bench gemm-chain`: the paper's GEMM chains against PyTorch and numpy.

For every workload (x between none / relu): compile, check against the float64 reference, then
time chainfuse, `torch.bmm` twice into preallocated outputs, `torch.bmm` with fresh outputs and
numpy, interleaved in shuffled rounds in this one process. 1 thread reports medians; more threads
report the best of the rounds (a shared machine only ever slows a run down). Each figure is also
given as a fraction of the FP32 FMA peak measured by a probe in the same run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.bench.harness import model_facts, predicted_ms, set_threads
from chainfuse.bench.results import HALF_SUFFIX, Result, geomean, suite_name
from chainfuse.bench.timing import interleave
from chainfuse.compiler import compile

__all__ = [
    "compile_times",
    "numpy_baseline",
    "run",
    "summarise",
    "torch_baselines",
]

SUITE = "gemm-chain"
QUICK = ("bert-base", "vit-huge-14", "mixer-l-32-s", "mixer-b-32-c")
BASELINES = ("torch_prealloc", "torch", "numpy")


def torch_baselines(between: str | None, args: Sequence[Any]) -> dict[str, Callable[[], object]]:
    """PyTorch's two `bmm`s (into preallocated outputs, and fresh), in the arguments' dtype:
    numpy arrays are float32, torch tensors keep theirs (bf16 runs PyTorch's bf16 path)."""
    try:
        import torch
    except ImportError:
        return {}
    A, B, D = (a if isinstance(a, torch.Tensor) else torch.from_numpy(a) for a in args)
    b, M, _ = A.shape
    C = torch.empty(b, M, B.shape[2], dtype=A.dtype)
    E = torch.empty(b, M, D.shape[2], dtype=A.dtype)

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


def compile_times() -> dict[str, float]:
    """Cold compile (empty cache) and warm first call (cached, in a new process), seconds; and
    the same process's second call, so that chainfuse's part of the first call (planning looked
    up, the object found and loaded) reads apart from the kernel's own arithmetic."""
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
            "k(x['A'], x['B'], x['D'])\n"
            "t4 = time.perf_counter()\n"
            "print(t2 - t1, t3 - t1, k.cached, t4 - t3)\n"
        )
        runs = []
        for _ in ("cold", "warm"):
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                  text=True, check=False)  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"compile-time probe failed:\n{done.stderr[-2000:]}")
            runs.append(done.stdout.split())
        cold, warm = runs
    return {
        "cold_compile_s": float(cold[0]),
        "warm_first_call_s": float(warm[1]),
        "warm_was_cached": float(warm[2] == "True"),
        "warm_second_call_s": float(warm[3]),
    }


def tiles_text(kernel: Any) -> str:
    spec = kernel.spec
    return f"T_M={spec.T_M} T_L={spec.T_L} T_K={spec.T_K} T_N={spec.T_N}"


def run(
    names: Sequence[str],
    betweens: Sequence[str | None],
    threads: Sequence[int],
    rounds: int,
    progress: Callable[[str], None] | None = None,
    dtype: str = "float32",
) -> list[Result]:
    """Compile, check and time every (workload, between) at every thread count.

    `dtype="bfloat16"` or `"float16"`: 16-bit tensors in and out for chainfuse and PyTorch alike
    (no numpy baseline: numpy has no bf16, and its float16 matmul no BLAS); the results' suite is
    "gemm-chain-bf16" / "-fp16".
    """
    half = dtype in HALF_SUFFIX
    results: list[Result] = []
    for name in names:
        for between in betweens:
            chain = workloads.chain_of(name, between, dtype)
            inputs = reference.random_inputs(chain, seed=7)
            args: list[Any] = [inputs[t.name] for t in chain.inputs]
            if half:
                import torch

                args = [torch.from_numpy(a).to(getattr(torch, dtype)) for a in args]
            want = reference.run(chain, inputs)["E"]
            baselines = dict(torch_baselines(between, args))
            np_fn = None if half else numpy_baseline(between, args)
            if np_fn is not None:
                baselines["numpy"] = np_fn
            for n in threads:
                set_threads(n)
                kernel = compile(chain, threads=n)  # planned for the threads it runs on
                out = kernel(*args)
                got = out.float().numpy() if half else out
                reference.assert_close(got, want, chain)
                fns = {"chainfuse": _call(kernel, args, out), **baselines}
                if n > 1:
                    # numpy's OpenBLAS workers spin for a while after each call and take the
                    # other core from whatever is timed next: numpy is a 1-thread baseline only
                    fns.pop("numpy", None)
                facts = model_facts(chain, kernel)
                timing = interleave(fns, rounds, best=n > 1)
                results.append(Result(
                    suite_name(SUITE, dtype), name, between or "none", n,
                    chain.flops() / 1e9, ms={k: t.ms for k, t in timing.items()},
                    baselines=BASELINES,
                    spread={k: t.spread for k, t in timing.items()},
                    best_ms={k: t.best_ms for k, t in timing.items()}, dtype=dtype,
                    tiles=tiles_text(kernel), predicted_ms=predicted_ms(chain, kernel.plan, n),
                    **facts,
                ))  # fmt: skip
                if progress is not None:
                    progress(f"{name} {between or 'none'} {n}t {dtype}")
    return results


def summarise(results: Sequence[Result], peak: float) -> dict[str, Any]:
    """The headline figures per thread count: the attention-shaped workloads against PyTorch
    (geomean, min, how many reach 85 % of the peak) and the MLPs' minimum speedup."""
    out: dict[str, Any] = {}
    for n in sorted({r.threads for r in results}):
        sel = [r for r in results if r.threads == n and "torch_prealloc" in r.ms]
        if not sel:
            continue
        att = [r for r in sel if workloads.find(r.workload).attention_shaped]  # type: ignore[union-attr]
        mlp = [r for r in sel if r not in att]
        ratios = [r.speedup("torch_prealloc") for r in att]
        out[f"{n}t"] = {
            "attention_shaped_geomean_vs_torch_prealloc": geomean(ratios),
            "attention_shaped_min_vs_torch_prealloc": min(ratios) if ratios else math.nan,
            "attention_shaped_at_or_above_85pct_peak": sum(
                r.gflops() >= 0.85 * peak * n for r in att
            ),
            "attention_shaped_at_or_above_85pct_peak_fastest_call": sum(
                r.best_gflops() >= 0.85 * peak * n for r in att
            ),
            "attention_shaped_count": len(att),
            "mlp_min_vs_torch_prealloc": min(
                (r.speedup("torch_prealloc") for r in mlp), default=math.nan
            ),
        }
    return out
