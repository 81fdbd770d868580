"""The main job: plan, compile and run a paper workload on this CPU, check it, time it.

    python -m chainfuse.bench.demo [WORKLOAD] [--between none,relu,softmax] [--repeat 20]

For each `between`, it prints the plan, checks the fused kernel against the float64 reference,
then times it against PyTorch (two `bmm`s into preallocated outputs, the activation in place)
and numpy (`matmul`), interleaved in shuffled rounds in this one process, everyone on 1 thread,
and prints the medians and the speedups.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

import numpy as np

from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.bench.gemm_chain import numpy_baseline, torch_baselines
from chainfuse.bench.harness import set_threads
from chainfuse.bench.probe import fp32_peak_gflops
from chainfuse.bench.timing import interleave
from chainfuse.compiler import compile
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain

__all__ = ["main"]

_PEAK: list[float] = []  # GFLOP/s of one core, measured once per run


def run_one(chain: Chain, between: str | None, repeat: int) -> dict[str, float]:
    kernel = compile(chain, threads=1)
    print(kernel.plan)
    print(kernel.describe())
    print(
        f"  compiled {kernel.spec.name} in {kernel.compile_seconds:.2f} s"
        f" ({'from the cache' if kernel.cached else 'cold'})"
    )
    inputs = reference.random_inputs(chain, seed=1)
    names = [t.name for t in chain.inputs]
    args = [inputs[n] for n in names]
    out = np.empty(chain.outputs[0].shape, dtype=np.float32)
    kernel(*args, out=out)
    expected = reference.run(chain, inputs)[chain.outputs[0].name]
    reference.assert_close(out, expected, chain)
    print("  result matches the float64 reference (chainfuse.reference.tolerance)")
    fns: dict[str, Callable[[], object]] = {"chainfuse": lambda: kernel(*args, out=out)}
    torch_fns = torch_baselines(between, args)
    if "torch_prealloc" in torch_fns:
        fns["torch"] = torch_fns["torch_prealloc"]
    np_fn = numpy_baseline(between, args)
    if np_fn is not None:
        fns["numpy"] = np_fn
    times = {name: t.ms / 1e3 for name, t in interleave(fns, repeat, budget_s=math.inf).items()}
    flops = chain.flops()
    peak = _PEAK[0] * 1e9
    for name, t in times.items():
        speed = (
            f"  x{times[name] / times['chainfuse']:.2f} chainfuse's speedup"
            if name != "chainfuse"
            else ""
        )
        print(f"  {name:<10} {t * 1e3:8.3f} ms  {flops / t / 1e9:7.1f} GFLOP/s"
              f"  {flops / t / peak:6.1%} of the measured peak{speed}")  # fmt: skip
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chainfuse.bench.demo", description=__doc__)
    parser.add_argument("workload", nargs="?", default="bert-base",
                        choices=[w.name for w in workloads.GEMM])  # fmt: skip
    parser.add_argument("--between", default="none,relu,softmax")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    set_threads(1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    print(Hardware.detect())
    print(
        f"load average {load:.2f}"
        + ("  (busy machine: timings will be noisy)" if load > 0.5 else "")
    )
    _PEAK[:] = [fp32_peak_gflops()]
    print(f"FP32 FMA peak of one core, measured now by a probe: {_PEAK[0]:.1f} GFLOP/s")
    for word in args.between.split(","):
        between = None if word == "none" else word
        chain = workloads.chain_of(args.workload, between)
        print()
        run_one(chain, between, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
