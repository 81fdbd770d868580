"""What a GPU adds to the planner's machine: the figures a Triton program's shape depends on.

`Hardware` already holds a GPU's SM count (`cores`), its levels (shared memory per SM, L2, HBM,
with their bandwidths) and its peaks per dtype (the tensor cores' for fp16/bf16, the CUDA cores'
for fp32). A program's block sizes, warps and pipeline stages also depend on what one program may
take of an SM (registers, threads, opt-in shared memory) and on the tensor cores' peak per input
format (tf32 and fp8 too, which are not chain dtypes). `GpuSpec` holds exactly those, as
`Hardware.gpu`; presets give them in a `[gpu]` table and cite their sources.

`Hardware.detect("cuda")` describes a CUDA device from `torch.cuda.get_device_properties` (here:
`gpu_properties`): the SM count, memory, L2, shared memory and registers are read; clock-dependent
peaks and bandwidths are not reported by the driver, so they come from the preset of the same
architecture (`architecture_preset`), scaled by the SM count. torch is imported only there, never by planning for a preset.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

__all__ = ["GpuSpec", "TensorFormat", "architecture_preset", "detected_figures", "gpu_properties"]


class TensorFormat(enum.Enum):
    """Input formats of the tensor cores (dense rates; accumulation in fp32)."""

    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    TF32 = "tf32"
    FLOAT8 = "float8"


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _rate(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a positive number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class GpuSpec:
    """Per-SM limits a program (a CTA) lives within, and the tensor cores' peaks (whole chip).

    `smem_per_program` is the opt-in maximum one program may allocate (less than the SM's
    shared memory, part of which the driver reserves); `registers_per_sm` counts 32-bit
    registers; `tensor_flops` is dense FLOP/s of the whole chip per input format.
    """

    compute_capability: tuple[int, int]
    registers_per_sm: int
    registers_per_thread: int
    threads_per_sm: int
    smem_per_program: int
    tensor_flops: tuple[tuple[TensorFormat, float], ...]
    warp_size: int = 32

    def __post_init__(self) -> None:
        cc = tuple(self.compute_capability)
        if len(cc) != 2 or not all(isinstance(c, int) and c >= 0 for c in cc):
            raise ValueError(f"gpu compute_capability must be (major, minor), got {cc!r}")
        object.__setattr__(self, "compute_capability", cc)
        for name in ("registers_per_sm", "registers_per_thread", "threads_per_sm",
                     "smem_per_program", "warp_size"):  # fmt: skip
            _whole(getattr(self, name), f"gpu {name}")
        peaks: dict[TensorFormat, float] = {}
        for fmt, flops in self.tensor_flops:
            if not isinstance(fmt, TensorFormat):
                raise TypeError(f"gpu tensor_flops keys must be TensorFormat, got {fmt!r}")
            if fmt in peaks:
                raise ValueError(f"gpu tensor_flops lists {fmt.value} twice")
            peaks[fmt] = _rate(flops, f"gpu tensor_flops.{fmt.value}")
        ordered = tuple(sorted(peaks.items(), key=lambda item: item[0].value))
        object.__setattr__(self, "tensor_flops", ordered)

    def tensor_peak(self, fmt: TensorFormat | str) -> float | None:
        """Dense whole-chip FLOP/s of the tensor cores for `fmt`; None where the part has none."""
        wanted = fmt if isinstance(fmt, TensorFormat) else TensorFormat(fmt)
        return dict(self.tensor_flops).get(wanted)

    def to_data(self) -> dict[str, Any]:
        return {
            "compute_capability": list(self.compute_capability),
            "registers_per_sm": self.registers_per_sm,
            "registers_per_thread": self.registers_per_thread,
            "threads_per_sm": self.threads_per_sm,
            "smem_per_program": self.smem_per_program,
            "tensor_flops": {fmt.value: flops for fmt, flops in self.tensor_flops},
            "warp_size": self.warp_size,
        }

    @classmethod
    def from_data(cls, data: object, what: str, size: Any) -> GpuSpec:
        """From a `[gpu]` table or its JSON; `size` parses `"227 KiB"` (hardware's parser)."""
        if not isinstance(data, dict):
            raise TypeError(f"{what}: gpu must be a table/object")
        fields = {"compute_capability", "registers_per_sm", "registers_per_thread",
                  "threads_per_sm", "smem_per_program", "tensor_flops", "warp_size"}  # fmt: skip
        keys = set(data)
        if not keys <= fields or not (fields - {"warp_size"}) <= keys:
            raise ValueError(
                f"{what}: gpu has keys {sorted(keys)}; expected {sorted(fields)} (warp_size "
                "optional)"
            )
        flops = data["tensor_flops"]
        if not isinstance(flops, dict):
            raise TypeError(f"{what}: gpu.tensor_flops must map formats to FLOP/s")
        formats = []
        for name, value in flops.items():
            try:
                formats.append((TensorFormat(name), value))
            except ValueError:
                known = ", ".join(f.value for f in TensorFormat)
                raise ValueError(
                    f"{what}: gpu.tensor_flops: unknown format {name!r}; expected {known}"
                ) from None
        return cls(
            compute_capability=tuple(data["compute_capability"]),
            registers_per_sm=data["registers_per_sm"],
            registers_per_thread=data["registers_per_thread"],
            threads_per_sm=data["threads_per_sm"],
            smem_per_program=size(data["smem_per_program"], f"{what} gpu.smem_per_program"),
            tensor_flops=tuple(formats),
            warp_size=data.get("warp_size", 32),
        )

    def __str__(self) -> str:
        peaks = ", ".join(f"{f.value} {v / 1e12:.1f}" for f, v in self.tensor_flops) or "none"
        major, minor = self.compute_capability
        return (
            f"gpu sm_{major}{minor}: {self.registers_per_sm} registers, {self.threads_per_sm} "
            f"threads, {self.smem_per_program // 1024} KiB shared memory per program; "
            f"tensor cores (TFLOP/s, dense) {peaks}"
        )


# compute capability -> the preset whose clocks, bandwidths and peaks per SM a detected part of
# that architecture is assumed to have (the driver reports none of them): the data-centre part
# of its generation; a part of another generation takes the nearest older one's (Ampere's for
# anything before Hopper, Hopper's after it), an approximation its name says
ARCHITECTURES = {(8, 0): "a100", (9, 0): "h100"}


def architecture_preset(compute_capability: tuple[int, int], total_memory: int) -> tuple[str, bool]:
    """(preset, exact): the preset a detected GPU is scaled from, and whether it is of that very
    architecture; an H100 with more than 100 GB of memory is an H200."""
    cc = (compute_capability[0], compute_capability[1])
    name = ARCHITECTURES.get(cc)
    exact = name is not None
    if name is None:
        name = "h100" if cc >= (9, 0) else "a100"
    if name == "h100" and total_memory > 100 * 1000**3:
        name = "h200"
    return name, exact


def gpu_properties(index: int = 0) -> dict[str, Any] | None:
    """What the driver reports of CUDA device `index`, or None without torch or a CUDA device.

    torch is imported here only when it is installed; a process that never asks for a GPU never
    imports it."""
    try:
        import torch
    except ImportError:
        return None
    try:
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return None
        p = torch.cuda.get_device_properties(index)
    except (RuntimeError, AssertionError):
        return None
    return {
        "name": str(p.name),
        "sms": int(p.multi_processor_count),
        "total_memory": int(p.total_memory),
        "l2": int(getattr(p, "L2_cache_size", 0)),
        "compute_capability": (int(p.major), int(p.minor)),
        "smem_per_sm": int(getattr(p, "shared_memory_per_multiprocessor", 0)),
        "smem_per_program": int(getattr(p, "shared_memory_per_block_optin", 0)),
        "registers_per_sm": int(getattr(p, "regs_per_multiprocessor", 0)),
        "threads_per_sm": int(getattr(p, "max_threads_per_multi_processor", 0)),
    }


class _Sized(Protocol):
    """What `detected_figures` reads of a `hardware.MemoryLevel` (this module lies below it)."""

    @property
    def capacity(self) -> int: ...

    @property
    def total_bandwidth(self) -> float | None: ...


_Level = TypeVar("_Level", bound=_Sized)


def detected_figures(
    levels: Sequence[_Level], gpu: GpuSpec, cores: int, props: dict[str, Any]
) -> tuple[tuple[_Level, ...], GpuSpec]:
    """A preset's levels and GPU figures with what the driver reported (`gpu_properties`) in
    place: shared memory per SM, L2 and memory sizes, registers, threads, the opt-in shared
    memory; totals (bandwidths, tensor-core peaks) scaled by the SM count, so the per-SM share
    stays the preset's."""
    scale = props["sms"] / cores
    out = list(levels)
    if props["smem_per_sm"]:
        out[0] = dataclasses.replace(out[0], capacity=props["smem_per_sm"])  # type: ignore[type-var]
    for i, lv in enumerate(out[1:], 1):
        total = lv.total_bandwidth
        size = props["l2"] if i == 1 and props["l2"] else lv.capacity
        size = props["total_memory"] if i == len(out) - 1 else size
        out[i] = dataclasses.replace(  # type: ignore[type-var]
            lv, capacity=size, total_bandwidth=None if total is None else total * scale
        )
    spec = dataclasses.replace(
        gpu,
        compute_capability=props["compute_capability"],
        registers_per_sm=props["registers_per_sm"] or gpu.registers_per_sm,
        threads_per_sm=props["threads_per_sm"] or gpu.threads_per_sm,
        smem_per_program=props["smem_per_program"] or gpu.smem_per_program,
        tensor_flops=tuple((f, v * scale) for f, v in gpu.tensor_flops),
    )
    return tuple(out), spec
