"""What every benchmark suite produces: one `Result` per (workload, variant, thread count).

Suites (`gemm_chain`, `attention`, `conv_chain`) fill these; `report` turns a list of them into
`report.md`, plots and JSON without knowing which suite made them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["HALF_SUFFIX", "Result", "geomean", "suite_name"]

#: the suffix a 16-bit run adds to its suite's name ("attention-bf16"); float32 adds none
HALF_SUFFIX = {"bfloat16": "-bf16", "float16": "-fp16"}


def suite_name(suite: str, dtype: str) -> str:
    """The results' suite of `suite` run in `dtype` ("attention", "attention-fp16")."""
    return suite + HALF_SUFFIX.get(dtype, "")


@dataclass
class Result:
    """Milliseconds per implementation of one workload, and what the model said about it.

    `ms["chainfuse"]` is always there; `baselines` names the keys of `ms` the headline speedup
    is taken against (the fastest of them, e.g. the faster of PyTorch channels-last and NCHW).
    """

    suite: str  # "gemm-chain", "attention", "conv-chain"
    workload: str  # a paper workload name (bench.workloads) or a suite's own case name
    variant: str  # what varies within a workload: "none", "relu", "softmax", "causal", ...
    threads: int
    gflop: float  # useful work of one call (no recompute), 1e9 FLOPs
    ms: dict[str, float]
    baselines: tuple[str, ...]
    spread: dict[str, float] = field(default_factory=dict)  # relative IQR per implementation
    best_ms: dict[str, float] = field(default_factory=dict)  # fastest call per implementation
    dtype: str = "float32"
    tiles: str = ""  # the code-level tiles as people read them, e.g. "T_M=96 T_L=48 ..."
    predicted_ms: float = math.nan  # the plan's predicted time
    predicted_bytes: dict[str, int] = field(default_factory=dict)  # level -> bytes read from it
    simulated_bytes: dict[str, int] = field(default_factory=dict)  # the simulator's, if run
    planning_ms: float = math.nan
    compile_s: float = math.nan  # build (or cache load) time of the kernel

    def best_baseline(self) -> str:
        """The fastest baseline present in `ms`."""
        present = [b for b in self.baselines if b in self.ms]
        if not present:
            raise ValueError(f"{self.workload}: none of the baselines {self.baselines} was timed")
        return min(present, key=lambda b: self.ms[b])

    def speedup(self, baseline: str | None = None) -> float:
        """Baseline time / chainfuse time (> 1: chainfuse is faster); the best baseline if None."""
        return self.ms[baseline or self.best_baseline()] / self.ms["chainfuse"]

    def gflops(self, impl: str = "chainfuse") -> float:
        return self.gflop / (self.ms[impl] / 1e3)

    def best_gflops(self, impl: str = "chainfuse") -> float:
        """GFLOP/s of the fastest call (NaN when not recorded): next to the median's figure,
        how much of the gap to the peak is the shared machine rather than the code."""
        return self.gflop / (self.best_ms.get(impl, math.nan) / 1e3)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["baselines"] = list(self.baselines)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        return cls(**{**d, "baselines": tuple(d["baselines"])})


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan
