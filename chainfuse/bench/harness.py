"""What every benchmark suite shares: one thread count for every contender, and what the model
predicted for a compiled kernel."""

from __future__ import annotations

from typing import Any

from chainfuse.hardware import Hardware, resolve
from chainfuse.model import Nest, estimate
from chainfuse.planner import timed_plan
from chainfuse.runtime import set_num_threads
from chainfuse.simulate import simulate

__all__ = ["model_facts", "predicted_ms", "set_threads"]


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


def model_facts(chain: Any, kernel: Any, hw: Hardware | None = None) -> dict[str, Any]:
    """What the model said about a compiled kernel, for `Result`: bytes per level, the
    simulator's bytes for the same plan, and the time a full planning run takes."""
    hw = hw or resolve(None)
    _, seconds = timed_plan(chain, hw, threads=kernel.plan.threads)
    try:
        simulated = simulate(chain, kernel.plan, hw)
    except ValueError:  # too many blocks to walk
        simulated = {}
    return {
        "predicted_bytes": dict(kernel.plan.bytes_per_level),
        "simulated_bytes": simulated,
        "planning_ms": seconds * 1e3,
        "compile_s": kernel.compile_seconds,
    }


def predicted_ms(chain: Any, plan: Any, threads: int, hw: Hardware | None = None) -> float:
    """The model's time for `plan` run on `threads` cores (plans are made for all cores)."""
    hw = hw or resolve(None)
    nest = Nest(chain, plan.order, plan.depth, fused=plan.fused)
    tiles = {level: dict(t) for level, t in plan.tiles}
    return estimate(nest, tiles, hw, plan.parallel, threads, plan.split).time_s * 1e3
