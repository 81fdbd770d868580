"""The AVX-512 micro-kernel: a 6x64 float32 block, 24 zmm accumulators.

Why 6x64 rather than 14x32 (both keep >= 12 accumulators, enough to cover 4-cycle FMA latency on
two pipes 3x over):

- nr = 64 is one attention/MLP head (the paper's workloads have N = 64, or 80): the second GEMM of
  a chain (P·V) covers the whole head in one register block, so each row of P is broadcast once
  and never re-streamed for a second column block (a head of 80 or 96, or of 64 whose rows are
  not dense, takes the wide blocks: 4 rows of the whole head, `avx512_wide`);
- 24 accumulators + 4 B vectors + 1 broadcast = 29 of the 32 zmm: no spills, with room for the
  compiler; per k step 4 B loads + 6 broadcasts feed 24 FMAs, well under two loads per cycle;
- a 6x64 block, compiled by gcc at run time, already matched PyTorch (MKL) on these batched GEMMs
  on the reference machine (see docs/design.md).

An N tail (e.g. N = 208 = 3 x 64 + 16) runs a narrow block of 16, 32 or 48 columns
(``part_cols``): 1-3 vectors of FMAs per row, not 4. Where N is below one block the generated
code's strips stay 64 wide (a softmax over 64 columns for 32 queries), and `select`'s score
prefers 12x32 there.
"""

from __future__ import annotations

import struct

from chainfuse.hardware import Isa
from chainfuse.ir import DType
from chainfuse.kernels.avx2 import avx2_transpose8
from chainfuse.kernels.contract import MicroKernel, scores_exp_parts
from chainfuse.kernels.registry import microkernel
from chainfuse.kernels.vector import VectorOps, emit_vector_tile

__all__ = [
    "AVX512",
    "EXP2_SIXTEENTHS",
    "avx512_6x64_f32",
    "avx512_12x32_f32",
    "avx512_scores_exp",
    "avx512_wide",
    "exp2_sixteenths",
]

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
    relu="_mm512_max_ps(_mm512_setzero_ps(), {v})",  # (maxps gives its second operand on NaN: v)
)


#: 2^r = c0 + r (c1 + r c2) on r in [-1/32, 1/32] (least squares on Chebyshev nodes, reweighted
#: towards the minimax relative error); folded into a sixteenths table (`exp2_sixteenths`), 2^v
#: is 5.4e-7 off at most, relative, in two FMA-unit operations a vector (docs/tuning.md)
EXP2_SIXTEENTHS = (1.0000000068776311, 0.6931878317649445, 0.24021946551485635)


def exp2_sixteenths(degree: int) -> str:
    """C initialiser of the folded table of `EXP2_SIXTEENTHS`' coefficient `degree`:
    2^(j/16) c_degree, j = 0..15, each rounded to float32 (vpermps reads it by the low four bits
    of the shifter's sum, (16 v) mod 16 rounded)."""
    c = EXP2_SIXTEENTHS[degree]
    single = (struct.unpack("<f", struct.pack("<f", 2.0 ** (j / 16) * c))[0] for j in range(16))
    return ", ".join(f"{x!r}f" for x in single)  # (the float32 values, exact as doubles)


def _register_block(what: str, rows: int, width: int, detail: str) -> tuple[list[list[str]], str]:
    """The accumulators of a `rows` x `width` block (their names, row by row, and the C that
    zeroes them), whole zmm vectors a row; with a B vector per column of vectors and the
    broadcast they must fit the 32 registers, else a ValueError names `what` and `detail`."""
    vectors = width // 16
    if width % 16 or rows * vectors + vectors + 1 > 32:
        raise ValueError(
            f"{what} wants whole zmm vectors a row and its {rows} x {width}/16 accumulators,"
            f" B vectors and broadcast in the 32 registers ({detail})"
        )
    acc = [[f"c{r}_{v}" for v in range(vectors)] for r in range(rows)]
    zero = "\n".join(
        "    __m512 " + ", ".join(f"{c} = _mm512_setzero_ps()" for c in row) + ";" for row in acc
    )
    return acc, zero


def _scores_exp_block(name: str, mr: int, rows: int, nr: int) -> str:
    """C of ``<name>_scores_exp`` (``rows == mr``) or ``<name>_scores_exp_part<rows>`` (fewer,
    with ``live``: the rows of A that exist, those past them reading its last)."""
    vectors = nr // 16
    acc, zero = _register_block(f"{name}: scores_exp", rows, nr, f"mr={mr}, nr={nr}")
    part = rows < mr
    fn = f"{name}_scores_exp_part{rows}" if part else f"{name}_scores_exp"
    row_ptrs = "\n".join(
        f"    const float* restrict r{r} = A + "
        + (f"(live > {r} ? {r} : live - 1) * rs;" if part and r > 0 else f"{r} * rs;")
        for r in range(rows)
    )
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
        for r in range(rows)
        for v in range(vectors)
    )
    if part:
        head = (
            f"/* {fn}: {name}_scores_exp on a short block: A's first `live` <= {rows} rows"
            " (the rows\n   past them read its last, and C's rows past `live` repeat that one) */"
        )
        live = ", int live"
    else:
        head = (
            f"/* {fn}: C[0:{rows}, 0:{nr}] = A . Bp (rows {nr} apart), and the `rows` rows of"
            f" {nr} at\n   ep exponentiated on the way (exp2_vec, a vector every second k step) */"
        )
        live = ""
    step = (
        f"{name}_exp2_vec(ep + 16 * e, shift + 16 * (e % {vectors}u), sum + 16 * (e % {vectors}u));"
    )
    return f"""
{head}
static inline __attribute__((always_inline)) void {fn}(int kc,
    const float* restrict A, long rs, long ks, const float* restrict Bp, float* restrict C,
    float* restrict ep, int rows, const float* restrict shift, float* restrict sum{live})
{{
    const unsigned nexp = (unsigned)rows * {vectors}u;
{zero}
{row_ptrs}
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
                {step}
                ++e;
            }}
        }}
    }}
    for (; e < nexp; ++e) {{
        {step}
    }}
{stores}
}}
"""


def avx512_scores_exp(kernel: MicroKernel) -> str:
    """C of ``<name>_scores_exp`` and ``<name>_exp2_rows`` (`MicroKernel.scores_exp`).

    The exponentials: v = x - shift, the shifter rounds v to sixteenths k = n + j/16, and 2^v =
    2^n p_j(v - k), p_j the quadratic of `EXP2_SIXTEENTHS` times 2^(j/16) (its three
    coefficients read from 16-entry tables by vpermps), 2^n by vscalefps. Two FMA-unit
    operations a vector (the quadratic's); the max, adds, permutes and the scalef run on the other
    pipes, which an FMA-bound loop leaves idle; no compare zeroes what lies far below the shift
    (the clamp at -152 does). One vector every second k step. The shift is any float (subtracted
    first), so one column's huge maximum does not hold the others to exact shifts.
    """
    name, mr, nr = kernel.name, kernel.mr, kernel.nr
    vectors = nr // 16
    tables = "\n".join(
        f"static const float {name}_exp2_a{d}[16] __attribute__((aligned(64))) = {{\n"
        f"    {exp2_sixteenths(d)}}};"
        for d in range(3)
    )
    a = [f"_mm512_permutexvar_ps(j, _mm512_load_ps({name}_exp2_a{d}))" for d in range(3)]
    rows = (*scores_exp_parts(mr), mr)
    blocks = "".join(_scores_exp_block(name, mr, r, nr) for r in rows)
    return f"""
/* {name}_exp2_vec's tables: 2^(j/16) times the quadratic's coefficients (EXP2_SIXTEENTHS) */
{tables}

/* {name}_exp2_vec: the 16 scores at x replaced by 2^(x - shift) (shift: their columns'), added
   to sum; x <= shift - 152 (and -inf) give 0 (2^-152 p rounds to it), x above that and below
   shift - 126 subnormals; NaN stays NaN (the max passes it on) */
static inline __attribute__((always_inline)) void {name}_exp2_vec(float* restrict x,
    const float* restrict shift, float* restrict sum)
{{
    const __m512 big = _mm512_set1_ps(786432.0f); /* 0x1.8p19: rounds to sixteenths */
    const __m512 v = _mm512_max_ps(_mm512_set1_ps(-152.0f),
                                   _mm512_sub_ps(_mm512_loadu_ps(x), _mm512_loadu_ps(shift)));
    const __m512 t = _mm512_add_ps(v, big);
    const __m512 k = _mm512_sub_ps(t, big);
    const __m512 r = _mm512_sub_ps(v, k);
    const __m512i j = _mm512_castps_si512(t); /* its low four bits: (16 k) mod 16 */
    const __m512 p = _mm512_fmadd_ps(_mm512_fmadd_ps({a[2]}, r, {a[1]}), r, {a[0]});
    const __m512 e = _mm512_scalef_ps(p, k); /* p 2^floor(k) */
    _mm512_storeu_ps(x, e);
    _mm512_storeu_ps(sum, _mm512_add_ps(_mm512_loadu_ps(sum), e));
}}
{blocks}
/* {name}_exp2_rows: whole rows of {nr} scores at p exponentiated, as {name}_scores_exp's */
static inline void {name}_exp2_rows(float* restrict p, int rows, const float* restrict shift,
                                    float* restrict sum)
{{
    for (unsigned e = 0; e < (unsigned)rows * {vectors}u; ++e) {{
        {name}_exp2_vec(p + 16 * e, shift + 16 * (e % {vectors}u), sum + 16 * (e % {vectors}u));
    }}
}}
"""


def avx512_wide(kernel: MicroKernel) -> str:
    """C of ``<name>_wide<w>`` for each ``w`` of ``kernel.wide_cols`` (`MicroKernel.wide`):
    ``wide_mr`` rows of a whole value head of ``w`` columns (d = 64, 80 or 96: 4-6 vectors),
    ``wide_mr x w/16`` accumulators, ``w/16`` B vectors and the broadcast in the 32 registers.
    (A head of 64 dense columns takes the 6x64 block, V's rows being its packed layout; one
    whose rows lie further apart, V a view of a fused QKV array, takes this one.)

    Each B vector is pinned to its register by an empty asm: left to itself gcc 12 folds the
    loads into the FMAs as memory operands, one zmm load an FMA, well below the FMA peak.
    """
    name, rows = kernel.name, kernel.wide_mr
    out = []
    for width in kernel.wide_cols:
        vectors = width // 16
        acc, zero = _register_block(f"{name}: a wide block", rows, width, f"width {width}")
        loads = "\n".join(
            f'        __m512 b{v} = _mm512_loadu_ps(b + {16 * v}); __asm__("" : "+v"(b{v}));'
            for v in range(vectors)
        )
        fmas = "\n".join(
            f"        {{\n            const __m512 a{r} = _mm512_set1_ps(a[{r}]);\n"
            + "\n".join(
                f"            {acc[r][v]} = _mm512_fmadd_ps(a{r}, b{v}, {acc[r][v]});"
                for v in range(vectors)
            )
            + "\n        }"
            for r in range(rows)
        )
        # the scale multiplies every row (1 without one): no branch for it, whose two versions
        # of the stores in each of the kernel's inlined copies took 0.8 s more to compile
        stores = []
        for r in range(rows):
            body = f"        const __m512 s = _mm512_set1_ps(scale ? scale[{r}] : 1.0f);\n"
            body += "\n".join(
                f"        _mm512_storeu_ps(C + {r} * ldc + {16 * v}, _mm512_mul_ps(s, accumulate ?"
                f" _mm512_add_ps(_mm512_loadu_ps(C + {r} * ldc + {16 * v}), {acc[r][v]})"
                f" : {acc[r][v]}));"
                for v in range(vectors)
            )
            stores.append(f"    if (rows > {r}) {{\n{body}\n    }}")
        out.append(f"""
/* {name}_wide{width}: C[0:rows, 0:{width}] (+)= A . B, A(i, p) = A[i + p*ks] broadcast (all {rows}
   rows read), B(p, j) = B[p*ldb + j] in place, rows <= {rows} of C stored (ldc apart), row i
   times scale[i] where scale is not NULL */
static inline void {name}_wide{width}(int kc, const float* restrict A, long ks,
    const float* restrict B, long ldb, float* restrict C, long ldc, int rows, int accumulate,
    const float* restrict scale)
{{
{zero}
    for (int p = 0; p < kc; ++p) {{
        const float* restrict a = A + (long)p * ks;
        const float* restrict b = B + (long)p * ldb;
{loads}
{fmas}
    }}
{chr(10).join(stores)}
}}
""")
    return "".join(out)


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
    wide=avx512_wide,
    wide_cols=(64, 80, 96),  # 4 x 4, 5 or 6 accumulators: 21, 26 or 31 registers
    wide_mr=4,
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
