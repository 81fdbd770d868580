"""Fuse or not: time the fused call against what would run without it, on the graph's own shapes.

The baseline is what the user gets without chainfuse: with the backend's mode "inductor", the
chain's nodes compiled by Inductor as the whole graph is compiled (freezing on where the weights
are constants: packed MKL weights, oneDNN's fused bias and activation); with mode "eager", the
nodes run by PyTorch. The caller names the baseline (`against`); it appears in the decision's
`why`. The two are timed alternately (`compare`), the best batch of each; the fused call must
take at most `MARGIN` of the baseline's time and give the same numbers within a loose sanity
bound, else the chain stays unfused. The margin is none: alone, a chain's weights stay in cache
between timed calls, in the model they come from memory, where the fused call gains more (a
ViT-384 MLP timed at 1.01x alone was worth 10 % of the model at 2 threads), and the whole-graph
check (`guard.check_graph`) is what keeps a model from being made slower. The decision is kept
on disk beside the kernel cache (`<cache_dir>/decisions/`), keyed by everything the timing
depends on, so a second compile of the same model on the same host decides without timing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chainfuse import builders, config, planner
from chainfuse.runtime import cache
from chainfuse.runtime.files import write_atomic

__all__ = [
    "MARGIN",
    "Decision",
    "compare",
    "decide",
    "decision_key",
    "paired",
    "predicted_time",
    "recall",
    "remember",
    "time_call",
]

#: the fused call is kept where it takes at most this share of the baseline's time (module
#: docstring; docs/performance.md)
MARGIN = 1.0
_VERSION = 5  # of the decision record: bumped when what is measured changes


@dataclass(frozen=True)
class Decision:
    fuse: bool
    why: str
    fused_s: float | None = None
    baseline_s: float | None = None
    predicted_s: float | None = None
    cached: bool = False
    against: str = "the unfused ops"  # the baseline, in words


def time_call(fn: Callable[[], Any], budget_s: float = 0.02) -> float:
    """Seconds per call of `fn`: calls are batched to fill `budget_s`, best batch of three."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    reps = max(1, min(1000, int(budget_s / once)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def compare(
    first: Callable[[], Any], second: Callable[[], Any], budget_s: float = 0.3, rounds: int = 3
) -> tuple[float, float]:
    """Seconds per call of `first` and of `second`, timed alternately (a busy host slows both
    alike): batches of calls, at least `rounds` batches of each and more while `budget_s`
    lasts; the best batch of each. Calls longer than their share of the budget are timed one
    by one in paired rounds (`paired`, at least 5 rounds, up to 1 s)."""
    once = []
    for fn in (first, second):  # (a warm-up call each, which also sizes the batches)
        start = time.perf_counter()
        fn()
        once.append(max(time.perf_counter() - start, 1e-7))
    slot = budget_s / (4 * rounds)  # the required rounds take half of the budget
    reps = [max(1, min(1000, int(slot / t))) for t in once]
    if reps == [1, 1]:
        # calls too long to batch (a model's MLP): the best of three single calls each read
        # one slow moment as the answer (a gated MLP 0.97x, then 1.14x a minute later); the
        # median of paired rounds' ratios does not
        return paired(first, second, max(budget_s, 1.0), max(rounds, 5))
    best = [float("inf"), float("inf")]
    start = time.perf_counter()
    done = 0
    while done < rounds or (done < 20 and (time.perf_counter() - start) * (done + 1) / done
                            <= budget_s):  # fmt: skip
        for i, fn in enumerate((first, second)):
            began = time.perf_counter()
            for _ in range(reps[i]):
                fn()
            best[i] = min(best[i], (time.perf_counter() - began) / reps[i])
        done += 1
    return best[0], best[1]


def paired(
    first: Callable[[], Any], second: Callable[[], Any], budget_s: float = 2.0, rounds: int = 5
) -> tuple[float, float]:
    """Seconds per call of `first` and of `second` for calls too long to batch (whole graphs):
    one call of each a round, the order swapped every round, at least `rounds` rounds and more
    while `budget_s` lasts (up to 15). `first`'s median, and `second`'s as `first`'s over the
    median of the rounds' ratios: a round's two calls see the same moment of a drifting host,
    which two separate medians or minima do not."""
    for fn in (first, second, first, second):  # (warm-up: a fresh graph's first calls allocate)
        fn()
    times: tuple[list[float], list[float]] = ([], [])
    start = time.perf_counter()
    done = 0
    while done < rounds or (done < 15 and time.perf_counter() - start < budget_s):
        order = ((0, first), (1, second)) if done % 2 == 0 else ((1, second), (0, first))
        for i, fn in order:
            began = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - began)
        done += 1
    ratio = statistics.median(a / b for a, b in zip(*times, strict=True))
    mine = statistics.median(times[0])
    return mine, mine / ratio


def _path(key: str) -> Path:
    return config.cache_dir() / "decisions" / key[:2] / f"{key}.json"


def decision_key(parts: Sequence[Any]) -> str:
    """The cache key of a decision: what was timed and where (host, threads, versions, and the
    code generators: a decision is timed again when the kernel it timed would change)."""
    from chainfuse import __version__

    host = cache._host_fingerprint()
    code = cache._generator_fingerprint()
    text = json.dumps([_VERSION, __version__, torch.__version__, host, code, _calls_fingerprint(),
                       *parts], default=str)  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _calls_fingerprint() -> str:
    """The files that decide what a fused chain runs besides its kernel: the rewrite (what is
    emitted around the call) and the operators (how a call reaches the kernel)."""
    root = Path(__file__).parent.parent
    files = sorted([*(root / "torch").glob("*.py"), *(root / "ops").glob("*.py")])
    return cache.files_fingerprint(files)


def _close(got: Any, want: Any) -> bool:
    """A sanity bound on the fused result (the numerics are tested against the float64
    reference; this catches a wrongly wired rewrite before it is kept)."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return False
    if got.shape != want.shape:
        return False
    g, w = got.double(), want.double()
    nan = w.isnan()
    if not torch.equal(g.isnan(), nan):
        return False
    g, w = g.masked_fill(nan, 0.0), w.masked_fill(nan, 0.0)  # (NaN where the unfused has NaN)
    tol = 2e-2 if want.dtype in (torch.bfloat16, torch.float16) else 1e-3
    return bool(((g - w).abs().max() <= tol * max(1.0, float(w.abs().max()))).item())


def recall(key_parts: Sequence[Any]) -> dict[str, Any] | None:
    """The record kept on disk under `key_parts` (None where there is none, or it is damaged)."""
    path = _path(decision_key(key_parts))
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def remember(key_parts: Sequence[Any], record: dict[str, Any]) -> None:
    """Keep `record` on disk under `key_parts` (written atomically)."""
    path = _path(decision_key(key_parts))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record).encode())


def decide(
    key_parts: Sequence[Any],
    fused: Callable[[], Any],
    baseline: Callable[[], Any],
    predicted_s: float | None,
    measure: bool = True,
    timed: Callable[[], tuple[Callable[[], Any], str]] | None = None,
    timed_fused: Callable[[], Callable[[], Any]] | None = None,
) -> Decision:
    """Time `fused` against the baseline (interleaved), keep the faster, remember the answer.

    `baseline` runs the unfused ops: the fused result is checked against its result, and it
    is the call timed unless `timed` is given: a function returning the call to time and its
    name in words, called only where a decision is timed (so that a costly baseline, an
    Inductor compile, is not built where the decision is recalled); `timed_fused` likewise
    gives the fused call to time where it is not `fused` itself. `measure=False` fuses
    without timing (the fused result is still checked)."""
    if measure:
        found = recall(key_parts)
        if found is not None:
            try:
                # (the model's prediction is today's: a record may predate it)
                return Decision(**{**found, "cached": True, "predicted_s": predicted_s})
            except TypeError:
                pass  # a record of another layout: decide again
    try:
        got = fused()
    except (RuntimeError, ValueError, TypeError) as exc:
        return Decision(False, f"the fused call failed: {exc}", predicted_s=predicted_s)
    want = baseline()
    if not _close(got, want):
        return Decision(False, "the fused result differs from the unfused one",
                        predicted_s=predicted_s)  # fmt: skip
    if not measure:
        return Decision(True, "fused without timing (measure=False)", predicted_s=predicted_s)
    call, against = timed() if timed is not None else (baseline, "the unfused ops")
    f, b = compare(timed_fused() if timed_fused is not None else fused, call)
    fuse = f <= MARGIN * b
    why = f"fused call {b / f:.2f}x as fast as {against}" + ("" if fuse else ": kept unfused")
    result = Decision(fuse, why, f, b, predicted_s, against=against)
    record = asdict(result)
    record.pop("cached")
    remember(key_parts, record)
    return result


def predicted_time(kind: str, dims: dict[str, Any], dtype: torch.dtype) -> float | None:
    """The planner's predicted time of the fused chain (None where the planner has no builder
    for it or refuses the chain)."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    try:
        if kind == "mlp":
            chain = builders.gemm_chain(1, dims["M"], dims["N"], dims["K"], dims["L"],
                                        dims["between"], name[dtype])  # fmt: skip
        elif kind == "gated_mlp":  # (planned as the kernel is: `planned_part`)
            chain = builders.planned_part(
                builders.gated_mlp_chain(
                    1, dims["M"], dims["N"], dims["K"], dims["L"], dims["between"], name[dtype]
                )
            )
        elif kind == "attention":
            chain = builders.attention_chain(
                dims["batch"], dims["heads"], dims["seq_q"], dims["seq_k"], dims["d"],
                dims["dv"], causal=dims["causal"], dtype=name[dtype],
            )  # fmt: skip
        else:
            return None
        return float(planner.plan(chain, threads=torch.get_num_threads()).predicted_time_s)
    except (ValueError, KeyError, TypeError):
        return None
