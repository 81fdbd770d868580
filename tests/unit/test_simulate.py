"""The model against the tile-trace simulator on random legal plans (STYLE.md: model properties).

With the ideal policy (one buffer per operand: the working set the plan assumes) the model's
bytes and flops must equal the simulator's exactly, for every legal order, depth and tile choice,
tails and halos included; and nothing moves less than the compulsory bytes.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from chainfuse.ir import Chain, attention_chain, conv_chain_spec, gemm_chain
from chainfuse.model import Nest, compulsory_bytes, level_cost
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
    r1, r2 = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3]))
    s1, s2 = draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 3]))
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


@st.composite
def tile_choices(draw: st.DrawFn, chain: Chain) -> dict[str, int]:
    """A tile in 1..extent per loop, with the product of trips kept under BLOCK_BUDGET."""
    budget = BLOCK_BUDGET
    tiles = {}
    names = list(chain.extents)
    for name in draw(st.permutations(names)):
        extent = chain.extents[name]
        smallest = -(-extent // max(1, budget))
        tile = draw(st.integers(smallest, extent))
        tiles[name] = tile
        budget //= -(-extent // tile)
    return tiles


def _check_fused(data: st.DataObject, chain: Chain) -> None:
    order, depth = data.draw(schedules(chain), label="schedule")
    try:
        nest = Nest(chain, order, depth)
    except ValueError:
        assume(False)
        raise
    tiles = data.draw(tile_choices(chain), label="tiles")
    cost = level_cost(nest, tiles)
    sim = simulate_level(chain, order, depth, tiles)
    assert cost.total == sim.bytes, (cost.by_tensor(), sim)
    assert cost.flops == sim.flops, (cost.op_flops, sim)
    assert cost.total >= compulsory_bytes(chain)
    assert cost.flops >= chain.flops()
    assert cost.used > 0


def _check_unfused(data: st.DataObject, chain: Chain) -> None:
    order = tuple(data.draw(st.permutations(list(chain.extents)), label="order"))
    nest = Nest(chain, order, 0, fused=False)
    tiles = data.draw(tile_choices(chain), label="tiles")
    cost = level_cost(nest, tiles)
    sim = simulate_level(chain, order, 0, tiles, fused=False)
    assert cost.total == sim.bytes, (cost.by_tensor(), sim)
    assert cost.flops == sim.flops == chain.flops()
    intermediates = sum(2 * t.nbytes for t in chain.intermediates)  # written once, read once
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


@PROPERTY
@given(chain=conv_chains(), data=st.data())
def test_conv_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_fused(data, chain)


@PROPERTY
@given(chain=conv_chains(), data=st.data())
def test_conv_unfused_model_equals_simulator(chain: Chain, data: st.DataObject) -> None:
    _check_unfused(data, chain)


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
    tiles = data.draw(tile_choices(chain), label="tiles")
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
    chain = gemm_chain(1, 8, 8, 8, 8)
    order = ("b", "m", "l", "k", "n")
    with pytest.raises(ValueError, match="more than 10 blocks"):
        simulate_level(chain, order, 3, dict.fromkeys(order, 1), max_blocks=10)


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
