"""The analytical model's closed forms: docs/design.md's worked example, recompute, conv halos, legality."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainfuse.builders import attention_chain, conv_chain_spec, gemm_chain
from chainfuse.hardware import Hardware
from chainfuse.model import (
    Nest,
    compulsory_bytes,
    deal,
    estimate,
    example_dv,
    least_flops,
    level_cost,
)
from chainfuse.simulate import simulate_level

EXAMPLE = ("b", "m", "l", "k", "n")  # docs/design.md: m > l > {k (op1) | n (op2)}, b outermost

# (batch, M, N, K, L, T_M, T_L, T_K, T_N): T_M | M, T_L | L, T_K < K, T_N < N
SIZES = [
    (1, 64, 32, 48, 96, 16, 32, 16, 8),
    (2, 64, 32, 48, 96, 64, 96, 47, 31),  # one tile along m and l
    (3, 12, 7, 5, 20, 4, 5, 2, 3),  # tails along k and n
    (1, 512, 64, 64, 512, 128, 64, 16, 32),
    (4, 30, 17, 13, 42, 6, 7, 4, 16),
    (2, 7, 2, 2, 7, 1, 1, 1, 1),
]


def ceil(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize(("batch", "M", "N", "K", "L", "TM", "TL", "TK", "TN"), SIZES)
def test_worked_example(batch: int, M: int, N: int, K: int, L: int, TM: int, TL: int, TK: int,
                        TN: int) -> None:  # fmt: skip
    assert M % TM == 0 and L % TL == 0 and TK < K and TN < N
    chain = gemm_chain(batch, M, N, K, L)
    nest = Nest(chain, EXAMPLE, 3)
    tiles = {"b": 1, "m": TM, "l": TL, "k": TK, "n": TN}
    cost = level_cost(nest, tiles)
    assert cost.total == pytest.approx(example_dv(M, N, K, L, TM, TL) * batch, rel=1e-12)
    item = 4 * batch
    assert cost.by_tensor() == {
        "A": M * K * ceil(L, TL) * item,
        "B": K * L * ceil(M, TM) * item,
        "D": L * N * ceil(M, TM) * item,
        "E": M * N * ceil(L, TL) * item,
    }
    assert "C" not in cost.by_tensor()  # the intermediate never moves
    # working set: each op's tiles plus the live intermediate tile C[T_M, T_L]
    op1 = TM * TK + TK * TL + TM * TL
    op2 = TM * TL + TL * TN + TM * TN
    assert cost.used == 4 * max(op1, op2)
    assert cost.flops == chain.flops()  # no recompute in this order
    # the simulator executes the same nest and agrees
    sim = simulate_level(chain, EXAMPLE, 3, tiles)
    assert (sim.bytes, sim.flops) == (cost.total, cost.flops)


@pytest.mark.parametrize("depth", [2, 3])
def test_worked_example_equivalent_depths(depth: int) -> None:
    """With the l loop shared (depth 3) or private to each op (depth 2 moves C-tiles of full l)."""
    chain = gemm_chain(1, 32, 16, 24, 48)
    tiles = {"b": 1, "m": 8, "l": 12, "k": 8, "n": 4}
    cost = level_cost(Nest(chain, EXAMPLE, depth), tiles)
    sim = simulate_level(chain, EXAMPLE, depth, tiles)
    assert cost.total == sim.bytes and cost.flops == sim.flops


def test_example_dv_closed_form() -> None:
    assert example_dv(512, 64, 64, 512, 64, 64) == 512 * 512 * 128 * (2 / 64) * 4
    assert example_dv(8, 2, 2, 8, 8, 8, itemsize=2) == 8 * 8 * 4 * (2 / 8) * 2


def test_estimate_dram_bytes_come_from_l3_tiles() -> None:
    hw = Hardware.preset("xeon-gold-6240")
    batch, M, N, K, L = 4, 256, 64, 64, 256
    chain = gemm_chain(batch, M, N, K, L)
    nest = Nest(chain, EXAMPLE, 3)
    t1 = {"b": 1, "m": 14, "l": 32, "k": 16, "n": 32}
    t2 = {"b": 1, "m": 64, "l": 64, "k": 32, "n": 32}
    t3 = {"b": 1, "m": 128, "l": 128, "k": 32, "n": 32}
    cost = estimate(nest, {"L1": t1, "L2": t2, "L3": t3}, hw)
    moved = dict(cost.bytes_per_level)
    assert list(moved) == ["L2", "L3", "DRAM"]
    assert moved["DRAM"] == level_cost(nest, t3).total
    assert moved["DRAM"] == example_dv(M, N, K, L, 128, 128) * batch
    assert moved["L3"] == level_cost(nest, t2).total
    assert moved["L2"] == level_cost(nest, t1).total
    used = dict(cost.used_per_level)
    assert used == {lv: level_cost(nest, t).used for lv, t in (("L1", t1), ("L2", t2), ("L3", t3))}
    assert cost.flops == chain.flops()
    assert cost.time_s == max(cost.compute_s, *(t for _, t in cost.memory_s))
    assert cost.time_s > 0 and cost.bound in ("compute", "L2", "L3", "DRAM")


def test_planned_dram_bytes_match_level_cost() -> None:
    """A plan's DRAM prediction is the model's bytes for its own L3 tiles and schedule."""
    from chainfuse.planner import plan

    hw = Hardware.preset("xeon-gold-6240")
    chain = gemm_chain(12, 512, 64, 64, 512)
    p = plan(chain, hw)
    nest = Nest(chain, p.order, p.depth, fused=p.fused)
    l3 = p.tiles_at("L3")
    assert l3 is not None
    assert p.predicted_bytes["DRAM"] == level_cost(nest, l3).total
    assert p.predicted_bytes["DRAM"] >= compulsory_bytes(chain)


# -- recompute ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "M", "N", "K", "L", "TM", "TL", "TK", "TN"), SIZES)
def test_recompute_when_n_encloses_op1(batch: int, M: int, N: int, K: int, L: int, TM: int,
                                       TL: int, TK: int, TN: int) -> None:  # fmt: skip
    chain = gemm_chain(batch, M, N, K, L)
    order = ("b", "m", "n", "l", "k")
    nest = Nest(chain, order, 4)
    tiles = {"b": 1, "m": TM, "l": TL, "k": TK, "n": TN}
    cost = level_cost(nest, tiles)
    assert cost.op_flops == (2 * M * L * K * ceil(N, TN) * batch, 2 * M * L * N * batch)
    assert cost.flops == (2 * M * L * K * ceil(N, TN) + 2 * M * L * N) * batch
    # op1 rereads its inputs for every n tile as well
    by = cost.by_tensor()
    assert by["A"] == M * K * ceil(L, TL) * ceil(N, TN) * batch * 4
    sim = simulate_level(chain, order, 4, tiles)
    assert (sim.bytes, sim.flops) == (cost.total, cost.flops)


def test_pointwise_between_recomputed_too() -> None:
    chain = gemm_chain(1, 8, 12, 4, 6, "relu")
    nest = Nest(chain, ("b", "m", "n", "l", "k"), 4)
    cost = level_cost(nest, {"b": 1, "m": 4, "n": 5, "l": 3, "k": 4})
    assert cost.op_flops == (2 * 8 * 6 * 4 * 3, 8 * 6 * 3, 2 * 8 * 6 * 12)


# -- convolutions: halo and recompute -------------------------------------------------------------

CONV_ORDER = ("n", "k2", "p2", "q2", "k1", "p1", "q1", "c", "r1", "s1", "r2", "s2")


def _halo_spans(size: int, tile: int) -> list[int]:
    """Rows of a 3x3 (pad 1, stride 1) consumer's input that each output tile of `tile` rows reads."""
    out = []
    for i in range(ceil(size, tile)):
        lo, hi = i * tile - 1, min(size, (i + 1) * tile)
        out.append(min(hi, size - 1) - max(lo, 0) + 1)
    return out


@pytest.mark.parametrize(
    ("H", "W", "T", "TK2"),
    [(10, 10, 1, 5), (10, 10, 3, 5), (10, 10, 4, 2), (10, 10, 10, 5), (9, 13, 4, 5), (8, 8, 5, 1)],
)
def test_conv_halo_recompute(H: int, W: int, T: int, TK2: int) -> None:
    C, K1, K2 = 3, 4, 5
    chain = conv_chain_spec(1, C, H, W, K1, 1, 1, K2, 3, 3, padding=(0, 1))
    nest = Nest(chain, CONV_ORDER, 4)  # prefix n, k2, p2, q2: op1 is computed per output tile
    tiles = {"n": 1, "k2": TK2, "p2": T, "q2": T, "k1": K1, "c": C}
    cost = level_cost(nest, tiles)
    rows, cols = _halo_spans(H, T), _halo_spans(W, T)
    pixels = sum(rows) * sum(cols)  # sum over tiles of clipped (T+2)-spans, rows times columns
    assert pixels >= H * W
    recompute = ceil(K2, TK2)  # k2 in the prefix encloses op1, which does not use it
    assert cost.op_flops == (2 * K1 * C * pixels * recompute, 2 * K2 * K1 * 9 * H * W)
    by = cost.by_tensor()
    assert by["X"] == C * pixels * recompute * 4  # the 1x1 first conv reads X with the halo
    assert by["Y2"] == K2 * H * W * 4
    # the working set of op1 holds a halo'd X tile: (T+2)^2 pixels away from the border
    if H > T + 2 and W > T + 2:
        x_tile = C * min(T + 2, H) * min(T + 2, W)
        assert cost.used >= x_tile * 4
    sim = simulate_level(chain, CONV_ORDER, 4, tiles)
    assert (sim.bytes, sim.flops) == (cost.total, cost.flops)


def test_conv_strided_halo() -> None:
    """A 3x3 stride-2 first conv read by a 3x3 second conv: X's block span is (T_P-1)*2+3+halo."""
    chain = conv_chain_spec(1, 2, 17, 17, 3, 3, 3, 2, 3, 3, stride=(2, 1), padding=(1, 1))
    nest = Nest(chain, CONV_ORDER, 4)
    tiles = {"n": 1, "k2": 2, "p2": 4, "q2": 9, "k1": 3, "c": 2, "r1": 3, "s1": 3, "r2": 3,
             "s2": 3}  # fmt: skip
    cost = level_cost(nest, tiles)
    sim = simulate_level(chain, CONV_ORDER, 4, tiles)
    assert (sim.bytes, sim.flops) == (cost.total, cost.flops)
    assert cost.flops > chain.flops()  # halo rows of Y1 are computed twice


def test_least_flops_of_a_strided_second_conv() -> None:
    """A 1x1 stride-2 second conv reads rows 0, 2, 4, 6, 8 of Y1: one output row per block makes
    the producer compute just those; a whole-extent block computes their hull, rows 0..8."""
    chain = conv_chain_spec(1, 2, 9, 9, 3, 1, 1, 2, 1, 1, stride=(1, 2))
    nest = Nest(chain, CONV_ORDER, 4)  # prefix n, k2, p2, q2
    op2 = 2 * 2 * 3 * 5 * 5
    assert level_cost(nest, chain.extents).flops == 2 * 3 * 2 * 9 * 9 + op2
    rows = level_cost(nest, {**chain.extents, "p2": 1, "q2": 1})
    assert rows.flops == 2 * 3 * 2 * 5 * 5 + op2 == least_flops(nest)
    sim = simulate_level(chain, CONV_ORDER, 4, {**chain.extents, "p2": 1, "q2": 1})
    assert sim.flops == rows.flops


# -- compulsory bytes ---------------------------------------------------------------------------


def test_compulsory_bytes_values() -> None:
    chain = gemm_chain(2, 5, 6, 7, 8, "softmax")
    assert compulsory_bytes(chain) == 4 * 2 * (5 * 7 + 7 * 8 + 8 * 6 + 5 * 6)
    # a stride-3 1x1 first conv never reads two of every three rows and columns of X
    conv = conv_chain_spec(1, 2, 9, 9, 3, 1, 1, 4, 1, 1, stride=(3, 1))
    read_x = 2 * 3 * 3
    assert compulsory_bytes(conv) == 4 * (read_x + 3 * 2 + 4 * 3 + 4 * 3 * 3)


def _legal_nests(chain, orders, fused=True):  # type: ignore[no-untyped-def]
    for order in orders:
        for depth in range(len(order) + 1) if fused else (0,):
            try:
                yield Nest(chain, order, depth, fused=fused)
            except ValueError:
                continue


def _tile_sets(extents: dict[str, int], rng: random.Random, count: int) -> list[dict[str, int]]:
    out = [dict(extents), dict.fromkeys(extents, 1)]
    for _ in range(count):
        out.append({n: rng.randint(1, e) for n, e in extents.items()})
    return out


def test_compulsory_bytes_bound_every_gemm_nest() -> None:
    rng = random.Random(7)
    chain = gemm_chain(2, 9, 5, 7, 11, "gelu")
    floor = compulsory_bytes(chain)
    tile_sets = _tile_sets(chain.extents, rng, 3)
    count = 0
    for fused in (True, False):
        for nest in _legal_nests(chain, itertools.permutations(chain.extents), fused):
            for tiles in tile_sets:
                assert level_cost(nest, tiles).total >= floor, (nest.order, nest.depth, tiles)
                count += 1
    assert count > 1000


def test_compulsory_bytes_bound_random_conv_nests() -> None:
    rng = random.Random(11)
    chains = [
        conv_chain_spec(
            1, 3, 9, 8, 4, 3, 3, 2, 3, 3, stride=(2, 1), padding=(1, 1), between="relu"
        ),
        conv_chain_spec(2, 2, 7, 7, 3, 1, 1, 4, 3, 3, padding=(0, 1)),
        conv_chain_spec(1, 2, 10, 10, 2, 3, 3, 3, 1, 1, stride=(3, 2)),
    ]
    for chain in chains:
        floor = compulsory_bytes(chain)
        loops = list(chain.extents)
        for _ in range(60):
            order = rng.sample(loops, len(loops))
            depth = rng.randint(0, 5)
            try:
                nest = Nest(chain, order, depth)
            except ValueError:
                nest = Nest(chain, order, 0, fused=False)
            tiles = {n: rng.randint(1, e) for n, e in chain.extents.items()}
            assert level_cost(nest, tiles).total >= floor, (order, depth, tiles)


def test_whole_extent_tiles_move_compulsory_bytes() -> None:
    """One block per op: every input read once, the output written once."""
    for chain in (gemm_chain(2, 9, 5, 7, 11, "relu"), attention_chain(1, 2, 5, 6, 3, 4, mask="bool"),
                  conv_chain_spec(1, 2, 6, 6, 3, 3, 3, 2, 1, 1)):  # fmt: skip
        order = tuple(chain.extents)
        cost = level_cost(Nest(chain, order, 0), chain.extents)
        assert cost.total == compulsory_bytes(chain)
        assert cost.flops == chain.flops()


# -- legality -----------------------------------------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, 2])
def test_gemm_reduction_in_prefix_is_illegal(position: int) -> None:
    chain = gemm_chain(1, 8, 8, 8, 8)
    rest = ["b", "m", "l", "n"]
    order = (*rest[:position], "k", *rest[position:])
    with pytest.raises(ValueError, match="'k' reduces 'C'"):
        Nest(chain, order, position + 1)
    Nest(chain, order, position)  # just outside the prefix is fine
    Nest(chain, order, 0, fused=False)  # an unfused nest has no shared prefix


def test_attention_reduction_in_prefix_is_illegal() -> None:
    chain = attention_chain(1, 2, 8, 8, 4, 4, causal=True)
    with pytest.raises(ValueError, match="'k' reduces 'S'"):
        Nest(chain, ("b", "h", "k", "m", "l", "n"), 3)


@pytest.mark.parametrize("loop", ["p1", "q1", "c", "r1"])
def test_conv_producer_loop_in_prefix_is_illegal(loop: str) -> None:
    chain = conv_chain_spec(1, 2, 8, 8, 3, 3, 3, 2, 3, 3, padding=(1, 1))
    order = ("n", loop, *(n for n in CONV_ORDER if n not in ("n", loop)))
    with pytest.raises(ValueError, match=f"'{loop}'"):
        Nest(chain, order, 2)


def test_conv_windowed_loop_named() -> None:
    chain = conv_chain_spec(1, 2, 8, 8, 3, 3, 3, 2, 3, 3, padding=(1, 1))
    order = ("n", "p1", *(n for n in CONV_ORDER if n not in ("n", "p1")))
    with pytest.raises(ValueError, match="'p1' indexes 'Y1' through p2\\+r2-1"):
        Nest(chain, order, 2)


def test_bad_orders() -> None:
    chain = gemm_chain(1, 4, 4, 4, 4)
    with pytest.raises(ValueError, match="permutation"):
        Nest(chain, ("b", "m", "l", "k"), 1)
    with pytest.raises(ValueError, match="permutation"):
        Nest(chain, ("b", "m", "l", "k", "n", "n"), 1)
    with pytest.raises(ValueError, match="depth 6 out of range"):
        Nest(chain, EXAMPLE, 6)
    with pytest.raises(ValueError, match="unfused"):
        Nest(chain, EXAMPLE, 2, fused=False)


def test_unfused_moves_the_intermediate() -> None:
    chain = gemm_chain(1, 16, 8, 8, 16)
    tiles = {"b": 1, "m": 16, "l": 16, "k": 8, "n": 8}
    fused = level_cost(Nest(chain, EXAMPLE, 3), tiles)
    unfused = level_cost(Nest(chain, EXAMPLE, 0, fused=False), tiles)
    assert unfused.by_tensor()["C"] == 2 * 16 * 16 * 4  # written by op1, read by op2
    assert unfused.total == fused.total + 2 * 16 * 16 * 4
    assert math.isclose(unfused.flops, fused.flops)


def _deal_by_hand(dims: tuple[tuple[int, int], ...], cores: int) -> tuple[int, float]:
    """Every block listed in row-major order with its element count, shares cut as the
    generated kernels cut them (ceil(blocks / workers) contiguous blocks each)."""
    tiles = [max(1, min(t, n)) for n, t in dims]
    trips = [ceil(n, t) for (n, _), t in zip(dims, tiles, strict=True)]
    sizes = [
        math.prod(min(t, n - i * t) for (n, _), t, i in zip(dims, tiles, idx, strict=True))
        for idx in itertools.product(*(range(k) for k in trips))
    ]
    workers = max(1, min(cores, len(sizes)))
    share = ceil(len(sizes), workers)
    busiest = max(sum(sizes[w * share : (w + 1) * share]) for w in range(workers))
    return workers, busiest * workers / sum(sizes)


@settings(max_examples=400, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 80)), min_size=1, max_size=3),
    cores=st.integers(1, 9),
)
def test_deal_weighs_tail_blocks_by_what_they_hold(dims: list[tuple[int, int]], cores: int) -> None:
    workers, imbalance = deal(tuple(dims), cores)
    want_workers, want = _deal_by_hand(tuple(dims), cores)
    assert workers == want_workers
    assert imbalance == pytest.approx(want, rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 80)), min_size=1, max_size=2),
    cores=st.integers(1, 9),
    extent=st.integers(1, 300),
    quantum=st.sampled_from([1, 4, 6]),
)
def test_deal_with_a_split_counts_the_kernels_shares(
    dims: list[tuple[int, int]], cores: int, extent: int, quantum: int
) -> None:
    """With fewer blocks than cores each block's cores take contiguous shares of the split
    loop, whole quanta each (the GEMM chain kernels' LQ); otherwise the split changes nothing."""
    split = (extent, quantum)
    workers, imbalance = deal(tuple(dims), cores, split)
    _, blocks_imbalance = _deal_by_hand(tuple(dims), cores)
    tiles = [max(1, min(t, n)) for n, t in dims]
    units = math.prod(ceil(n, t) for (n, _), t in zip(dims, tiles, strict=True))
    if units >= cores:
        assert (workers, imbalance) == deal(tuple(dims), cores)
        return
    parts = cores // units
    per = ceil(extent, parts * quantum) * quantum
    shares = [min(per, extent - p * per) for p in range(parts) if p * per < extent]
    assert workers == units * len(shares) <= cores
    # the busiest worker: the largest block's largest share, over the average worker's work
    average = 1 / (units * len(shares))
    want = (blocks_imbalance / units) * (max(shares) / extent) / average
    assert imbalance == pytest.approx(want, rel=1e-12)


def test_deal_examples() -> None:
    # an MLP's 64 tokens, l in two shares of whole quanta (2052 and 2044)
    assert deal(((64, 64),), 2, (4096, 6)) == (2, 2052 * 2 / 4096)
    assert deal(((100, 100),), 3, (100, 6)) == (3, 1.08)  # shares of 36, 36 and 28
    assert deal(((64, 32),), 2, (4096, 6)) == deal(((64, 32),), 2)  # two blocks: no split
    assert deal(((64, 64),), 4, (6, 6)) == (1, 1.0)  # one quantum: nothing to share
    assert deal(((768, 512),), 2) == (2, 4 / 3)  # one block of 512 rows, one of 256
    assert deal(((12, 1), (768, 512)), 2) == (2, 1.0)  # each core: 6 heads of both blocks
    assert deal(((768, 384),), 2) == (2, 1.0)
    assert deal(((5, 1),), 2) == (2, 1.2)  # 3 heads and 2
    assert deal(((512, 512),), 4) == (1, 1.0)


# -- the micro-kernel's efficiency terms ----------------------------------------------------------


def test_calibration_interpolates_and_holds_its_ends() -> None:
    from chainfuse.kernels.calibration import Calibration

    cal = Calibration("k", "here", ((16, 0.8), (64, 0.9), (256, 1.0)), 4.0)
    assert cal.speed(1) == cal.speed(16) == 0.8 and cal.speed(4096) == 1.0
    assert cal.speed(32) == pytest.approx(0.85)  # halfway in log2 between 16 and 64
    assert all(cal.speed(s) <= cal.speed(s + 1) for s in range(1, 300))
    for bad in (((64, 0.9), (16, 0.8)), ((16, 0.0),), ()):
        with pytest.raises(ValueError, match="calibration k"):
            Calibration("k", "here", bad, 4.0)
    with pytest.raises(ValueError, match="pack_flops"):
        Calibration("k", "here", ((16, 1.0),), -1.0)
    for bad_split in (0.0, 4.5, math.nan):
        with pytest.raises(ValueError, match="split_head"):
            Calibration("k", "here", ((16, 1.0),), 1.0, bad_split)
        with pytest.raises(ValueError, match="split_multiple"):
            Calibration("k", "here", ((16, 1.0),), 1.0, 1.0, bad_split)
    split = Calibration("k", "here", ((16, 1.0),), 1.0, 0.9, 1.3)
    assert split.to_dict()["split_head"] == 0.9 and "split_head" not in cal.to_dict()
    assert split.split(64, 64) == split.split(80, 64) == 0.9  # one wide block holds these
    assert split.split(128, 64) == split.split(256, 64) == 1.3  # nr columns at a time


def test_every_cpu_kernel_has_a_calibration() -> None:
    """The shipped table parses, and a kernel without its own entry gets the default one."""
    from chainfuse.kernels import available
    from chainfuse.kernels.calibration import calibration, table

    entries = table()
    assert "default" in entries and entries["default"].kernel in entries
    for kernel in available():
        cal = calibration(kernel.name)
        assert cal.kernel in (kernel.name, entries["default"].kernel)
        assert 0 < cal.speed(1) <= cal.speed(256) <= 1 and cal.pack_flops >= 0


def test_efficiency_charges_short_calls_and_packing_on_cpus_only() -> None:
    from chainfuse.model import code_level, efficiency

    chain = gemm_chain(2, 256, 64, 512, 256, "relu")
    xeon, h100 = Hardware.preset("xeon-gold-6240"), Hardware.preset("h100")
    assert efficiency(chain, h100) is None  # no CPU micro-kernel there: plain flops
    terms = efficiency(chain, xeon)
    assert terms is not None
    ext = chain.extents
    short, long_ = terms.stretch({"k": 16, "l": 16}, ext), terms.stretch({"k": 256, "l": 256}, ext)
    assert short[0] > long_[0] >= 1.0 and short[2] > long_[2] >= 1.0
    assert short[1] == 1.0  # the ReLU is no contraction
    assert terms.pack_flops(2000) == 2 * terms.pack_flops(1000) > 0
    # the estimate: the same nest with shorter calls at the code level (L2 here) computes longer
    assert code_level(xeon) == "L2"
    nest = Nest(chain, ("b", "m", "l", "k", "n"), 3)
    l1 = {"b": 1, "m": 48, "l": 16, "k": 16, "n": 64}
    l3 = {"b": 1, "m": 256, "l": 256, "k": 512, "n": 64}
    wide = {"L1": l1, "L2": {**l3, "m": 96, "k": 256}, "L3": l3}
    narrow = {"L1": l1, "L2": {**l3, "m": 96, "l": 32, "k": 32}, "L3": l3}
    fast, slow = estimate(nest, wide, xeon), estimate(nest, narrow, xeon)
    assert slow.compute_s > fast.compute_s and slow.flops == fast.flops
    assert 0 < fast.kernel_s < fast.compute_s
    assert fast.plain_s <= fast.time_s


def test_efficiency_runs_the_reductions_tail_call_at_its_own_length() -> None:
    from chainfuse.model import efficiency

    chain = gemm_chain(1, 256, 64, 64, 256, "relu")  # K = 64
    terms = efficiency(chain, Hardware.preset("xeon-gold-6240"))
    assert terms is not None
    ext, speed = chain.extents, terms.calibration.speed
    whole = terms.stretch({"k": 64, "l": 256}, ext)[0]
    split = terms.stretch({"k": 48, "l": 256}, ext)[0]  # a call of 48 steps, then one of 16
    assert whole == pytest.approx(1 / speed(64))
    assert split == pytest.approx((48 / speed(48) + 16 / speed(16)) / 64)
    assert split > 1 / speed(48) > whole


def test_efficiency_charges_packing_where_the_code_packs_per_load() -> None:
    from chainfuse.model import efficiency

    xeon = Hardware.preset("xeon-gold-6240")
    gemm = efficiency(gemm_chain(1, 256, 64, 256, 64, "relu"), xeon)
    attention = efficiency(attention_chain(1, 4, 128, 128, 64, 64), xeon)
    assert gemm is not None and attention is not None
    assert gemm.pack_flops(1000) > 0
    assert attention.pack_flops(1000) == 0  # V packed once a head (`DT_PANELS`)


def test_a_split_value_head_is_charged_where_a_wide_block_holds_it_whole() -> None:
    """An attention whose code runs its second GEMM on the wide block (the whole value head in
    registers) charges a value tile below the head at the kernel's measured `Calibration.split`
    for that head (one block: `split_head`; several: `split_multiple`); chains whose code has no
    such block, or a head of one block under a causal softmax, are not charged."""
    import dataclasses

    from chainfuse.kernels import available
    from chainfuse.model import efficiency

    wide = next(k for k in available() if k.wide is not None)
    xeon = dataclasses.replace(Hardware.preset("xeon-gold-6240"), isa=frozenset(wide.isa))
    nr = wide.nr
    for dv, causal, mask in ((nr, False, None), (nr, False, (1, 1, 256, 256)),
                             (2 * nr, False, None), (2 * nr, True, None)):  # fmt: skip
        kind = None if mask is None else "additive"
        chain = attention_chain(1, 4, 256, 256, 64, dv, causal=causal, mask=kind, mask_shape=mask)
        terms = efficiency(chain, xeon)
        assert terms is not None and terms.head is not None and terms.head[:2] == (2, "n")
        assert terms.head[2] == terms.calibration.split(dv, nr)
        ext = chain.extents
        whole = terms.stretch({"m": 64, "l": 256, "k": 64, "n": dv}, ext)
        split = terms.stretch({"m": 64, "l": 256, "k": 64, "n": dv // 2}, ext)
        assert split[0] == whole[0] and split[1] == whole[1]  # the scores and the softmax
        assert split[2] == pytest.approx(whole[2] / terms.head[2])
    for other in (
        attention_chain(1, 4, 256, 256, 64, nr, causal=True),
        attention_chain(1, 4, 256, 256, 64, max(wide.wide_cols), causal=True),  # (one block)
        attention_chain(1, 4, 256, 256, 64, nr - 16),  # a head no wide block holds
        gemm_chain(1, 256, 64, 64, 256, "relu"),  # no softmax: no wide block
        attention_chain(1, 4, 256, 256, 64, nr, dtype="bfloat16"),
    ):
        t = efficiency(other, xeon)
        assert t is None or t.head is None


def test_online_softmax_rescale_counts_a_tail_tile_as_a_call() -> None:
    from chainfuse.model import rescale_factors
    from chainfuse.model.softmax import RESCALE_STEPS

    chain = attention_chain(1, 2, 128, 512, 64, 64)
    whole = rescale_factors(chain, {"l": 512, "k": 64})
    tail = rescale_factors(chain, {"l": 510, "k": 64})  # 510 keys, then 2
    assert whole[2] == pytest.approx(1 + RESCALE_STEPS / 512)
    assert tail[2] == pytest.approx(1 + 2 * RESCALE_STEPS / 512)
    assert rescale_factors(chain, {"l": 256, "k": 64})[2] == pytest.approx(tail[2])


def test_weights_stored_transposed_are_not_charged_packing_where_read_in_place() -> None:
    from chainfuse.codegen.gemm_chain import DIRECT_ROW_STRIPS
    from chainfuse.model import efficiency, kernel_of

    xeon = Hardware.preset("xeon-gold-6240")
    shape = (1, 4096 + 7, 64, 256, 512)
    linear = gemm_chain(*shape, "gelu", b_transposed=True, d_transposed=True)
    plain = gemm_chain(*shape, "gelu")
    terms, untransposed, kernel = (
        efficiency(linear, xeon),
        efficiency(plain, xeon),
        kernel_of(linear, xeon),
    )
    assert terms is not None and untransposed is not None and kernel is not None
    most = DIRECT_ROW_STRIPS * kernel.nr
    assert most < 4096 and terms.direct == (("B", most), ("D", most)) and untransposed.direct == ()
    ext = linear.extents
    assert terms.in_place({"m": most}, ext) == {"B", "D"}
    assert terms.in_place({"m": most + 1}, ext) == frozenset()
    assert untransposed.in_place({"m": 16}, ext) == frozenset()
    # the same nest and tiles: equal bytes and flops, less compute where B and D are read in place
    nest_t = Nest(linear, ("b", "m", "l", "k", "n"), 3)
    nest_p = Nest(plain, ("b", "m", "l", "k", "n"), 3)
    l1 = {"b": 1, "m": 48, "l": 16, "k": 16, "n": 64}
    l3 = {"b": 1, "m": 4096, "l": 512, "k": 256, "n": 64}
    for m, cheaper in ((most, True), (most + kernel.nr, False)):
        tiles = {"L1": l1, "L2": {**l3, "m": m, "l": 96, "k": 128}, "L3": l3}
        t, p = estimate(nest_t, tiles, xeon), estimate(nest_p, tiles, xeon)
        assert t.bytes_per_level == p.bytes_per_level and t.flops == p.flops
        assert (t.compute_s < p.compute_s) is cheaper


def test_a_packed_whole_is_charged_once_per_row_block_whatever_the_l_tiles() -> None:
    """The code packs each row block of Aᵀ whole, once for every l block
    (`kernels.packing.keeps_a_whole`): the packing term charges A's rows once, padded to whole
    nr-strips, not once per load of the level's tiles; past `AT_WHOLE` it packs a k block for
    each l block, charged per load."""
    from chainfuse.kernels import packing
    from chainfuse.model import efficiency, kernel_of

    xeon = Hardware.preset("xeon-gold-6240")
    chain = gemm_chain(2, 100, 256, 512, 1024, "relu")
    terms, kernel = efficiency(chain, xeon), kernel_of(chain, xeon)
    assert terms is not None and kernel is not None and terms.a is not None
    assert terms.a == ("A", "k", kernel.nr, 2 * 512)
    ext = chain.extents
    moved = [(0, "A", 10**9), (0, "B", 7), (1, "D", 5)]
    rows = -(-64 // kernel.nr) * kernel.nr + -(-36 // kernel.nr) * kernel.nr  # blocks 64 + 36
    a_bytes = rows * 2 * 512 * 4
    for l_tile in (96, 384):
        tiles = {"m": 64, "l": l_tile, "k": 64, "n": 256}
        assert terms.packed_bytes(moved, 2, tiles, ext) == [a_bytes + 7, 5]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packing, "AT_WHOLE", 16)
        tiles = {"m": 64, "l": 96, "k": 64, "n": 256}
        assert terms.packed_bytes(moved, 2, tiles, ext) == [10**9 + 7, 5]
