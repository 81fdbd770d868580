"""How fast each micro-kernel runs for what a plan makes it do: a few measured points per kernel.

`calibration.json` beside this module holds, per micro-kernel name, what
``python -m chainfuse.bench.microkernel --calibrate`` measured (docs/tuning.md#calibration):

- ``reduction``: (k steps per call, speed as a share of the kernel's best over the points):
  short calls pay the call's prologue and the C block's load and store over fewer steps;
- ``pack_flops``: packing one element of an operand into a panel takes as long as this many of
  the kernel's flops at its best speed;
- ``split_head`` (kernels with wide blocks, `MicroKernel.wide`; else 1): an attention's second
  GEMM whose value head the code tiles in parts (T_N below the head) leaves the wide block,
  which holds the whole head in registers and writes the output's rows, for the Eᵀ path (an
  accumulator tile and a transposing store): its speed there as a share of the wide block's,
  for a head one wide block holds (``wide_cols``: 64, 80, 96 dims);
- ``split_multiple``: the same for a head of several ``nr`` blocks (128, 256 dims), which the
  wide block runs ``nr`` columns at a time, each pass over the scores again; above 1 where the
  Eᵀ path is the faster one (the code then splits such heads: `codegen.schedule`);
- ``measured_on``: the host class and date.

A kernel without an entry of its own uses the ``"default"`` one (measured on the kernel named
there). The model reads the table through `calibration`; between the points it interpolates
linearly in log2(steps), beyond them it holds the nearest point.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PATH", "Calibration", "calibration", "several_blocks", "table"]

PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Calibration:
    """One micro-kernel's measured efficiency terms (module docstring)."""

    kernel: str
    measured_on: str
    reduction: tuple[tuple[int, float], ...]  # (steps per call, share of the best), ascending
    pack_flops: float
    split_head: float = 1.0
    split_multiple: float = 1.0

    def __post_init__(self) -> None:
        steps = [s for s, _ in self.reduction]
        if not steps or steps != sorted(set(steps)) or steps[0] < 1:
            raise ValueError(f"calibration {self.kernel}: reduction steps must ascend from 1")
        if not all(0 < share <= 1 for _, share in self.reduction):
            raise ValueError(f"calibration {self.kernel}: shares must lie in (0, 1]")
        if not math.isfinite(self.pack_flops) or self.pack_flops < 0:
            raise ValueError(f"calibration {self.kernel}: pack_flops must be >= 0")
        for name in ("split_head", "split_multiple"):
            if not 0 < getattr(self, name) <= 4:
                raise ValueError(f"calibration {self.kernel}: {name} must lie in (0, 4]")

    def speed(self, steps: int) -> float:
        """The kernel's speed at `steps` k steps a call, as a share of its best."""
        points = self.reduction
        if steps <= points[0][0]:
            return points[0][1]
        for (s0, v0), (s1, v1) in itertools.pairwise(points):
            if steps <= s1:
                w = (math.log2(steps) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return v0 + w * (v1 - v0)
        return points[-1][1]

    def split(self, head: int, nr: int) -> float:
        """`split_head` or `split_multiple` for a value head of `head` dims (blocks of `nr`)."""
        return self.split_multiple if several_blocks(head, nr) else self.split_head

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "measured_on": self.measured_on,
            "reduction": [list(p) for p in self.reduction],
            "pack_flops": self.pack_flops,
        }
        if self.split_head != 1.0 or self.split_multiple != 1.0:
            out["split_head"] = self.split_head
            out["split_multiple"] = self.split_multiple
        return out


def several_blocks(head: int, nr: int) -> bool:
    """Whether a wide block runs a value head of `head` dims `nr` columns at a time (twice or
    more), not in one pass."""
    return head > nr and head % nr == 0


def _parse(name: str, entry: dict[str, object]) -> Calibration:
    reduction = entry["reduction"]
    assert isinstance(reduction, list)
    return Calibration(
        kernel=name,
        measured_on=str(entry["measured_on"]),
        reduction=tuple((int(s), float(v)) for s, v in reduction),
        pack_flops=float(entry["pack_flops"]),  # type: ignore[arg-type]
        split_head=float(entry.get("split_head", 1.0)),  # type: ignore[arg-type]
        split_multiple=float(entry.get("split_multiple", 1.0)),  # type: ignore[arg-type]
    )


@functools.cache
def table(path: Path = PATH) -> dict[str, Calibration]:
    """Every entry of the calibration file, by kernel name (``"default"`` included)."""
    data = json.loads(path.read_text())
    default = data["default"]
    out = {name: _parse(name, entry) for name, entry in data["kernels"].items()}
    out["default"] = _parse(str(default["kernel"]), out[str(default["kernel"])].to_dict())
    return out


def calibration(kernel: str) -> Calibration:
    """The measured terms of the micro-kernel named `kernel`, or the default entry's."""
    entries = table()
    return entries.get(kernel, entries["default"])
