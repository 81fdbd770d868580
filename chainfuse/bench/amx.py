"""AMX throughput, measured: the TDPBF16PS probe and the AMX micro-kernel.

- The probe: four independent TDPBF16PS a step (accumulator tiles 0-3, operands 4-7 loaded
  once from random bf16), timed in C. One instruction is 16,384 FLOP and issues every 16 cycles
  on the unit (1,024 FLOP/cycle): the probe is the unit's throughput right now, which a second
  tenant of the unit can cut by ~3.5x (seen on an AMX Xeon). Real AMX only: the
  emulation's speed says nothing about the unit, so `probe_gflops` refuses it.
- The micro-kernel: the 2 x 2-tile block `cf_amx_r2c2` (32 x 32 fp32 += 32 x kc . kc x 32 bf16)
  on panels resident in L1, called repeatedly on the same C block; checked against numpy first.

Random operands throughout: zero-filled tiles keep the clock high and overstate the speed by
~20 %. ``python -m chainfuse.bench.microkernel --isa amx`` runs `main` (``--emulate``: the
emulated build, for a correctness smoke on any host; its speed is not the unit's).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from chainfuse.codegen.common import c_source
from chainfuse.kernels.amx import AMX_BF16_32X32, AmxPath, amx_status
from chainfuse.runtime import build, load

__all__ = ["AmxBench", "amx_source", "measure", "probe_gflops"]

#: TDPBF16PS a probe step issues (independent accumulators: enough to cover its latency)
PROBE_TILES = 4
#: FLOP of one TDPBF16PS: 16 x 16 outputs x 32 products x 2
INSTRUCTION_FLOP = 16 * 16 * 32 * 2


def amx_source() -> str:
    """The benchmark's C, for either build (`AmxPath.cflags`)."""
    uk = AMX_BF16_32X32
    assert uk.full_tile is not None
    tile_blocks = uk.full_tile(uk)
    dots = "\n".join(f"        CF_TILE_DPBF16PS({t}, {4 + t // 2}, {6 + t % 2});" for t in range(4))
    return f"""\
#define _POSIX_C_SOURCE 199309L
#include <time.h>
{c_source("amx_tiles.c")}
{tile_blocks}
static double now(void)
{{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}}

static void config(void)
{{
    cf_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {{
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }}
    CF_TILE_LOADCONFIG(&cfg);
}}

/* Seconds for `iters` x 4 TDPBF16PS on tiles loaded from A (2 x 1 KiB) and B (2 x 1 KiB); the
   accumulators are stored to C (16 x 64 floats) so that nothing is optimised away. */
double amx_probe(long iters, const uint16_t* A, const uint16_t* B, float* C)
{{
    config();
    CF_TILE_LOADD(4, A, 64);
    CF_TILE_LOADD(5, A + 512, 64);
    CF_TILE_LOADD(6, B, 64);
    CF_TILE_LOADD(7, B + 512, 64);
    CF_TILE_ZERO(0);
    CF_TILE_ZERO(1);
    CF_TILE_ZERO(2);
    CF_TILE_ZERO(3);
    const double t0 = now();
    for (long r = 0; r < iters; ++r) {{
{dots}
    }}
    const double t = now() - t0;
    CF_TILE_STORED(0, C, 256);
    CF_TILE_STORED(1, C + 16, 256);
    CF_TILE_STORED(2, C + 32, 256);
    CF_TILE_STORED(3, C + 48, 256);
    CF_TILE_RELEASE();
    return t;
}}

/* Seconds for `reps` calls of the 32 x 32 block over kb blocks of 32 k: A 32 rows of 32 kb
   bf16, B two column tiles of kb VNNI tiles, C 32 x 32 fp32 (accumulate: reps > 0 adds). */
double amx_block(long reps, long kb, const uint16_t* A, const uint16_t* B, float* C, int acc)
{{
    config();
    const double t0 = now();
    for (long r = 0; r < reps; ++r) {{
        cf_amx_r2c2(kb, A, 64 * kb, B, kb, C, 128, acc);
        __asm__ volatile("" ::: "memory"); /* keep every call */
    }}
    const double t = now() - t0;
    CF_TILE_RELEASE();
    return t;
}}
"""


def _library(path: AmxPath) -> ctypes.CDLL:
    lib = load(build(amx_source(), "bench_amx", path.cflags).path)
    u16p, f32p = ctypes.POINTER(ctypes.c_uint16), ctypes.POINTER(ctypes.c_float)
    lib.amx_probe.restype = ctypes.c_double
    lib.amx_probe.argtypes = [ctypes.c_long, u16p, u16p, f32p]
    lib.amx_block.restype = ctypes.c_double
    lib.amx_block.argtypes = [ctypes.c_long, ctypes.c_long, u16p, u16p, f32p, ctypes.c_int]
    return lib


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, rounded to nearest even (finite inputs)."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _vnni(b: np.ndarray) -> np.ndarray:
    """bf16 bits of B [32 kb, 32] as `cf_amx_r2c2` reads them: column tile c's block p at
    (c kb + p) x 512, its row q holding B[32p + 2q, 16c + j], B[32p + 2q + 1, 16c + j] at 2j,
    2j + 1."""
    kb = b.shape[0] // 32
    tiles = b.reshape(kb, 16, 2, 2, 16).transpose(3, 0, 1, 4, 2)  # c, p, q, j, pair
    return np.ascontiguousarray(tiles.reshape(-1))


def _u16(a: np.ndarray) -> ctypes._Pointer[ctypes.c_uint16]:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_uint16))


def _f32(a: np.ndarray) -> ctypes._Pointer[ctypes.c_float]:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def _calibrate(timed: Callable[[int], float], seconds: float, start: int) -> int:
    """Units of work that last about ``seconds`` (the first timings double as a warm-up)."""
    units = start
    while (elapsed := timed(units)) < seconds / 10:
        units *= 4
    return max(1, int(units * seconds / elapsed))


def _probe(lib: ctypes.CDLL, seconds: float, repeat: int) -> float:
    rng = np.random.default_rng(1)
    A = _bf16(rng.uniform(-1, 1, 1024).astype(np.float32))
    B = _bf16(rng.uniform(-1, 1, 1024).astype(np.float32))
    C = np.zeros(16 * 64, np.float32)

    def timed(iters: int) -> float:
        return float(lib.amx_probe(iters, _u16(A), _u16(B), _f32(C)))

    iters = _calibrate(timed, seconds, 1000)
    best = max(iters / timed(iters) for _ in range(repeat))
    return best * PROBE_TILES * INSTRUCTION_FLOP / 1e9


def probe_gflops(seconds: float = 0.05, repeat: int = 5) -> float | None:
    """The AMX unit's TDPBF16PS throughput on one core now, GFLOP/s; None without real AMX (the
    emulation is never probed)."""
    if not amx_status()[0]:
        return None
    return _probe(_library(AmxPath.REAL), seconds, repeat)


@dataclass(frozen=True)
class AmxBench:
    """The AMX micro-kernel's GFLOP/s next to the probe's (None: emulated, no probe), and its
    largest deviation from the float64 product of the same bf16 operands."""

    path: AmxPath
    kc: int
    kernel_gflops: float
    probe_gflops: float | None
    max_error: float

    def __str__(self) -> str:
        lines = [
            f"micro-kernel {AMX_BF16_32X32.name} ({self.path.value}; kc={self.kc}, L1-resident "
            "panels, random bf16, 1 thread)",
            f"  checked against numpy (float64 of the bf16 operands): max |error| "
            f"{self.max_error:.2e}",
        ]
        if self.probe_gflops is None:
            lines.append(
                f"  kernel    {self.kernel_gflops:8.2f} GFLOP/s through the emulation (a "
                "correctness smoke run: not the unit's speed; no AMX probe)"
            )
        else:
            lines += [
                f"  kernel    {self.kernel_gflops:8.1f} GFLOP/s",
                f"  AMX probe {self.probe_gflops:8.1f} GFLOP/s ({PROBE_TILES} independent "
                "TDPBF16PS a step)",
                f"  kernel / probe  {100 * self.kernel_gflops / self.probe_gflops:5.1f} %",
            ]
        return "\n".join(lines)


def measure(path: AmxPath, kc: int = 256, seconds: float = 0.1, repeat: int = 15) -> AmxBench:
    """Check the AMX block once against numpy, then time it (and, on real AMX, the probe,
    interleaved with it). ``kc``: a multiple of 32."""
    if kc < 32 or kc % 32:
        raise ValueError(f"kc: expected a positive multiple of 32, got {kc}")
    if path is AmxPath.REAL and not amx_status()[0]:
        raise RuntimeError(f"no AMX here: {amx_status()[1]}")
    lib = _library(path)
    rng = np.random.default_rng(0)
    kb = kc // 32
    A = _bf16(rng.uniform(-1, 1, (32, kc)).astype(np.float32))
    Bl = _bf16(rng.uniform(-1, 1, (kc, 32)).astype(np.float32))
    B = _vnni(Bl)
    C = np.zeros((32, 32), np.float32)
    lib.amx_block(1, kb, _u16(A), _u16(B), _f32(C), 0)
    want = _float(A).astype(np.float64) @ _float(Bl).astype(np.float64)
    error = float(np.max(np.abs(C - want)))
    if not error <= 1e-5 * kc:  # fp32 accumulation of kc products of magnitude < 1
        raise AssertionError(f"the AMX block is off by {error:.3g} (kc={kc})")

    def timed(reps: int) -> float:
        return float(lib.amx_block(reps, kb, _u16(A), _u16(B), _f32(C), 1))

    flop = 2.0 * 32 * 32 * kc
    if path is AmxPath.EMULATED:  # (one short timing: the emulation is slow and not the point)
        start = time.perf_counter()
        timed(1)
        return AmxBench(path, kc, flop / (time.perf_counter() - start) / 1e9, None, error)
    reps = _calibrate(timed, seconds, 100)
    best_kernel = best_probe = 0.0
    for _ in range(repeat):  # interleaved, so both see the same load and clock
        best_kernel = max(best_kernel, reps * flop / timed(reps) / 1e9)
        best_probe = max(best_probe, _probe(lib, seconds / 4, 1))
    return AmxBench(path, kc, best_kernel, best_probe, error)
