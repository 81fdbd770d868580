"""Lower a `Plan` of a two-GEMM chain into one C function (CPU backend).

The chains it takes: `E = f(A . B) . D` with up to two batch loops, where f is nothing, relu,
gelu or a (scaled) row softmax over l, and B may be stored transposed (attention's Kᵀ). The
block order is the plan's: batch loops and m outermost (split across threads), then l; inside an
l block op1 runs over k blocks into the score tile, f is applied to the tile while it is in
cache (a relu by the micro-kernel as it stores op1's last k block), and op2 runs over n blocks
accumulating into E::

    for (b, m_o) claimed by this thread:            # prefix, parallel
        pack A[b, m_o, :]                           # once per row block
        for l_o:                                    # prefix
            for k_o: C_t (+)= A[m_o, k_o] . B[k_o, l_o]      # op1 blocks, micro-kernel
            C_t = f(C_t)  (online softmax: rescale E rows by exp(max_old - max_new))
            for n_o: E[m_o, n_o] (+)= C_t . D[l_o, n_o]       # op2 blocks, micro-kernel
        (softmax: E rows /= running sum)

The micro-kernel is compiled in; the tiles (`T_M`, `T_L`, `T_K`, `T_N`), every size and every
stride are run-time arguments, so one object serves every shape and plan of a chain's structure
(a new batch, sequence length or head dim loads it; it never waits for the compiler).
Tails need no padding of user tensors: packing zero-fills partial register blocks and the
micro-kernel writes only the valid corner.

The code computes the chain transposed (Pᵀ = Bᵀ . Aᵀ: m along the micro-kernel's nr columns), so
that op1's output tile is already op2's packed operand. op2 then either accumulates Eᵀ, stored
transposed into E at the end of the row block (a softmax's rescaled rows, bf16 output, threads
that split l), or, for float32 chains whose n tiles are whole nr-column strips, adds into E
directly with m along the rows (`pack_strips.c`). Row blocks are claimed by the threads from a
shared counter (`claim.c`).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, replace

from chainfuse.codegen.common import c_source
from chainfuse.codegen.writer import Writer
from chainfuse.hardware import Isa
from chainfuse.ir import Activation, Chain, Contraction, DType, MaskKind, Pointwise, Softmax
from chainfuse.kernels import MicroKernel, emit_with_packing, scores_exp_parts

__all__ = [
    "PACKED",
    "Epilogue",
    "GemmChainShape",
    "GemmChainSpec",
    "emit_gemm_chain",
    "exponentiates_beside_op1",
    "match_gemm_chain",
]

MAX_BATCH = 2  # batch loops the kernel takes (attention: batch and heads)
DIRECT_STRIPS = 8  # row blocks of at most this many nr-strips read B and D slivers in place,
DIRECT_STRIDE = 256  # if the slivers' rows are at most this many elements apart (measured: a
# Mixer-C weight, rows 2-16 KiB apart, runs 12-24 % faster packed in 4 strips of 16; attention's
# V, rows 256 B apart, 7-16 % faster in place at 32-128 keys)
DIRECT_FAR_STRIPS = 2  # ... or at any distance for this many strips (measured: Mixer-S-C's
# weights, rows 8 KiB apart, 1.67 ms in place vs 2.84 ms packed in one strip of 64, 2.05 vs 2.36
# ms in two of 32: a packed copy used once or twice does not pay for its writes)
DT_PANELS = 4  # a softmax chain keeps up to this many packed n blocks of D (all of it) for the
# row blocks of a batch that follow (`_row_block`: reuse_d)
AT_WHOLE = 1 << 20  # floats of Aᵀ a thread keeps packed whole (all of k, for every l block)
#: half-precision dtypes and their short names (the C conversions `cf_from_<short>`/`cf_to_<short>`):
#: 16-bit in and out, fp32 arithmetic inside
HALF = {DType.BFLOAT16: "bf16", DType.FLOAT16: "f16"}
ROWS_MAX = 8  # row blocks of at most this many rows of m take `<name>_rows` (decoding, 1 token)
#: ... and of at most this many where fp32 B's rows meet A's in dot products (attention's K:
#: `fits_rows`) and all of B and D take at most a quarter of the last cache level
#: (`row_path_rows`): there the tiles' narrow strip (16 columns) costs less than 8 rows' dot
#: products. Measured (Zen 4, 32 MiB L3 shared with other machines, 1 thread, interleaved, 20
#: rounds, the row path as of cf_dot4 inlined), the tiled path's time over the row path's at 6 /
#: 7 / 8 queries: 12 heads x 128 keys x 64 - / 1.14 / 0.94, x 512 (3 MiB of K and V) 1.14 / 0.99
#: / 0.89, 8 x 256 x 128 - / 1.12 / 0.89, 16 x 256 x 80 1.37 / 0.99 / 0.91; 12 x 2048 x 64 (12
#: MiB) - / 1.05 / 1.10. Before that row path was 0.83-0.90 of its time: the tiles 0.76-0.91 at
#: 7 and 0.71-0.81 at 8 while K and V fit, and 1.16-1.54x from 16 MiB (16-32 heads x 1024 x
#: 128), where each row block waits on K and V from further out and the row path's reads
#: overlap its arithmetic. (An MLP's rows, B added in row by row, stay on the row path through
#: ROWS_MAX: 256 x 1024 x 256 at 8 rows 1.08, 768 x 3072 x 768 0.88.)
ROWS_FIT = 7
ROWS_FIT_SHARE = 4  # ... while B and D take at most 1/this of the last cache level
ROWS_LB = 256  # ... which scores keys in blocks of this many (an online softmax across them)
#: a row of m on the row path costs about this many of the tiled path's columns (Zen 4,
#: 1 thread: 2.8-4.8 us a query and head of 257 keys of 64 there, 0.67 us a column here)
ROWS_COST = 5


def fits_rows(spec: GemmChainSpec) -> bool:
    """Whether ROWS_FIT can bound the row path: fp32 B met in dot products (`b_transposed`). Not
    16-bit B and D, which the tiles widen as they pack them, for every row block: the row path
    stays ahead there through ROWS_MAX (bf16, 12 heads x 512 keys x 64, the tiles' time over the
    row path's at 6 / 7 / 8 queries: 1.87 / 1.63 / 1.57)."""
    return spec.b_transposed and spec.dtype not in HALF


def row_path_rows(spec: GemmChainSpec, bd_bytes: float, cache_bytes: int) -> int:
    """Row blocks of at most this many rows of m take `<name>_rows` (the C's `rows_max`):
    ROWS_FIT where `fits_rows` and B and D (`bd_bytes`, all of both over the batch) take at
    most a quarter of the last cache level (`cache_bytes`), else ROWS_MAX."""
    return ROWS_FIT if fits_rows(spec) and ROWS_FIT_SHARE * bd_bytes <= cache_bytes else ROWS_MAX


def rows_tail(kernel: MicroKernel) -> int:
    """Rows of m past a row block's whole strips that take `<name>_rows` instead of a tail
    strip, which computes a whole narrow block (`part_cols`, else nr) of columns for them:
    those that cost less there (a block of 257 queries: 1 on the row path, not 16 columns)."""
    return min(ROWS_MAX, (kernel.part_cols or kernel.nr) // ROWS_COST)


def rows_past_strips(rows: int, kernel: MicroKernel) -> int:
    """How many of a row block's `rows` rows of m take `<name>_rows` past its whole strips
    (`_block`'s `tail`, where threads do not split l): 0 unless 1..`rows_tail` are left."""
    left = rows % kernel.nr
    return left if rows > kernel.nr and left <= rows_tail(kernel) else 0


#: A tiled online softmax keeps a column's shift while the column's maximum stays at most this
#: far above it (base 2): its exponentials are then below 2^LAZY_SHIFT = 256, and the sum and
#: Eᵀ are rescaled only when some column's shift moves (each new key tile rescaled all of Eᵀ:
#: 3-5 % of a long sequence's time, interleaved, Zen 3). Exponents up to it stay exact in
#: float32 (a sum of 2^24 keys at most 2^32, and 1e4-magnitude values far from overflow).
LAZY_SHIFT = 8

#: `cf_scores_strip` exponentiates a strip's later blocks against the shift its first block set
#: and rescales a column whose sum reached 2^SUM_CAP (then below 2): its exponentials stay below
#: that, as LAZY_SHIFT keeps the strip's own pass's below 2^8 a key (a sum of 2^8 keys).
SUM_CAP = 16


def _to_e(spec: GemmChainSpec) -> bool:
    """Whether op2 may write E directly (`pack_strips.c`): float32 E (accumulated in place) and no
    softmax (which packs nothing for it: `_softmax_to_e`). The code then also asks, at run time,
    for n blocks of whole nr-column strips (the planner sizes T_N in mr rows: Mixer-C's 258 =
    43 x 6 would pad 14 columns of 272, measured 4 % slower)."""
    return spec.dtype is DType.FLOAT32 and spec.epilogue is not Epilogue.SOFTMAX


def _softmax_to_e(spec: GemmChainSpec) -> bool:
    """Whether a softmax chain's op2 may write E directly, decided at run time (`to_e`): float32
    E and D's rows already the micro-kernel's packed B layout (one dense strip of N = NR
    columns, rows NR apart), read in place. No Eᵀ accumulator and no transposing store: the
    rescales and the division by the sum act on E's rows. (Its tail strip of queries then runs
    whole mr-row blocks in op2, not a narrow block.) Each output element sums over l in the
    same order either way: bit-identical."""
    return spec.dtype is DType.FLOAT32 and spec.epilogue is Epilogue.SOFTMAX


def wide_heads(spec: GemmChainSpec) -> tuple[int, ...]:
    """The value-head widths whose op2 writes E's rows with the whole head in registers
    (`MicroKernel.wide`, decided at run time with `to_e`): a softmax chain's, where E's rows
    can take it (`_softmax_to_e`) and the micro-kernel has wide blocks; () otherwise. Like a
    head of `nr` dense columns (the strided block's, read as its packed layout), these skip
    the Eᵀ accumulator and its transposing store, and V's rows are read in place at any
    stride (a head of `nr` too, when its rows are not dense: V a view of a fused QKV array)."""
    kernel = spec.kernel
    if not _softmax_to_e(spec) or kernel.wide is None:
        return ()
    return kernel.wide_cols


def wide_multiples(kernel: MicroKernel) -> bool:
    """Whether a value head of any multiple of `nr` dims goes into E's rows as well, `nr`
    columns at a time (`wide_heads` has `nr`: its wide block, once per block of columns).
    Measured on Zen 4 (1 thread, interleaved, unfused PyTorch in the rounds; time over the Eᵀ
    accumulator): heads of 128, 16 x 512 0.977, 8 x 1024 0.988, 32 x 256 0.972."""
    return kernel.wide is not None and kernel.nr in kernel.wide_cols


def _named_heads(kernel: MicroKernel) -> tuple[int, ...]:
    """The wide blocks' widths that the generated code tests for by name (`N == w`): all of
    them, but those `wide_multiples` covers with its `N % NR == 0`."""
    return tuple(c for c in kernel.wide_cols if not (wide_multiples(kernel) and c % kernel.nr == 0))


def holds_head(kernel: MicroKernel, n: int) -> bool:
    """Whether a wide block of `kernel` holds a value head of `n` dims (the generated code's
    run-time test, `_wide_test`, in Python: the plan keeps such an n whole)."""
    return n in _named_heads(kernel) or (wide_multiples(kernel) and n % kernel.nr == 0)


def _wide_test(spec: GemmChainSpec) -> str:
    """The C that `to_e` adds for the heads a wide block holds (`holds_head`), or ""."""
    if not wide_heads(spec):
        return ""
    tests = "".join(f" || N == {c}" for c in _named_heads(spec.kernel))
    return tests + (" || N % NR == 0" if wide_multiples(spec.kernel) else "")


def _tiles_macro(w: Writer, spec: GemmChainSpec) -> None:
    """`CF_TILES(t)`: the plan's tiles, run-time arguments (one compiled object serves every
    plan of a chain's structure: a new sequence length never waits for the compiler), and the
    padded extents and workspace regions that follow from them, as locals of the function."""
    w.line("/* the tiles T_M, T_L, T_K, T_N (run-time arguments) and what follows from them:")
    w.line("   T_M and T_N rounded up to whole nr strips, T_L and T_N to whole mr slivers; Eᵀ's")
    w.line("   row stride LDE is MPN plus one cache line, so that rows do not all fall in the same")
    w.line("   cache sets when MPN is a power of two (the transposition reads down a column); DTF")
    w.line("   floats of packed D (Dᵀ slivers, or D's nr-column strips when op2 writes E) */")
    if _to_e(spec):
        dtf = "NPM / MR * SLIVER(T_L) > NPN * T_L ? NPM / MR * SLIVER(T_L) : NPN * T_L"
    else:
        dtf = "NPM / MR * SLIVER(T_L)"
    lines = [
        "const long T_M = (t)[0], T_L = (t)[1], T_K = (t)[2], T_N = (t)[3];",
        "const long MPN = (T_M + NR - 1) / NR * NR, LDE = MPN + 16;",
        "const long LPM = (T_L + MR - 1) / MR * MR, NPM = (T_N + MR - 1) / MR * MR;",
        "const long NPN = (T_N + NR - 1) / NR * NR;",
        f"const long DTF = {dtf};",
        "(void)T_M; (void)T_L; (void)T_K; (void)T_N; (void)MPN; (void)LDE; (void)LPM;",
        "(void)NPM; (void)NPN; (void)DTF;",
    ]
    w.line("#define CF_TILES(t) \\")
    for i, text in enumerate(lines):
        w.line(f"    {text}" + (" \\" if i < len(lines) - 1 else ""))


class Epilogue(enum.Enum):
    """What happens to the intermediate tile between the two GEMMs."""

    NONE = "none"
    RELU = "relu"
    GELU = "gelu"
    SOFTMAX = "softmax"


@dataclass(frozen=True)
class GemmChainSpec:
    """What the generated code depends on (and nothing it does not: no sizes). The tiles are
    the plan's, passed at run time: they are not part of `name` or of the source."""

    batch: tuple[str, ...]  # batch loop names, outermost first
    tensors: tuple[str, str, str, str]  # A, B, D, E names in the chain
    b_transposed: bool  # B stored [.., l, k] (Kᵀ of attention) instead of [.., k, l]
    epilogue: Epilogue
    T_M: int
    T_L: int
    T_K: int
    T_N: int
    kernel: MicroKernel
    mask: MaskKind = MaskKind.NONE  # softmax: an additive (float) or boolean (byte) mask input
    causal: bool = False  # softmax: positions with l > m are masked (PyTorch's is_causal)
    dtype: DType = DType.FLOAT32  # of the inputs and the output (bf16, fp16: fp32 arithmetic)

    @property
    def name(self) -> str:
        word = {Epilogue.NONE: "gemm", Epilogue.RELU: "gemm_relu", Epilogue.GELU: "gemm_gelu",
                Epilogue.SOFTMAX: "gemm_softmax"}[self.epilogue]  # fmt: skip
        word += "_causal" if self.causal else ""
        word += "" if self.mask is MaskKind.NONE else f"_{self.mask.value}mask"
        # every field that shapes the code, spelled without sets (their order changes between
        # processes), so the name, the source and the cache key are the same in every process
        key = (
            f"{self.batch}|{self.tensors}|{self.b_transposed}|{self.epilogue.value}|"
            f"{self.kernel.name}|"
            f"{self.mask.value}|{self.causal}|{self.dtype.value}"
        ).encode()
        short = {DType.FLOAT32: "f32", **HALF}[self.dtype]
        return f"{word}_gemm_{short}_{hashlib.sha256(key).hexdigest()[:8]}"


@dataclass(frozen=True)
class GemmChainShape:
    """What `match_gemm_chain` recognised in a chain."""

    batch: tuple[str, ...]
    tensors: tuple[str, str, str, str]  # A, B, D, E
    b_transposed: bool
    epilogue: Epilogue
    mask: MaskKind = MaskKind.NONE
    mask_tensor: str | None = None
    causal: bool = False


def match_gemm_chain(chain: Chain) -> GemmChainShape:
    """Recognise `E = f(A . B) . D`; raise ValueError saying what does not fit."""
    ops = chain.ops
    contractions = [op for op in ops if isinstance(op, Contraction)]
    if len(contractions) != 2 or not isinstance(ops[0], Contraction):
        raise ValueError(f"{chain.name}: the C backend takes two GEMMs with one op between")
    first, second = contractions
    middle = ops[1:-1]
    epilogue = Epilogue.NONE
    if len(middle) > 1:
        raise ValueError(f"{chain.name}: at most one memory-intensive op between the GEMMs")
    if middle:
        op = middle[0]
        if isinstance(op, Softmax):
            epilogue = Epilogue.SOFTMAX
        elif isinstance(op, Pointwise) and op.fn in (Activation.RELU, Activation.GELU):
            epilogue = Epilogue.RELU if op.fn is Activation.RELU else Epilogue.GELU
        else:
            raise ValueError(f"{chain.name}: op '{op}' between the GEMMs is not supported yet")
    a, b = first.inputs
    c = first.output
    p, d = second.inputs
    e = second.output
    if p.tensor != (middle[0].output.tensor if middle else c.tensor):
        raise ValueError(f"{chain.name}: the second GEMM must read the first one's result first")
    for acc in (a, b, c, p, d, e):
        if any(len(ix.terms) != 1 or ix.terms[0][1] != 1 or ix.offset for ix in acc.index):
            raise ValueError(f"{chain.name}: {acc} is not a plain GEMM index (convolution?)")
    cl = c.loops
    if len(cl) < 2 or len(cl) - 2 > MAX_BATCH:
        raise ValueError(f"{chain.name}: expected [batch..., m, l] for {c.tensor}")
    batch, (m, l) = cl[:-2], cl[-2:]
    (k,) = first.reduction
    n = e.loops[-1]
    want = {
        a.tensor: (*batch, m, k),
        d.tensor: (*batch, l, n),
        e.tensor: (*batch, m, n),
    }
    for acc in (a, d, e):
        if acc.loops != want[acc.tensor]:
            raise ValueError(f"{chain.name}: {acc} should be indexed {want[acc.tensor]}")
    if b.loops == (*batch, k, l):
        transposed = False
    elif b.loops == (*batch, l, k):
        transposed = True
    else:
        raise ValueError(f"{chain.name}: {b} should be indexed [{batch}, k, l] or [{batch}, l, k]")
    shape = GemmChainShape(tuple(batch), (a.tensor, b.tensor, d.tensor, e.tensor), transposed,
                           epilogue)  # fmt: skip
    soft = middle[0] if middle and isinstance(middle[0], Softmax) else None
    if soft is None:
        return shape
    if soft.axis != l:
        raise ValueError(f"{chain.name}: the softmax must run over {l!r}, the second GEMM's sum")
    if soft.causal and soft.row != m:
        raise ValueError(f"{chain.name}: causal masking must compare {l!r} with {m!r}")
    if soft.mask is not None:
        allowed = (*batch, m, l)
        if any(ix.loops and ix.loops[0] not in allowed for ix in soft.mask.index):
            raise ValueError(f"{chain.name}: mask {soft.mask} uses loops outside {allowed}")
    return replace(
        shape,
        mask=soft.mask_kind,
        mask_tensor=None if soft.mask is None else soft.mask.tensor,
        causal=soft.causal,
    )


def _exp2_eighths() -> str:
    """`2^(k/8)`, k = 0..7, for `_EXP2_STRIP`'s table: each as its float32 bits (rounded to
    nearest) less 1.0's and less `k << 20`, the low bits the shifter leaves above the index."""
    bits = [struct.unpack("<I", struct.pack("<f", 2.0 ** (k / 8)))[0] for k in range(8)]
    return ", ".join(str(b - 0x3F800000 - (k << 20)) for k, b in enumerate(bits))


# The softmax strip's exponentials on AVX2 (16 columns: two vectors a row), the "whole" shifts'
# case (integers below 2^21 in magnitude). The same 2^(v - s) as cf_exp2_from but with the
# shifter rounding to eighths: t = v + (0x1.8p20 + 127 - s) keeps 8 (round(v - s, 1/8) + 127) in
# its low bits, whose lowest three pick 2^(k/8) from an eight-entry table in a register
# (vpermd) and the rest, shifted into the exponent, scale it by 2^n: one integer add makes
# T = 2^(n + k/8). The remainder r in [-1/16, 1/16] needs only a degree-3 polynomial,
# 2^r = 1 + r (c1 + r (c2 + r c3)) (fitted for chainfuse as cf_exp2_from's; 1.4e-7 relative
# error evaluated in float32), and T 2^r = T + (r T) q: four FMA-unit operations a vector instead
# of seven. The loop is bound by those units (Zen 3: one strip's pass took 6 % of bert-base's
# time); measured on Zen 3, 1 thread, interleaved: 0.97-1.0 of the time on the 12 paper
# attentions, geomean 0.989. v = s gives 1 exactly, v <= s - 127 and -inf 0 exactly (t's
# index and exponent bits are then 0, and so is the table's first entry), NaN stays NaN (the
# max lets it through and r carries it).
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
""".replace("EIGHTHS", _exp2_eighths())


def _exp2_strip(spec: GemmChainSpec) -> bool:
    """Whether a softmax strip's exponentials take `_EXP2_STRIP` (an AVX2 micro-kernel's 16
    columns) rather than the portable loop over cf_exp2_from."""
    return (
        spec.epilogue is Epilogue.SOFTMAX
        and Isa.AVX2 in spec.kernel.isa
        and Isa.FMA in spec.kernel.isa
        and spec.kernel.nr == 16
    )


def exponentiates_beside_op1(spec: GemmChainSpec) -> bool:
    """Whether op1's whole blocks of an attention's scores run the micro-kernel's `scores_exp`
    (`cf_scores_strip`): float32, no mask and not causal (the strip's own pass applies those
    between op1 and the maxima), and a kernel that has it (and narrow blocks: a strip's `nw`
    columns pick whole strips)."""
    return (
        spec.epilogue is Epilogue.SOFTMAX
        and spec.mask is MaskKind.NONE
        and not spec.causal
        and spec.dtype is DType.FLOAT32
        and spec.b_transposed
        and spec.kernel.scores_exp is not None
        and bool(spec.kernel.part_cols)
    )


def _scores_strip(w: Writer, spec: GemmChainSpec) -> None:
    """`cf_scores_strip`: op1 and the online softmax of one whole strip of scores (NR columns,
    k in one block), the exponentials of each block of MR keys spread over the next block's
    FMA loop (`MicroKernel.scores_exp`) instead of a pass of their own after op1, and no
    maxima past the first block.

    A column's shift comes from the strip's first block alone: its maximum rounded up to an
    integer (below 2^21 in magnitude, else the maximum itself), or the column's shift from the
    l blocks before while that maximum stays within LAZY_SHIFT of it (as the strip's own pass
    keeps it). The later blocks are exponentiated against it, their maxima never taken: a
    key far above the first block's maximum makes the column's sum large, so a sum past
    2^SUM_CAP at the end has the column's exponentials and sum scaled by 2^-k (k its exponent,
    the shift moved up by k), exact in float32 but for what falls below its subnormals. A sum
    that overflowed or is NaN (a key more than ~127 above it, NaN or inf inputs) returns -1:
    the caller then computes the strip on its own pass, which takes every block's maximum.

    Measured on Zen 4 (1 thread, interleaved, 40 rounds), against every block taking its
    maxima, testing them against the shift and moving it (rescaling the rows before), with the
    keys past whole blocks on a block and a pass of their own: the 12 paper attentions took
    0.986-1.002 of the time (median 0.990); one strip of 208 keys alone in a loop 0.98-0.99."""
    uk = spec.kernel.name
    w.line("/* op1 for a whole strip of lc >= MR rows of keys (A's rows in place at Bd, rs apart,")
    w.line("   ks a step, when direct; else packed in slivers at Bt) and its online softmax: each")
    w.line("   block's scores exponentiated during the next block's FMAs, the last block's and the")
    w.line("   keys' past whole blocks after them; the column statistics (cmax: the shift, csum)")
    w.line("   updated as the strip's own pass updates them, alpha what Eᵀ is to be rescaled by.")
    w.line("   Returns whether any column's shift moved, or -1 (cmax, csum untouched) where a")
    w.line("   column's sum overflowed or is NaN: the strip's own pass then computes it */")
    with w.block(
        "static int cf_scores_strip(int kc, int lc, int direct, const float* restrict Bd,"
        " long rs, long ks, const float* restrict Bt, long sliver, const float* restrict a,"
        " float* restrict p, float* restrict cmax, float* restrict csum, float* restrict alpha)"
    ):
        w.line("float shift[NR], sum[NR];")
        w.line("const int blocks = lc / MR;")
        w.line("const long ars = direct ? rs : 1, aks = direct ? ks : MR;")
        w.line("/* the first block: its scores, then the shifts from their maxima */")
        w.line(f"{uk}_scores_exp(kc, direct ? Bd : Bt, ars, aks, a, p, p, 0, shift, sum);")
        with w.block("for (int c = 0; c < NR; ++c)"):
            w.line("float mx = p[c]; /* (a NaN anywhere makes the sum NaN) */")
            w.line("for (int r = 1; r < MR; ++r) mx = p[r * NR + c] > mx ? p[r * NR + c] : mx;")
            w.line("const int keep = cmax[c] != -INFINITY && !(mx > cmax[c] + LAZY_SHIFT);")
            w.line(
                "shift[c] = keep ? cmax[c] : mx < 2097152.0f && mx > -2097152.0f ? ceilf(mx) : mx;"
            )
            w.line("sum[c] = 0.0f;")
        with w.block("for (int s = 1; s < blocks; ++s)"):
            w.line("float* restrict c = p + (long)s * MR * NR;")
            w.line(
                "const float* restrict as = direct ? Bd + (long)s * MR * rs : Bt + (long)s * sliver;"
            )
            w.line(f"{uk}_scores_exp(kc, as, ars, aks, a, c, c - MR * NR, MR, shift, sum);")
        w.line("const int m = lc - blocks * MR;")
        with w.block("if (m > 0)"):
            w.line("/* the keys past whole blocks: a short block of their own (the smallest part")
            w.line("   that holds them, its rows past theirs repeating their last), the last")
            w.line("   whole block exponentiated during its FMAs */")
            w.line("float* restrict c = p + (long)blocks * MR * NR;")
            w.line(
                "const float* restrict as = direct ? Bd + (long)blocks * MR * rs"
                " : Bt + (long)blocks * sliver;"
            )
            parts = scores_exp_parts(spec.kernel.mr)
            for i, r in enumerate(parts):
                w.line("else" if i == len(parts) - 1 else f"{'else if' if i else 'if'} (m <= {r})")
                w.line(
                    f"    {uk}_scores_exp_part{r}(kc, as, ars, aks, a, c, c - MR * NR, MR, shift,"
                    " sum, m);"
                )
            w.line(f"{uk}_exp2_rows(c, m, shift, sum);")
        w.line(f"else {uk}_exp2_rows(p + (long)(blocks - 1) * MR * NR, MR, shift, sum);")
        w.line(
            "/* a sum past 2^SUM_CAP: the column scaled by 2^-k, k its exponent; inf or NaN: -1 */"
        )
        w.line("int big = 0;")
        with w.block("for (int c = 0; c < NR; ++c)"):
            w.line("if (!(sum[c] <= 3.40282347e38f)) return -1;")
            w.line("big |= sum[c] >= SUM_BIG;")
        with w.block("if (big)"):
            w.line("float f[NR];")
            with w.block("for (int c = 0; c < NR; ++c)"):
                w.line("const int k = sum[c] >= SUM_BIG ? ilogbf(sum[c]) : 0;")
                w.line("f[c] = ldexpf(1.0f, -k);")
                w.line("sum[c] *= f[c];")
                w.line("shift[c] += (float)k;")
            with w.block("for (int r = 0; r < lc; ++r)"):
                w.line("#pragma omp simd")
                w.line("for (int c = 0; c < NR; ++c) p[r * NR + c] *= f[c];")
        w.line("int moved = 0;")
        with w.block("for (int c = 0; c < NR; ++c)"):
            w.line("/* (a column with nothing but -inf so far keeps zero mass) */")
            w.line(
                "const float al = cmax[c] == -INFINITY ? 0.0f : shift[c] == cmax[c] ? 1.0f"
                " : cf_exp2_neg(cmax[c] - shift[c]);"
            )
            w.line("alpha[c] = al;")
            w.line("moved |= al != 1.0f;")
            w.line("csum[c] = csum[c] * al + sum[c];")
            w.line("cmax[c] = shift[c];")
        w.line("return moved;")


def _scores_strip_call(w: Writer, spec: GemmChainSpec) -> None:
    """Op1's strip loop: a whole strip (k in one block, at least MR keys) takes
    `cf_scores_strip` and skips the blocks and the softmax pass below, unless it returned -1
    (a sum overflowed: the strip runs them)."""
    with w.block("if (nw == NR && TK == K && lc >= MR)"):
        w.line("float* restrict p = Pt + (long)j * LPM * NR;")
        w.line("float alpha[NR];")
        w.line(
            "const int moved = cf_scores_strip(kc, lc, direct_b, B_b + l0 * sBr + k0, sBr, 1,"
            " Bt, SLIVER(kc), a, p, col_max + j * NR, col_sum + j * NR, alpha);"
        )
        with w.block("if (moved >= 0)"):
            _rescale_e(w, spec, "NR")
            w.line("continue;")


#: Slots of the one array `<name>_packed` takes (longs): pointers, then the scalars, then arrays.
PACKED = {
    "A": 0, "B": 1, "D": 2, "E": 3, "mask": 4, "work": 5, "work_per_thread": 6, "nthreads": 7,
    "scale_bits": 8, "sizes": 9, "strides": 15, "mask_strides": 27, "outer_m": 31, "tiles": 32,
    "cache_bytes": 36, "end": 37,
}  # fmt: skip


def emit_gemm_chain(spec: GemmChainSpec, header: str = "") -> str:
    """C source of `void <name>(...)`, `void <name>_packed(const long*)` (the same, its
    arguments in one array laid out as `PACKED`) and `long <name>_workspace(...)` for `spec`.

    The code computes the transposed chain, `Eᵀ = Dᵀ . f(Bᵀ . Aᵀ)`, so that op1's micro-kernel
    writes the intermediate tile straight into the packed layout op2's micro-kernel reads (strips
    of `nr` rows of m, each `[l][nr]`): the tile is never repacked, only the small Eᵀ block is
    transposed into E once per row block. m is the micro-kernel's column (nr) dimension, l and
    n its row (mr) dimension, and a softmax over l reduces down the columns, in vectors.
    """
    ker = spec.kernel
    mr, nr = ker.mr, ker.nr
    name = spec.name
    w = Writer()
    w.line("/*")
    for text in header.strip().split("\n"):
        w.line(f" * {text}".rstrip())
    w.line(" */")
    w.lines(c_source("math.c"))
    w.lines(emit_with_packing(ker))
    if exponentiates_beside_op1(spec) and ker.scores_exp is not None:
        w.lines(ker.scores_exp(ker))
    if wide_heads(spec) and ker.wide is not None:
        w.lines(ker.wide(ker))
    w.line(f"#define MR {mr}")
    w.line(f"#define NR {nr}")
    w.line(
        f"#define PART_MR {ker.part_rows} /* a sliver of this many rows is read in place too"
        " (<uk>_tail reads only its rows; 0: none) */"
    )
    w.line(f"#define ROWS_MAX {ROWS_MAX} /* row blocks of this many rows or fewer: _rows */")
    if fits_rows(spec):
        w.line(f"#define ROWS_FIT {ROWS_FIT} /* ... where B and D fit in the cache (rows_max) */")
    w.line(
        f"#define ROWS_TAIL {rows_tail(ker)} /* rows past whole strips of a block that take _rows */"
    )
    if ker.part_cols:
        w.line("/* the columns a tail strip of n < NR computes: whole narrow blocks (<uk>_cols) */")
        pc = ker.part_cols
        w.line(f"#define CF_NW(n) ((n) >= NR ? NR : ((n) + {pc - 1}) / {pc} * {pc})")
    w.line(f"#define ROWS_LB {ROWS_LB} /* ... l (keys) at a time */")
    w.line(f"#define LAZY_SHIFT {LAZY_SHIFT}.0f /* a shift kept while maxima stay this close */")
    w.line(f"#define SUM_BIG {2**SUM_CAP}.0f /* 2^SUM_CAP: a strip's sum rescaled from it */")
    w.line("#define ALIGN16(x) (((x) + 15) & ~15L)")
    w.line("/* floats from one packed MR-row sliver of a kc-step panel to the next: whole cache")
    w.line("   lines, an odd number of them, so that the slivers a panel's row-by-row packing")
    w.line("   writes at once fall in different cache sets (an even stride of 2^n lines puts")
    w.line("   them all in a few sets of L1, and every store misses) */")
    w.line(
        "#define SLIVER(kc) (ALIGN16((long)(kc) * MR) + (ALIGN16((long)(kc) * MR) / 16 % 2 ? 0 : 16))"
    )
    _tiles_macro(w, spec)
    if spec.dtype in HALF:
        short = HALF[spec.dtype]
        w.line(
            f"/* {short} inputs and output: converted to fp32 while packing (the micro-kernel and"
        )
        w.line(f"   the intermediate are fp32), E rounded to {short} once at the end */")
        w.line(f"#define CF_LOAD(x) cf_from_{short}(x)")
        w.line(f"#define CF_STORE(x) cf_to_{short}(x)")
        if spec.dtype is DType.FLOAT16:
            w.line("#define CF_F16 1")
        w.line("/* floats of the row path's widened rows: four of K, N or ROWS_LB (_rows) */")
        w.line(
            "#define CF_WIDE(K, N) ALIGN16(4 * ((K) > (N) ? ((K) > ROWS_LB ? (K) : ROWS_LB)"
            " : ((N) > ROWS_LB ? (N) : ROWS_LB)))"
        )
        w.lines(c_source("half.c"))
        w.line("typedef uint16_t cf_elem;")
        w.line("#define PACK_A cf_half_pack_a")
        w.line("#define PACK_AT cf_half_pack_at")
        w.line("#define PACK_BT cf_half_pack_bt")
        w.line(
            f"#define DIRECT_MC 0 /* {short} slivers cannot be read in place by an fp32 kernel */"
        )
        w.line(f"#define DIRECT_STRIDE {DIRECT_STRIDE}")
        w.line(f"#define DIRECT_FAR_STRIPS {DIRECT_FAR_STRIPS}")
    else:
        w.line("typedef float cf_elem;")
        w.line("#define CF_LOAD(x) (x)")
        w.line("#define CF_STORE(x) (x)")
        w.line("#define CF_WIDE(K, N) 0 /* (fp32: the row path reads rows in place) */")
        w.line(f"#define PACK_A {ker.name}_pack_a")
        w.line(f"#define PACK_AT {ker.name}_pack_at")
        w.line(f"#define PACK_BT {ker.name}_pack_bt")
        w.line(
            f"#define DIRECT_MC {DIRECT_STRIPS} * NR /* up to this many columns: no B/D packing */"
        )
        w.line(f"#define DIRECT_STRIDE {DIRECT_STRIDE} /* ... if their rows are this close */")
        w.line(
            f"#define DIRECT_FAR_STRIPS {DIRECT_FAR_STRIPS} /* ... or at most this many strips */"
        )
    w.line("/* Aᵀ packed whole (all of k, once per row block, kept for every l block) up to this")
    w.line("   many floats; beyond them one k block at a time, packed again for each l block */")
    w.line(f"#define AT_WHOLE {AT_WHOLE}L")
    w.line("#define CF_AK(K, TK) ((K) == (TK) || MPN * (K) <= AT_WHOLE ? (K) : (TK))")
    if spec.epilogue is Epilogue.SOFTMAX:
        w.line(
            "/* packed n blocks of D kept for the next row blocks (reuse_d): all of N, in blocks of"
        )
        w.line(
            "   T_N, when it takes at most DT_PANELS blocks; else one block, packed each time */"
        )
        w.line(f"#define DT_PANELS {DT_PANELS}")
        w.line(
            "#define CF_DTN(N) ((N) > T_N && (N) <= DT_PANELS * T_N ? ((N) + T_N - 1) / T_N : 1)"
        )
    else:
        w.line("#define CF_DTN(N) 1 /* (one packed block of D: see the softmax chains') */")
    w.line("")
    if _exp2_strip(spec):
        w.lines(_EXP2_STRIP)
    if spec.b_transposed:  # (`_rows_scores_by_key`)
        w.lines(c_source("dot4.c"))
    w.lines(c_source("pack_panel.c"))
    w.lines(c_source("claim.c"))
    if _to_e(spec):
        w.lines(c_source("pack_strips.c"))
    w.lines(c_source("prefetch.c"))
    w.line("/* floats of workspace one thread needs: packed Aᵀ, packed Bᵀ, the intermediate Pᵀ,")
    w.line("   packed Dᵀ, the Eᵀ accumulator, the softmax column statistics, and the row path's")
    w.line("   rows of A and accumulators (_rows) */")
    with w.block(f"long {name}_workspace(long K, long N, const long* tiles)"):
        w.line("CF_TILES(tiles)")
        w.line("const long TK = K < T_K ? K : T_K;")
        w.line("const long AK = CF_AK(K, TK); /* Aᵀ's k: all of it, or one block */")
        w.line("const long DTN = CF_DTN(N);")
        w.line(
            "return ALIGN16(MPN * AK) + LPM / MR * SLIVER(TK) + ALIGN16(MPN * LPM)"
            " + DTN * DTF + ALIGN16(N * LDE) + 2 * ALIGN16(MPN)"
            " + ALIGN16(ROWS_MAX * K) + ALIGN16(ROWS_MAX * N) + CF_WIDE(K, N);"
        )
    w.line("")
    if exponentiates_beside_op1(spec):
        _scores_strip(w, spec)
        w.line("")
    _store_e(w, spec)
    w.line("")
    _rows(w, spec)
    w.line("")
    w.line(
        "/* sizes: batch0, batch1, M, N, K, L; strides (elements) of A, B, D, E: batch0, batch1,"
    )
    w.line(
        "   row (the last dim is contiguous); B's row is k (or l when B is stored transposed) */"
    )
    with w.block(
        f"void {name}(const cf_elem* restrict A, const cf_elem* restrict B,\n"
        f"    const cf_elem* restrict D, cf_elem* restrict E, const long* sizes,\n"
        f"    const long* strides, float scale, const void* mask_data, const long* mask_strides,\n"
        f"    float* restrict work, long work_per_thread, int nthreads, long outer_m,\n"
        f"    const long* tiles, long cache_bytes)"
    ):
        w.line("CF_TILES(tiles)")
        w.line("const long nb0 = sizes[0], nb1 = sizes[1], M = sizes[2], N = sizes[3];")
        w.line("const long K = sizes[4], L = sizes[5];")
        w.line("const long sA0 = strides[0], sA1 = strides[1], sAm = strides[2];")
        w.line("const long sB0 = strides[3], sB1 = strides[4], sBr = strides[5];")
        w.line("const long sD0 = strides[6], sD1 = strides[7], sDl = strides[8];")
        w.line("const long sE0 = strides[9], sE1 = strides[10], sEm = strides[11];")
        w.line("const long TK = K < T_K ? K : T_K;")
        w.line("const long AK = CF_AK(K, TK); /* Aᵀ's k: all of it, or one block */")
        w.line("const long DTN = CF_DTN(N);")
        if fits_rows(spec):
            w.line("/* the row path's reach (row_path_rows in c.py): ROWS_FIT rows where all of B")
            w.line(
                "   and D (K and V) take at most a quarter of the last cache level, else ROWS_MAX */"
            )
            w.line(
                "const double bd_bytes = ((double)(sB0 ? nb0 : 1) * (double)(sB1 ? nb1 : 1) * (double)K"
                " + (double)(sD0 ? nb0 : 1) * (double)(sD1 ? nb1 : 1) * (double)N) * (double)L"
                " * (double)sizeof(cf_elem);"
            )
            w.line(
                f"const int rows_max = {ROWS_FIT_SHARE}.0 * bd_bytes <= (double)cache_bytes"
                " ? ROWS_FIT : ROWS_MAX;"
            )
        else:
            w.line("const int rows_max = ROWS_MAX; /* (see row_path_rows in c.py) */")
        w.line("(void)cache_bytes;")
        w.line("/* the parallel blocks: a batch index and T_MO rows of m (the plan's outermost m")
        w.line("   tile: the blocks its model deals to the cores), run as row blocks of T_M */")
        w.line("const long T_MO = outer_m < T_M ? T_M : outer_m;")
        w.line("const long mblocks = (M + T_MO - 1) / T_MO;")
        w.line("const long blocks = nb0 * nb1 * mblocks;")
        if spec.epilogue is Epilogue.SOFTMAX:
            w.line(
                "const int split = 1; /* (a softmax's shares of l would need their maxima merged) */"
            )
            w.line("const long LQ = L;")
        else:
            w.line(
                "/* fewer blocks than threads, each one row block (an MLP's few tokens: one head of"
            )
            w.line(
                "   64 rows is one strip of the micro-kernel): the threads of a block split its l"
            )
            w.line(
                "   range, each into its own Eᵀ, and a second pass adds the shares up. Each thread"
            )
            w.line("   reads its share of B and D only */")
            w.line(
                "const int split = blocks < nthreads && (T_MO <= T_M || M <= T_M) ? (int)(nthreads / blocks) : 1;"
            )
            w.line(
                "const long LQ = (L + (long)split * MR - 1) / ((long)split * MR) * MR; /* l per share */"
            )
        if spec.epilogue is Epilogue.SOFTMAX:
            w.line("/* the scores in base 2: exp(x) = 2^(x log2(e)) */")
            w.line("const float scale2 = scale * CF_LOG2E;")
        w.line("(void)scale;")
        w.line("/* mask strides (elements, 0 where it broadcasts): batch0, batch1, m, l */")
        w.line("const long sM0 = mask_strides[0], sM1 = mask_strides[1];")
        w.line("const long sMm = mask_strides[2], sMl = mask_strides[3];")
        w.line("(void)mask_data; (void)sM0; (void)sM1; (void)sMm; (void)sMl;")
        w.line("/* the next block to claim (split == 1): see cf_claim */")
        w.line("long next_blk = 0;")
        w.line("/* one iteration per thread, so its index names its workspace: no omp.h needed */")
        w.line("#pragma omp parallel for schedule(static, 1) num_threads(nthreads)")
        with w.block("for (int t = 0; t < nthreads; ++t)"):
            w.line("float* restrict At = work + (long)t * work_per_thread;")
            w.line("float* restrict Bt = At + ALIGN16(MPN * AK);")
            w.line("float* restrict Pt = Bt + LPM / MR * SLIVER(TK);")
            w.line("float* restrict Dt = Pt + ALIGN16(MPN * LPM);")
            w.line("float* restrict Et = Dt + DTN * DTF;")
            w.line("float* restrict col_max = Et + ALIGN16(N * LDE);")
            w.line("float* restrict col_sum = col_max + ALIGN16(MPN);")
            w.line("float* restrict rows_q = col_sum + ALIGN16(MPN); /* see _rows */")
            w.line("float* restrict rows_o = rows_q + ALIGN16(ROWS_MAX * K);")
            w.line("float* restrict rows_w = rows_o + ALIGN16(ROWS_MAX * N); /* (16-bit: _rows) */")
            if spec.epilogue is Epilogue.SOFTMAX and not spec.causal:
                w.line("/* whose D the packed blocks in Dt hold (reuse_d): where it starts */")
                w.line("const cf_elem* dt_from = 0;")
            w.line(
                "/* split: share t % split of block t / split; else blocks claimed one by one */"
            )
            w.line(
                "const long last = split > 1 ? (t < blocks * split ? t / split + 1 : 0) : blocks;"
            )
            w.line("const long l_lo = split > 1 ? (t % split) * LQ : 0;")
            w.line("const long l_hi = split > 1 && l_lo + LQ < L ? l_lo + LQ : L;")
            w.line("long nxt = split > 1 ? t / split : cf_claim(&next_blk);")
            with w.block("for (long blk = nxt; blk < last; blk = nxt)"):
                w.line("nxt = split > 1 ? blk + 1 : -1; /* -1: the next one not claimed yet */")
                _block(w, spec)
                w.line("if (nxt < 0) nxt = cf_claim(&next_blk);")
        if spec.epilogue is not Epilogue.SOFTMAX:
            _split_sum(w, spec)
    w.line("")
    w.line("/* the same with every argument in one array, for callers that pay per argument")
    w.line("   (ctypes: ~0.2 us each): see PACKED in chainfuse.codegen.c for the layout */")
    with w.block(f"void {name}_packed(const long* a)"):
        w.line("const uint32_t bits = (uint32_t)a[8];")
        w.line("float scale;")
        w.line("memcpy(&scale, &bits, sizeof scale);")
        w.line(
            f"{name}((const cf_elem*)a[0], (const cf_elem*)a[1], (const cf_elem*)a[2],"
            " (cf_elem*)a[3], a + 9, a + 15, scale, (const void*)a[4], a + 27,"
            " (float*)a[5], a[6], (int)a[7], a[31], a + 32, a[36]);"
        )
    return w.text()


def _split_sum(w: Writer, spec: GemmChainSpec) -> None:
    """The second pass of a split l range: the threads of a block add their shares of Eᵀ into
    the first share's, each over its own range of n, and store that range of E."""
    with w.block("if (split > 1)"):
        w.line("#pragma omp parallel for schedule(static, 1) num_threads(nthreads)")
        with w.block("for (int t = 0; t < blocks * split; ++t)"):
            w.line("const long blk = t / split, part = t % split;")
            w.line("const long b0 = blk / (nb1 * mblocks), b1 = (blk / mblocks) % nb1;")
            w.line("const long mo = (blk % mblocks) * T_MO;")
            w.line("const int mc = (int)(M - mo < T_MO ? M - mo : T_MO);")
            w.line("const long NQ = (N + split - 1) / split;")
            w.line("const long n_lo = part * NQ < N ? part * NQ : N;")
            w.line("const long n_hi = n_lo + NQ < N ? n_lo + NQ : N;")
            w.line("/* Eᵀ of the thread that ran share q of this block (region one's layout) */")
            w.line(
                "#define ET_OF(q) (work + (blk * split + (q)) * work_per_thread + ALIGN16(MPN * AK)"
                " + LPM / MR * SLIVER(TK) + ALIGN16(MPN * LPM) + DTN * DTF)"
            )
            w.line("float* restrict et0 = ET_OF(0);")
            with w.block("for (long q = 1; q < split; ++q)"):
                w.line("const float* restrict etq = ET_OF(q);")
                with w.block("for (long c2 = n_lo; c2 < n_hi; ++c2)"):
                    w.line("#pragma omp simd")
                    w.line("for (int i = 0; i < mc; ++i) et0[c2 * LDE + i] += etq[c2 * LDE + i];")
            w.line("#undef ET_OF")
            w.line("cf_elem* restrict E_b = E + b0 * sE0 + b1 * sE1 + mo * sEm;")
            w.line(
                f"if (n_hi > n_lo) {spec.name}_store_e(mc, n_hi - n_lo, et0 + n_lo * LDE, 0,"
                " E_b + n_lo, sEm, LDE);"
            )


def _pack_at(w: Writer, uk: str, k0: str, kc: str, scaled: bool) -> None:
    """Aᵀ strips (op1's B operand): strip j holds m columns j*nr.. over k. `scaled`: times the
    softmax scale and log2(e), so the scores come out scaled and in base 2 (one pass over the
    T_M x K block of A instead of one over every T_M x T_L tile of scores)."""
    with w.block("for (int j = 0; j * NR < mc; ++j)"):
        w.line("const int n = mc - j * NR < NR ? mc - j * NR : NR;")
        w.line(f"float* restrict strip = At + (long)j * NR * AK + (AK == K ? {k0} : 0) * NR;")
        factor = "scale2" if scaled else "1.0f"
        w.line(f"PACK_BT({kc}, n, A_b + j * NR * sAm + {k0}, sAm, strip, {factor});")


def _block(w: Writer, spec: GemmChainSpec) -> None:
    """One parallel block: a batch index and T_MO rows of m (the plan's outermost m tile, the
    blocks its model deals to the cores), run as row blocks of T_M."""
    w.line("const long b0 = blk / (nb1 * mblocks), b1 = (blk / mblocks) % nb1;")
    w.line("const long mo = (blk % mblocks) * T_MO;")
    w.line("const long mo_end = M - mo < T_MO ? M : mo + T_MO;")
    with w.block("for (long m0 = mo; m0 < mo_end; m0 += T_M)"):
        w.line("const int rows = (int)(mo_end - m0 < T_M ? mo_end - m0 : T_M);")
        # causal: key blocks wholly after the block's last query are all masked: skipped
        bound = "L < m0 + {0} ? L : m0 + {0}" if spec.causal else "l_hi"
        w.line("/* a few rows past whole strips take _rows (ROWS_TAIL), the rest the tiles */")
        w.line(  # (`rows_past_strips`: the same rule, for describe)
            "const int tail = split == 1 && rows > NR && rows % NR <= ROWS_TAIL ? rows % NR : 0;"
        )
        with w.block("if (tail > 0)"):
            w.line(f"const long tail_end = {bound.format('rows')};")
            _rows_invoke(w, spec, "tail", "m0 + rows - tail", "tail_end")
        w.line("const int mc = rows - tail;")
        w.line(f"const long l_end = {bound.format('mc')};")
        _rows_call(w, spec)
        _row_block(w, spec)


def _row_block(w: Writer, spec: GemmChainSpec) -> None:
    """The body of one (batch, m_o) row block of `mc` <= T_M rows from `m0`, keys up to `l_end`."""
    uk = spec.kernel.name
    softmax = spec.epilogue is Epilogue.SOFTMAX
    in_place = spec.dtype is DType.FLOAT32  # the micro-kernel reads fp32 slivers in place
    w.line("const cf_elem* restrict A_b = A + b0 * sA0 + b1 * sA1 + m0 * sAm;")
    w.line("const cf_elem* restrict B_b = B + b0 * sB0 + b1 * sB1;")
    w.line("const cf_elem* restrict D_b = D + b0 * sD0 + b1 * sD1;")
    w.line("cf_elem* restrict E_b = E + b0 * sE0 + b1 * sE1 + m0 * sEm;")
    w.line("/* few column strips: a B or D sliver serves too few micro-kernel calls to pay for")
    w.line("   packing it; whole slivers are then read in place (tails are still packed). Not")
    w.line("   a sliver whose rows lie far apart (a new page per element read, re-read for")
    w.line("   every strip) unless it serves one or two strips: packing it row by row is")
    w.line("   cheaper only when the packed copy is read several times */")
    w.line("const int direct = mc <= DIRECT_MC;")
    w.line("const int few = mc <= DIRECT_FAR_STRIPS * NR;")
    far_b = "" if spec.b_transposed else " && (few || sBr <= DIRECT_STRIDE)"
    w.line(f"const int direct_b = direct{far_b};")
    if softmax:
        if _softmax_to_e(spec):
            w.line("/* op2 straight into E where D's rows are the packed layout (_softmax_to_e),")
            w.line("   or a wide block holds a whole value head (wide_heads) */")
            heads = _wide_test(spec)
            w.line(f"const int to_e = ((N == NR && sDl == NR){heads}) && T_N >= N && l_end > l_lo;")
        _reuse_d(w, spec)
    reused = " && !reuse_d" if softmax else ""
    w.line(f"const int direct_d = direct{reused} && (few || sDl <= DIRECT_STRIDE);")
    if spec.mask is MaskKind.ADDITIVE:
        w.line("const cf_elem* mask_b = (const cf_elem*)mask_data + b0 * sM0 + b1 * sM1;")
    elif spec.mask is MaskKind.BOOL:
        w.line(
            "const unsigned char* mask_b = (const unsigned char*)mask_data + b0 * sM0 + b1 * sM1;"
        )
    with w.block("if (TK == K)"):
        w.line("/* k in one block: Aᵀ is packed once for the whole row block */")
        _pack_at(w, uk, "0", "(int)K", softmax)
    if softmax:
        with w.block("for (int i = 0; i < MPN; ++i)"):
            w.line("col_max[i] = -INFINITY;")
            w.line("col_sum[i] = 0.0f;")
    if _to_e(spec):
        w.line("/* op2 straight into E (see cf_pack_b_panel), unless the threads split l or D is")
        w.line("   read in place */")
        w.line("const int to_e = T_N % NR == 0 && split == 1 && !direct_d && l_end > l_lo;")
    if not softmax:
        with w.block("if (l_end <= l_lo)"):
            w.line("/* an empty share of l (split below): it adds zeros */")
            w.line("for (long c2 = 0; c2 < N; ++c2) memset(Et + c2 * LDE, 0, MPN * sizeof(float));")
    with w.block("for (long l0 = l_lo; l0 < l_end; l0 += T_L)"):
        w.line("const int lc = (int)(l_end - l0 < T_L ? l_end - l0 : T_L);")
        w.line("/* op1: Pᵀ[lc x mc] = Bᵀ[l_o, :] . Aᵀ[:, m_o], over k blocks */")
        with w.block("for (long k0 = 0; k0 < K; k0 += TK)"):
            w.line("const int kc = (int)(K - k0 < TK ? K - k0 : TK);")
            w.line(
                "/* (several k blocks: each packed for the first l block and kept for the others"
            )
            w.line("   where Aᵀ is kept whole, else packed for each) */")
            with w.block("if (TK != K && (AK != K || l0 == l_lo))"):
                _pack_at(w, uk, "k0", "kc", softmax)
            if spec.b_transposed:
                with w.block("for (int s = 0; s * MR < lc; ++s)"):
                    w.line("const int m = lc - s * MR < MR ? lc - s * MR : MR;")
                    w.line(
                        "if (direct_b && (m == MR || m == PART_MR)) continue; /* read in place below */"
                    )
                    w.line(
                        "PACK_A(kc, m, B_b + (l0 + s * MR) * sBr + k0, sBr, Bt + (long)s * SLIVER(kc));"
                    )
            else:  # (whole slivers read in place below when direct_b)
                w.line("cf_pack_at_panel(kc, lc, B_b + k0 * sBr + l0, sBr, Bt, !direct_b);")
                w.line("/* the panel packed next: B's next k block, or the first D panel */")
                w.line("cf_pf pf;")
                w.line(
                    "if (k0 + kc < K) cf_pf_set(&pf, B_b + (k0 + kc) * sBr + l0, sBr,"
                    " (int)(K - k0 - kc < TK ? K - k0 - kc : TK), lc);"
                )
                w.line("else cf_pf_set(&pf, D_b + l0 * sDl, sDl, lc, N < T_N ? N : T_N);")
                w.line(
                    "const int pf_rows = cf_pf_share(&pf, (mc + NR - 1) / NR * ((lc + MR - 1) / MR));"
                )
            w.line(
                "/* whole strips of NR columns, a tail strip's too: Aᵀ is zero beyond mc, so its"
            )
            w.line(
                "   columns of Pᵀ come out zero (or are set to zero by <uk>_cols, which computes"
            )
            w.line(
                "   only the nw columns of a tail strip), and op2 reads no stale workspace there"
            )
            w.line(
                "   (stale floats may be subnormal: a microcode assist per FMA on some cores) */"
            )
            with w.block("for (int j = 0; j * NR < mc; ++j)"):
                w.line(
                    "const float* restrict a = At + (long)j * NR * AK + (AK == K ? k0 : 0) * NR;"
                )
                if spec.kernel.part_cols and in_place:
                    w.line("const int nw = CF_NW(mc - j * NR); /* (a tail strip: its columns) */")
                if spec.epilogue is Epilogue.RELU:
                    w.line("/* the relu as each block of the last k block is stored */")
                    w.line("const int acc = (k0 > 0) | (k0 + kc >= K ? RELU_AT_STORE : 0);")
                else:
                    w.line("const int acc = k0 > 0;")
                if exponentiates_beside_op1(spec):
                    _scores_strip_call(w, spec)
                with w.block("for (int s = 0; s * MR < lc; ++s)"):
                    w.line("const int m = lc - s * MR < MR ? lc - s * MR : MR;")
                    w.line("float* restrict c = Pt + (long)j * LPM * NR + s * MR * NR;")
                    if not in_place:
                        w.line(f"{uk}(kc, Bt + (long)s * SLIVER(kc), a, c, NR, m, NR, acc);")
                    else:
                        if spec.b_transposed:
                            place = "B_b + (l0 + s * MR) * sBr + k0", "sBr", "1"
                        else:
                            place = "B_b + k0 * sBr + l0 + s * MR", "1", "sBr"
                        packed = "Bt + (long)s * SLIVER(kc)"
                        _sliver_call(
                            w, spec.kernel, "kc", "direct_b", place, packed, "a, c, NR", room=True
                        )
                    if not spec.b_transposed:
                        w.line("cf_pf_step(&pf, pf_rows);")
                if spec.epilogue not in (Epilogue.NONE, Epilogue.RELU):
                    w.line("/* the strip's scores are complete and in L1: f on them now */")
                    with w.block("if (k0 + kc >= K)"):
                        _epilogue_strip(w, spec, bool(spec.kernel.part_cols) and in_place)
        w.line("/* op2: Eᵀ[n_o, m_o] (+)= Dᵀ[n_o, l_o] . Pᵀ[l_o, m_o] */")
        if _softmax_to_e(spec):
            w.line("/* the last l block straight into E: its rows final there, stored over their")
            w.line("   sums (inv, the sums' inverses) with no pass of their own after it */")
            w.line("const int last_l = to_e && l0 + T_L >= l_end;")
            with w.block("if (last_l)"):
                _invert_sums(w)
        with w.block("for (long n0 = 0; n0 < N; n0 += T_N)"):
            w.line("const int nc = (int)(N - n0 < T_N ? N - n0 : T_N);")
            w.line("/* (whole slivers read in place below when direct_d) */")
            if _to_e(spec):
                w.line("if (to_e) cf_pack_b_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt);")
                w.line("else cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt, !direct_d);")
            elif softmax:
                w.line("/* (or packed for an earlier row block of this batch: reuse_d) */")
                w.line("float* restrict Dn = Dt + (reuse_d ? n0 / T_N * DTF : 0);")
                to_e = "!to_e && " if _softmax_to_e(spec) else ""
                w.line(
                    f"if ({to_e}fresh_d) cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dn, !direct_d);"
                )
            else:
                w.line("cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt, !direct_d);")
            if spec.b_transposed:
                # B is read in place by rows of l (attention's K: a new head's from L3 once, then
                # from L2), the next l block's too, and so is D in the row blocks of attention's
                # plans (direct_d); what waits on its loads is the packing of the next row
                # block's Aᵀ (Q), which reads its rows a few floats at a time. Measured on Zen 3,
                # 1 thread, interleaved: the 12 paper workloads 0.95-0.995 of the time without;
                # the next head's K asked for as well took 1 % more than Q alone
                w.line("/* what is packed next: the next row block's Aᵀ (below) */")
                w.line("cf_pf pf;")
                w.line("if (n0 + nc < N || l0 + T_L < l_end) cf_pf_set(&pf, D_b, 0, 0, 0);")
                next_b = ""
            else:
                w.line("/* the panel packed next: D's next n block, or B's for the next l block */")
                w.line("cf_pf pf;")
                w.line(
                    "if (n0 + nc < N) cf_pf_set(&pf, D_b + l0 * sDl + n0 + nc, sDl, lc,"
                    " N - n0 - nc < T_N ? N - n0 - nc : T_N);"
                )
                w.line(
                    "else if (l0 + T_L < l_end) cf_pf_set(&pf, B_b + l0 + T_L, sBr,"
                    " (int)TK, l_end - l0 - T_L < T_L ? l_end - l0 - T_L : T_L);"
                )
                next_b = (
                    "if (q0 != b0 || q1 != b1) cf_pf_then(&pf, B + q0 * sB0 + q1 * sB1"
                    " + l_lo, sBr, (int)TK, l_end - l_lo < T_L ? l_end - l_lo : T_L);"
                )
            with w.block("else"):
                whose = "" if spec.b_transposed else ", and its B if another batch's"
                if spec.b_transposed:
                    # the store at the row block's end wrote lines of a new output that came
                    # from L3 or DRAM and waited on them (the store took 3 % of bert-base's
                    # time). Measured on Zen 3, 1 thread, interleaved: 0.97-1.0 of the time with
                    # them asked for here
                    w.line("/* this row block's E, which the store at its end writes, then the")
                    w.line("   next row block's A: packed first */")
                    w.line("cf_pf_set(&pf, E_b, sEm, mc, N);")
                else:
                    w.line(f"/* the next row block's A{whose}: packed first */")
                w.line("long nm0 = m0 + T_M, nblk = blk;")
                with w.block("if (nm0 >= mo_end)"):
                    w.line("/* claimed now, so that its panels are fetched while this one ends */")
                    w.line("if (nxt < 0) nxt = cf_claim(&next_blk);")
                    w.line("nblk = nxt;")
                    w.line("nm0 = (nblk % mblocks) * T_MO;")
                with w.block("if (nblk < last)"):
                    w.line("const long q0 = nblk / (nb1 * mblocks), q1 = (nblk / mblocks) % nb1;")
                    w.line("const int rows = (int)(M - nm0 < T_M ? M - nm0 : T_M);")
                    then = "then" if spec.b_transposed else "set"
                    w.line(
                        f"cf_pf_{then}(&pf, A + q0 * sA0 + q1 * sA1 + nm0 * sAm, sAm, rows, TK);"
                    )
                    if next_b:
                        w.line(next_b)
                if not spec.b_transposed:
                    w.line("else cf_pf_set(&pf, D_b, 0, 0, 0);")
            w.line(
                "const int pf_rows = cf_pf_share(&pf, (mc + NR - 1) / NR * ((nc + MR - 1) / MR));"
            )
            if _to_e(spec) or _softmax_to_e(spec):
                with w.block("if (to_e)"):
                    # (in place: nc = N = NR, one strip, rows NR apart)
                    d = "D_b + l0 * sDl" if _softmax_to_e(spec) else "Dt + (long)s * lc * NR"
                    if wide_heads(spec):
                        with w.block("if (N != NR || sDl != NR)"):
                            _op2_wide(w, spec)
                        with w.block("else"):
                            _op2_to_e(w, spec, d)
                    else:
                        _op2_to_e(w, spec, d)
                with w.block("else"):
                    _op2_to_et(w, spec)
            else:
                _op2_to_et(w, spec)
    written = " (or E as op2 wrote it)" if _softmax_to_e(spec) else ""
    w.line(
        f"/* E[m_o, :] = Eᵀ transposed{written}"
        + (", each row over its softmax sum */" if softmax else " */")
    )
    if _softmax_to_e(spec):
        w.line("/* (to_e: op2 of the last l block stored E's rows over their sums) */")
        with w.block("if (!to_e)"):
            _invert_sums(w)
            w.line(f"{spec.name}_store_e(mc, N, Et, col_sum, E_b, sEm, LDE);")
    elif softmax:
        _invert_sums(w)
        w.line(f"{spec.name}_store_e(mc, N, Et, col_sum, E_b, sEm, LDE);")
    else:
        w.line("/* (split l: the second pass adds the shares up and stores them) */")
        cond = "split == 1 && !to_e" if _to_e(spec) else "split == 1"
        w.line(f"if ({cond}) {spec.name}_store_e(mc, N, Et, 0, E_b, sEm, LDE);")


def _invert_sums(w: Writer) -> None:
    """The row block's softmax sums replaced by their inverses (0 for a row with none), what
    E's rows are multiplied by."""
    with w.block("for (int i = 0; i < mc; ++i)"):
        w.line("col_sum[i] = col_sum[i] > 0.0f ? 1.0f / col_sum[i] : 0.0f;")


def _rows_call(w: Writer, spec: GemmChainSpec) -> None:
    """A row block of at most `rows_max` rows of m (`row_path_rows`; decoding: one query or a
    group of them; an MLP's one token; a tail block) goes to `<name>_rows`: in the tiled path its
    rows would fill 1-8 of the micro-kernel's nr columns, and the other FMAs of every call would
    be spent on padding. Threads that split l (one block, several threads) each add their share
    into their Eᵀ, for the second pass to sum as it sums the tiled path's."""
    with w.block("if (mc <= rows_max)"):
        _rows_invoke(w, spec, "mc", "m0", "l_end")
        w.line("continue;")


def _rows_invoke(w: Writer, spec: GemmChainSpec, rows: str, first: str, l_end: str) -> None:
    """`<name>_rows` on `rows` rows of m from `first`, keys up to `l_end`."""
    mask = "0, 0, 0"
    if spec.mask is not MaskKind.NONE:
        elem = "cf_elem" if spec.mask is MaskKind.ADDITIVE else "unsigned char"
        mask = f"(const {elem}*)mask_data + b0 * sM0 + b1 * sM1, sMm, sMl"
    softmax = spec.epilogue is Epilogue.SOFTMAX
    scale = "scale2" if softmax else "1.0f"
    et = "0" if softmax else "split > 1 ? Et : 0"
    w.line(
        f"{spec.name}_rows({rows}, {first}, K, N, l_lo, {l_end}, A + b0 * sA0 + b1 * sA1"
        f" + ({first}) * sAm, sAm, B + b0 * sB0 + b1 * sB1, sBr, D + b0 * sD0 + b1 * sD1, sDl,"
        f" E + b0 * sE0 + b1 * sE1 + ({first}) * sEm, sEm, {scale}, {mask}, rows_q, rows_o,"
        f" rows_w, {et}, LDE);"
    )


def _rows(w: Writer, spec: GemmChainSpec) -> None:
    """`<name>_rows`: the chain for `mc` <= ROWS_MAX rows of m (from `m0`) of one batch index
    over l in [l_lo, l_end), without the micro-kernel: each row of B (attention's K) is read
    once for all the rows' dot products (vectorised along k; a B stored [k, l] is added in row
    by row, vectorised along l), f runs on ROWS_LB scores at a time (a softmax as the tiled
    path's online one: base 2, running max and rescaled sum, masks applied first), and D's rows
    are added into the rows' accumulators (vectorised along n). Decoding and a single token's
    MLP read B and D once per block of rows, at the speed memory gives. The result goes into
    E, or, with `et` (threads that split l), into Eᵀ (row stride `lde`) for the second pass.
    Optimised at -O2 (gcc; other compilers ignore the attribute): 0.3 s less compile than at
    -O3, and as fast (measured on Zen 1, interleaved: 0.93-1.05 of the -O3 time)."""
    softmax = spec.epilogue is Epilogue.SOFTMAX
    with w.block(
        f'static __attribute__((noinline, optimize("O2"))) void {spec.name}_rows(int mc,\n'
        "    long m0, long K, long N,"
        " long l_lo, long l_end, const cf_elem* restrict A_b, long sAm,"
        " const cf_elem* restrict B_b,\n    long sBr, const cf_elem* restrict D_b, long sDl,"
        " cf_elem* restrict E_b, long sEm,\n    float qscale, const void* mask_b, long sMm,"
        " long sMl, float* restrict q, float* restrict o,\n    float* restrict wide, float* restrict et,"
        " long lde)"
    ):
        if spec.mask is MaskKind.NONE:
            w.line("(void)mask_b; (void)sMm; (void)sMl; (void)m0;")
        if spec.dtype not in HALF:
            w.line("(void)wide; /* (16-bit rows are widened into it once for all the rows) */")
        w.line("float s[ROWS_MAX][ROWS_LB] __attribute__((aligned(32)));")
        if softmax:
            w.line("float cmax[ROWS_MAX], csum[ROWS_MAX];")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line("/* the row of A (softmax: scaled into base 2, as the tiled path packs it) */")
            w.line(
                "for (long k = 0; k < K; ++k) q[i * K + k] = CF_LOAD(A_b[i * sAm + k]) * qscale;"
            )
            w.line("for (long n = 0; n < N; ++n) o[i * N + n] = 0.0f;")
            if softmax:
                w.line("cmax[i] = -INFINITY;")
                w.line("csum[i] = 0.0f;")
        with w.block("for (long l0 = l_lo; l0 < l_end; l0 += ROWS_LB)"):
            w.line("const int lb = (int)(l_end - l0 < ROWS_LB ? l_end - l0 : ROWS_LB);")
            half = spec.dtype in HALF
            if spec.b_transposed:
                _rows_scores_by_key(w, half)
            else:
                _rows_scores_by_k(w, half)
            with w.block("for (int i = 0; i < mc; ++i)"):
                w.line("float* restrict si = s[i];")
                if softmax:
                    _rows_softmax(w, spec)
                elif spec.epilogue is Epilogue.RELU:
                    w.line("/* as the micro-kernel's max(x, 0) (which gives 0 for NaN) */")
                    w.line("for (int l = 0; l < lb; ++l) si[l] = si[l] > 0.0f ? si[l] : 0.0f;")
                elif spec.epilogue is Epilogue.GELU:
                    w.line("#pragma omp simd")
                    with w.block("for (int l = 0; l < lb; ++l)"):
                        w.line(
                            "si[l] = 0.5f * si[l] * (1.0f + cf_erf(si[l] * 0.70710678118654752f));"
                        )
                else:
                    w.line("(void)si;")
            _rows_add_d(w, half)
        with w.block("for (int i = 0; i < mc; ++i)"):
            if softmax:
                w.line("const float inv = csum[i] > 0.0f ? 1.0f / csum[i] : 0.0f;")
                w.line(
                    "for (long n = 0; n < N; ++n) E_b[i * sEm + n] = CF_STORE(o[i * N + n] * inv);"
                )
            else:
                w.line("if (et) for (long n = 0; n < N; ++n) et[n * lde + i] = o[i * N + n];")
                w.line(
                    "else for (long n = 0; n < N; ++n) E_b[i * sEm + n] = CF_STORE(o[i * N + n]);"
                )
        if softmax:
            w.line("(void)et; (void)lde;")


def _rows_softmax(w: Writer, spec: GemmChainSpec) -> None:
    """`_rows`' online softmax of row i's `lb` scores `si` (masks first), its accumulator
    rescaled by exp(old max - new max)."""
    if spec.mask is MaskKind.ADDITIVE:
        w.line("const cf_elem* restrict mk = (const cf_elem*)mask_b + (m0 + i) * sMm;")
        w.line("for (int l = 0; l < lb; ++l) si[l] += cf_mask2(CF_LOAD(mk[(l0 + l) * sMl]));")
    elif spec.mask is MaskKind.BOOL:
        w.line("const unsigned char* restrict mk = (const unsigned char*)mask_b + (m0 + i) * sMm;")
        w.line("for (int l = 0; l < lb; ++l) si[l] = mk[(l0 + l) * sMl] ? si[l] : -INFINITY;")
    if spec.causal:
        w.line("/* keys after the query (l > m): the caller's l_end ends at the block's last */")
        w.line("for (int l = 0; l < lb; ++l) si[l] = l0 + l > m0 + i ? -INFINITY : si[l];")
    w.line("float mx = -INFINITY;")
    w.line("/* (vectorised: a max reduction's lanes start at -inf; each passes NaN over) */")
    w.line("#pragma omp simd reduction(max:mx)")
    w.line("for (int l = 0; l < lb; ++l) mx = si[l] > mx ? si[l] : mx;")
    w.line("const float m_new = mx > cmax[i] ? mx : cmax[i];")
    w.line("/* a row with nothing but -inf so far keeps zero mass */")
    w.line("const float shift = m_new == -INFINITY ? 0.0f : m_new;")
    w.line("const float alpha = cmax[i] == -INFINITY ? 0.0f : cf_exp2_neg(cmax[i] - shift);")
    w.line("cmax[i] = m_new;")
    w.line("float sum = 0.0f;")
    w.line("#pragma omp simd reduction(+:sum)")
    with w.block("for (int l = 0; l < lb; ++l)"):
        w.line("const float e = cf_exp2_neg(si[l] - shift);")
        w.line("si[l] = e;")
        w.line("sum += e;")
    w.line("csum[i] = csum[i] * alpha + sum;")
    w.line("if (alpha != 1.0f) for (long n = 0; n < N; ++n) o[i * N + n] *= alpha;")


def _rows_add_d(w: Writer, half: bool) -> None:
    """`_rows`' second GEMM: D's rows times the rows' values of f, into the accumulators."""
    _rows_add_rows(w, "l", "lb", "D_b + (l0 + l) * sDl", "sDl", "s[i][l + {j}]", "o + i * N", "N",
                   half)  # fmt: skip


def _rows_add_rows(
    w: Writer, at: str, count: str, row: str, stride: str, weight: str, acc: str, width: str,
    half: bool,
) -> None:  # fmt: skip
    """For `at` over [0, count): `acc` (row i's accumulator, `width` floats) += `weight` (of
    row i and `at` + {j}) times the row of an operand at `row` (`stride` apart from the next),
    four rows at a time (each accumulator loaded and stored once per four, not once per row: a
    store-to-load wait each time), then one at a time. 16-bit rows (`half`) are widened into
    `wide` first, once for all the rows i: the loops then vectorise as fp32's do (an fp16
    conversion inside them kept them scalar)."""
    w.line(f"long {at} = 0;")
    with w.block(f"for (; {at} + 4 <= {count}; {at} += 4)"):
        if half:
            w.line(f"const cf_elem* restrict h0 = {row};")
            for j in range(4):
                w.line(f"float* restrict r{j} = wide + {j} * {width};")
                w.line(f"cf_widen(h0 + {j} * {stride}, r{j}, {width});")
        else:
            w.line(f"const cf_elem* restrict r0 = {row};")
            for j in range(1, 4):
                w.line(f"const cf_elem* restrict r{j} = r{j - 1} + {stride};")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line(f"const float w0 = {weight.format(j=0)}, w1 = {weight.format(j=1)};")
            w.line(f"const float w2 = {weight.format(j=2)}, w3 = {weight.format(j=3)};")
            w.line(f"float* restrict a = {acc};")
            w.line("#pragma omp simd")
            with w.block(f"for (long x = 0; x < {width}; ++x)"):
                load = "{}" if half else "CF_LOAD({})"
                terms = [f"w{j} * " + load.format(f"r{j}[x]") for j in range(4)]
                w.line(f"a[x] += {' + '.join(terms)};")
    with w.block(f"for (; {at} < {count}; ++{at})"):
        if half:
            w.line("float* restrict r0 = wide;")
            w.line(f"cf_widen({row}, r0, {width});")
        else:
            w.line(f"const cf_elem* restrict r0 = {row};")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line(f"const float w0 = {weight.format(j=0)};")
            w.line(f"float* restrict a = {acc};")
            w.line("#pragma omp simd")
            load = "r0[x]" if half else "CF_LOAD(r0[x])"
            w.line(f"for (long x = 0; x < {width}; ++x) a[x] += w0 * {load};")


def _rows_scores_by_key(w: Writer, half: bool) -> None:
    """`_rows`' scores when K is stored [l, k] (attention): dot products along k (16-bit keys
    widened into `wide` first, once for all the rows)."""
    w.line("/* four keys at a time: four independent FMA chains (one waits on its")
    w.line("   latency), their rows read from L1 for every query; past the last key the")
    w.line("   group re-reads it, and those scores are not kept */")
    with w.block("for (int l = 0; l < lb; l += 4)"):
        if half:
            w.line("const cf_elem* restrict h0 = B_b + (l0 + l) * sBr;")
            for j in range(4):
                w.line(f"float* restrict k{j} = wide + {j} * K;")
                last = "h0" if j == 0 else f"l + {j} < lb ? h0 + {j} * sBr : h0"
                w.line(f"cf_widen({last}, k{j}, K);")
        else:
            w.line("const cf_elem* restrict k0 = B_b + (l0 + l) * sBr;")
            w.line("const cf_elem* restrict k1 = l + 1 < lb ? k0 + sBr : k0;")
            w.line("const cf_elem* restrict k2 = l + 2 < lb ? k0 + 2 * sBr : k0;")
            w.line("const cf_elem* restrict k3 = l + 3 < lb ? k0 + 3 * sBr : k0;")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line("float a[4];")
            w.line("cf_dot4(K, q + i * K, k0, k1, k2, k3, a); /* (fp32 or widened rows) */")
            w.line("if (l + 4 <= lb) memcpy(&s[i][l], a, sizeof a); /* (one vector store) */")
            with w.block("else"):
                w.line("s[i][l] = a[0];")
                w.line("if (l + 1 < lb) s[i][l + 1] = a[1];")
                w.line("if (l + 2 < lb) s[i][l + 2] = a[2];")


def _rows_scores_by_k(w: Writer, half: bool) -> None:
    """`_rows`' scores when B is stored [k, l] (GEMM chains): rows of B added in, vectorised
    along l."""
    with w.block("for (int i = 0; i < mc; ++i)"):
        w.line("for (int l = 0; l < lb; ++l) s[i][l] = 0.0f;")
    _rows_add_rows(w, "k", "K", "B_b + k * sBr + l0", "sBr", "q[i * K + k + {j}]", "s[i]", "lb",
                   half)  # fmt: skip


def _sliver_call(
    w: Writer,
    kernel: MicroKernel,
    kc: str,
    direct: str,
    place: tuple[str, str, str],
    packed: str,
    rest: str,
    room: bool = False,
) -> None:
    """One call site of the micro-kernel for an mr-row sliver of the A operand, read in place
    when `direct` (at `place`: pointer, row and step strides) or packed at `packed`; `rest` is
    the B operand, C and ldc. One inlined copy of the register block instead of two (each costs
    compile time); a short sliver (m < MR) is packed, unless it has exactly the kernel's
    `part_rows` rows (`PART_MR`: `<uk>_tail` reads only those, in place). A kernel with narrow
    blocks (`part_cols`) computes `nw` columns of the strip, the rest set to zero (`<uk>_cols`).
    With `room` (C has rows for a whole block past the sliver's, which nothing reads), a packed
    short sliver runs the part or the whole block straight into C."""
    uk = kernel.name
    ptr, rs, ks = place
    entry, cols = (f"{uk}_cols", "nw") if kernel.part_cols else (f"{uk}_strided", "NR")
    # (condition or None for the last, statement) in order: if / else if / else
    branches: list[tuple[str | None, str]] = []
    if kernel.part_rows:  # exactly its rows: <uk>_tail reads only those
        branches.append(
            (
                f"{direct} && m == PART_MR",
                f"{uk}_tail({kc}, {ptr}, {rs}, {ks}, {rest}, m, NR, acc);",
            )
        )
    if room:
        # C has room for the kernel's rows below the sliver's m (op1's strip of scores: LPM
        # rows, of which lc are read): the packed sliver, zero below m, runs the part block or
        # the whole one straight into C (its rows past m come out zero); <uk>_tail ran the
        # whole block into a tile on the stack and copied m rows out
        if kernel.part_rows:
            branches.append(
                ("m <= PART_MR", f"{uk}_tail({kc}, {packed}, 1, MR, {rest}, PART_MR, NR, acc);")
            )
        branches.append((None, f"{entry}({kc}, {packed}, 1, MR, {rest}, {cols}, acc);"))
    else:
        branches.append((None, f"{uk}_tail({kc}, {packed}, 1, MR, {rest}, m, NR, acc);"))
    with w.block("if (m == MR)"):
        w.line(f"const float* restrict as = {direct} ? {ptr} : {packed};")
        rows = rs if rs == "1" else f"{direct} ? {rs} : 1"
        w.line(f"{entry}({kc}, as, {rows}, {direct} ? {ks} : MR, {rest}, {cols}, acc);")
    word = "else if"
    for condition, statement in branches:
        w.line(f"{word} ({condition}) {statement}" if condition else f"else {statement}")
        word = "else if"


def _reuse_d(w: Writer, spec: GemmChainSpec) -> None:
    """`reuse_d`: whether this row block packs all of D's l block (every n block: `CF_DTN`) and
    leaves it in the workspace for the next row blocks of its batch, which then pack nothing
    (`fresh_d` false). A head's V is packed once per thread, not once per row block or read in
    place by every one: in place, each step of op2's micro-kernel reads a new cache line of V and
    uses six of its 16 floats, and the next row block reads the same lines again.
    Only where D's l block is the row block's whole range of keys (a causal chain's grows from
    one row block to the next) and another row block of the batch follows (M > T_M), or D is
    the same for every batch index. Measured on Zen 3 (AVX2, 1 thread, interleaved against the
    kernel that read V in place, or packed it for each row block where it had more than 8
    strips): the 12 paper workloads 0.944-0.982 of the time (geomean 0.962), vit-huge-14 and -16
    (T_N = 40: two packed blocks) 0.969 and 0.956; packing it for each row block instead took
    1.00-1.04."""
    if spec.causal:
        w.line("const int reuse_d = 0, fresh_d = 1; /* (causal: l_end moves with m0) */")
        return
    to_e = "!to_e && " if _softmax_to_e(spec) else ""
    w.line("/* all of D packed once for the row blocks of this batch (see _reuse_d in c.py) */")
    w.line(
        f"const int reuse_d = {to_e}l_end > l_lo && l_end - l_lo <= T_L && DTN * T_N >= N"
        " && (M > T_M || (sD0 == 0 && sD1 == 0));"
    )
    w.line("/* (l_lo and l_end are the call's own here: the same for every row block) */")
    w.line("const int fresh_d = !reuse_d || dt_from != D_b + l_lo * sDl;")
    w.line("dt_from = reuse_d ? D_b + l_lo * sDl : 0;")


def _op2_to_et(w: Writer, spec: GemmChainSpec) -> None:
    """op2 of one l block and n block into the Eᵀ accumulator: rows n (Dᵀ slivers, or D read
    in place), columns m (Pᵀ's strips)."""
    uk = spec.kernel.name
    dt = "Dn" if spec.epilogue is Epilogue.SOFTMAX else "Dt"  # (this n block's: reuse_d)
    in_place = spec.dtype is DType.FLOAT32
    w.line("/* whole strips again: Eᵀ has MPN columns, the store reads the first mc */")
    with w.block("for (int j = 0; j * NR < mc; ++j)"):
        w.line("const int acc = l0 > l_lo;")
        w.line("const float* restrict p = Pt + (long)j * LPM * NR;")
        if spec.kernel.part_cols and in_place:
            w.line("const int nw = CF_NW(mc - j * NR); /* (a tail strip: its columns) */")
        with w.block("for (int s = 0; s * MR < nc; ++s)"):
            w.line("const int m = nc - s * MR < MR ? nc - s * MR : MR;")
            w.line("float* restrict c = Et + (n0 + s * MR) * LDE + j * NR;")
            if not in_place:
                w.line(f"{uk}(lc, {dt} + (long)s * SLIVER(lc), p, c, LDE, m, NR, acc);")
            else:
                place = "D_b + l0 * sDl + n0 + s * MR", "1", "sDl"
                packed = f"{dt} + (long)s * SLIVER(lc)"
                _sliver_call(w, spec.kernel, "lc", "direct_d", place, packed, "p, c, LDE")
            w.line("cf_pf_step(&pf, pf_rows);")


def _op2_to_e(w: Writer, spec: GemmChainSpec, strip: str) -> None:
    """op2 of one l block and n block straight into E: rows m, mr at a time within each of Pᵀ's
    nr-column strips, columns n from D's nr-column strips, strip `s` at `strip` (packed by
    `pack_strips.c`, or D itself, `_softmax_to_e`)."""
    uk = spec.kernel.name
    scaled = _softmax_to_e(spec)  # (last_l: each row over its sum as it is stored)
    with w.block("for (int j = 0; j * NR < mc; ++j)"):
        w.line("const int acc = l0 > l_lo;")
        w.line("const float* restrict p = Pt + (long)j * LPM * NR;")
        if scaled:
            w.line("const float* restrict inv = last_l ? col_sum + j * NR : 0;")
        with w.block("for (int s = 0; s * NR < nc; ++s)"):
            w.line("const int n = nc - s * NR < NR ? nc - s * NR : NR;")
            w.line(f"const float* restrict d = {strip};")
            with w.block("for (int r = 0; r < NR && j * NR + r < mc; r += MR)"):
                w.line("int m = NR - r < MR ? NR - r : MR;")
                w.line("if (mc - j * NR - r < m) m = mc - j * NR - r;")
                w.line("float* restrict e = E_b + (j * NR + r) * sEm + n0 + s * NR;")
                full = (
                    f"{uk}_full_rs(lc, p + r, 1, NR, d, e, sEm, acc, inv ? inv + r : 0);"
                    if scaled
                    else f"{uk}_strided(lc, p + r, 1, NR, d, e, sEm, NR, acc);"
                )
                w.line(f"if (m == MR && n == NR) {full}")
                w.line("/* (a short block's tail reads the kernel's mr rows, or its part: rows")
                w.line("   of the next strip's rows at worst, inside the workspace, discarded) */")
                tail = f"{uk}_tail(lc, p + r, 1, NR, d, e, sEm, m, n, acc);"
                if scaled:
                    with w.block("else"):
                        w.line(tail)
                        with w.block("if (inv)"), w.block("for (int i = 0; i < m; ++i)"):
                            w.line("for (int x = 0; x < n; ++x) e[i * sEm + x] *= inv[r + i];")
                else:
                    w.line(f"else {tail}")
                w.line("cf_pf_step(&pf, pf_rows);")


def _op2_wide(w: Writer, spec: GemmChainSpec) -> None:
    """op2 of one l block straight into E with a whole value head of N columns (`wide_heads`)
    in registers: rows m, `wide_mr` at a time within each of Pᵀ's nr-column strips (P's values
    broadcast, rows NR apart), V's rows read in place. Each element of E sums over l in the
    order the Eᵀ accumulator's does: bit-identical."""
    ker = spec.kernel
    calls = [(f"N == {c}", f"{ker.name}_wide{c}(lc, p + r, NR, D_b + l0 * sDl, sDl, e, sEm, m, acc,"
              " inv ? inv + r : 0);") for c in _named_heads(ker)]  # fmt: skip
    if wide_multiples(ker):  # (to_e: a multiple of NR) NR columns at a time
        calls.append(
            (
                "1",
                "for (long c = 0; c < N; c += NR)"
                f" {ker.name}_wide{ker.nr}(lc, p + r, NR, D_b + l0 * sDl + c, sDl, e + c, sEm, m,"
                " acc, inv ? inv + r : 0);",
            )
        )
    with w.block("for (int j = 0; j * NR < mc; ++j)"):
        w.line("const int acc = l0 > l_lo;")
        w.line("const float* restrict p = Pt + (long)j * LPM * NR;")
        w.line("const int live = mc - j * NR < NR ? mc - j * NR : NR;")
        w.line("const float* restrict inv = last_l ? col_sum + j * NR : 0;")
        w.line(f"/* (a short block of the last strip reads all {ker.wide_mr} columns of P, which")
        w.line("   op1 computed: a tail strip's nw is whole vectors; it stores its rows alone) */")
        with w.block(f"for (int r = 0; r < live; r += {ker.wide_mr})"):
            w.line(f"const int m = live - r < {ker.wide_mr} ? live - r : {ker.wide_mr};")
            w.line("float* restrict e = E_b + (j * NR + r) * sEm;")
            for i, (cond, call) in enumerate(calls):
                test = "" if i == len(calls) - 1 else f"if ({cond}) "
                lead = "" if i == 0 else "else "
                w.line(f"{lead}{test}{call}")
            w.line("cf_pf_step(&pf, pf_rows);")


def _store_e(w: Writer, spec: GemmChainSpec) -> None:
    """`<name>_store_e`: E[0:mc, :] = Eᵀ transposed, row i times inv_sum[i] after a softmax.
    A function of its own, kept out of line: inside the kernel's one big function its loops
    tripled the compile time (register allocation there grows faster than the code)."""
    softmax = spec.epilogue is Epilogue.SOFTMAX
    with w.block(
        f"static __attribute__((noinline)) void {spec.name}_store_e(int mc, long N,\n"
        "    const float* restrict Et, const float* restrict inv_sum, cf_elem* restrict E_b,"
        " long sEm,\n    long LDE)"
    ):
        if not softmax:
            w.line("(void)inv_sum;")
        scaled = " * inv" if softmax else ""
        first = "0"
        tb = spec.kernel.transpose_block
        uk = spec.kernel.name
        if tb:
            w.line(f"/* whole {tb}-row groups: {tb}x{tb} blocks of Eᵀ transposed in registers */")
            w.line(f"const int whole = mc / {tb} * {tb};")
            with w.block(f"for (int i = 0; i < whole; i += {tb})"):
                w.line("long c = 0;")
                with w.block(f"for (; c + {tb} <= N; c += {tb})"):
                    if spec.dtype is DType.FLOAT32:  # straight into E, scaled on the way
                        w.line("float* restrict e = E_b + i * sEm + c;")
                        if softmax:
                            w.line(
                                f"{uk}_transpose_scaled(Et + c * LDE + i, LDE, e, sEm, inv_sum + i);"
                            )
                        else:
                            w.line(f"{uk}_transpose(Et + c * LDE + i, LDE, e, sEm);")
                    else:  # through a block on the stack, rounded to bf16/fp16 on the way out
                        w.line(f"float blk[{tb * tb}] __attribute__((aligned(32)));")
                        w.line(f"{uk}_transpose(Et + c * LDE + i, LDE, blk, {tb});")
                        with w.block(f"for (int r = 0; r < {tb}; ++r)"):
                            _e_row(w, softmax, "i + r")
                            w.line(
                                f"for (int cc = 0; cc < {tb}; ++cc) e[c + cc] = CF_STORE(blk[r * {tb} + cc]{scaled});"
                            )
                with w.block(f"for (int r = 0; r < {tb}; ++r)"):
                    _e_row(w, softmax, "i + r")
                    w.line(
                        f"for (long c2 = c; c2 < N; ++c2) e[c2] = CF_STORE(Et[c2 * LDE + i + r]{scaled});"
                    )
            first = "whole"
        w.line(
            "/* row by row: E is written contiguously, and the N lines of Eᵀ a row reads stay in L1"
        )
        w.line("   for the next rows */")
        with w.block(f"for (int i = {first}; i < mc; ++i)"):
            _e_row(w, softmax, "i")
            with w.block("for (long c = 0; c < N; ++c)"):
                w.line(f"e[c] = CF_STORE(Et[c * LDE + i]{scaled});")


def _e_row(w: Writer, softmax: bool, row: str) -> None:
    """Row `row` of E, and the factor its values take after a softmax."""
    w.line(f"cf_elem* restrict e = E_b + ({row}) * sEm;")
    if softmax:
        w.line(f"const float inv = inv_sum[{row}];")


def _exp_strip(w: Writer, exp: str, width: str) -> None:
    """The strip's scores exponentiated in place by `exp` (of row r, column i), summed by
    column: its first `width` columns."""
    with w.block("for (int r = 0; r < lc; ++r)"):
        w.line("#pragma omp simd")
        with w.block(f"for (int i = 0; i < {width}; ++i)"):
            w.line(f"const float e = {exp};")
            w.line("p[r * NR + i] = e;")
            w.line("sum[i] += e;")


def _masked_rows(
    w: Writer,
    spec: GemmChainSpec,
    first: str,
    at: str,
    per_row: bool,
    width: str,
    added: bool = False,
) -> None:
    """The strip's rows from `first`: scores masked (the mask at offset `at` of mask_b: read once
    a row when `per_row`; already `added` to them), causal compare, their maxima by column (the
    first `width` columns)."""
    changed = (spec.mask is not MaskKind.NONE and not added) or spec.causal  # (p rewritten)
    with w.block(f"for (int r = {first}; r < lc; ++r)"):
        if spec.mask is MaskKind.ADDITIVE and per_row:
            w.line(f"const float add = cf_mask2(CF_LOAD(mask_b[{at}]));")
        elif spec.mask is MaskKind.BOOL and per_row:
            w.line(f"const int keep = mask_b[{at}] != 0;")
        if spec.mask is MaskKind.NONE or per_row or added:
            w.line("#pragma omp simd")
        with w.block(f"for (int c = 0; c < {width}; ++c)"):
            w.line("float v = p[r * NR + c]; /* scaled: Aᵀ was packed times scale log2(e) */")
            if spec.mask is MaskKind.ADDITIVE and not added:
                w.line("v += add;" if per_row else f"v += cf_mask2(CF_LOAD(mask_b[{at}]));")
            elif spec.mask is MaskKind.BOOL and not added:
                w.line(
                    "v = keep ? v : -INFINITY;" if per_row else f"v = mask_b[{at}] ? v : -INFINITY;"
                )
            if spec.causal:
                w.line("v = l0 + r > q[c] ? -INFINITY : v;")
            if changed:
                w.line("p[r * NR + c] = v;")
            w.line("mx[c] = v > mx[c] ? v : mx[c];")


def _epilogue_strip(w: Writer, spec: GemmChainSpec, narrow: bool) -> None:
    """f on strip `j` of the score tile (`lc` rows of NR columns), once its k blocks are done
    (a relu is not here: the micro-kernel applies it as it stores, `RELU_AT_STORE`). `narrow`:
    op2 reads only the `nw` columns of a tail strip, and the softmax runs on those alone."""
    if spec.epilogue is Epilogue.GELU:
        w.line("/* gelu on the strip */")
        w.line("float* restrict p = Pt + (long)j * LPM * NR;")
        w.line("#pragma omp simd")
        with w.block("for (int x = 0; x < lc * NR; ++x)"):
            w.line("p[x] = 0.5f * p[x] * (1.0f + cf_erf(p[x] * 0.70710678118654752f));")
        return
    w.line("/* online softmax down each column (a row of the scores): new max, rescale what the")
    w.line("   sum and Eᵀ hold by exp(old max - new max), exponentiate the strip */")
    w.line("float* restrict p = Pt + (long)j * LPM * NR;")
    w.line("float* restrict cmax = col_max + j * NR;")
    w.line("float* restrict csum = col_sum + j * NR;")
    if not narrow:
        _softmax_strip(w, spec, "NR")
        return
    w.line("/* a tail strip: its nw columns alone, which is all op2 reads of it (a strip of 16")
    w.line("   queries at NR 64 exponentiated four times the scores it needs) */")
    with w.block("if (nw == NR)"):
        _softmax_strip(w, spec, "NR")
    with w.block("else"):
        _softmax_strip(w, spec, "nw")


def _softmax_strip(w: Writer, spec: GemmChainSpec, width: str) -> None:
    """`_epilogue_strip`'s softmax on the strip's first `width` columns (NR, or a tail
    strip's nw)."""
    w.line("float mx[NR], shift[NR], alpha[NR], sum[NR];")
    w.line(f"for (int c = 0; c < {width}; ++c) mx[c] = -INFINITY;")
    masked = spec.mask is not MaskKind.NONE or spec.causal
    if masked:
        w.line("/* the query (m) of each column; padding columns reuse the last valid one */")
        w.line("long q[NR];")
        w.line(
            f"for (int c = 0; c < {width}; ++c) q[c] = m0 + (j * NR + c < mc ? j * NR + c : mc - 1);"
        )
    first = "0"
    if spec.causal and spec.mask is MaskKind.NONE:
        w.line("/* causal alone: the rows of keys at or before the strip's first query are masked")
        w.line(
            "   for none of its columns (every row of a block below the diagonal): no compare */"
        )
        w.line("const long below = m0 + j * NR - l0 + 1;")
        w.line("const int free_rows = below < 0 ? 0 : below > lc ? lc : (int)below;")
        with w.block("for (int r = 0; r < free_rows; ++r)"):
            w.line("#pragma omp simd")
            with w.block(f"for (int c = 0; c < {width}; ++c)"):
                w.line("mx[c] = p[r * NR + c] > mx[c] ? p[r * NR + c] : mx[c];")
        first = "free_rows"
    if spec.mask is not MaskKind.NONE:
        w.line("/* a mask the same for every query (a key-padding mask: sMm 0) is one value a row")
        w.line("   of the strip, and the row's loop runs vectorised; else one gather an element */")
        w.line("if (sMm == 0)")
        _masked_rows(w, spec, first, "(l0 + r) * sMl", True, width)
        tb = spec.kernel.transpose_block
        bool_mask = spec.mask is MaskKind.BOOL
        # (a whole strip only: a tail strip takes the gathers)
        if tb and (bool_mask or spec.dtype is DType.FLOAT32) and width == "NR":
            w.line(
                "/* a mask along contiguous keys, a whole strip: its blocks transposed in registers"
            )
            w.line("   (a boolean one as 0 / -inf) and added row by row, then the rows' loop */")
            with w.block("else if (sMl == 1 && j * NR + NR <= mc)"):
                elem = "unsigned char" if bool_mask else "float"
                w.line(f"const {elem}* restrict rows = mask_b + (m0 + j * NR) * sMm + l0;")
                w.line(f"float blk[{tb * tb}] __attribute__((aligned(64)));")
                if bool_mask:
                    w.line(f"float raw[{tb * tb}] __attribute__((aligned(64)));")
                w.line("int r = 0;")
                with w.block(f"for (; r + {tb} <= lc; r += {tb})"):
                    with w.block(f"for (int c0 = 0; c0 < NR; c0 += {tb})"):
                        if bool_mask:
                            with w.block(f"for (int c = 0; c < {tb}; ++c)"):
                                w.line("#pragma omp simd")
                                with w.block(f"for (int i = 0; i < {tb}; ++i)"):
                                    w.line(f"raw[c * {tb} + i] = rows[(c0 + c) * sMm + r + i] ? "
                                           "0.0f : -INFINITY;")  # fmt: skip
                            w.line(f"{spec.kernel.name}_transpose(raw, {tb}, blk, {tb});")
                        else:
                            w.line(
                                f"{spec.kernel.name}_transpose(rows + c0 * sMm + r, sMm, blk, {tb});"
                            )
                        with w.block(f"for (int i = 0; i < {tb}; ++i)"):
                            w.line("#pragma omp simd")
                            with w.block(f"for (int c = 0; c < {tb}; ++c)"):
                                w.line("float* restrict pc = p + (r + i) * NR + c0 + c;")
                                if bool_mask:  # (a select: a score of inf is masked too)
                                    w.line(f"*pc = blk[i * {tb} + c] == 0.0f ? *pc : -INFINITY;")
                                else:
                                    w.line(f"*pc += cf_mask2(blk[i * {tb} + c]);")
                with w.block("for (; r < lc; ++r)"):
                    if bool_mask:
                        w.line("for (int c = 0; c < NR; ++c) p[r * NR + c] = rows[c * sMm + r] ? "
                               "p[r * NR + c] : -INFINITY;")  # fmt: skip
                    else:
                        w.line(
                            "for (int c = 0; c < NR; ++c) p[r * NR + c] += cf_mask2(rows[c * sMm + r]);"
                        )
                _masked_rows(w, spec, first, "", False, width, added=True)
        w.line("else")
    _masked_rows(w, spec, first, "q[c] * sMm + (l0 + r) * sMl", False, width)
    w.line("/* shifts: the new maxima rounded up to integers where they are below 2^21 in")
    w.line("   magnitude (every column of the strip: cf_exp2_from), else the maxima themselves;")
    w.line("   a column whose new maximum is at most LAZY_SHIFT above its integer shift keeps it")
    w.line("   (its exponentials stay below 2^LAZY_SHIFT), and Eᵀ is rescaled only when a")
    w.line("   column's shift moves */")
    w.line("int whole = 1, moved = 0;")
    with w.block(f"for (int c = 0; c < {width}; ++c)"):
        w.line("const float m_new = mx[c] > cmax[c] ? mx[c] : cmax[c];")
        w.line("whole &= m_new == -INFINITY || (m_new < 2097152.0f && m_new > -2097152.0f);")
        w.line("mx[c] = m_new;")
    with w.block(f"for (int c = 0; c < {width}; ++c)"):
        w.line("/* a column with nothing but -inf so far keeps zero mass */")
        w.line("const int keep = whole && cmax[c] != -INFINITY && mx[c] <= cmax[c] + LAZY_SHIFT;")
        w.line(
            "shift[c] = mx[c] == -INFINITY ? 0.0f : keep ? cmax[c] : whole ? ceilf(mx[c]) : mx[c];"
        )
        w.line(
            "alpha[c] = keep ? 1.0f : cmax[c] == -INFINITY ? 0.0f : cf_exp2_neg(cmax[c] - shift[c]);"
        )
        w.line("moved |= !keep;")
        w.line("cmax[c] = mx[c] == -INFINITY ? -INFINITY : shift[c];")
        w.line("sum[c] = 0.0f;")
    with w.block("if (whole)"):
        if _exp2_strip(spec) and width == "NR":
            w.line("cf_exp2_strip(p, lc, shift, sum);")
        else:
            w.line("float c[NR], lo[NR];")
            with w.block(f"for (int i = 0; i < {width}; ++i)"):
                w.line("c[i] = 12583039.0f - shift[i];")
                w.line("lo[i] = shift[i] - 127.0f;")
            _exp_strip(w, "cf_exp2_from(p[r * NR + i], c[i], lo[i])", width)
    with w.block("else"):
        _exp_strip(w, "cf_exp2_neg(p[r * NR + i] - shift[i])", width)
    with w.block(f"for (int c = 0; c < {width}; ++c)"):
        w.line("csum[c] = csum[c] * alpha[c] + sum[c];")
    _rescale_e(w, spec, width)


def _rescale_e(w: Writer, spec: GemmChainSpec, width: str) -> None:
    """Where a strip's shifts moved after its first l block: what Eᵀ (or E) holds of the strip's
    `width` columns times `alpha`."""
    with w.block("if (l0 > 0 && moved)"):
        if _softmax_to_e(spec):
            with w.block("if (to_e)"), w.block("for (int c = 0; c < NR && j * NR + c < mc; ++c)"):
                w.line("cf_elem* restrict e = E_b + (j * NR + c) * sEm;")
                w.line("for (long n = 0; n < N; ++n) e[n] *= alpha[c];")
            w.line("else")
        with w.block("for (long c2 = 0; c2 < N; ++c2)"):
            w.line("float* restrict et = Et + c2 * LDE + j * NR;")
            w.line(f"for (int c = 0; c < {width}; ++c) et[c] *= alpha[c];")
