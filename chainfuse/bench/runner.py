"""`chainfuse bench [gemm-chain|attention|conv-chain|all]`: run suites, write the report.

    chainfuse bench all --quick --out bench-out     # the representative subset, ~2 minutes
    chainfuse bench gemm-chain --threads 1,2        # one suite, every paper workload

Order of a run: probe the machine (FP32 peak, read bandwidths, load average; warn when busy),
time a cold compile and a warm first call, run each suite (compile, check against the float64
reference, time chainfuse and the baselines interleaved), probe the FP32 peak again (the report's
peak is the better of the two probes), then the model-fidelity runs (the top plans of some
workloads compiled and timed), and write report.md, the plots and results.json into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chainfuse.bench import amx, attention, fidelity, gemm_chain, report, workloads
from chainfuse.bench.fidelity import Fidelity
from chainfuse.bench.harness import set_threads
from chainfuse.bench.probe import fp32_peak_gflops, measure_machine
from chainfuse.bench.results import HALF_SUFFIX, Result, suite_name
from chainfuse.hardware import Hardware
from chainfuse.ir import DType
from chainfuse.kernels.amx import ENV_AMX, AmxPath, amx_mode, amx_path, amx_status

__all__ = ["Progress", "main"]

SUITES = ("gemm-chain", "attention", "conv-chain")
CONV_QUICK = ("resnet50-1x1-3x3", "1x1-1x1-a")
# fidelity (the top plans compiled and timed): every workload of a suite, one variant each;
# --quick: one workload per suite
FIDELITY_VARIANT = "relu"


class Progress:
    """A one-line progress bar on a terminal, one line per step otherwise (logs, CI)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()

    def __call__(self, label: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if self.stream.isatty():
            filled = round(30 * self.done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            end = "\n" if self.done >= self.total else ""
            self.stream.write(
                f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f} s  {label:<40}{end}"
            )
        else:
            self.stream.write(f"[{self.done}/{self.total} {elapsed:.0f} s] {label}\n")
        self.stream.flush()


def _conv_module() -> Any | None:
    try:
        return importlib.import_module("chainfuse.bench.conv_chain")
    except ImportError:
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chainfuse bench", description=__doc__.split("\n")[0])
    p.add_argument("suite", nargs="?", default="all", choices=[*SUITES, "all"])
    p.add_argument("--quick", action="store_true", help="a representative subset (~2 minutes)")
    p.add_argument("--threads", default="1,2", help="thread counts, e.g. 1,2")
    p.add_argument("--dtype", default="fp32",
                   help="fp32, bf16, fp16 or a list, e.g. fp32,bf16 (16-bit: GEMM chains and "
                        "attention; conv is fp32)")  # fmt: skip
    p.add_argument("--between", default="none,relu", help="gemm-chain/conv-chain variants")
    p.add_argument("--rounds", type=int, default=15, help="timing rounds per case")
    p.add_argument("--top", type=int, default=10, help="plans per fidelity run (0: no fidelity)")
    p.add_argument("--out", default="bench-out", help="directory for report.md, plots, JSON")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the Triton kernels on the GPU against PyTorch (bench/gpu.py)")  # fmt: skip
    return p


def _parse_threads(text: str) -> list[int]:
    try:
        threads = [int(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(
            f"chainfuse bench: --threads: expected integers like 1,2, got {text!r}"
        ) from None
    if not threads or min(threads) < 1:
        raise SystemExit(f"chainfuse bench: --threads: expected positive integers, got {text!r}")
    return threads


def main(argv: Sequence[str] | None = None) -> int:
    """Run the suites; the thread settings it changes are put back when it returns (the
    process may go on: tests, notebooks)."""
    from chainfuse.runtime import threads as cc

    # every contender's OpenMP runtime passive (the README's protocol for 2 threads): each reads
    # the policy once, when it is loaded, and PyTorch's is loaded just below
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    before = cc.requested_num_threads()
    torch_before = _torch_threads()
    try:
        return _main(argv)
    finally:
        cc.set_num_threads(before)
        if torch_before is not None:
            import torch

            torch.set_num_threads(torch_before)


def _torch_threads() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return int(torch.get_num_threads())


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    names = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
             "fp16": "float16", "float16": "float16"}  # fmt: skip
    try:
        dtypes = list(dict.fromkeys(names[d] for d in args.dtype.split(",")))
    except KeyError as exc:
        print(f"chainfuse bench: --dtype: unknown {exc.args[0]!r}; expected fp32, bf16, fp16 "
              "or a list of them (fp32,bf16)", file=sys.stderr)  # fmt: skip
        return 2
    if args.device == "cuda":
        from chainfuse.bench import gpu

        chosen = ["gemm-chain", "attention", "mlp"] if args.suite == "all" else [args.suite]
        half = [d for d in dtypes if d != "float32"] if args.dtype == "fp32" else dtypes
        return gpu.main(chosen, args.quick, half or ["float16"], args.out)
    threads = _parse_threads(args.threads)
    betweens = [None if b == "none" else b for b in args.between.split(",")]
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    conv = _conv_module()
    half = [d for d in dtypes if d in HALF_SUFFIX]
    if half and args.suite == "conv-chain":
        print(f"chainfuse bench: --dtype {half[0]}: conv chains compile in fp32 only",
              file=sys.stderr)  # fmt: skip
        return 2
    if "conv-chain" in suites and conv is None:
        if args.suite == "conv-chain":
            print("chainfuse bench: the conv-chain suite is not available in this build",
                  file=sys.stderr)  # fmt: skip
            return 2
        suites.remove("conv-chain")
        print("note: conv-chain suite not available in this build; skipped", file=sys.stderr)

    gemm_names = gemm_chain.QUICK if args.quick else tuple(w.name for w in workloads.GEMM)
    att_names = [c[0] for c in attention.cases(args.quick)]
    conv_names = CONV_QUICK if args.quick else tuple(w.name for w in workloads.CONV)
    fid_gemm = gemm_names[:1] if args.quick else gemm_names
    fid_att = att_names[:1] if args.quick else att_names
    fid_conv = conv_names[:1] if args.quick else conv_names
    steps = {
        "gemm-chain": len(gemm_names) * len(betweens) * len(threads) * len(dtypes),
        "attention": len(att_names) * len(threads) * len(dtypes),
        "conv-chain": len(conv_names) * len(betweens) * len(threads),
    }
    total = sum(steps[s] for s in suites)
    if args.top > 0:
        total += len(fid_gemm) * ("gemm-chain" in suites) + len(fid_att) * ("attention" in suites)
        total += len(fid_conv) * ("conv-chain" in suites)

    set_threads(1)
    machine = measure_machine()
    print(f"{machine.hardware.name}: FP32 FMA peak measured {machine.peak_gflops:.1f} GFLOP/s "
          f"per core (nominal {machine.nominal_peak_gflops:.1f}); load {machine.load_average:.2f}")  # fmt: skip
    for w in machine.warnings():
        print(f"warning: {w}", file=sys.stderr)
    extra: dict[str, Any] = {"compile": gemm_chain.compile_times()}
    times = extra["compile"]
    print(f"cold compile {times['cold_compile_s']:.2f} s; warm first call (new process, cached) "
          f"{times['warm_first_call_s'] * 1e3:.1f} ms, its second call "
          f"{times['warm_second_call_s'] * 1e3:.1f} ms")  # fmt: skip

    amx_peak = _amx_probe(dtypes, extra, "before")
    progress = Progress(total)
    results: list[Result] = []
    runs: dict[str, Callable[[], list[Result]]] = {
        "gemm-chain": lambda: [
            r
            for d in dtypes
            for r in gemm_chain.run(gemm_names, betweens, threads, args.rounds, progress, d)
        ],
        "attention": lambda: [
            r for d in dtypes for r in attention.run(att_names, threads, args.rounds, progress, d)
        ],
        "conv-chain": lambda: _run_conv(conv, conv_names, betweens, threads, args.rounds, progress),
    }
    for suite in suites:
        results += runs[suite]()
    # the peak is what the core can do and a busy moment lowers one probe: the report's is the
    # better of the probes before and after the timings
    again = fp32_peak_gflops()
    extra["fp32_probe_gflops"] = {"before": machine.peak_gflops, "after": again}
    print(f"FP32 FMA peak measured again: {again:.1f} GFLOP/s per core")
    if again > machine.peak_gflops:
        machine = dataclasses.replace(machine, peak_gflops=again)
    peak = machine.peak_gflops
    if amx_peak is not None:
        amx_peak = max(amx_peak, _amx_probe(dtypes, extra, "after") or 0.0)
    # bf16 suites run on AMX: their % of peak is of the AMX probe
    peaks = {suite_name(s, "bfloat16"): (amx_peak, "AMX") for s in SUITES} if amx_peak else {}
    # each suite's headline figures (its targets are stated in them), where it has them
    summaries = {"gemm-chain": gemm_chain.summarise, "attention": attention.summarise}
    for suite in dict.fromkeys(r.suite for r in results):
        base = suite
        for suffix in HALF_SUFFIX.values():
            base = base.removesuffix(suffix)
        summarise = summaries.get(base)
        if summarise is not None:
            key = suite.replace("-", "_") + "_headline_figures"
            suite_peak = peaks.get(suite, (peak, "FP32"))[0]
            extra[key] = summarise([r for r in results if r.suite == suite], suite_peak)

    fids: list[Fidelity] = []
    if args.top > 0:
        set_threads(1)
        rounds = fidelity.QUICK_ROUNDS if args.quick else fidelity.ROUNDS
        if "gemm-chain" in suites:
            for name in fid_gemm:
                chain = workloads.chain_of(name, FIDELITY_VARIANT)
                fids.append(fidelity.measure(chain, "gemm-chain", name, FIDELITY_VARIANT,
                                             args.top, rounds, progress=progress))  # fmt: skip
        if "attention" in suites:
            for name in fid_att:
                fids.append(fidelity.measure(attention.chain_of(name), "attention", name,
                                             attention.variant(name), args.top, rounds,
                                             progress=progress))  # fmt: skip
        if "conv-chain" in suites:
            for name in fid_conv:
                chain = workloads.chain_of(name, FIDELITY_VARIANT)
                fids.append(fidelity.measure_conv(chain, "conv-chain", name, FIDELITY_VARIANT,
                                                  args.top, rounds, progress=progress))  # fmt: skip

    command = "chainfuse bench " + " ".join(argv if argv is not None else sys.argv[1:])
    files = report.write(Path(args.out), results, fids, machine, extra, command.strip(), peaks)
    for s in report.summary_rows(results, peak, peaks):
        print(f"{s['suite']:<11} {s['threads']}t  geomean x{s['geomean_speedup']:.2f}  "
              f"min x{s['min_speedup']:.2f}  over the fastest baseline ({s['cases']} cases)")  # fmt: skip
    for f in fids:
        print(f"fidelity {f.suite} {f.workload} {f.variant}: Spearman rho {f.rho:.2f} "
              f"(without kernel terms {f.rho_plain:.2f}; the measurement's own "
              f"{f.repeat_rho:.2f}), tuning gap {f.tuning_gap:.1%}")  # fmt: skip
    print("wrote " + ", ".join(str(p) for p in files))
    return 0


def _amx_probe(dtypes: Sequence[str], extra: dict[str, Any], when: str) -> float | None:
    """For a bf16 run: the AMX probe's GFLOP/s per core where the AMX kernels run on the unit
    (recorded in `extra["amx_probe_gflops"]`), else None with a line saying why the bf16
    figures are of the FP32 probe. Random operands (zeros overstate the unit's speed)."""
    if "bfloat16" not in dtypes:
        return None
    path = amx_path(DType.BFLOAT16)
    if path is AmxPath.REAL:
        gflops = amx.probe_gflops()
        if gflops is not None:
            extra.setdefault("amx_probe_gflops", {})[when] = gflops
            nominal = Hardware.detect().peak(DType.BFLOAT16) / 1e9
            print(f"AMX bf16 probe ({when}): {gflops:.1f} GFLOP/s per core (nominal "
                  f"{nominal:.1f}); bf16 % of peak is of the AMX probe")  # fmt: skip
            return gflops
    if when == "before":
        usable, why = amx_status()
        if path is AmxPath.EMULATED:
            why = f"{ENV_AMX}=emulate: the emulated AMX kernels, slow by design"
        elif usable:
            why = f"{ENV_AMX}={amx_mode().value}: the AMX kernels are not used"
        else:
            why = f"no AMX: {why}"
        extra["amx"] = why
        print(f"bf16: {why}; bf16 % of peak is of the FP32 probe")
    return None


def _run_conv(
    conv: Any,
    names: Sequence[str],
    betweens: Sequence[str | None],
    threads: Sequence[int],
    rounds: int,
    progress: Progress,
) -> list[Result]:
    out: list[Result] = []
    for name in names:  # one workload at a time, so the progress bar moves
        got: list[Result] = conv.run([name], betweens, threads, rounds)
        for r in got:
            progress(f"{r.workload} {r.variant} {r.threads}t")
        out += got
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
