"""What the planner knows about a machine: memory levels, cores, vector ISA and peak FLOP/s.

The data-movement model needs, per memory level, how much fits (capacity) and how fast one core
can read it (bandwidth); the compute bound needs peak FLOP/s per core per dtype; micro-kernel
selection needs the ISA flags and the vector register file. `Hardware` holds exactly that as a
frozen, hashable value that round-trips through JSON, so a plan can name the machine it was made
for. Capabilities are fields, never `if name == "..."`.

Where the numbers come from:

- `Hardware.detect()` reads this host (Linux: /proc and /sys; elsewhere documented defaults). It
  measures nothing: bandwidths are per-cycle defaults (`DEFAULT_BYTES_PER_CYCLE`,
  `DEFAULT_DRAM_BANDWIDTH`, `DEFAULT_DRAM_TOTAL_BANDWIDTH`) until a probe replaces them.
- `Hardware.preset(name)` loads `chainfuse/presets/<name>.toml`, data files that cite their sources.

A machine as the model sees it (`print(Hardware.preset("xeon-gold-6240"))`)::

    hardware xeon-gold-6240 (cpu): 18 cores at 2.60 GHz
    isa avx2 avx512f fma; vectors 64 B x 32 registers
    level  capacity   per-core BW  total BW    shared
    L1     32 KiB     345.8 GB/s   -           no
    L2     1 MiB      135.2 GB/s   -           no
    L3     24.75 MiB  39.0 GB/s    702.0 GB/s  yes
    DRAM   192 GiB    12.0 GB/s    140.8 GB/s  yes
    peak per core  float32 166.4 GFLOP/s, float64 83.2 GFLOP/s
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import json
import math
import os
import platform
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

from chainfuse.ir import DType

__all__ = [
    "AMX_TILES",
    "AMX_TILE_BYTES",
    "DEFAULT_BYTES_PER_CYCLE",
    "DEFAULT_CACHES",
    "DEFAULT_CLOCK_HZ",
    "DEFAULT_DRAM_BANDWIDTH",
    "DEFAULT_DRAM_BYTES",
    "DEFAULT_DRAM_TOTAL_BANDWIDTH",
    "DeviceKind",
    "Hardware",
    "Isa",
    "MemoryLevel",
    "presets",
    "resolve",
]


class DeviceKind(enum.Enum):
    """The kind of chip: decides which backend can run a plan (NPU plans are never run here)."""

    CPU = "cpu"
    GPU = "gpu"
    NPU = "npu"


class Isa(enum.Enum):
    """Instruction-set features that micro-kernels are written for (values are /proc flags)."""

    AVX2 = "avx2"
    FMA = "fma"
    AVX512F = "avx512f"
    AVX512_BF16 = "avx512_bf16"
    AMX_TILE = "amx_tile"
    AMX_BF16 = "amx_bf16"
    NEON = "neon"


# -- defaults for detect() ------------------------------------------------------------------------
# Bytes per cycle one core reads from each cache level (L1 two 32-byte loads, L2 half a line, L3
# ~10): conservative for recent server cores; nothing is measured at detect time, a deeper level
# uses L3's figure.
DEFAULT_BYTES_PER_CYCLE = MappingProxyType({1: 64.0, 2: 32.0, 3: 10.0})
# One core streaming from DRAM, and all cores together: typical of a one- or two-channel slice of
# a server or a desktop (one core cannot saturate a multi-channel controller).
DEFAULT_DRAM_BANDWIDTH = 12e9
DEFAULT_DRAM_TOTAL_BANDWIDTH = 20e9
# Where /sys does not say: (level, capacity in bytes, shared by all cores).
DEFAULT_CACHES: tuple[tuple[int, int, bool], ...] = (
    (1, 32 * 1024, False),
    (2, 1024 * 1024, False),
    (3, 8 * 1024 * 1024, True),
)
DEFAULT_CLOCK_HZ = 2.0e9
DEFAULT_DRAM_BYTES = 8 * 1024**3

# Peak-FLOP assumptions for detect(): two FMA pipes per core (2 flops a lane a cycle); AMX-BF16
# 1024 flops a cycle a core (16x32 by 32x16 tiles, Intel's figure). VDPBF16PS is no faster than
# fp32 FMA (measured on an AMX Xeon: half its rate), so AVX512-BF16 alone adds no bf16 peak.
FMA_UNITS = 2
AMX_BF16_FLOPS_PER_CYCLE = 1024.0

# AMX's tile registers (palette 1): 8 tiles of 16 rows x 64 bytes, the innermost storage of a
# bf16 chain on AMX. The AMX micro-kernel's 32 x 32 block (4 fp32 accumulator tiles, 2 of A,
# 2 of B) fills all of them, so its shape is the tile level's block (docs/design.md).
AMX_TILES = 8
AMX_TILE_BYTES = 1024

# Cores whose FP pipes are narrower than their widest vector ISA run each wide instruction in
# halves: (vendor_id, family, first model, last model) -> pipe bytes (Zen/Zen+ and Dhyana: AVX2
# as two 128-bit halves; Zen 4: AVX-512 as two 256-bit halves).
FP_PIPE_BYTES: tuple[tuple[str, int, int, int, int], ...] = (
    ("AuthenticAMD", 0x17, 0x00, 0x2F, 16),
    ("HygonGenuine", 0x18, 0x00, 0xFF, 16),
    ("AuthenticAMD", 0x19, 0x10, 0x1F, 32),
    ("AuthenticAMD", 0x19, 0x60, 0x7F, 32),
    ("AuthenticAMD", 0x19, 0xA0, 0xAF, 32),
)

# Where detect() reads; module constants so tests can point them at a fake tree.
PROC_CPUINFO = Path("/proc/cpuinfo")
PROC_MEMINFO = Path("/proc/meminfo")
SYS_CPU = Path("/sys/devices/system/cpu")


# -- validation -----------------------------------------------------------------------------------


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _positive_float(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a positive number, got {value!r}")
    result = float(value)
    if not math.isfinite(result) or result <= 0:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return result


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(iB|B)?\s*$", re.IGNORECASE)


def _parse_size(value: object, what: str) -> int:
    """Bytes from an int or from text: `32K`, `164 KiB`, `24.75 MiB` (binary), `141 GB` (decimal).

    A bare letter is binary because that is what /sys and /proc write (`32K`, `32768K`); `KB`,
    `MB`, `GB` are decimal because that is how vendors print memory sizes.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return _positive_int(value, what)
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{what} must be bytes or a size like '32 KiB', got {value!r}")
    number, prefix, unit = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    base = 1000 if unit is not None and unit.upper() == "B" and prefix else 1024
    size = float(number) * base**power
    if size != int(size):
        raise ValueError(f"{what}: {value!r} is not a whole number of bytes")
    return _positive_int(int(size), what)


# -- the values -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryLevel:
    """One level of the memory hierarchy as the data-movement model sees it.

    `capacity` is what one core may fill: its own cache if the level is private, the whole level
    if `shared`. `bandwidth` is what ONE core can read from the level; for shared levels
    `total_bandwidth` caps all cores together (one core rarely saturates DRAM, all of them do).
    """

    name: str
    capacity: int
    bandwidth: float
    shared: bool
    total_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"memory level name must be a non-empty string, got {self.name!r}")
        _positive_int(self.capacity, f"level {self.name!r} capacity")
        object.__setattr__(
            self, "bandwidth", _positive_float(self.bandwidth, f"level {self.name!r} bandwidth")
        )
        if not isinstance(self.shared, bool):
            raise TypeError(f"level {self.name!r} shared must be a bool, got {self.shared!r}")
        if self.total_bandwidth is not None:
            if not self.shared:
                raise ValueError(
                    f"level {self.name!r}: total_bandwidth is only for shared levels "
                    "(a private level's total is bandwidth x cores)"
                )
            total = _positive_float(self.total_bandwidth, f"level {self.name!r} total_bandwidth")
            object.__setattr__(self, "total_bandwidth", total)

    def aggregate_bandwidth(self, cores: int) -> float:
        """Bytes/s that `cores` cores read together: each at `bandwidth`, capped by the total."""
        together = self.bandwidth * _positive_int(cores, "cores")
        return together if self.total_bandwidth is None else min(together, self.total_bandwidth)


@dataclass(frozen=True)
class Hardware:
    """A machine for planning: cores, memory levels (innermost first), ISA and peaks per core.

    Registers are not a level: the micro-kernel owns them (`vector_registers`, `vector_bytes`).
    The last level (DRAM/HBM) is shared, and so is every level outside a shared one.
    """

    name: str
    kind: DeviceKind
    cores: int
    levels: tuple[MemoryLevel, ...]
    isa: frozenset[Isa]
    vector_bytes: int
    vector_registers: int
    peak_flops: tuple[tuple[DType, float], ...]
    clock_hz: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"hardware name must be a non-empty string, got {self.name!r}")
        what = f"hardware {self.name!r}"
        if not isinstance(self.kind, DeviceKind):
            raise TypeError(f"{what}: kind must be a DeviceKind, got {self.kind!r}")
        _positive_int(self.cores, f"{what} cores")
        levels = tuple(self.levels)
        if not levels or not all(isinstance(lv, MemoryLevel) for lv in levels):
            raise ValueError(f"{what}: levels must be a non-empty sequence of MemoryLevel")
        names = [lv.name for lv in levels]
        if len(set(names)) != len(names):
            raise ValueError(f"{what}: duplicate memory level names in {names}")
        if not levels[-1].shared:
            raise ValueError(f"{what}: the outermost level {names[-1]!r} must be shared")
        for inner, outer in itertools.pairwise(levels):
            if inner.shared and not outer.shared:
                raise ValueError(
                    f"{what}: level {outer.name!r} is private but lies outside shared {inner.name!r}"
                )
        isa = frozenset(self.isa)
        if not all(isinstance(flag, Isa) for flag in isa):
            raise ValueError(f"{what}: isa must hold Isa members, got {sorted(map(str, isa))}")
        _count(self.vector_bytes, f"{what} vector_bytes")
        _count(self.vector_registers, f"{what} vector_registers")
        peaks: dict[DType, float] = {}
        for dtype, flops in self.peak_flops:
            if not isinstance(dtype, DType):
                raise TypeError(f"{what}: peak_flops keys must be DType, got {dtype!r}")
            if dtype in peaks:
                raise ValueError(f"{what}: peak_flops lists {dtype.value} twice")
            peaks[dtype] = _positive_float(flops, f"{what} peak {dtype.value}")
        # Canonical order, so equal machines compare and hash equal however they were written.
        ordered = tuple(sorted(peaks.items(), key=lambda item: item[0].value))
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "isa", isa)
        object.__setattr__(self, "peak_flops", ordered)
        object.__setattr__(self, "clock_hz", _positive_float(self.clock_hz, f"{what} clock_hz"))

    # -- lookup -----------------------------------------------------------------------------------
    def peak(self, dtype: DType | str) -> float:
        """Per-core FLOP/s for `dtype`; a dtype without its own unit runs at the float32 rate."""
        wanted = DType.parse(dtype)
        peaks = dict(self.peak_flops)
        found = peaks.get(wanted, peaks.get(DType.FLOAT32))
        if found is None:
            known = ", ".join(d.value for d in peaks) or "none"
            raise ValueError(
                f"hardware {self.name!r} has no peak for {wanted.value} and no float32 peak to "
                f"fall back on (known: {known})"
            )
        return found

    def instruction_flops(self, dtype: DType | str) -> float:
        """Flops of one arithmetic instruction of the widest vector ISA for `dtype`: the float32
        lanes of a vector (times 2 with FMA), scaled by the dtype's peak over float32's. What a
        micro-kernel's instructions are compared with: a core whose pipes split wide vectors
        (`FP_PIPE_BYTES`) has a lower peak but the same instructions."""
        lanes = max(1, self.vector_bytes // 4)
        return lanes * _fused(self.isa) * self.peak(dtype) / self.peak(DType.FLOAT32)

    @property
    def amx(self) -> bool:
        """Whether the machine has AMX-TILE and AMX-BF16 (whether this process may use them is
        `kernels.amx.amx_status`'s question)."""
        return {Isa.AMX_TILE, Isa.AMX_BF16} <= self.isa

    @property
    def tile_capacity(self) -> int:
        """Bytes of the matrix engine's tile registers (`AMX_TILES` x `AMX_TILE_BYTES`), 0 where
        there is none."""
        return AMX_TILES * AMX_TILE_BYTES if self.amx else 0

    def matrix_engine(self, dtype: DType | str) -> bool:
        """Whether chainfuse's kernels compute `dtype` on a matrix engine here: bf16 on AMX."""
        return DType.parse(dtype) is DType.BFLOAT16 and self.amx

    def for_chain(self, dtype: DType | str) -> Hardware:
        """The machine as chainfuse's kernels for a chain of `dtype` see it. A CPU computes a
        16-bit chain on its matrix engine where `matrix_engine` says so (its peak is the
        engine's), else widened to fp32 on the FMA units (`fp32_units`: its peak is float32's,
        whatever 16-bit rate the machine's own libraries reach). GPUs and fp32 chains: as is."""
        wanted = DType.parse(dtype)
        half = wanted in (DType.BFLOAT16, DType.FLOAT16)
        if self.kind is not DeviceKind.CPU or not half or self.matrix_engine(wanted):
            return self
        return self.fp32_units()

    def fp32_units(self) -> Hardware:
        """This machine with its 16-bit units taken away: no AMX flags, no 16-bit peaks (they
        fall back to float32's). What a kernel that widens 16-bit operands to fp32 runs on."""
        half = (DType.BFLOAT16, DType.FLOAT16)
        isa = self.isa - {Isa.AMX_TILE, Isa.AMX_BF16}
        peaks = tuple((d, f) for d, f in self.peak_flops if d not in half)
        if isa == self.isa and peaks == self.peak_flops:
            return self
        return dataclasses.replace(self, isa=isa, peak_flops=peaks)

    def level(self, name: str) -> MemoryLevel:
        for lv in self.levels:
            if lv.name == name:
                return lv
        known = ", ".join(lv.name for lv in self.levels)
        raise ValueError(f"hardware {self.name!r} has no memory level {name!r}; known: {known}")

    # -- variations -------------------------------------------------------------------------------
    def scaled(self, level_name: str, capacity: int) -> Hardware:
        """A copy with one level's capacity changed: the "larger cache never hurts" property."""
        old = self.level(level_name)
        new = dataclasses.replace(old, capacity=_positive_int(capacity, f"{level_name} capacity"))
        return self.with_levels(tuple(new if lv is old else lv for lv in self.levels))

    def with_levels(self, levels: tuple[MemoryLevel, ...]) -> Hardware:
        return dataclasses.replace(self, levels=tuple(levels))

    # -- JSON -------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_to_data(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        data = json.loads(text)
        if not isinstance(data, dict):
            raise TypeError("hardware JSON must be an object")
        return _from_data(data, "hardware JSON")

    @classmethod
    def from_toml(cls, text: str, name: str | None = None) -> Hardware:
        """A machine from a preset file's text. `name`, when given, must match the file's name.

        The file holds the JSON fields plus `source` (required: where the numbers come from);
        capacities may be sizes like `"164 KiB"`; peaks are per core in `[peak_flops]`, or per chip
        in `[peak_flops_total]` (divided by `cores` here) as GPU vendors publish them.
        """
        data = tomllib.loads(text)
        what = f"preset {name or data.get('name')!r}"
        source = data.pop("source", None)
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{what}: a preset must say where its numbers come from (`source`)")
        if name is not None and data.get("name") != name:
            raise ValueError(f"{what}: file says name = {data.get('name')!r}")
        if "peak_flops_total" in data:
            if "peak_flops" in data:
                raise ValueError(f"{what}: give peak_flops or peak_flops_total, not both")
            cores = _positive_int(data.get("cores"), f"{what} cores")
            totals = data.pop("peak_flops_total")
            if not isinstance(totals, dict):
                raise ValueError(f"{what}: peak_flops_total must be a table")
            data["peak_flops"] = {
                k: _positive_float(v, f"{what} peak_flops_total.{k}") / cores
                for k, v in totals.items()
            }
        return _from_data(data, what)

    # -- sources ----------------------------------------------------------------------------------
    @classmethod
    def detect(cls) -> Hardware:
        """This host, read once per process (see the module docstring for what is assumed)."""
        return _detect()

    @classmethod
    def preset(cls, name: str) -> Hardware:
        return _preset(name)

    # -- text -------------------------------------------------------------------------------------
    def __str__(self) -> str:
        isa = " ".join(sorted(flag.value for flag in self.isa)) or "none"
        rows = [("level", "capacity", "per-core BW", "total BW", "shared")]
        for lv in self.levels:
            bw, shared = _rate(lv.bandwidth, "B/s"), "yes" if lv.shared else "no"
            total = "-" if lv.total_bandwidth is None else _rate(lv.total_bandwidth, "B/s")
            rows.append((lv.name, _size(lv.capacity), bw, total, shared))
        widths = [max(len(row[i]) for row in rows) + 2 for i in range(4)]
        peaks = ", ".join(f"{d.value} {_rate(f, 'FLOP/s')}" for d, f in self.peak_flops) or "none"
        clock = f"{self.clock_hz / 1e9:.2f} GHz"
        lines = [
            f"hardware {self.name} ({self.kind.value}): {self.cores} cores at {clock}",
            f"isa {isa}; vectors {self.vector_bytes} B x {self.vector_registers} registers",
        ]
        lines += [
            "".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + row[4] for row in rows
        ]
        lines.append(f"peak per core  {peaks}")
        if self.amx:
            tiles = f"{AMX_TILES} x {_size(AMX_TILE_BYTES)}"
            lines.append(
                f"AMX tiles {tiles} (innermost level of bf16 chains; block 32x32), "
                f"bf16 peak {_rate(self.peak(DType.BFLOAT16), 'FLOP/s')} per core"
            )
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{nbytes} B"


def _rate(value: float, unit: str) -> str:
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.1f} {unit}"


# -- JSON / TOML data -----------------------------------------------------------------------------

_FIELDS = {f.name for f in dataclasses.fields(Hardware)}
_LEVEL_FIELDS = {f.name for f in dataclasses.fields(MemoryLevel)}


def _to_data(hw: Hardware) -> dict[str, Any]:
    return {
        "name": hw.name,
        "kind": hw.kind.value,
        "cores": hw.cores,
        "levels": [dataclasses.asdict(lv) for lv in hw.levels],
        "isa": sorted(flag.value for flag in hw.isa),
        "vector_bytes": hw.vector_bytes,
        "vector_registers": hw.vector_registers,
        "peak_flops": {dtype.value: flops for dtype, flops in hw.peak_flops},
        "clock_hz": hw.clock_hz,
    }


_E = TypeVar("_E", bound=enum.Enum)


def _enum(cls: type[_E], value: object, what: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        known = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{what}: unknown value {value!r}; expected one of {known}") from None


def _from_data(data: dict[str, Any], what: str) -> Hardware:
    """Build from plain data (parsed JSON or TOML); unknown or missing keys are errors."""
    keys = set(data)
    if keys != _FIELDS:
        extra, missing = sorted(keys - _FIELDS), sorted(_FIELDS - keys)
        raise ValueError(f"{what}: unknown keys {extra}, missing keys {missing}")
    if not isinstance(data["levels"], list) or not isinstance(data["isa"], list):
        raise TypeError(f"{what}: levels and isa must be lists")
    levels = []
    for i, lv in enumerate(data["levels"]):
        if not isinstance(lv, dict):
            raise TypeError(f"{what}: level {i} must be a table/object")
        lv = {"total_bandwidth": None, **lv}
        if set(lv) != _LEVEL_FIELDS:
            raise ValueError(
                f"{what}: level {i} has keys {sorted(lv)}; expected {sorted(_LEVEL_FIELDS)}"
            )
        levels.append(
            MemoryLevel(
                name=lv["name"],
                capacity=_parse_size(lv["capacity"], f"{what} level {lv['name']!r} capacity"),
                bandwidth=lv["bandwidth"],
                shared=lv["shared"],
                total_bandwidth=lv["total_bandwidth"],
            )
        )
    peaks = data["peak_flops"]
    if not isinstance(peaks, dict):
        raise TypeError(f"{what}: peak_flops must map dtype names to FLOP/s")
    return Hardware(
        name=data["name"],
        kind=_enum(DeviceKind, data["kind"], f"{what} kind"),
        cores=data["cores"],
        levels=tuple(levels),
        isa=frozenset(_enum(Isa, flag, f"{what} isa") for flag in data["isa"]),
        vector_bytes=data["vector_bytes"],
        vector_registers=data["vector_registers"],
        peak_flops=tuple((DType.parse(k, f"{what} peak_flops"), v) for k, v in peaks.items()),
        clock_hz=data["clock_hz"],
    )


# -- presets --------------------------------------------------------------------------------------


def _preset_dir() -> Traversable:
    """Package data, so presets load from a wheel or a zip as well as from a checkout."""
    return resources.files("chainfuse").joinpath("presets")


def presets() -> tuple[str, ...]:
    """Names of the machines shipped as data files, sorted."""
    files = (p.name for p in _preset_dir().iterdir() if p.is_file())
    return tuple(sorted(n.removesuffix(".toml") for n in files if n.endswith(".toml")))


@functools.cache
def _preset(name: str) -> Hardware:
    known = presets()
    if name not in known:
        raise ValueError(f"unknown hardware preset {name!r}; known presets: {', '.join(known)}")
    text = _preset_dir().joinpath(f"{name}.toml").read_text(encoding="utf-8")
    return Hardware.from_toml(text, name)


def resolve(hardware: Hardware | str | None) -> Hardware:
    """The one way entry points accept a machine: None or "detect" = this host, a str = a preset."""
    if hardware is None or hardware == "detect":
        return Hardware.detect()
    if isinstance(hardware, str):
        return Hardware.preset(hardware)
    if isinstance(hardware, Hardware):
        return hardware
    raise TypeError(
        "hardware must be a Hardware, a preset name, 'detect' or None, "
        f"got {type(hardware).__name__}"
    )


# -- detect() -------------------------------------------------------------------------------------


def _read(path: str | os.PathLike[str]) -> str | None:
    """A file's text, or None: detect() must never fail because /proc or /sys is missing.

    Plain `os.read` calls: `Path.read_text` on /sys costs ten times as much, in every process
    that compiles a kernel."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except (OSError, ValueError):
        return None
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:  # a directory, or a file that fails to read
        return None
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _cpu_list(text: str) -> set[int]:
    """CPU ids from a kernel cpu list such as `0-3,8,10-11`."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit():
            end = int(hi) if hi.strip().isdigit() else int(lo)
            cpus.update(range(int(lo), end + 1))
    return cpus


def _cpuinfo_field(text: str, key: str) -> str | None:
    """The first `key : value` of /proc/cpuinfo (the boot CPU's; all CPUs are alike here)."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def _detect_isa(cpuinfo: str) -> frozenset[Isa]:
    words = set((_cpuinfo_field(cpuinfo, "flags") or "").split())
    words |= set((_cpuinfo_field(cpuinfo, "Features") or "").split())  # Arm spells it this way
    found = {flag for flag in Isa if flag.value in words}
    # ASIMD is mandatory on AArch64, so it is there even where no cpuinfo says so (macOS).
    if "asimd" in words or platform.machine().lower() in ("arm64", "aarch64"):
        found.add(Isa.NEON)
    return frozenset(found)


def _detect_clock(cpuinfo: str) -> float:
    """The core's top frequency. cpufreq's max comes first: `cpu MHz` is a snapshot that reads
    low on an idle core with frequency scaling; VMs without cpufreq show the nominal clock there."""
    khz = _read(SYS_CPU / "cpu0" / "cpufreq" / "cpuinfo_max_freq")
    candidates = [
        (khz or "").strip(),
        _cpuinfo_field(cpuinfo, "cpu MHz") or "",
    ]
    for scale, text in zip((1e3, 1e6), candidates, strict=True):
        try:
            hz = float(text) * scale
        except ValueError:
            continue
        if math.isfinite(hz) and hz > 0:
            return hz
    return DEFAULT_CLOCK_HZ


def _detect_caches() -> list[tuple[int, int, bool]]:
    """(level, capacity, shared) of cpu0's data/unified caches, innermost first.

    Shared means used by more CPUs than cpu0's SMT siblings: a core's L2 that its hyperthread
    also uses is still that core's cache.
    """
    siblings = _cpu_list(_read(SYS_CPU / "cpu0" / "topology" / "thread_siblings_list") or "0")
    found: dict[int, tuple[int, bool]] = {}
    folder = os.path.join(SYS_CPU, "cpu0", "cache")
    try:  # (os.listdir and joined strings: Path.glob costs far more, per process)
        names = sorted(n for n in os.listdir(folder) if n.startswith("index"))
    except OSError:
        names = []
    for name in names:
        index = os.path.join(folder, name)
        level, kind, size = (_read(os.path.join(index, f)) for f in ("level", "type", "size"))
        if level is None or kind is None or size is None:
            continue
        if kind.strip() not in ("Data", "Unified") or not level.strip().isdigit():
            continue
        try:
            capacity = _parse_size(size.strip(), index)
        except ValueError:
            continue
        users = _cpu_list(_read(os.path.join(index, "shared_cpu_list")) or "0")
        found.setdefault(int(level), (capacity, len(users - siblings) > 0))
    return [(lv, cap, shared) for lv, (cap, shared) in sorted(found.items())]


def _detect_dram() -> int:
    text = _read(PROC_MEMINFO) or ""
    value = _cpuinfo_field(text, "MemTotal")  # same `key: value` layout as cpuinfo
    if value is not None and value.endswith("kB") and value[:-2].strip().isdigit():
        return int(value[:-2]) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return DEFAULT_DRAM_BYTES


def _detect_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _vector_shape(isa: frozenset[Isa]) -> tuple[int, int]:
    """(vector_bytes, vector_registers) of the widest vector ISA."""
    if Isa.AVX512F in isa:
        return 64, 32
    if Isa.AVX2 in isa:
        return 32, 16
    if Isa.NEON in isa:
        return 16, 32
    return 0, 0


def _fp_pipe_bytes(cpuinfo: str, vector_bytes: int) -> int:
    """How many bytes of a vector one FP pipe computes per cycle: `vector_bytes`, unless the core
    is listed in `FP_PIPE_BYTES` as splitting its widest vectors."""
    vendor = _cpuinfo_field(cpuinfo, "vendor_id") or ""
    try:
        family = int(_cpuinfo_field(cpuinfo, "cpu family") or "")
        model = int(_cpuinfo_field(cpuinfo, "model") or "")
    except ValueError:
        return vector_bytes
    for who, fam, first, last, width in FP_PIPE_BYTES:
        if vendor == who and family == fam and first <= model <= last:
            return min(vector_bytes, width)
    return vector_bytes


def _fused(isa: frozenset[Isa]) -> int:
    """Flops per lane of one arithmetic instruction: 2 with fused multiply-add, else 1."""
    return 2 if isa & {Isa.FMA, Isa.AVX512F, Isa.NEON} else 1


def _peaks(
    isa: frozenset[Isa], vector_bytes: int, clock_hz: float, pipe_bytes: int | None = None
) -> tuple[tuple[DType, float], ...]:
    """Per-core peaks from the assumptions next to `FMA_UNITS` (each pipe `pipe_bytes` wide,
    by default the whole vector); scalar code does 2 flops/cycle."""
    fused = _fused(isa)
    lanes32 = (vector_bytes if pipe_bytes is None else pipe_bytes) // 4
    fp32 = clock_hz * FMA_UNITS * fused * lanes32 if lanes32 else clock_hz * 2.0
    peaks = {DType.FLOAT32: fp32, DType.FLOAT64: fp32 / 2 if lanes32 else fp32}
    if Isa.AMX_BF16 in isa and Isa.AMX_TILE in isa:
        peaks[DType.BFLOAT16] = clock_hz * AMX_BF16_FLOPS_PER_CYCLE
    return tuple(peaks.items())


def _detect_host() -> Hardware:
    """Read this host now (uncached). Each fact falls back to its documented default on its own."""
    cpuinfo = _read(PROC_CPUINFO) or ""
    isa = _detect_isa(cpuinfo)
    clock = _detect_clock(cpuinfo)
    cores = _detect_cores()
    caches = _detect_caches() or list(DEFAULT_CACHES)
    levels: list[MemoryLevel] = []
    for number, capacity, shared in caches:
        # Keep the model's invariants: capacities grow outwards and nothing private lies outside
        # something shared. A cache no larger than the one inside it adds no room to plan for.
        if levels and capacity <= levels[-1].capacity:
            continue
        shared = shared or (bool(levels) and levels[-1].shared)
        per_core = DEFAULT_BYTES_PER_CYCLE.get(number, DEFAULT_BYTES_PER_CYCLE[3]) * clock
        total = per_core * cores if shared else None
        levels.append(MemoryLevel(f"L{number}", capacity, per_core, shared, total))
    dram = _detect_dram()
    if levels and dram <= levels[-1].capacity:
        dram = max(DEFAULT_DRAM_BYTES, 2 * levels[-1].capacity)
    levels.append(
        MemoryLevel("DRAM", dram, DEFAULT_DRAM_BANDWIDTH, True, DEFAULT_DRAM_TOTAL_BANDWIDTH)
    )
    vector_bytes, vector_registers = _vector_shape(isa)
    model = _cpuinfo_field(cpuinfo, "model name") or platform.processor() or platform.machine()
    return Hardware(
        name=f"host: {model or 'unknown cpu'}",
        kind=DeviceKind.CPU,
        cores=cores,
        levels=tuple(levels),
        isa=isa,
        vector_bytes=vector_bytes,
        vector_registers=vector_registers,
        peak_flops=_peaks(isa, vector_bytes, clock, _fp_pipe_bytes(cpuinfo, vector_bytes)),
        clock_hz=clock,
    )


_detect = functools.cache(_detect_host)
