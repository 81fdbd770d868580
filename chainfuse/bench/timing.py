"""Interleaved timing of several implementations of the same computation, in one process.

A shared 2-core machine drifts by tens of percent within seconds, so implementations are timed
in rounds (one call each per round) rather than one after another: a slow moment then slows
every contender alike, and ratios stay meaningful even when absolute times do not.

Each round calls them in a new order (a seeded shuffle, the same sequence every run): in a fixed
order each contender would always inherit the caches the same other one leaves (measured in
docs/performance.md); shuffled, every contender follows every other about equally often.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = ["Timing", "interleave", "paired_ms"]


@dataclass(frozen=True)
class Timing:
    """One implementation's figure: `ms` is the median (or the best, see `interleave`)."""

    ms: float
    spread: float  # (75th - 25th percentile) / median: how noisy the samples were
    samples: int
    best_ms: float = float("nan")  # the fastest call: what the code does when nothing interferes
    times_s: tuple[float, ...] = ()  # every round's call in seconds, in round order


def interleave(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    best: bool = False,
    budget_s: float = 20.0,
) -> dict[str, Timing]:
    """Time every function of `fns` once per round, each round in a shuffled order (seeded:
    the same orders every run), after one warm-up call each in `fns`' order.

    `best=True` reports the minimum instead of the median (used with more than one thread,
    where a shared machine only ever slows a run down). Stops after `rounds` rounds, or earlier
    once `budget_s` has passed and at least three rounds are in.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    deadline = time.perf_counter() + budget_s
    order = list(fns)
    shuffle = random.Random(0).shuffle
    for r in range(rounds):
        shuffle(order)
        for name in order:
            fn = fns[name]
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
        if r >= 2 and time.perf_counter() > deadline:
            break
    out: dict[str, Timing] = {}
    for name, xs in samples.items():
        median = statistics.median(xs)
        if len(xs) >= 4:
            q = statistics.quantiles(xs, n=4)
            spread = (q[2] - q[0]) / median
        else:
            spread = (max(xs) - min(xs)) / median
        out[name] = Timing(
            (min(xs) if best else median) * 1e3, spread, len(xs), min(xs) * 1e3, tuple(xs)
        )
    return out


def paired_ms(timing: Mapping[str, Timing], base: str) -> dict[str, float]:
    """Each implementation's time as `base`'s median times the median over rounds of its call
    over `base`'s call in the same round (`interleave`'s rounds).

    A round's calls see the same moment of a drifting machine, so their ratio keeps little of
    the drift that the ratio of two medians still carries, and the least of many close
    contenders' medians is mostly the one that caught the quiet rounds (see
    `chainfuse.bench.fidelity`). `base` maps to its own median.
    """
    ref = timing[base].times_s
    if not ref:
        raise ValueError(f"paired_ms: {base!r} has no per-round times")
    out: dict[str, float] = {}
    for name, t in timing.items():
        if len(t.times_s) != len(ref):
            raise ValueError(
                f"paired_ms: {name!r} ran {len(t.times_s)} rounds, {base!r} {len(ref)}"
            )
        ratio = statistics.median(a / b for a, b in zip(t.times_s, ref, strict=True))
        out[name] = statistics.median(ref) * 1e3 * ratio
    return out
