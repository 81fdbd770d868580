"""The whole-model bench's figures: the speed-up as the median of per-round ratios with its
interquartile range (pure functions; no model is built, nothing is timed)."""

from __future__ import annotations

import pytest

from chainfuse.bench.models import Row, Spread, speedup, table


def test_speedup_is_the_median_of_per_round_ratios_not_the_ratio_of_medians() -> None:
    theirs, ours = [1.0, 10.0, 100.0], [2.0, 5.0, 200.0]  # ratios 0.5, 2, 0.5
    got = speedup(theirs, ours)
    assert got.median == pytest.approx(0.5)  # (the ratio of the medians would be 2)
    assert (got.low, got.high) == (pytest.approx(0.5), pytest.approx(1.25))


def test_speedup_quartiles_of_five_rounds() -> None:
    got = speedup([2.0] * 5, [1.0, 2.0, 4.0, 1.0, 2.0])  # ratios 2, 1, 0.5, 2, 1
    assert (got.median, got.low, got.high) == (1.0, 1.0, 2.0)
    assert str(got) == "1.00x (1.00-2.00)"


def test_speedup_of_one_round_and_of_an_even_count() -> None:
    assert speedup([3.0], [2.0]) == Spread(1.5, 1.5, 1.5)
    got = speedup([1.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.25, 0.125])  # ratios 1, 2, 4, 8
    assert (got.median, got.low, got.high) == (3.0, 1.75, 5.0)


@pytest.mark.parametrize(("theirs", "ours"), [([], []), ([1.0], [1.0, 2.0]), ([1.0], [0.0])])
def test_speedup_rejects_mismatched_empty_or_zero_times(
    theirs: list[float], ours: list[float]
) -> None:
    with pytest.raises(ValueError, match="speedup"):
        speedup(theirs, ours)


def test_row_reports_medians_spread_and_samples() -> None:
    samples = {"eager": [4.0, 8.0, 4.0], "inductor": [2.0, 2.0, 2.0],
               "inductor-freezing": [2.0, 3.0, 2.2], "chainfuse": [1.0, 3.0, 2.0]}  # fmt: skip
    row = Row("whisper", "fp32", 1, samples, 4, 4, 0.5)
    assert row.times_s["inductor-freezing"] == 2.2
    assert str(row.speedup("inductor-freezing")) == "1.10x (1.05-1.55)"  # ratios 2, 1, 1.1
    line = table([row]).splitlines()[-1]  # eager: ratios 4, 2.67, 2
    assert "| 1.10x (1.05-1.55) | 2.67x | 4/4 | 50.0 % |" in line
    record = row.to_json()
    assert record["samples_s"] == samples
    assert record["speedup_over"]["inductor-freezing"]["median"] == pytest.approx(1.1)


def test_bench_models_names_the_argument_it_refuses() -> None:
    pytest.importorskip("transformers")
    from chainfuse.bench.models import main

    with pytest.raises(ValueError, match=r"--models: .* \(got nope\)"):
        main(["--models", "bert,nope"])
    with pytest.raises(ValueError, match=r"--dtype: fp32, bf16 or fp32,bf16 \(got 'both'\)"):
        main(["--dtype", "both"])
