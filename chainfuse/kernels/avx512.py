"""The AVX-512 micro-kernel: a 6x64 float32 block, 24 zmm accumulators.

Why 6x64 rather than 14x32 (both keep >= 12 accumulators, enough to cover 4-cycle FMA latency on
two pipes 3x over):

- nr = 64 is one attention/MLP head (the paper's workloads have N = 64, or 80): the second GEMM of
  a chain (P·V) covers the whole head in one register block, so each row of P is broadcast once
  and never re-streamed for a second column block;
- 24 accumulators + 4 B vectors + 1 broadcast = 29 of the 32 zmm: no spills, with room for the
  compiler; per k step 4 B loads + 6 broadcasts feed 24 FMAs, well under two loads per cycle;
- a 6x64 block, compiled by gcc at run time, already matched PyTorch (MKL) on these batched GEMMs
  on the reference machine (see DESIGN.md).

An N tail (e.g. N = 208 = 3 x 64 + 16) runs a narrow block of 16, 32 or 48 columns
(``part_cols``): 1-3 vectors of FMAs per row, not 4. Where N is below one block the generated
code's strips stay 64 wide (a softmax over 64 columns for 32 queries), and `select`'s score
prefers 12x32 there (attention over 32 queries: 0.044 ms against 0.068 ms with 6x64).
"""

from __future__ import annotations

from chainfuse.hardware import Isa
from chainfuse.ir import DType
from chainfuse.kernels.avx2 import avx2_transpose8
from chainfuse.kernels.base import MicroKernel, VectorOps, emit_vector_tile, microkernel

__all__ = ["AVX512", "avx512_6x64_f32", "avx512_12x32_f32"]

AVX512 = VectorOps(
    type="__m512",
    lanes=16,
    preamble="#include <immintrin.h>\n",
    zero="_mm512_setzero_ps()",
    load="_mm512_loadu_ps({ptr})",
    store="_mm512_storeu_ps({ptr}, {v})",
    broadcast="_mm512_set1_ps(*({ptr}))",  # one vbroadcastss from memory (load port, no ALU)
    fma="_mm512_fmadd_ps({a}, {b}, {c})",
    add="_mm512_add_ps({a}, {b})",
    relu="_mm512_max_ps({v}, _mm512_setzero_ps())",  # (maxps returns its second operand on NaN)
)


@microkernel(
    name="avx512_6x64_f32",
    isa=frozenset({Isa.AVX512F, Isa.FMA}),
    dtypes=(DType.FLOAT32,),
    mr=6,
    nr=64,
    registers=6 * 4 + 4 + 1,
    flops_per_instruction=2 * 16,
    cflags=("-mavx512f", "-mfma", "-mprefer-vector-width=512"),
    transpose=avx2_transpose8,  # (AVX-512F implies AVX2: the 8x8 ymm transposes serve here too)
    transpose_block=8,
    part_rows=4,
    part_cols=16,  # a tail strip of 16, 32 or 48 columns: 1-3 vectors of FMAs, not 4
)
def avx512_6x64_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, AVX512)


@microkernel(
    name="avx512_12x32_f32",
    isa=frozenset({Isa.AVX512F, Isa.FMA}),
    dtypes=(DType.FLOAT32,),
    mr=12,
    nr=32,
    registers=12 * 2 + 2 + 1,
    flops_per_instruction=2 * 16,
    cflags=("-mavx512f", "-mfma", "-mprefer-vector-width=512"),
    transpose=avx2_transpose8,
    transpose_block=8,
    part_rows=6,
    part_cols=16,
)
def avx512_12x32_f32(kernel: MicroKernel) -> str:
    return emit_vector_tile(kernel, AVX512)
