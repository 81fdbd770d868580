"""How well the model ranks plans: compile the planner's top plans, time them, compare.

For one chain the planner's choice is compiled, then the plans the model ranks right behind it:
the same block order with other code-level tiles (multiples of the micro-kernel's block around
the chosen ones, each costed by `model.estimate` over every level, capacity respected). The
top `k` by predicted time are compiled and timed interleaved on one thread; each plan's measured
time is the chosen plan's median times the median of its per-round ratios to the chosen plan
(`timing.paired_ms`): by their medians alone the least of ten close plans is mostly the one that
caught the quiet rounds (docs/performance.md). Two figures come out:

- Spearman's rank correlation between the model's ranking and the measured times (1: the model
  orders the plans exactly as the machine does; near 0: its ordering among these is noise).
  The model's predicted time is max(compute, memory) per plan, so compute-bound plans tie on
  it; the ranking breaks those ties by predicted memory time (the sum over levels of bytes over
  bandwidth, which is what the planner's per-level search minimises next to compute);
- the tuning gap: how much slower the planner's first choice is than the best of the `k`
  measured (0 %: an autotuner over these plans would have found nothing better).

Each record also keeps the model's time without the micro-kernel's efficiency terms
(`Cost.plain_s`, `model.efficiency`) and `rho_plain`, that ranking's rho against the same
measured times: the before/after of those terms within one run. The planner's choice, and so
the tuning gap, differs between model versions: ``python -m chainfuse.bench.fidelity --compare
BEFORE.json AFTER.json`` sets two bench runs' `results.json` side by side, per suite, with
the runs' own agreement: rho between their measured times of the plans both timed
(`run_agreement`). Two runs of one model on one host give the ceiling a model's rho can reach
there: plans a few per cent apart reorder from one process to the next
(docs/performance.md#model-and-planner).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from chainfuse import reference
from chainfuse.bench.timing import Timing, interleave, paired_ms
from chainfuse.compiler import ConvKernel, Kernel, compile, compile_conv
from chainfuse.hardware import Hardware, resolve
from chainfuse.ir import Chain
from chainfuse.model import Nest, code_level, estimate
from chainfuse.planner import USABLE
from chainfuse.runtime import num_threads

__all__ = [
    "Fidelity",
    "conv_candidates",
    "measure",
    "measure_conv",
    "run_agreement",
    "spearman",
    "split_half_rho",
]

_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
#: interleaved rounds each workload's plans are timed in (at most `BUDGET_S`): plans 1-2 % apart
#: need many (docs/performance.md#model-and-planner: two runs of 250 agree at rho 0.86 on GEMM
#: chains, a run of 40 and one of 100 at 0.54); `QUICK_ROUNDS` for the bench's quick set
ROUNDS = 250
QUICK_ROUNDS = 100
#: seconds one workload's plans may be timed for (the rounds stop there, at least three in)
BUDGET_S = 90.0
#: plans two runs must both have timed for `run_agreement` to compare their orderings
AGREE_PLANS = 4


@dataclass
class Fidelity:
    """Predicted and measured milliseconds of the top plans of one workload; [0] is the choice."""

    suite: str
    workload: str
    variant: str
    tiles: list[str]
    predicted_ms: list[float]  # the model's time: max(compute, memory)
    predicted_memory_ms: list[float]  # its tie-break: summed memory time over the levels
    measured_ms: list[float]
    predicted_plain_ms: list[float] = field(default_factory=list)  # without the kernel's terms
    repeat_rho: float = math.nan  # the measurement's own repeatability (`split_half_rho`)

    @property
    def predicted_rank(self) -> list[float]:
        keys = list(zip(self.predicted_ms, self.predicted_memory_ms, strict=True))
        return _ranks(keys)

    @property
    def rho(self) -> float:
        return spearman(self.predicted_rank, self.measured_ms)

    @property
    def rho_plain(self) -> float:
        """rho of the ranking by the time without the micro-kernel's efficiency terms (NaN
        where the record has none)."""
        if len(self.predicted_plain_ms) != len(self.measured_ms):
            return math.nan
        keys = list(zip(self.predicted_plain_ms, self.predicted_memory_ms, strict=True))
        return spearman(_ranks(keys), self.measured_ms)

    @property
    def tuning_gap(self) -> float:
        """measured(first choice) / min(measured) - 1."""
        return self.measured_ms[0] / min(self.measured_ms) - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rho": self.rho, "rho_plain": self.rho_plain,
                "tuning_gap": self.tuning_gap}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Fidelity:
        keep = ("suite", "workload", "variant", "tiles", "predicted_ms", "predicted_memory_ms",
                "measured_ms")  # fmt: skip
        return cls(**{k: d[k] for k in keep}, predicted_plain_ms=d.get("predicted_plain_ms", []),
                   repeat_rho=d.get("repeat_rho", math.nan))  # fmt: skip


def _ranks(xs: Sequence[Any]) -> list[float]:
    """Ranks 1..n, ties given their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's on average ranks); NaN if either is constant."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman: {len(xs)} and {len(ys)} values")
    if len(xs) < 2:
        return math.nan
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def _code_loops(kernel: Kernel) -> dict[str, str]:
    """Chain loop name of each code-level tile (T_M, T_L, T_K, T_N)."""
    first, second = kernel.chain.contractions
    m, l_ = first.output.loops[-2:]
    return {"T_M": m, "T_L": l_, "T_K": first.reduction[0], "T_N": second.output.loops[-1]}


Key = tuple[float, float, float]  # (predicted time, memory time, time at the peak), seconds


class Coster(Protocol):
    def __call__(self, tiles: Mapping[str, int], fit: bool = True) -> Key | None: ...


def candidates(
    kernel: Kernel, hw: Hardware, threads: int, top: int
) -> list[tuple[Key, dict[str, int]]]:
    """(model's key, code-level tiles) of the chosen plan and of the `top - 1` best others."""
    ext = kernel.chain.extents
    loops = _code_loops(kernel)
    spec = kernel.spec
    picked = {loops[f]: getattr(spec, f) for f in ("T_M", "T_L", "T_K", "T_N")}
    quantum = {loops["T_M"]: spec.kernel.nr, loops["T_L"]: spec.kernel.mr,
               loops["T_N"]: spec.kernel.mr, loops["T_K"]: 1}  # fmt: skip
    cost = coster(kernel, hw, threads)

    def values(loop: str) -> list[int]:
        q, n, t = quantum[loop], ext[loop], picked[loop]
        out = {min(n, max(q, round(t * f / q) * q)) for f in _FACTORS}
        return sorted(out | {t})

    first = cost(picked, fit=False)
    assert first is not None
    scored: list[tuple[Key, dict[str, int]]] = []
    names = list(picked)
    for combo in itertools.product(*(values(n) for n in names)):
        tiles = dict(zip(names, combo, strict=True))
        if tiles == picked:
            continue
        t = cost(tiles)
        if t is not None:
            scored.append((t, tiles))
    scored.sort(key=lambda st: st[0])
    return [(first, picked), *scored[: top - 1]]


def coster(kernel: Kernel | ConvKernel, hw: Hardware, threads: int) -> Coster:
    """The model's key of the kernel's plan with other code-level tiles (chain loop -> tile;
    a conv kernel's: ``p2``, its band of rows), or None where they overflow the code level
    (unless `fit` is False: the tiles the code chose run whatever the model holds of them)."""
    chain, chosen = kernel.chain, kernel.plan
    level = code_level(hw)
    nest = Nest(chain, chosen.order, chosen.depth, fused=chosen.fused)
    base = {lv: dict(t) for lv, t in chosen.tiles}
    capacity = next(lv.capacity for lv in hw.levels if lv.name == level) * USABLE
    whole = {"q2": kernel.shape.Q2} if isinstance(kernel, ConvKernel) else {}

    def cost(tiles: Mapping[str, int], fit: bool = True) -> Key | None:
        levels = {lv: dict(t) for lv, t in base.items()}
        levels[level] = {**levels[level], **tiles, **whole}
        for lv, t in levels.items():  # inner levels never hold more than the code level
            if lv != level and _inner(hw, lv, level):
                levels[lv] = {k: min(v, levels[level][k]) for k, v in t.items()}
        c = estimate(nest, levels, hw, chosen.parallel, threads, chosen.split)
        used = dict(c.used_per_level).get(level, 0)
        if fit and used > capacity:
            return None
        return c.time_s, sum(t for _, t in c.memory_s), c.plain_s

    return cost


def _inner(hw: Hardware, a: str, b: str) -> bool:
    names = [lv.name for lv in hw.levels]
    return names.index(a) < names.index(b)


def measure(
    chain: Chain,
    suite: str,
    workload: str,
    variant: str,
    top: int = 10,
    rounds: int = ROUNDS,
    hardware: Hardware | None = None,
    progress: Callable[[str], None] | None = None,
) -> Fidelity:
    """Compile and time the top `top` plans of `chain` (1 thread; see the module docstring)."""
    hw = hardware or resolve(None)
    chosen = compile(chain, hw, threads=1)
    ranked = candidates(chosen, hw, 1, top)
    by_loop = {v: k for k, v in _code_loops(chosen).items()}

    def build(tiles: dict[str, int]) -> Kernel:
        return compile(chain, hw, threads=1, tiles=tiles)

    inputs = reference.random_inputs(chain, seed=11)
    args = [inputs[t.name] for t in chain.inputs]

    def bind(kernel: Kernel) -> tuple[Callable[[], object], Callable[[], Any]]:
        out = np.empty(chain.outputs[0].shape, dtype=np.float32)
        return (lambda: kernel(*args, out=out)), (lambda: out)

    labels = [" ".join(f"{by_loop[k]}={v}" for k, v in t.items()) for _, t in ranked]
    kernels = _build_all(chosen, build, [t for _, t in ranked[1:]])
    return _time_ranked(chain, inputs, (suite, workload, variant), ranked, labels, kernels,
                        bind, rounds, progress)  # fmt: skip


def _build_all(chosen: Any, build: Callable[[Any], Any], rest: Sequence[Any]) -> list[Any]:
    """The chosen kernel and the others, compiled two at a time (gcc runs outside the GIL)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return [chosen, *pool.map(build, rest)]


def _time_ranked(
    chain: Chain,
    inputs: Mapping[str, Any],
    names: tuple[str, str, str],
    ranked: Sequence[tuple[Key, Any]],
    labels: list[str],
    kernels: Sequence[Any],
    bind: Callable[[Any], tuple[Callable[[], object], Callable[[], Any]]],
    rounds: int,
    progress: Callable[[str], None] | None,
) -> Fidelity:
    """Check every kernel against the reference, time them interleaved on one thread (the
    count they were planned for, whatever the caller's), make the record."""
    want = reference.run(chain, inputs)[chain.outputs[0].name]
    calls: list[Callable[[], object]] = []
    with num_threads(1):
        for kernel in kernels:
            call, result = bind(kernel)
            call()
            reference.assert_close(np.asarray(result()), want, chain)
            calls.append(call)
        reps = _repeats(calls[0], SAMPLE_S)
        fns = {str(i): _batch(call, reps) for i, call in enumerate(calls)}
        timing = interleave(fns, rounds, budget_s=BUDGET_S)
    if progress is not None:
        progress(f"fidelity {names[1]} {names[2]}")
    return Fidelity(
        *names,
        tiles=labels,
        predicted_ms=[p[0] * 1e3 for p, _ in ranked],
        predicted_memory_ms=[p[1] * 1e3 for p, _ in ranked],
        measured_ms=_measured(timing, len(kernels)),
        predicted_plain_ms=[p[2] * 1e3 for p, _ in ranked],
        repeat_rho=split_half_rho(timing, "0"),
    )


def split_half_rho(timing: Mapping[str, Timing], base: str) -> float:
    """Spearman's rho between the plans' measured times from the even rounds and from the odd
    ones (each paired with `base` as `paired_ms` pairs them): how far the measurement itself
    reproduces its ranking, the ceiling a model's rho is read against (NaN: under 4 rounds)."""
    halves = []
    for start in (0, 1):
        part = {}
        for name, t in timing.items():
            xs = t.times_s[start::2]
            if len(xs) < 2:
                return math.nan
            part[name] = Timing(t.ms, t.spread, len(xs), t.best_ms, tuple(xs))
        paired = paired_ms(part, base)
        halves.append([paired[k] for k in sorted(paired, key=int)])
    return spearman(halves[0], halves[1])


#: each timed sample runs a plan back to back for about this long (one short call alone carries
#: the timer's and the previous plan's cache state; docs/performance.md#model-and-planner)
SAMPLE_S = 0.02


def _repeats(call: Callable[[], object], seconds: float) -> int:
    """Back-to-back calls that take about `seconds` (at least one)."""
    start = time.perf_counter()
    call()
    call()
    once = max((time.perf_counter() - start) / 2, 1e-7)
    return max(1, min(1000, round(seconds / once)))


def _batch(call: Callable[[], object], reps: int) -> Callable[[], object]:
    def run() -> None:
        for _ in range(reps):
            call()

    return run


def _measured(timing: Mapping[str, Timing], n: int) -> list[float]:
    """The plans' measured ms, "0" (the chosen plan) first: paired with it (`paired_ms`)."""
    paired = paired_ms(timing, "0")
    return [paired[str(i)] for i in range(n)]


# -- convolution chains ---------------------------------------------------------------------------


def conv_candidates(
    kernel: ConvKernel, hw: Hardware, threads: int, top: int
) -> list[tuple[Key, int]]:
    """(model's key, rows per band) of the chosen conv plan and of the `top - 1` best others.

    A conv kernel's schedule is its band of conv2 output rows (`T_P2`, whole rows: the plan's
    p2 x q2 pixel tile), its channel blocks follow from L1. The alternatives are other band
    heights, costed by `estimate` with the code level's tiles set to that band of whole rows.
    """
    P2 = kernel.shape.P2
    cost = coster(kernel, hw, threads)
    picked = kernel.tiles.band_rows
    first = cost({"p2": picked}, fit=False)
    assert first is not None
    others = {min(P2, max(1, round(picked * f))) for f in (*_FACTORS, 0.25, 4.0)} | {1, P2}
    scored = [(k, b) for b in sorted(others - {picked}) if (k := cost({"p2": b})) is not None]
    scored.sort(key=lambda kb: kb[0])
    return [(first, picked), *scored[: top - 1]]


def measure_conv(
    chain: Chain,
    suite: str,
    workload: str,
    variant: str,
    top: int = 10,
    rounds: int = ROUNDS,
    hardware: Hardware | None = None,
    progress: Callable[[str], None] | None = None,
) -> Fidelity:
    """`measure` for a conv chain: the top band heights, compiled and timed (1 thread)."""
    import torch

    hw = hardware or resolve(None)
    chosen = compile_conv(chain, hw, threads=1)
    ranked = conv_candidates(chosen, hw, 1, top)

    def build(band: int) -> ConvKernel:
        return compile_conv(chain, hw, threads=1, tiles={"p2": band})

    inputs = reference.random_inputs(chain, seed=11)
    cl = torch.channels_last
    x = torch.from_numpy(inputs["X"]).contiguous(memory_format=cl)
    w1, w2 = torch.from_numpy(inputs["W1"]), torch.from_numpy(inputs["W2"])

    def bind(kernel: ConvKernel) -> tuple[Callable[[], object], Callable[[], Any]]:
        out = torch.empty(chain.outputs[0].shape, dtype=torch.float32, memory_format=cl)
        return (lambda: kernel(x, w1, w2, out=out)), (lambda: out.numpy())

    kernels = _build_all(chosen, build, [b for _, b in ranked[1:]])
    labels = [f"T_P2={b}" for _, b in ranked]
    return _time_ranked(chain, inputs, (suite, workload, variant), ranked, labels, kernels,
                        bind, rounds, progress)  # fmt: skip


# -- before / after -------------------------------------------------------------------------------


def compare(before: Sequence[Fidelity], after: Sequence[Fidelity]) -> list[str]:
    """Per suite: workloads, mean rho and mean tuning gap of two runs (a markdown table); the
    after run's rho without the kernel's terms beside them."""

    def mean(xs: Sequence[float]) -> float:
        xs = [x for x in xs if not math.isnan(x)]
        return sum(xs) / len(xs) if xs else math.nan

    lines = ["| suite | workloads (before / after) | mean rho before | mean rho after | "
             "after, without kernel terms | measurement's own rho (after) | "
             "the runs' agreement (workloads) | mean tuning gap before | after |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for suite in dict.fromkeys(f.suite for f in (*before, *after)):
        b = [f for f in before if f.suite == suite]
        a = [f for f in after if f.suite == suite]
        agree = run_agreement(b, a)
        lines.append(
            f"| {suite} | {len(b)} / {len(a)} | {mean([f.rho for f in b]):.2f} | "
            f"{mean([f.rho for f in a]):.2f} | {mean([f.rho_plain for f in a]):.2f} | "
            f"{mean([f.repeat_rho for f in a]):.2f} | "
            f"{mean(list(agree.values())):.2f} ({len(agree)}) | "
            f"{mean([f.tuning_gap for f in b]):.1%} | {mean([f.tuning_gap for f in a]):.1%} |"
        )
    return lines


def run_agreement(before: Sequence[Fidelity], after: Sequence[Fidelity]) -> dict[str, float]:
    """Per workload (`suite/workload/variant`) both runs timed: Spearman's rho between the two
    runs' measured times of the plans (tile labels) both timed, where there are at least
    `AGREE_PLANS` of them and the rho is defined."""
    first = {(f.suite, f.workload, f.variant): f for f in before}
    out: dict[str, float] = {}
    for f in after:
        g = first.get((f.suite, f.workload, f.variant))
        if g is None:
            continue
        common = [t for t in f.tiles if t in g.tiles]
        if len(common) < AGREE_PLANS:
            continue
        rho = spearman([g.measured_ms[g.tiles.index(t)] for t in common],
                       [f.measured_ms[f.tiles.index(t)] for t in common])  # fmt: skip
        if not math.isnan(rho):
            out[f"{f.suite}/{f.workload}/{f.variant}"] = rho
    return out


def rerank(records: Sequence[Fidelity], hardware: Hardware | None = None) -> list[Fidelity]:
    """`records` with their plans costed again by this model (their measured times kept): a
    model change's rho on stored timings, without timing anything (docs/tuning.md). The
    chosen plan (the first) stays first; the records must come from this machine's runs."""
    from chainfuse.bench import attention, workloads

    hw = hardware or resolve(None)
    out = []
    for f in records:
        if f.suite == "attention":
            chain = attention.chain_of(f.workload)
        else:
            chain = workloads.chain_of(f.workload, f.variant)
        kernel: Kernel | ConvKernel
        if f.suite == "conv-chain":
            kernel = compile_conv(chain, hw, threads=1)
            loops = {"T_P2": "p2"}
        else:
            kernel = compile(chain, hw, threads=1)
            loops = _code_loops(kernel)
        cost = coster(kernel, hw, 1)
        keys = []
        for label in f.tiles:
            tiles = {loops[k]: int(v) for k, v in (t.split("=") for t in label.split())}
            key = cost(tiles, fit=False)
            assert key is not None
            keys.append(key)
        ms = [[k[i] * 1e3 for k in keys] for i in range(3)]
        out.append(
            replace(f, predicted_ms=ms[0], predicted_memory_ms=ms[1], predicted_plain_ms=ms[2])
        )
    return out


def load(path: str) -> list[Fidelity]:
    """The fidelity records of a bench run's `results.json`."""
    data = json.loads(Path(path).read_text())
    return [Fidelity.from_dict(d) for d in data.get("fidelity", [])]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chainfuse.bench.fidelity",
        description="set two bench runs' fidelity figures side by side, per suite, or one run's "
        "against this model's ranking of the same plans",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"),
                      help="results.json of `chainfuse bench ... --top 10` runs")  # fmt: skip
    what.add_argument("--rerank", metavar="RESULTS",
                      help="one such run's timings against this model's ranking of its "
                      "plans")  # fmt: skip
    args = parser.parse_args(argv)
    flag = "--compare" if args.compare else "--rerank"
    try:
        if args.compare:
            before, after = load(args.compare[0]), load(args.compare[1])
        else:
            before = load(args.rerank)
            after = rerank(before)
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"{flag}: {exc}")
    print("\n".join(compare(before, after)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
