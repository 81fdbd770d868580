"""The fuzz campaign (`chainfuse fuzz`, `chainfuse.bench.fuzz`): a bounded, seeded slice of it
must end with no failure, it must reach the edges it is for (NaN through relu, out= aliasing an
input, numpy subclasses, numpy-integer conv strides, ...), and the harness must tell each
outcome apart and rebuild any case from its seed and index."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chainfuse import builders
from chainfuse.bench import fuzz
from chainfuse.bench.fuzz_cases import Case

ROOT = Path(__file__).resolve().parents[2]
SEED = 47
SLICE = 300


@pytest.fixture(scope="module")
def campaign() -> fuzz.Summary:
    return fuzz.run(SLICE, seed=SEED, compact=True)


def test_the_slice_has_no_failures(campaign: fuzz.Summary) -> None:
    failures = campaign.failures
    assert not failures, (
        f"{len(failures)} of {SLICE} cases failed:\n"
        + "\n".join(map(campaign.reproducer, failures))
        + "\n\n"
        + campaign.table()
    )


def test_the_slice_reaches_the_edges(campaign: fuzz.Summary) -> None:
    """Each edge below is drawn at least once by the slice (a change of the drawing that drops
    one fails here, not silently)."""
    seen: collections.Counter[tuple[str, ...]] = collections.Counter()
    for r in campaign.results:
        feats = set(r.features)
        for need in _EDGES:
            op, dtype, *wanted = need
            if r.op == op and (dtype == "*" or r.dtype == dtype) and feats.issuperset(wanted):
                seen[need] += 1
    missing = [need for need in _EDGES if not seen[need]]
    assert not missing, f"the slice never draws: {missing}"


_EDGES: list[tuple[str, ...]] = [
    *((op, dtype) for op in ("gemm_chain", "attention") for dtype in fuzz.DTYPES),
    ("conv_chain", "float32"),
    ("gemm_chain", "*", "relu", "nan"),
    ("gemm_chain", "*", "inf"),
    ("gemm_chain", "float16", "large"),
    ("gemm_chain", "*", "out-alias"),
    ("gemm_chain", "*", "out-overlap"),
    ("gemm_chain", "*", "bcast_view"),
    ("gemm_chain", "*", "negstride"),
    ("gemm_chain", "*", "compile"),
    ("gemm_chain", "*", "torch"),
    ("gemm_chain", "*", "mlp"),
    ("attention", "*", "nan"),
    ("attention", "*", "gqa"),
    ("attention", "*", "causal"),
    ("attention", "*", "mask-bool"),
    ("attention", "*", "mask-additive"),
    ("attention", "*", "masked-rows"),
    ("attention", "*", "sdpa"),
    ("attention", "*", "compile"),
    ("attention", "*", "permuted"),
    ("conv_chain", "*", "between-relu", "nan"),
    ("conv_chain", "*", "x-channels_last"),
    ("conv_chain", "*", "np-int"),
    ("conv_chain", "*", "stride"),
    ("conv_chain", "*", "compile"),
]


def test_a_case_is_rebuilt_from_its_seed_and_index() -> None:
    for index in range(20):
        one, two = fuzz.draw(SEED, index), fuzz.draw(SEED, index)
        assert one.describe == two.describe
        np.testing.assert_array_equal(one.expected, two.expected)


def test_drawing_subclasses_and_memmaps() -> None:
    """Edge operands only `--cases 10000` might meet are drawn by some case of a short run."""
    feats = {f for i in range(800) for f in fuzz.draw(1, i).features}
    assert {"memmap", "subclass", "out-alias", "unbatched", "rank5", "rank2"} <= feats


# -- the harness's verdicts, on cases made by hand ------------------------------------------------


def _case(call: Any, expected: np.ndarray, dtype: str = "float32", **kw: Any) -> Case:
    chain = builders.gemm_chain(1, 2, 2, 2, 2, None, dtype)
    return Case("gemm_chain", dtype, (), [], call, expected, chain, frozenset({"A", "out"}),
                "", **kw)  # fmt: skip


def _raises(exc: Exception) -> Any:
    def call() -> Any:
        raise exc

    return call


def test_outcomes_are_told_apart() -> None:
    want = np.ones((1, 2, 2))
    assert fuzz.judge(_case(lambda: want.copy(), want))[0] is fuzz.Outcome.OK
    wrong = fuzz.judge(_case(lambda: want + 0.01, want))
    assert wrong[0] is fuzz.Outcome.WRONG and "not close" in wrong[1]
    nan = fuzz.judge(_case(lambda: np.where(want > 0, np.nan, 0), want))
    assert nan[0] is fuzz.Outcome.WRONG
    named = ValueError("out: the output array is read-only")
    assert fuzz.judge(_case(_raises(named), want, may_refuse=True))[0] is fuzz.Outcome.REFUSED
    refused = fuzz.judge(_case(_raises(named), want))  # a valid call refused
    assert refused[0] is fuzz.Outcome.CRASH and "refused a valid call" in refused[1]
    unnamed = TypeError("'float' object is not iterable")
    assert fuzz.judge(_case(_raises(unnamed), want, may_refuse=True))[0] is fuzz.Outcome.UNCLEAR
    other = AttributeError("A: 'memmap' object has no attribute 'stride'")
    assert fuzz.judge(_case(_raises(other), want, may_refuse=True))[0] is fuzz.Outcome.CRASH


def test_nan_and_inf_are_compared_with_pytorchs() -> None:
    want = np.array([[[1.0, np.nan], [np.inf, 2.0]]])
    same = want.copy()
    ok = _case(lambda: same, want, oracle=lambda: same)
    assert fuzz.judge(ok)[0] is fuzz.Outcome.OK
    theirs = np.array([[[1.0, np.nan], [np.nan, 2.0]]])  # PyTorch: NaN where the reference: inf
    differs = fuzz.judge(_case(lambda: same, want, oracle=lambda: theirs))
    assert differs[0] is fuzz.Outcome.WRONG and "PyTorch" in differs[1]
    # 16-bit: PyTorch's unfused chain rounds its intermediate (it may pass the range's top);
    # a result with the reference's inf there is the documented difference, counted once
    half = fuzz.judge(_case(lambda: same, want, "bfloat16", oracle=lambda: theirs))
    assert half[0] is fuzz.Outcome.DOCUMENTED and half[1].startswith("1 elements")
    wrong = np.array([[[1.0, np.nan], [np.nan, 2.0]]])  # (NaN where the reference has inf)
    assert fuzz.judge(_case(lambda: wrong, want, "bfloat16", oracle=lambda: same))[0] is (
        fuzz.Outcome.WRONG
    )


def test_float16_results_past_its_range_are_inf() -> None:
    want = np.array([[[1.0e5, -1.0e5], [1.0, 60000.0]]])  # the first two overflow float16
    overflowed = np.array([[[np.inf, -np.inf], [1.0, 60000.0]]])
    assert fuzz.judge(_case(lambda: overflowed, want, "float16"))[0] is fuzz.Outcome.OK
    clipped = np.array([[[65504.0, -65504.0], [1.0, 60000.0]]])
    assert fuzz.judge(_case(lambda: clipped, want, "float16"))[0] is fuzz.Outcome.WRONG


def test_out_must_hold_the_result() -> None:
    want = np.ones((1, 2, 2))
    out = np.zeros((1, 2, 2))
    verdict = fuzz.judge(_case(lambda: want.copy(), want, out=out))
    assert verdict[0] is fuzz.Outcome.WRONG and "out=" in verdict[1]


def test_isolate_reports_a_dead_worker_as_that_cases_crash(monkeypatch: Any) -> None:
    def segfault(*args: Any) -> Any:
        os.kill(os.getpid(), signal.SIGSEGV)

    monkeypatch.setattr(fuzz, "_BUILDERS", dict.fromkeys(fuzz.OPS, segfault))
    summary = fuzz.run(2, seed=0, isolate=True, timeout=60)
    assert [r.outcome for r in summary.results] == [fuzz.Outcome.CRASH] * 2
    assert all("died" in r.message for r in summary.results)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "chainfuse", "fuzz", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600, check=False)  # fmt: skip


def test_the_command_prints_the_table_and_reruns_a_case() -> None:
    proc = _cli("--cases", "4", "--seed", str(SEED), "--compact")
    assert "tried" in proc.stdout and "4 cases in" in proc.stdout, proc.stderr
    assert proc.returncode == (1 if "failures:" in proc.stdout else 0)
    one = _cli("--seed", str(SEED), "--case", "2", "--compact")
    assert f"case 2 of seed {SEED}" in one.stdout and "strides=" in one.stdout, one.stderr
    assert "outcome:" in one.stdout
