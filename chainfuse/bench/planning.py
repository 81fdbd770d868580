"""How long planning takes, and what it decides, for every paper workload.

    python -m chainfuse.bench.planning [--hw PRESET|detect] [--repeat 5] [--simulate] [--json PATH]

Each workload of `chainfuse.bench.workloads` (GEMM chains with nothing, ReLU or softmax between
the ops; conv chains with nothing or ReLU) is planned `--repeat` times with `timed_plan`; the table
shows the median planning time next to the decision (fused?, order, compute-at depth, schedules
considered) and the predicted times of the chosen and the unfused execution.

With `--simulate` the chosen plan's bytes per level (`plan.predicted_bytes`) are set beside what the
tile-trace simulator counts for the same tiles (it counts uniform runs of blocks, so every paper
workload simulates in well under a second).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from chainfuse.bench.workloads import ALL, GemmWorkload
from chainfuse.hardware import Hardware, presets, resolve
from chainfuse.ir import Chain
from chainfuse.planner import Plan, timed_plan
from chainfuse.simulate import simulate_level

__all__ = ["LevelCheck", "Row", "check_bytes", "main", "measure", "summary"]

GEMM_BETWEEN: tuple[str | None, ...] = (None, "relu", "softmax")
CONV_BETWEEN: tuple[str | None, ...] = (None, "relu")


@dataclass(frozen=True)
class LevelCheck:
    """Bytes read from one level: the model's and the simulator's (None: not simulated)."""

    level: str
    predicted: int
    simulated: int | None
    status: str  # "equal" or "different"


@dataclass(frozen=True)
class Row:
    workload: str
    between: str
    median_ms: float
    fused: bool
    order: tuple[str, ...]
    depth: int
    considered: int
    predicted_ms: float
    unfused_ms: float
    checks: tuple[LevelCheck, ...] = ()


def cases() -> Iterator[tuple[str, str | None, Chain]]:
    """(workload, between, chain) for every paper workload and each of its in-between ops."""
    for w in ALL:
        for between in GEMM_BETWEEN if isinstance(w, GemmWorkload) else CONV_BETWEEN:
            yield w.name, between, w.chain(between)


def check_bytes(chain: Chain, plan: Plan, hw: Hardware) -> tuple[LevelCheck, ...]:
    """The model's bytes per level beside the simulator's, level by level (as `simulate` pairs
    them: the tiles of the inner level decide what is read from the outer one)."""
    predicted = plan.predicted_bytes
    out = []
    for inner, outer in itertools.pairwise(hw.levels):
        tiles = plan.tiles_at(inner.name)
        if tiles is None or outer.name not in predicted:
            continue
        want = int(predicted[outer.name])  # int(): conv plans may carry numpy integers
        sim = simulate_level(chain, plan.order, plan.depth, tiles, plan.fused)
        status = "equal" if sim.bytes == want else "different"
        out.append(LevelCheck(outer.name, want, int(sim.bytes), status))
    return tuple(out)


def measure(
    name: str,
    between: str | None,
    chain: Chain,
    hw: Hardware,
    repeat: int,
    simulate: bool = False,
) -> Row:
    """Plan `chain` `repeat` times; the last plan (all are equal) is the one reported."""
    seconds = []
    for _ in range(repeat):
        plan, s = timed_plan(chain, hw)
        seconds.append(s)
    return Row(
        workload=name,
        between=between or "none",
        median_ms=statistics.median(seconds) * 1e3,
        fused=bool(plan.fused),
        order=tuple(plan.order),
        depth=int(plan.depth),
        considered=int(plan.considered),
        predicted_ms=float(plan.predicted_time_s) * 1e3,
        unfused_ms=float(plan.unfused_time_s) * 1e3,
        checks=check_bytes(chain, plan, hw) if simulate else (),
    )


def summary(rows: Sequence[Row]) -> dict[str, float]:
    medians = [r.median_ms for r in rows]
    return {"median_ms": statistics.median(medians), "max_ms": max(medians)}


def _order(order: Sequence[str], depth: int) -> str:
    return f"{' > '.join(order)} / {depth}"


def _header(width: int) -> str:
    return (
        f"{'workload':<17} {'between':<8} {'plan ms':>8} {'fused':<5} {'order / depth':<{width}} "
        f"{'considered':>10} {'pred ms':>9} {'unfused ms':>10}"
    )


def _line(r: Row, width: int) -> str:
    return (
        f"{r.workload:<17} {r.between:<8} {r.median_ms:>8.1f} {'yes' if r.fused else 'no':<5} "
        f"{_order(r.order, r.depth):<{width}} {r.considered:>10} {r.predicted_ms:>9.4f} "
        f"{r.unfused_ms:>10.4f}"
    )


def _check_lines(r: Row) -> list[str]:
    lines = []
    for c in r.checks:
        sim = "-" if c.simulated is None else f"{c.simulated:,}"
        lines.append(f"    {c.level:<6} model {c.predicted:>15,}  simulated {sim:>15}  {c.status}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chainfuse.bench.planning", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--hw", default="detect", help=f"a preset ({', '.join(presets())}) or detect"
    )
    parser.add_argument("--repeat", type=int, default=5, help="plans per workload (median shown)")
    parser.add_argument("--simulate", action="store_true", help="compare bytes with the simulator")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    try:
        hw = resolve(args.hw)
    except ValueError as exc:
        parser.error(str(exc))

    print(f"planning on {hw.name}, {args.repeat} repeat(s) per workload")
    todo = list(cases())
    width = max(len(_order(tuple(chain.extents), 0)) for _, _, chain in todo)
    print(_header(width))
    rows = []
    for name, between, chain in todo:
        row = measure(name, between, chain, hw, args.repeat, args.simulate)
        rows.append(row)
        print(_line(row, width))
        for line in _check_lines(row):
            print(line)
        sys.stdout.flush()
    total = summary(rows)
    print(
        f"{len(rows)} chains planned: median of medians {total['median_ms']:.1f} ms, "
        f"max {total['max_ms']:.1f} ms"
    )
    if args.simulate:
        checks = [c for r in rows for c in r.checks]
        counts = {s: sum(c.status == s for c in checks) for s in sorted({c.status for c in checks})}
        print("bytes, model vs simulator: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    if args.json:
        data = {
            "hardware": hw.name,
            "repeat": args.repeat,
            "summary": total,
            "rows": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
