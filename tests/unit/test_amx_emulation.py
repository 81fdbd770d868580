"""The plain-C emulation of the AMX tile instructions (`csrc/amx_tiles.c`) against TDPBF16PS
results recorded on AMX hardware (`tests/data/tdpbf16ps_vectors.npz`, a copy of the shared
vectors): every output bit of all 200 cases must match. On an AMX host the same harness built
for the unit runs the vectors too. Also: the `CHAINFUSE_AMX` switch and the capability check."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chainfuse.codegen.common import c_source
from chainfuse.ir import DType
from chainfuse.kernels import amx
from chainfuse.kernels.amx import AmxMode, AmxPath, amx_mode, amx_path, amx_status
from chainfuse.runtime import build, load

VECTORS = Path(__file__).resolve().parents[1] / "data" / "tdpbf16ps_vectors.npz"

#: one TDPBF16PS per case, all tiles 16 rows x 64 bytes: OUT = C + A . B (B in VNNI pairs)
HARNESS = """
void cf_amx_cases(long n, const uint16_t* A, const uint16_t* B, const uint32_t* C,
                  uint32_t* out)
{
    cf_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 3; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    CF_TILE_LOADCONFIG(&cfg);
    for (long i = 0; i < n; ++i) {
        CF_TILE_LOADD(0, C + 256 * i, 64);
        CF_TILE_LOADD(1, A + 512 * i, 64);
        CF_TILE_LOADD(2, B + 512 * i, 64);
        CF_TILE_DPBF16PS(0, 1, 2);
        CF_TILE_STORED(0, out + 256 * i, 64);
    }
    CF_TILE_RELEASE();
}
"""


def _harness(path: AmxPath) -> Any:
    lib = load(build(c_source("amx_tiles.c") + HARNESS, "amx_cases", path.cflags).path)
    fn = lib.cf_amx_cases
    fn.restype = None
    fn.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 4
    return fn


def _run(path: AmxPath) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.load(VECTORS)
    a, b, c = (np.ascontiguousarray(data[x]) for x in ("A", "B", "C"))
    out = np.full_like(data["OUT"], 0xDEADBEEF)
    _harness(path)(len(a), a.ctypes.data, b.ctypes.data, c.ctypes.data, out.ctypes.data)
    return out, data["OUT"], data["kind"]


def _mismatches(got: np.ndarray, want: np.ndarray, kind: np.ndarray) -> str:
    bad = np.argwhere(got != want)
    lines = [f"case {i} ({kind[i]}) [{m}, {n}]: {got[i, m, n]:#010x}, hardware {want[i, m, n]:#010x}"
             for i, m, n in bad[:10]]  # fmt: skip
    return f"{len(bad)} of {got.size} output words differ:\n" + "\n".join(lines)


def test_vectors_are_in_the_repository() -> None:
    data = np.load(VECTORS)
    assert data["OUT"].shape == (200, 16, 16) and data["A"].dtype == np.uint16
    assert set(data["kind"]) == {"normal", "range", "underflow", "special", "overflow"}


def test_emulation_matches_every_bit_of_the_hardware_vectors() -> None:
    got, want, kind = _run(AmxPath.EMULATED)
    assert np.array_equal(got, want), _mismatches(got, want, kind)


def test_the_vectors_tell_a_wrong_order_of_sums_apart() -> None:
    # the check can fail: one fp32 accumulator over all 32 products (no even/odd split) differs
    data = np.load(VECTORS)
    i = int(np.flatnonzero(data["kind"] == "normal")[0])
    a = (data["A"][i].astype(np.uint32) << 16).view(np.float32)
    b = (data["B"][i].astype(np.uint32) << 16).view(np.float32)  # [16 pairs][16 n x 2]
    one = np.zeros((16, 16), np.float32)
    for kp in range(16):
        for h in range(2):
            one = one + np.outer(a[:, 2 * kp + h], b[kp, h::2])
    got = (data["C"][i].view(np.float32) + one).view(np.uint32)
    assert not np.array_equal(got, data["OUT"][i])


@pytest.mark.skipif(not amx_status()[0], reason=f"no AMX here: {amx_status()[1]}")
def test_the_unit_matches_the_vectors() -> None:
    got, want, kind = _run(AmxPath.REAL)
    assert np.array_equal(got, want), _mismatches(got, want, kind)


def test_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(amx.ENV_AMX, raising=False)
    assert amx_mode() is AmxMode.OFF and amx_path(DType.BFLOAT16) is None  # opt-in for now
    monkeypatch.setenv(amx.ENV_AMX, "auto")
    assert amx_path(DType.BFLOAT16) is (AmxPath.REAL if amx_status()[0] else None)
    monkeypatch.setenv(amx.ENV_AMX, "emulate")
    assert amx_path(DType.BFLOAT16) is AmxPath.EMULATED
    assert amx_path(DType.FLOAT32) is None and amx_path(DType.FLOAT16) is None
    monkeypatch.setenv(amx.ENV_AMX, "off")
    assert amx_path(DType.BFLOAT16) is None
    monkeypatch.setenv(amx.ENV_AMX, "yes")
    with pytest.raises(
        ValueError, match=r"CHAINFUSE_AMX='yes': expected one of auto, emulate, off"
    ):
        amx_mode()


def test_status_says_why() -> None:
    available, reason = amx_status()
    assert isinstance(available, bool) and reason
    assert amx_status() is amx_status()  # asked once per process


def test_status_needs_the_cpu_flags_and_the_permission(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(amx.platform, "system", lambda: "Linux")
    monkeypatch.setattr(amx.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(amx, "_cpu_missing", lambda: "the CPU lacks amx_bf16 (CPUID leaf 7)")
    assert amx_status.__wrapped__() == (False, "the CPU lacks amx_bf16 (CPUID leaf 7)")
    monkeypatch.setattr(amx, "_cpu_missing", lambda: "")
    refused = (False, "arch_prctl(ARCH_REQ_XCOMP_PERM) refused: Invalid argument (errno 22)")
    monkeypatch.setattr(amx, "_request_tile_permission", lambda: refused)
    assert amx_status.__wrapped__() == refused
    monkeypatch.setattr(amx, "_request_tile_permission", lambda: (True, ""))
    assert amx_status.__wrapped__()[0] is True
