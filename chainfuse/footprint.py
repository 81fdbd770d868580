"""Regions of tensors that the blocks of a nest touch, as small expressions built once per nest.

Why: while planning, the model asks the same questions thousands of times ("how many elements of
X does one block touch with these tiles?", "how many summed over every block?"), and the answers
depend on the tiles only through a few integers. So the nest's structure (which loop is derived
from which consumer index, through which strides, offsets and clips) is turned once into a nested
tuple, and answering is integer arithmetic on it. Equal expressions with equal tiles give equal
answers, so one memo keyed by (expression, the tiles it reads) serves every nest of a chain.

An *interval expression* is the inclusive range [lo, hi] a loop covers in one block::

    ("t", loop, N)      the loop at its block's tile index i: [i*T, min(N, (i+1)*T) - 1]
    ("w", N)            the whole extent [0, N - 1] (the loop is not a block loop here)
    ("d", N, uses)      a derived loop: the hull of what its consumers read, clipped to
                        [0, N - 1]; each use is an affine index (offset, ((coeff, expr), ...))

A *dim* is `(size, affine)`: the elements of a tensor dimension of `size` that the affine index
covers, `max(0, min(hi, size - 1) - max(lo, 0) + 1)`. A conv input's row dim of a tile of output
rows is `(H, (-pad, ((stride, ("t", "p", P)), (1, ("w", R)))))`: its span is the halo'd
`(T_P - 1) * stride + R`, clipped at the borders, without anyone writing that formula.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "Dim",
    "Expr",
    "dim_leaves",
    "distinct",
    "grid_sum",
    "leaves",
    "may_repeat",
    "plain_loop",
    "point_span",
    "repeat_sum",
]

Expr = tuple[Any, ...]  # ("t", loop, N) | ("w", N) | ("d", N, uses)
EMPTY = 1 << 40  # how far below its start an empty derived interval ends: no sum un-empties it
Affine = tuple[int, tuple[tuple[int, Expr], ...]]  # (offset, ((coeff, expr), ...))
Dim = tuple[int, Affine]  # (size of the tensor dimension, its index)


def leaves(exprs: Iterable[Expr]) -> frozenset[str]:
    """The loops whose tile index moves these intervals (the `"t"` leaves)."""
    out: set[str] = set()
    stack = list(exprs)
    while stack:
        e = stack.pop()
        if e[0] == "t":
            out.add(e[1])
        elif e[0] == "d":
            stack.extend(sub for _, terms in e[2] for _, sub in terms)
    return frozenset(out)


def dim_leaves(dim: Dim) -> frozenset[str]:
    return leaves(sub for _, sub in dim[1][1])


def plain_loop(dim: Dim) -> tuple[str, int] | None:
    """(loop, N) when the dim is indexed by one tiled loop, unscaled and unshifted: its tiles then
    partition the loop, so summed over them they cover `min(N, size)` elements (no grid needed)."""
    _, (offset, terms) = dim
    if offset == 0 and len(terms) == 1 and terms[0][0] == 1 and terms[0][1][0] == "t":
        return terms[0][1][1], terms[0][1][2]
    return None


def _interval(
    e: Expr, tiles: Mapping[str, int], at: Mapping[str, Any], mn: Any, mx: Any
) -> tuple[Any, Any]:
    """[lo, hi] of an interval expression with the `"t"` loops at the tile indices `at`:
    integers (`mn`, `mx` = the builtins min, max) or numpy arrays holding one index per block
    of a grid (`np.minimum`, `np.maximum`)."""
    tag = e[0]
    if tag == "t":
        n = e[2]
        t = max(1, min(tiles.get(e[1], n), n))
        i = at[e[1]]
        return i * t, mn(n, (i + 1) * t) - 1
    if tag == "w":
        return 0, e[1] - 1
    n = e[1]
    lo: Any = n
    hi: Any = -1
    for offset, terms in e[2]:
        clo, chi = _bounds(offset, terms, tiles, at, mn, mx)
        clo, chi = mx(clo, 0), mn(chi, n - 1)
        empty = mn(1, mx(0, clo - chi))  # 1 where this use reads nothing: it adds nothing
        lo = mn(lo, clo + empty * EMPTY)
        hi = mx(hi, chi - empty * EMPTY)
    # nothing read (every use in the padding): the producer computes nothing, and the interval
    # must stay empty when a tap's range is added to it, so it is made emptier than any range
    return lo, hi - mn(1, mx(0, lo - hi)) * EMPTY


def _bounds(
    offset: int,
    terms: tuple[tuple[int, Expr], ...],
    tiles: Mapping[str, int],
    at: Mapping[str, Any],
    mn: Any,
    mx: Any,
) -> tuple[Any, Any]:
    lo: Any = offset
    hi: Any = offset
    for c, sub in terms:
        a, b = _interval(sub, tiles, at, mn, mx)
        lo = lo + (c * a if c > 0 else c * b)  # not min/max: an empty [a, b] (a > b) stays empty
        hi = hi + (c * b if c > 0 else c * a)
    return lo, hi


def _span(dim: Dim, tiles: Mapping[str, int], at: Mapping[str, Any], mn: Any, mx: Any) -> Any:
    lo, hi = _clipped(dim, tiles, at, mn, mx)
    return mx(0, hi - lo + 1)


def _clipped(
    dim: Dim, tiles: Mapping[str, int], at: Mapping[str, Any], mn: Any, mx: Any
) -> tuple[Any, Any]:
    size, (offset, terms) = dim
    lo, hi = _bounds(offset, terms, tiles, at, mn, mx)
    return mx(lo, 0), mn(hi, size - 1)


def point_span(dims: Iterable[Dim], tiles: Mapping[str, int]) -> int:
    """Elements one block touches: every tiled loop at its first tile (a full, non-edge tile
    unless the loop has a single, clipped one)."""
    dims = tuple(dims)
    at = dict.fromkeys(_structure(dims)[0], 0)
    return math.prod(_span(d, tiles, at, min, max) for d in dims)


def grid_sum(dims: Iterable[Dim], tiles: Mapping[str, int]) -> int:
    """Elements touched summed over every block: the sum over all tile indices of the dims'
    tiled loops of the product of their spans (a block on the edge counts at its clipped size)."""
    dims = tuple(dims)
    names, trips, line = _grid(dims, tiles)
    if math.prod(trips) == 1:
        return point_span(dims, tiles)
    if line:
        return _line_sum(dims, tiles, line, math.prod(trips))
    grid = np.indices(trips).reshape(len(names), -1)
    at = dict(zip(names, grid, strict=True))
    total: Any = 1
    for d in dims:
        total = total * _span(d, tiles, at, np.minimum, np.maximum)
    return int(np.sum(total))


def repeat_sum(dims: Iterable[Dim], tiles: Mapping[str, int], step: Mapping[str, int]) -> int:
    """Elements of the blocks whose region equals the block just before, summed over the steps
    from one block to the next in which the dims' tiled loops move as `step` says: 0 = it does
    not move (every tile index), 1 = it advances (tile i -> i + 1), 2 = it wraps (last -> first).

    A tensor's region repeats where clipping or a sum of loops maps two tile indices to one
    range: a halo clipped to the same rows at a border, or `p + r` with `r` tiled."""
    dims = tuple(dims)
    names, trips, line = _grid(dims, tiles)
    if line is not None:
        return _line_repeats(dims, tiles, line, math.prod(trips), step.get(line, 0))
    # every block's clipped range of every dim, once; a step's blocks before and after it are
    # then two slices of the grid
    grid = np.indices(trips)
    at = {n: grid[k] for k, n in enumerate(names)}
    before: list[slice] = []
    after: list[slice] = []
    for n, t in zip(names, trips, strict=True):
        move = step.get(n, 0) if t > 1 else 0
        before.append(
            slice(0, t - 1) if move == 1 else slice(t - 1, t) if move == 2 else slice(None)
        )
        after.append(slice(1, t) if move == 1 else slice(0, 1) if move == 2 else slice(None))
    b, a = tuple(before), tuple(after)
    same: Any = True
    size: Any = 1
    for d in dims:
        lo, hi = _clipped(d, tiles, at, np.minimum, np.maximum)
        lo, hi = np.broadcast_to(lo, grid.shape[1:]), np.broadcast_to(hi, grid.shape[1:])
        same = same & (lo[b] == lo[a]) & (hi[b] == hi[a])
        size = size * np.maximum(0, hi[a] - lo[a] + 1)
    return int(np.sum(np.where(same, size, 0)))


# One moving loop: every bound is affine in the tile index where nothing is clipped, so the
# blocks split into clipped ones at either end, walked one by one, and a middle run of equal
# blocks that is counted, not walked (docs/design.md, "What a level moves").


def _single_use(dims: tuple[Dim, ...]) -> bool:
    """Whether every derived loop in the dims is read through one index (its hull is affine)."""
    stack = [sub for _, (_, terms) in dims for _, sub in terms]
    while stack:
        e = stack.pop()
        if e[0] == "d":
            if len(e[2]) != 1:
                return False
            stack.extend(sub for _, sub in e[2][0][1])
    return True


def _line_interval(e: Expr, tiles: Mapping[str, int], loop: str, i: int) -> tuple[int, int, bool]:
    """`_interval` with `loop` at tile index i (any other tiled loop has one tile), and whether
    anything was clipped."""
    tag = e[0]
    if tag == "t":
        n = e[2]
        t = max(1, min(tiles.get(e[1], n), n))
        at = i if e[1] == loop else 0
        hi = (at + 1) * t
        return at * t, min(n, hi) - 1, hi > n
    if tag == "w":
        return 0, e[1] - 1, False
    n = e[1]
    offset, terms = e[2][0]
    lo, hi, clipped = _line_bounds(offset, terms, tiles, loop, i)
    if lo < 0 or hi > n - 1:
        lo, hi, clipped = max(lo, 0), min(hi, n - 1), True
    if lo > hi:  # the use reads padding only: the loop is empty (see `_interval`)
        return n, -1 - EMPTY, True
    return lo, hi, clipped


def _line_bounds(
    offset: int,
    terms: tuple[tuple[int, Expr], ...],
    tiles: Mapping[str, int],
    loop: str,
    i: int,
) -> tuple[int, int, bool]:
    lo = hi = offset
    clipped = False
    for c, sub in terms:
        a, b, cl = _line_interval(sub, tiles, loop, i)
        lo += c * a if c > 0 else c * b
        hi += c * b if c > 0 else c * a
        clipped = clipped or cl
    return lo, hi, clipped


def _line_block(
    dims: tuple[Dim, ...], tiles: Mapping[str, int], loop: str, i: int
) -> tuple[int, tuple[int, ...], bool]:
    """Block i's elements, its clipped ranges (lo, hi per dim) and whether anything clipped."""
    size = 1
    ranges: list[int] = []
    clipped = False
    for n, (offset, terms) in dims:
        lo, hi, cl = _line_bounds(offset, terms, tiles, loop, i)
        if lo < 0 or hi > n - 1:
            lo, hi, cl = max(lo, 0), min(hi, n - 1), True
        size *= max(0, hi - lo + 1)
        ranges += (lo, hi)
        clipped = clipped or cl
    return size, tuple(ranges), clipped


def _line_ends(
    dims: tuple[Dim, ...], tiles: Mapping[str, int], loop: str, trips: int
) -> tuple[list[tuple[int, int, tuple[int, ...]]], int, int]:
    """The clipped blocks (index, elements, ranges) at both ends, in index order, and the middle
    run of unclipped blocks as (count, elements of each); count 0 when every block is clipped."""
    ends: list[tuple[int, int, tuple[int, ...]]] = []
    i = 0
    while i < trips:
        size, ranges, clipped = _line_block(dims, tiles, loop, i)
        if not clipped:
            break
        ends.append((i, size, ranges))
        i += 1
    if i == trips:
        return ends, 0, 0
    middle = size
    tail: list[tuple[int, int, tuple[int, ...]]] = []
    j = trips - 1
    while j > i:
        size, ranges, clipped = _line_block(dims, tiles, loop, j)
        if not clipped:
            break
        tail.append((j, size, ranges))
        j -= 1
    return ends + tail[::-1], j - i + 1, middle


def _line_sum(dims: tuple[Dim, ...], tiles: Mapping[str, int], loop: str, trips: int) -> int:
    ends, count, middle = _line_ends(dims, tiles, loop, trips)
    return sum(size for _, size, _ in ends) + count * middle


def _line_repeats(
    dims: tuple[Dim, ...], tiles: Mapping[str, int], loop: str, trips: int, move: int
) -> int:
    """`repeat_sum` along a line: an unclipped block's region is the one before it moved by a
    non-zero slope, so only steps between two clipped blocks can repeat a region (and the wrap
    from the last block to the first, if the loop wraps)."""
    if trips == 1 or move == 0:  # nothing moves: every block repeats itself
        return _line_sum(dims, tiles, loop, trips)
    if move == 2:
        last, first = _line_block(dims, tiles, loop, trips - 1), _line_block(dims, tiles, loop, 0)
        return first[0] if last[1] == first[1] else 0
    ends, _, _ = _line_ends(dims, tiles, loop, trips)
    total = 0
    for (i, _, before), (j, size, after) in itertools.pairwise(ends):
        if j == i + 1 and before == after:
            total += size
    return total


def may_repeat(dims: Iterable[Dim], tiles: Mapping[str, int]) -> bool:
    """False when no step from one block to the next that moves the dims' tiled loops leaves
    their region unchanged (every `repeat_sum` whose step moves them is 0): exact and cheap for
    one moving loop; True (it may) otherwise."""
    dims = tuple(dims)
    _, trips, line = _grid(dims, tiles)
    if not line:
        return True
    return any(_line_repeats(dims, tiles, line, math.prod(trips), move) for move in (1, 2))


def _grid(
    dims: tuple[Dim, ...], tiles: Mapping[str, int]
) -> tuple[tuple[str, ...], list[int], str | None]:
    """The dims' tiled loops (sorted), how many tiles each has, and, when the blocks lie along a
    line (every derived loop read through one index, at most one loop with several tiles), that
    loop ("" when none moves); None otherwise."""
    names, extents, single = _structure(dims)
    trips = [-(-e // max(1, min(tiles.get(n, e), e))) for n, e in zip(names, extents, strict=True)]
    moving = [n for n, t in zip(names, trips, strict=True) if t > 1]
    line = (moving[0] if moving else "") if single and len(moving) <= 1 else None
    return names, trips, line


@functools.lru_cache(maxsize=4096)
def _structure(dims: tuple[Dim, ...]) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """What `_grid` needs of the dims that no tile changes (the planner asks for the same dims
    with thousands of tiles)."""
    names = tuple(sorted(leaves(sub for _, (_, terms) in dims for _, sub in terms)))
    ext: dict[str, int] = {}
    for _, (_, terms) in dims:
        _collect_extents(terms, ext)
    return names, tuple(ext[n] for n in names), _single_use(dims)


def _collect_extents(terms: tuple[tuple[int, Expr], ...], out: dict[str, int]) -> None:
    for _, e in terms:
        if e[0] == "t":
            out[e[1]] = e[2]
        elif e[0] == "d":
            for _, sub in e[2]:
                _collect_extents(sub, out)


def distinct(e: Expr, limit: int = 1 << 16) -> frozenset[int] | None:
    """The values an interval expression's loop takes over all blocks: every value, except for a
    derived loop, which takes only those its consumers read (a strided consumer skips some).
    None when enumerating them would pass `limit` combinations."""
    if e[0] != "d":
        return frozenset(range(e[-1]))
    n = e[1]
    out: set[int] = set()
    for offset, terms in e[2]:
        sums = {offset}
        for c, sub in terms:
            values = distinct(sub, limit)
            if values is None or len(sums) * len(values) > limit:
                return None
            sums = {s + c * v for s in sums for v in values}
        out.update(v for v in sums if 0 <= v < n)
    return frozenset(out)
