"""Hardware: presets load and round-trip, detect() reads this host and never crashes, resolve()."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from chainfuse import hardware
from chainfuse.hardware import DeviceKind, Hardware, Isa, MemoryLevel, presets, resolve
from chainfuse.ir import DType

KIB, MIB, GIB = 1024, 1024**2, 1024**3
PRESETS = ("a100", "ascend-910", "h100", "h200", "xeon-8480", "xeon-gold-6240")


@pytest.fixture
def fresh_detect() -> Iterator[None]:
    """detect() is cached per process; tests that fake the host must not see or leave a copy."""
    hardware._detect.cache_clear()
    yield
    hardware._detect.cache_clear()


def _check_hierarchy(hw: Hardware) -> None:
    """The invariants the model relies on for every machine, detected or preset."""
    assert hw.cores >= 1 and hw.clock_hz > 0 and hw.peak(DType.FLOAT32) > 0
    capacities = [lv.capacity for lv in hw.levels]
    assert all(c > 0 for c in capacities)
    assert capacities == sorted(set(capacities)), "capacities grow outwards"
    assert all(lv.bandwidth > 0 for lv in hw.levels)
    assert hw.levels[-1].shared
    first_shared = next(i for i, lv in enumerate(hw.levels) if lv.shared)
    assert all(lv.shared for lv in hw.levels[first_shared:])


# -- presets --------------------------------------------------------------------------------------


def test_presets_are_listed_sorted() -> None:
    assert presets() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_round_trips(name: str) -> None:
    hw = Hardware.preset(name)
    assert hw.name == name
    _check_hierarchy(hw)
    for lv in hw.levels:  # all cores together reach a shared level's published total
        assert lv.aggregate_bandwidth(hw.cores) == (lv.total_bandwidth or lv.bandwidth * hw.cores)
    again = Hardware.from_json(hw.to_json())
    assert again == hw and hash(again) == hash(hw)
    assert again.to_json() == hw.to_json()
    text = str(hw)
    assert name in text and all(lv.name in text for lv in hw.levels)


def test_xeon_gold_6240_is_the_papers_cpu() -> None:
    hw = Hardware.preset("xeon-gold-6240")
    assert hw.kind is DeviceKind.CPU and hw.cores == 18
    assert hw.peak(DType.FLOAT32) == 2.6e9 * 2 * 2 * 16
    assert hw.peak("bf16") == hw.peak(DType.FLOAT32)  # no bf16 unit: the fp32 rate
    assert {Isa.AVX512F, Isa.FMA} <= hw.isa and Isa.AMX_BF16 not in hw.isa
    assert (hw.vector_bytes, hw.vector_registers) == (64, 32)
    assert [lv.name for lv in hw.levels] == ["L1", "L2", "L3", "DRAM"]
    assert hw.level("L3").capacity == 24.75 * MIB
    dram = hw.level("DRAM")
    assert dram.aggregate_bandwidth(1) == 12e9
    assert dram.aggregate_bandwidth(18) == pytest.approx(140.784e9)


def test_gpu_peaks_are_per_sm() -> None:
    a100 = Hardware.preset("a100")
    assert a100.kind is DeviceKind.GPU
    assert a100.peak(DType.BFLOAT16) * a100.cores == pytest.approx(312e12)
    assert a100.peak(DType.FLOAT32) * a100.cores == pytest.approx(19.5e12)
    assert a100.levels[0].name == "SMEM" and a100.levels[0].capacity == 164 * KIB


def test_h200_is_an_h100_with_more_hbm() -> None:
    h100, h200 = Hardware.preset("h100"), Hardware.preset("h200")
    assert h200.level("HBM").aggregate_bandwidth(h200.cores) == pytest.approx(4.8e12)
    assert dataclasses.replace(h200, name="h100", levels=h100.levels) == h100
    assert h200.levels[:-1] == h100.levels[:-1]


def test_npu_preset_falls_back_to_fp32_for_bf16() -> None:
    npu = Hardware.preset("ascend-910")
    assert npu.kind is DeviceKind.NPU and npu.cores == 32
    assert [lv.name for lv in npu.levels] == ["L0", "L1", "L2", "HBM"]
    assert npu.peak(DType.BFLOAT16) == npu.peak(DType.FLOAT32)
    assert npu.peak(DType.FLOAT16) * npu.cores == pytest.approx(256e12)


def test_unknown_preset_lists_known_names() -> None:
    with pytest.raises(ValueError, match="no-such-chip") as err:
        Hardware.preset("no-such-chip")
    assert all(name in str(err.value) for name in PRESETS)


def test_preset_file_must_cite_a_source_and_its_name() -> None:
    text = (Path(hardware.__file__).parent / "presets" / "a100.toml").read_text()
    without_source = re.sub(r'source = """.*?"""', "", text, flags=re.DOTALL)
    with pytest.raises(ValueError, match="source"):
        Hardware.from_toml(without_source, "a100")
    with pytest.raises(ValueError, match="name"):
        Hardware.from_toml(text, "h100")


# -- the value ------------------------------------------------------------------------------------


def _tiny(**changes: object) -> Hardware:
    base = Hardware(
        name="tiny",
        kind=DeviceKind.CPU,
        cores=2,
        levels=(
            MemoryLevel("L1", 32 * KIB, 100e9, False),
            MemoryLevel("DRAM", GIB, 10e9, True, 15e9),
        ),
        isa=frozenset({Isa.AVX2, Isa.FMA}),
        vector_bytes=32,
        vector_registers=16,
        peak_flops=((DType.FLOAT32, 64e9), (DType.BFLOAT16, 128e9)),
        clock_hz=2e9,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_peak_order_is_canonical() -> None:
    flipped = _tiny(peak_flops=((DType.BFLOAT16, 128e9), (DType.FLOAT32, 64e9)))
    assert flipped == _tiny() and hash(flipped) == hash(_tiny())


def test_peak_without_float32_is_an_error() -> None:
    hw = _tiny(peak_flops=((DType.BFLOAT16, 128e9),))
    assert hw.peak(DType.BFLOAT16) == 128e9
    with pytest.raises(ValueError, match="float32"):
        hw.peak(DType.FLOAT64)


def test_level_lookup_names_known_levels() -> None:
    with pytest.raises(ValueError, match="L1, DRAM"):
        _tiny().level("L3")


def test_scaled_changes_one_capacity_only() -> None:
    hw = _tiny()
    bigger = hw.scaled("L1", 64 * KIB)
    assert bigger.level("L1").capacity == 64 * KIB and hw.level("L1").capacity == 32 * KIB
    assert bigger.level("DRAM") == hw.level("DRAM")
    assert dataclasses.replace(bigger, levels=hw.levels) == hw
    with pytest.raises(ValueError):
        hw.scaled("L1", 0)
    with pytest.raises(ValueError, match="L9"):
        hw.scaled("L9", KIB)


def test_invalid_machines_are_rejected() -> None:
    with pytest.raises(ValueError, match="total_bandwidth"):
        MemoryLevel("L1", KIB, 1e9, False, 2e9)
    with pytest.raises(ValueError, match="outermost"):
        _tiny(levels=(MemoryLevel("L1", KIB, 1e9, False),))
    with pytest.raises(ValueError, match="twice"):
        _tiny(peak_flops=((DType.FLOAT32, 1e9), (DType.FLOAT32, 2e9)))
    with pytest.raises(ValueError, match="cores"):
        _tiny(cores=0)


def test_json_rejects_unknown_keys() -> None:
    text = _tiny().to_json().replace('"cores"', '"kores"')
    with pytest.raises(ValueError, match="kores"):
        Hardware.from_json(text)


# -- detect() -------------------------------------------------------------------------------------


def test_detect_describes_this_host(fresh_detect: None) -> None:
    hw = Hardware.detect()
    assert hw is Hardware.detect(), "cached"
    assert hw.kind is DeviceKind.CPU
    _check_hierarchy(hw)
    assert hw.levels[0].name == "L1" and hw.levels[-1].name == "DRAM"
    assert Hardware.from_json(hw.to_json()) == hw


def _point_detect_at(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    monkeypatch.setattr(hardware, "PROC_CPUINFO", root / "proc" / "cpuinfo")
    monkeypatch.setattr(hardware, "PROC_MEMINFO", root / "proc" / "meminfo")
    monkeypatch.setattr(hardware, "SYS_CPU", root / "sys" / "cpu")


def test_detect_survives_missing_proc_and_sys(
    fresh_detect: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _point_detect_at(monkeypatch, tmp_path / "nothing-here")
    hw = Hardware.detect()
    _check_hierarchy(hw)
    caches = [(lv.name, lv.capacity, lv.shared) for lv in hw.levels[:-1]]
    assert caches == [("L1", 32 * KIB, False), ("L2", MIB, False), ("L3", 8 * MIB, True)]
    assert hw.clock_hz == hardware.DEFAULT_CLOCK_HZ
    assert hw.isa <= {Isa.NEON}  # NEON is architectural on AArch64 hosts


def test_detect_survives_unreadable_and_garbage_files(
    fresh_detect: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "proc" / "cpuinfo").mkdir(parents=True)  # a directory: reading it fails
    (tmp_path / "proc" / "meminfo").write_bytes(b"MemTotal: lots\xff\n")
    index = tmp_path / "sys" / "cpu" / "cpu0" / "cache" / "index0"
    index.mkdir(parents=True)
    for name, text in {"level": "one", "type": "Data", "size": "huge"}.items():
        (index / name).write_text(text)
    _point_detect_at(monkeypatch, tmp_path)
    _check_hierarchy(Hardware.detect())


def _fake_host(root: Path) -> None:
    """A 2-socket Sapphire-Rapids-like host with SMT: cpu0's sibling is cpu56."""
    proc = root / "proc"
    proc.mkdir(parents=True)
    flags = "fpu sse2 avx avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"
    (proc / "cpuinfo").write_text(
        f"processor\t: 0\nmodel name\t: Fake Xeon\ncpu MHz\t\t: 800.000\nflags\t\t: {flags}\n\n"
        "processor\t: 1\nflags\t\t: fpu\n"
    )
    (proc / "meminfo").write_text("MemTotal:       16777216 kB\nMemFree: 1 kB\n")
    cpu0 = root / "sys" / "cpu" / "cpu0"
    (cpu0 / "topology").mkdir(parents=True)
    (cpu0 / "topology" / "thread_siblings_list").write_text("0,56\n")
    (cpu0 / "cpufreq").mkdir()
    (cpu0 / "cpufreq" / "cpuinfo_max_freq").write_text("3000000\n")
    caches = [
        ("1", "Data", "48K", "0,56"),
        ("1", "Instruction", "32K", "0,56"),
        ("2", "Unified", "2048K", "0,56"),
        ("3", "Unified", "107520K", "0-55,112-167"),
    ]
    for i, (level, kind, size, users) in enumerate(caches):
        index = cpu0 / "cache" / f"index{i}"
        index.mkdir(parents=True)
        for name, text in zip(
            ("level", "type", "size", "shared_cpu_list"), (level, kind, size, users), strict=True
        ):
            (index / name).write_text(text + "\n")


def test_detect_reads_caches_isa_and_clock(
    fresh_detect: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_host(tmp_path)
    _point_detect_at(monkeypatch, tmp_path)
    hw = Hardware.detect()
    _check_hierarchy(hw)
    levels = [(lv.name, lv.capacity, lv.shared) for lv in hw.levels]
    assert levels == [
        ("L1", 48 * KIB, False),  # shared only with its SMT sibling: still private
        ("L2", 2 * MIB, False),
        ("L3", 105 * MIB, True),
        ("DRAM", 16 * GIB, True),
    ]
    assert hw.clock_hz == 3e9, "cpufreq max, not the idle `cpu MHz` snapshot"
    assert {Isa.AVX512F, Isa.AVX512_BF16, Isa.AMX_TILE, Isa.AMX_BF16, Isa.FMA} <= hw.isa
    assert (hw.vector_bytes, hw.vector_registers) == (64, 32)
    assert hw.peak(DType.FLOAT32) == 3e9 * 2 * 2 * 16
    assert hw.peak(DType.BFLOAT16) == 3e9 * hardware.AMX_BF16_FLOPS_PER_CYCLE
    assert hw.matrix_engine(DType.BFLOAT16) and hw.tile_capacity == 8 * KIB
    assert hw.level("L1").bandwidth == 3e9 * hardware.DEFAULT_BYTES_PER_CYCLE[1]
    assert "Fake Xeon" in hw.name


@pytest.mark.parametrize(
    ("vendor", "family", "model", "lanes"),
    [
        ("AuthenticAMD", 23, 1, 4),  # Zen (EPYC 7001): 256-bit AVX2 as two 128-bit halves
        ("AuthenticAMD", 23, 8, 4),  # Zen+
        ("HygonGenuine", 24, 0, 4),  # Dhyana, a Zen
        ("AuthenticAMD", 23, 49, 8),  # Zen 2: whole 256-bit pipes
        ("AuthenticAMD", 25, 1, 8),  # Zen 3
        ("GenuineIntel", 6, 85, 8),
    ],
)
def test_detect_peak_counts_the_fp_pipes_width(
    fresh_detect: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    vendor: str,
    family: int,
    model: int,
    lanes: int,
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cpuinfo").write_text(
        f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        "model name\t: Fake\ncpu MHz\t\t: 2000.000\nflags\t\t: fpu avx avx2 fma\n\n"
    )
    _point_detect_at(monkeypatch, tmp_path)
    hw = Hardware.detect()
    assert hw.vector_bytes == 32, "the ISA's vectors stay 256-bit"
    assert hw.peak(DType.FLOAT32) == 2e9 * 2 * 2 * lanes
    assert hw.instruction_flops(DType.FLOAT32) == 16, "an FMA instruction does 8 lanes' flops"


def test_zen4_avx512_runs_at_the_avx2_rate(
    fresh_detect: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "cpuinfo").write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "cpu MHz\t\t: 2000.000\nflags\t\t: fpu avx avx2 fma avx512f\n\n"
    )
    _point_detect_at(monkeypatch, tmp_path)
    hw = Hardware.detect()
    assert hw.vector_bytes == 64
    assert hw.peak(DType.FLOAT32) == 2e9 * 2 * 2 * 8


# -- resolve() ------------------------------------------------------------------------------------


def test_resolve_accepts_none_names_and_machines(fresh_detect: None) -> None:
    assert resolve(None) is Hardware.detect()
    assert resolve("detect") is Hardware.detect()
    assert resolve("a100") == Hardware.preset("a100")
    tiny = _tiny()
    assert resolve(tiny) is tiny
    with pytest.raises(ValueError, match="known presets"):
        resolve("no-such-chip")


@pytest.mark.parametrize("bad", [42, 1.5, ["a100"], b"a100"])
def test_resolve_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match="hardware"):
        resolve(bad)  # type: ignore[arg-type]


def test_avx512_bf16_alone_adds_no_bf16_peak() -> None:
    # VDPBF16PS runs at half the FMA rate on an AMX Xeon: bf16 falls back to the fp32 peak
    isa = frozenset({Isa.AVX2, Isa.FMA, Isa.AVX512F, Isa.AVX512_BF16})
    peaks = dict(hardware._peaks(isa, 64, 2e9))
    assert DType.BFLOAT16 not in peaks and peaks[DType.FLOAT32] == 2e9 * 2 * 2 * 16
    amx = dict(hardware._peaks(isa | {Isa.AMX_TILE, Isa.AMX_BF16}, 64, 2e9))
    assert amx[DType.BFLOAT16] == 2e9 * hardware.AMX_BF16_FLOPS_PER_CYCLE
