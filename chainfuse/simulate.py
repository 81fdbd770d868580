"""A tile-trace simulator: execute a plan's block loop nest and count what crosses each level.

It is the ground truth the model is tested against, so it shares none of the model's
arithmetic: it walks every block of the nest in order, works out each block's region of each
tensor from the loop intervals, derives a producer's region from what its consumer really reads
in that prefix iteration, and charges a tile's bytes whenever the level does not hold it.

Two policies for what a level holds:

- `"ideal"`: one buffer per (op, tensor) holding its current tile — what the plan's working set
  assumes. Exact whenever that working set fits the level, which the planner guarantees.
- `"lru"`: one least-recently-used cache of the level's capacity shared by all tiles.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from chainfuse.ir import Access, Chain, Contraction, Op

if TYPE_CHECKING:
    from chainfuse.hardware import Hardware
    from chainfuse.planner import Plan

__all__ = ["SimResult", "simulate", "simulate_level"]

Interval = tuple[int, int]
Region = tuple[Interval, ...]


@dataclass(frozen=True)
class SimResult:
    """Bytes brought into the level, and the flops the blocks executed (recompute included)."""

    bytes: int
    flops: int
    blocks: int


def _tile(index: int, tile: int, extent: int) -> Interval:
    t = max(1, min(tile, extent))
    return index * t, min(extent, (index + 1) * t) - 1


EMPTY: Interval = (0, -1)


def _region(acc: Access, ranges: Mapping[str, Interval], shape: tuple[int, ...]) -> Region:
    out = []
    for ix, size in zip(acc.index, shape, strict=True):
        lo = hi = ix.offset
        empty = False
        for loop, c in ix.terms:
            a, b = ranges[loop]
            empty |= a > b  # a loop that runs over nothing (its consumer reads only padding)
            lo += c * a if c > 0 else c * b
            hi += c * b if c > 0 else c * a
        lo, hi = max(lo, 0), min(hi, size - 1)
        out.append(EMPTY if empty or lo > hi else (lo, hi))
    return tuple(out)


def _elements(region: Region) -> int:
    n = 1
    for lo, hi in region:
        n *= max(0, hi - lo + 1)
    return n


def _hull(a: Region | None, b: Region) -> Region:
    if a is None:
        return b
    if _elements(b) == 0:
        return a
    if _elements(a) == 0:
        return b
    return tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(a, b, strict=True))


def simulate_level(
    chain: Chain,
    order: tuple[str, ...],
    depth: int,
    tiles: Mapping[str, int],
    fused: bool = True,
    policy: Literal["ideal", "lru"] = "ideal",
    capacity: int | None = None,
    max_blocks: int = 2_000_000,
) -> SimResult:
    """Walk the nest `order[:depth]` (shared) + each op's own loops with `tiles`; count bytes."""
    if policy == "lru" and capacity is None:
        raise ValueError("policy='lru' needs a capacity in bytes")
    ext = chain.extents
    prefix = order[:depth]
    resident = {t.name for t in chain.intermediates} if fused else set()
    trips = {n: -(-ext[n] // max(1, min(tiles.get(n, ext[n]), ext[n]))) for n in ext}
    buffers: dict[tuple[int, str], Region] = {}
    lru: OrderedDict[tuple[str, Region], int] = OrderedDict()
    held = 0
    moved = 0
    flops = 0
    blocks = 0

    def touch(op_index: int, name: str, region: Region) -> None:
        nonlocal moved, held
        size = _elements(region) * chain.tensor(name).dtype.itemsize
        if policy == "ideal":
            if buffers.get((op_index, name)) != region:
                buffers[(op_index, name)] = region
                moved += size
            return
        key = (name, region)
        if key in lru:
            lru.move_to_end(key)
            return
        moved += size
        lru[key] = size
        held += size
        while held > (capacity or 0) and len(lru) > 1:
            _, gone = lru.popitem(last=False)
            held -= gone

    for idx in itertools.product(*(range(trips[n]) for n in prefix)):
        at = {n: _tile(i, tiles.get(n, ext[n]), ext[n]) for n, i in zip(prefix, idx, strict=True)}
        # what each resident intermediate's consumers read during this prefix iteration
        needed: dict[str, Region] = {}
        plans = []
        for op_index in range(len(chain.ops) - 1, -1, -1):
            op = chain.ops[op_index]
            fixed = dict(at)
            if op.output.tensor in needed:
                for ix, iv in zip(op.output.index, needed[op.output.tensor], strict=True):
                    fixed[ix.loops[0]] = iv
            own = [n for n in order if n in op.loops and n not in fixed]
            plans.append((op_index, op, fixed, own))
            for acc in op.reads:
                if acc.tensor not in resident:
                    continue
                shape = chain.tensor(acc.tensor).shape
                whole = dict(fixed)
                whole.update({n: (0, ext[n] - 1) for n in own})
                needed[acc.tensor] = _hull(needed.get(acc.tensor), _region(acc, whole, shape))
        for op_index, op, fixed, own in reversed(plans):
            for sub in itertools.product(*(range(trips[n]) for n in own)):
                ranges = dict(fixed)
                ranges.update(
                    {
                        n: _tile(i, tiles.get(n, ext[n]), ext[n])
                        for n, i in zip(own, sub, strict=True)
                    }
                )
                blocks += 1
                if blocks > max_blocks:
                    raise ValueError(
                        f"more than {max_blocks} blocks: use coarser tiles to simulate"
                    )
                flops += _block_flops(op, ranges)
                for acc in (*op.reads, op.output):
                    if acc.tensor in resident:
                        continue
                    touch(
                        op_index, acc.tensor, _region(acc, ranges, chain.tensor(acc.tensor).shape)
                    )
    return SimResult(moved, flops, blocks)


def _block_flops(op: Op, ranges: Mapping[str, Interval]) -> int:
    n = 1
    for loop in op.loops:
        lo, hi = ranges[loop]
        n *= max(0, hi - lo + 1)
    return 2 * n if isinstance(op, Contraction) else n


def simulate(
    chain: Chain,
    plan: Plan,
    hardware: Hardware | str | None = None,
    policy: Literal["ideal", "lru"] = "ideal",
) -> dict[str, int]:
    """Bytes read from each level (keys as in `plan.predicted_bytes`) by executing the plan."""
    from chainfuse.hardware import presets, resolve

    if hardware is None and plan.hardware not in presets():
        hardware = resolve(None)  # a plan for the detected host
        if hardware.name != plan.hardware:
            raise ValueError(
                f"hardware: the plan was made for {plan.hardware!r}; pass that Hardware"
            )
    hw = resolve(hardware if hardware is not None else plan.hardware)
    out: dict[str, int] = {}
    levels = list(hw.levels)
    for inner, outer in itertools.pairwise(levels):
        tiles = plan.tiles_at(inner.name)
        if tiles is None:
            continue
        res = simulate_level(
            chain, plan.order, plan.depth, tiles, plan.fused, policy, capacity=inner.capacity
        )
        out[outer.name] = res.bytes
    return out
