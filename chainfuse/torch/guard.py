"""Inductor as the measure of a rewrite: what the user gets without chainfuse.

`compile_graph` compiles a graph as the backend compiles its final graph (`compile_fx`, freezing
as set); `isolated=True` compiles it apart from the Dynamo compile it is called from (its own
tracing context and fake mode), for a graph that is only timed: a chain's unfused nodes, whose
example inputs are real values. `check_graph` is the whole-graph check: the rewritten graph
and the plain one, both compiled by Inductor, timed alternately on the example inputs (`paired`:
the median of the rounds' ratios); the rewritten one is kept unless it is measured slower by
more than `GRAPH_TOLERANCE` (so that a chain's gain lost around it, an epilogue Inductor no
longer fuses across the custom operator, never makes the model slower). Each fused chain has
already been measured at least as fast as Inductor's code for its nodes (`MARGIN`); asking the
whole graph for a margin of a few per cent threw away measured gains (whole calls vary by more
than the few per cent a model's chains save; see docs/performance.md). The answer is kept on
disk as the chains' decisions are.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.fx as fx

from chainfuse.torch.decide import paired, recall, remember

__all__ = ["GraphCheck", "check_graph", "compile_graph", "describe", "plain_copy"]

#: the time the whole-graph check spends timing (at least `GRAPH_ROUNDS` calls of each graph)
GRAPH_BUDGET_S = 4.0
GRAPH_ROUNDS = 5
#: how much slower the rewritten graph may measure and be kept: the noise of whole calls on a
#: shared host (its chains each measured faster; the plain graph is kept past this)
GRAPH_TOLERANCE = 0.02


@dataclass(frozen=True)
class GraphCheck:
    """The whole-graph check of one graph: which graph was kept and the measured times."""

    graph: int
    kept_rewritten: bool
    why: str
    rewritten_s: float | None = None
    plain_s: float | None = None
    cached: bool = False


def compile_graph(
    gm: fx.GraphModule, inputs: Sequence[Any], freeze: bool, isolated: bool = False
) -> Callable[..., Any]:
    """`gm` compiled by Inductor (`compile_fx`) with its freezing set to `freeze`; `isolated`:
    in a tracing context of its own (from the real `inputs`), apart from Dynamo's."""
    from torch._inductor.compile_fx import compile_fx

    with contextlib.ExitStack() as stack:
        if isolated:
            stack.enter_context(torch._guards.tracing(None))
        stack.enter_context(torch._inductor.config.patch(freezing=freeze))
        compiled: Callable[..., Any] = compile_fx(gm, list(inputs))  # type: ignore[assignment]
    return compiled


def plain_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose graph a rewrite of `gm` leaves as it is; the tensors (weights,
    constants) are shared, not copied."""
    tensors = itertools.chain(gm.parameters(), gm.buffers(),
                              (v for v in vars(gm).values() if isinstance(v, torch.Tensor)))  # fmt: skip
    memo: dict[int, Any] = {id(t): t for t in tensors}
    return copy.deepcopy(gm, memo)


def describe(value: Any) -> Any:
    """What a decision depends on of an input: a tensor's shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), list(value.stride()), str(value.dtype)]
    return repr(value)


def check_graph(
    number: int,
    key_parts: Sequence[Any],
    rewritten: Callable[[], Callable[..., Any]],
    plain: Callable[[], Callable[..., Any]],
    inputs: Sequence[Any],
) -> tuple[Callable[..., Any], GraphCheck]:
    """The rewritten graph, or the plain one where the rewritten one measures slower by more
    than `GRAPH_TOLERANCE`; and the check that chose it.

    `rewritten` and `plain` compile each graph (called only where needed: a recalled answer
    compiles the kept graph alone); `inputs` are real values both are timed on."""
    parts = ["graph", *key_parts]
    found = recall(parts)
    if found is not None:
        try:
            check = GraphCheck(**{**found, "graph": number, "cached": True})
        except TypeError:
            check = None  # a record of another layout: decide again
        if check is not None:
            return (rewritten if check.kept_rewritten else plain)(), check
    fused = rewritten()
    try:
        unfused = plain()
    except Exception as exc:  # (any failure of Inductor's: reported in the check)
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        why = f"the plain graph failed to compile ({type(exc).__name__}: {reason}): not checked"
        return fused, GraphCheck(number, True, why)

    def call(fn: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return fn(*inputs)

        return run

    r, p = paired(call(fused), call(unfused), budget_s=GRAPH_BUDGET_S, rounds=GRAPH_ROUNDS)
    kept = r <= p * (1 + GRAPH_TOLERANCE)
    why = (f"the rewritten graph {p / r:.2f}x as fast as Inductor's code for the plain graph"
           + ("" if kept else ": the plain graph kept"))  # fmt: skip
    check = GraphCheck(number, kept, why, r, p)
    record = asdict(check)
    record.pop("cached")
    remember(parts, record)
    return (fused if kept else unfused), check
