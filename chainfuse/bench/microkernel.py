"""How close a micro-kernel gets to the FMA peak it could reach: ``python -m chainfuse.bench.microkernel``.

Two C loops, compiled together with the kernel's flags and timed in C (no Python in the loop):

- the kernel: ``mr x nr`` block, ``kc`` = 256 steps, packed panels resident in L1 (24 KiB for the
  AVX2 6x16 kernel), called ``reps`` times with ``accumulate`` = 1 on the same C block;
- the probe: 12 independent FMA chains ``c = c*x + y`` in the kernel's vector width (zmm for an
  AVX-512 kernel, ymm for AVX2, the vector-extension width or scalar otherwise). With enough
  chains to cover latency x pipes, this is the core's sustainable FMA throughput.

Prints GFLOP/s of both and the kernel's share of the probe. The machine is shared and clocks
drift: each figure is the best of ``--repeat`` timings of about ``--seconds`` each.

``--calibrate`` measures what the model's compute time needs of each kernel that runs here
(`chainfuse.kernels.calibration`): its speed at `CALIBRATION_STEPS` k steps a call, run as a
GEMM runs it (`SWEEP` packed A slivers in turn, each into its own C block), as a share of the
longest; and the cost of packing one element of a B panel (``pack_b`` of ``nr``-column slivers
from an L2-resident row-major B), in the kernel's flops; for a kernel with wide blocks that the
compiler picks for attention here, `split_head`: an attention (`SPLIT_CHAIN`) compiled with its
value head whole and tiled in parts (heads of one block and of two), timed interleaved. It
prints the entries as JSON;
``--write`` stores them in ``chainfuse/kernels/calibration.json`` (docs/tuning.md#calibration).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import numpy as np

from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import Chain, DType
from chainfuse.kernels import MicroKernel, Problem, available, emit_with_packing, select
from chainfuse.kernels.calibration import PATH, Calibration
from chainfuse.runtime import build, load, num_threads

__all__ = [
    "CALIBRATION_STEPS",
    "SPLIT_CHAIN",
    "MicroBenchResult",
    "calibrate",
    "main",
    "measure",
    "source",
    "split_head",
]

PROBE_CHAINS = 12
#: k steps a call at which `calibrate` times each kernel (up to the longest panel L1 holds).
CALIBRATION_STEPS = (4, 8, 16, 32, 64, 128, 256)
PACK_ROWS = 256  # the B panel `calibrate` packs: 256 k steps x 4 slivers, 64 KiB of floats
PACK_SLIVERS = 4
SWEEP = 32  # A slivers `calibrate` runs in turn against one B panel
#: (batch, heads, queries, keys, head dims) of the attention `split_head` times: ViT-base's
#: (heads of twice the dims: half as many)
SPLIT_CHAIN = (1, 12, 256, 256, 64)

_PROBES = {
    # (vector type declaration, lanes, splat, fma): the kernel's own vector width.
    "avx512": ("__m512", 16, "_mm512_set1_ps({x})", "_mm512_fmadd_ps({c}, {x}, {y})"),
    "avx2": ("__m256", 8, "_mm256_set1_ps({x})", "_mm256_fmadd_ps({c}, {x}, {y})"),
    "portable": ("chainfuse_probe_v8sf", 8, "chainfuse_probe_splat({x})", "{c} * {x} + {y}"),
}


@dataclass(frozen=True)
class MicroBenchResult:
    """Measured GFLOP/s of one micro-kernel and of the FMA probe of its vector width."""

    kernel: str
    kc: int
    kernel_gflops: float
    probe_gflops: float

    @property
    def fraction(self) -> float:
        return self.kernel_gflops / self.probe_gflops

    def __str__(self) -> str:
        return (
            f"micro-kernel {self.kernel} (kc={self.kc}, L1-resident panels, 1 thread)\n"
            f"  kernel    {self.kernel_gflops:8.1f} GFLOP/s\n"
            f"  FMA probe {self.probe_gflops:8.1f} GFLOP/s ({PROBE_CHAINS} independent chains)\n"
            f"  kernel / probe  {100 * self.fraction:5.1f} %"
        )


def _probe_kind(kernel: MicroKernel) -> str:
    if Isa.AVX512F in kernel.isa:
        return "avx512"
    if Isa.AVX2 in kernel.isa and Isa.FMA in kernel.isa:
        return "avx2"
    return "portable"


def source(kernel: MicroKernel) -> str:
    """The benchmark's C: the kernel, a timed loop over it, and the FMA probe."""
    vtype, lanes, splat, fma = _PROBES[_probe_kind(kernel)]
    chains = range(PROBE_CHAINS)
    init = "\n".join(f"    {vtype} c{i} = {splat.format(x=f'{i + 1}.0f * seed')};" for i in chains)
    step = "\n".join(f"        c{i} = {fma.format(c=f'c{i}', x='x', y='y')};" for i in chains)
    total = " + ".join(f"c{i}" for i in chains)
    return f"""\
#define _POSIX_C_SOURCE 199309L
#include <time.h>
{emit_with_packing(kernel)}
typedef float chainfuse_probe_v8sf __attribute__((vector_size(32)));
static inline chainfuse_probe_v8sf chainfuse_probe_splat(float x)
{{
    return (chainfuse_probe_v8sf){{x, x, x, x, x, x, x, x}};
}}

static double now(void)
{{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}}

/* Seconds for `reps` calls on one full mr x nr block, accumulating into C. */
double bench_kernel(int kc, long reps, const float* Ap, const float* Bp, float* C, long ldc)
{{
    const double t0 = now();
    for (long r = 0; r < reps; ++r) {{
        {kernel.name}(kc, Ap, Bp, C, ldc, {kernel.mr}, {kernel.nr}, 1);
        __asm__ volatile("" ::: "memory"); /* keep every call */
    }}
    return now() - t0;
}}

/* Seconds for `reps` calls as a GEMM runs them: {SWEEP} packed A slivers of kc steps in turn
   (from L2 for long calls), one packed B panel, each sliver into a C block of its own. */
double bench_sweep(int kc, long reps, const float* Ap, const float* Bp, float* C, long ldc)
{{
    const double t0 = now();
    for (long r = 0; r < reps; ++r) {{
        const long s = r % {SWEEP};
        {kernel.name}(kc, Ap + s * kc * {kernel.mr}, Bp, C + s * {kernel.mr} * ldc, ldc, {kernel.mr}, {kernel.nr}, 1);
        __asm__ volatile("" ::: "memory");
    }}
    return now() - t0;
}}

/* Seconds for `reps` packings of {PACK_SLIVERS} {kernel.nr}-column slivers of kc rows of B. */
double bench_pack(int kc, long reps, const float* B, long ldb, float* Bp)
{{
    const double t0 = now();
    for (long r = 0; r < reps; ++r) {{
        for (int j = 0; j < {PACK_SLIVERS}; ++j) {{
            {kernel.name}_pack_b(kc, {kernel.nr}, B + j * {kernel.nr}, ldb, Bp + (long)j * kc * {kernel.nr});
        }}
        __asm__ volatile("" ::: "memory");
    }}
    return now() - t0;
}}

/* Seconds for `iters` x {PROBE_CHAINS} independent FMAs of {lanes} lanes; result in *sink. */
double bench_probe(long iters, float seed, float* sink)
{{
    const {vtype} x = {splat.format(x="0.999999f")};
    const {vtype} y = {splat.format(x="1e-6f")};
{init}
    const double t0 = now();
    for (long r = 0; r < iters; ++r) {{
{step}
    }}
    const double t = now() - t0;
    const {vtype} s = {total};
    float out[{lanes}];
    __builtin_memcpy(out, &s, sizeof out);
    *sink = out[0];
    return t;
}}
"""


def measure(
    kernel: MicroKernel | None = None, kc: int = 256, seconds: float = 0.1, repeat: int = 15
) -> MicroBenchResult:
    """Time ``kernel`` (default: `select` for this host) and the FMA probe of its width."""
    hardware = Hardware.detect()
    if kernel is None:
        kernel = select(Problem(DType.FLOAT32, 4096, 4096, kc), hardware)
    lib = load(build(source(kernel), f"bench_{kernel.name}", kernel.cflags).path)
    f32p = ctypes.POINTER(ctypes.c_float)
    lib.bench_kernel.restype = ctypes.c_double
    lib.bench_kernel.argtypes = [ctypes.c_int, ctypes.c_long, f32p, f32p, f32p, ctypes.c_long]
    lib.bench_probe.restype = ctypes.c_double
    lib.bench_probe.argtypes = [ctypes.c_long, ctypes.c_float, f32p]

    rng = np.random.default_rng(0)
    Ap = rng.uniform(-1, 1, kc * kernel.mr).astype(np.float32)
    Bp = rng.uniform(-1, 1, kc * kernel.nr).astype(np.float32)
    C = np.zeros((kernel.mr, kernel.nr), np.float32)
    sink = ctypes.c_float()

    def ptr(a: np.ndarray) -> ctypes._Pointer[ctypes.c_float]:
        return a.ctypes.data_as(f32p)

    def time_kernel(reps: int) -> float:
        return float(lib.bench_kernel(kc, reps, ptr(Ap), ptr(Bp), ptr(C), kernel.nr))

    def time_probe(iters: int) -> float:
        return float(lib.bench_probe(iters, 1.0, ctypes.byref(sink)))

    kernel_flops = 2.0 * kernel.mr * kernel.nr * kc
    lanes = _PROBES[_probe_kind(kernel)][1]
    probe_flops = 2.0 * PROBE_CHAINS * lanes
    kernel_reps = _calibrate(time_kernel, seconds)
    probe_iters = _calibrate(time_probe, seconds)
    best_kernel = best_probe = 0.0
    for _ in range(repeat):  # interleaved, so both see the same machine load and clock
        best_kernel = max(best_kernel, kernel_reps * kernel_flops / time_kernel(kernel_reps))
        best_probe = max(best_probe, probe_iters * probe_flops / time_probe(probe_iters))
    return MicroBenchResult(kernel.name, kc, best_kernel / 1e9, best_probe / 1e9)


def calibrate(kernel: MicroKernel, seconds: float = 0.04, repeat: int = 25) -> Calibration:
    """Measure `kernel`'s calibration entry on this host (module docstring): its speed at each
    of `CALIBRATION_STEPS` k steps a call (best of `repeat` interleaved rounds) as a share of the
    longest, and a packed element's cost in its flops at that speed. The machine may be shared:
    each point is its least time over the rounds, and a point below a shorter one's speed takes
    that speed. (A line through the points, a call costing `kc + overhead` steps, overstated a
    long call's overhead, which out-of-order execution hides: docs/tuning.md#calibration.)"""
    lib = load(build(source(kernel), f"bench_{kernel.name}", kernel.cflags).path)
    f32p = ctypes.POINTER(ctypes.c_float)
    lib.bench_sweep.restype = ctypes.c_double
    lib.bench_sweep.argtypes = [ctypes.c_int, ctypes.c_long, f32p, f32p, f32p, ctypes.c_long]
    lib.bench_pack.restype = ctypes.c_double
    lib.bench_pack.argtypes = [ctypes.c_int, ctypes.c_long, f32p, ctypes.c_long, f32p]
    longest = max(CALIBRATION_STEPS)
    rng = np.random.default_rng(0)
    Ap = rng.uniform(-1, 1, SWEEP * longest * kernel.mr).astype(np.float32)
    Bp = rng.uniform(-1, 1, max(longest * kernel.nr, PACK_ROWS * kernel.nr * PACK_SLIVERS))
    Bp = Bp.astype(np.float32)
    ldb = kernel.nr * PACK_SLIVERS
    B = rng.uniform(-1, 1, PACK_ROWS * ldb).astype(np.float32)
    C = np.zeros((SWEEP * kernel.mr, kernel.nr), np.float32)

    def ptr(a: np.ndarray) -> ctypes._Pointer[ctypes.c_float]:
        return a.ctypes.data_as(f32p)

    def timer(kc: int) -> Callable[[int], float]:
        return lambda reps: float(lib.bench_sweep(kc, reps, ptr(Ap), ptr(Bp), ptr(C), kernel.nr))

    def time_pack(reps: int) -> float:
        return float(lib.bench_pack(PACK_ROWS, reps, ptr(B), ldb, ptr(Bp)))

    reps = {kc: _calibrate(timer(kc), seconds) for kc in CALIBRATION_STEPS}
    pack_reps = _calibrate(time_pack, seconds)
    call = dict.fromkeys(CALIBRATION_STEPS, math.inf)  # least seconds a call
    pack = math.inf  # least seconds an element
    for _ in range(repeat):  # interleaved: every point sees the same load and clock
        for kc in CALIBRATION_STEPS:
            call[kc] = min(call[kc], timer(kc)(reps[kc]) / reps[kc])
        pack = min(pack, time_pack(pack_reps) / (pack_reps * PACK_ROWS * ldb))
    # each point's least seconds a step, as a share of the fastest; a longer call is never
    # slower (what is left between long points is the clock's noise, not the kernel)
    per_step = {kc: t / kc for kc, t in call.items()}
    slope = min(per_step.values())  # seconds a step at the kernel's best
    shares, best = [], 0.0
    for kc in CALIBRATION_STEPS:
        best = max(best, slope / per_step[kc])
        shares.append((kc, round(best, 3)))

    step_flops = 2.0 * kernel.mr * kernel.nr
    split = split_head(kernel) or (1.0, 1.0)
    return Calibration(
        kernel=kernel.name,
        measured_on=f"{Hardware.detect().name} ({date.today().isoformat()})",
        reduction=tuple(shares),
        pack_flops=round(pack * step_flops / slope, 2),
        split_head=split[0],
        split_multiple=split[1],
    )


def split_head(kernel: MicroKernel, rounds: int = 60) -> tuple[float, float] | None:
    """`Calibration.split_head` and `split_multiple` of `kernel`, or None where it has no wide
    block or the compiler runs another kernel's for attention here: `SPLIT_CHAIN` with a value
    head of `nr` and of twice that, each compiled whole and tiled at half and three quarters of
    the head, timed interleaved (`timing.paired_ms`); each share the second GEMM's speed that
    makes the model's time grow as the measured one did (the GEMM's share of the time taken as
    its share of the flops)."""
    from chainfuse.builders import attention_chain
    from chainfuse.model import kernel_of

    batch, heads, queries, keys, _ = SPLIT_CHAIN
    single = attention_chain(batch, heads, queries, keys, kernel.nr, kernel.nr)
    chosen = kernel_of(single, Hardware.detect())
    if kernel.wide is None or chosen is None or chosen.name != kernel.name:
        return None
    one = _split_share(single, rounds)
    two = 2 * kernel.nr
    several = _split_share(attention_chain(batch, heads // 2, queries, keys, two, two), rounds)
    return one, several


def _split_share(chain: Chain, rounds: int) -> float:
    """The second GEMM's speed with its value head in parts, as a share of it whole (above)."""
    from chainfuse import reference
    from chainfuse.bench.fidelity import SAMPLE_S, _batch, _repeats
    from chainfuse.bench.timing import interleave, paired_ms
    from chainfuse.compiler import compile

    hw = Hardware.detect()
    value = chain.contractions[1].output.loops[-1]
    dims = chain.extents[value]
    inputs = reference.random_inputs(chain, seed=0)
    args = [inputs[t.name] for t in chain.inputs]
    out = np.empty(chain.outputs[0].shape, np.float32)
    calls = {}
    for tile in (dims, dims // 2, dims * 3 // 4):
        built = compile(chain, hw, threads=1, tiles={value: tile})
        calls[str(tile)] = functools.partial(built, *args, out=out)
    with num_threads(1):  # (planned for one thread)
        reps = _repeats(calls[str(dims)], SAMPLE_S)
        timing = interleave({k: _batch(c, reps) for k, c in calls.items()}, rounds, budget_s=60.0)
    paired = paired_ms(timing, str(dims))
    ratio = statistics.mean(paired[k] / paired[str(dims)] for k in calls if k != str(dims))
    ext = chain.extents
    flops = [math.prod(ext[n] for n in op.loops) for op in chain.contractions]
    share = flops[1] / sum(flops)  # the second GEMM's share of the whole head's time
    return round(min(4.0, share / max(share / 4, ratio - 1 + share)), 3)


def write(entries: list[Calibration], path: Path = PATH) -> None:
    """Store `entries` in the calibration file, replacing those of the same kernels."""
    data = json.loads(path.read_text())
    for entry in entries:
        data["kernels"][entry.kernel] = entry.to_dict()
    text = json.dumps(data, indent=1)
    text = re.sub(r"\[\s+(\d+),\s+([\d.]+)\s+\]", r"[\1, \2]", text)  # a point a line
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def _calibrate(timed: Callable[[int], float], seconds: float) -> int:
    """Units of work that last about ``seconds`` (the first timings double as a warm-up)."""
    units = 1000
    while (elapsed := timed(units)) < seconds / 10:
        units *= 4
    return max(1, int(units * seconds / elapsed))


def main(argv: list[str] | None = None) -> int:
    names = [k.name for k in available()]
    parser = argparse.ArgumentParser(
        prog="python -m chainfuse.bench.microkernel", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--kernel", choices=names, help="default: select() for this machine")
    parser.add_argument("--kc", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=0.1, help="per timing")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--isa", choices=["amx"], help="amx: the AMX-BF16 tile block against the TDPBF16PS probe"
    )
    parser.add_argument(
        "--emulate", action="store_true", help="with --isa amx: the emulated build (correctness)"
    )
    parser.add_argument(
        "--calibrate", action="store_true", help="measure the model's efficiency terms (JSON)"
    )
    parser.add_argument("--write", action="store_true", help="with --calibrate: store them")
    args = parser.parse_args(argv)
    if args.isa == "amx":
        return _amx(parser, args)
    if args.emulate:
        parser.error("--emulate goes with --isa amx")
    kernel = None
    if args.kernel is not None:
        kernel = next(k for k in available() if k.name == args.kernel)
        if not kernel.isa <= Hardware.detect().isa:
            parser.error(f"{kernel.name} needs {sorted(f.value for f in kernel.isa)}")
    if args.write and not args.calibrate:
        parser.error("--write goes with --calibrate")
    if args.calibrate:
        here = Hardware.detect()
        kernels = [kernel] if kernel else [k for k in available() if k.isa <= here.isa]
        entries = [calibrate(k) for k in kernels if DType.FLOAT32 in k.dtypes]
        print(json.dumps({e.kernel: e.to_dict() for e in entries}, indent=1))
        if args.write:
            write(entries)
        return 0
    print(measure(kernel, args.kc, args.seconds, args.repeat))
    return 0


def _amx(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--isa amx``: the AMX block on the unit, or through the emulation with ``--emulate``."""
    from chainfuse.bench import amx
    from chainfuse.kernels.amx import AmxPath, amx_status

    if args.kernel is not None:
        parser.error("--kernel names an FMA micro-kernel; --isa amx measures amx_bf16_32x32")
    usable, why = amx_status()
    if not usable and not args.emulate:
        print(
            f"no AMX: {why}. The AMX micro-kernel needs a CPU with AMX-TILE and AMX-BF16 and "
            "the kernel's permission; add --emulate for a correctness smoke run of the emulated "
            "build (its speed is not the unit's)",
            file=sys.stderr,
        )
        return 2
    path = AmxPath.EMULATED if args.emulate else AmxPath.REAL
    print(amx.measure(path, args.kc, args.seconds, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
