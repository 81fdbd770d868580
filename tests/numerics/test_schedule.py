"""The code schedule: every tile the code runs and every path choice, decided in Python, said by
`Kernel.describe()`, and what the compiled C runs (results checked against the reference)."""

from __future__ import annotations

import pytest

import chainfuse
from chainfuse import reference
from chainfuse.codegen.schedule import NARROW_ROWS, SCHEDULE, WIDE_ROWS, CodeSchedule
from chainfuse.compiler import compile


def _run(kernel: chainfuse.Kernel, chain: chainfuse.Chain, threads: int = 1) -> None:
    inputs = reference.random_inputs(chain, seed=5)
    chainfuse.set_num_threads(threads)
    try:
        out = kernel(*[inputs[t.name] for t in chain.inputs])
    finally:
        chainfuse.set_num_threads(None)
    want = reference.run(chain, inputs)[chain.outputs[0].name]
    reference.assert_close(out, want, chain)


def test_given_tiles_are_the_codes_and_say_so() -> None:
    chain = chainfuse.gemm_chain(2, 37, 13, 45, 29, "relu")
    kernel = compile(chain, tiles={"m": 20, "l": 7, "k": 8, "n": 6})
    s = kernel.schedule
    assert isinstance(s, CodeSchedule) and s.tiles == (20, 7, 8, 6)
    assert s.tiles == (kernel.spec.T_M, kernel.spec.T_L, kernel.spec.T_K, kernel.spec.T_N)
    given = {c.tile: c.code for c in s.changes if c.reason == "given"}
    planned = dict(zip(("T_M", "T_L", "T_K", "T_N"), s.planned, strict=True))
    assert given == {t: v for t, v in zip(planned, s.tiles, strict=True) if planned[t] != v}
    assert "code tiles T_M=20 T_L=7 T_K=8 T_N=6" in kernel.describe()
    _run(kernel, chain)


def test_a_causal_16_bit_chains_row_blocks_are_widened_with_a_reason() -> None:
    chain = chainfuse.attention_chain(1, 2, 200, 200, 32, 32, causal=True, dtype="bfloat16")
    s = compile(chain, threads=1).schedule
    assert s.tiles[0] >= WIDE_ROWS
    if s.planned[0] < WIDE_ROWS:
        assert any(c.tile == "T_M" and "causal" in c.reason for c in s.changes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_mask_that_varies_along_the_rows_runs_in_small_row_blocks(dtype: str) -> None:
    """The planner sees the mask's shape, not which keys it leaves out: a mask with a row dim
    runs in row blocks of at most NARROW_ROWS rows, where more of a causal mask's keys are
    left out; a padding mask (one row for every query) keeps the planner's tile."""
    for shape, capped in (((1, 1, 1024, 1024), True), ((1, 1, 1, 1024), False)):
        chain = chainfuse.attention_chain(
            1, 12, 1024, 1024, 64, 64, mask="additive", mask_shape=shape, dtype=dtype
        )
        s = compile(chain, threads=1).schedule
        changed = [c for c in s.changes if c.tile == "T_M" and "mask" in c.reason]
        assert (s.tiles[0] <= NARROW_ROWS) if capped else not changed
        assert bool(changed) == (capped and s.planned[0] > NARROW_ROWS)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_l_only_where_there_are_fewer_blocks_than_threads(threads: int) -> None:
    # one row block (an MLP's few tokens): its threads share l; a softmax never splits
    mlp = chainfuse.mlp_chain(40, 32, 256, 24, "gelu")
    kernel = compile(mlp, threads=threads, tiles={"m": 48})
    s = kernel.schedule
    assert s.split(threads) == threads
    assert s.arguments(threads)[SCHEDULE.index("split")] == threads
    assert (f"{threads} share each block's range" in s.describe(threads)) == (threads > 1)
    _run(kernel, mlp, threads)
    attention = chainfuse.attention_chain(1, 1, 40, 256, 32, 24)
    assert compile(attention, threads=threads, tiles={"m": 48}).schedule.split(threads) == 1


def test_the_row_paths_reach_follows_what_k_and_v_take_of_the_cache() -> None:
    # fp32 attention: ROWS_FIT rows while all of K and V fit a quarter of the last cache level,
    # ROWS_MAX beyond; K and V broadcast over the heads (stride 0) count once
    from chainfuse.codegen.rows import ROWS_FIT, ROWS_FIT_SHARE, ROWS_MAX

    chain = chainfuse.attention_chain(2, 4, 16, 64, 32, 32)
    s = compile(chain).schedule
    assert s.reach_varies
    fits = s.cache_bytes / ROWS_FIT_SHARE
    keys = int(fits // s.bd_bytes(1)) + 1  # the fewest keys past a quarter of the cache
    assert s.row_path_rows(s.bd_bytes(keys - 1)) == ROWS_FIT
    assert s.row_path_rows(s.bd_bytes(keys)) == ROWS_MAX
    dense = (1,) * 12
    shared = (1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1)  # B's and D's heads broadcast
    assert s.bd_bytes(keys, shared) == pytest.approx(s.bd_bytes(keys, dense) / 4)


def test_a_packed_whole_or_per_block_is_the_schedules() -> None:
    chain = chainfuse.gemm_chain(1, 32, 16, 300, 48)
    whole = compile(chain, tiles={"k": 64}).schedule
    assert whole.a_k == 300 and "Aᵀ packed whole" in whole.describe()
    assert whole.arguments(1)[SCHEDULE.index("a_k")] == 300


@pytest.mark.parametrize("split_multiple", [0.9, 1.3])
def test_a_head_of_several_wide_blocks_is_split_where_that_measured_faster(
    split_multiple: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value head of two of the kernel's nr-column blocks runs through the wide block, a
    pass over the scores per block, where the calibration measured that faster than the Eᵀ
    path (`split_multiple` <= 1: n kept whole); where the Eᵀ path measured faster, n runs in
    parts (blocks of nr where the plan had it whole, with the reason said). Either way the result is the reference's."""
    import dataclasses

    from chainfuse.codegen import schedule
    from chainfuse.kernels import calibration

    chain = chainfuse.attention_chain(1, 2, 96, 80, 32, 128)
    kernel = compile(chain, threads=1)
    nr = kernel.spec.kernel.nr
    if kernel.spec.kernel.wide is None or nr != 64:
        pytest.skip(f"{kernel.spec.kernel.name} has no wide block of 64 columns")
    entry = dataclasses.replace(calibration.calibration(kernel.spec.kernel.name),
                                split_multiple=split_multiple)  # fmt: skip
    monkeypatch.setattr(schedule, "calibration", lambda name: entry)
    kernel = compile(chain, threads=1)
    split = [c for c in kernel.schedule.changes if c.tile == "T_N" and "in parts" in c.reason]
    if split_multiple <= 1:
        assert kernel.schedule.tiles[3] == 128 and not split and kernel.schedule.wide_head
    else:  # (the planner may split it itself: the model charges the wide block too)
        tile_n, planned_n = kernel.schedule.tiles[3], kernel.schedule.planned[3]
        assert tile_n < 128 and not kernel.schedule.wide_head
        assert bool(split) == (planned_n == 128) and (not split or tile_n == nr)
        assert not split or "split_multiple" in split[0].reason
    _run(kernel, chain)
