"""AMX (Intel's tile matrix engine): whether this process may use it, and the switch that says
whether chainfuse does.

The unit needs two things: the CPU has it (CPUID leaf 7, EDX bit 24 AMX-TILE and bit 22
AMX-BF16, which Linux reports as the /proc/cpuinfo flags ``amx_tile`` and ``amx_bf16``) and the
kernel lets this process use the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``, once
per process; without it the first tile instruction raises SIGILL). `amx_status` checks both, asks
for the permission once, and confirms it with ``ARCH_GET_XCOMP_PERM``.

``CHAINFUSE_AMX`` (`amx_mode`) chooses what bf16 GEMM chains run on:

- ``off`` (default until the kernels are measured on an AMX machine): never the AMX kernels;
- ``auto``: the AMX kernels where `amx_status` says the unit is usable, else the fp32 path;
- ``emulate``: the same generated kernels built with the plain-C emulation of the tile
  instructions (``csrc/amx_tiles.c``), on any host: bit for bit what an AMX host computes,
  slowly; how tests and users without AMX run the AMX code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import os
import platform

from chainfuse.hardware import Isa
from chainfuse.ir import DType
from chainfuse.kernels.contract import MicroKernel

__all__ = [
    "AMX_BF16_32X32",
    "AMX_CFLAGS",
    "EMULATE_CFLAGS",
    "ENV_AMX",
    "FP32_FMA",
    "AmxMode",
    "AmxPath",
    "amx_absent",
    "amx_mode",
    "amx_path",
    "amx_report",
    "amx_status",
    "emit_tap_block",
    "emit_tile_block",
]

ENV_AMX = "CHAINFUSE_AMX"

#: flags of the build that runs the tile instructions, and of the one that emulates them
AMX_CFLAGS = ("-mamx-tile", "-mamx-bf16")
EMULATE_CFLAGS = ("-DCF_AMX_EMULATE",)

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


#: the name `Kernel.arithmetic` gives the path that widens 16-bit inputs and computes on fp32
#: vector (FMA) units; `AmxPath` names the tile paths
FP32_FMA = "fp32-fma"


class AmxMode(enum.Enum):
    """The values of ``CHAINFUSE_AMX``."""

    AUTO = "auto"
    EMULATE = "emulate"
    OFF = "off"


class AmxPath(enum.Enum):
    """How a kernel runs its tile instructions: on the unit, or through the emulation."""

    REAL = "amx-bf16"
    EMULATED = "amx-bf16 (emulated)"

    @property
    def cflags(self) -> tuple[str, ...]:
        """The build's flags (separate builds, so separate cache entries)."""
        return AMX_CFLAGS if self is AmxPath.REAL else EMULATE_CFLAGS


def amx_mode() -> AmxMode:
    """``CHAINFUSE_AMX``, read on each call (default ``off``); another value is an error."""
    raw = os.environ.get(ENV_AMX, "").strip().lower()
    if not raw:
        return AmxMode.OFF
    try:
        return AmxMode(raw)
    except ValueError:
        allowed = ", ".join(m.value for m in AmxMode)
        raise ValueError(f"{ENV_AMX}={raw!r}: expected one of {allowed}") from None


def amx_path(dtype: DType) -> AmxPath | None:
    """The AMX path a chain of `dtype` takes here (None: not AMX): bf16 only, per `amx_mode`."""
    if dtype is not DType.BFLOAT16:
        return None
    mode = amx_mode()
    if mode is AmxMode.EMULATE:
        return AmxPath.EMULATED
    if mode is AmxMode.AUTO and amx_status()[0]:
        return AmxPath.REAL
    return None


def amx_report() -> str:
    """One line on AMX in this process, as `chainfuse hw` prints it: whether the unit is there
    and permitted (`available`, `no AMX`, `permission refused`) and what ``CHAINFUSE_AMX`` makes
    of it (`off`, `auto`, `emulated`)."""
    usable, why = amx_status()
    if usable:
        unit = f"available ({why})"
    elif why.startswith(("the CPU lacks", "AMX needs")):
        unit = f"no AMX ({why})"
    else:
        unit = f"permission refused ({why})"
    mode = amx_mode()
    if mode is AmxMode.EMULATE:
        use = "bf16 AMX kernels run through the C emulation (bit-exact, slow)"
    elif mode is AmxMode.AUTO:
        use = "bf16 AMX kernels " + ("in use" if usable else "cannot run here")
    else:
        use = "bf16 AMX kernels not used"
    return f"{unit}; {ENV_AMX}={mode.value}: {use}"


def amx_absent(dtype: DType) -> str:
    """Why a chain of `dtype` does not run on AMX here, for `Kernel.arithmetic` ("" when it
    does: `amx_path` gives a path)."""
    if dtype is not DType.BFLOAT16:
        return f"AMX takes bf16, this chain is {dtype.value}"
    mode = amx_mode()
    if mode is AmxMode.OFF:
        return f"AMX kernels not enabled ({ENV_AMX}=off; auto or emulate runs them)"
    if mode is AmxMode.AUTO:
        usable, why = amx_status()
        return "" if usable else f"{ENV_AMX}=auto, no AMX here: {why}"
    return ""


@functools.cache
def amx_status() -> tuple[bool, str]:
    """(whether this process can run AMX-BF16 tile instructions, why or why not). The first call
    asks Linux for the tile state (once per process: the answer is kept)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"AMX needs Linux on x86-64, this is {platform.system()} {platform.machine()}"
    missing = _cpu_missing()
    if missing:
        return False, missing
    granted, why = _request_tile_permission()
    if not granted:
        return False, why
    return True, "AMX-TILE and AMX-BF16 present (CPUID), tile data permitted (arch_prctl)"


def _cpu_missing() -> str:
    """What the CPU lacks of AMX-TILE and AMX-BF16 ("" when it has both): CPUID leaf 7 as the
    kernel reports it in /proc/cpuinfo's flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError as err:
        return f"cannot read /proc/cpuinfo ({err})"
    words = set(flags.partition(":")[2].split())
    lacks = [flag for flag in ("amx_tile", "amx_bf16") if flag not in words]
    return f"the CPU lacks {' and '.join(lacks)} (CPUID leaf 7)" if lacks else ""


def _request_tile_permission() -> tuple[bool, str]:
    """``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`` through libc's ``syscall``, then
    ``ARCH_GET_XCOMP_PERM`` to confirm bit 18 of the granted features."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
    except OSError as error:
        return False, f"cannot load libc to ask for the tile state ({error})"
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    number = ctypes.c_long(_SYS_ARCH_PRCTL)  # (64-bit arguments: syscall is variadic)
    request = ctypes.c_ulong(_XFEATURE_XTILEDATA)
    if syscall(number, ctypes.c_long(_ARCH_REQ_XCOMP_PERM), request) != 0:
        code = ctypes.get_errno()
        return False, f"arch_prctl(ARCH_REQ_XCOMP_PERM) refused: {os.strerror(code)} (errno {code})"
    mask = ctypes.c_ulong(0)
    if syscall(number, ctypes.c_long(_ARCH_GET_XCOMP_PERM), ctypes.byref(mask)) != 0:
        code = ctypes.get_errno()
        return False, f"arch_prctl(ARCH_GET_XCOMP_PERM) failed: {os.strerror(code)} (errno {code})"
    if not mask.value >> _XFEATURE_XTILEDATA & 1:
        return False, f"tile data not among the permitted features (mask {mask.value:#x})"
    return True, ""


#: Tile numbers of the blocks: accumulators 0-3 (row tile r, column tile c: 2r + c), the row
#: tiles of A 4-5, the column tiles of B 6-7. Every tile is configured 16 rows x 64 bytes.
_ACC, _A, _B = (0, 1, 2, 3), (4, 5), (6, 7)


def emit_tile_block(rt: int, ct: int) -> str:
    """C of ``cf_amx_r<rt>c<ct>``: one block of ``rt`` x ``ct`` fp32 accumulator tiles
    (16 x 16 each), ``C (+)= A . B`` over ``kb`` blocks of 32 k. ``A``: bf16 rows ``lda`` bytes
    apart (k block p at ``A + 32p``); ``B``: VNNI tiles of 512 bf16, column tile c's block p at
    ``B + (c * bstride + p) * 512``; ``C`` rows ``ldc`` bytes apart, read first if
    ``accumulate``. Tile numbers are literals, as the instructions require."""
    if rt not in (1, 2) or ct not in (1, 2):
        raise ValueError(f"a tile block is 1 or 2 tiles a side, got {rt}x{ct}")
    name = f"cf_amx_r{rt}c{ct}"
    acc = [(r, c, _ACC[2 * r + c]) for r in range(rt) for c in range(ct)]

    def at(r: int, c: int) -> str:
        parts = ["(char*)C", *([f"{16 * r} * ldc"] if r else []), *([f"{64 * c}"] if c else [])]
        return " + ".join(parts)

    load = "\n".join(f"        CF_TILE_LOADD({t}, {at(r, c)}, ldc);" for r, c, t in acc)
    zero = "\n".join(f"        CF_TILE_ZERO({t});" for _, _, t in acc)
    a_rows = "\n".join(
        f"        CF_TILE_LOADD({_A[r]}, (const char*)(A + 32 * p){f' + {16 * r} * lda' if r else ''},"
        " lda);"
        for r in range(rt)
    )
    b_cols = "\n".join(
        f"        CF_TILE_LOADD({_B[c]}, B + {'(bstride + p)' if c else 'p'} * 512, 64);"
        for c in range(ct)
    )
    dots = "\n".join(f"        CF_TILE_DPBF16PS({t}, {_A[r]}, {_B[c]});" for r, c, t in acc)
    store = "\n".join(f"    CF_TILE_STORED({t}, {at(r, c)}, ldc);" for r, c, t in acc)
    return f"""
/* {16 * rt}x{16 * ct} fp32 block (+)= A . B in tiles (kernels.amx.emit_tile_block) */
static void {name}(long kb, const uint16_t* A, long lda, const uint16_t* B, long bstride,
                   float* C, long ldc, int accumulate)
{{
    if (accumulate) {{
{load}
    }} else {{
{zero}
    }}
    for (long p = 0; p < kb; ++p) {{
{a_rows}
{b_cols}
{dots}
    }}
{store}
}}
"""


def emit_tap_block(rt: int, ct: int) -> str:
    """C of ``cf_amx_taps_r<rt>c<ct>``: `emit_tile_block`'s block for a convolution, its fp32
    accumulators kept in tiles over every tap: ``C = sum over taps t, blocks p of 32 channels``
    of ``A(t, p) . B(t, p)``, where ``A(t, p)`` is the 16-row tile at ``A + toff[t] + 32p``
    (rows ``lda`` bytes apart) and column tile c's ``B(t, p)`` is the VNNI tile at
    ``B + (c * bstride + t * cb + p) * 512``; C is written once, rows ``ldc`` bytes apart."""
    if rt not in (1, 2) or ct not in (1, 2):
        raise ValueError(f"a tile block is 1 or 2 tiles a side, got {rt}x{ct}")
    acc = [(r, c, _ACC[2 * r + c]) for r in range(rt) for c in range(ct)]

    def at(r: int, c: int) -> str:
        parts = ["(char*)C", *([f"{16 * r} * ldc"] if r else []), *([f"{64 * c}"] if c else [])]
        return " + ".join(parts)

    zero = "\n".join(f"    CF_TILE_ZERO({t});" for _, _, t in acc)
    a_rows = "\n".join(
        f"            CF_TILE_LOADD({_A[r]}, (const char*)a{f' + {16 * r} * lda' if r else ''}, lda);"
        for r in range(rt)
    )
    b_cols = "\n".join(
        f"            CF_TILE_LOADD({_B[c]}, b{' + bstride * 512' if c else ''}, 64);"
        for c in range(ct)
    )
    dots = "\n".join(f"            CF_TILE_DPBF16PS({t}, {_A[r]}, {_B[c]});" for r, c, t in acc)
    store = "\n".join(f"    CF_TILE_STORED({t}, {at(r, c)}, ldc);" for r, c, t in acc)
    return f"""
/* {16 * rt}x{16 * ct} fp32 block = sum over taps of A . B in tiles (kernels.amx.emit_tap_block) */
static void cf_amx_taps_r{rt}c{ct}(long taps, const long* toff, long cb, const uint16_t* A,
                                 long lda, const uint16_t* B, long bstride, float* C, long ldc)
{{
{zero}
    for (long t = 0; t < taps; ++t) {{
        for (long p = 0; p < cb; ++p) {{
            const uint16_t* a = A + toff[t] + 32 * p;
            const uint16_t* b = B + (t * cb + p) * 512;
{a_rows}
{b_cols}
{dots}
        }}
    }}
{store}
}}
"""


def _tile_blocks(kernel: MicroKernel) -> str:
    """Every block shape a generated kernel runs: 1 or 2 row tiles (a tail of rows) by 1 or 2
    column tiles (a tail of columns)."""
    return "".join(emit_tile_block(rt, ct) for rt in (1, 2) for ct in (1, 2))


#: The AMX-BF16 block: 2 x 2 accumulator tiles (32 x 32 fp32), 2 tiles of A and 2 of B (all 8
#: tiles). Not in the registry: its operands are bf16 VNNI tiles, not the registry's fp32 packed
#: slivers, and only `chainfuse.codegen.amx_chain` generates code around it.
AMX_BF16_32X32 = MicroKernel(
    name="amx_bf16_32x32",
    isa=frozenset({Isa.AMX_TILE, Isa.AMX_BF16}),
    dtypes=(DType.BFLOAT16,),
    mr=32,
    nr=32,
    kr=2,
    registers=8,
    flops_per_instruction=16 * 16 * 32 * 2,
    full_tile=_tile_blocks,
    cflags=AMX_CFLAGS,
)
