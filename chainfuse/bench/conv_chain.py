"""`chainfuse bench conv-chain`: the paper's eight conv chains against PyTorch (oneDNN).

For every workload (x between none / relu): compile the fused kernel, check it against the
float64 reference, then time chainfuse (channels-last input and output, zero-copy; and as
`chainfuse_nchw` on NCHW input and output, which it reads and writes through channels-last row
buffers) and PyTorch's `conv2d -> [relu] -> conv2d` in channels_last and in NCHW memory format,
interleaved in shuffled rounds in this one process. 1 thread reports medians; more threads the
best of the rounds (a shared machine only ever slows a run down). The headline speedup is over the
faster of the two PyTorch formats.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.bench.harness import predicted_ms, set_threads
from chainfuse.bench.results import Result
from chainfuse.bench.timing import interleave
from chainfuse.compiler import ConvKernel, compile_conv
from chainfuse.hardware import resolve
from chainfuse.planner import timed_plan
from chainfuse.simulate import simulate

__all__ = ["BASELINES", "SUITE", "run", "torch_baselines"]

SUITE = "conv-chain"
BASELINES = ("torch_channels_last", "torch_nchw")


def _workload(name: str) -> workloads.ConvWorkload:
    w = workloads.find(name)
    if not isinstance(w, workloads.ConvWorkload):
        raise ValueError(f"{name!r} is not a convolution workload")
    return w


def torch_baselines(
    w: workloads.ConvWorkload, between: str | None, inputs: dict[str, Any]
) -> dict[str, Callable[[], object]]:
    """PyTorch's two convolutions (oneDNN on CPU) in channels_last and in NCHW format."""
    import torch
    import torch.nn.functional as F

    x, w1, w2 = (torch.from_numpy(inputs[n]) for n in ("X", "W1", "W2"))
    cl = torch.channels_last
    formats = {
        "torch_channels_last": (x.contiguous(memory_format=cl), w1.contiguous(memory_format=cl),
                                w2.contiguous(memory_format=cl)),
        "torch_nchw": (x, w1, w2),
    }  # fmt: skip
    pads = (w.R1 // 2, w.R2 // 2)

    def make(args: tuple[Any, Any, Any]) -> Callable[[], object]:
        a, b, c = args

        def run() -> object:
            with torch.no_grad():
                y = F.conv2d(a, b, stride=w.stride1, padding=pads[0])
                if between == "relu":
                    y = torch.relu_(y)
                return F.conv2d(y, c, stride=w.stride2, padding=pads[1])

        return run

    return {name: make(args) for name, args in formats.items()}


def _chainfuse(
    kernel: ConvKernel, inputs: dict[str, Any], channels_last: bool = True
) -> tuple[Callable[[], object], Any]:
    """The fused kernel on channels-last (or NCHW) tensors, into a preallocated output of the
    same memory format."""
    import torch

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.from_numpy(inputs["X"]).contiguous(memory_format=fmt)
    w1, w2 = torch.from_numpy(inputs["W1"]), torch.from_numpy(inputs["W2"])
    out = torch.empty(kernel.chain.outputs[0].shape, dtype=torch.float32, memory_format=fmt)
    return (lambda: kernel(x, w1, w2, out=out)), out


def run(
    names: Sequence[str],
    betweens: Sequence[str | None],
    threads: Sequence[int],
    rounds: int,
) -> list[Result]:
    """Compile, check and time every (workload, between) at every thread count."""
    hw = resolve(None)
    results: list[Result] = []
    for name in names:
        w = _workload(name)
        for between in betweens:
            chain = w.chain(between)
            inputs = reference.random_inputs(chain, seed=7)
            want = reference.run(chain, inputs)["Y2"]
            baselines = torch_baselines(w, between, inputs)
            for n in threads:
                set_threads(n)
                kernel = compile_conv(chain, hw, threads=n)  # planned for the threads it runs on
                call, out = _chainfuse(kernel, inputs)
                call_nchw, out_nchw = _chainfuse(kernel, inputs, channels_last=False)
                for fn, result in ((call, out), (call_nchw, out_nchw)):
                    fn()  # checked before it is timed
                    reference.assert_close(result.numpy(), want, chain)
                fns: dict[str, Callable[[], object]] = {
                    "chainfuse": call,
                    "chainfuse_nchw": call_nchw,
                    **baselines,
                }
                _, planning_s = timed_plan(chain, hw, threads=n)
                try:
                    simulated = simulate(chain, kernel.plan, hw)
                except ValueError:  # too many blocks to walk
                    simulated = {}
                timing = interleave(fns, rounds, best=n > 1)
                results.append(Result(
                    SUITE, name, between or "none", n, chain.flops() / 1e9,
                    ms={k: t.ms for k, t in timing.items()},
                    baselines=BASELINES,
                    spread={k: t.spread for k, t in timing.items()},
                    best_ms={k: t.best_ms for k, t in timing.items()},
                    tiles=f"{kernel.tiles} halo={kernel.halo.value}",
                    predicted_ms=predicted_ms(chain, kernel.plan, n, hw),
                    predicted_bytes=dict(kernel.plan.bytes_per_level),
                    simulated_bytes=simulated,
                    planning_ms=planning_s * 1e3,
                    compile_s=kernel.compile_seconds,
                ))  # fmt: skip
    return results
