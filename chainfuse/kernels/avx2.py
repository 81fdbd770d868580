"""The AVX2 + FMA micro-kernel: a 6x16 float32 block, 12 ymm accumulators.

Per k step: 2 loads of Bp (16 floats), 6 broadcasts of Ap, 12 ``_mm256_fmadd_ps``. Registers:
12 accumulators + 2 B vectors + 1 broadcast = 15 of the 16 ymm, the classic BLIS/OpenBLAS
Haswell shape. 12 independent FMA chains cover the FMA latency (4-5 cycles) times two FMA pipes,
and 8 loads per 12 FMAs stay below the two load ports.
"""

from __future__ import annotations

import struct

from chainfuse.hardware import Isa
from chainfuse.ir import DType
from chainfuse.kernels.contract import MicroKernel
from chainfuse.kernels.registry import microkernel
from chainfuse.kernels.vector import VectorOps, emit_vector_tile

__all__ = ["AVX2", "avx2_exp2_strip", "avx2_fma_6x16_f32", "avx2_transpose8"]

AVX2 = VectorOps(
    type="__m256",
    lanes=8,
    preamble="#include <immintrin.h>\n",
    zero="_mm256_setzero_ps()",
    load="_mm256_loadu_ps({ptr})",
    store="_mm256_storeu_ps({ptr}, {v})",
    broadcast="_mm256_broadcast_ss({ptr})",
    fma="_mm256_fmadd_ps({a}, {b}, {c})",
    add="_mm256_add_ps({a}, {b})",
    relu="_mm256_max_ps(_mm256_setzero_ps(), {v})",  # (maxps gives its second operand on NaN: v)
)


def avx2_transpose8(kernel: MicroKernel) -> str:
    """``<name>_transpose``: an 8x8 float block through registers (8 half-row loads, 8 half-row
    inserts, 16 in-lane shuffles, 8 stores), and ``<name>_transpose_scaled``, the same with output
    row ``j`` times ``scale[j]`` (8 more multiplies).

    Rows go in as 128-bit halves, row ``i`` and row ``i + 4`` side by side, so no shuffle crosses
    the 128-bit lanes (the usual last step, four ``vperm2f128`` pairs, is 8 uops each on some
    cores)."""
    name = kernel.name
    # row i's 4-float halves: r{i} holds row i's first half and row i+4's; r{i+4} their second
    # halves, so that the in-lane 4x4 transposes below leave whole columns in each register
    loads = "\n".join(
        f"    const __m256 r{i + 4 * h} = _mm256_insertf128_ps(_mm256_castps128_ps256("
        f"_mm_loadu_ps(src + {i} * lds + {4 * h})), _mm_loadu_ps(src + {i + 4} * lds + {4 * h}), 1);"
        for h in range(2)
        for i in range(4)
    )
    shuffles = """\
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1);
    const __m256 t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3);
    const __m256 t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5);
    const __m256 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);"""
    rows = [f"u{j}" for j in range(8)]
    plain = "\n".join(
        f"    _mm256_storeu_ps(dst + {j} * ldd, {row});" for j, row in enumerate(rows)
    )
    scaled = "\n".join(
        f"    _mm256_storeu_ps(dst + {j} * ldd, _mm256_mul_ps({row}, _mm256_broadcast_ss(scale + {j})));"
        for j, row in enumerate(rows)
    )
    pad = " " * (len(name) + 31)
    return f"""
/* {name}_transpose: dst[j*ldd + i] = src[i*lds + j], i, j < 8 */
static inline void {name}_transpose(const float* restrict src, long lds, float* restrict dst,
{pad}long ldd)
{{
{loads}
{shuffles}
{plain}
}}

/* {name}_transpose_scaled: dst[j*ldd + i] = src[i*lds + j] * scale[j], i, j < 8 */
static inline void {name}_transpose_scaled(const float* restrict src, long lds,
{pad}       float* restrict dst, long ldd,
{pad}       const float* restrict scale)
{{
{loads}
{shuffles}
{scaled}
}}
"""


def _exp2_eighths() -> str:
    """`2^(k/8)`, k = 0..7, for `avx2_exp2_strip`'s table: each as its float32 bits (rounded to
    nearest) less 1.0's and less `k << 20`, the low bits the shifter leaves above the index."""
    bits = [struct.unpack("<I", struct.pack("<f", 2.0 ** (k / 8)))[0] for k in range(8)]
    return ", ".join(str(b - 0x3F800000 - (k << 20)) for k, b in enumerate(bits))


def avx2_exp2_strip(kernel: MicroKernel) -> str:
    """``cf_exp2_strip(p, rows, shift, sum)``: a softmax strip's exponentials ``2^(v - shift)``
    on rows of 16 columns (two vectors), summed by column, for shifts that are integers below
    2^21 in magnitude. The shifter rounds to eighths: its low three bits pick ``2^(k/8)`` from a
    table in a register (vpermd), the rest scale it by ``2^n``, and the remainder in [-1/16,
    1/16] takes a cubic (1.4e-7 relative error): four FMA-unit operations a vector, not seven.
    v = s gives 1 exactly, v <= s - 127 and -inf 0 exactly, NaN stays NaN."""
    return _EXP2_STRIP.replace("EIGHTHS", _exp2_eighths())


_EXP2_STRIP = r"""
static inline void cf_exp2_strip(float* restrict p, int rows, const float* restrict shift,
                                 float* restrict sum)
{
    const __m256i tab = _mm256_setr_epi32(EIGHTHS);
    const __m256 c1 = _mm256_set1_ps(6.931472421e-1f), c2 = _mm256_set1_ps(2.402576357e-1f);
    const __m256 c3 = _mm256_set1_ps(5.549622327e-2f);
    const __m256 s0 = _mm256_loadu_ps(shift), s1 = _mm256_loadu_ps(shift + 8);
    const __m256 big = _mm256_set1_ps(1572991.0f), below = _mm256_set1_ps(127.0f);
    const __m256 k0 = _mm256_sub_ps(big, s0), k1 = _mm256_sub_ps(big, s1);
    const __m256 lo0 = _mm256_sub_ps(s0, below), lo1 = _mm256_sub_ps(s1, below);
    __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();
    for (int r = 0; r < rows; ++r) {
        float* restrict row = p + (long)r * 16;
        const __m256 x0 = _mm256_max_ps(lo0, _mm256_loadu_ps(row)); /* (NaN: the second) */
        const __m256 x1 = _mm256_max_ps(lo1, _mm256_loadu_ps(row + 8));
        const __m256 t0 = _mm256_add_ps(x0, k0), t1 = _mm256_add_ps(x1, k1);
        const __m256 r0 = _mm256_sub_ps(x0, _mm256_sub_ps(t0, k0));
        const __m256 r1 = _mm256_sub_ps(x1, _mm256_sub_ps(t1, k1));
        const __m256i i0 = _mm256_castps_si256(t0), i1 = _mm256_castps_si256(t1);
        const __m256 T0 = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_permutevar8x32_epi32(tab, i0), _mm256_slli_epi32(i0, 20)));
        const __m256 T1 = _mm256_castsi256_ps(
            _mm256_add_epi32(_mm256_permutevar8x32_epi32(tab, i1), _mm256_slli_epi32(i1, 20)));
        const __m256 q0 = _mm256_fmadd_ps(_mm256_fmadd_ps(c3, r0, c2), r0, c1);
        const __m256 q1 = _mm256_fmadd_ps(_mm256_fmadd_ps(c3, r1, c2), r1, c1);
        const __m256 e0 = _mm256_fmadd_ps(q0, _mm256_mul_ps(r0, T0), T0);
        const __m256 e1 = _mm256_fmadd_ps(q1, _mm256_mul_ps(r1, T1), T1);
        _mm256_storeu_ps(row, e0);
        _mm256_storeu_ps(row + 8, e1);
        sum0 = _mm256_add_ps(sum0, e0);
        sum1 = _mm256_add_ps(sum1, e1);
    }
    float part[16];
    _mm256_storeu_ps(part, sum0);
    _mm256_storeu_ps(part + 8, sum1);
    for (int i = 0; i < 16; ++i) sum[i] += part[i];
}
"""


@microkernel(
    name="avx2_fma_6x16_f32",
    isa=frozenset({Isa.AVX2, Isa.FMA}),
    dtypes=(DType.FLOAT32,),
    mr=6,
    nr=16,
    registers=6 * 2 + 2 + 1,
    flops_per_instruction=2 * 8,
    # 256-bit vectors for the loops gcc vectorises too (the softmax's): some -march tunings
    # pick 128-bit ones, and 16 xmm registers spill there
    cflags=("-mavx2", "-mfma", "-mprefer-vector-width=256"),
    transpose=avx2_transpose8,
    transpose_block=8,
    part_rows=4,
    part_cols=8,  # a tail strip of up to 8 columns: one vector of FMAs, not two
    exp2_strip=avx2_exp2_strip,
)
def avx2_fma_6x16_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, AVX2)
