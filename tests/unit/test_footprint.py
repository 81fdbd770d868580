"""Footprint sums along one tiled loop (counted in runs of equal blocks) against the block by block
evaluation of the general interval code."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from chainfuse.footprint import Dim, Expr, _clipped, _span, grid_sum, may_repeat, repeat_sum

LOOP = "p"
TAP, TAPS = "r", 3


@st.composite
def exprs(draw: st.DrawFn, depth: int = 0) -> Expr:
    """An interval expression of the loop `p`: the tiled loop itself, or a loop derived through
    one strided, shifted use (windows and halos, nested up to three times)."""
    if depth == 3 or draw(st.booleans()):
        return ("t", LOOP, draw(st.integers(1, 40)))
    inner = draw(exprs(depth + 1))
    terms: list[tuple[int, Expr]] = [(draw(st.sampled_from([1, 2, 3, -1])), inner)]
    if draw(st.booleans()):
        terms.append((1, ("w", draw(st.integers(1, 6)))))
    offset = draw(st.integers(-4, 3))
    return ("d", draw(st.integers(1, 60)), ((offset, tuple(terms)),))


@st.composite
def lines(draw: st.DrawFn) -> tuple[tuple[Dim, ...], int, int]:
    """1-2 dims moved by `p` alone (every "t" leaf of `p` shares one extent; `r` has one tile),
    a tile, the extent."""
    extent = draw(st.integers(1, 40))
    dims = []
    for _ in range(draw(st.integers(1, 2))):
        e = draw(exprs())
        e = _with_extent(e, extent)
        terms: list[tuple[int, Expr]] = [(draw(st.sampled_from([1, 2, -1])), e)]
        if draw(st.booleans()):
            terms.append((1, ("w", draw(st.integers(1, 5)))))
        if draw(st.booleans()):  # a window tap tiled whole: a loop with a single tile
            terms.append((1, ("t", TAP, TAPS)))
        dims.append((draw(st.integers(1, 70)), (draw(st.integers(-3, 2)), tuple(terms))))
    return tuple(dims), draw(st.integers(1, extent + 2)), extent


def _with_extent(e: Expr, extent: int) -> Expr:
    if e[0] == "t":
        return ("t", LOOP, extent)
    offset, terms = e[2][0]
    inner = tuple((c, _with_extent(sub, extent) if sub[0] != "w" else sub) for c, sub in terms)
    return ("d", e[1], ((offset, inner),))


def _blocks(dims: tuple[Dim, ...], tiles: dict[str, int], extent: int) -> list[tuple[int, object]]:
    """(elements, clipped ranges) of every block, by the general code at one index at a time."""
    out = []
    for i in range(-(-extent // min(tiles[LOOP], extent))):
        at = {LOOP: i, TAP: 0}
        size = math.prod(_span(d, tiles, at, min, max) for d in dims)
        out.append((size, tuple(_clipped(d, tiles, at, min, max) for d in dims)))
    return out


@settings(max_examples=400, deadline=None)
@given(lines())
def test_line_sum_is_the_sum_over_blocks(case: tuple[tuple[Dim, ...], int, int]) -> None:
    dims, tile, extent = case
    tiles = {LOOP: tile, TAP: TAPS}
    assert grid_sum(dims, tiles) == sum(size for size, _ in _blocks(dims, tiles, extent))


@settings(max_examples=400, deadline=None)
@given(lines(), st.sampled_from([0, 1, 2]))
def test_line_repeats_are_the_unchanged_steps(
    case: tuple[tuple[Dim, ...], int, int], move: int
) -> None:
    dims, tile, extent = case
    tiles = {LOOP: tile, TAP: TAPS}
    blocks = _blocks(dims, tiles, extent)
    if len(blocks) == 1 or move == 0:
        want = sum(size for size, _ in blocks)
    elif move == 1:
        want = sum(b[0] for a, b in itertools.pairwise(blocks) if a[1] == b[1])
    else:
        want = blocks[0][0] if blocks[-1][1] == blocks[0][1] else 0
    assert repeat_sum(dims, tiles, {LOOP: move}) == want


def test_a_halo_clipped_at_both_borders_repeats() -> None:
    # rows p + r - 2 of a 3-row image, tiles of one row, a 5-tap window: blocks 0..2 all read
    # rows 0..2 (clipped), so two of the three steps repeat the region
    dim: Dim = (3, (-2, ((1, ("t", LOOP, 3)), (1, ("w", 5)))))
    tiles = {LOOP: 1}
    assert grid_sum((dim,), tiles) == 9
    assert repeat_sum((dim,), tiles, {LOOP: 1}) == 6
    assert repeat_sum((dim,), tiles, {LOOP: 2}) == 3


@settings(max_examples=300, deadline=None)
@given(lines())
def test_may_repeat_is_false_only_when_no_moving_step_repeats(
    case: tuple[tuple[Dim, ...], int, int],
) -> None:
    dims, tile, extent = case
    tiles = {LOOP: tile, TAP: TAPS}
    blocks = _blocks(dims, tiles, extent)
    if len(blocks) == 1:
        return  # nothing moves: the answer is "it may" (not asked by the model)
    repeats = sum(b[0] for a, b in itertools.pairwise(blocks) if a[1] == b[1])
    repeats += blocks[0][0] if blocks[-1][1] == blocks[0][1] else 0
    assert may_repeat(dims, tiles) == (repeats > 0)
