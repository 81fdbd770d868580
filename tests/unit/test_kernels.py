"""chainfuse.kernels: every micro-kernel this CPU can run against numpy; the registry; select."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from chainfuse import config
from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import DType
from chainfuse.kernels import (
    PREFETCH_FAR,
    MicroKernel,
    Problem,
    Registry,
    available,
    avx2_fma_6x16_f32,
    avx512_6x64_f32,
    avx512_12x32_f32,
    emit_with_packing,
    portable_4x16_f32,
    reference_4x4_f32,
    register,
    select,
    select_weighted,
)
from chainfuse.runtime import build, find_compiler, load

HOST = Hardware.detect()
X86_ISA = frozenset({Isa.AVX2, Isa.FMA, Isa.AVX512F, Isa.AVX512_BF16, Isa.AMX_TILE, Isa.AMX_BF16})
KERNELS = available()
EPS32 = float(np.finfo(np.float32).eps)

Run = Callable[..., int]


def _ids(kernel: MicroKernel) -> str:
    return kernel.name


def _runnable(kernel: MicroKernel) -> None:
    missing = kernel.isa - HOST.isa
    if missing:
        pytest.skip(f"this CPU lacks {sorted(f.value for f in missing)} for {kernel.name}")


def _widths(kernel: MicroKernel) -> list[int]:
    """Column counts that reach every path of a tail: 1, nr - 1, nr, and each narrow block's
    width (`part_cols`: straight into C) and one column either side of it (through the copy)."""
    near = {w + d for w in kernel.col_widths for d in (-1, 0, 1)}
    return sorted(n for n in {1, kernel.nr - 1, kernel.nr} | near if 1 <= n <= kernel.nr)


def _harness(kernel: MicroKernel) -> str:
    k = kernel.name
    cols = (
        f"""
/* {k}_cols: w of the nr columns computed, the rest of the mr rows set to zero */
int run_cols(int kc, const float* A, long rs, long ks, const float* B, float* C, long ldc, int w,
             int accumulate)
{{
    float* Bp = malloc(sizeof(float) * (size_t)(kc > 0 ? kc : 1) * {kernel.nr});
    if (!Bp) return -1;
    {k}_pack_b(kc, w, B, w, Bp);
    {k}_cols(kc, A, rs, ks, Bp, C, ldc, w, accumulate);
    free(Bp);
    return 0;
}}
"""
        if kernel.col_widths
        else ""
    )
    return f"""\
#include <stdlib.h>
{emit_with_packing(kernel)}
int run(int kc, int m, int n, const float* A, long lda, int a_transposed, const float* B,
        long ldb, int b_transposed, float* C, long ldc, int accumulate)
{{
    float* Ap = malloc(sizeof(float) * (size_t)(kc > 0 ? kc : 1) * {kernel.mr});
    float* Bp = malloc(sizeof(float) * (size_t)(kc > 0 ? kc : 1) * {kernel.nr});
    if (!Ap || !Bp) {{
        free(Ap);
        free(Bp);
        return -1;
    }}
    if (a_transposed) {k}_pack_at(kc, m, A, lda, Ap); else {k}_pack_a(kc, m, A, lda, Ap);
    if (b_transposed) {k}_pack_bt(kc, n, B, ldb, Bp, 1.0f); else {k}_pack_b(kc, n, B, ldb, Bp);
    {k}(kc, Ap, Bp, C, ldc, m, n, accumulate);
    free(Ap);
    free(Bp);
    return 0;
}}

/* {kernel.mr} rows read in place, ng groups of kc steps (ng == 0: the one-group strided call) */
int run_in_place(int kc, int ng, long gs, const float* A, long rs, long ks, const float* B,
                 float* C, long ldc, int n, int accumulate)
{{
    const int steps = kc * (ng > 0 ? ng : 1);
    float* Bp = malloc(sizeof(float) * (size_t)(steps > 0 ? steps : 1) * {kernel.nr});
    if (!Bp) return -1;
    {k}_pack_b(steps, n, B, n, Bp);
    if (ng == 0) {k}_strided(kc, A, rs, ks, Bp, C, ldc, n, accumulate);
    else {k}_grouped(kc, ng, gs, A, rs, ks, Bp, C, ldc, n, accumulate);
    free(Bp);
    return 0;
}}

/* the row-major packing on its own: Ap (kc x mr) from A (m x kc) */
void run_pack_a(int kc, int m, const float* A, long lda, float* Ap)
{{
    {k}_pack_a(kc, m, A, lda, Ap);
}}

/* the transposed packing on its own: Bp (kc x nr) from Bt (n x kc), times scale */
void run_pack_bt(int kc, int n, const float* Bt, long ldbt, float* Bp, float scale)
{{
    {k}_pack_bt(kc, n, Bt, ldbt, Bp, scale);
}}
{cols}"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Run]]:
    """One harness per kernel, compiled on first use and kept for the module."""
    built: dict[str, Run] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(config.ENV_CACHE_DIR, str(tmp_path_factory.mktemp("kernel-cache")))

        def get(kernel: MicroKernel, entry: str = "run") -> Run:
            if kernel.name not in built:
                result = build(_harness(kernel), f"test_{kernel.name}", kernel.cflags)
                lib = load(result.path)
                i, lg, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
                lib.run.argtypes = [i, i, i, ptr, lg, i, ptr, lg, i, ptr, lg, i]
                lib.run_in_place.argtypes = [i, i, lg, ptr, lg, lg, ptr, ptr, lg, i, i]
                lib.run.restype = lib.run_in_place.restype = ctypes.c_int
                lib.run_pack_bt.argtypes = [i, i, ptr, lg, ptr, ctypes.c_float]
                lib.run_pack_bt.restype = None
                built[kernel.name] = lib.run
                built[kernel.name + ".in_place"] = lib.run_in_place
                built[kernel.name + ".pack_bt"] = lib.run_pack_bt
                lib.run_pack_a.argtypes = [i, i, ptr, lg, ptr]
                lib.run_pack_a.restype = None
                built[kernel.name + ".pack_a"] = lib.run_pack_a
                if kernel.col_widths:
                    lib.run_cols.argtypes = [i, ptr, lg, lg, ptr, ptr, lg, i, i]
                    lib.run_cols.restype = ctypes.c_int
                    built[kernel.name + ".cols"] = lib.run_cols
            return built[kernel.name if entry == "run" else f"{kernel.name}.{entry}"]

        yield get


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _assert_close(got: np.ndarray, want: np.ndarray, scale: np.ndarray, kc: int, what: str) -> None:
    """float32 GEMM error bound: |got - want| <= (kc + 2) eps32 (|A||B| + |C0|), elementwise."""
    bound = (kc + 2) * EPS32 * scale + 1e-30
    bad = ~(np.abs(got.astype(np.float64) - want) <= bound)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off; worst at {np.argwhere(bad)[0]}"


def _assert_block(
    C: np.ndarray,
    A: np.ndarray,
    B: np.ndarray,
    C0: np.ndarray | None,
    sentinel: float,
    what: str,
    relu: bool = False,
) -> None:
    """C[0:m, 0:n] = A @ B (+ C0 when accumulating; its relu with `relu`) within the GEMM
    bound, and every other element of C still the sentinel (m, n: A's rows, B's columns)."""
    m, n = A.shape[0], B.shape[1]
    product = A.astype(np.float64) @ B.astype(np.float64)
    scale = np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)
    if C0 is not None:
        product += C0
        scale += np.abs(C0)
    if relu:  # (relu moves an error no further: |relu(x) - relu(y)| <= |x - y|)
        product = np.maximum(product, 0.0)
    _assert_close(C[:m, :n], product, scale, A.shape[1], what)
    outside = np.ones(C.shape, bool)
    outside[:m, :n] = False
    assert (C[outside] == sentinel).all(), f"{what}: wrote outside C[0:{m}, 0:{n}]"


@pytest.mark.parametrize("transposed", [False, True], ids=["rowmajor", "transposed"])
@pytest.mark.parametrize("accumulate", [0, 1, 2, 3])  # bit 1: RELU_AT_STORE
@pytest.mark.parametrize("kc", [1, 7, 19, 64])  # 19: whole 8x8 transposed blocks + a tail
@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_microkernel_matches_numpy(
    compiled: Callable[..., Run],
    kernel: MicroKernel,
    kc: int,
    accumulate: int,
    transposed: bool,
) -> None:
    _runnable(kernel)
    run = compiled(kernel)
    rng = np.random.default_rng(kc * 10 + accumulate)
    mr, nr = kernel.mr, kernel.nr
    sentinel = np.float32(7.0)
    for m in sorted({1, kernel.part_rows, mr - 1, mr} - {0}):  # part_rows: its own tile
        for n in _widths(kernel):  # (part_cols: the narrow blocks)
            what = f"{kernel.name} kc={kc} m={m} n={n} accumulate={accumulate}"
            A = rng.uniform(-1, 1, (m, kc)).astype(np.float32)
            B = rng.uniform(-1, 1, (kc, n)).astype(np.float32)
            # Sources with leading dimensions larger than their width, as tiles of bigger arrays.
            if transposed:
                a_src = np.zeros((kc, m + 2), np.float32)
                a_src[:, :m] = A.T
                b_src = np.zeros((n, kc + 1), np.float32)
                b_src[:, :kc] = B.T
            else:
                a_src = np.zeros((m, kc + 3), np.float32)
                a_src[:, :kc] = A
                b_src = np.zeros((kc, n + 5), np.float32)
                b_src[:, :n] = B
            ldc = nr + 3
            C = np.full((mr + 2, ldc), sentinel, np.float32)
            if accumulate & 1:
                C[:m, :n] = rng.uniform(-1, 1, (m, n))
            else:
                C[:m, :n] = np.nan  # overwriting must not read C
            C0 = C[:m, :n].astype(np.float64)
            status = run(
                kc, m, n,
                _ptr(a_src), a_src.shape[1], int(transposed),
                _ptr(b_src), b_src.shape[1], int(transposed),
                _ptr(C), ldc, accumulate,
            )  # fmt: skip
            assert status == 0
            _assert_block(C, A, B, C0 if accumulate & 1 else None, sentinel, what, accumulate > 1)


@pytest.mark.parametrize("accumulate", [0, 1, 2, 3])
@pytest.mark.parametrize(
    ("kc", "ng", "ks"),
    # (ks = PREFETCH_FAR + 1: the steps far apart enough for the full tile's prefetch)
    [(1, 0, 1), (19, 0, 3), (1, 1, 1), (7, 3, 1), (16, 2, 2), (5, 0, PREFETCH_FAR + 1)],
)
@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_in_place_calls_match_numpy(
    compiled: Callable[..., Run], kernel: MicroKernel, kc: int, ng: int, ks: int, accumulate: int
) -> None:
    """`_strided` (ng = 0) and `_grouped` read A(i, g*kc + p) = A[g*gs + i*rs + p*ks] in place:
    rows, steps and groups at awkward strides in one buffer whose other elements are NaN."""
    _runnable(kernel)
    run = compiled(kernel, "in_place")
    rng = np.random.default_rng(100 * kc + 10 * ng + accumulate)
    mr, nr = kernel.mr, kernel.nr
    groups = max(ng, 1)
    rs = kc * ks + 3  # a row past the last step of the row before, and not a multiple of it
    gs = mr * rs + 5
    buf = np.full(groups * gs + 8, np.nan, np.float32)
    A = rng.uniform(-1, 1, (mr, groups * kc)).astype(np.float32)
    for g in range(groups):
        for i in range(mr):
            buf[g * gs + i * rs : g * gs + i * rs + kc * ks : ks] = A[i, g * kc : (g + 1) * kc]
    for n in _widths(kernel):
        what = f"{kernel.name} kc={kc} ng={ng} ks={ks} n={n} accumulate={accumulate}"
        B = rng.uniform(-1, 1, (groups * kc, n)).astype(np.float32)
        ldc = nr + 3
        C = np.full((mr + 2, ldc), 7.0, np.float32)
        C[:mr, :n] = rng.uniform(-1, 1, (mr, n)) if accumulate & 1 else np.nan
        C0 = C[:mr, :n].astype(np.float64)
        status = run(kc, ng, gs, _ptr(buf), rs, ks, _ptr(B), _ptr(C), ldc, n, accumulate)
        assert status == 0
        _assert_block(C, A, B, C0 if accumulate & 1 else None, 7.0, what, accumulate > 1)


@pytest.mark.parametrize("accumulate", [0, 1, 3])
@pytest.mark.parametrize("kc", [1, 7, 64])
@pytest.mark.parametrize("kernel", [k for k in KERNELS if k.col_widths], ids=_ids)
def test_cols_computes_its_width_and_zeroes_the_rest_of_the_strip(
    compiled: Callable[..., Run], kernel: MicroKernel, kc: int, accumulate: int
) -> None:
    """`_cols(..., w, accumulate)`: C[0:mr, 0:w] (+)= A . Bp (a narrow block, or the full tile
    at w = nr) and C[0:mr, w:nr] = 0 whatever it held (a tail strip kept whole, as if its Bp
    columns were zeros), A read in place; nothing else of C written."""
    _runnable(kernel)
    run = compiled(kernel, "cols")
    rng = np.random.default_rng(kc + accumulate)
    mr, nr = kernel.mr, kernel.nr
    rs, ks = 1, mr + 1  # a packed-like sliver at a stride that is not mr
    for w in (*kernel.col_widths, nr):
        what = f"{kernel.name} kc={kc} w={w} accumulate={accumulate}"
        A = rng.uniform(-1, 1, (mr, kc)).astype(np.float32)
        buf = np.full(kc * ks + mr, np.nan, np.float32)
        for p in range(kc):
            buf[p * ks : p * ks + mr] = A[:, p]
        B = rng.uniform(-1, 1, (kc, w)).astype(np.float32)
        ldc = nr + 3
        C = np.full((mr + 2, ldc), 7.0, np.float32)
        C[:mr, :w] = rng.uniform(-1, 1, (mr, w)) if accumulate & 1 else np.nan
        C[:mr, w:nr] = np.nan  # set to zero, never read
        C0 = C[:mr, :w].astype(np.float64)
        assert run(kc, _ptr(buf), rs, ks, _ptr(B), _ptr(C), ldc, w, accumulate) == 0
        assert (C[:mr, w:nr] == 0).all(), f"{what}: the columns past w are not zeros"
        C[:mr, w:nr] = 7.0
        _assert_block(C, A, B, C0 if accumulate & 1 else None, 7.0, what, accumulate > 1)


@pytest.mark.parametrize("kc", [1, 7, 8, 17, 64])
@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_pack_a_copies_its_rows_and_zeroes_the_rest_exactly(
    compiled: Callable[..., Run], kernel: MicroKernel, kc: int
) -> None:
    """`_pack_a(kc, m, A, lda, Ap)`: Ap[p*mr + i] = A[i, p] for i < m, zeros in the rows past
    m, nothing written past kc steps; register-transposed groups of rows (a 12-row kernel's
    8-11), the rows after them and short slivers alike."""
    _runnable(kernel)
    run = compiled(kernel, "pack_a")
    rng = np.random.default_rng(kc)
    mr = kernel.mr
    tb = kernel.transpose_block or mr
    for m in sorted({1, tb - 1, tb, tb + 1, mr - 1, mr} & set(range(1, mr + 1))):
        lda = kc + 5
        A = np.full((m, lda), np.nan, np.float32)
        A[:, :kc] = rng.uniform(-1e4, 1e4, (m, kc))
        Ap = np.full(kc * mr + 16, 7.0, np.float32)
        run(kc, m, _ptr(A), lda, _ptr(Ap))
        want = np.zeros((kc, mr), np.float32)
        want[:, :m] = A[:, :kc].T
        assert np.array_equal(Ap[: kc * mr].reshape(kc, mr), want), f"{kernel.name} kc={kc} m={m}"
        assert (Ap[kc * mr :] == 7.0).all(), f"{kernel.name} kc={kc} m={m}: written past kc"


@pytest.mark.parametrize("scale", [1.0, 0.125 * 1.4426950408889634])
@pytest.mark.parametrize("kc", [1, 7, 8, 17, 64])
@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_pack_bt_transposes_and_scales_exactly(
    compiled: Callable[..., Run], kernel: MicroKernel, kc: int, scale: float
) -> None:
    """`_pack_bt(kc, n, Bt, ldbt, Bp, scale)`: Bp[p*nr + j] = Bt[j, p] * scale rounded once
    (attention's Qᵀ times its softmax scale in base 2), zeros in the columns past n; whole
    register-transposed blocks, the steps after them and partial slivers alike."""
    _runnable(kernel)
    run = compiled(kernel, "pack_bt")
    rng = np.random.default_rng(kc)
    nr = kernel.nr
    factor = np.float32(scale)
    tb = kernel.transpose_block or nr  # whole groups of tb columns, then single columns
    for n in sorted(
        {1, tb - 1, tb, tb + 1, nr - 1, nr} & set(range(1, nr + 1)) | {*_widths(kernel)}
    ):
        ldbt = kc + 5
        Bt = np.full((n, ldbt), np.nan, np.float32)
        Bt[:, :kc] = rng.uniform(-1e4, 1e4, (n, kc))
        Bp = np.full((kc, nr), 7.0, np.float32)
        run(kc, n, _ptr(Bt), ldbt, _ptr(Bp), float(factor))
        want = np.zeros((kc, nr), np.float32)
        want[:, :n] = Bt[:, :kc].T * factor
        assert np.array_equal(Bp, want), f"{kernel.name} kc={kc} n={n} scale={scale}"


@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_emitted_source_compiles_for_its_isa(kernel: MicroKernel, tmp_path: Path) -> None:
    """Compile only (``-S``, the kernel's own flags, no -march=native): also covers kernels this
    CPU cannot run, e.g. AVX-512 here; the assembly must use the ISA's registers and FMAs."""
    if kernel.isa and not kernel.isa <= X86_ISA:
        pytest.skip(f"{kernel.name} is not an x86 kernel")
    if kernel.isa and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 intrinsics need an x86 compiler")
    src = tmp_path / "k.c"
    src.write_text(
        emit_with_packing(kernel)
        + "void call(int kc, const float* Ap, const float* Bp, float* C, long ldc, int m, int n)\n"
        + f"{{ {kernel.name}(kc, Ap, Bp, C, ldc, m, n, 1); }}\n"
    )
    cc = find_compiler()
    command = [cc.path, "-O3", "-std=c11", "-ffp-contract=fast", *kernel.cflags, "-S"]
    done = subprocess.run(
        [*command, "-o", str(tmp_path / "k.s"), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    asm = (tmp_path / "k.s").read_text()
    if Isa.AVX512F in kernel.isa:
        assert "zmm" in asm and "vfmadd" in asm
    elif Isa.AVX2 in kernel.isa:
        assert "ymm" in asm and "vfmadd" in asm


@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_one_signature_for_every_kernel(kernel: MicroKernel) -> None:
    source = " ".join(kernel.emit().split())
    expected = (
        f"static inline void {kernel.name}(int kc, const float* restrict Ap, const float* "
        "restrict Bp, float* restrict C, long ldc, int m, int n, int accumulate)"
    )
    assert expected in source
    assert re.search(rf"static [^\n]*void {kernel.name}_pack_bt\(", emit_with_packing(kernel))


def test_emitted_sources_are_the_same_in_another_process_and_differ_by_kernel() -> None:
    """The source is the cache key: a process with another hash seed emits the same bytes for
    every kernel (no set or dict order, no addresses), and no two kernels emit the same."""
    here = {k.name: hashlib.sha256(emit_with_packing(k).encode()).hexdigest() for k in KERNELS}
    code = (
        "import hashlib\nfrom chainfuse.kernels import available, emit_with_packing\n"
        "for k in available():\n"
        "    print(k.name, hashlib.sha256(emit_with_packing(k).encode()).hexdigest())\n"
    )
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[2]), os.getenv("PYTHONPATH")]))
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, env=env)  # fmt: skip
        assert dict(line.split() for line in child.stdout.splitlines()) == here, seed
    assert len(set(here.values())) == len(here) > 1


@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_full_tiles_prefetch_only_far_apart_steps(kernel: MicroKernel) -> None:
    """A full tile asks for the next line along A's rows only when its steps are at least
    PREFETCH_FAR floats apart: below that the hardware follows them (module docstring of base)."""
    source = kernel.emit()
    prefetches = re.findall(r"^.*__builtin_prefetch\(a \+.*$", source, re.M)
    if not prefetches:
        pytest.skip(f"{kernel.name} emits its own full tile without the shared prefetch")
    for line in prefetches:
        assert f"if (ks >= {PREFETCH_FAR})" in line, line


def test_registry_has_the_reference_and_rejects_duplicates() -> None:
    assert reference_4x4_f32 in KERNELS and not reference_4x4_f32.isa
    assert len({k.name for k in KERNELS}) == len(KERNELS)
    with pytest.raises(ValueError, match="already registered"):
        register(reference_4x4_f32)
    private = Registry()
    private.register(avx2_fma_6x16_f32)
    with pytest.raises(ValueError, match="already registered"):
        private.register(dataclasses.replace(portable_4x16_f32, name="avx2_fma_6x16_f32"))
    assert private.available() == (avx2_fma_6x16_f32,)


def test_select_on_this_machine() -> None:
    problem = Problem(DType.FLOAT32, 512, 512, 64)
    if {Isa.AVX512F, Isa.FMA} <= HOST.isa:
        expected = avx512_6x64_f32
    elif {Isa.AVX2, Isa.FMA} <= HOST.isa:
        expected = avx2_fma_6x16_f32
    else:
        expected = portable_4x16_f32
    assert select(problem, HOST) == expected


def test_select_without_isa_flags_is_portable_and_reference_always_applies() -> None:
    bare = dataclasses.replace(
        HOST,
        isa=frozenset(),
        vector_bytes=0,
        vector_registers=0,
        peak_flops=((DType.FLOAT32, 2 * HOST.clock_hz),),
    )
    problem = Problem(DType.FLOAT32, 100, 100, 100)
    # A machine that declares scalar peaks: every kernel reaches the same (capped) width, the
    # larger block wins unless its tails waste more (100 = 6 x 16 + 4 columns) than a 4x4 block.
    assert select(Problem(DType.FLOAT32, 64, 64, 64), bare) == portable_4x16_f32
    assert select(problem, bare) in (portable_4x16_f32, reference_4x4_f32)
    assert select(problem, dataclasses.replace(HOST, isa=frozenset())) == portable_4x16_f32
    assert reference_4x4_f32.applies(problem, bare)
    assert not avx2_fma_6x16_f32.applies(problem, bare)


def test_select_on_split_fp_pipes_keeps_the_fma_kernel() -> None:
    """A Zen-1-like core (256-bit AVX2 on 128-bit pipes) has half the peak of its vectors, but
    its FMA instructions still do twice the work of the portable kernel's: no tie on width that
    the portable 4-row block's smaller tails would break in its favour."""
    zen1 = dataclasses.replace(
        HOST,
        isa=frozenset({Isa.AVX2, Isa.FMA}),
        vector_bytes=32,
        vector_registers=16,
        peak_flops=((DType.FLOAT32, HOST.clock_hz * 2 * 2 * 4),),
    )
    for M in (64, 16, 512):
        assert select(Problem(DType.FLOAT32, M, 64, 64), zen1) == avx2_fma_6x16_f32


def test_score_weighs_tail_waste() -> None:
    xeon = Hardware.preset("xeon-gold-6240")
    assert select(Problem(DType.FLOAT32, 512, 64, 64), xeon) == avx512_6x64_f32
    # the same block size: fewer operand loads per FMA (6x64) wins the tie
    assert (
        avx512_12x32_f32.score(Problem(DType.FLOAT32, 512, 64, 64), xeon)[:2]
        == (avx512_6x64_f32.score(Problem(DType.FLOAT32, 512, 64, 64), xeon)[:2])
    )
    # N = 208 = 3 x 64 + 16: three 64-wide blocks and a 16-wide one (part_cols), no waste
    assert select(Problem(DType.FLOAT32, 208, 208, 64), xeon) == avx512_6x64_f32
    # ... which a 64-wide block without narrow ones would lose to 12x32 (256 columns, not 224)
    whole = dataclasses.replace(avx512_6x64_f32, part_cols=0)
    problem = Problem(DType.FLOAT32, 208, 208, 64)
    assert whole.score(problem, xeon) < avx512_12x32_f32.score(problem, xeon)
    assert avx512_6x64_f32.score(problem, xeon)[0] == round(208 / 210, 9)  # (rows of 6 only)
    # N = 32, narrower than one 64-wide block: counted at the full width (the strip's softmax
    # and stores are 64 wide whatever the block computes), so 12x32 wins
    assert select(Problem(DType.FLOAT32, 512, 32, 64), xeon) == avx512_12x32_f32
    # N = 16: a 64-wide block would compute 4x the useful work in its tail; 16 columns of ymm
    # or 32 of zmm take as many FMAs, and the larger block wins
    assert select(Problem(DType.FLOAT32, 512, 16, 64), xeon) == avx512_12x32_f32


def test_select_weighted_weighs_both_gemms_by_flops() -> None:
    xeon = Hardware.preset("xeon-gold-6240")
    # 510 rows: whole blocks of 6, not of 12 (which then idles 6 of 516 rows)
    wide, narrow = Problem(DType.FLOAT32, 510, 64, 64), Problem(DType.FLOAT32, 510, 16, 64)
    assert select_weighted([(wide, 1.0)], xeon) == select(wide, xeon) == avx512_6x64_f32
    # a second GEMM of 16 columns as large as the first: a 64-wide block idles 3/4 of it
    assert select_weighted([(wide, 1.0), (narrow, 1.0)], xeon) == avx512_12x32_f32
    # ... but not when it is 0.1 % of the work
    assert select_weighted([(wide, 1.0), (narrow, 0.001)], xeon) == avx512_6x64_f32
    with pytest.raises(ValueError, match="no problems"):
        select_weighted([], xeon)


def test_no_kernel_for_float64_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no micro-kernel handles float64"):
        select(Problem(DType.FLOAT64, 8, 8, 8), HOST)


def test_invalid_values_are_rejected() -> None:
    with pytest.raises(ValueError):
        Problem(DType.FLOAT32, 0, 1, 1)
    with pytest.raises(ValueError, match="C identifier"):
        dataclasses.replace(reference_4x4_f32, name="not a name")
    with pytest.raises(ValueError):
        dataclasses.replace(reference_4x4_f32, mr=0)
    for rows in (-1, 4, True):  # reference_4x4 has mr = 4: a part tile has fewer rows
        with pytest.raises(ValueError, match="part_rows"):
            dataclasses.replace(reference_4x4_f32, part_rows=rows)
    for cols in (-2, 3, 64, True):  # avx512 6x64: a proper divisor of nr = 64, an int
        with pytest.raises(ValueError, match="part_cols"):
            dataclasses.replace(avx512_6x64_f32, part_cols=cols)
    assert avx512_6x64_f32.col_widths == (16, 32, 48)
    with pytest.raises(ValueError, match="not a multiple of 16"):  # whole vectors only
        dataclasses.replace(avx512_6x64_f32, part_cols=8).emit()
    # scores_exp (softmax exponentials beside op1's FMAs) wants whole zmm rows and its block,
    # B vectors and broadcast in the 32 registers: 8 x 64 would need 37
    for mr, nr in ((8, 64), (6, 40)):
        wide = dataclasses.replace(avx512_6x64_f32, mr=mr, nr=nr, part_cols=0, transpose_block=0,
                                   transpose=None)  # fmt: skip
        assert wide.scores_exp is not None
        with pytest.raises(ValueError, match=f"scores_exp wants .* \\(mr={mr}, nr={nr}\\)"):
            wide.scores_exp(wide)
    # wide blocks (a whole value head a row): the emitter, its widths and rows go together;
    # rows divide nr; every width's accumulators, B vectors and broadcast fit the 32 registers
    for bad in ({"wide": None}, {"wide_cols": ()}, {"wide_mr": 0}, {"wide_mr": 5},
                {"wide_cols": (0,)}):  # fmt: skip
        with pytest.raises(ValueError, match="wide"):
            dataclasses.replace(avx512_6x64_f32, **bad)
    assert avx512_6x64_f32.wide is not None
    with pytest.raises(ValueError, match="32 registers"):
        avx512_6x64_f32.wide(dataclasses.replace(avx512_6x64_f32, wide_cols=(112,)))


_WIDE_KERNELS = [k for k in KERNELS if k.wide is not None]


@pytest.mark.parametrize("kernel", _WIDE_KERNELS, ids=_ids)
def test_wide_blocks_compute_their_rows_of_a_whole_value_head(
    kernel: MicroKernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`<name>_wide<w>` (`MicroKernel.wide`) against float64: C[0:rows, 0:w] (+)= A . B with A
    broadcast from rows ks apart, B's rows ldb apart (beyond w: never read into C), C's ldc
    apart, row i times scale[i] where a scale is given (the accumulated sum's); every rows
    count 1..wide_mr stores its rows and nothing else, accumulated or not; each B vector held
    in a register (an empty asm pins it: not folded into the FMAs)."""
    _runnable(kernel)
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(tmp_path))
    assert kernel.wide is not None
    text = kernel.wide(kernel)
    name, mr = kernel.name, kernel.wide_mr
    assert text.count('__asm__("" : "+v"(b') == sum(w // 16 for w in kernel.wide_cols)
    calls = "\n".join(
        f"void run{w}(int kc, const float* A, long ks, const float* B, long ldb, float* C,"
        f" long ldc, int rows, int acc, const float* scale)"
        f" {{ {name}_wide{w}(kc, A, ks, B, ldb, C, ldc, rows, acc, scale); }}"
        for w in kernel.wide_cols
    )
    lib = load(build(f"#include <immintrin.h>\n{text}\n{calls}\n", f"test_wide_{name}",
                     kernel.cflags).path)  # fmt: skip
    ptr = ctypes.c_void_p
    rng = np.random.default_rng(3)
    for w in kernel.wide_cols:
        fn = getattr(lib, f"run{w}")
        fn.argtypes = [ctypes.c_int, ptr, ctypes.c_long, ptr, ctypes.c_long, ptr, ctypes.c_long,
                       ctypes.c_int, ctypes.c_int, ptr]  # fmt: skip
        fn.restype = None
        for kc, rows, acc, scaled in ((1, mr, 0, 0), (37, 1, 1, 1), (130, mr - 1, 0, 1),
                                      (64, 2, 1, 0)):  # fmt: skip
            ks, ldb, ldc = mr + 9, w + 7, w + 5
            a = rng.standard_normal((kc, ks)).astype(np.float32)
            b = rng.standard_normal((kc, ldb)).astype(np.float32)
            c = np.full((mr + 1, ldc), 0.25, np.float32)
            scale = rng.uniform(0.5, 2.0, mr).astype(np.float32)
            before = c.copy()
            fn(
                kc,
                _ptr(a),
                ks,
                _ptr(b),
                ldb,
                _ptr(c),
                ldc,
                rows,
                acc,
                _ptr(scale) if scaled else None,
            )
            want = a[:, :rows].T.astype(np.float64) @ b[:, :w].astype(np.float64)
            if acc:
                want += before[:rows, :w]
            if scaled:
                want *= scale[:rows, None]
            np.testing.assert_allclose(c[:rows, :w], want, rtol=1e-5, atol=1e-5 * np.sqrt(kc))
            assert np.array_equal(c[rows:], before[rows:]) and np.array_equal(
                c[:, w:], before[:, w:]
            )


_EXP_KERNELS = [k for k in KERNELS if k.scores_exp is not None]


@pytest.mark.parametrize("kernel", _EXP_KERNELS, ids=_ids)
def test_scores_exponentials_are_accurate_and_their_sums_exact(
    kernel: MicroKernel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`<name>_exp2_rows` (what `scores_exp` runs beside op1's FMAs) on every kind of value:
    2^(x - shift) within 5.4e-7 relative (4.5 float32 ulps) wherever it is a normal float,
    below 2^-126 never above it, 0 for x <= shift - 152 and -inf, NaN for NaN; and each
    column's sum exactly the float32 sum, row by row, of the exponentials it stored."""
    _runnable(kernel)
    monkeypatch.setenv(config.ENV_CACHE_DIR, str(tmp_path))
    name, nr = kernel.name, kernel.nr
    assert kernel.scores_exp is not None
    source = f"""#include <immintrin.h>
#include <math.h>
{kernel.scores_exp(kernel)}
void run_exp2_rows(float* p, int rows, const float* shift, float* sum)
{{
    {name}_exp2_rows(p, rows, shift, sum);
}}
"""
    lib = load(build(source, f"test_exp_{name}", kernel.cflags).path)
    ptr = ctypes.c_void_p
    lib.run_exp2_rows.argtypes = [ptr, ctypes.c_int, ptr, ptr]
    lib.run_exp2_rows.restype = None
    rng = np.random.default_rng(7)
    # every column its own shift (any float: subtracted first), and below it a dense sweep of
    # v = x - shift from 8 above (a lazily kept shift) to far below the smallest subnormal
    shift = rng.uniform(-60, 60, nr).astype(np.float32)
    shift[:3] = (0.0, 1e6, -3.5)
    v = np.concatenate([np.linspace(-160.0, 8.0, 60_000), rng.uniform(-2, 0.5, 12_000)])
    rows = -(-v.size // nr)
    x = (np.resize(v, rows * nr).reshape(rows, nr) + shift).astype(np.float32)
    x[0, :4] = (-np.inf, np.nan, shift[2] - 152.0, shift[3] - 151.0)
    p = x.copy()
    total = np.full(nr, 0.5, np.float32)  # (sums are added to what is there)
    lib.run_exp2_rows(_ptr(p), rows, _ptr(shift), _ptr(total))
    exact = np.exp2((x - shift).astype(np.float64))  # the kernel's v: x - shift in float32
    normal, tiny = exact >= 2.0**-126, exact < 2.0**-126  # (neither: the NaN)
    rel = np.abs(p[normal] / exact[normal] - 1.0)
    assert rel.max() <= 5.4e-7, f"{name}: 2^v off by {rel.max():.3g} relative"
    assert (p[tiny] <= 2.0**-126).all() and (p[tiny] >= 0).all()
    assert (p[(x - shift) <= -152] == 0).all() and p[0, 0] == 0 and p[0, 2] == 0
    assert np.isnan(p[0, 1]) and np.isnan(total[1])
    want = np.full(nr, 0.5, np.float32)
    for row in p:  # the kernel's order: row after row, each add rounded to float32
        want = want + row
    assert np.array_equal(total, want, equal_nan=True)


def test_calibration_of_the_hosts_kernel_is_a_valid_entry() -> None:
    """`python -m chainfuse.bench.microkernel --calibrate` on this host's fp32 kernel: shares
    that never fall as calls lengthen and reach 1, a packing cost, and a split-head share only
    for a kernel with wide blocks (the figures themselves are the bench's, docs/tuning.md)."""
    from chainfuse.bench import microkernel

    here = Hardware.detect()
    kernel = select(Problem(DType.FLOAT32, 4096, 4096, 256), here)
    entry = microkernel.calibrate(kernel, seconds=0.002, repeat=2)
    shares = [share for _, share in entry.reduction]
    assert [s for s, _ in entry.reduction] == list(microkernel.CALIBRATION_STEPS)
    assert shares == sorted(shares) and shares[-1] == 1.0 and entry.pack_flops > 0
    assert 0 < entry.split_head <= 1
    if kernel.wide is None:
        assert entry.split_head == 1.0 and microkernel.split_head(kernel) is None
