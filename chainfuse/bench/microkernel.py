"""How close a micro-kernel gets to the FMA peak it could reach: ``python -m chainfuse.bench.microkernel``.

Two C loops, compiled together with the kernel's flags and timed in C (no Python in the loop):

- the kernel: ``mr x nr`` block, ``kc`` = 256 steps, packed panels resident in L1 (24 KiB for the
  AVX2 6x16 kernel), called ``reps`` times with ``accumulate`` = 1 on the same C block;
- the probe: 12 independent FMA chains ``c = c*x + y`` in the kernel's vector width (zmm for an
  AVX-512 kernel, ymm for AVX2, the vector-extension width or scalar otherwise). With enough
  chains to cover latency x pipes, this is the core's sustainable FMA throughput.

Prints GFLOP/s of both and the kernel's share of the probe. The machine is shared and clocks
drift: each figure is the best of ``--repeat`` timings of about ``--seconds`` each.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import DType
from chainfuse.kernels import MicroKernel, Problem, available, select
from chainfuse.runtime import build, load

__all__ = ["MicroBenchResult", "main", "measure", "source"]

PROBE_CHAINS = 12

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
{kernel.emit()}
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
