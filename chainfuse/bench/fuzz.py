"""A fuzz campaign over every public op: random calls checked against the float64 reference and,
where PyTorch defines which elements are NaN or inf, against PyTorch's own ops.

    chainfuse fuzz --cases 10000 [--seed S] [--ops gemm_chain,attention] [--dtypes float32]
    chainfuse fuzz --seed S --case N        # rerun one case, printing its operands

Case N of seed S is drawn from its own random stream (`numpy.random.default_rng([S, N])`), so
it is rebuilt exactly from (S, N) and the same --ops and --dtypes. Each case ends as one of:
ok; refused (a TypeError/ValueError naming an argument, where the op may refuse that input);
wrong (a result off the reference's tolerance, or NaN/inf where PyTorch has none or the other
way round); crash (any other exception, or a valid call refused); unclear (a TypeError or
ValueError that names no argument). The last three are failures. The campaign runs in this
process (`--isolate`: each case in a forked worker, so a segfault or hang is that case's crash).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import multiprocessing
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chainfuse import ops, reference
from chainfuse.bench.fuzz_attention import attention_case
from chainfuse.bench.fuzz_cases import Case, pick
from chainfuse.bench.fuzz_conv import conv_case
from chainfuse.bench.fuzz_gated import gated_case
from chainfuse.bench.fuzz_gemm import gemm_case
from chainfuse.bench.fuzz_values import as_float64, overflow_of, torch_or_none

__all__ = ["DTYPES", "OPS", "Outcome", "Result", "Summary", "draw", "judge", "main", "run"]

OPS = ("gemm_chain", "attention", "conv_chain", "gated_mlp")
DTYPES = ("float32", "bfloat16", "float16")
_BUILDERS = {"gemm_chain": gemm_case, "attention": attention_case, "conv_chain": conv_case,
             "gated_mlp": gated_case}  # fmt: skip
_ENTRIES = {"gemm_chain": ["ops", "torch", "compile"], "attention": ["ops", "torch", "sdpa", "compile"],
            "conv_chain": ["ops", "torch", "compile"], "gated_mlp": ["ops", "torch"]}  # fmt: skip
#: cases between progress lines, and between clearing the ops' kernel caches (memory stays flat)
EVERY = 500


class Outcome(enum.Enum):
    OK = "ok"
    REFUSED = "refused"
    WRONG = "wrong"
    CRASH = "crash"
    UNCLEAR = "unclear"
    SKIPPED = "skipped"
    #: a documented difference (README, limits): a NaN/inf in keys after a causal query, which
    #: the kernel does not read; or PyTorch's NaN/inf placement differs from the float64
    #: reference's (its answer depends on its path there), and the result has the reference's
    DOCUMENTED = "documented"

    @property
    def failed(self) -> bool:
        return self in (Outcome.WRONG, Outcome.CRASH, Outcome.UNCLEAR)


@dataclasses.dataclass(frozen=True)
class Result:
    """What one case did: its category (op, dtype, features) and outcome, with the message of a
    failure or refusal."""

    index: int
    op: str
    dtype: str
    features: tuple[str, ...]
    outcome: Outcome
    message: str = ""


@dataclasses.dataclass
class Summary:
    """A campaign's results, a table of them by category, and a reproducer per failure."""

    seed: int
    ops: tuple[str, ...]
    dtypes: tuple[str, ...]
    compact: bool
    results: list[Result]
    seconds: float

    @property
    def failures(self) -> list[Result]:
        return [r for r in self.results if r.outcome.failed]

    def counts(self) -> dict[tuple[str, str, str], collections.Counter[Outcome]]:
        """(op, dtype, feature) -> outcome counts; each case counts under every one of its
        features, and under "(all)"."""
        table: dict[tuple[str, str, str], collections.Counter[Outcome]] = {}
        for r in self.results:
            for feature in dict.fromkeys(("(all)", *r.features)):  # (each once per case)
                table.setdefault((r.op, r.dtype, feature), collections.Counter())[r.outcome] += 1
        return table

    def table(self) -> str:
        head = f"{'op':<11} {'dtype':<9} {'feature':<24} {'tried':>6} {'refused':>7} " \
               f"{'doc':>6} {'wrong':>6} {'crash':>6} {'unclear':>7}"  # fmt: skip
        lines = [head, "-" * len(head)]
        for (op, dtype, feature), c in sorted(self.counts().items()):
            tried = sum(c.values()) - c[Outcome.SKIPPED]
            lines.append(f"{op:<11} {dtype:<9} {feature:<24} {tried:>6} {c[Outcome.REFUSED]:>7} "
                         f"{c[Outcome.DOCUMENTED]:>6} {c[Outcome.WRONG]:>6} {c[Outcome.CRASH]:>6} "
                         f"{c[Outcome.UNCLEAR]:>7}")  # fmt: skip
        total = collections.Counter(r.outcome for r in self.results)
        lines.append(
            f"{len(self.results)} cases in {self.seconds:.1f} s: {total[Outcome.OK]} ok, "
            f"{total[Outcome.REFUSED]} refused, {total[Outcome.DOCUMENTED]} NaN/inf in unread"
            f" causal keys or as the reference (documented), {total[Outcome.WRONG]} wrong, "
            f"{total[Outcome.CRASH]} crash, {total[Outcome.UNCLEAR]} unclear, "
            f"{total[Outcome.SKIPPED]} skipped"
        )
        return "\n".join(lines)

    def reproducer(self, r: Result) -> str:
        """One line per failure: what failed, and the command that reruns exactly that case."""
        first = r.message.strip().splitlines()[0] if r.message.strip() else ""
        first = first if len(first) <= 240 else first[:237] + "..."
        return (f"case {r.index} ({r.outcome.value}, {r.op} {r.dtype} {','.join(r.features)}): "
                f"{first}\n    rerun: {rerun_command(self.seed, r.index, self.ops, self.dtypes, self.compact)}")  # fmt: skip


def rerun_command(
    seed: int, index: int, op_names: Sequence[str], dtypes: Sequence[str], compact: bool
) -> str:
    command = f"python -m chainfuse fuzz --seed {seed} --case {index}"
    if compact:
        command += " --compact"
    if tuple(op_names) != OPS:
        command += f" --ops {','.join(op_names)}"
    if tuple(dtypes) != DTYPES:
        command += f" --dtypes {','.join(dtypes)}"
    return command


class Skip(Exception):
    """A case this environment cannot draw (a bfloat16 case without torch, conv in 16-bit)."""


def draw(seed: int, index: int, op_names: Sequence[str] = OPS, dtypes: Sequence[str] = DTYPES,
         compact: bool = False) -> Case:  # fmt: skip
    """Case `index` of the campaign seeded `seed`, over `op_names` and `dtypes`; `compact`
    draws from fewer kernel structures (a short run compiles fewer kernels)."""
    rng = np.random.default_rng([seed, index])
    op = str(pick(rng, list(op_names)))
    torch = torch_or_none()
    allowed = [d for d in dtypes if (op != "conv_chain" or d == "float32")
               and (d != "bfloat16" or torch is not None)]  # fmt: skip
    if not allowed:
        raise Skip(f"{op}: no dtype of {', '.join(dtypes)} here")
    dtype = str(pick(rng, allowed))
    entries = [e for e in _ENTRIES[op] if torch is not None or e in ("ops", "compile")]
    return _BUILDERS[op](rng, dtype, entries, compact)


def names_argument(message: str, names: frozenset[str]) -> bool:
    """Whether an error message opens by naming an argument: "attn_mask: ...", "q, k, v: ..."."""
    head, colon, _ = message.partition(":")
    return (
        bool(colon)
        and len(head) <= 60
        and any(t in names for t in re.findall(r"[A-Za-z_]\w*", head))
    )


def judge(case: Case) -> tuple[Outcome, str]:
    """Run `case` and say how it ended (see the module's outcomes), with a message."""
    try:
        result = case.call()
    except (TypeError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
        if not names_argument(str(exc), case.names):
            return Outcome.UNCLEAR, message
        if case.may_refuse:
            return Outcome.REFUSED, message
        return Outcome.CRASH, f"refused a valid call: {message}"
    except Exception as exc:
        return Outcome.CRASH, f"{type(exc).__name__}: {exc}"
    actual = as_float64(result)
    expected = case.expected
    if actual.shape != expected.shape:
        return Outcome.WRONG, f"result shape {actual.shape}, expected {expected.shape}"
    if case.out is not None and result is not case.out:
        written = as_float64(case.out)
        if written.shape != actual.shape or not np.array_equal(written, actual, equal_nan=True):
            return Outcome.WRONG, "out= does not hold the result returned"
    rtol = reference.tolerance(case.chain)[0]
    edge = np.zeros(expected.shape, dtype=bool)
    if case.dtype == "float16":  # a result past float16's range is inf, as PyTorch's is
        top = overflow_of("float16")
        with np.errstate(invalid="ignore"):
            edge = np.abs(np.abs(expected) - top) <= 4 * rtol * top  # either side: either answer
            over = np.isfinite(expected) & (np.abs(expected) >= top) & ~edge
        expected = np.where(over, np.sign(expected) * np.inf, expected)
        expected = np.where(edge, actual, expected)
    shape = case.chain.outputs[0].shape  # (the softmax term of the bound has the chain's shape)
    skipped = _skipped_zeros(case, actual, expected)
    if skipped.any():  # judged as documented: those elements finite, every other as usual
        expected = np.where(skipped, actual, expected)
    try:
        reference.assert_close(actual.reshape(shape), expected.reshape(shape), case.chain,
                               inputs=case.inputs, peak=case.peak)  # fmt: skip
    except AssertionError as exc:
        return Outcome.WRONG, str(exc)
    if case.oracle is not None:
        theirs = case.oracle()
        skipped = (
            skipped
            | _skipped_zeros(case, actual, theirs)
            | _as_reference(actual, theirs, case, expected)
        )
        theirs = np.where(skipped, actual, theirs)
        bad = ~_same_specials(actual, theirs) & ~edge
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            return Outcome.WRONG, (
                f"NaN/inf differ from PyTorch's at {int(bad.sum())} of {bad.size} elements; "
                f"first at index {at}: actual {actual[at]!r}, PyTorch {theirs[at]!r}, reference "
                f"{case.expected[at]!r}"
            )
    if skipped.any():
        return Outcome.DOCUMENTED, (
            f"{int(skipped.sum())} elements as the README documents (keys a causal mask"
            " excludes, a row with no key, a NaN or inf as the reference's where PyTorch's"
            " differs)"
        )
    return Outcome.OK, ""


def _skipped_zeros(case: Case, actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Elements finite here but not in `expected`, in a case where that is the documented
    difference: NaN/inf in a causal attention, whose kernel does not read the keys after a
    query (the reference multiplies their values by 0)."""
    features = set(case.features)
    special = bool(features & {"nan", "inf"})
    skips = case.op == "attention" and "causal" in features
    if not (special and skips):
        return np.zeros(actual.shape, dtype=bool)
    found: np.ndarray = ~np.isnan(actual) & np.isnan(expected)
    found |= np.isfinite(actual) & ~np.isfinite(expected)
    return found


def _same_specials(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where x and y are alike in NaN, +inf and -inf."""
    same: np.ndarray = (np.isnan(x) == np.isnan(y)) & (np.isposinf(x) == np.isposinf(y))
    same &= np.isneginf(x) == np.isneginf(y)
    return same


def _as_reference(
    actual: np.ndarray, theirs: np.ndarray, case: Case, ref: np.ndarray
) -> np.ndarray:
    """Elements where PyTorch's NaN/inf placement differs from the float64 reference's (`ref`:
    past float16's range, its inf) and the result follows the reference: an attention row with no key (zeros; PyTorch's SDPA gives
    zeros or NaN by dtype and path), or a NaN or inf exactly where the reference has it (PyTorch
    drops some: its causal SDPA skips keys after a query, some of its convolutions skip padded
    taps; its 16-bit intermediate can round past the top of the range, as relu(x)² of an x
    in range)."""
    no_keys = (case.op == "attention") & np.isnan(theirs) & np.isfinite(ref) & np.isfinite(actual)
    # a NaN or inf exactly as the reference has it (PyTorch's differs: a NaN it drops, or its
    # 16-bit intermediate rounded past the top of the range)
    as_ref = _same_specials(actual, ref) & ~_same_specials(theirs, ref) & ~np.isfinite(ref)
    if case.dtype == "float32":  # (no 16-bit intermediate: only a NaN PyTorch drops)
        as_ref &= np.isnan(ref) & np.isfinite(theirs)
    else:  # its intermediate past the top (relu(x)² of an x in range), the true value finite:
        # the result is finite, and within the tolerance of the reference (checked before)
        as_ref |= ~np.isfinite(theirs) & np.isfinite(ref) & np.isfinite(actual)
    found: np.ndarray = no_keys | as_ref
    return found


def run_case(seed: int, index: int, op_names: Sequence[str] = OPS,
             dtypes: Sequence[str] = DTYPES, compact: bool = False) -> Result:  # fmt: skip
    """Draw and judge case `index` (a case that cannot be drawn here is skipped)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            case = draw(seed, index, op_names, dtypes, compact)
        except Skip as exc:
            return Result(index, "-", "-", (), Outcome.SKIPPED, str(exc))
        except Exception as exc:  # the harness's own fault: reported, the campaign goes on
            message = f"drawing the case failed (a fuzz harness bug): {type(exc).__name__}: {exc}"
            return Result(index, "harness", "-", (), Outcome.CRASH, message)
        try:
            outcome, message = judge(case)
        except Exception as exc:
            outcome = Outcome.CRASH
            message = f"judging the case failed (a fuzz harness bug): {type(exc).__name__}: {exc}"
    return Result(index, case.op, case.dtype, case.features, outcome, message)


def run(
    cases: int,
    seed: int = 0,
    op_names: Sequence[str] = OPS,
    dtypes: Sequence[str] = DTYPES,
    *,
    start: int = 0,
    compact: bool = False,
    isolate: bool = False,
    timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> Summary:
    """Run cases `start` .. `start + cases - 1` of the campaign seeded `seed`; `isolate` runs
    them in a forked worker (a segfault or a case past `timeout` seconds is that case's crash);
    `progress` gets a line every `EVERY` cases; `compact`: see `draw`."""
    unknown = [o for o in op_names if o not in OPS] + [d for d in dtypes if d not in DTYPES]
    if unknown or not op_names or not dtypes:
        raise ValueError(f"op_names, dtypes: expected some of {OPS} and {DTYPES}, got {unknown}")
    began = time.perf_counter()
    results: list[Result] = []
    args = (seed, tuple(op_names), tuple(dtypes), compact)
    worker = _Worker(args, timeout) if isolate else None
    try:
        for i in range(start, start + cases):
            if worker is not None:
                results.append(worker.run(i))
            else:
                results.append(run_case(seed, i, op_names, dtypes, compact))
            done = i - start + 1
            if done % EVERY == 0:
                if worker is None:
                    ops.calls.clear()
                if progress is not None:
                    bad = sum(r.outcome.failed for r in results)
                    progress(f"fuzz: {done}/{cases} cases, {time.perf_counter() - began:.1f} s, "
                             f"{bad} failures")  # fmt: skip
    finally:
        if worker is not None:
            worker.close()
    return Summary(seed, tuple(op_names), tuple(dtypes), compact, results,
                   time.perf_counter() - began)  # fmt: skip


class _Worker:
    """A forked process that runs cases one at a time; one that dies or hangs is replaced."""

    def __init__(self, args: tuple[int, tuple[str, ...], tuple[str, ...], bool],
                 timeout: float) -> None:  # fmt: skip
        self.args = args
        self.timeout = timeout
        self.context = multiprocessing.get_context("fork")
        self.process: Any = None
        self.pipe: Any = None

    def _start(self) -> None:
        parent, child = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(child, *self.args), daemon=True)
        self.process.start()
        child.close()
        self.pipe = parent

    def run(self, index: int) -> Result:
        if self.process is None:
            self._start()
        self.pipe.send(index)
        why = None
        try:
            if self.pipe.poll(self.timeout):
                answer: Result = self.pipe.recv()
                return answer
            why = f"no answer in {self.timeout:.0f} s (hung)"
        except EOFError:
            self.process.join(5)
            why = f"the worker died (exit code {self.process.exitcode})"
        self.close()
        return Result(index, "?", "?", ("isolated",), Outcome.CRASH, why)

    def close(self) -> None:
        if self.process is not None:
            if self.process.is_alive():
                self.process.kill()
            self.process.join(5)
            self.pipe.close()
        self.process = self.pipe = None


def _serve(
    pipe: Any, seed: int, op_names: tuple[str, ...], dtypes: tuple[str, ...], compact: bool
) -> None:
    done = 0
    while True:
        try:
            index = pipe.recv()
        except EOFError:
            return
        pipe.send(run_case(seed, index, op_names, dtypes, compact))
        done += 1
        if done % EVERY == 0:
            ops.calls.clear()


def _rerun(
    seed: int, index: int, op_names: Sequence[str], dtypes: Sequence[str], compact: bool
) -> int:
    """`--case N`: rebuild case N, print its call and operands, run it, print how it ended."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        try:
            case = draw(seed, index, op_names, dtypes, compact)
        except Skip as exc:
            print(f"case {index}: skipped: {exc}")
            return 0
        print(f"case {index} of seed {seed}: {case.op} {case.dtype} {','.join(case.features)}")
        call, _, operands = case.describe.partition("  ")
        print(f"  call: {call}")
        for line in operands.split("; "):
            print(f"  {line}")
        outcome, message = judge(case)
    print(f"  outcome: {outcome.value}" + (f": {message}" if message else ""))
    return 1 if outcome.failed else 0


def _names(text: str, known: Sequence[str], what: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: expected some of {','.join(known)}, got {text!r}"
        )
    return names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `fuzz` subcommand's options (the CLI's parser adds them)."""
    p.add_argument("--cases", type=int, default=1000, help="how many cases (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="the campaign's seed (default 0)")
    p.add_argument("--start", type=int, default=0, help="the first case's index (default 0)")
    p.add_argument("--case", type=int, default=None, metavar="N",
                   help="rerun case N only, printing its operands and the mismatch")  # fmt: skip
    p.add_argument("--ops", type=lambda t: _names(t, OPS, "--ops"), default=OPS,
                   help=f"ops to draw from (default {','.join(OPS)})")  # fmt: skip
    p.add_argument("--dtypes", type=lambda t: _names(t, DTYPES, "--dtypes"), default=DTYPES,
                   help=f"dtypes to draw from (default {','.join(DTYPES)})")  # fmt: skip
    p.add_argument("--compact", action="store_true",
                   help="draw from fewer kernel structures (short runs compile less)")  # fmt: skip
    p.add_argument("--isolate", action="store_true",
                   help="run each case in a forked worker: a segfault or hang is its crash")  # fmt: skip
    p.add_argument("--timeout", type=float, default=120.0, help="--isolate: seconds per case")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="also write the table and reproducers to DIR/fuzz.txt")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    """`chainfuse fuzz`: run the campaign, print the table and a reproducer per failure; exit
    status 1 if any case failed."""
    if args.case is not None:
        return _rerun(args.seed, args.case, args.ops, args.dtypes, args.compact)
    if args.cases < 1:
        raise ValueError(f"--cases: expected a positive count, got {args.cases}")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    summary = run(args.cases, args.seed, args.ops, args.dtypes, start=args.start,
                  compact=args.compact, isolate=args.isolate, timeout=args.timeout, progress=say)  # fmt: skip
    report = summary.table()
    failures = summary.failures
    if failures:
        report += f"\n\n{len(failures)} failures:\n" + "\n".join(map(summary.reproducer, failures))
    print(report)
    if args.out:
        from pathlib import Path

        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "fuzz.txt").write_text(report + "\n", encoding="utf-8")
    return 1 if failures else 0
