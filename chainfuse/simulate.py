"""A tile-trace simulator: execute a plan's block loop nest and count what crosses each level.

It is the ground truth the model is tested against, so it shares none of the model's
arithmetic: it walks the blocks of the nest in order, works out each block's region of each
tensor from the loop intervals, derives a producer's region from what its consumer really reads
in that prefix iteration, and charges a tile's bytes whenever the level does not hold it. A run
of iterations that only shift every moving region by a whole tile charges alike, so it is walked
once and counted (`_Walk`): real MLPs and long sequences simulate in milliseconds.

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
    runs: bool = True,
) -> SimResult:
    """Walk the nest `order[:depth]` (shared) + each op's own loops with `tiles`; count bytes.

    With the ideal policy, uniform runs of a loop's iterations are counted, not walked (`runs`;
    `_Walk`), so any size simulates in milliseconds. The LRU policy walks every block and refuses
    more than `max_blocks` of them."""
    if policy == "lru" and capacity is None:
        raise ValueError("policy='lru' needs a capacity in bytes")
    walk = _Walk(chain, order, depth, tiles, fused, policy, capacity or 0, max_blocks)
    walk.compress = runs and policy == "ideal"
    walk.loop(walk.prefix, 0, {}, None)
    return SimResult(walk.moved, walk.flops, walk.blocks)


class _Walk:
    """The block loop nest, walked in order: the prefix loops, then in each prefix iteration each
    op's own loops, producers first.

    Counting a run instead of walking it: call an iteration of a loop *interior* when the loop's
    tile is whole there and no region that moves with the loop is clipped (checked with every
    other loop at its widest, so no iteration of theirs clips it either). Then iteration i + 1
    is iteration i shifted along the moving dims: same sizes, same flops, and the same regions
    repeat (a buffer holds the region of the iteration before, which every iteration of the loop
    rewrites). So where iterations a..b are all interior, iterations a+1..b charge alike: a+1 is
    walked and counted b - a times, and b is walked uncounted to leave the buffers as it does.
    An LRU cache's contents outlive an iteration, so that policy walks everything."""

    def __init__(
        self,
        chain: Chain,
        order: tuple[str, ...],
        depth: int,
        tiles: Mapping[str, int],
        fused: bool,
        policy: Literal["ideal", "lru"],
        capacity: int,
        max_blocks: int,
    ) -> None:
        self.chain, self.order, self.policy = chain, order, policy
        self.capacity, self.max_blocks = capacity, max_blocks
        self.ext = ext = chain.extents
        self.prefix = list(order[:depth])
        self.resident = {t.name for t in chain.intermediates} if fused else set()
        self.tile = {n: max(1, min(tiles.get(n, ext[n]), ext[n])) for n in ext}
        self.trips = {n: -(-ext[n] // self.tile[n]) for n in ext}
        self.shapes = {t.name: t.shape for t in chain.tensors}
        self.itemsize = {t.name: t.dtype.itemsize for t in chain.tensors}
        self.compress = True
        self.runs: dict[tuple[str, int | None], dict[int, int]] = {}
        self.buffers: dict[tuple[int, str], Region] = {}
        self.lru: OrderedDict[tuple[str, Region], int] = OrderedDict()
        self.held = self.moved = self.flops = self.blocks = 0

    def loop(
        self, loops: list[str], j: int, ranges: dict[str, Interval], scope: int | None
    ) -> None:
        """Iterations of loops[j] (and everything inside it) with the outer loops at `ranges`;
        `scope`: the op whose own loops these are, None for the shared prefix."""
        if j == len(loops):
            if scope is None:
                self.body(ranges)
            else:
                self.block(scope, ranges)
            return
        n = loops[j]
        skip = self._runs(n, scope) if self.compress else {}
        i = 0
        while i < self.trips[n]:
            ranges[n] = _tile(i, self.tile[n], self.ext[n])
            end = skip.get(i)
            if end is None:
                self.loop(loops, j + 1, ranges, scope)
                i += 1
                continue
            before = (self.moved, self.flops, self.blocks)
            self.loop(loops, j + 1, ranges, scope)
            times = end - i  # further iterations i + 1 .. end, each charging as much as i
            self.moved += (self.moved - before[0]) * times
            self.flops += (self.flops - before[1]) * times
            self.blocks += (self.blocks - before[2]) * times
            counted = (self.moved, self.flops, self.blocks)
            ranges[n] = _tile(end, self.tile[n], self.ext[n])
            self.loop(loops, j + 1, ranges, scope)  # the buffers as iteration `end` leaves them
            self.moved, self.flops, self.blocks = counted
            i = end + 1
        del ranges[n]

    def body(self, at: Mapping[str, Interval]) -> None:
        """One prefix iteration: what each resident intermediate's consumers read, then the ops."""
        chain, ext = self.chain, self.ext
        needed: dict[str, Region] = {}
        plans = []
        for op_index in range(len(chain.ops) - 1, -1, -1):
            op = chain.ops[op_index]
            fixed = dict(at)
            if op.output.tensor in needed:
                for ix, iv in zip(op.output.index, needed[op.output.tensor], strict=True):
                    fixed[ix.loops[0]] = iv
            own = [n for n in self.order if n in op.loops and n not in fixed]
            plans.append((op_index, fixed, own))
            for acc in op.reads:
                if acc.tensor not in self.resident:
                    continue
                whole = dict(fixed)
                whole.update({n: (0, ext[n] - 1) for n in own})
                region = _region(acc, whole, self.shapes[acc.tensor])
                needed[acc.tensor] = _hull(needed.get(acc.tensor), region)
        for op_index, fixed, own in reversed(plans):
            self.loop(own, 0, fixed, op_index)

    def block(self, op_index: int, ranges: Mapping[str, Interval]) -> None:
        op = self.chain.ops[op_index]
        self.blocks += 1
        if not self.compress and self.blocks > self.max_blocks:
            raise ValueError(f"more than {self.max_blocks} blocks: use coarser tiles to simulate")
        self.flops += _block_flops(op, ranges)
        for acc in (*op.reads, op.output):
            if acc.tensor not in self.resident:
                self.touch(op_index, acc.tensor, _region(acc, ranges, self.shapes[acc.tensor]))

    def touch(self, op_index: int, name: str, region: Region) -> None:
        size = _elements(region) * self.itemsize[name]
        if self.policy == "ideal":
            if self.buffers.get((op_index, name)) != region:
                self.buffers[(op_index, name)] = region
                self.moved += size
            return
        key = (name, region)
        if key in self.lru:
            self.lru.move_to_end(key)
            return
        self.moved += size
        self.lru[key] = size
        self.held += size
        while self.held > self.capacity and len(self.lru) > 1:
            _, gone = self.lru.popitem(last=False)
            self.held -= gone

    def _runs(self, loop: str, scope: int | None) -> dict[int, int]:
        """{a + 1: b} for each run a..b of at least four interior iterations of `loop`."""
        key = (loop, scope)
        if key not in self.runs:
            t, trips = self.tile[loop], self.trips[loop]
            whole = self.ext[loop] // t  # iterations with a whole tile
            inside = [whole >= 4 and self._interior(loop, scope, i) for i in range(whole)]
            out: dict[int, int] = {}
            a = 0
            while a < len(inside):
                if not inside[a]:
                    a += 1
                    continue
                b = a
                while b + 1 < len(inside) and inside[b + 1]:
                    b += 1
                if b - a >= 3:
                    out[a + 1] = b
                a = b + 1
            assert trips >= whole
            self.runs[key] = out
        return self.runs[key]

    def _interior(self, loop: str, scope: int | None, i: int) -> bool:
        """Whether no region that moves with `loop` at iteration i clips, every other loop at
        its widest (the whole extent; a derived loop: its consumers' widest reads)."""
        chain, ext = self.chain, self.ext
        ranges = {n: (0, ext[n] - 1) for n in ext}
        ranges[loop] = (i * self.tile[loop], (i + 1) * self.tile[loop] - 1)
        ops = [scope] if scope is not None else range(len(chain.ops) - 1, -1, -1)
        needed: dict[str, tuple[list[Interval], list[bool]]] = {}
        for op_index in ops:
            op = chain.ops[op_index]
            r, moving = dict(ranges), {loop}
            if scope is None and op.output.tensor in needed:
                ivs, flags = needed[op.output.tensor]
                for ix, (lo, hi), flag in zip(op.output.index, ivs, flags, strict=True):
                    name = ix.loops[0]
                    if flag:
                        moving.add(name)
                    r[name] = (max(lo, 0), min(hi, ext[name] - 1))
            for acc in (*op.reads, op.output):
                raw: list[Interval] = []
                flags = []
                for ix, size in zip(acc.index, self.shapes[acc.tensor], strict=True):
                    lo = hi = ix.offset
                    for name, c in ix.terms:
                        a, b = r[name]
                        lo += c * a if c > 0 else c * b
                        hi += c * b if c > 0 else c * a
                    flag = any(name in moving for name, _ in ix.terms)
                    if flag and (lo < 0 or hi > size - 1 or lo > hi):
                        return False
                    raw.append((lo, hi))
                    flags.append(flag)
                if scope is None and acc is not op.output and acc.tensor in self.resident:
                    if acc.tensor in needed:  # read twice: the hull of two moving uses may
                        return False  # not move as one
                    needed[acc.tensor] = (raw, flags)
        return True


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
