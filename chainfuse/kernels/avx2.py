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

__all__ = ["AVX2", "avx2_fma_6x16_f32"]

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
)


@microkernel(
    name="avx2_fma_6x16_f32",
    isa=frozenset({Isa.AVX2, Isa.FMA}),
    dtypes=(DType.FLOAT32,),
    mr=6,
    nr=16,
    registers=6 * 2 + 2 + 1,
    flops_per_instruction=2 * 8,
    cflags=("-mavx2", "-mfma"),
)
def avx2_fma_6x16_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, AVX2)
