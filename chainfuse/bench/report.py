"""Turn benchmark results into `report.md`, PNG plots and `results.json` in one directory.

It knows nothing of how a suite measured: it reads `Result`s (one per workload, variant and
thread count) and `Fidelity` records (the model's ranking of a workload's top plans against
their measured times), plus the probe of the machine they ran on.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from chainfuse.bench.fidelity import Fidelity, spearman
from chainfuse.bench.probe import Machine
from chainfuse.bench.results import Result, geomean
from chainfuse.ir import DType

__all__ = ["across_workloads", "plot", "summary_rows", "write"]

_MIB = 1 << 20


def _fmt_ms(ms: float, spread: float | None) -> str:
    if math.isnan(ms):
        return "-"
    return f"{ms:.3f}" if spread is None or math.isnan(spread) else f"{ms:.3f} ±{spread:.0%}"


def _bytes_cell(r: Result, level: str) -> str:
    pred = r.predicted_bytes.get(level)
    if pred is None:
        return "-"
    sim = r.simulated_bytes.get(level)
    sim_text = "not simulated" if sim is None else f"{sim / _MIB:.2f}"
    return f"{pred / _MIB:.2f} / {sim_text}"


def summary_rows(
    results: Sequence[Result], peak: float, peaks: Mapping[str, tuple[float, str]] | None = None
) -> list[dict[str, Any]]:
    """Per suite and thread count: geomean and minimum speedup over the best baseline, and how
    many cases reach 80 % of the FP32 peak (median, and fastest call), or of the suite's own
    peak in `peaks` (suite -> (GFLOP/s per core, its name): bf16 on AMX, the AMX probe)."""
    rows = []
    for suite in dict.fromkeys(r.suite for r in results):
        peak_of, name = (peaks or {}).get(suite, (peak, "FP32"))
        for n in sorted({r.threads for r in results if r.suite == suite}):
            sel = [r for r in results if r.suite == suite and r.threads == n]
            ratios = [r.speedup() for r in sel]
            rows.append({
                "suite": suite, "threads": n, "cases": len(sel),
                "geomean_speedup": geomean(ratios), "min_speedup": min(ratios),
                "at_or_above_80pct_peak": sum(r.gflops() >= 0.8 * peak_of * n for r in sel),
                "at_or_above_80pct_peak_fastest_call": sum(
                    r.best_gflops() >= 0.8 * peak_of * n for r in sel
                ),
                **({} if name == "FP32" else {"peak": name, "peak_gflops_per_core": peak_of}),
            })  # fmt: skip
    return rows


def fewest_threads(results: Sequence[Result]) -> tuple[int, list[Result]]:
    """The fewest threads any result ran on (1 unless the run had no 1-thread pass) and the
    results at that count: the model's predictions are for the threads each ran on."""
    if not results:
        return 1, []
    n = min(r.threads for r in results)
    return n, [r for r in results if r.threads == n]


def across_workloads(results: Sequence[Result]) -> list[tuple[str, int, float]]:
    """(suite, cases, Spearman rho of predicted vs measured ms) over each suite's results at
    the fewest threads (1 thread: `fewest_threads`): does the model order the workloads as the
    machine does?"""
    out = []
    for suite in dict.fromkeys(r.suite for r in results):
        _, sel = fewest_threads([r for r in results if r.suite == suite])
        rho = spearman([r.predicted_ms for r in sel], [r.ms["chainfuse"] for r in sel])
        out.append((suite, len(sel), rho))
    return out


def _suite_table(results: Sequence[Result], peak: float, name: str = "FP32") -> list[str]:
    baselines = list(dict.fromkeys(b for r in results for b in r.baselines if b in r.ms))
    # other forms of chainfuse timed next to the headline one (e.g. on NCHW input)
    others = list(dict.fromkeys(k for r in results for k in r.ms
                                if k != "chainfuse" and k not in r.baselines))  # fmt: skip
    levels = list(dict.fromkeys(lv for r in results for lv in r.predicted_bytes))
    head = ["workload", "variant", "threads", "chainfuse ms", *(f"{k} ms" for k in others),
            *(f"{b} ms" for b in baselines),
            "speedup (vs best)", "GFLOP/s", f"% {name} peak", "fastest call", "tiles", "predicted ms",
            *(f"{lv} MiB pred / sim" for lv in levels), "plan ms", "compile s"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        best = r.best_baseline()
        cells = [r.workload, r.variant, str(r.threads),
                 _fmt_ms(r.ms["chainfuse"], r.spread.get("chainfuse")),
                 *(_fmt_ms(r.ms.get(k, math.nan), r.spread.get(k)) for k in others),
                 *(_fmt_ms(r.ms.get(b, math.nan), r.spread.get(b)) for b in baselines),
                 f"{r.speedup():.2f}x ({best})", f"{r.gflops():.1f}",
                 f"{r.gflops() / (peak * r.threads):.0%}",
                 f"{r.best_gflops() / (peak * r.threads):.0%}", r.tiles, f"{r.predicted_ms:.3f}",
                 *(_bytes_cell(r, lv) for lv in levels), f"{r.planning_ms:.1f}",
                 f"{r.compile_s:.2f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _fidelity_lines(fidelity: Sequence[Fidelity]) -> list[str]:
    if not fidelity:
        return ["No fidelity run (`--top 0`)."]
    lines = [
        "| suite | workload | variant | plans | Spearman rho | tuning gap | first choice "
        "(pred / measured ms) | best measured (pred / measured ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in fidelity:
        b = min(range(len(f.measured_ms)), key=lambda i: f.measured_ms[i])
        lines.append(
            f"| {f.suite} | {f.workload} | {f.variant} | {len(f.measured_ms)} | {f.rho:.2f} | "
            f"{f.tuning_gap:.1%} | {f.tiles[0]} ({f.predicted_ms[0]:.3f} / "
            f"{f.measured_ms[0]:.3f}) | {f.tiles[b]} ({f.predicted_ms[b]:.3f} / "
            f"{f.measured_ms[b]:.3f}) |"
        )
    lines += ["", "| suite | workloads | mean Spearman rho | without kernel terms | "
              "measurement's own rho | mean tuning gap | max tuning gap |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for suite in dict.fromkeys(f.suite for f in fidelity):
        sel = [f for f in fidelity if f.suite == suite]
        rhos = [f.rho for f in sel if not math.isnan(f.rho)]
        plain = [f.rho_plain for f in sel if not math.isnan(f.rho_plain)]
        gaps = [f.tuning_gap for f in sel]
        rho = statistics.mean(rhos) if rhos else math.nan
        rho_plain = statistics.mean(plain) if plain else math.nan
        own = [f.repeat_rho for f in sel if not math.isnan(f.repeat_rho)]
        repeat = statistics.mean(own) if own else math.nan
        lines.append(f"| {suite} | {len(sel)} | {rho:.2f} | {rho_plain:.2f} | {repeat:.2f} | "
                     f"{statistics.mean(gaps):.1%} | {max(gaps):.1%} |")  # fmt: skip
    return lines


def write(
    out: Path,
    results: Sequence[Result],
    fidelity: Sequence[Fidelity],
    machine: Machine,
    extra: Mapping[str, Any],
    command: str,
    peaks: Mapping[str, tuple[float, str]] | None = None,
) -> list[Path]:
    """Write report.md, results.json and the plots into `out`; return the files written.
    `peaks`: suites whose % of peak is of another peak than the FP32 probe's (`summary_rows`)."""
    out.mkdir(parents=True, exist_ok=True)
    peak = machine.peak_gflops
    hw = machine.hardware
    written = []
    data = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": {
            "hardware": json.loads(hw.to_json()),
            "load_average": machine.load_average,
            "fp32_peak_gflops_per_core_measured": peak,
            "fp32_peak_gflops_per_core_nominal": machine.nominal_peak_gflops,
            "read_bandwidth_bytes_per_s_measured": dict(machine.bandwidth),
            "warnings": machine.warnings(),
        },
        "summary": summary_rows(results, peak, peaks),
        "predicted_vs_measured_rho": {s: rho for s, _, rho in across_workloads(results)},
        **extra,
        "results": [r.to_dict() for r in results],
        "fidelity": [f.to_dict() for f in fidelity],
    }
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    written.append(out / "results.json")
    plots = plot(out, results, fidelity, machine)
    written += plots

    md = [
        "# chainfuse benchmark report",
        "",
        f"`{command}` on {data['date']}: {hw.name}, {hw.cores} cores, "
        f"{' '.join(sorted(i.value for i in hw.isa))}; Python {platform.python_version()}.",
        "",
        f"FP32 FMA peak, one core: **{peak:.1f} GFLOP/s measured** by a probe in this run (the "
        "better of one before and one after the timings) "
        f"(nominal {machine.nominal_peak_gflops:.1f}). Read bandwidth measured, one core: "
        + ", ".join(f"{lv} {bw / 1e9:.1f} GB/s" for lv, bw in machine.bandwidth)
        + f". Load average at the start: {machine.load_average:.2f}.",
        "",
        "Timing: every implementation in one process, interleaved (one call each a round, every "
        "round in a shuffled order) after a warm-up call; 1 thread reports the median (± the "
        "interquartile range over the median), more threads the best of the rounds. Every "
        "chainfuse result was checked against the "
        "float64 reference before it was timed. Speedup = the fastest baseline's time over "
        "chainfuse's. % FP32 peak: chainfuse's GFLOP/s (median) over the probe's peak times "
        "the threads; `fastest call`: the same for chainfuse's fastest call of the rounds (the "
        "probe is a best-of too: the two bracket what the code does on a quiet machine). Bytes: "
        "the plan's predicted bytes read from each level / the tile simulator's count for the "
        "same plan.",
        "",
    ]
    md += [f"> warning: {w}" for w in machine.warnings()]
    md += ["## Summary", "", "| suite | threads | cases | geomean speedup | min speedup | "
           ">= 80% of FP32 peak (median / fastest call) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for s in data["summary"]:
        md.append(f"| {s['suite']} | {s['threads']} | {s['cases']} | "
                  f"{s['geomean_speedup']:.2f}x | {s['min_speedup']:.2f}x | "
                  f"{s['at_or_above_80pct_peak']} / "
                  f"{s.get('at_or_above_80pct_peak_fastest_call', 'n/a')} |")  # fmt: skip
    for key, value in extra.items():
        md += ["", f"`{key}`: `{json.dumps(value, default=str)}`"]
    for suite in dict.fromkeys(r.suite for r in results):
        md += ["", f"## {suite}", ""]
        peak_of, name = (peaks or {}).get(suite, (peak, "FP32"))
        md += _suite_table([r for r in results if r.suite == suite], peak_of, name)
    md += ["", "## Model fidelity", "",
           "For each workload the planner's first choice and the plans the model ranks next "
           "(same block order, other code-level tiles; for a conv chain, other heights of its "
           "band of output rows) were compiled and timed on one thread, interleaved; a plan's "
           "measured time is the first choice's median times the median of its per-round ratios "
           "to the first choice (round by round the machine's drift cancels). "
           "rho: Spearman's rank correlation between the model's ranking (predicted time, ties "
           "broken by predicted memory time) and the measured times (nan: the model ranks all "
           "of them equal); without kernel terms: the same for the time with the flops at the "
           "peak (the model before its micro-kernel efficiency terms); the measurement's own "
           "rho: the plans' times from the even rounds against those from the odd ones, the "
           "ceiling a model's rho can reach on this machine. Tuning gap: how much "
           "slower the first choice ran than the best of those plans.", ""]  # fmt: skip
    md += _fidelity_lines(fidelity)
    md += ["", "Across workloads (the chosen plan of each, 1 thread, or the fewest threads the run "
           "timed): Spearman's rho between predicted and measured time.", "",
           "| suite | cases | rho |", "|---|---|---|"]  # fmt: skip
    for suite, n, rho in across_workloads(results):
        md.append(f"| {suite} | {n} | {rho:.2f} |")
    md += ["", "## Plots", ""]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    (out / "report.md").write_text("\n".join(md) + "\n")
    written.append(out / "report.md")
    return written


def plot(
    out: Path, results: Sequence[Result], fidelity: Sequence[Fidelity], machine: Machine
) -> list[Path]:
    """The report's PNGs; an empty list (and a note on stderr) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print("note: matplotlib is not installed (pip install 'chainfuse[bench]'): no plots",
              file=sys.stderr)  # fmt: skip
        return []
    paths = []
    suites = list(dict.fromkeys(r.suite for r in results))
    peak = machine.peak_gflops

    # 1. speedup per workload, one panel per suite, one bar per thread count
    fig, axes = plt.subplots(len(suites), 1, figsize=(12, 3.6 * len(suites)), squeeze=False)
    for ax, suite in zip(axes[:, 0], suites, strict=True):
        sel = [r for r in results if r.suite == suite]
        labels = list(dict.fromkeys(f"{r.workload}\n{r.variant}" for r in sel))
        threads = sorted({r.threads for r in sel})
        width = 0.8 / len(threads)
        for j, n in enumerate(threads):
            by = {f"{r.workload}\n{r.variant}": r.speedup() for r in sel if r.threads == n}
            xs = [i + j * width for i in range(len(labels))]
            ax.bar(xs, [by.get(lb, math.nan) for lb in labels], width, label=f"{n} thread(s)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(labels))], labels, fontsize=7,
                      rotation=60, ha="right")  # fmt: skip
        ax.set_ylabel("speedup vs best baseline")
        ax.set_title(f"{suite}: chainfuse vs the fastest baseline (higher is better)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "speedup.png"))

    # 2. hierarchical roofline: each 1-thread kernel once per level, at its FLOPs per byte
    # read from that level (the plan's prediction) and its measured GFLOP/s
    fig, ax = plt.subplots(figsize=(8.5, 6))
    pts = [r for r in results if r.threads == 1 and r.predicted_bytes]
    xs_all = [r.gflop * 1e9 / b for r in pts for b in r.predicted_bytes.values() if b > 0]
    lo, hi = min([0.5, *xs_all]) / 2, max([200.0, *xs_all]) * 2
    grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.axhline(peak, color="black", label=f"FP32 peak, measured ({peak:.0f} GFLOP/s)")
    ax.axhline(machine.nominal_peak_gflops, color="gray", linestyle=":",
               label=f"FP32 peak, nominal ({machine.nominal_peak_gflops:.0f})")  # fmt: skip
    bf16 = dict(machine.hardware.peak_flops).get(DType.BFLOAT16)
    if bf16 is not None:
        ax.axhline(bf16 / 1e9, color="purple", label=f"BF16 peak ({bf16 / 1e9:.0f})")
    measured_bw = dict(machine.bandwidth)
    colors = {level.name: f"C{k}" for k, level in enumerate(machine.hardware.levels)}
    for level in machine.hardware.levels:
        color = colors[level.name]
        ax.plot(grid, [min(peak, x * level.bandwidth / 1e9) for x in grid], color=color,
                linewidth=0.9, label=f"{level.name} {level.bandwidth / 1e9:.0f} GB/s nominal")  # fmt: skip
        if level.name in measured_bw:
            bw = measured_bw[level.name]
            ax.plot(grid, [min(peak, x * bw / 1e9) for x in grid], color=color,
                    linestyle="--", linewidth=0.9,
                    label=f"{level.name} {bw / 1e9:.0f} GB/s measured")  # fmt: skip
    for j, suite in enumerate(suites):
        for level in machine.hardware.levels:
            sel = [r for r in pts if r.suite == suite and r.predicted_bytes.get(level.name)]
            if not sel:
                continue
            ax.scatter([r.gflop * 1e9 / r.predicted_bytes[level.name] for r in sel],
                       [r.gflops() for r in sel], marker="os^"[j % 3], s=18,
                       color=colors[level.name], zorder=3,
                       label=f"{suite}: bytes from {level.name}")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP per byte read from the level (the plan's prediction)")
    ax.set_ylabel("GFLOP/s (one core)")
    ax.set_title("Hierarchical roofline of this machine (one core); chainfuse kernels on it")
    ax.legend(fontsize=6, loc="lower right", ncol=2)
    fig.tight_layout()
    paths.append(_save(fig, out / "roofline.png"))

    # 3. predicted vs measured time
    fig, ax = plt.subplots(figsize=(6.5, 6))
    fewest, at_fewest = fewest_threads(results)
    one = [r for r in at_fewest if not math.isnan(r.predicted_ms)]
    ax.scatter([r.predicted_ms for r in one], [r.ms["chainfuse"] for r in one],
               label="chosen plan of each workload", zorder=3)  # fmt: skip
    if fidelity:
        ax.scatter([p for f in fidelity for p in f.predicted_ms],
                   [m for f in fidelity for m in f.measured_ms], marker="x", alpha=0.6,
                   label="top plans (fidelity runs)")  # fmt: skip
    both = [r.predicted_ms for r in one] + [r.ms["chainfuse"] for r in one]
    if both:
        a, b = min(both) / 1.5, max(both) * 1.5
        ax.plot([a, b], [a, b], color="black", linewidth=0.8, label="measured = predicted")
        ax.set_xscale("log")  # (an empty axis cannot be log-scaled)
        ax.set_yscale("log")
    ax.set_xlabel("predicted ms")
    ax.set_ylabel("measured ms (1 thread, median)" if fewest == 1 else
                  f"measured ms ({fewest} threads, best of the rounds)")  # fmt: skip
    ax.set_title("The model's predicted time against the measured time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(_save(fig, out / "predicted_vs_measured.png"))

    # 4. planning and compile times
    firsts = {(r.suite, r.workload, r.variant): r for r in results if r.threads == min(
        x.threads for x in results)}  # fmt: skip
    if firsts:
        rows = list(firsts.values())
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(12, 6.5), sharex=True)
        labels = [f"{r.workload} {r.variant}" for r in rows]
        a1.bar(range(len(rows)), [r.planning_ms for r in rows], color="C2")
        a1.set_ylabel("planning ms")
        a1.set_title("Planning time (a full search) and compile time (or cache load) per kernel")
        a2.bar(range(len(rows)), [r.compile_s for r in rows], color="C3")
        a2.set_ylabel("compile s")
        a2.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out / "planning_compile.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
