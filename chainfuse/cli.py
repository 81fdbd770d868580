"""The `chainfuse` command: plan a paper workload or explicit sizes, show the hardware.

chainfuse plan bert-base --hw xeon-gold-6240
chainfuse plan --gemm 12,512,64,64,512 --between softmax --json
chainfuse plan --conv 64,56,56,64,64,1,1 --kernels 1,3 --between relu
chainfuse hw [--hw PRESET]
chainfuse bench [gemm-chain|attention|conv-chain|models|all] [--quick] [--threads 1,2] [--out DIR]
chainfuse fuzz --cases 10000 [--seed S] [--ops gemm_chain,attention,conv_chain] [--dtypes ...]
chainfuse fuzz --seed S --case N        # rerun one case, printing its operands
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from chainfuse.bench import workloads
from chainfuse.builders import conv_chain_spec, gemm_chain
from chainfuse.gpu_plan import TritonPlan, plan_triton
from chainfuse.hardware import DeviceKind, Hardware, presets, resolve
from chainfuse.ir import ACTIVATION_NAMES, Chain, DType
from chainfuse.kernels.amx import amx_path, amx_report
from chainfuse.planner import Plan, PlanningError, timed_plan
from chainfuse.simulate import simulate

__all__ = ["main"]


def _ints(text: str, count: int, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what}: expected {count} integers, got {text!r}"
        ) from None
    if len(values) != count:
        raise argparse.ArgumentTypeError(f"{what}: expected {count} integers, got {len(values)}")
    return values


def _chain(args: argparse.Namespace) -> Chain:
    given = [x for x in (args.workload, args.gemm, args.conv) if x]
    if len(given) != 1:
        raise SystemExit("chainfuse plan: give exactly one of WORKLOAD, --gemm or --conv")
    between = None if args.between == "none" else args.between
    if args.workload:
        return workloads.chain_of(args.workload, between, args.dtype)
    if args.gemm:
        b, m, n, k, l_ = _ints(args.gemm, 5, "--gemm b,M,N,K,L")
        return gemm_chain(b, m, n, k, l_, between, args.dtype)
    c, h, w, k1, k2, s1, s2 = _ints(args.conv, 7, "--conv C,H,W,K1,K2,stride1,stride2")
    r1, r2 = _ints(args.kernels, 2, "--kernels R1,R2")
    return conv_chain_spec(1, c, h, w, k1, r1, r1, k2, r2, r2, stride=(s1, s2),
                           padding=(r1 // 2, r2 // 2), between=between, dtype=args.dtype)  # fmt: skip


def _plan(args: argparse.Namespace) -> int:
    chain = _chain(args)
    hw = resolve(args.hw)
    shown: Plan | TritonPlan
    if (
        hw.gpu is not None
        and len(chain.contractions) == 2
        and {"m", "n", "k", "l"} <= set(chain.extents)
    ):  # a GPU runs two-GEMM chains as Triton kernels: their blocks, warps and stages
        start = time.perf_counter()
        shown = plan_triton(chain, hw)
        result, seconds = shown.plan, time.perf_counter() - start
    else:
        result, seconds = timed_plan(chain, hw, threads=args.threads)
        shown = result
    if args.json:
        print(shown.to_json())
        return 0
    print(chain)
    print()
    print(shown)
    print(f"  planned in {seconds * 1e3:.1f} ms")
    if chain.dtype in (DType.BFLOAT16, DType.FLOAT16) and hw.kind is DeviceKind.CPU:
        print(f"  arithmetic: {_arithmetic(chain.dtype, hw)}")
        if (
            args.hw in (None, "detect")
            and hw.matrix_engine(chain.dtype)
            and not amx_path(chain.dtype)
        ):
            print(
                f"  (here the AMX kernels do not run, so compiled kernels are fp32-fma: {amx_report()})"
            )
    if args.simulate:
        sim = simulate(chain, result, hw)
        print("  level   predicted     simulated")
        for level, predicted in result.bytes_per_level:
            print(f"  {level:<6} {predicted:>12,} {sim[level]:>13,}")
    return 0


def _arithmetic(dtype: DType, hw: Hardware) -> str:
    """The path a 16-bit chain is planned for on `hw` (`Hardware.for_chain`)."""
    if hw.matrix_engine(dtype):
        peak = hw.peak(dtype) / 1e9
        return f"amx-bf16 (AMX tiles, 32x32 block; {peak:,.0f} GFLOP/s a core)"
    return f"fp32-fma ({dtype.value} widened to fp32; {hw.peak(DType.FLOAT32) / 1e9:,.0f} GFLOP/s a core)"


def _hw(args: argparse.Namespace) -> int:
    hw = resolve(args.hw)
    print(hw)
    if args.hw in (None, "detect"):
        print(f"AMX: {amx_report()}")
    elif hw.amx:
        print("AMX: in this preset's ISA (planning only: this host is not checked)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from chainfuse.bench import runner

    rest = list(args.rest)
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if rest[:1] == ["models"]:  # whole models end to end (needs torch and transformers)
        from chainfuse.bench import models

        return models.main(rest[1:])
    return runner.main(rest)


def _fuzz(args: argparse.Namespace) -> int:
    from chainfuse.bench import fuzz

    return fuzz.main(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chainfuse", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    hw_help = f"a preset ({', '.join(presets())}) or 'detect' (default)"

    p = sub.add_parser("plan", help="plan a chain and print the plan")
    p.add_argument("workload", nargs="?", help=f"one of: {', '.join(workloads.names())}")
    p.add_argument("--gemm", metavar="b,M,N,K,L", help="an explicit batched GEMM chain")
    p.add_argument("--conv", metavar="C,H,W,K1,K2,s1,s2", help="an explicit conv chain")
    p.add_argument("--kernels", default="3,1", metavar="R1,R2", help="conv kernel sizes")
    p.add_argument("--between", default="none",
                   choices=["none", *ACTIVATION_NAMES, "softmax"])  # fmt: skip
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"],
    )
    p.add_argument("--hw", default="detect", help=hw_help)
    p.add_argument("--threads", type=int, default=None, help="cores to plan for")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--simulate", action="store_true", help="also run the tile simulator")
    p.set_defaults(run=_plan)

    b = sub.add_parser("bench", help="benchmark against PyTorch/numpy, write a report",
                       add_help=False)  # fmt: skip
    b.add_argument("rest", nargs=argparse.REMAINDER,
                   help="[gemm-chain|attention|conv-chain|models|all] [--quick] ... (see --help)")  # fmt: skip
    b.set_defaults(run=_bench)

    f = sub.add_parser("fuzz", help="run random cases of every op against the reference")
    from chainfuse.bench.fuzz import add_arguments

    add_arguments(f)
    f.set_defaults(run=_fuzz)

    h = sub.add_parser("hw", help="print the detected (or a preset) hardware")
    h.add_argument("--hw", default="detect", help=hw_help)
    h.set_defaults(run=_hw)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # its own parser takes everything after it: argparse's REMAINDER does not take a first
        # argument that looks like an option (`chainfuse bench --help`, `bench --quick`)
        argv = ["bench", "--", *argv[1:]]
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except (ValueError, PlanningError, argparse.ArgumentTypeError) as exc:
        print(f"chainfuse {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
