"""Which of several costed plans to run: the fastest, unless others tie with it on time.

The model's time is `max(compute, memory)`, so plans bound by compute tie on it however much
they move; among those the one moving fewer bytes from the outermost level leaves the most
bandwidth to whatever else runs (other threads, other processes, a faster dtype) and is the one
to keep. Times within `TIE` of the fastest are ties (docs/tuning.md#tie):

    chosen = min over { c : time(c) <= (1 + TIE) * fastest } of
             (bytes from the outermost level, bytes from the next level in, ..., time)

Fusion adds one rule (docs/design.md, "Fuse or not"): a fused plan that moves more bytes from
the outermost level than the unfused execution (which writes each intermediate there and reads
it back) is a candidate only if it is predicted faster than it by more than `TIE`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from chainfuse.model.time import Cost

__all__ = ["TIE", "choose", "faster", "traffic"]

#: Relative difference of predicted times below which two plans tie and traffic decides
#: (docs/tuning.md).
TIE = 0.02

_T = TypeVar("_T")


def traffic(cost: Cost) -> tuple[int, ...]:
    """Bytes read from each level, outermost first: the order ties are broken in."""
    return tuple(b for _, b in reversed(cost.bytes_per_level))


def faster(a: Cost, b: Cost) -> bool:
    """Whether `a` is predicted faster than `b` by more than `TIE`."""
    return a.time_s * (1 + TIE) < b.time_s


def choose(
    fused: Sequence[tuple[Cost, _T]], unfused: tuple[Cost, _T] | None = None
) -> tuple[Cost, _T]:
    """The plan to run among costed `fused` candidates and the `unfused` execution (either may
    be empty): the least traffic among the times that tie with the fastest (module docstring)."""
    pool = list(fused)
    if unfused is not None:
        limit = traffic(unfused[0])[:1]
        pool = [c for c in pool if traffic(c[0])[:1] <= limit or faster(c[0], unfused[0])]
        pool.append(unfused)
    if not pool:
        raise ValueError("choose: no candidates")
    fastest = min(c[0].time_s for c in pool)
    tied = [c for c in pool if c[0].time_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda c: (traffic(c[0]), c[0].time_s))
