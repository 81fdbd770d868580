"""The AVX2 + FMA micro-kernel: a 6x16 float32 block, 12 ymm accumulators.

Per k step: 2 loads of Bp (16 floats), 6 broadcasts of Ap, 12 ``_mm256_fmadd_ps``. Registers:
12 accumulators + 2 B vectors + 1 broadcast = 15 of the 16 ymm, the classic BLIS/OpenBLAS
Haswell shape. 12 independent FMA chains cover the FMA latency (4-5 cycles) times two FMA pipes,
and 8 loads per 12 FMAs stay below the two load ports.
"""

from __future__ import annotations

from chainfuse.hardware import Isa
from chainfuse.ir import DType
from chainfuse.kernels.base import MicroKernel, VectorOps, emit_vector_tile, microkernel

__all__ = ["AVX2", "avx2_fma_6x16_f32", "avx2_transpose8"]

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
    relu="_mm256_max_ps({v}, _mm256_setzero_ps())",  # (maxps returns its second operand on NaN)
)


def avx2_transpose8(kernel: MicroKernel) -> str:
    """``<name>_transpose``: an 8x8 float block through registers (8 half-row loads, 8 half-row
    inserts, 16 in-lane shuffles, 8 stores), and ``<name>_transpose_scaled``, the same with output
    row ``j`` times ``scale[j]`` (8 more multiplies).

    Rows go in as 128-bit halves, row ``i`` and row ``i + 4`` side by side, so no shuffle crosses
    the 128-bit lanes: the usual last step, four ``vperm2f128`` pairs, is 8 uops each on Zen 1
    (measured there on an L1-resident block: 11.7-13.7 ns against 13.1-14.2 ns)."""
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


@microkernel(
    name="avx2_fma_6x16_f32",
    isa=frozenset({Isa.AVX2, Isa.FMA}),
    dtypes=(DType.FLOAT32,),
    mr=6,
    nr=16,
    registers=6 * 2 + 2 + 1,
    flops_per_instruction=2 * 8,
    # 256-bit vectors for the loops gcc vectorises too (the softmax's): its Zen 1 tuning picks
    # 128-bit ones, and 16 xmm registers spill there (attention 0.97-0.99 of the time)
    cflags=("-mavx2", "-mfma", "-mprefer-vector-width=256"),
    transpose=avx2_transpose8,
    transpose_block=8,
    part_rows=4,
    part_cols=8,  # a tail strip of up to 8 columns: one vector of FMAs, not two
)
def avx2_fma_6x16_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, AVX2)
