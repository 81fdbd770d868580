"""The C math helpers every generated GEMM-chain kernel includes (`codegen/csrc/math.c`): the
exponentials (the softmax's base-2 one, the one under GELU's erf), the erf and the tanh
(soft-capping's), against float64 numpy/math over their whole domain, built with
the flags of every kernel build (so the vectorised, if-converted code is what is tested); the AVX2
kernels' softmax strip exponentials (`kernels.avx2.avx2_exp2_strip`) and the 16-bit conversions likewise."""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Iterator

import numpy as np
import pytest

from chainfuse import config
from chainfuse.codegen.common import c_source
from chainfuse.hardware import Hardware, Isa
from chainfuse.kernels.avx2 import avx2_exp2_strip, avx2_fma_6x16_f32
from chainfuse.runtime import build, load

HARNESS = (
    c_source("math.c")
    + r"""
void run_exp(const float* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_exp_neg(x[i]);
}

void run_exp2(const float* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_exp2_neg(x[i]);
}

void run_erf(const float* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_erf(x[i]);
}

void run_tanh(const float* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_tanh(x[i]);
}
"""
)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    yield from _harness(tmp_path_factory, HARNESS, "test_cmath", ())


def _harness(
    tmp_path_factory: pytest.TempPathFactory, source: str, name: str, flags: tuple[str, ...]
) -> Iterator[ctypes.CDLL]:
    """`source` built in a cache of its own, its `run_*(in, out, n)` entry points typed."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(config.ENV_CACHE_DIR, str(tmp_path_factory.mktemp(f"{name}-cache")))
        built = load(build(source, name, flags).path)
        for entry in re.findall(r"^void (run_\w+)\(", source, re.MULTILINE):
            fn = getattr(built, entry)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
        yield built


def _apply(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.full_like(x, 12345.0)
    getattr(lib, name)(x.ctypes.data, y.ctypes.data, x.size)
    return y


def test_exp_of_non_positive_arguments(lib: ctypes.CDLL) -> None:
    # every float32 step near 0, a dense sweep, the underflow edge, odd lengths for the tails
    x = np.concatenate([
        -np.linspace(0.0, 1e-3, 1001), -np.linspace(0.0, 100.0, 200_003),
        np.linspace(-88.5, -86.5, 4001), [-0.0, -1e-30, -1e-45],
    ]).astype(np.float32)  # fmt: skip
    got = _apply(lib, "run_exp", x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny * 2
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 2e-7, f"worst relative error {rel.max():.3g} at x={x[normal][rel.argmax()]}"
    tiny = ~normal  # below the smallest normal: 0 or a subnormal, never more than that
    assert np.all((got[tiny] >= 0) & (got[tiny] <= 2 * np.finfo(np.float32).tiny))
    assert np.all(got[x <= -88.0] == 0.0)


def test_exp_special_values(lib: ctypes.CDLL) -> None:
    got = _apply(lib, "run_exp", np.array([-np.inf, np.nan, -1e30, -89.0, 0.0], np.float32))
    assert got[0] == 0.0 and np.isnan(got[1]) and got[2] == 0.0 and got[3] == 0.0
    assert got[4] == 1.0


def test_exp2_of_non_positive_arguments(lib: ctypes.CDLL) -> None:
    # the softmax's exponential (its scores in base 2): every step near 0, a dense sweep, both
    # rounding directions of n (x - n = +-1/2), the subnormal edge
    half = np.arange(0, 127) + 0.5
    x = np.concatenate([
        -np.linspace(0.0, 1e-3, 1001), -np.linspace(0.0, 126.0, 300_007), -half,
        -np.nextafter(half, 0), -np.nextafter(half, 200), [-0.0, -1e-30, -1e-45],
    ]).astype(np.float32)  # fmt: skip
    got = _apply(lib, "run_exp2", x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    normal = want >= np.finfo(np.float32).tiny * 2
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 2.5e-7, (
        f"worst relative error {rel.max():.3g} at x={x[normal][rel.argmax()]}"
    )
    tiny = ~normal
    assert np.all((got[tiny] >= 0) & (got[tiny] <= 2 * np.finfo(np.float32).tiny))


def test_exp2_special_values(lib: ctypes.CDLL) -> None:
    x = np.array([-np.inf, np.nan, -1e30, -127.0, -126.75, 0.0, -1.0, -126.0], np.float32)
    got = _apply(lib, "run_exp2", x)
    assert got[0] == 0.0 and np.isnan(got[1]) and got[2] == 0.0 and got[3] == 0.0
    assert got[4] == 0.0 and got[5] == 1.0 and got[6] == 0.5
    assert got[7] == np.float32(2.0**-126)


def test_erf(lib: ctypes.CDLL) -> None:
    x = np.concatenate([np.linspace(-6, 6, 120_001), [0.0, -0.0, 1e-8, -1e-8]]).astype(np.float32)
    got = _apply(lib, "run_erf", x).astype(np.float64)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert np.abs(got - want).max() < 5e-7
    special = _apply(lib, "run_erf", np.array([np.inf, -np.inf, np.nan], np.float32))
    assert special[0] == 1.0 and special[1] == -1.0 and np.isnan(special[2])


def test_tanh(lib: ctypes.CDLL) -> None:
    """Relative error below 2.5e-7 over the whole range (soft-capping's scores: cap tanh(s/cap)
    is then as exact as the scores), odd, and exact at the branches' seam and the ends."""
    x = np.concatenate([np.linspace(-12, 12, 240_001), np.geomspace(1e-30, 0.7, 20_001),
                        [0.0, 0.625, np.nextafter(np.float32(0.625), np.float32(0)), 9.0, 50.0,
                         1e30]]).astype(np.float32)  # fmt: skip
    got = _apply(lib, "run_tanh", x).astype(np.float64)
    want = np.tanh(x.astype(np.float64))
    nonzero = want != 0.0
    assert (np.abs(got - want)[nonzero] / np.abs(want[nonzero])).max() < 2.5e-7
    assert got[x == 0.0].tolist() == [0.0] * int((x == 0.0).sum())
    assert np.array_equal(_apply(lib, "run_tanh", -x), -got.astype(np.float32))
    special = _apply(lib, "run_tanh", np.array([np.inf, -np.inf, np.nan], np.float32))
    assert special[0] == 1.0 and special[1] == -1.0 and np.isnan(special[2])


STRIP_HARNESS = (
    c_source("math.c")
    + "#include <immintrin.h>\n"
    + avx2_exp2_strip(avx2_fma_6x16_f32)
    + r"""
/* the column shifts the tests use: integers, none and up to 2^20 - 1 in magnitude */
static const float shifts[16] = {0, 1, -1, 37, -300, 1000, -4096, 126, -127, 65536, -65536,
                                 1048575, -1048575, 5, -5, 0};

void run_strip(const float* x, float* y, long n) /* x: n / 16 rows; y: 2^(x - shift) */
{
    float sum[16] = {0};
    for (long i = 0; i < n; ++i) y[i] = x[i];
    cf_exp2_strip(y, (int)(n / 16), shifts, sum);
}

void run_strip_sum(const float* x, float* y, long n) /* y[0:16]: the columns' sums, added */
{
    float sum[16];
    for (int i = 0; i < 16; ++i) sum[i] = 1.0f;
    for (long i = 0; i < n; ++i) y[16 + i] = x[i];
    cf_exp2_strip(y + 16, (int)(n / 16), shifts, sum);
    for (int i = 0; i < 16; ++i) y[i] = sum[i];
}
"""
)
SHIFTS = np.array([0, 1, -1, 37, -300, 1000, -4096, 126, -127, 65536, -65536, 1048575, -1048575,
                   5, -5, 0], np.float64)  # fmt: skip


@pytest.fixture(scope="module")
def strip_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ctypes.CDLL]:
    """`avx2_exp2_strip`, the AVX2 kernels' exponentials of a softmax strip, as they build it."""
    if not {Isa.AVX2, Isa.FMA} <= Hardware.detect().isa:
        pytest.skip("the host has no AVX2 and FMA")
    flags = ("-mavx2", "-mfma")
    yield from _harness(tmp_path_factory, STRIP_HARNESS, "test_exp2_strip", flags)


def _strip_input(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 16 columns, column i the shift of column i plus `d` (<= 0), rounded to float32;
    and 2^(x - shift) in float64 of those floats."""
    x = (SHIFTS[None, :] + d.reshape(-1, 1)).astype(np.float32)
    return x, np.exp2(x.astype(np.float64) - SHIFTS[None, :])


def test_exp2_strip_of_scores_below_their_shifts(strip_lib: ctypes.CDLL) -> None:
    # every column with its own shift (the strip's 16 queries): a dense sweep of x - s down to
    # the underflow edge, both rounding directions at each eighth, the steps near 0: within
    # the portable cf_exp2_from's bound (1.1e-7 measured; a 3 % error in the cubic coefficient
    # gives 4.9e-7), and every result below the smallest normal 0 or a subnormal
    eighths = np.arange(0, 126 * 8) / 8 + 1 / 16
    d = np.concatenate([
        -np.linspace(0.0, 126.0, 100_003), -eighths, -np.nextafter(eighths, 0),
        -np.nextafter(eighths, 200), -np.linspace(0.0, 1e-3, 1001),
    ])  # fmt: skip
    x, want = _strip_input(d)
    got = _apply(strip_lib, "run_strip", x).astype(np.float64)
    normal = want >= np.finfo(np.float32).tiny * 2
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    assert rel.max() < 2.5e-7, f"worst relative error {rel.max():.3g}"
    tiny = ~normal
    assert np.all((got[tiny] >= 0) & (got[tiny] <= 2 * np.finfo(np.float32).tiny))


def test_exp2_strip_special_values_and_sums(strip_lib: ctypes.CDLL) -> None:
    # x = s: 1 exactly; s - 127 and below, -inf: 0 exactly (a masked key weighs nothing); NaN
    # stays NaN; the sums add to what the caller had
    x = np.tile(SHIFTS.astype(np.float32), (5, 1))
    x[1] -= 127
    x[2] = -np.inf
    x[3] = np.nan
    x[4] -= 1e30
    got = _apply(strip_lib, "run_strip", x).reshape(5, 16)
    assert np.all(got[0] == 1.0) and np.all(got[1] == 0.0) and np.all(got[2] == 0.0)
    assert np.all(np.isnan(got[3])) and np.all(got[4] == 0.0)
    d = -np.linspace(0.0, 9.0, 48)
    x, want = _strip_input(d)
    y = np.zeros(16 + x.size, np.float32)
    strip_lib.run_strip_sum(x.ctypes.data, y.ctypes.data, x.size)
    np.testing.assert_allclose(y[:16], 1.0 + want.sum(axis=0), rtol=1e-6)


HALF_HARNESS = (
    "#define MR 6\n#define NR 16\n#define CF_LOAD(x) cf_from_f16(x)\n#define CF_F16 1\n"
    + c_source("half.c")
    + r"""
void run_from_f16(const uint16_t* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_from_f16(x[i]);
}

void run_to_f16(const float* x, uint16_t* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_to_f16(x[i]);
}

void run_from_bf16(const uint16_t* x, float* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_from_bf16(x[i]);
}

void run_widen_f16(const uint16_t* x, float* y, long n)
{
    cf_widen(x, y, n);
}

void run_to_bf16(const float* x, uint16_t* y, long n)
{
    for (long i = 0; i < n; ++i) y[i] = cf_to_bf16(x[i]);
}
"""
)


@pytest.fixture(scope="module", params=["as built", "plain C"])
def half_lib(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ctypes.CDLL]:
    """The conversions as a kernel build compiles them (F16C's instructions where the host has
    them), and the plain C ones that other hosts get (`CF_NO_F16C`)."""
    flags = ("-DCF_NO_F16C",) if request.param == "plain C" else ()
    yield from _harness(tmp_path_factory, HALF_HARNESS, "test_half", flags)


def _convert(lib: ctypes.CDLL, name: str, x: np.ndarray, out: type) -> np.ndarray:
    x = np.ascontiguousarray(x)
    y = np.zeros(x.shape, out)
    getattr(lib, name)(x.ctypes.data, y.ctypes.data, x.size)
    return y


def test_f16_widens_every_bit_pattern_exactly(half_lib: ctypes.CDLL) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = _convert(half_lib, "run_from_f16", bits, np.float32)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0.0 too


def _f32_edges() -> np.ndarray:
    """float32 values around every fp16 rounding decision: each fp16 value, the halfway points
    between neighbours (ties to even) and one float32 step either side of them, fp16's subnormal
    and overflow edges, and random bit patterns of every magnitude."""
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    f16 = f16[np.isfinite(f16)].astype(np.float64)
    f16 = np.unique(f16)
    mid = ((f16[1:] + f16[:-1]) / 2).astype(np.float32)  # exact: fp16 halves fit in float32
    edges = [f16.astype(np.float32), mid, np.nextafter(mid, np.float32(np.inf)),
             np.nextafter(mid, np.float32(-np.inf)),
             np.array([65504, 65519.99, 65520, 65535.9, 65536, 1e9, 2.0**-24, 2.0**-25,
                       2.0**-25 * 1.0000001, 2.0**-26, 1e-30, 0.0], np.float32)]  # fmt: skip
    rng = np.random.default_rng(0)
    edges.append(
        rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    )
    x = np.concatenate(edges).astype(np.float32)
    return np.concatenate([x, -x])


def test_f16_narrows_to_nearest_ties_to_even(half_lib: ctypes.CDLL) -> None:
    x = _f32_edges()
    got = _convert(half_lib, "run_to_f16", x, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    assert np.all(np.isnan(got[nan].view(np.float16)))
    assert np.array_equal(got[~nan], want[~nan].view(np.uint16))
    special = np.array([np.inf, -np.inf, np.nan], np.float32)
    back = _convert(half_lib, "run_to_f16", special, np.uint16).view(np.float16)
    assert back[0] == np.inf and back[1] == -np.inf and np.isnan(back[2])


def test_bf16_round_trips(half_lib: ctypes.CDLL) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    wide = _convert(half_lib, "run_from_bf16", bits, np.float32)
    assert np.array_equal(wide.view(np.uint32), bits.astype(np.uint32) << 16)
    finite = np.isfinite(wide)
    assert np.array_equal(_convert(half_lib, "run_to_bf16", wide[finite], np.uint16), bits[finite])


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 65536])
def test_f16_rows_widen_exactly(half_lib: ctypes.CDLL, n: int) -> None:
    # eight at a time (F16C) and the tail one by one: every bit pattern, odd lengths
    bits = np.arange(1 << 16, dtype=np.uint16)[:n]
    got = _convert(half_lib, "run_widen_f16", bits, np.float32)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
