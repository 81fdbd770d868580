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
from chainfuse.kernels.base import (
    EXP2_CUBIC,
    MicroKernel,
    VectorOps,
    emit_vector_tile,
    exp2_eighths,
    microkernel,
)

__all__ = ["AVX512", "avx512_6x64_f32", "avx512_12x32_f32", "avx512_scores_exp"]

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


def avx512_scores_exp(kernel: MicroKernel) -> str:
    """C of ``<name>_scores_exp`` and ``<name>_exp2_rows`` (`MicroKernel.scores_exp`).

    The exponentials are the AVX2 strip's (`codegen.c`): v = x - shift, then the shifter rounds
    v to eighths, an eight-entry table in a register (vpermd) and the exponent bits make
    T = 2^(n + k/8), and 2^r = 1 + r q(r) on the remainder (`EXP2_CUBIC`): four FMA-unit
    operations a vector and eight on the other pipes (max, adds, the integer shift and add, the
    permute), which an FMA-bound loop leaves idle. One vector every second k step: on Zen 4 (1
    thread, interleaved, against the strip's own pass after op1) the 12 paper attentions took
    0.964-0.986 of the time; a first version spaced them three every eighth step (bert-base,
    mixer-b-32-s, vit-huge-14: 1.00-1.01 where every second step gave 0.968-0.981) or one every
    third (0.974-0.995). The shift is any float (subtracted first), so one column's huge maximum
    does not hold the others to exact shifts.
    """
    name, mr, nr = kernel.name, kernel.mr, kernel.nr
    vectors = nr // 16
    if nr % 16 or mr * vectors + vectors + 1 > 32:
        raise ValueError(
            f"{name}: scores_exp wants whole zmm vectors a row and its mr x nr/16 accumulators,"
            f" B vectors and broadcast in the 32 registers (mr={mr}, nr={nr})"
        )
    acc = [[f"c{r}_{v}" for v in range(vectors)] for r in range(mr)]
    zero = "\n".join(
        "    __m512 " + ", ".join(f"{c} = _mm512_setzero_ps()" for c in row) + ";" for row in acc
    )
    rows = "\n".join(f"    const float* restrict r{r} = A + {r} * rs;" for r in range(mr))
    loads = "\n".join(
        f"        const __m512 b{v} = _mm512_loadu_ps(b + {16 * v});" for v in range(vectors)
    )
    fmas = "\n".join(
        f"        const __m512 a{r} = _mm512_set1_ps(*(r{r} + o));\n"
        + "\n".join(f"        {c} = _mm512_fmadd_ps(a{r}, b{v}, {c});" for v, c in enumerate(row))
        for r, row in enumerate(acc)
    )
    stores = "\n".join(
        f"    _mm512_storeu_ps(C + {r * nr + 16 * v}, {acc[r][v]});"
        for r in range(mr)
        for v in range(vectors)
    )
    maxima = "\n".join(
        "    m = _mm512_set1_ps(-INFINITY);\n"
        + "".join(f"    m = _mm512_max_ps({acc[r][v]}, m);\n" for r in range(mr))
        + f"    m = _mm512_max_ps(m, _mm512_loadu_ps(run + {16 * v}));\n"
        + f"    _mm512_storeu_ps(run + {16 * v}, m);\n"
        + f"    passed |= _mm512_cmp_ps_mask(m, _mm512_loadu_ps(gate + {16 * v}), _CMP_GT_OQ);"
        for v in range(vectors)
    )
    c1, c2, c3 = EXP2_CUBIC
    eighths = exp2_eighths()
    return f"""
/* {name}_exp2_vec: the 16 scores at x replaced by 2^(x - shift) (shift: their columns'), added
   to sum; x <= shift - 127 (and -inf) give 0, NaN stays NaN (the max passes it on) */
static inline __attribute__((always_inline)) void {name}_exp2_vec(float* restrict x,
    const float* restrict shift, float* restrict sum)
{{
    const __m512 big = _mm512_set1_ps(1572991.0f); /* 0x1.8p20 + 127: rounds to eighths */
    const __m512 v = _mm512_max_ps(_mm512_set1_ps(-127.0f),
                                   _mm512_sub_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(shift)));
    const __m512 t = _mm512_add_ps(v, big);
    const __m512 r = _mm512_sub_ps(v, _mm512_sub_ps(t, big));
    const __m512i i = _mm512_castps_si512(t);
    const __m512i tab = _mm512_setr_epi32({eighths}, {eighths});
    const __m512 T = _mm512_castsi512_ps(
        _mm512_add_epi32(_mm512_permutexvar_epi32(i, tab), _mm512_slli_epi32(i, 20)));
    const __m512 q = _mm512_fmadd_ps(
        _mm512_fmadd_ps(_mm512_set1_ps({c3}), r, _mm512_set1_ps({c2})), r, _mm512_set1_ps({c1}));
    const __m512 e = _mm512_fmadd_ps(q, _mm512_mul_ps(r, T), T);
    _mm512_storeu_ps(x, e);
    _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), e));
}}

/* {name}_scores_exp: C[0:{mr}, 0:{nr}] = A . Bp (rows {nr} apart), the `rows` rows of {nr} at
   ep exponentiated on the way (exp2_vec, a vector every second k step), and the block's column
   maxima taken into run (NaN passed over); whether any column's passed its gate */
static inline __attribute__((always_inline)) int {name}_scores_exp(int kc,
    const float* restrict A, long rs, long ks, const float* restrict Bp, float* restrict C,
    float* restrict ep, int rows, const float* restrict shift, float* restrict sum,
    float* restrict run, const float* restrict gate)
{{
    const unsigned nexp = (unsigned)rows * {vectors}u;
{zero}
{rows}
    unsigned e = 0;
    int wait = 2;
#pragma GCC unroll 4
    for (int p = 0; p < kc; ++p) {{
        const long o = (long)p * ks;
        const float* restrict b = Bp + (long)p * {nr};
{loads}
{fmas}
        if (--wait == 0) {{
            wait = 2;
            if (e < nexp) {{
                {name}_exp2_vec(ep + 16 * e, shift + 16 * (e % {vectors}u), sum + 16 * (e % {vectors}u));
                ++e;
            }}
        }}
    }}
    for (; e < nexp; ++e) {{
        {name}_exp2_vec(ep + 16 * e, shift + 16 * (e % {vectors}u), sum + 16 * (e % {vectors}u));
    }}
{stores}
    __m512 m;
    __mmask16 passed = 0;
{maxima}
    return passed != 0;
}}

/* {name}_exp2_rows: whole rows of {nr} scores at p exponentiated, as {name}_scores_exp's */
static inline void {name}_exp2_rows(float* restrict p, int rows, const float* restrict shift,
                                    float* restrict sum)
{{
    for (unsigned e = 0; e < (unsigned)rows * {vectors}u; ++e) {{
        {name}_exp2_vec(p + 16 * e, shift + 16 * (e % {vectors}u), sum + 16 * (e % {vectors}u));
    }}
}}
"""


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
    scores_exp=avx512_scores_exp,
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
