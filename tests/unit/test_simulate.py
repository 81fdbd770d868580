"""The model against the tile-trace simulator on random legal plans (STYLE.md: model properties).

With the ideal policy (one buffer per operand: the working set the plan assumes) the model's
bytes and flops must equal the simulator's exactly, for every legal order, depth and tile choice,
tails and halos included; and nothing moves less than the compulsory bytes.

That includes the blocks whose region repeats the one the buffer already holds, which the
simulator does not reload: a window tap tiled so that `p + r` takes the same rows twice in a
row, or a halo clipped to the same rows at a border (small inputs, wide padding). The tests at
the end pin both.

`compulsory_bytes` counts only the input elements some output depends on, so it bounds every
schedule, strided consumers included (a fused producer computes only the rows they read).
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chainfuse.builders import attention_chain, conv_chain_spec, gemm_chain
from chainfuse.ir import Chain
from chainfuse.model import Nest, compulsory_bytes, least_flops, level_cost
from chainfuse.simulate import simulate_level

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCK_BUDGET = 600  # product of tile trips over all loops: keeps one simulation in milliseconds
INFINITE = 10**18

AWKWARD = st.sampled_from([1, 7, 17, 63, 65])


def _size(hi: int) -> st.SearchStrategy[int]:
    return st.one_of(AWKWARD.filter(lambda v: v <= hi), st.integers(1, hi))


@st.composite
def gemm_chains(draw: st.DrawFn) -> Chain:
    between = draw(st.sampled_from([None, "relu", "gelu", "softmax"]))
    return gemm_chain(draw(st.integers(1, 3)), draw(_size(70)), draw(_size(70)), draw(_size(70)),
                      draw(_size(70)), between)  # fmt: skip


@st.composite
def attention_chains(draw: st.DrawFn) -> Chain:
    b, h = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    mask = draw(st.sampled_from([None, "bool", "additive"]))
    shape = None
    if mask is not None:
        full = (b, h, sq, sk)
        rank = draw(st.integers(1, 4))
        shape = tuple(draw(st.sampled_from([1, f])) for f in full[4 - rank :])
    return attention_chain(b, h, sq, sk, draw(st.integers(1, 24)), draw(st.integers(1, 24)),
                           causal=draw(st.booleans()), mask=mask, mask_shape=shape)  # fmt: skip


@st.composite
def conv_chains(draw: st.DrawFn) -> Chain:
    args = dict(
        N=draw(st.integers(1, 2)), C=draw(st.integers(1, 6)), H=draw(st.integers(1, 12)),
        W=draw(st.integers(1, 12)), K1=draw(st.integers(1, 6)), K2=draw(st.integers(1, 6)),
    )  # fmt: skip
    taps = st.sampled_from([1, 2, 3, 5])
    r1, r2, s1, s2 = draw(taps), draw(taps), draw(taps), draw(taps)
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    between = draw(st.sampled_from([None, "relu"]))
    try:
        return conv_chain_spec(args["N"], args["C"], args["H"], args["W"], args["K1"], r1, s1,
                               args["K2"], r2, s2, stride=stride, padding=padding,
                               between=between)  # fmt: skip
    except ValueError:
        assume(False)
        raise AssertionError from None


def _legal(chain: Chain, order: tuple[str, ...], depth: int) -> bool:
    try:
        Nest(chain, order, depth)
    except ValueError:
        return False
    return True


@st.composite
def schedules(draw: st.DrawFn, chain: Chain) -> tuple[tuple[str, ...], int]:
    """A random permutation of the loops and a compute-at depth; legal ones are drawn mostly.

    Half the time the loops that may lead a prefix are moved to the front (a random permutation
    of a conv chain's 12 loops rarely has a long legal prefix otherwise)."""
    order = tuple(draw(st.permutations(list(chain.extents))))
    if draw(st.booleans()):
        ok = [n for n in order if _legal(chain, (n, *(m for m in order if m != n)), 1)]
        order = (*ok, *(n for n in order if n not in ok))
    legal = [d for d in range(len(order) + 1) if _legal(chain, order, d)]
    depth = draw(st.one_of(st.sampled_from(legal), st.integers(0, len(order))))
    return order, depth


TAPS = ("r1", "s1", "r2", "s2")


@st.composite
def tile_choices(
    draw: st.DrawFn, chain: Chain, budget: int = BLOCK_BUDGET, whole_taps: bool | None = None
) -> dict[str, int]:
    """A tile in 1..extent per loop, with the product of trips kept under `budget`.

    `whole_taps` keeps a convolution's window taps untiled (as the planner does); None draws it."""
    if whole_taps is None:
        whole_taps = draw(st.booleans())
    tiles = {}
    names = list(chain.extents)
    for name in draw(st.permutations(names)):
        extent = chain.extents[name]
        if whole_taps and name in TAPS:
            tiles[name] = extent
            continue
        smallest = -(-extent // max(1, budget))
        tile = draw(st.integers(smallest, extent))
        tiles[name] = tile
        budget //= -(-extent // tile)
    return tiles


def _fully_read(chain: Chain) -> bool:
    """Every element of every intermediate is read by its consumer (else a fused chain computes,
    and reads inputs for, only part of it, which `compulsory_bytes` does not know)."""
    ext = chain.extents
    for t in chain.intermediates:
        for op in chain.consumers(t.name):
            acc = next(a for a in op.reads if a.tensor == t.name)
            for ix, size in zip(acc.index, t.shape, strict=True):
                values = {ix.offset + sum(c * v for (_, c), v in zip(ix.terms, combo, strict=True))
                          for combo in itertools.product(*(range(ext[n]) for n in ix.loops))}  # fmt: skip
                if not set(range(size)) <= values:
                    return False
    return True


def _check_fused(
    data: st.DataObject, chain: Chain, budget: int = BLOCK_BUDGET, whole_taps: bool | None = None
) -> None:
    order, depth = data.draw(schedules(chain), label="schedule")
    try:
        nest = Nest(chain, order, depth)
    except ValueError:
        assume(False)
        raise
    tiles = data.draw(tile_choices(chain, budget, whole_taps), label="tiles")
    cost = level_cost(nest, tiles)
    sim = simulate_level(chain, order, depth, tiles)
    assert cost.flops == sim.flops, (cost.op_flops, sim)
    assert cost.total == sim.bytes, (cost.by_tensor(), sim)
    assert cost.total >= compulsory_bytes(chain)
    assert cost.flops >= least_flops(nest)
    if _fully_read(chain):
        assert cost.flops >= chain.flops()
    assert cost.used > 0


def _check_unfused(
    data: st.DataObject, chain: Chain, budget: int = BLOCK_BUDGET, whole_taps: bool | None = None
) -> None:
    order = tuple(data.draw(st.permutations(list(chain.extents)), label="order"))
    nest = Nest(chain, order, 0, fused=False)
    tiles = data.draw(tile_choices(chain, budget, whole_taps), label="tiles")
    cost = level_cost(nest, tiles)
    sim = simulate_level(chain, order, 0, tiles, fused=False)
    assert cost.total == sim.bytes, (cost.by_tensor(), sim)
    assert cost.flops == sim.flops == chain.flops()
    # every intermediate is written once, and read once unless a strided consumer skips some
    intermediates = sum(t.nbytes for t in chain.intermediates) * (2 if _fully_read(chain) else 1)
    assert cost.total >= compulsory_bytes(chain) + intermediates


@PROPERTY
@given(chain=gemm_chains(), data=st.data())
def test_gemm_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_fused(data, chain)


@PROPERTY
@given(chain=gemm_chains(), data=st.data())
def test_gemm_unfused_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_unfused(data, chain)


@PROPERTY
@given(chain=attention_chains(), data=st.data())
def test_attention_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_fused(data, chain)


@PROPERTY
@given(chain=attention_chains(), data=st.data())
def test_attention_unfused_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_unfused(data, chain)


CONV_BUDGET = 120  # a conv block costs more to simulate and to cost than a GEMM block


@PROPERTY
@given(chain=conv_chains(), data=st.data())
def test_conv_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_fused(data, chain, CONV_BUDGET)


@PROPERTY
@given(chain=conv_chains(), data=st.data())
def test_conv_unfused_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_unfused(data, chain, CONV_BUDGET)


@PROPERTY
@given(chain=conv_chains(), data=st.data(), fused=st.booleans())
def test_conv_model_equals_simulator_tiled_taps(
    chain: Chain, data: st.DataObject, fused: bool
) -> None:
    """Window taps split into tiles (the planner keeps them whole): regions repeat often."""
    check = _check_fused if fused else _check_unfused
    check(data, chain, CONV_BUDGET, whole_taps=False)


# -- LRU ------------------------------------------------------------------------------------------


@PROPERTY
@given(chain=st.one_of(gemm_chains(), attention_chains(), conv_chains()), data=st.data())
def test_lru_never_beats_compulsory(chain: Chain, data: st.DataObject) -> None:
    order, depth = data.draw(schedules(chain), label="schedule")
    try:
        nest = Nest(chain, order, depth)
    except ValueError:
        assume(False)
        raise
    conv = "r1" in chain.extents
    tiles = data.draw(tile_choices(chain, CONV_BUDGET if conv else BLOCK_BUDGET), label="tiles")
    ideal = simulate_level(chain, order, depth, tiles)
    used = level_cost(nest, tiles).used
    capacity = data.draw(
        st.sampled_from([1, used // 2 or 1, used, 4 * used, INFINITE]), label="cap"
    )
    lru = simulate_level(chain, order, depth, tiles, policy="lru", capacity=capacity)
    assert lru.bytes >= compulsory_bytes(chain)
    assert lru.flops == ideal.flops and lru.blocks == ideal.blocks
    if capacity == INFINITE:  # every distinct tile comes in once; the ideal buffers reload
        assert lru.bytes <= ideal.bytes


@PROPERTY
@given(chain=gemm_chains(), data=st.data())
def test_lru_infinite_capacity_moves_compulsory_bytes(chain: Chain, data: st.DataObject) -> None:
    """A GEMM chain's tiles partition each tensor, so an unbounded cache loads each element once."""
    order, depth = data.draw(schedules(chain), label="schedule")
    assume(_legal(chain, order, depth))
    tiles = data.draw(tile_choices(chain), label="tiles")
    lru = simulate_level(chain, order, depth, tiles, policy="lru", capacity=INFINITE)
    assert lru.bytes == compulsory_bytes(chain)


def test_lru_needs_capacity() -> None:
    chain = gemm_chain(1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="capacity"):
        simulate_level(chain, tuple(chain.extents), 0, {}, policy="lru")


def test_max_blocks() -> None:
    """The LRU policy walks every block, so it has a limit; the ideal one counts runs."""
    chain = gemm_chain(1, 8, 8, 8, 8)
    order = ("b", "m", "l", "k", "n")
    tiles = dict.fromkeys(order, 1)
    with pytest.raises(ValueError, match="more than 10 blocks"):
        simulate_level(chain, order, 3, tiles, policy="lru", capacity=64, max_blocks=10)
    assert simulate_level(chain, order, 3, tiles, max_blocks=10).blocks == 8 * 8 * 16


def test_lru_small_cache_thrashes() -> None:
    """A cache holding one tile re-reads A for every l tile: what the ideal buffers also move."""
    chain = gemm_chain(1, 16, 16, 16, 16)
    order = ("b", "m", "l", "k", "n")
    tiles = {"b": 1, "m": 4, "l": 4, "k": 4, "n": 4}
    ideal = simulate_level(chain, order, 3, tiles)
    tiny = simulate_level(chain, order, 3, tiles, policy="lru", capacity=1)
    big = simulate_level(chain, order, 3, tiles, policy="lru", capacity=INFINITE)
    assert big.bytes == compulsory_bytes(chain) < ideal.bytes <= tiny.bytes
    assert math.isclose(ideal.bytes, level_cost(Nest(chain, order, 3), tiles).total)


# -- regions that repeat: no reload -----------------------------------------------------------------


def test_no_reload_when_tap_window_repeats() -> None:
    # Z[p2 + r2] with r2 tiled by 1 outside p2 (2 tiles): blocks (r2=0, p2=1) and (r2=1, p2=0)
    # read the same rows of Z, so the simulator keeps the buffer; the model reloads it.
    chain = conv_chain_spec(1, 3, 8, 11, 1, 1, 1, 3, 3, 1, stride=(2, 1), between="relu")
    order = ("s2", "k1", "s1", "q2", "r2", "r1", "p2", "p1", "q1", "n", "k2", "c")
    tiles = {"n": 1, "k2": 3, "p2": 1, "q2": 3, "k1": 1, "p1": 4, "q1": 5, "c": 2, "r1": 1,
             "s1": 1, "r2": 1, "s2": 1}  # fmt: skip
    cost = level_cost(Nest(chain, order, 0, fused=False), tiles)
    sim = simulate_level(chain, order, 0, tiles, fused=False)
    assert cost.by_tensor()["Z"] == 192  # 240 if every block reloaded it
    assert cost.total == sim.bytes == 1752


def test_no_reload_when_clipped_halo_repeats() -> None:
    # A 3x3 (pad 1) conv over a 2-row input: both p1 tiles read rows [0, 1] of X.
    chain = conv_chain_spec(1, 1, 2, 2, 1, 3, 3, 1, 1, 1, padding=(1, 0))
    order = tuple(chain.extents)
    tiles = {**chain.extents, "p1": 1}
    cost = level_cost(Nest(chain, order, 0, fused=False), tiles)
    sim = simulate_level(chain, order, 0, tiles, fused=False)
    assert cost.by_tensor()["X"] == 16  # 32 if the second p1 tile reloaded it
    assert cost.total == sim.bytes == 104


def test_compulsory_bytes_of_a_strided_second_conv() -> None:
    """A 1x1 stride-2 second conv reads a quarter of Y1, so a fused chain needs only the rows
    and columns 0, 2, 4, 6 of X (one block reads their hull, 7x7 of X's 8x8)."""
    chain = conv_chain_spec(1, 4, 8, 8, 4, 1, 1, 4, 1, 1, stride=(1, 2))
    assert not _fully_read(chain)
    x, w1, w2, y2 = 4 * 4 * 4, 4 * 4, 4 * 4, 4 * 4 * 4
    assert compulsory_bytes(chain) == 4 * (x + w1 + w2 + y2)
    one_block = level_cost(Nest(chain, tuple(chain.extents), 0), chain.extents)
    assert one_block.by_tensor()["X"] == 4 * 4 * 7 * 7
    assert one_block.total >= compulsory_bytes(chain)


def test_a_block_that_reads_only_padding_reads_nothing() -> None:
    """Y2 is 3x3 from a 1x1 Y1 with padding 2, stride 2: only the centre block reads Y1, so the
    other blocks' producer computes nothing and reads no X (an empty row range plus a 2-wide tap
    range must stay empty)."""
    chain = conv_chain_spec(1, 1, 1, 2, 1, 1, 2, 1, 1, 1, stride=(1, 2), padding=(0, 2))
    order = ("n", "k2", "p2", "q2", "k1", "p1", "q1", "c", "r1", "s1", "r2", "s2")
    tiles = {**dict.fromkeys(order, 1), "s1": 2}
    cost = level_cost(Nest(chain, order, 4), tiles)
    sim = simulate_level(chain, order, 4, tiles)
    assert cost.by_tensor()["X"] == 8  # the centre block's two elements, once
    assert cost.total == sim.bytes == 56
    assert cost.flops == sim.flops


# -- counted runs: the same answer as walking every block, on chains too large to walk -----------


@PROPERTY
@given(chain=st.one_of(gemm_chains(), attention_chains(), conv_chains()), data=st.data())
def test_counted_runs_equal_the_walk(chain: Chain, data: st.DataObject) -> None:
    """Counting uniform runs of iterations gives exactly the bytes, flops and blocks of walking
    them, for any order, depth and tiling (tails, halos, split taps, padding-only blocks)."""
    order, depth = data.draw(schedules(chain), label="schedule")
    fused = data.draw(st.booleans(), label="fused")
    if fused and not _legal(chain, order, depth):
        assume(False)
    conv = "r1" in chain.extents
    tiles = data.draw(tile_choices(chain, CONV_BUDGET if conv else 4 * BLOCK_BUDGET), label="t")
    counted = simulate_level(chain, order, depth if fused else 0, tiles, fused)
    walked = simulate_level(chain, order, depth if fused else 0, tiles, fused, runs=False)
    assert counted == walked


@st.composite
def large_chains(draw: st.DrawFn) -> Chain:
    """Real MLPs and long attention: far too many blocks to walk."""
    if draw(st.booleans()):
        dims = [draw(st.sampled_from([512, 1000, 1024, 4096])) for _ in range(4)]
        between = draw(st.sampled_from([None, "relu", "gelu", "softmax"]))
        return gemm_chain(1, draw(st.sampled_from([1, 64, 197])), *dims[1:], between)
    heads, seq = draw(st.integers(1, 16)), draw(st.sampled_from([4096, 4099, 8192]))
    d = draw(st.sampled_from([64, 80, 128]))
    return attention_chain(1, heads, seq, seq, d, d, causal=draw(st.booleans()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=large_chains(), data=st.data())
def test_large_chains_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    order, depth = data.draw(schedules(chain), label="schedule")
    assume(_legal(chain, order, depth))
    tiles = {
        n: data.draw(st.sampled_from(sorted({1, 6, 16, 64, 96, e, max(1, e // 3)})), label=n)
        for n, e in chain.extents.items()
    }
    sim = simulate_level(chain, order, depth, tiles)
    cost = level_cost(Nest(chain, order, depth), tiles)
    assert (sim.bytes, sim.flops) == (cost.total, cost.flops)
