"""The benchmark harness's own logic: timing, results, rank correlation, report, CLI errors.

No timing is asserted here (timing belongs in benchmarks); these check the bookkeeping that
turns measurements into the report.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import json
import math
import os
import statistics
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chainfuse.bench import fidelity, report, runner
from chainfuse.bench.fidelity import Fidelity, spearman
from chainfuse.bench.probe import Machine
from chainfuse.bench.results import Result, geomean
from chainfuse.bench.timing import Timing, interleave, paired_ms
from chainfuse.hardware import Hardware


def _result(suite: str = "gemm-chain", workload: str = "bert-base", threads: int = 1,
            ms: dict[str, float] | None = None) -> Result:  # fmt: skip
    return Result(
        suite, workload, "relu", threads, 0.8,
        ms=ms or {"chainfuse": 10.0, "torch_prealloc": 12.0, "numpy": 11.0},
        baselines=("torch_prealloc", "numpy"), spread={"chainfuse": 0.02},
        best_ms={"chainfuse": 8.0}, tiles="T_M=96", predicted_ms=9.0, predicted_bytes={"L2": 1 << 20, "DRAM": 1 << 18},
        simulated_bytes={"L2": 1 << 20}, planning_ms=12.0, compile_s=0.5,
    )  # fmt: skip


def _machine() -> Machine:
    hw = Hardware.preset("xeon-gold-6240")
    return Machine(hw, 0.1, 150.0, hw.peak("float32") / 1e9, (("L2", 1e11), ("DRAM", 1.2e10)))


def test_interleave_calls_every_function_once_a_round_in_shuffled_orders() -> None:
    calls: list[str] = []
    names = ("a", "b", "c")
    fns = {n: (lambda n=n: calls.append(n)) for n in names}
    out = interleave(fns, rounds=30)
    assert calls[:3] == list(names)  # one warm-up each, in order

    def rounds_of(calls: list[str]) -> list[tuple[str, ...]]:  # (after the warm-ups)
        return [tuple(calls[i : i + 3]) for i in range(3, len(calls), 3)]

    rounds = rounds_of(calls)
    assert len(rounds) == 30 and all(sorted(r) == list(names) for r in rounds)
    # each contender runs after each other one about equally often (what the one before
    # leaves in the caches is part of a call's time), never always after the same one
    after = collections.Counter(itertools.pairwise(calls[3:]))
    assert all(after[x, y] >= 8 for x in names for y in names if x != y)  # of ~14.5 each
    calls.clear()
    interleave(fns, rounds=30)
    assert rounds_of(calls) == rounds  # seeded
    assert set(out) == set(names) and all(t.samples == 30 and t.ms >= 0 for t in out.values())
    assert all(0 <= t.best_ms <= t.ms for t in out.values())  # the fastest call, the median
    for t in out.values():  # every round's time, in order: the median and the fastest of them
        assert len(t.times_s) == 30
        assert t.ms == pytest.approx(statistics.median(t.times_s) * 1e3)
        assert t.best_ms == pytest.approx(min(t.times_s) * 1e3)
    with pytest.raises(ValueError, match="rounds"):
        interleave(fns, rounds=0)


def _timing(times_s: list[float]) -> Timing:
    ms = statistics.median(times_s) * 1e3
    return Timing(ms, 0.0, len(times_s), min(times_s) * 1e3, tuple(times_s))


def test_paired_times_keep_the_ratio_of_each_round_not_the_drift() -> None:
    # the machine drifts by up to 3x from round to round; "b" takes 1.1x "a" in every round;
    # "c" has 0.9x a's median but ran fast where "a" ran slow and the other way round: what
    # it took against "a" is each round's ratio, the median of those
    drift = [1.0, 3.0, 1.2, 2.5, 1.0, 2.8, 1.1]
    a = _timing(drift)
    b = _timing([1.1 * x for x in drift])
    c = _timing([0.9 * x for x in [3.0, 1.0, 2.5, 1.2, 2.8, 1.0, 1.1]])
    assert c.ms == pytest.approx(0.9 * a.ms)
    paired = paired_ms({"a": a, "b": b}, "a")
    assert paired["a"] == pytest.approx(a.ms)
    assert paired["b"] == pytest.approx(1.1 * a.ms)
    skewed = paired_ms({"a": a, "c": c}, "a")
    ratios = sorted(cx / ax for cx, ax in zip(c.times_s, a.times_s, strict=True))
    assert skewed["c"] == pytest.approx(a.ms * ratios[3])  # the median round's ratio
    with pytest.raises(ValueError, match="rounds"):
        paired_ms({"a": a, "d": _timing(drift[:3])}, "a")
    with pytest.raises(ValueError, match="per-round"):
        paired_ms({"a": Timing(1.0, 0.0, 1)}, "a")


def test_fidelity_measures_every_plan_against_the_chosen_one_round_by_round() -> None:
    drift = [1.0, 2.0, 1.5, 3.0, 1.2]
    timing = {"0": _timing(drift), "1": _timing([0.95 * x for x in drift]),
              "2": _timing([1.2 * x for x in (3.0, 1.0, 2.0, 1.2, 1.5)])}  # fmt: skip
    measured = fidelity._measured(timing, 3)  # ms
    assert measured[0] == pytest.approx(1500.0)
    assert measured[1] == pytest.approx(0.95 * 1500.0)  # 5 % faster every round: a 5 % gap
    # its median is 1.2x the chosen one's, but round by round it took 0.48-3.6x: the median
    # round 1.5x (1.25 x 1.2)
    assert timing["2"].ms == pytest.approx(1.2 * 1500.0)
    assert measured[2] == pytest.approx(1.5 * 1500.0)


def test_fidelity_times_its_plans_on_the_one_thread_they_were_planned_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plans are planned for one thread, so they are timed on one whatever the caller set
    (a direct call of `measure` ran them on every core); the caller's count comes back."""
    import chainfuse
    from chainfuse import gemm_chain

    seen: list[int] = []

    def fake(fns: dict[str, object], rounds: int, budget_s: float = 20.0) -> dict[str, Timing]:
        seen.append(chainfuse.get_num_threads())
        return {name: _timing([1e-3, 1.1e-3, 0.9e-3, 1e-3]) for name in fns}

    monkeypatch.setattr(fidelity, "interleave", fake)
    chainfuse.set_num_threads(2)
    try:
        record = fidelity.measure(gemm_chain(1, 48, 32, 32, 40, "relu"), "gemm-chain", "tiny",
                                  "relu", top=2, rounds=4)  # fmt: skip
        assert seen == [1] and chainfuse.get_num_threads() == 2
    finally:
        chainfuse.set_num_threads(None)
    assert len(record.measured_ms) == len(record.tiles) == 2


def test_result_speedup_is_against_the_fastest_baseline() -> None:
    r = _result()
    assert r.best_baseline() == "numpy"
    assert r.speedup() == pytest.approx(1.1)
    assert r.speedup("torch_prealloc") == pytest.approx(1.2)
    assert r.gflops() == pytest.approx(80.0)
    assert Result.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError, match="none of the baselines"):
        _result(ms={"chainfuse": 1.0}).best_baseline()


def test_geomean() -> None:
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(geomean([]))


def test_spearman_known_values() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError):
        spearman([1, 2], [1])


@settings(deadline=None)  # the first call imports scipy
@given(st.lists(st.tuples(st.integers(0, 5), st.floats(-10, 10)), min_size=3, max_size=30))
def test_spearman_matches_scipy(pairs: list[tuple[int, float]]) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    xs, ys = [float(a) for a, _ in pairs], [b for _, b in pairs]
    with warnings.catch_warnings():  # constant draws: scipy warns and gives nan, as we do
        warnings.simplefilter("ignore", scipy_stats.ConstantInputWarning)
        want = scipy_stats.spearmanr(xs, ys).statistic
    got = spearman(xs, ys)
    assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9)


def test_fidelity_rank_breaks_time_ties_by_memory_time() -> None:
    f = Fidelity("gemm-chain", "w", "none", ["a", "b", "c"], predicted_ms=[5.0, 5.0, 6.0],
                 predicted_memory_ms=[2.0, 1.0, 0.5], measured_ms=[3.0, 2.0, 4.0])  # fmt: skip
    assert f.predicted_rank == [2.0, 1.0, 3.0]
    assert f.rho == pytest.approx(1.0)
    assert f.tuning_gap == pytest.approx(0.5)
    back = Fidelity.from_dict(json.loads(json.dumps(f.to_dict())))
    assert json.dumps(back.to_dict()) == json.dumps(f.to_dict())  # (NaN fields compare unequal)
    assert math.isnan(f.rho_plain)  # (a record from before the kernel terms has none)
    assert math.isnan(f.repeat_rho)  # (nor its measurement's repeatability)


def test_split_half_rho_is_the_rounds_agreeing_with_themselves() -> None:
    from chainfuse.bench.fidelity import split_half_rho
    from chainfuse.bench.timing import Timing

    def timing(times: list[float]) -> Timing:
        return Timing(1.0, 0.0, len(times), 1.0, tuple(times))

    steady = {"0": timing([1.0] * 6), "1": timing([1.1] * 6), "2": timing([1.2] * 6)}
    assert split_half_rho(steady, "0") == pytest.approx(1.0)
    # even rounds order the plans 0 < 1 < 2, odd rounds the reverse: no agreement at all
    flip = {"0": timing([1.0, 1.0] * 3), "1": timing([1.1, 0.9] * 3), "2": timing([1.2, 0.8] * 3)}
    assert split_half_rho(flip, "0") == pytest.approx(-1.0)
    assert math.isnan(split_half_rho({k: timing([1.0] * 3) for k in "012"}, "0"))


def test_fidelity_compares_the_model_without_its_kernel_terms_and_two_runs(
    tmp_path: Path,
) -> None:
    after = Fidelity("gemm-chain", "w", "relu", ["a", "b", "c"], predicted_ms=[1.0, 2.0, 3.0],
                     predicted_memory_ms=[0.0, 0.0, 0.0], measured_ms=[1.0, 2.0, 3.0],
                     predicted_plain_ms=[3.0, 2.0, 1.0], repeat_rho=0.5)  # fmt: skip
    assert after.rho == pytest.approx(1.0) and after.rho_plain == pytest.approx(-1.0)
    assert Fidelity.from_dict(json.loads(json.dumps(after.to_dict()))) == after
    before = dataclasses.replace(after, measured_ms=[2.0, 1.0, 3.0], predicted_plain_ms=[])
    for name, fids in (("before", [before]), ("after", [after])):
        (tmp_path / name).write_text(json.dumps({"fidelity": [f.to_dict() for f in fids]}))
    table = fidelity.compare(fidelity.load(str(tmp_path / "before")),
                             fidelity.load(str(tmp_path / "after")))  # fmt: skip
    # (three plans in common: too few for the runs' agreement)
    assert (
        table[2] == "| gemm-chain | 1 / 1 | 0.50 | 1.00 | -1.00 | 0.50 | nan (0) | 100.0% | 0.0% |"
    )
    assert fidelity.main(["--compare", str(tmp_path / "before"), str(tmp_path / "after")]) == 0


def test_two_runs_agree_on_the_plans_both_timed_only() -> None:
    def run(tiles: list[str], measured: list[float], workload: str = "w") -> Fidelity:
        n = len(tiles)
        return Fidelity("gemm-chain", workload, "relu", tiles, predicted_ms=[1.0] * n,
                        predicted_memory_ms=[0.0] * n, measured_ms=measured)  # fmt: skip

    first = run(["a", "b", "c", "d", "e"], [1.0, 2.0, 3.0, 4.0, 5.0])
    # the second run timed "e" in another plan's place and lists the plans in another order:
    # matched by label, its a..d measured in the reverse order
    second = run(["d", "c", "x", "b", "a"], [1.0, 2.0, 9.0, 3.0, 4.0])
    assert fidelity.run_agreement([first], [second]) == {"gemm-chain/w/relu": pytest.approx(-1.0)}
    same = run(["a", "b", "c", "d"], [1.0, 1.5, 2.0, 9.0])
    assert fidelity.run_agreement([first], [same]) == {"gemm-chain/w/relu": pytest.approx(1.0)}
    # fewer plans in common than AGREE_PLANS, another workload, a constant run: nothing
    assert fidelity.run_agreement([first], [run(["a", "b", "c", "y"], [1, 2, 3, 4])]) == {}
    assert fidelity.run_agreement([first], [run(["a", "b", "c", "d"], [1, 2, 3, 4], "v")]) == {}
    assert fidelity.run_agreement([first], [run(["a", "b", "c", "d"], [2.0] * 4)]) == {}
    table = fidelity.compare([first], [second])
    assert table[2].split(" | ")[6] == "-1.00 (1)"


def test_report_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = [_result(threads=1), _result(threads=2),
               _result("attention", "seq-64", ms={"chainfuse": 1.0, "sdpa": 0.9})]  # fmt: skip
    results[2].baselines = ("sdpa",)
    fids = [Fidelity("gemm-chain", "bert-base", "relu", ["x", "y"], [1.0, 2.0], [0.1, 0.1],
                     [1.1, 1.0])]  # fmt: skip
    files = report.write(tmp_path, results, fids, _machine(), {"extra": 1}, "chainfuse bench x")
    names = {p.name for p in files}
    assert {"report.md", "results.json"} <= names
    pngs = [p for p in files if p.suffix == ".png"]
    assert len(pngs) >= 3 and all(p.stat().st_size > 5000 for p in pngs)
    md = (tmp_path / "report.md").read_text()
    assert "## gemm-chain" in md and "## attention" in md and "## Model fidelity" in md
    assert "1.10x (numpy)" in md and "0.90x (sdpa)" in md  # speedups vs the fastest baseline
    assert "1.00 / 1.00" in md  # L2 MiB predicted / simulated
    assert "not simulated" in md  # DRAM had no simulator figure
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == 3 and data["fidelity"][0]["tuning_gap"] == pytest.approx(0.1)
    summary = {(s["suite"], s["threads"]): s for s in data["summary"]}
    assert summary["gemm-chain", 1]["geomean_speedup"] == pytest.approx(1.1)
    # 0.8 GFLOP in 10 ms median, 8 ms fastest call: 80 and 100 GFLOP/s of the 150 peak
    assert "| 53% | 67% |" in md
    assert summary["gemm-chain", 1]["at_or_above_80pct_peak_fastest_call"] == 0


def test_report_of_a_run_without_one_thread_plots_and_ranks_its_fewest_threads(
    tmp_path: Path,
) -> None:
    # `--threads 2` alone: the model's plot and rho take the 2-thread results (the model
    # predicted those for 2 threads), where an empty log-scaled axis made the report fail
    pytest.importorskip("matplotlib")
    results = [_result(threads=2), _result(workload="bert-large", threads=2,
                                           ms={"chainfuse": 20.0, "numpy": 25.0})]  # fmt: skip
    results[1].predicted_ms = 18.0
    files = report.write(tmp_path, results, [], _machine(), {}, "chainfuse bench x")
    assert {"predicted_vs_measured.png", "roofline.png"} <= {p.name for p in files}
    assert report.across_workloads(results) == [("gemm-chain", 2, pytest.approx(1.0))]
    assert report.fewest_threads(results)[0] == 2
    assert "| gemm-chain | 2 | 1.00 |" in (tmp_path / "report.md").read_text()


def test_progress_without_a_terminal_prints_one_line_per_step() -> None:
    stream = io.StringIO()
    bar = runner.Progress(2, stream)
    bar("first")
    bar("second")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/2") and lines[1].endswith("second")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gemm-chain", "--dtype", "fp8"], "--dtype: unknown 'fp8'"),
        (["conv-chain", "--dtype", "bf16"], "conv chains compile in fp32 only"),
        (["conv-chain", "--dtype", "fp32,fp16"], "conv chains compile in fp32 only"),
        (["gemm-chain", "--threads", "1,x"], "--threads"),
        (["gemm-chain", "--threads", "0"], "--threads"),
    ],
)
def test_runner_rejects_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = runner.main(argv)
    except SystemExit as exc:
        code, text = 2, str(exc)
    else:
        text = capsys.readouterr().err
    assert code == 2 and message in text


def test_runner_makes_every_openmp_runtime_passive_before_loading_torch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """PyTorch's OpenMP runtime reads OMP_WAIT_POLICY once, when torch is imported: the runner
    sets its default before it imports torch, or PyTorch's workers spin while ours sleep (2
    threads, 32 keys: unfused PyTorch 0.049 ms against ours 0.053 ms; passive both, 0.35 ms
    against 0.055 ms); a user's own setting is kept."""
    seen: list[str | None] = []

    def torch_threads() -> None:
        seen.append(os.environ.get("OMP_WAIT_POLICY"))

    monkeypatch.setattr(runner, "_torch_threads", torch_threads)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert runner.main(["attention", "--dtype", "fp64"]) == 2
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert runner.main(["attention", "--dtype", "fp64"]) == 2
    assert seen == ["PASSIVE", "ACTIVE"]
    capsys.readouterr()


def test_fidelity_candidates_start_with_the_planners_choice() -> None:
    from chainfuse.builders import gemm_chain
    from chainfuse.compiler import compile
    from chainfuse.hardware import resolve

    chain = gemm_chain(2, 96, 32, 32, 120, "relu")
    kernel = compile(chain)
    ranked = fidelity.candidates(kernel, resolve(None), 1, 5)
    spec = kernel.spec
    assert ranked[0][1] == {"m": spec.T_M, "l": spec.T_L, "k": spec.T_K, "n": spec.T_N}
    assert 1 < len(ranked) <= 5
    assert len({tuple(t.items()) for _, t in ranked}) == len(ranked)  # distinct plans
    keys = [k for k, _ in ranked[1:]]
    assert keys == sorted(keys)  # the others in the model's order


def test_fidelity_costs_the_codes_own_tiles_and_reranks_stored_timings(tmp_path: Path) -> None:
    """The chosen plan is costed even where the code's tiles exceed what the model lets the
    planner hold (a conv band the code sizes itself), and `--rerank` costs a run's plans again
    with this model, keeping their measured times."""
    from chainfuse.bench import workloads
    from chainfuse.compiler import compile, compile_conv
    from chainfuse.hardware import resolve

    hw = resolve(None)
    conv = compile_conv(workloads.chain_of("darknet-19-b", "relu"), hw, threads=1)
    cost = fidelity.coster(conv, hw, 1)
    huge = {"p2": conv.shape.P2}
    assert cost(huge) is None and cost(huge, fit=False) is not None  # all 28 rows: too many
    ranked = fidelity.conv_candidates(conv, hw, 1, 5)
    assert ranked[0][1] == conv.tiles.band_rows and math.isfinite(ranked[0][0][0])

    kernel = compile(workloads.chain_of("mixer-s-32-s", "relu"), hw, threads=1)
    ranked_g = fidelity.candidates(kernel, hw, 1, 3)
    names = {v: k for k, v in fidelity._code_loops(kernel).items()}
    labels = [" ".join(f"{names[n]}={v}" for n, v in t.items()) for _, t in ranked_g]
    stored = Fidelity("gemm-chain", "mixer-s-32-s", "relu", labels, [9.0, 8.0, 7.0],
                      [0.0] * 3, [1.0, 2.0, 3.0], [9.0, 8.0, 7.0], 0.5)  # fmt: skip
    again = fidelity.rerank([stored], hw)[0]
    assert again.measured_ms == stored.measured_ms and again.repeat_rho == 0.5
    assert again.predicted_ms == pytest.approx([k[0] * 1e3 for k, _ in ranked_g])
    (tmp_path / "run.json").write_text(json.dumps({"fidelity": [stored.to_dict()]}))
    assert fidelity.main(["--rerank", str(tmp_path / "run.json")]) == 0
    with pytest.raises(SystemExit):
        fidelity.main(["--rerank", str(tmp_path / "missing.json")])


@pytest.mark.parametrize("name", ["padded-512", "bool-512", "causal-1024", "causal-mask-1024",
                                  "window-2048"])  # fmt: skip
def test_masked_attention_cases_time_the_same_computation_everywhere(name: str) -> None:
    # the masked cases' SDPA, unfused PyTorch and chainfuse calls all compute the case's chain
    # (a baseline that dropped the mask would make its speedup meaningless), on small sizes of
    # the same kinds; a causal case counts the flops of the scores it keeps
    pytest.importorskip("torch")
    import numpy as np

    from chainfuse import reference
    from chainfuse.bench import attention
    from chainfuse.builders import attention_chain

    _, _, _, causal, kind, shape = attention.MASKED[name]
    small = None if shape is None else tuple(9 if s > 1 else 1 for s in shape)
    chain = attention_chain(1, 2, 9, 9, 8, 8, causal=causal, mask=kind, mask_shape=small)
    inputs = reference.random_inputs(chain, seed=3)
    if name in attention.STRUCTURED:  # (the window scaled to 4 of the 9 keys)
        window = 4 if attention.STRUCTURED[name] else None
        inputs["mask"] = attention.structured_mask(9, window)
        keep = inputs["mask"][0, 0] == 0
        assert keep[8, 8] and keep[8, 5] and not keep[3, 4]
        assert keep[8, 4] == (window is None)
    args = [inputs[n] for n in ("Q", "K", "V", "mask") if n in inputs]
    want = reference.run(chain, inputs)["O"]
    fns = {**attention._torch_fns(args, causal), "chainfuse": attention._drop_in(args, causal)}
    for who, fn in fns.items():
        try:
            reference.assert_close(np.asarray(fn()), want, chain)
        except AssertionError as e:
            raise AssertionError(f"{who}: {e}") from None
    assert attention.variant(name) == ("causal" if causal else kind)
    full = attention_chain(1, 2, 9, 9, 8, 8)
    expect = full.flops() * (45 / 81 if causal else 1)
    assert math.isclose(attention.useful_gflop(chain) * 1e9, expect)


def test_attention_headline_figures_keep_the_extra_cases_out_of_the_paper_set() -> None:
    from chainfuse.bench import attention

    def case(name: str, chainfuse_ms: float, sdpa_ms: float) -> Result:
        r = _result("attention", name, ms={"chainfuse": chainfuse_ms, "sdpa": sdpa_ms})
        r.baselines = ("sdpa",)
        return r

    results = [case("bert-base", 1.0, 1.5), case("vit-base-16", 1.0, 1.2),
               case("seq-64", 1.0, 1.1), case("decode-512", 1.0, 1.05),
               case(attention.LONG[0][0], 1.0, 0.9), case("causal-1024", 1.0, 1.7)]  # fmt: skip
    got = attention.summarise(results, peak=1.0)["1t"]
    assert got["paper_count"] == 2
    assert got["paper_geomean_vs_sdpa"] == pytest.approx(math.sqrt(1.5 * 1.2))
    assert got["paper_min_vs_sdpa"] == pytest.approx(1.2)
    assert got["short_min_vs_best_torch"] == pytest.approx(1.1)
    assert got["decode_min_vs_best_torch"] == pytest.approx(1.05)
    assert got["long_min_vs_sdpa"] == pytest.approx(0.9)
    assert got["masked_min_vs_sdpa"] == pytest.approx(1.7)
    names = [c[0] for c in attention.cases()]
    assert attention.LONG[0][0] in names and attention.LONG[0][0] not in (
        c[0] for c in attention.cases(quick=True)
    )


def test_num_threads_sets_the_count_for_a_block_and_puts_the_callers_back() -> None:
    import chainfuse
    from chainfuse.runtime import num_threads, requested_num_threads

    for before in (None, 3):
        chainfuse.set_num_threads(before)
        try:
            with num_threads(1):
                assert chainfuse.get_num_threads() == 1
            assert requested_num_threads() == before
            with pytest.raises(RuntimeError), num_threads(2):
                raise RuntimeError
            assert requested_num_threads() == before
        finally:
            chainfuse.set_num_threads(None)
