"""What the backend's fuse-or-not decisions measure in mode "inductor": each chain against
Inductor's code for its unfused nodes (an Inductor compile of them; where that fails, the nodes
run eagerly, with the reason in the decision), then the whole rewritten graph against the plain
one, both compiled by Inductor, keeping the faster; both answers kept on disk.

The timings are injected (`compare` replaced), so that each test decides what is faster and
fails where the backend keeps the other; the compiles and the outputs are real.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cft = pytest.importorskip("chainfuse.torch")

from chainfuse.torch import backend as backend_mod  # noqa: E402
from chainfuse.torch import decide as decide_mod  # noqa: E402
from chainfuse.torch import guard  # noqa: E402
from chainfuse.torch.backend import Backend, Options, Report  # noqa: E402

nn = torch.nn


def _mlp() -> Any:
    """An MLP with no bias on the first GEMM (a chain every chainfuse build fuses) after an
    embedding (so that the graph's input, token ids, is the same at every dtype)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 256, bias=False), nn.ReLU(),
                         nn.Linear(256, 64)).eval()  # fmt: skip


X = torch.randint(0, 100, (2, 17))


class Compiles:
    """`compile_graph` spied on: what each compile was (a chain's baseline, `isolated`; a
    whole graph with or without chainfuse's operator) and how often each result ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_baseline: bool = False,
                 fail_plain: bool = False) -> None:  # fmt: skip
        self.made: list[tuple[bool, bool]] = []  # (isolated, has a chainfuse operator)
        self.runs: dict[bool, int] = {True: 0, False: 0}  # graph with chainfuse's op -> calls
        self.fail_baseline, self.fail_plain = fail_baseline, fail_plain
        self.real = guard.compile_graph
        monkeypatch.setattr(backend_mod, "compile_graph", self.compile)

    def compile(self, gm: Any, inputs: Any, freeze: bool, isolated: bool = False) -> Any:
        rewritten = "chainfuse" in gm.code
        self.made.append((isolated, rewritten))
        assert freeze  # (the backend's default: the weights are constants)
        if isolated and self.fail_baseline:
            raise RuntimeError("injected failure")
        if not isolated and not rewritten and self.fail_plain:
            raise RuntimeError("injected failure")
        compiled = self.real(gm, inputs, freeze, isolated)
        if isolated:
            return compiled

        def run(*args: Any) -> Any:
            self.runs[rewritten] += 1
            return compiled(*args)

        return run


def _times(monkeypatch: pytest.MonkeyPatch, chain: tuple[float, float] | None,
           graph: tuple[float, float] | None) -> list[str]:  # fmt: skip
    """Inject the measured (fused, baseline) and (rewritten, plain) seconds; None: timing that
    one fails the test. Returns the log of what was timed."""
    log: list[str] = []

    def fake(name: str, times: tuple[float, float] | None) -> Any:
        def compare(first: Any, second: Any, budget_s: float = 0.3, rounds: int = 3) -> Any:
            # (stands for `decide.compare` and for the graph check's `decide.paired`)
            assert times is not None, f"the {name} was timed, not recalled"
            log.append(name)
            return times

        return compare

    monkeypatch.setattr(decide_mod, "compare", fake("chain", chain))
    monkeypatch.setattr(guard, "paired", fake("graph", graph))
    return log


def _compile_and_run(report: Report, dtype: Any = torch.float32, **options: Any) -> Any:
    torch._dynamo.reset()
    model, x = _mlp().to(dtype), X
    # (parameters as graph inputs: the backend makes them constants and maps the inputs)
    compiled = torch.compile(model, backend=Backend(Options(**options), report), fullgraph=True)
    with torch.no_grad():
        got = compiled(x)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, model(x), rtol=tol, atol=tol)
        return compiled


def test_chains_are_timed_against_inductor_and_the_faster_graph_is_kept(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    compiles = Compiles(monkeypatch)
    log = _times(monkeypatch, chain=(1.0, 2.0), graph=(1.0, 1.5))
    report = Report()
    compiled = _compile_and_run(report)
    (chain,) = report.chains
    assert chain.fused and chain.decision is not None
    assert chain.why == "fused call 2.00x as fast as Inductor's code for the unfused ops"
    assert chain.decision.against == "Inductor's code for the unfused ops"
    # the chain's baseline compiled apart, then both whole graphs
    assert compiles.made == [(True, False), (False, True), (False, False)]
    assert log == ["chain", "graph"]
    (check,) = report.graph_checks
    assert check.kept_rewritten and not check.cached and "1.50x" in check.why
    with torch.no_grad():
        compiled(X)
    assert compiles.runs[True] >= 1 and compiles.runs[False] == 0

    # a second compile of the same model recalls both answers: nothing timed, one compile
    compiles.made.clear()
    again = Report()
    _times(monkeypatch, chain=None, graph=None)
    _compile_and_run(again)
    assert again.chains[0].fused and again.chains[0].decision.cached  # type: ignore[union-attr]
    assert again.graph_checks[0].cached and again.graph_checks[0].kept_rewritten
    assert compiles.made == [(False, True)]

    # the same graph with bfloat16 weights (its code and inputs unchanged) is timed again
    log = _times(monkeypatch, chain=(1.0, 2.0), graph=(1.0, 1.5))
    _compile_and_run(Report(), dtype=torch.bfloat16)
    assert log == ["chain", "graph"]


def test_a_slower_rewritten_graph_is_dropped_and_a_failing_baseline_is_reported(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    compiles = Compiles(monkeypatch, fail_baseline=True)
    _times(monkeypatch, chain=(1.0, 2.0), graph=(1.2, 1.0))
    report = Report()
    compiled = _compile_and_run(report)
    (chain,) = report.chains
    assert chain.decision is not None and chain.decision.fuse  # the chain alone: faster
    assert not chain.fused and "whole-graph check kept it plain" in chain.why
    assert "as fast as the unfused ops run eagerly (Inductor failed on them: RuntimeError: " \
           "injected failure)" in chain.why  # fmt: skip
    (check,) = report.graph_checks
    assert not check.kept_rewritten and "the plain graph kept" in check.why
    assert check.rewritten_s == 1.2 and check.plain_s == 1.0
    runs = dict(compiles.runs)
    with torch.no_grad():
        compiled(X)
    assert compiles.runs[False] == runs[False] + 1 and compiles.runs[True] == runs[True]


def test_a_plain_graph_inductor_fails_on_leaves_the_rewritten_one(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    compiles = Compiles(monkeypatch, fail_plain=True)
    _times(monkeypatch, chain=(1.0, 2.0), graph=None)
    report = Report()
    _compile_and_run(report)
    (check,) = report.graph_checks
    assert check.kept_rewritten and check.rewritten_s is None
    assert "the plain graph failed to compile (RuntimeError: injected failure)" in check.why
    assert report.chains[0].fused and compiles.runs[True] == 1


def test_no_inductor_timing_in_eager_mode_or_without_measuring(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    compiles = Compiles(monkeypatch)
    log = _times(monkeypatch, chain=(1.0, 2.0), graph=None)
    report = Report()
    _compile_and_run(report, mode="eager")
    assert report.chains[0].why == "fused call 2.00x as fast as the unfused ops"
    assert log == ["chain"] and not compiles.made and not report.graph_checks
    report = Report()
    _compile_and_run(report, measure=False)
    assert report.chains[0].fused and not report.graph_checks
    assert compiles.made == [(False, True)]


def test_explain_names_each_baseline_and_the_graph_check(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    _times(monkeypatch, chain=(1.0, 2.0), graph=(1.2, 1.0))
    torch._dynamo.reset()
    text = str(cft.explain(_mlp(), X, show=False, rounds=1))
    assert "fused call 2.00x as fast as Inductor's code for the unfused ops" in text
    assert "whole-graph check" in text and "[plain]" in text and "the plain graph kept" in text


def test_compare_alternates_and_times_each_at_least_three_times() -> None:
    calls: list[str] = []

    def call(name: str, seconds: float) -> Any:
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    slow, fast = decide_mod.compare(call("a", 2e-3), call("b", 0.0), budget_s=1e-3)
    assert slow > fast and slow >= 2e-3
    assert calls[:2] == ["a", "b"]  # a warm-up call each, then batches taken in turns
    batches = [name for i, name in enumerate(calls[2:]) if i == 0 or calls[2:][i - 1] != name]
    assert batches[:6] == ["a", "b"] * 3 and batches == ["a", "b"] * (len(batches) // 2)


def test_graphs_that_write_their_inputs_are_not_timed_whole() -> None:
    def writes(x: Any, y: Any) -> Any:
        x.add_(1)
        return y.relu()

    def pure(x: Any, y: Any) -> Any:
        return (x + 1).relu_() + y

    assert backend_mod._writes_state(torch.fx.symbolic_trace(writes).graph)
    assert not backend_mod._writes_state(torch.fx.symbolic_trace(pure).graph)


@pytest.mark.parametrize("via", ["paired", "compare"])
def test_paired_swaps_the_order_every_round_and_reads_the_rounds_ratios(
    via: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paired` (the whole-graph check's timing), and `compare` (a chain's) for calls too long
    to batch: the order swapped every round, the median of the rounds' ratios, at least five."""
    calls: list[str] = []
    now = [0.0]
    seconds = {"a": 3.0, "b": 2.0}  # each call of a or b takes this; nothing else takes time

    def timed(name: str) -> Any:
        def run() -> None:
            calls.append(name)
            now[0] += seconds[name]

        return run

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    if via == "paired":
        first, second = decide_mod.paired(timed("a"), timed("b"), budget_s=0.0, rounds=5)
    else:  # (a sizing call of each first)
        first, second = decide_mod.compare(timed("a"), timed("b"), budget_s=0.3)
        assert calls[:2] == ["a", "b"]
        del calls[:2]
    assert calls[:4] == ["a", "b", "a", "b"]  # the warm-up
    assert calls[4:] == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b"]
    assert first == pytest.approx(3.0) and second == pytest.approx(2.0)


def test_a_rewritten_graph_not_measured_slower_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    # (each chain already beat Inductor's code for its nodes; the whole graph only has to not
    # be measured slower by more than a whole call's noise)
    _times(monkeypatch, chain=(1.0, 2.0), graph=(1.01, 1.0))
    report = Report()
    _compile_and_run(report)
    assert report.graph_checks and report.graph_checks[0].kept_rewritten


def test_conv_chains_are_timed_channels_last_as_inductor_runs_them(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NCHW model whose convolutions Inductor runs channels-last (its layout optimization):
    the chain's decision times both sides on channels-last images, as the rewritten graph
    passes them to the operator (whose layout is flexible: Inductor does not copy them back to
    NCHW); the output is eager's either way."""
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    Compiles(monkeypatch)
    _times(monkeypatch, chain=(1.0, 2.0), graph=(1.0, 1.5))
    seen: list[bool] = []
    real_decide = backend_mod.decide

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(bool(args[0][-1]))  # (the key's last part: timed channels-last)
        return real_decide(*args, **kwargs)

    monkeypatch.setattr(backend_mod, "decide", spy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(8, 48, 1), nn.ReLU6(), nn.Conv2d(48, 48, 3, padding=1, groups=48),
                        nn.ReLU6()).eval()  # fmt: skip
    x = torch.randn(1, 8, 12, 12)
    report = Report()
    torch._dynamo.reset()
    compiled = torch.compile(net, backend=Backend(Options(), report), fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), net(x), rtol=1e-5, atol=1e-5)
    assert seen == [True] and report.chains[0].fused
    assert torch.Tag.flexible_layout in torch.ops.chainfuse.conv_chain.default.tags
