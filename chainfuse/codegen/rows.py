"""The row path of a GEMM chain: `<name>_rows`, a row block of at most `rows_max` rows of m
(decoding's queries, an MLP's few tokens, a block's rows past whole strips) computed without the
micro-kernel, each row of B and D read once for all the rows; and the rule that picks it."""

from __future__ import annotations

from chainfuse.codegen.gemm_spec import HALF, Epilogue, GemmChainSpec
from chainfuse.codegen.softmax import activation_c
from chainfuse.codegen.writer import Writer
from chainfuse.ir import MaskKind
from chainfuse.kernels import MicroKernel

__all__ = [
    "ROWS_COST",
    "ROWS_FIT",
    "ROWS_FIT_SHARE",
    "ROWS_LB",
    "ROWS_MAX",
    "emit_rows",
    "emit_rows_call",
    "emit_rows_invoke",
    "fits_rows",
    "row_path_rows",
    "rows_past_strips",
    "rows_tail",
]


#: Row blocks of at most this many rows of m take `<name>_rows` (decoding, 1 token)
#: (docs/tuning.md) ...
ROWS_MAX = 8
#: ... and of at most this many where fp32 B's rows meet A's in dot products (attention's K:
#: `fits_rows`) and B and D fit in the last cache level (`row_path_rows`) (docs/tuning.md)
ROWS_FIT = 7
#: ... "fit": B and D take at most 1/this of the last cache level (docs/tuning.md)
ROWS_FIT_SHARE = 4
#: The row path scores keys in blocks of this many, an online softmax across them
#: (docs/tuning.md)
ROWS_LB = 256
#: A row of m on the row path costs about this many of the tiled path's columns
#: (docs/tuning.md)
ROWS_COST = 5


def fits_rows(spec: GemmChainSpec) -> bool:
    """Whether ROWS_FIT can bound the row path: fp32 B met in dot products (`b_transposed`). Not
    16-bit B and D, which the tiles widen as they pack them for every row block: the row path
    stays ahead there through ROWS_MAX."""
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
    (`emit_block`'s `tail`, where threads do not split l): 0 unless 1..`rows_tail` are left."""
    left = rows % kernel.nr
    return left if rows > kernel.nr and left <= rows_tail(kernel) else 0


def emit_rows_call(w: Writer, spec: GemmChainSpec) -> None:
    """A row block of at most `rows_max` rows of m (`row_path_rows`; decoding: one query or a
    group of them; an MLP's one token; a tail block) goes to `<name>_rows`: in the tiled path its
    rows would fill 1-8 of the micro-kernel's nr columns, and the other FMAs of every call would
    be spent on padding. Threads that split l (one block, several threads) each add their share
    into their Eᵀ, for the second pass to sum as it sums the tiled path's."""
    with w.block("if (mc <= rows_max)"):
        emit_rows_invoke(w, spec, "mc", "m0", "l_end")
        w.line("continue;")


def emit_rows_invoke(w: Writer, spec: GemmChainSpec, rows: str, first: str, l_end: str) -> None:
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
        f" rows_w, {et}, LDE, bias1, bias2,"
        f" {'B3 + b0 * sB0 + b1 * sB1' if spec.gated else '0'});"
    )


def emit_rows(w: Writer, spec: GemmChainSpec) -> None:
    """`<name>_rows`: the chain for `mc` <= ROWS_MAX rows of m (from `m0`) of one batch index
    over l in [l_lo, l_end), without the micro-kernel: each row of B (attention's K) is read
    once for all the rows' dot products (vectorised along k; a B stored [k, l] is added in row
    by row, vectorised along l), f runs on ROWS_LB scores at a time (a softmax as the tiled
    path's online one: base 2, running max and rescaled sum, masks applied first), and D's rows
    are added into the rows' accumulators (vectorised along n). Decoding and a single token's
    MLP read B and D once per block of rows, at the speed memory gives. The result goes into
    E, or, with `et` (threads that split l), into Eᵀ (row stride `lde`) for the second pass.
    Optimised at -O2 (gcc; other compilers ignore the attribute): less compile time than -O3,
    and as fast."""
    softmax = spec.epilogue is Epilogue.SOFTMAX
    with w.block(
        f'static __attribute__((noinline, optimize("O2"))) void {spec.name}_rows(int mc,\n'
        "    long m0, long K, long N,"
        " long l_lo, long l_end, const cf_elem* restrict A_b, long sAm,"
        " const cf_elem* restrict B_b,\n    long sBr, const cf_elem* restrict D_b, long sDl,"
        " cf_elem* restrict E_b, long sEm,\n    float qscale, const void* mask_b, long sMm,"
        " long sMl, float* restrict q, float* restrict o,\n    float* restrict wide, float* restrict et,"
        " long lde, const cf_elem* restrict bias1, const cf_elem* restrict bias2,\n"
        "    const cf_elem* restrict B3_b)"
    ):
        w.line("(void)bias1; (void)bias2; (void)B3_b;")
        if spec.mask is MaskKind.NONE:
            w.line("(void)mask_b; (void)sMm; (void)sMl; (void)m0;")
        if spec.dtype not in HALF:
            w.line("(void)wide; /* (16-bit rows are widened into it once for all the rows) */")
        w.line("float s[ROWS_MAX][ROWS_LB] __attribute__((aligned(32)));")
        if spec.gated:
            w.line("float s3[ROWS_MAX][ROWS_LB] __attribute__((aligned(32))); /* (B3's scores) */")
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
            if spec.gated:  # (each in a block of its own: the loops' counters)
                for b, into in (("B_b", "s"), ("B3_b", "s3")):
                    with w.block(f"/* the scores of {b} */"):
                        _rows_scores(w, spec, half, b, into)
            else:
                _rows_scores(w, spec, half, "B_b", "s")
            with w.block("for (int i = 0; i < mc; ++i)"):
                w.line("float* restrict si = s[i];")
                if softmax:
                    _rows_softmax(w, spec)
                elif spec.gated:
                    w.line("/* a gated MLP: f of the gate's scores times the up projection's */")
                    w.line("#pragma omp simd")
                    with w.block("for (int l = 0; l < lb; ++l)"):
                        w.line("const float x = si[l];")
                        w.line(f"si[l] = ({activation_c(spec.epilogue, 'x')}) * s3[i][l];")
                elif spec.epilogue is not Epilogue.NONE or spec.bias1:
                    w.line("/* (bias1, then) f: NaN stays NaN, as in torch's */")
                    w.line("#pragma omp simd")
                    with w.block("for (int l = 0; l < lb; ++l)"):
                        plus = " + CF_LOAD(bias1[l0 + l])" if spec.bias1 else ""
                        w.line(f"const float x = si[l]{plus};")
                        w.line(f"si[l] = {activation_c(spec.epilogue, 'x')};")
                else:
                    w.line("(void)si;")
            if spec.d_transposed:
                _rows_dot_d(w, half)
            else:
                _rows_add_d(w, half)
        with w.block("for (int i = 0; i < mc; ++i)"):
            if softmax:
                empty = "0.0f" if spec.safe else "NAN"  # a row with no key: SDPA's, softmax's
                w.line(f"const float inv = csum[i] > 0.0f ? 1.0f / csum[i] : {empty};")
                plus = " + CF_LOAD(bias2[n])" if spec.bias2 else ""
                w.line(
                    f"for (long n = 0; n < N; ++n) E_b[i * sEm + n] = CF_STORE(o[i * N + n] * inv{plus});"
                )
            else:
                w.line("if (et) for (long n = 0; n < N; ++n) et[n * lde + i] = o[i * N + n];")
                plus = " + CF_LOAD(bias2[n])" if spec.bias2 else ""
                w.line(
                    f"else for (long n = 0; n < N; ++n) E_b[i * sEm + n] = CF_STORE(o[i * N + n]{plus});"
                )
        if softmax:
            w.line("(void)et; (void)lde;")


def _rows_softmax(w: Writer, spec: GemmChainSpec) -> None:
    """`_rows`' online softmax of row i's `lb` scores `si` (masks first), its accumulator
    rescaled by exp(old max - new max)."""
    if spec.softcap is not None:
        w.line("/* soft-capping first, before any mask: cap tanh(s / cap), in base 2 */")
        w.line("#pragma omp simd")
        w.line("for (int l = 0; l < lb; ++l) si[l] = cf_softcap(si[l], CF_CAP2);")
    if spec.mask is MaskKind.ADDITIVE:
        w.line("const cf_elem* restrict mk = (const cf_elem*)mask_b + (m0 + i) * sMm;")
        w.line("for (int l = 0; l < lb; ++l) si[l] += cf_mask2(CF_LOAD(mk[(l0 + l) * sMl]));")
    elif spec.mask is MaskKind.BOOL:
        w.line("const unsigned char* restrict mk = (const unsigned char*)mask_b + (m0 + i) * sMm;")
        w.line("for (int l = 0; l < lb; ++l) si[l] += mk[(l0 + l) * sMl] ? 0.0f : -INFINITY;")
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


def _rows_scores(w: Writer, spec: GemmChainSpec, half: bool, b: str, into: str) -> None:
    """`_rows`' scores of the weight at `b` into `into` (B stored [l, k] or [k, l])."""
    if spec.b_transposed:
        _rows_scores_by_key(w, half, b, into)
    else:
        _rows_scores_by_k(w, half, b, into)


def _rows_dot_d(w: Writer, half: bool) -> None:
    """`_rows`' second GEMM when D is stored [n, l] (nn.Linear's weight): each row of the
    accumulators gains dot products of its `lb` values of f with four rows of D at a time,
    along l (16-bit rows widened into `wide` first, once for all the rows)."""
    with w.block("for (long n = 0; n < N; n += 4)"):
        w.line("const long n1 = n + 1 < N ? n + 1 : n, n2 = n + 2 < N ? n + 2 : n;")
        w.line("const long n3 = n + 3 < N ? n + 3 : n;")
        if half:
            for j, at in enumerate(("n", "n1", "n2", "n3")):
                w.line(f"float* restrict d{j} = wide + {j} * ROWS_LB;")
                w.line(f"cf_widen(D_b + {at} * sDl + l0, d{j}, lb);")
        else:
            for j, at in enumerate(("n", "n1", "n2", "n3")):
                w.line(f"const cf_elem* restrict d{j} = D_b + {at} * sDl + l0;")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line("float a[4];")
            w.line("cf_dot4(lb, s[i], d0, d1, d2, d3, a);")
            w.line("float* restrict oi = o + i * N;")
            w.line("oi[n] += a[0];")
            w.line("if (n + 1 < N) oi[n + 1] += a[1];")
            w.line("if (n + 2 < N) oi[n + 2] += a[2];")
            w.line("if (n + 3 < N) oi[n + 3] += a[3];")


def _rows_scores_by_key(w: Writer, half: bool, b: str = "B_b", into: str = "s") -> None:
    """`_rows`' scores when K is stored [l, k] (attention): dot products along k (16-bit keys
    widened into `wide` first, once for all the rows)."""
    w.line("/* four keys at a time: four independent FMA chains (one waits on its")
    w.line("   latency), their rows read from L1 for every query; past the last key the")
    w.line("   group re-reads it, and those scores are not kept */")
    with w.block("for (int l = 0; l < lb; l += 4)"):
        if half:
            w.line(f"const cf_elem* restrict h0 = {b} + (l0 + l) * sBr;")
            for j in range(4):
                w.line(f"float* restrict k{j} = wide + {j} * K;")
                last = "h0" if j == 0 else f"l + {j} < lb ? h0 + {j} * sBr : h0"
                w.line(f"cf_widen({last}, k{j}, K);")
        else:
            w.line(f"const cf_elem* restrict k0 = {b} + (l0 + l) * sBr;")
            w.line("const cf_elem* restrict k1 = l + 1 < lb ? k0 + sBr : k0;")
            w.line("const cf_elem* restrict k2 = l + 2 < lb ? k0 + 2 * sBr : k0;")
            w.line("const cf_elem* restrict k3 = l + 3 < lb ? k0 + 3 * sBr : k0;")
        with w.block("for (int i = 0; i < mc; ++i)"):
            w.line("float a[4];")
            w.line("cf_dot4(K, q + i * K, k0, k1, k2, k3, a); /* (fp32 or widened rows) */")
            w.line(f"if (l + 4 <= lb) memcpy(&{into}[i][l], a, sizeof a); /* (one vector store) */")
            with w.block("else"):
                w.line(f"{into}[i][l] = a[0];")
                w.line(f"if (l + 1 < lb) {into}[i][l + 1] = a[1];")
                w.line(f"if (l + 2 < lb) {into}[i][l + 2] = a[2];")


def _rows_scores_by_k(w: Writer, half: bool, b: str = "B_b", into: str = "s") -> None:
    """`_rows`' scores when B is stored [k, l] (GEMM chains): rows of B added in, vectorised
    along l."""
    with w.block("for (int i = 0; i < mc; ++i)"):
        w.line(f"for (int l = 0; l < lb; ++l) {into}[i][l] = 0.0f;")
    _rows_add_rows(w, "k", "K", f"{b} + k * sBr + l0", "sBr", "q[i * K + k + {j}]", f"{into}[i]",
                   "lb", half)  # fmt: skip
