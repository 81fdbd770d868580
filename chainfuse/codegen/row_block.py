"""One parallel block of a GEMM chain's tiled path: its row blocks, each op1 over k blocks into
the score tile (f applied while in cache), then op2 over n blocks into Eᵀ or E's rows, and the
transposing store of Eᵀ into E (`<name>_store_e`)."""

from __future__ import annotations

from chainfuse.codegen.gemm_spec import (
    Epilogue,
    GemmChainSpec,
    named_heads,
    softmax_writes_e,
    wide_heads,
    wide_multiples,
    wide_test,
    writes_e,
)
from chainfuse.codegen.rows import emit_rows_call, emit_rows_invoke
from chainfuse.codegen.softmax import (
    emit_epilogue_strip,
    emit_invert_sums,
    emit_scores_strip_call,
    exponentiates_beside_op1,
)
from chainfuse.codegen.writer import Writer
from chainfuse.ir import DType, MaskKind
from chainfuse.kernels import MicroKernel

__all__ = [
    "copies_kv",
    "emit_block",
    "emit_free_kv_buffer",
    "emit_free_memos",
    "emit_kv_buffer",
    "emit_narrow_keys",
    "emit_narrow_memos",
    "emit_store_e",
    "narrow_memo_args",
    "narrows_keys",
]

#: an additive mask value at or below this excludes its key where the row keeps another: score +
#: value rounds to value (|score| < 2^103), and its exponential against the row's maximum is 0
#: (-inf, or `torch.finfo(float32 or bfloat16).min` as models fill with; fp16's -65504 is not)
EXCLUDED_BELOW = -1e37


def narrows_keys(spec: GemmChainSpec) -> bool:
    """Whether a row block's keys are narrowed to those its mask keeps (`cf_narrow_keys`)."""
    return spec.epilogue is Epilogue.SOFTMAX and spec.mask is not MaskKind.NONE


def emit_narrow_keys(w: Writer, spec: GemmChainSpec, elem_type: str = "cf_elem") -> None:
    """`cf_narrow_keys`: a row block's range of keys without the keys at its start and end that
    the mask excludes for every row (-inf or below EXCLUDED_BELOW, or False), where that is
    exact: q's rows and the left-out keys' k and v rows finite (their scores are then finite
    and weigh 0; a NaN or inf there reaches every row, as in SDPA, so nothing is left out), and
    no row that keeps no key unless its mask is -inf throughout (such a row weighs every key
    alike in eager's softmax of finfo.min fills). A causal mask, a sliding window and padding
    leave out their blocks as `is_causal` does. What the mask says is shared through a
    `cf_keys_memo` by the blocks of the same rows a broadcast mask gives alike (every head's,
    for a causal mask), and k and v are checked once a head (`kv_ok`) where the head has
    enough row blocks to repay it (`emit_narrow_memos`). `elem_type`: the operands' C type
    (CF_LOAD widens it)."""
    bool_mask = spec.mask is MaskKind.BOOL
    elem = "unsigned char" if bool_mask else elem_type
    out = "(x) == 0" if bool_mask else f"CF_LOAD(x) <= {EXCLUDED_BELOW:g}f"
    inf = "1" if bool_mask else "CF_LOAD(x) == -INFINITY"
    kat = "kt[l * sBr + x]" if spec.b_transposed else "kt[x * sBr + l]"
    vat = "v[x * sDl + l]" if spec.d_transposed else "v[l * sDl + x]"
    w.line(f"#define CF_OUT(x) ({out})")
    w.line(f"#define CF_ALL_INF(x) ({inf})")
    w.line("#define CF_RUN 64")
    w.line("/* whether the mask leaves out all of CF_RUN keys from p, `step` apart */")
    with w.block(f"static inline int cf_run_out(const {elem}* restrict p, long step)"):
        w.line("int out = 1;")
        with w.block("if (step == 1)"):
            w.line("#pragma omp simd reduction(& : out)")
            w.line("for (int i = 0; i < CF_RUN; ++i) out &= CF_OUT(p[i]);")
        w.line("else for (int i = 0; i < CF_RUN; ++i) out &= CF_OUT(p[i * step]);")
        w.line("return out;")
    w.line("/* what a row block's mask says of its keys [l0, l1): whether some keys at the start")
    w.line("   or the end are left out for every row, and the range between, [*lo, *end) */")
    with w.block(
        f"static int cf_mask_keys(const {elem}* restrict mk, long sMm, long sMl, long m0, int mc,"
        "\n    long l0, long l1, long* lo, long* end)"
    ):
        w.line("long first = l1, last = l0; /* the first key kept, one past the last */")
        w.line("const int rows = sMm == 0 ? 1 : mc; /* (a mask the same for every row) */")
        with w.block("for (int r = 0; r < rows; ++r)"):
            w.line(f"const {elem}* restrict row = mk + (m0 + r) * sMm;")
            w.line("/* the row's first key kept, then one past its last: runs of CF_RUN keys left")
            w.line(
                "   out stepped over by a vectorised test, the rest key by key (a row that keeps"
            )
            w.line("   keys throughout stops at once) */")
            w.line("long f = l0;")
            w.line("while (f + CF_RUN <= l1 && cf_run_out(row + f * sMl, sMl)) f += CF_RUN;")
            w.line("while (f < l1 && CF_OUT(row[f * sMl])) ++f;")
            with w.block("if (f >= l1)"):
                w.line(
                    "/* no key kept: -inf throughout weighs no key; finfo.min weighs all alike */"
                )
                w.line("int all_inf = 1;")
                w.line("for (long l = l0; l < l1; ++l) all_inf &= CF_ALL_INF(row[l * sMl]);")
                w.line("if (!all_inf) return 0;")
                w.line("continue;")
            w.line("long e = l1;")
            w.line(
                "while (e - CF_RUN > f && cf_run_out(row + (e - CF_RUN) * sMl, sMl)) e -= CF_RUN;"
            )
            w.line("while (e > f + 1 && CF_OUT(row[(e - 1) * sMl])) --e;")
            w.line("first = f < first ? f : first;")
            w.line("last = e > last ? e : last;")
            w.line("if (first == l0 && last == l1) return 0; /* nothing to leave out */")
        w.line("if (first >= last) return 0; /* every row -inf throughout */")
        w.line("*lo = first;")
        w.line("*end = last;")
        w.line("return 1;")
    w.line("/* k's and v's rows [from, to) times 0, summed: 0 only where they are all finite (the")
    w.line("   sums vectorised: in order, each add waited on the one before) */")
    with w.block(
        f"static float cf_kv_zero(const {elem_type}* restrict kt, long sBr,"
        f" const {elem_type}* restrict v,\n    long sDl, long K, long N, long from, long to)"
    ):
        w.line("float z = 0.0f;")
        with w.block("for (long l = from; l < to; ++l)"):
            w.line("#pragma omp simd reduction(+ : z)")
            w.line(f"for (long x = 0; x < K; ++x) z += CF_LOAD({kat}) * 0.0f;")
            w.line("#pragma omp simd reduction(+ : z)")
            w.line(f"for (long x = 0; x < N; ++x) z += CF_LOAD({vat}) * 0.0f;")
        w.line("return z;")
    w.line("/* a row block's mask answer (cf_mask_keys) shared between the blocks of its rows:")
    w.line("   state 0 not known yet, 1 narrowed to [lo, end), 2 not narrowed */")
    w.line("typedef struct { int state; long lo, end; } cf_keys_memo;")
    w.line(
        "/* the row block's keys [*lo, *end) narrowed to those its mask keeps for some row: returns"
    )
    w.line("   whether they narrowed (see emit_narrow_keys in codegen/row_block.py). `memo`: the")
    w.line("   mask's answer for these rows, shared (or 0); `kv_ok`: whether the head's k and v")
    w.line("   are finite throughout, its L keys checked once (0 not known yet, 1 yes, 2 no), or")
    w.line("   0: the keys left out are checked here */")
    with w.block(
        f"static int cf_narrow_keys(const {elem}* restrict mk, long sMm, long sMl, long m0, int mc,"
        f"\n    long* lo, long* end, const {elem_type}* restrict q, long sAm, long K,"
        f"\n    const {elem_type}* restrict kt, long sBr, const {elem_type}* restrict v, long sDl,"
        " long N,\n    cf_keys_memo* memo, int* kv_ok, long L)"
    ):
        w.line("const long l0 = *lo, l1 = *end;")
        w.line("long first, last;")
        w.line("const int known = memo ? __atomic_load_n(&memo->state, __ATOMIC_ACQUIRE) : 0;")
        with w.block("if (known == 0)"):
            w.line("const int narrows = cf_mask_keys(mk, sMm, sMl, m0, mc, l0, l1, &first, &last);")
            with w.block("if (memo)"):
                w.line("/* (blocks racing here store the same answer) */")
                w.line("__atomic_store_n(&memo->lo, first, __ATOMIC_RELAXED);")
                w.line("__atomic_store_n(&memo->end, last, __ATOMIC_RELAXED);")
                w.line("__atomic_store_n(&memo->state, narrows ? 1 : 2, __ATOMIC_RELEASE);")
            w.line("if (!narrows) return 0;")
        w.line("else if (known == 2) return 0;")
        with w.block("else"):
            w.line("first = __atomic_load_n(&memo->lo, __ATOMIC_RELAXED);")
            w.line("last = __atomic_load_n(&memo->end, __ATOMIC_RELAXED);")
        w.line("/* q, and k and v of the keys left out, finite: x * 0 is 0 only for finite x */")
        w.line("float z = 0.0f;")
        with w.block("for (int r = 0; r < mc; ++r)"):
            w.line("#pragma omp simd reduction(+ : z)")
            w.line("for (long x = 0; x < K; ++x) z += CF_LOAD(q[r * sAm + x]) * 0.0f;")
        w.line("int kv = kv_ok ? __atomic_load_n(kv_ok, __ATOMIC_ACQUIRE) : 2;")
        with w.block("if (kv == 0)"):
            w.line("kv = cf_kv_zero(kt, sBr, v, sDl, K, N, 0, L) == 0.0f ? 1 : 2;")
            w.line("__atomic_store_n(kv_ok, kv, __ATOMIC_RELEASE);")
        with w.block("if (kv != 1)"):
            w.line("z += cf_kv_zero(kt, sBr, v, sDl, K, N, l0, first);")
            w.line("z += cf_kv_zero(kt, sBr, v, sDl, K, N, last, l1);")
        w.line("if (z != 0.0f) return 0; /* (NaN) */")
        w.line("*lo = first;")
        w.line("*end = last;")
        w.line("return 1;")
    w.line("#undef CF_OUT")
    w.line("#undef CF_ALL_INF")
    w.line("#undef CF_RUN")


def emit_narrow_memos(w: Writer, row_blocks: str) -> None:
    """The memos `cf_narrow_keys` shares between a call's blocks (freed by `emit_free_memos`),
    for `row_blocks` (a C expression) row blocks a batch index: one `cf_keys_memo` per row
    block of each distinct mask, where a batch dim broadcasts it (every head of a causal mask
    reads it alike: the mask read once, not once a head), and one `kv_ok` per batch index
    where it has more than two row blocks (its k and v checked once then cost less than the
    keys its blocks leave out, each checked on its own). None where allocation fails."""
    w.line("/* cf_narrow_keys' answers shared between blocks (see emit_narrow_memos) */")
    w.line("const long nm0 = sM0 != 0 ? nb0 : 1, nm1 = sM1 != 0 ? nb1 : 1;")
    w.line(f"const long memo_rows = {row_blocks}; /* row blocks of a batch index */")
    w.line(
        "cf_keys_memo* keys_memo = nm0 * nm1 < nb0 * nb1"
        "\n    ? calloc((size_t)(nm0 * nm1 * memo_rows), sizeof(cf_keys_memo)) : 0;"
    )
    w.line("int* kv_ok = memo_rows > 2 ? calloc((size_t)(nb0 * nb1), sizeof(int)) : 0;")


def emit_free_memos(w: Writer) -> None:
    """Free what `emit_narrow_memos` allocated."""
    w.line("free(keys_memo);")
    w.line("free(kv_ok);")


def narrow_memo_args(row_block: str) -> str:
    """`cf_narrow_keys`' memo arguments for row block `row_block` (a C expression, < the
    `memo_rows` of `emit_narrow_memos`) of the batch indices b0, b1."""
    return (
        "keys_memo ? keys_memo + ((sM0 != 0 ? b0 : 0) * nm1 + (sM1 != 0 ? b1 : 0)) * memo_rows"
        f" + {row_block} : 0, kv_ok ? kv_ok + b0 * nb1 + b1 : 0"
    )


def emit_block(w: Writer, spec: GemmChainSpec) -> None:
    """One parallel block: a batch index and T_MO rows of m (the plan's outermost m tile, the
    blocks its model deals to the cores), run as row blocks of T_M."""
    w.line("const long b0 = blk / (nb1 * mblocks), b1 = (blk / mblocks) % nb1;")
    w.line("const long mo = (blk % mblocks) * T_MO;")
    w.line("const long mo_end = M - mo < T_MO ? M : mo + T_MO;")
    if not copies_kv(spec):
        _row_blocks(w, spec)
        return
    w.line("/* k and v of this head: the thread's contiguous copy where it has one (kv_buf) */")
    w.line("const cf_elem* k_head = B + b0 * sB0 + b1 * sB1;")
    w.line("const cf_elem* v_head = D + b0 * sD0 + b1 * sD1;")
    with w.block("if (kv_buf)"):
        with w.block("if (kv_from != k_head || kv_from_v != v_head)"):
            w.line("for (long l = 0; l < L; ++l)")
            w.line("    memcpy(kv_buf + l * K, k_head + l * sBr, (size_t)K * sizeof(cf_elem));")
            w.line("for (long l = 0; l < L; ++l)")
            w.line(
                "    memcpy(kv_buf + L * K + l * N, v_head + l * sDl, (size_t)N * sizeof(cf_elem));"
            )
            w.line("kv_from = k_head;")
            w.line("kv_from_v = v_head;")
            if reuses_d(spec):
                w.line("dt_from = 0; /* (V packed from the copy of another head) */")
    w.line("/* (the call's operands under other names, for the block below to shadow them) */")
    w.line("const cf_elem* const B_call = B;")
    w.line("const cf_elem* const D_call = D;")
    w.line("const long sB0_call = sB0, sB1_call = sB1, sBr_call = sBr;")
    w.line("const long sD0_call = sD0, sD1_call = sD1, sDl_call = sDl;")
    with w.block("/* the row blocks read k and v from the copy, else the call's own */"):
        w.line("const cf_elem* restrict B = kv_buf ? (const cf_elem*)kv_buf : B_call;")
        w.line("const cf_elem* restrict D = kv_buf ? (const cf_elem*)kv_buf + L * K : D_call;")
        w.line("const long sB0 = kv_buf ? 0 : sB0_call, sB1 = kv_buf ? 0 : sB1_call;")
        w.line("const long sD0 = kv_buf ? 0 : sD0_call, sD1 = kv_buf ? 0 : sD1_call;")
        w.line("const long sBr = kv_buf ? K : sBr_call, sDl = kv_buf ? N : sDl_call;")
        w.line("(void)sB0; (void)sB1; (void)sD0; (void)sD1;")
        _row_blocks(w, spec)


def copies_kv(spec: GemmChainSpec) -> bool:
    """Whether the kernel copies a head's k and v rows contiguous, once a head and thread, where
    they lie far apart (`emit_kv_buffer`): attention's k and v as views of a projection's
    output [.., seq, heads * dim] transposed, whose rows are heads * dim apart (a new page
    every row or few, which the row blocks' in-place reads and packing then pay again and
    again)."""
    return (
        spec.epilogue is Epilogue.SOFTMAX
        and spec.b_transposed
        and not spec.d_transposed
        and not spec.gated
    )


def reuses_d(spec: GemmChainSpec) -> bool:
    """Whether the kernel keeps a packed V for the next row blocks (`dt_from`, `_reuse_d`)."""
    return spec.epilogue is Epilogue.SOFTMAX and not spec.causal


def emit_kv_buffer(w: Writer, spec: GemmChainSpec) -> None:
    """A thread's buffer for `copies_kv` (in its parallel loop; `emit_free_kv_buffer` after):
    L rows of k then L rows of v, where k's or v's rows are more than KV_APART elements apart
    and the thread runs at least two row blocks of a head (null otherwise, or where malloc
    fails: the rows are read in place). Copied once for one row block, the rows would be read
    twice and written once where they are read once now."""
    if not copies_kv(spec):
        return
    w.line("/* k and v rows far apart, read by several row blocks of a head: copied contiguous,")
    w.line("   once a head (see copies_kv in codegen/row_block.py) */")
    w.line("/* (row blocks of a head this thread runs: those of its parallel blocks, or its share")
    w.line("   of the head's where the threads claim the head's blocks side by side) */")
    w.line("const long head_rbs = (M + T_M - 1) / T_M;")
    w.line("const long block_rbs = ((T_MO < M ? T_MO : M) + T_M - 1) / T_M;")
    w.line(
        "const long own_rbs = block_rbs > head_rbs / nthreads ? block_rbs : head_rbs / nthreads;"
    )
    w.line(
        "cf_elem* kv_buf = split == 1 && own_rbs >= 2 && (sBr > K + KV_APART || sDl > N + KV_APART)"
        "\n    ? malloc((size_t)(L * (K + N)) * sizeof(cf_elem)) : 0;"
    )
    w.line("const cf_elem* kv_from = 0; /* whose k and v kv_buf holds */")
    w.line("const cf_elem* kv_from_v = 0;")


def emit_free_kv_buffer(w: Writer, spec: GemmChainSpec) -> None:
    """Free `emit_kv_buffer`'s buffer."""
    if copies_kv(spec):
        w.line("free(kv_buf);")


def _row_blocks(w: Writer, spec: GemmChainSpec) -> None:
    """The row blocks of one parallel block, rows mo to mo_end."""
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
            emit_rows_invoke(w, spec, "tail", "m0 + rows - tail", "tail_end")
        w.line("const int mc = rows - tail;")
        if not narrows_keys(spec):
            w.line(f"const long l_end = {bound.format('mc')};")
            emit_rows_call(w, spec)
            _row_block(w, spec)
            return
        w.line(
            "/* keys the mask leaves out for every row, at the start and the end: not computed */"
        )
        w.line(f"long n_lo = l_lo, n_end = {bound.format('mc')};")
        elem = "unsigned char" if spec.mask is MaskKind.BOOL else "cf_elem"
        w.line(
            f"const int narrowed = split == 1 && mc > 0 && cf_narrow_keys((const {elem}*)mask_data"
            " + b0 * sM0 + b1 * sM1, sMm, sMl, m0, mc, &n_lo, &n_end, A + b0 * sA0 + b1 * sA1"
            " + m0 * sAm, sAm, K, B + b0 * sB0 + b1 * sB1, sBr, D + b0 * sD0 + b1 * sD1, sDl, N,"
            f" {narrow_memo_args('(blk % mblocks) * per_mo + (m0 - mo) / T_M')}, L);"
        )
        w.line("(void)narrowed;")
        with w.block("/* the row block over the narrowed keys */"):
            w.line("const long l_lo = n_lo, l_end = n_end;")
            emit_rows_call(w, spec)
            _row_block(w, spec)


def _row_block(w: Writer, spec: GemmChainSpec) -> None:
    """The body of one (batch, m_o) row block of `mc` <= T_M rows from `m0`, keys up to `l_end`."""
    uk = spec.kernel.name
    softmax = spec.epilogue is Epilogue.SOFTMAX
    in_place = spec.dtype is DType.FLOAT32  # the micro-kernel reads fp32 slivers in place
    w.line("const cf_elem* restrict A_b = A + b0 * sA0 + b1 * sA1 + m0 * sAm;")
    w.line("const cf_elem* restrict B_b = B + b0 * sB0 + b1 * sB1;")
    if spec.gated:  # (B3 lies as B does: its strides)
        w.line("const cf_elem* restrict B3_b = B3 + b0 * sB0 + b1 * sB1;")
    w.line("const cf_elem* restrict D_b = D + b0 * sD0 + b1 * sD1;")
    w.line("cf_elem* restrict E_b = E + b0 * sE0 + b1 * sE1 + m0 * sEm;")
    w.line("/* few column strips: a B or D sliver serves too few micro-kernel calls to pay for")
    w.line("   packing it; whole slivers are then read in place (tails are still packed). Not")
    w.line("   a sliver whose rows lie far apart (a new page per element read, re-read for")
    w.line("   every strip) unless it serves one or two strips: packing it row by row is")
    w.line("   cheaper only when the packed copy is read several times. Slivers whose rows are")
    w.line("   contiguous along the reduction (B or D stored transposed) up to more strips */")
    w.line("const int direct = mc <= DIRECT_MC, direct_rows = mc <= DIRECT_MC_ROWS;")
    w.line("const int few = mc <= DIRECT_FAR_STRIPS * NR;")
    w.line("(void)direct_rows; (void)few;")
    far_b = "_rows" if spec.b_transposed else " && (few || sBr <= DIRECT_STRIDE)"
    w.line(f"const int direct_b = direct{far_b};")
    if softmax:
        if softmax_writes_e(spec):
            w.line("/* op2 straight into E where D's rows are the packed layout (_softmax_to_e),")
            w.line("   or a wide block holds a whole value head (wide_heads) */")
            heads = wide_test(spec)
            w.line(f"const int to_e = ((N == NR && sDl == NR){heads}) && T_N >= N && l_end > l_lo;")
        _reuse_d(w, spec)
    reused = " && !reuse_d" if softmax else ""
    if spec.d_transposed:
        w.line(f"const int direct_d = direct_rows{reused};")
    else:
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
    if writes_e(spec):
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
            weights = [("B_b", "Bt")] + ([("B3_b", "Bt3")] if spec.gated else [])
            if spec.gated:
                w.line("/* a gated MLP: the gate's and the up projection's panels side by side */")
            if spec.b_transposed:
                for b, bt in weights:
                    with w.block("for (int s = 0; s * MR < lc; ++s)"):
                        w.line("const int m = lc - s * MR < MR ? lc - s * MR : MR;")
                        w.line(
                            "if (direct_b && (m == MR || m == PART_MR)) continue; /* read in place below */"
                        )
                        w.line(
                            f"PACK_A(kc, m, {b} + (l0 + s * MR) * sBr + k0, sBr, {bt} + (long)s * SLIVER(kc));"
                        )
            else:  # (whole slivers read in place below when direct_b)
                for b, bt in weights:
                    w.line(f"cf_pack_at_panel(kc, lc, {b} + k0 * sBr + l0, sBr, {bt}, !direct_b);")
                w.line("/* the panel packed next: B's next k block, or the first D panel */")
                w.line("cf_pf pf;")
                w.line(
                    "if (k0 + kc < K) cf_pf_set(&pf, B_b + (k0 + kc) * sBr + l0, sBr,"
                    " (int)(K - k0 - kc < TK ? K - k0 - kc : TK), lc);"
                )
                if spec.d_transposed:
                    w.line("else cf_pf_set(&pf, D_b + l0, sDl, (int)(N < T_N ? N : T_N), lc);")
                else:
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
                if spec.epilogue is Epilogue.RELU and not spec.bias1 and not spec.gated:
                    w.line("/* the relu as each block of the last k block is stored */")
                    w.line("const int acc = (k0 > 0) | (k0 + kc >= K ? RELU_AT_STORE : 0);")
                else:
                    w.line("const int acc = k0 > 0;")
                if exponentiates_beside_op1(spec):
                    emit_scores_strip_call(w, spec)
                tiles = [("B_b", "Bt", "Pt")] + ([("B3_b", "Bt3", "P3t")] if spec.gated else [])
                for i, (b, bt, pt) in enumerate(tiles):
                    if i:
                        w.line("/* the up projection's scores beside the gate's */")
                    with w.block("for (int s = 0; s * MR < lc; ++s)"):
                        w.line("const int m = lc - s * MR < MR ? lc - s * MR : MR;")
                        w.line(f"float* restrict c = {pt} + (long)j * LPM * NR + s * MR * NR;")
                        if not in_place:
                            w.line(f"{uk}(kc, {bt} + (long)s * SLIVER(kc), a, c, NR, m, NR, acc);")
                        else:
                            if spec.b_transposed:
                                place = f"{b} + (l0 + s * MR) * sBr + k0", "sBr", "1"
                            else:
                                place = f"{b} + k0 * sBr + l0 + s * MR", "1", "sBr"
                            packed = f"{bt} + (long)s * SLIVER(kc)"
                            _sliver_call(
                                w, spec.kernel, "kc", "direct_b", place, packed, "a, c, NR",
                                room=True,
                            )  # fmt: skip
                        if not spec.b_transposed and i == 0:
                            w.line("cf_pf_step(&pf, pf_rows);")
                if spec.epilogue not in (Epilogue.NONE, Epilogue.RELU) or spec.bias1 or spec.gated:
                    w.line("/* the strip's scores are complete and in L1: f on them now */")
                    with w.block("if (k0 + kc >= K)"):
                        emit_epilogue_strip(w, spec, bool(spec.kernel.part_cols) and in_place)
        w.line("/* op2: Eᵀ[n_o, m_o] (+)= Dᵀ[n_o, l_o] . Pᵀ[l_o, m_o] */")
        if softmax_writes_e(spec):
            w.line("/* the last l block straight into E: its rows final there, stored over their")
            w.line("   sums (inv, the sums' inverses) with no pass of their own after it */")
            w.line("const int last_l = to_e && l0 + T_L >= l_end;")
            with w.block("if (last_l)"):
                emit_invert_sums(w, spec)
        with w.block("for (long n0 = 0; n0 < N; n0 += T_N)"):
            w.line("const int nc = (int)(N - n0 < T_N ? N - n0 : T_N);")
            w.line("/* (whole slivers read in place below when direct_d) */")
            if writes_e(spec):
                if spec.d_transposed:
                    with w.block("if (to_e)"):
                        _pack_d_strips(w)
                    with w.block("else"):
                        _pack_d_slivers(w, "Dt")
                else:
                    w.line("if (to_e) cf_pack_b_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt);")
                    w.line(
                        "else cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt, !direct_d);"
                    )
            elif softmax:
                w.line("/* (or packed for an earlier row block of this batch: reuse_d) */")
                w.line("float* restrict Dn = Dt + (reuse_d ? n0 / T_N * DTF : 0);")
                to_e = "!to_e && " if softmax_writes_e(spec) else ""
                if spec.d_transposed:
                    with w.block(f"if ({to_e}fresh_d)"):
                        _pack_d_slivers(w, "Dn")
                else:
                    w.line(
                        f"if ({to_e}fresh_d) cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dn, !direct_d);"
                    )
            elif spec.d_transposed:
                _pack_d_slivers(w, "Dt")
            else:
                w.line("cf_pack_at_panel(lc, nc, D_b + l0 * sDl + n0, sDl, Dt, !direct_d);")
            if spec.b_transposed:
                # B and D are read in place here; what waits on its loads is the packing of the
                # next row block's Aᵀ (Q), a few floats of each row at a time
                w.line("/* what is packed next: the next row block's Aᵀ (below) */")
                w.line("cf_pf pf;")
                w.line("if (n0 + nc < N || l0 + T_L < l_end) cf_pf_set(&pf, D_b, 0, 0, 0);")
                next_b = ""
            else:
                w.line("/* the panel packed next: D's next n block, or B's for the next l block */")
                w.line("cf_pf pf;")
                if spec.d_transposed:
                    w.line(
                        "if (n0 + nc < N) cf_pf_set(&pf, D_b + (n0 + nc) * sDl + l0, sDl,"
                        " (int)(N - n0 - nc < T_N ? N - n0 - nc : T_N), lc);"
                    )
                else:
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
                    # the store at the row block's end writes lines of a new output that come
                    # from L3 or DRAM: asked for here
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
            if writes_e(spec) or softmax_writes_e(spec):
                with w.block("if (to_e)"):
                    # (in place: nc = N = NR, one strip, rows NR apart)
                    d = "D_b + l0 * sDl" if softmax_writes_e(spec) else "Dt + (long)s * lc * NR"
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
    written = " (or E as op2 wrote it)" if softmax_writes_e(spec) else ""
    w.line(
        f"/* E[m_o, :] = Eᵀ transposed{written}"
        + (", each row over its softmax sum */" if softmax else " */")
    )
    if softmax_writes_e(spec):
        w.line("/* (to_e: op2 of the last l block stored E's rows over their sums) */")
        with w.block("if (!to_e)"):
            emit_invert_sums(w, spec)
            w.line(f"{spec.name}_store_e(mc, N, Et, col_sum, bias2, E_b, sEm, LDE);")
    elif softmax:
        emit_invert_sums(w, spec)
        w.line(f"{spec.name}_store_e(mc, N, Et, col_sum, bias2, E_b, sEm, LDE);")
    else:
        w.line("/* (split l: the second pass adds the shares up and stores them) */")
        cond = "split == 1 && !to_e" if writes_e(spec) else "split == 1"
        w.line(f"if ({cond}) {spec.name}_store_e(mc, N, Et, 0, bias2, E_b, sEm, LDE);")
    if spec.bias2 and (writes_e(spec) or softmax_writes_e(spec)):
        w.line("/* op2 wrote E's rows in place: bias2 added to them now, in cache */")
        with w.block("if (to_e)"), w.block("for (int i = 0; i < mc; ++i)"):
            w.line("cf_elem* restrict e = E_b + i * sEm;")
            w.line("#pragma omp simd")
            w.line("for (long c = 0; c < N; ++c) e[c] += bias2[c];")


def _pack_at(w: Writer, uk: str, k0: str, kc: str, scaled: bool) -> None:
    """Aᵀ strips (op1's B operand): strip j holds m columns j*nr.. over k. `scaled`: times the
    softmax scale and log2(e), so the scores come out scaled and in base 2 (one pass over the
    T_M x K block of A instead of one over every T_M x T_L tile of scores)."""
    with w.block("for (int j = 0; j * NR < mc; ++j)"):
        w.line("const int n = mc - j * NR < NR ? mc - j * NR : NR;")
        w.line(f"float* restrict strip = At + (long)j * NR * AK + (AK == K ? {k0} : 0) * NR;")
        factor = "scale2" if scaled else "1.0f"
        w.line(f"PACK_BT({kc}, n, A_b + j * NR * sAm + {k0}, sAm, strip, {factor});")


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


def _pack_d_slivers(w: Writer, into: str) -> None:
    """Dᵀ slivers of D stored transposed (`d_transposed`: rows n, l contiguous), as B's
    transposed slivers are packed: mr rows of n over the l block each, whole ones read in place
    where `direct_d`."""
    with w.block("for (int s = 0; s * MR < nc; ++s)"):
        w.line("const int m = nc - s * MR < MR ? nc - s * MR : MR;")
        w.line("if (direct_d && (m == MR || m == PART_MR)) continue; /* read in place */")
        w.line(
            f"PACK_A(lc, m, D_b + (n0 + s * MR) * sDl + l0, sDl, {into} + (long)s * SLIVER(lc));"
        )


def _pack_d_strips(w: Writer) -> None:
    """D's nr-column strips for op2 into E's rows (`cf_pack_b_panel`'s layout, [l][NR] each)
    from D stored transposed: NR rows of n, each contiguous along l, transposed as packed."""
    with w.block("for (int s = 0; s * NR < nc; ++s)"):
        w.line("const int n = nc - s * NR < NR ? nc - s * NR : NR;")
        w.line("PACK_BT(lc, n, D_b + (n0 + s * NR) * sDl + l0, sDl, Dt + (long)s * lc * NR, 1.0f);")


def _reuse_d(w: Writer, spec: GemmChainSpec) -> None:
    """`reuse_d`: whether this row block packs all of D's l block (every n block: `CF_DTN`) and
    leaves it in the workspace for the next row blocks of its batch (`fresh_d` false there): a
    head's V packed once per thread. Only where D's l block is all the row block's keys (not
    causal) and another row block of the batch follows, or D is the same for every batch."""
    if spec.causal:
        w.line("const int reuse_d = 0, fresh_d = 1; /* (causal: l_end moves with m0) */")
        return
    to_e = "!to_e && " if softmax_writes_e(spec) else ""
    to_e += "!narrowed && " if narrows_keys(spec) else ""
    w.line(
        "/* all of D packed once for the row blocks of this batch (see reuse_d in codegen/row_block.py) */"
    )
    w.line(
        f"const int reuse_d = {to_e}l_end > l_lo && l_end - l_lo <= T_L && DTN * T_N >= N"
        " && (M > T_M || (sD0 == 0 && sD1 == 0));"
    )
    w.line("/* (l_lo and l_end are the call's own here, unless narrowed: the same for every row")
    w.line("   block) */")
    at = "D_b + l_lo" if spec.d_transposed else "D_b + l_lo * sDl"
    w.line(f"const int fresh_d = !reuse_d || dt_from != {at};")
    w.line(f"dt_from = reuse_d ? {at} : 0;")


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
                if spec.d_transposed:
                    place = "D_b + (n0 + s * MR) * sDl + l0", "sDl", "1"
                else:
                    place = "D_b + l0 * sDl + n0 + s * MR", "1", "sDl"
                packed = f"{dt} + (long)s * SLIVER(lc)"
                _sliver_call(w, spec.kernel, "lc", "direct_d", place, packed, "p, c, LDE")
            w.line("cf_pf_step(&pf, pf_rows);")


def _op2_to_e(w: Writer, spec: GemmChainSpec, strip: str) -> None:
    """op2 of one l block and n block straight into E: rows m, mr at a time within each of Pᵀ's
    nr-column strips, columns n from D's nr-column strips, strip `s` at `strip` (packed by
    `pack_strips.c`, or D itself, `softmax_writes_e`)."""
    uk = spec.kernel.name
    scaled = softmax_writes_e(spec)  # (last_l: each row over its sum as it is stored)
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
              " inv ? inv + r : 0);") for c in named_heads(ker)]  # fmt: skip
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


def emit_store_e(w: Writer, spec: GemmChainSpec) -> None:
    """`<name>_store_e`: E[0:mc, :] = Eᵀ transposed, row i times inv_sum[i] after a softmax.
    A function of its own, kept out of line: inside the kernel's one big function its loops
    tripled the compile time (register allocation there grows faster than the code)."""
    softmax = spec.epilogue is Epilogue.SOFTMAX
    with w.block(
        f"static __attribute__((noinline)) void {spec.name}_store_e(int mc, long N,\n"
        "    const float* restrict Et, const float* restrict inv_sum,"
        " const cf_elem* restrict b2,\n    cf_elem* restrict E_b, long sEm, long LDE)"
    ):
        if not softmax:
            w.line("(void)inv_sum;")
        w.line("(void)b2; /* bias2 (from this range's first column), or none */")
        scaled = " * inv" if softmax else ""
        half = spec.dtype is not DType.FLOAT32
        # 16-bit E: bias2 added before the one rounding; fp32 E: added after the transposition
        added = " + CF_LOAD(b2[{c}])" if spec.bias2 and half else ""
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
                            plus = added.format(c="c + cc")
                            w.line(
                                f"for (int cc = 0; cc < {tb}; ++cc) e[c + cc] = CF_STORE(blk[r * {tb} + cc]{scaled}{plus});"
                            )
                with w.block(f"for (int r = 0; r < {tb}; ++r)"):
                    _e_row(w, softmax, "i + r")
                    plus = added.format(c="c2")
                    w.line(
                        f"for (long c2 = c; c2 < N; ++c2) e[c2] = CF_STORE(Et[c2 * LDE + i + r]{scaled}{plus});"
                    )
            first = "whole"
        w.line(
            "/* row by row: E is written contiguously, and the N lines of Eᵀ a row reads stay in L1"
        )
        w.line("   for the next rows */")
        with w.block(f"for (int i = {first}; i < mc; ++i)"):
            _e_row(w, softmax, "i")
            with w.block("for (long c = 0; c < N; ++c)"):
                w.line(f"e[c] = CF_STORE(Et[c * LDE + i]{scaled}{added.format(c='c')});")
        if spec.bias2 and not half:
            with w.block("for (int i = 0; i < mc; ++i)"):
                _e_row(w, False, "i")
                w.line("#pragma omp simd")
                w.line("for (long c = 0; c < N; ++c) e[c] += b2[c];")


def _e_row(w: Writer, softmax: bool, row: str) -> None:
    """Row `row` of E, and the factor its values take after a softmax."""
    w.line(f"cf_elem* restrict e = E_b + ({row}) * sEm;")
    if softmax:
        w.line(f"const float inv = inv_sum[{row}];")
