"""What this machine can do right now: the FP32 FMA peak and read bandwidths, measured.

`Hardware.detect()` gives nominal figures (base clock x FMA width, bandwidths per level); a
shared machine delivers less, turbo more. Benchmarks quote both, and warn when the live probe
falls well below the nominal peak (someone else is using the cores).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from chainfuse.hardware import Hardware
from chainfuse.ir import DType

__all__ = ["Machine", "fp32_peak_gflops", "measure_machine", "read_bandwidth"]


def fp32_peak_gflops() -> float:
    """This core's FP32 FMA peak, measured now by a probe (12 independent FMA chains)."""
    from chainfuse.bench.microkernel import measure

    return measure(seconds=0.05, repeat=5).probe_gflops


def read_bandwidth(nbytes: int, seconds: float = 0.1) -> float:
    """Bytes/s of a BLAS dot product over two float32 vectors of `nbytes` in all (best pass).

    Sized to a cache level (e.g. half of L2) it measures that level; far beyond L3, DRAM. A dot
    is the cheapest read-bound loop numpy has (a sum is bound by its adds); below ~100 KiB
    the call overhead dominates, so L1 is not measured this way.
    """
    a = np.ones(max(1, nbytes // 8), dtype=np.float32)
    b = np.ones_like(a)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    passes = 0
    while passes < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        np.dot(a, b)
        best = min(best, time.perf_counter() - start)
        passes += 1
    return 2 * a.nbytes / best


@dataclass(frozen=True)
class Machine:
    """The hardware description next to what a probe measured in this run."""

    hardware: Hardware
    load_average: float
    peak_gflops: float  # measured, one core
    nominal_peak_gflops: float  # Hardware.detect()'s, one core
    bandwidth: tuple[tuple[str, float], ...]  # level -> measured read bytes/s, one core

    def warnings(self) -> list[str]:
        out = []
        if self.load_average > 0.5:
            out.append(
                f"load average {self.load_average:.2f}: another job is running; "
                "figures will be low and noisy"
            )
        if self.peak_gflops < 0.75 * self.nominal_peak_gflops:
            out.append(
                f"the FP32 probe reached {self.peak_gflops:.0f} GFLOP/s, well below the nominal "
                f"{self.nominal_peak_gflops:.0f}: the cores are busy or throttled"
            )
        return out


def measure_machine(hardware: Hardware | None = None) -> Machine:
    """Probe the FP32 peak and the read bandwidth of each level of this machine, now."""
    hw = hardware or Hardware.detect()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    bandwidth = []
    for level in hw.levels:
        if level.capacity < 128 << 10 and level is not hw.levels[-1]:
            continue  # overhead-dominated (see read_bandwidth)
        if level is hw.levels[-1]:
            size = max(256 << 20, 8 * hw.levels[-2].capacity) if len(hw.levels) > 1 else 256 << 20
        else:
            size = level.capacity // 2
        bandwidth.append((level.name, read_bandwidth(size)))
    return Machine(hw, load, fp32_peak_gflops(), hw.peak(DType.FLOAT32) / 1e9, tuple(bandwidth))
