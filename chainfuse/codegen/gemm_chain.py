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

from chainfuse.codegen.common import ALIGN16, c_source, define_lines, header_comment, per_thread
from chainfuse.codegen.gemm_spec import HALF, Epilogue, GemmChainSpec, wide_heads, writes_e
from chainfuse.codegen.row_block import (
    copies_kv,
    emit_block,
    emit_free_kv_buffer,
    emit_free_memos,
    emit_kv_buffer,
    emit_narrow_keys,
    emit_narrow_memos,
    emit_store_e,
    narrows_keys,
    reuses_d,
)
from chainfuse.codegen.rows import (
    ROWS_LB,
    ROWS_MAX,
    emit_rows,
    rows_tail,
)
from chainfuse.codegen.softmax import (
    LAZY_SHIFT,
    SUM_CAP,
    emit_scores_strip,
    exponentiates_beside_op1,
    uses_exp2_strip,
)
from chainfuse.codegen.writer import Writer
from chainfuse.ir import DType
from chainfuse.kernels import emit_with_packing
from chainfuse.kernels.packing import DIRECT_ROW_STRIPS  # (B or D stored transposed)

__all__ = [
    "DIRECT_FAR_STRIPS",
    "DIRECT_ROW_STRIPS",
    "DIRECT_STRIDE",
    "DIRECT_STRIPS",
    "KV_APART",
    "PACKED",
    "emit_gemm_chain",
]

#: Row blocks of at most this many nr-strips read B and D slivers in place, not packed
#: (docs/tuning.md) ...
DIRECT_STRIPS = 8
#: ... if the slivers' rows are at most this many elements apart (docs/tuning.md) ...
DIRECT_STRIDE = 256
#: ... or at any distance for this many strips: a packed copy used once or twice does not pay
#: for its writes (docs/tuning.md)
DIRECT_FAR_STRIPS = 2
#: An attention's k and v whose rows lie more than this many elements further apart than a
#: row's length are copied contiguous once a head and thread, where the thread runs several
#: row blocks of the head (`row_block.emit_kv_buffer`; docs/tuning.md)
KV_APART = 0


#: Slots of the one array `<name>_packed` takes (longs): pointers, then the scalars, then arrays.
PACKED = {
    "A": 0, "B": 1, "D": 2, "E": 3, "mask": 4, "work": 5, "work_per_thread": 6, "nthreads": 7,
    "scale_bits": 8, "sizes": 9, "strides": 15, "mask_strides": 27, "outer_m": 31, "tiles": 32,
    "schedule": 36, "bias1": 40, "bias2": 41, "B3": 42, "packed": 43, "end": 44,
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
    header_comment(w, header)
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
    w.line(
        f"#define ROWS_TAIL {rows_tail(ker)} /* rows past whole strips of a block that take _rows */"
    )
    if ker.part_cols:
        w.line("/* the columns a tail strip of n < NR computes: whole narrow blocks (<uk>_cols) */")
        pc = ker.part_cols
        w.line(f"#define CF_NW(n) ((n) >= NR ? NR : ((n) + {pc - 1}) / {pc} * {pc})")
    w.line(f"#define ROWS_LB {ROWS_LB} /* ... l (keys) at a time */")
    if spec.softcap is not None:
        w.line(f"#define CF_CAP {spec.softcap!r}f /* soft-capping: cap tanh(s / cap) */")
        w.line("#define CF_CAP2 (CF_CAP * CF_LOG2E) /* ... in base 2 */")
    w.line(f"#define LAZY_SHIFT {LAZY_SHIFT}.0f /* a shift kept while maxima stay this close */")
    w.line(f"#define SUM_BIG {2**SUM_CAP}.0f /* 2^SUM_CAP: a strip's sum rescaled from it */")
    w.line(ALIGN16)
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
        w.line("#define DIRECT_MC_ROWS 0")
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
        w.line(
            f"#define DIRECT_MC_ROWS {DIRECT_ROW_STRIPS} * NR /* ... where B or D is stored transposed */"
        )
        w.line(f"#define DIRECT_STRIDE {DIRECT_STRIDE} /* ... if their rows are this close */")
        w.line(
            f"#define DIRECT_FAR_STRIPS {DIRECT_FAR_STRIPS} /* ... or at most this many strips */"
        )
    if copies_kv(spec):
        w.line(f"#define KV_APART {KV_APART} /* k, v rows this much further apart: copied */")
    w.line("")
    if uses_exp2_strip(spec) and ker.exp2_strip is not None:
        w.lines(ker.exp2_strip(ker))
    if spec.b_transposed or spec.d_transposed:  # (`_rows_scores_by_key`, `_rows_dot_d`)
        w.lines(c_source("dot4.c"))
    w.lines(c_source("pack_panel.c"))
    w.lines(c_source("claim.c"))
    if writes_e(spec):
        w.lines(c_source("pack_strips.c"))
    w.lines(c_source("prefetch.c"))
    w.line("/* floats of workspace one thread needs: packed Aᵀ, packed Bᵀ, the intermediate Pᵀ,")
    w.line("   packed Dᵀ, the Eᵀ accumulator, the softmax column statistics, and the row path's")
    w.line("   rows of A and accumulators (_rows)")
    w.line("   (AK and DTN: the code schedule's, see _schedule below) */")
    with w.block(
        f"long {name}_workspace(long K, long N, const long* tiles, const long* code_schedule)"
    ):
        w.line("CF_TILES(tiles)")
        w.line("const long TK = K < T_K ? K : T_K;")
        w.line("const long AK = code_schedule[1], DTN = code_schedule[2];")
        w.line(
            "return ALIGN16(MPN * AK) + LPM / MR * SLIVER(TK) + ALIGN16(MPN * LPM)"
            " + DTN * DTF + ALIGN16(N * LDE) + 2 * ALIGN16(MPN)"
            " + ALIGN16(ROWS_MAX * K) + ALIGN16(ROWS_MAX * N) + CF_WIDE(K, N)"
            + (" + LPM / MR * SLIVER(TK) + ALIGN16(MPN * LPM);" if spec.gated else ";")
        )
    w.line("")
    if exponentiates_beside_op1(spec):
        emit_scores_strip(w, spec)
        w.line("")
    emit_store_e(w, spec)
    if narrows_keys(spec):
        w.line("")
        emit_narrow_keys(w, spec)
    w.line("")
    emit_rows(w, spec)
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
        f"    const long* tiles, const long* code_schedule, const cf_elem* restrict bias1,\n"
        f"    const cf_elem* restrict bias2, const cf_elem* restrict B3)"
    ):
        w.line("CF_TILES(tiles)")
        w.line("const long nb0 = sizes[0], nb1 = sizes[1], M = sizes[2], N = sizes[3];")
        w.line("const long K = sizes[4], L = sizes[5];")
        w.line("const long sA0 = strides[0], sA1 = strides[1], sAm = strides[2];")
        w.line("const long sB0 = strides[3], sB1 = strides[4], sBr = strides[5];")
        w.line("const long sD0 = strides[6], sD1 = strides[7], sDl = strides[8];")
        w.line("const long sE0 = strides[9], sE1 = strides[10], sEm = strides[11];")
        w.line("const long TK = K < T_K ? K : T_K;")
        _schedule(w, spec)
        w.line("/* the parallel blocks: a batch index and T_MO rows of m (the plan's outermost m")
        w.line("   tile: the blocks its model deals to the cores), run as row blocks of T_M */")
        w.line("const long T_MO = outer_m < T_M ? T_M : outer_m;")
        w.line("const long mblocks = (M + T_MO - 1) / T_MO;")
        w.line("const long blocks = nb0 * nb1 * mblocks;")
        w.line(
            "const long LQ = (L + (long)split * MR - 1) / ((long)split * MR) * MR; /* l per share */"
        )
        if spec.epilogue is Epilogue.SOFTMAX and spec.softcap is not None:
            w.line("/* soft-capped scores: A packed times scale / cap, cf_softcap's argument;")
            w.line("   the strips' softmax makes them cap tanh(scale s / cap) in base 2 */")
            w.line("const float scale2 = scale / CF_CAP;")
        elif spec.epilogue is Epilogue.SOFTMAX:
            w.line("/* the scores in base 2: exp(x) = 2^(x log2(e)) */")
            w.line("const float scale2 = scale * CF_LOG2E;")
        w.line("(void)scale; (void)bias1; (void)bias2; (void)B3; /* (null where absent) */")
        w.line("/* mask strides (elements, 0 where it broadcasts): batch0, batch1, m, l */")
        w.line("const long sM0 = mask_strides[0], sM1 = mask_strides[1];")
        w.line("const long sMm = mask_strides[2], sMl = mask_strides[3];")
        w.line("(void)mask_data; (void)sM0; (void)sM1; (void)sMm; (void)sMl;")
        w.line("/* the next block to claim (split == 1): see cf_claim */")
        w.line("long next_blk = 0;")
        if narrows_keys(spec):
            w.line("const long per_mo = (T_MO + T_M - 1) / T_M; /* row blocks of a parallel one */")
            emit_narrow_memos(w, "mblocks * per_mo")
        with per_thread(w):
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
            if spec.gated:
                w.line("/* a gated MLP's up projection: its packed panel and its score tile */")
                w.line("float* restrict Bt3 = rows_w + CF_WIDE(K, N);")
                w.line("float* restrict P3t = Bt3 + LPM / MR * SLIVER(TK);")
            if reuses_d(spec):
                w.line("/* whose D the packed blocks in Dt hold (reuse_d): where it starts */")
                w.line("const cf_elem* dt_from = 0;")
            emit_kv_buffer(w, spec)
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
                emit_block(w, spec)
                w.line("if (nxt < 0) nxt = cf_claim(&next_blk);")
            emit_free_kv_buffer(w, spec)
        if narrows_keys(spec):
            emit_free_memos(w)
        if spec.epilogue is not Epilogue.SOFTMAX:
            _split_sum(w, spec)
    w.line("")
    w.line("/* the same with every argument in one array, for callers that pay per argument")
    w.line(
        "   (ctypes: ~0.2 us each): see PACKED in chainfuse.codegen.gemm_chain for the layout */"
    )
    with w.block(f"void {name}_packed(const long* a)"):
        w.line("const uint32_t bits = (uint32_t)a[8];")
        w.line("float scale;")
        w.line("memcpy(&scale, &bits, sizeof scale);")
        w.line(
            f"{name}((const cf_elem*)a[0], (const cf_elem*)a[1], (const cf_elem*)a[2],"
            " (cf_elem*)a[3], a + 9, a + 15, scale, (const void*)a[4], a + 27,"
            " (float*)a[5], a[6], (int)a[7], a[31], a + 32, a + 36, (const cf_elem*)a[40],"
            " (const cf_elem*)a[41], (const cf_elem*)a[42]);"
        )
    return w.text()


def _tiles_macro(w: Writer, spec: GemmChainSpec) -> None:
    """`CF_TILES(t)`: the plan's tiles, run-time arguments (one compiled object serves every
    plan of a chain's structure: a new sequence length never waits for the compiler), and the
    padded extents and workspace regions that follow from them, as locals of the function."""
    w.line("/* the tiles T_M, T_L, T_K, T_N (run-time arguments) and what follows from them:")
    w.line("   T_M and T_N rounded up to whole nr strips, T_L and T_N to whole mr slivers; Eᵀ's")
    w.line("   row stride LDE is MPN plus one cache line, so that rows do not all fall in the same")
    w.line("   cache sets when MPN is a power of two (the transposition reads down a column); DTF")
    w.line("   floats of packed D (Dᵀ slivers, or D's nr-column strips when op2 writes E) */")
    if writes_e(spec):
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
    define_lines(w, "CF_TILES(t)", lines)


def _schedule(w: Writer, spec: GemmChainSpec) -> None:
    """The code schedule's decisions (`codegen.schedule.SCHEDULE`), read from its argument: the
    C takes them as they are and decides none of them itself. A softmax's split is 1 by its
    structure (`CodeSchedule.split`), so its code is compiled without the split paths."""
    w.line("/* the code schedule (chainfuse.codegen.schedule): the row path's reach, Aᵀ's packed k")
    w.line("   (all of K or one block), packed blocks of D kept, threads sharing a block's l */")
    w.line("const int rows_max = (int)code_schedule[0];")
    w.line("const long AK = code_schedule[1], DTN = code_schedule[2];")
    if spec.epilogue is Epilogue.SOFTMAX:
        w.line("const int split = 1; /* (code_schedule[3]: a softmax never splits l) */")
    else:
        w.line("const int split = (int)code_schedule[3];")


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
                " bias2 ? bias2 + n_lo : 0, E_b + n_lo, sEm, LDE);"
            )
