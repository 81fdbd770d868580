"""The tiled path's softmax and GELU on a strip of scores (op1's output, in L1): the online
softmax down each column (masks, causal compare, lazy shifts, exponentials, Eᵀ rescaled), and
`cf_scores_strip`, which exponentiates each block of scores beside the next block's FMAs."""

from __future__ import annotations

from chainfuse.codegen.gemm_spec import Epilogue, GemmChainSpec, softmax_writes_e
from chainfuse.codegen.writer import Writer
from chainfuse.ir import DType, MaskKind
from chainfuse.kernels import scores_exp_parts

__all__ = [
    "LAZY_SHIFT",
    "SUM_CAP",
    "activation_c",
    "emit_epilogue_strip",
    "emit_invert_sums",
    "emit_scores_strip",
    "emit_scores_strip_call",
    "exponentiates_beside_op1",
    "uses_exp2_strip",
]


#: A tiled online softmax keeps a column's shift while the column's maximum stays at most this
#: far above it (base 2): exponentials below 2^LAZY_SHIFT, and Eᵀ rescaled only when some
#: column's shift moves; exact in float32 (docs/tuning.md)
LAZY_SHIFT = 8
#: `cf_scores_strip` rescales a column whose sum reached 2^SUM_CAP (to below 2), exponentiating
#: a strip's later blocks against its first block's shift (docs/tuning.md)
SUM_CAP = 16


def uses_exp2_strip(spec: GemmChainSpec) -> bool:
    """Whether a softmax strip's exponentials take the micro-kernel's `exp2_strip` hook
    (`cf_exp2_strip`) rather than the portable loop over cf_exp2_from."""
    return spec.epilogue is Epilogue.SOFTMAX and spec.kernel.exp2_strip is not None


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
        and spec.softcap is None
    )


def emit_scores_strip(w: Writer, spec: GemmChainSpec) -> None:
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
    the caller then computes the strip on its own pass, which takes every block's maximum."""
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


def emit_scores_strip_call(w: Writer, spec: GemmChainSpec) -> None:
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


def emit_invert_sums(w: Writer, spec: GemmChainSpec) -> None:
    """The row block's softmax sums replaced by their inverses, what E's rows are multiplied by;
    a row with no key (a sum of 0) gets 0 when the softmax is safe, else NaN."""
    empty = "0.0f" if spec.safe else "NAN"
    with w.block("for (int i = 0; i < mc; ++i)"):
        w.line(f"col_sum[i] = col_sum[i] > 0.0f ? 1.0f / col_sum[i] : {empty};")


def emit_epilogue_strip(w: Writer, spec: GemmChainSpec, narrow: bool) -> None:
    """f on strip `j` of the score tile (`lc` rows of NR columns), once its k blocks are done
    (a relu is not here: the micro-kernel applies it as it stores, `RELU_AT_STORE`). `narrow`:
    op2 reads only the `nw` columns of a tail strip, and the softmax runs on those alone."""
    if spec.epilogue is not Epilogue.SOFTMAX:
        word = spec.epilogue.value if spec.epilogue is not Epilogue.NONE else ""
        w.line(
            f"/* {'bias1, then ' if spec.bias1 else ''}{word} on the strip */".replace(
                ", then  ", " "
            )
        )
        w.line("float* restrict p = Pt + (long)j * LPM * NR;")
        if spec.gated:
            w.line("/* a gated MLP: f of the gate's scores times the up projection's */")
            w.line("const float* restrict p3 = P3t + (long)j * LPM * NR;")
            w.line("#pragma omp simd")
            with w.block("for (int x = 0; x < lc * NR; ++x)"):
                w.line("const float g = p[x];")
                w.line(f"p[x] = ({activation_c(spec.epilogue, 'g')}) * p3[x];")
            return
        if not spec.bias1:
            w.line("#pragma omp simd")
            with w.block("for (int x = 0; x < lc * NR; ++x)"):
                w.line(f"p[x] = {activation_c(spec.epilogue, 'p[x]')};")
            return
        with w.block("for (int r = 0; r < lc; ++r)"):
            w.line("const float b = CF_LOAD(bias1[l0 + r]); /* (a row of Pᵀ: one l) */")
            w.line("float* restrict row = p + r * NR;")
            w.line("#pragma omp simd")
            with w.block("for (int c = 0; c < NR; ++c)"):
                w.line("const float x = row[c] + b;")
                w.line(f"row[c] = {activation_c(spec.epilogue, 'x')};")
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


def activation_c(epilogue: Epilogue, x: str) -> str:
    """The C expression of a pointwise epilogue on the float `x` (a name: read several times).
    NaN propagates through each, as through PyTorch's (`cf_sigmoid`)."""
    if epilogue is Epilogue.NONE:
        return x
    if epilogue is Epilogue.RELU:
        return f"{x} < 0.0f ? 0.0f : {x}"  # (NaN < 0 is false: NaN stays, as torch.relu's)
    if epilogue is Epilogue.GELU:
        return f"0.5f * {x} * (1.0f + cf_erf({x} * 0.70710678118654752f))"
    if epilogue is Epilogue.GELU_TANH:  # x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))
        return f"{x} * cf_sigmoid(1.5957691216057308f * ({x} + 0.044715f * {x} * {x} * {x}))"
    if epilogue is Epilogue.QUICK_GELU:
        return f"{x} * cf_sigmoid(1.702f * {x})"
    if epilogue is Epilogue.SILU:
        return f"{x} * cf_sigmoid({x})"
    if epilogue is Epilogue.RELU6:
        return f"({x} < 0.0f ? 0.0f : {x} > 6.0f ? 6.0f : {x})"
    if epilogue is Epilogue.HARDSWISH:  # (as PyTorch's: -inf gives -inf * 0, NaN)
        return f"{x} * ({x} < -3.0f ? 0.0f : {x} > 3.0f ? 6.0f : {x} + 3.0f) * (1.0f / 6.0f)"
    if epilogue is Epilogue.MISH:
        return f"{x} * cf_tanh_softplus({x})"
    if epilogue is Epilogue.SQUARED_RELU:
        return f"({x} < 0.0f ? 0.0f : {x}) * ({x} < 0.0f ? 0.0f : {x})"
    raise ValueError(f"activation_c: {epilogue.value} is not pointwise")


def _softmax_strip(w: Writer, spec: GemmChainSpec, width: str) -> None:
    """`_epilogue_strip`'s softmax on the strip's first `width` columns (NR, or a tail
    strip's nw)."""
    w.line("float mx[NR], shift[NR], alpha[NR], sum[NR];")
    w.line(f"for (int c = 0; c < {width}; ++c) mx[c] = -INFINITY;")
    if spec.softcap is not None:
        w.line("/* soft-capping first, before any mask: cap tanh(s / cap), in base 2 */")
        with w.block("for (int r = 0; r < lc; ++r)"):
            w.line("#pragma omp simd")
            with w.block(f"for (int c = 0; c < {width}; ++c)"):
                w.line("p[r * NR + c] = cf_softcap(p[r * NR + c], CF_CAP2);")
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
                                if bool_mask:  # (0 / -inf added: NaN and +inf give NaN)
                                    w.line(f"*pc += blk[i * {tb} + c];")
                                else:
                                    w.line(f"*pc += cf_mask2(blk[i * {tb} + c]);")
                with w.block("for (; r < lc; ++r)"):
                    if bool_mask:
                        w.line("for (int c = 0; c < NR; ++c) p[r * NR + c] += rows[c * sMm + r] ? "
                               "0.0f : -INFINITY;")  # fmt: skip
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
        if uses_exp2_strip(spec) and width == "NR":
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
                w.line(  # added as SDPA adds it: a NaN or +inf score stays NaN where masked
                    "v += keep ? 0.0f : -INFINITY;"
                    if per_row
                    else f"v += mask_b[{at}] ? 0.0f : -INFINITY;"
                )
            if spec.causal:
                w.line("v = l0 + r > q[c] ? -INFINITY : v;")
            if changed:
                w.line("p[r * NR + c] = v;")
            w.line("mx[c] = v > mx[c] ? v : mx[c];")


def _exp_strip(w: Writer, exp: str, width: str) -> None:
    """The strip's scores exponentiated in place by `exp` (of row r, column i), summed by
    column: its first `width` columns."""
    with w.block("for (int r = 0; r < lc; ++r)"):
        w.line("#pragma omp simd")
        with w.block(f"for (int i = 0; i < {width}; ++i)"):
            w.line(f"const float e = {exp};")
            w.line("p[r * NR + i] = e;")
            w.line("sum[i] += e;")


def _rescale_e(w: Writer, spec: GemmChainSpec, width: str) -> None:
    """Where a strip's shifts moved after its first l block: what Eᵀ (or E) holds of the strip's
    `width` columns times `alpha`."""
    with w.block("if (l0 > 0 && moved)"):
        if softmax_writes_e(spec):
            with w.block("if (to_e)"), w.block("for (int c = 0; c < NR && j * NR + c < mc; ++c)"):
                w.line("cf_elem* restrict e = E_b + (j * NR + c) * sEm;")
                w.line("for (long n = 0; n < N; ++n) e[n] *= alpha[c];")
            w.line("else")
        with w.block("for (long c2 = 0; c2 < N; ++c2)"):
            w.line("float* restrict et = Et + c2 * LDE + j * NR;")
            w.line(f"for (int c = 0; c < {width}; ++c) et[c] *= alpha[c];")
