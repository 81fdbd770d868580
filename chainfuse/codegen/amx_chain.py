"""Lower a bf16 GEMM chain onto AMX tiles: `E = f(A . B + b1) . D + b2` (or a gated MLP's
`(f(A . B) * (A . B3)) . D`), bf16 in and out, fp32 in tiles.

One source, two builds: the C calls the `CF_TILE_*` macros of `csrc/amx_tiles.c`, which are the
AMX instructions (`-mamx-tile -mamx-bf16`) or, with `-DCF_AMX_EMULATE`, their bit-exact plain-C
emulation (any host; `kernels.amx.AmxPath`). The blocks::

    for (b, m_o) claimed by this thread:          # MB rows of m (T_M), parallel
        A's rows: in place (k whole 32s, whole 16-row tiles), else packed once, zero-padded
        for l_o:                                   # blocks of T_L keys (whole 32s); causal:
                                                   # only up to the block's last row's key
            pack B[:, l_o] and D[l_o, :] as VNNI tiles (zeros past k, l and n), or
            take those tiles from the weights packed once (`packed`: ops.pack_weights)
            for m_i in m_o, 32 rows at a time:     # causal: its keys only, in whole 32s
                S = A[m_i, :] . B[:, l_o]          # op1: fp32 tiles over all of k (gated: S3
                                                   # = A[m_i, :] . B3[:, l_o] too)
                P = bf16(f(S + b1))                # fp32 f (softmax: online, per row; scaled,
                                                   # masked, causal compare, then exp)
                Eacc[m_i, :] (+)= P . D[l_o, :]    # op2: fp32 tiles, kept in scratch
        E[m_o, :] = bf16(Eacc + b2)                # (softmax: Eacc / the rows' sums + b2)

A softmax's mask (boolean: bytes, True takes part, added as 0 / -inf as SDPA adds it; additive:
bf16, added to the scaled scores) is read element by element through its strides along
(batch0, batch1, m, l), 0 where it broadcasts, as the fp32 path reads it; `is_causal` masks keys
past the query (top-left aligned, a select). A row with no key above -inf gets zeros where the
softmax is safe (attention), else NaN. NaN and inf go through as in PyTorch's unfused ops: a
NaN score poisons its row (the max skips it, its exponential does not), masked or not, an inf
score makes its row NaN; keys the causal loop never computes cannot.

The intermediate is rounded to bf16 before op2, as PyTorch's unfused bf16 chain rounds it (f
itself runs on the fp32 scores, one rounding fewer than PyTorch's bf16 C then bf16 f(C)); E is
rounded once. Every size, stride and tile is a run-time argument, and the entry points are
those of `gemm_chain.emit_gemm_chain` (`<name>_packed` over the `PACKED` array, and
`<name>_workspace`), so `compiled.Kernel` calls either alike.
"""

from __future__ import annotations

import dataclasses

from chainfuse.codegen.common import (
    ALIGN16,
    c_source,
    chain_lines,
    define_lines,
    header_comment,
    per_thread,
)
from chainfuse.codegen.gemm_spec import Epilogue, GemmChainShape, GemmChainSpec
from chainfuse.codegen.row_block import (
    emit_free_memos,
    emit_narrow_keys,
    emit_narrow_memos,
    narrow_memo_args,
    narrows_keys,
)
from chainfuse.codegen.schedule import CodeSchedule, TileChange
from chainfuse.codegen.softmax import activation_c
from chainfuse.codegen.writer import Writer
from chainfuse.ir import Chain, MaskKind
from chainfuse.kernels.amx import AMX_BF16_32X32, AmxPath
from chainfuse.planner import Plan

__all__ = [
    "AMX_MAX_L",
    "AMX_MAX_M",
    "AMX_MAX_WORKSPACE",
    "PACKED_HEADER",
    "amx_arithmetic",
    "amx_describe",
    "amx_header",
    "amx_prelude",
    "amx_schedule",
    "amx_unsupported",
    "amx_workspace_bytes",
    "emit_amx_chain",
    "emit_tile_config",
]

#: Rows of m per parallel block at most: the block's fp32 E accumulator and packed A stay small
AMX_MAX_M = 256
#: Keys per l block at most: its packed B and D panels and the fp32 scores of 32 rows
AMX_MAX_L = 512


#: Bytes of one thread's workspace at most (`CF_AMX_REGIONS` at the largest tiles): k and n
#: run whole in tiles, so a chain whose K or N is larger takes the fp32 path, which tiles them
AMX_MAX_WORKSPACE = 64 << 20


def amx_workspace_bytes(K: int, N: int, gated: bool = False) -> int:
    """One thread's workspace (`CF_AMX_REGIONS`) at the largest tiles, in bytes (`gated`: a
    gated MLP's, with the up projection's panel and scores)."""
    kp, lde, mb, tl = _r32(K), -(-N // 16) * 16, AMX_MAX_M, AMX_MAX_L

    def a16(x: int) -> int:
        return -(-x // 16) * 16

    floats = (a16(kp * tl // 2) + a16(tl * lde // 2) + a16(mb * kp // 2) + a16(32 * tl)
              + a16(16 * tl) + a16(mb * lde) + 2 * a16(mb))  # fmt: skip
    if gated:
        floats += a16(kp * tl // 2) + a16(32 * tl)
    return 4 * floats


def amx_unsupported(shape: GemmChainShape, k_n: tuple[int, int] | None = None) -> str:
    """Why the AMX generator does not take a chain of `shape` ("" when it does). It takes every
    chain `match_gemm_chain` recognises (every between, masks of both kinds and causal
    softmaxes, B and D stored either way, biases, the gated MLP) whose reduction and output
    widths `k_n` = (K, N), when given, keep a thread's workspace within `AMX_MAX_WORKSPACE`
    (a bias before a softmax is an additive mask over l: the kernels read it as one)."""
    if k_n is not None:
        need = amx_workspace_bytes(*k_n, shape.gate is not None)
        if need > AMX_MAX_WORKSPACE:
            return (
                f"K = {k_n[0]} and N = {k_n[1]} run whole in AMX tiles: {need} bytes of workspace"
                f" a thread, past {AMX_MAX_WORKSPACE}"
            )
    return ""


def _r32(x: int) -> int:
    return -(-x // 32) * 32


def amx_schedule(schedule: CodeSchedule) -> CodeSchedule:
    """`schedule` (made with `AMX_BF16_32X32`) with the tiles the AMX code runs: T_M rows of m
    per parallel block and T_L keys per l block, each whole 32s (two tiles) and bounded
    (`AMX_MAX_M`, `AMX_MAX_L`); k and n run whole (T_K = K, T_N = N)."""
    spec = schedule.spec
    if spec.kernel is not AMX_BF16_32X32:
        raise ValueError(f"amx_schedule: {spec.name} was scheduled for {spec.kernel.name}")
    _, _, M, N, K, L = schedule.sizes
    code = {
        "T_M": min(_r32(spec.T_M), AMX_MAX_M, _r32(M)),
        "T_L": min(_r32(spec.T_L), AMX_MAX_L, _r32(L)),
        "T_K": K,
        "T_N": N,
    }
    why = {
        "T_M": "AMX row blocks: whole 32 rows (two tiles), at most the rows there are",
        "T_L": "AMX l blocks: whole 32 keys (one VNNI block), at most the keys there are",
        "T_K": "AMX: op1 runs all of k in tiles",
        "T_N": "AMX: op2 runs all of n in tiles",
    }
    changes = list(schedule.changes)
    for tile, value in code.items():
        before = getattr(spec, tile)
        if value != before:
            changes.append(TileChange(tile, before, value, why[tile]))
    spec = dataclasses.replace(
        spec, T_M=code["T_M"], T_L=code["T_L"], T_K=code["T_K"], T_N=code["T_N"]
    )
    return dataclasses.replace(schedule, spec=spec, changes=tuple(changes), a_k=K)


def amx_arithmetic(path: AmxPath) -> str:
    """`Kernel.arithmetic` of an AMX kernel: what it computes in, said plainly."""
    return (
        f"{path.value}: bf16 inputs, fp32 accumulation in AMX tiles (TDPBF16PS), f in fp32, "
        "the intermediate rounded to bf16 before the second GEMM, output rounded to bf16 once"
    )


def amx_header(chain: Chain, chosen: Plan, spec: GemmChainSpec, path: AmxPath) -> str:
    """The source's opening comment: the chain's structure and the path (no sizes, no tiles:
    those are arguments)."""
    ops, roles = chain_lines(chain)
    return (
        f"chainfuse generated kernel {spec.name} ({path.value})\n"
        f"chain:\n{ops}\n"
        f"tensors: {roles}\n"
        f"order {' > '.join(chosen.order)}; tiles T_M (rows per parallel block) and T_L "
        "(keys per l block): run-time arguments\n"
        f"micro-kernel {spec.kernel.name}: 2x2 fp32 tiles of 16x16, A and B in bf16 tiles; "
        f"epilogue {spec.epilogue.value}; parallel over the batch and m\n"
        f"arithmetic: {amx_arithmetic(path)}"
    )


def amx_describe(schedule: CodeSchedule, path: AmxPath) -> str:
    """What the compiled AMX code runs (`Kernel.describe`)."""
    m, l_, k, n = schedule.loops
    spec = schedule.spec
    lines = [
        f"  {path.value}: parallel blocks of {spec.T_M} rows of {m}, l blocks of {spec.T_L}"
        f" keys; all of {k} and {n} in tiles",
        *(f"  {c.tile} {c.planned} -> {c.code}: {c.reason}" for c in schedule.changes),
        f"  micro-kernel {spec.kernel.name}: 32 rows of {m} by 32 of {l_} (op1) or of {n}"
        " (op2), 16-row and 16-column tails in single tiles",
        f"  B and D packed as VNNI tiles per l block, or read from the weights packed once (a"
        f" call's `packed`); A read in place where {k} is whole 32s",
    ]
    if spec.bias1 or spec.bias2:
        lines.append("  biases added in fp32: bias1 before f, bias2 before E's one rounding")
    if spec.gated:
        lines.append(f"  gated: op1 runs B and B3 over all of {k}; f(S) * S3 rounded to bf16")
    if spec.mask is not MaskKind.NONE:
        lines.append(f"  {spec.mask.value} mask read through its strides, added in fp32")
    if spec.causal:
        lines.append(
            f"  causal: blocks of {l_} past a block's last query skipped, the diagonal compared"
        )
    return "\n".join(lines)


def emit_amx_chain(spec: GemmChainSpec, header: str, path: AmxPath) -> str:
    """C source of `void <name>(...)`, `void <name>_packed(const long*)` (its arguments laid out
    as `gemm_chain.PACKED`) and `long <name>_workspace(K, N, tiles, code_schedule)` for `spec`
    on AMX tiles; built with `path.cflags`."""
    if spec.kernel is not AMX_BF16_32X32:
        raise ValueError(f"emit_amx_chain: {spec.name} is for {spec.kernel.name}")
    name = spec.name
    softmax = spec.epilogue is Epilogue.SOFTMAX
    w = amx_prelude(header, path)
    w.lines(spec.kernel.full_tile(spec.kernel))
    w.line("")
    emit_tile_config(w)
    w.line("")
    _emit_pack_vnni(w)
    w.line("")
    if narrows_keys(spec):
        emit_narrow_keys(w, spec, "uint16_t")
        w.line("")
    w.line(f"#define CF_GATED {int(spec.gated)} /* a gated MLP: the up projection's B3 too */")
    _emit_regions(w)
    with w.block(
        f"long {name}_workspace(long K, long N, const long* tiles, const long* code_schedule)"
    ):
        w.line("(void)code_schedule;")
        w.line("CF_AMX_REGIONS(tiles, K, N)")
        w.line("return SCRATCH;")
    w.line("")
    w.line(
        "/* sizes: batch0, batch1, M, N, K, L; strides (elements) of A, B, D, E: batch0, batch1,"
    )
    w.line(
        "   row (the last dim is contiguous); B's row is k (or l when B is stored transposed) */"
    )
    with w.block(
        f"void {name}(const uint16_t* restrict A, const uint16_t* restrict B,\n"
        "    const uint16_t* restrict D, uint16_t* restrict E, const long* sizes,\n"
        "    const long* strides, float scale, const void* restrict mask_data,\n"
        "    const long* mask_strides, float* restrict work, long work_per_thread,\n"
        "    int nthreads, const long* tiles, const uint16_t* restrict bias1,\n"
        "    const uint16_t* restrict bias2, const uint16_t* restrict B3,\n"
        "    const uint16_t* restrict packed)"
    ):
        w.line("const long nb0 = sizes[0], nb1 = sizes[1], M = sizes[2], N = sizes[3];")
        w.line("const long K = sizes[4], L = sizes[5];")
        w.line("const long sA0 = strides[0], sA1 = strides[1], sAm = strides[2];")
        w.line("const long sB0 = strides[3], sB1 = strides[4], sBr = strides[5];")
        w.line("const long sD0 = strides[6], sD1 = strides[7], sDl = strides[8];")
        w.line("const long sE0 = strides[9], sE1 = strides[10], sEm = strides[11];")
        w.line("CF_AMX_REGIONS(tiles, K, N)")
        w.line("const long sM0 = mask_strides[0], sM1 = mask_strides[1];")
        w.line("const long sMm = mask_strides[2], sMl = mask_strides[3];")
        w.line("(void)scale; (void)mask_data; (void)sM0; (void)sM1; (void)sMm; (void)sMl;")
        w.line("const long KB = KP / 32; /* k blocks of 32: op1's tile steps */")
        w.line("(void)bias1; (void)bias2; (void)B3; /* (null where absent) */")
        _emit_prepacked(w)
        w.line("const long mblocks = (M + MB - 1) / MB, blocks = nb0 * nb1 * mblocks;")
        w.line("long next_blk = 0; /* the next block to claim: see cf_claim */")
        if narrows_keys(spec):
            emit_narrow_memos(w, "mblocks")
        with per_thread(w):
            w.line("float* restrict base = work + (long)t * work_per_thread;")
            w.line("uint16_t* restrict Bp = (uint16_t*)base; /* B's l block, VNNI tiles */")
            if spec.gated:
                w.line("uint16_t* restrict B3p = (uint16_t*)(base + AT_B3); /* B3's, the same */")
                w.line("float* restrict S3 = base + AT_S3; /* the up projection's fp32 block */")
            w.line(
                "uint16_t* restrict Dp = (uint16_t*)(base + AT_DP); /* D's l block, VNNI tiles */"
            )
            w.line("uint16_t* restrict Ap = (uint16_t*)(base + AT_AP); /* A's rows, when packed */")
            w.line("float* restrict S = base + AT_S; /* op1's fp32 block: 32 rows of TLP */")
            w.line("uint16_t* restrict P = (uint16_t*)(base + AT_P); /* bf16 f(S): op2's A */")
            w.line("float* restrict Eacc = base + AT_E; /* fp32 E of the row block */")
            if softmax:
                w.line("float* restrict row_max = base + AT_STATS; /* online softmax, per row */")
                w.line("float* restrict row_sum = row_max + ALIGN16(MB);")
            if softmax:
                _emit_head_buffer(w)
            w.line("cf_amx_config(); /* once per call and thread */")
            with w.block(
                "for (long blk = cf_claim(&next_blk); blk < blocks; blk = cf_claim(&next_blk))"
            ):
                _emit_block(w, spec)
            w.line("CF_TILE_RELEASE();")
            if softmax:
                w.line("free(head_vnni);")
        if narrows_keys(spec):
            emit_free_memos(w)
    w.line("")
    w.line("/* the same with every argument in one array (gemm_chain.PACKED's layout): what")
    w.line("   compiled.Kernel calls; the outer_m and code_schedule slots are not read */")
    with w.block(f"void {name}_packed(const long* a)"):
        w.line("const uint32_t bits = (uint32_t)a[8];")
        w.line("float scale;")
        w.line("memcpy(&scale, &bits, sizeof scale);")
        w.line(
            f"{name}((const uint16_t*)a[0], (const uint16_t*)a[1], (const uint16_t*)a[2],"
            " (uint16_t*)a[3], a + 9, a + 15, scale, (const void*)a[4], a + 27, (float*)a[5],"
            " a[6], (int)a[7], a + 32, (const uint16_t*)a[40], (const uint16_t*)a[41],"
            " (const uint16_t*)a[42], (const uint16_t*)a[43]);"
        )
    return w.text()


def amx_prelude(header: str, path: AmxPath) -> Writer:
    """A new source's opening shared by the AMX generators: the header, the build line, the C
    helpers (math, bf16 conversions, the tile macros, work claiming) and the common macros."""
    w = Writer()
    header_comment(w, header)
    w.line(f"/* {path.value}: built with {' '.join(path.cflags)} */")
    w.lines(c_source("math.c"))
    w.line("/* half.c's widening helpers read these; only its bf16 conversions are used here */")
    w.line("#define CF_LOAD(x) cf_from_bf16(x)")
    w.line("#define MR 16")
    w.line("#define NR 16")
    w.lines(c_source("half.c"))
    w.lines(c_source("amx_tiles.c"))
    w.lines(c_source("claim.c"))
    w.line(ALIGN16)
    w.line("#define CF_R32(x) (((x) + 31) / 32 * 32) /* rounded up to whole 32s */")
    return w


def emit_tile_config(w: Writer) -> None:
    """`cf_amx_config`: every tile 16 rows of 64 bytes (palette 1)."""
    w.line(
        "/* the tile configuration: all 8 tiles 16 rows x 64 bytes (16 x 32 bf16, 16 x 16 fp32) */"
    )
    with w.block("static void cf_amx_config(void)"):
        w.line("cf_tilecfg cfg;")
        w.line("memset(&cfg, 0, sizeof cfg);")
        w.line("cfg.palette_id = 1;")
        with w.block("for (int t = 0; t < 8; ++t)"):
            w.line("cfg.colsb[t] = 64;")
            w.line("cfg.rows[t] = 16;")
        w.line("CF_TILE_LOADCONFIG(&cfg);")


def _emit_pack_vnni(w: Writer) -> None:
    """`cf_amx_pack_vnni`: a panel of a bf16 matrix packed as VNNI tiles, zeros past its end."""
    w.line("/* X(r, c) = X[r * rs + c * cs], `rows` x `cols` of it, packed as kb x ct VNNI tiles")
    w.line(
        "   (kb blocks of 32 rows, ct tiles of 16 columns; zeros past rows and cols): tile (p, c)"
    )
    w.line("   at out + (c * kb + p) * 512, its row q holding X(32p + 2q, 16c + j) and")
    w.line("   X(32p + 2q + 1, 16c + j) at 2j and 2j + 1 (TDPBF16PS's layout of its B) */")
    with w.block(
        "static void cf_amx_pack_vnni(const uint16_t* restrict X, long rs, long cs, long rows,\n"
        "    long cols, long kb, long ct, uint16_t* restrict out)"
    ):
        with w.block("for (long c = 0; c < ct; ++c)"):
            w.line("const long c0 = 16 * c, nc = cols - c0 < 16 ? cols - c0 : 16;")
            with w.block("for (long p = 0; p < kb; ++p)"):
                w.line("uint16_t* restrict tile = out + (c * kb + p) * 512;")
                with w.block("for (long q = 0; q < 16; ++q)"):
                    w.line("const long r = 32 * p + 2 * q;")
                    w.line("const uint16_t* restrict x0 = X + r * rs + c0 * cs;")
                    w.line("uint16_t* restrict row = tile + 32 * q;")
                    w.line("long j = 0;")
                    with w.block("if (r + 1 < rows)"):
                        with w.block("for (; j < nc; ++j)"):
                            w.line("row[2 * j] = x0[j * cs];")
                            w.line("row[2 * j + 1] = x0[rs + j * cs];")
                    with w.block("else if (r < rows)"):
                        with w.block("for (; j < nc; ++j)"):
                            w.line("row[2 * j] = x0[j * cs];")
                            w.line("row[2 * j + 1] = 0;")
                    w.line("for (; j < 16; ++j) row[2 * j] = row[2 * j + 1] = 0;")


def _emit_regions(w: Writer) -> None:
    """`CF_AMX_REGIONS(tiles, K, N)`: the run-time tiles and the workspace's regions (floats
    from a thread's base, each whole 64-byte lines)."""
    w.line("/* the tiles (run-time arguments): MB rows of m per parallel block, TLP keys per l")
    w.line("   block, both whole 32s; K and N padded to whole tiles; a thread's workspace regions")
    w.line("   (floats from its base): B's and D's VNNI panels, A's rows (when packed), op1's fp32")
    w.line("   block S, its bf16 f(S) P, the row block's fp32 E, the softmax's row stats, and a")
    w.line("   gated MLP's B3 panel and fp32 block S3 */")
    lines = [
        "const long MB = CF_R32((tiles)[0]), TLP = CF_R32((tiles)[1]);",
        "const long KP = CF_R32(K), NT = ((N) + 15) / 16, LDE = NT * 16;",
        "const long AT_DP = ALIGN16(KP * TLP / 2), AT_AP = AT_DP + ALIGN16(TLP * NT * 8);",
        "const long AT_S = AT_AP + ALIGN16(MB * KP / 2), AT_P = AT_S + ALIGN16(32 * TLP);",
        "const long AT_E = AT_P + ALIGN16(16 * TLP), AT_STATS = AT_E + ALIGN16(MB * LDE);",
        "const long AT_B3 = AT_STATS + 2 * ALIGN16(MB);",
        "const long AT_S3 = AT_B3 + CF_GATED * ALIGN16(KP * TLP / 2);",
        "const long SCRATCH = AT_S3 + CF_GATED * ALIGN16(32 * TLP);",
        "(void)AT_STATS; (void)AT_S3;",
    ]
    define_lines(w, "CF_AMX_REGIONS(tiles, K, N)", lines)


#: uint16s of `packed`'s header (64 bytes: see `ops.packed`) before the tiles
PACKED_HEADER = 32


def _emit_prepacked(w: Writer) -> None:
    """Where the weights packed once (`packed`, `ops.pack_weights`) lie: past the header, B's
    VNNI tiles over all of l (l tile-major, as `cf_amx_pack_vnni` lays out a panel: any l
    block of whole 32s is a slice), [B3's,] then D's (n tile-major over all of l's blocks:
    an l block's tiles are `LBL` apart)."""
    w.line("/* the weights packed once (null: packed per l block): past the header, B's VNNI")
    w.line("   tiles over all of l, [B3's,] then D's, whose n tiles are LBL l blocks apart */")
    w.line("const long LBL = CF_R32(L) / 32;")
    w.line(f"const uint16_t* restrict Bpk = packed ? packed + {PACKED_HEADER} : 0;")
    w.line("const uint16_t* restrict B3pk = packed && CF_GATED ? Bpk + KP * LBL * 32 : 0;")
    w.line("const uint16_t* restrict Dpk = packed ? Bpk + (1 + CF_GATED) * KP * LBL * 32 : 0;")
    w.line("(void)B3pk;")


def _emit_pack_l_block(
    w: Writer, spec: GemmChainSpec, l0: str, lc: str, lb: str, weights: list[tuple[str, str]],
    d_dst: str,
) -> None:  # fmt: skip
    """`lc` keys (l) from `l0` of each (source, destination) of `weights` (B's k x l, and B3's)
    and of D (l x n) into `d_dst`, packed as VNNI tiles: `lb` blocks of 32 keys, 2 * `lb` tiles
    of 16 (C expressions)."""
    for src, dst in weights:
        if spec.b_transposed:  # (stored [l][k])
            w.line(f"cf_amx_pack_vnni({src} + {l0} * sBr, 1, sBr, K, {lc}, KB, 2 * {lb}, {dst});")
        else:
            w.line(f"cf_amx_pack_vnni({src} + {l0}, sBr, 1, K, {lc}, KB, 2 * {lb}, {dst});")
    if spec.d_transposed:  # (stored [n][l])
        w.line(f"cf_amx_pack_vnni(D_b + {l0}, 1, sDl, {lc}, N, {lb}, NT, {d_dst});")
    else:
        w.line(f"cf_amx_pack_vnni(D_b + {l0} * sDl, sDl, 1, {lc}, N, {lb}, NT, {d_dst});")


def _emit_head_buffer(w: Writer) -> None:
    """An attention thread's buffer for a head's k and v as VNNI tiles over all of l, packed
    once a head (`_emit_block`) where the thread runs at least two row blocks of it (its share
    of the head's blocks, which the threads claim side by side); else, or where malloc fails,
    null: each row block packs each l block it reads, as before."""
    w.line("/* a head's k and v packed once as VNNI tiles where this thread runs at least two of")
    w.line("   its row blocks (else each row block packs every l block it reads) */")
    w.line(
        "uint16_t* head_vnni = !packed && mblocks / nthreads >= 2"
        "\n    ? malloc((size_t)(KP * LBL * 32 + LBL * 32 * NT * 16) * sizeof(uint16_t)) : 0;"
    )
    w.line("const uint16_t* head_from = 0; /* whose k and v head_vnni holds */")
    w.line("const uint16_t* head_from_v = 0;")


def _emit_block(w: Writer, spec: GemmChainSpec) -> None:
    """One parallel block: MB rows of m of one batch, through every l block."""
    softmax = spec.epilogue is Epilogue.SOFTMAX
    w.line("const long b0 = blk / (nb1 * mblocks), b1 = (blk / mblocks) % nb1;")
    w.line("const long m0 = (blk % mblocks) * MB, mc = M - m0 < MB ? M - m0 : MB;")
    w.line("const uint16_t* restrict A_b = A + b0 * sA0 + b1 * sA1 + m0 * sAm;")
    w.line("const uint16_t* restrict B_b = B + b0 * sB0 + b1 * sB1;")
    w.line("const uint16_t* restrict D_b = D + b0 * sD0 + b1 * sD1;")
    if spec.gated:
        w.line("const uint16_t* restrict B3_b = B3 + b0 * sB0 + b1 * sB1; /* (B's strides) */")
    w.line("uint16_t* restrict E_b = E + b0 * sE0 + b1 * sE1 + m0 * sEm;")
    w.line("/* k x l and l x n VNNI tiles over all of l: the weights packed once (`packed`), or")
    w.line("   this head's, packed by this thread (head_vnni); null: packed per l block */")
    w.line("const uint16_t* Bh = Bpk;")
    w.line("const uint16_t* Dh = Dpk;")
    if softmax:
        with w.block("if (head_vnni)"):
            with w.block("if (head_from != B_b || head_from_v != D_b)"):
                _emit_pack_l_block(w, spec, "0", "L", "LBL", [("B_b", "head_vnni")],
                                   "head_vnni + KP * LBL * 32")  # fmt: skip
                w.line("head_from = B_b;")
                w.line("head_from_v = D_b;")
            w.line("Bh = head_vnni;")
            w.line("Dh = head_vnni + KP * LBL * 32;")
    w.line("/* A's rows straight into tiles where k is whole 32s and every row tile whole; else")
    w.line("   packed once for the block, zeros past k and past its rows (to whole 16s) */")
    w.line("const int direct = K % 32 == 0 && mc % 16 == 0;")
    w.line("const uint16_t* restrict a_rows = direct ? A_b : Ap;")
    w.line("const long lda = 2 * (direct ? sAm : KP); /* bytes */")
    with w.block("if (!direct)"):
        with w.block("for (long i = 0; i < (mc + 15) / 16 * 16; ++i)"):
            w.line("uint16_t* restrict row = Ap + i * KP;")
            w.line("const long kc = i < mc ? K : 0;")
            w.line("for (long p = 0; p < kc; ++p) row[p] = A_b[i * sAm + p];")
            w.line("for (long p = kc; p < KP; ++p) row[p] = 0;")
    if softmax:
        with w.block("for (long i = 0; i < mc; ++i)"):
            w.line("row_max[i] = -INFINITY;")
            w.line("row_sum[i] = 0.0f;")
    if spec.mask is MaskKind.BOOL:
        w.line("const unsigned char* restrict mask_b =")
        w.line("    (const unsigned char*)mask_data + b0 * sM0 + b1 * sM1;")
    elif spec.mask is MaskKind.ADDITIVE:
        w.line(
            "const uint16_t* restrict mask_b = (const uint16_t*)mask_data + b0 * sM0 + b1 * sM1;"
        )
    bound = "m0 + mc < L ? m0 + mc : L" if spec.causal else "L"
    if spec.causal:
        w.line("/* causal: keys past the block's last query are masked for all its rows */")
    if narrows_keys(spec):
        w.line(
            "/* keys the mask leaves out for every row, at the start and the end: not computed */"
        )
        w.line(f"long l_lo = 0, l_end = {bound};")
        w.line(
            "cf_narrow_keys(mask_b, sMm, sMl, m0, (int)mc, &l_lo, &l_end, A_b, sAm, K, B_b, sBr,"
            f" D_b, sDl, N, {narrow_memo_args('blk % mblocks')}, L);"
        )
        w.line(
            "/* (slices of whole tiles start at whole 32s: the keys before, left out, weigh 0) */"
        )
        w.line("if (Bh) l_lo = l_lo / 32 * 32;")
    else:
        w.line(f"const long l_lo = 0, l_end = {bound};")
    with w.block("for (long l0 = l_lo; l0 < l_end; l0 += TLP)"):
        w.line("const long lc = l_end - l0 < TLP ? l_end - l0 : TLP;")
        w.line("const long LB = CF_R32(lc) / 32; /* blocks of 32 keys (tiles of 16: 2 * LB) */")
        w.line("/* this l block of B (k x l) and of D (l x n) as VNNI tiles: slices of the")
        w.line("   weights packed once (`packed`), else packed here */")
        w.line("const uint16_t* restrict Bl = Bp;")
        w.line("const uint16_t* restrict Dl = Dp;")
        w.line("long dstride = LB; /* tiles between D's column tiles */")
        if spec.gated:
            w.line("const uint16_t* restrict B3l = B3p;")
        with w.block("if (Bh)"):
            w.line("Bl = Bh + l0 / 16 * KB * 512;")
            w.line("Dl = Dh + l0 / 32 * 512;")
            w.line("dstride = LBL;")
            if spec.gated:
                w.line("B3l = B3pk + l0 / 16 * KB * 512;")
        with w.block("else"):
            weights = [("B_b", "Bp"), ("B3_b", "B3p")] if spec.gated else [("B_b", "Bp")]
            _emit_pack_l_block(w, spec, "l0", "lc", "LB", weights, "Dp")
        with w.block("for (long r0 = 0; r0 < mc; r0 += 32)"):
            w.line("const long rows = mc - r0 < 32 ? mc - r0 : 32;")
            w.line("const long rt16 = rows > 16 ? 32 : 16; /* the rows the tiles compute */")
            if spec.causal:
                w.line("/* causal: these rows' keys only (the first l block always has some) */")
                w.line("const long need = m0 + r0 + rows - l0;")
                w.line("const long lr = need < lc ? need : lc;")
                w.line("if (lr <= 0) continue;")
            else:
                w.line("const long lr = lc; /* the keys these rows take */")
            w.line("const long LBr = CF_R32(lr) / 32, LTr = 2 * LBr;")
            w.line(
                "const uint16_t* restrict a = (const uint16_t*)((const char*)a_rows + r0 * lda);"
            )
            w.line("/* op1: S = A[rows, :] . B[:, l0 : l0 + lr], fp32 tiles over all of k */")
            for bl, s_ in (("Bl", "S"), ("B3l", "S3")) if spec.gated else (("Bl", "S"),):
                with w.block("for (long c0 = 0; c0 < LTr; c0 += 2)"):
                    w.line(f"const uint16_t* restrict b = {bl} + c0 * KB * 512;")
                    w.line(
                        f"if (rows > 16) cf_amx_r2c2(KB, a, lda, b, KB, {s_} + c0 * 16, 4 * TLP, 0);"
                    )
                    w.line(f"else cf_amx_r1c2(KB, a, lda, b, KB, {s_} + c0 * 16, 4 * TLP, 0);")
            _emit_epilogue(w, spec)
            w.line("/* op2: Eacc[rows, :] (+)= P . D[l0 : l0 + lr, :], fp32 tiles */")
            with w.block("for (long c0 = 0; c0 < NT; c0 += 2)"):
                w.line("const uint16_t* restrict d = Dl + c0 * dstride * 512;")
                w.line("float* restrict e = Eacc + r0 * LDE + c0 * 16;")
                w.line("const int acc = l0 > l_lo;")
                for rt in (2, 1):
                    head = "if (rows > 16)" if rt == 2 else "else"
                    with w.block(head):
                        w.line(
                            f"if (c0 + 1 < NT) cf_amx_r{rt}c2(LBr, P, 2 * TLP, d, dstride, e,"
                            " 4 * LDE, acc);"
                        )
                        w.line(
                            f"else cf_amx_r{rt}c1(LBr, P, 2 * TLP, d, dstride, e, 4 * LDE, acc);"
                        )
    w.line(
        "/* E = bf16(Eacc), rounded once"
        + (", each row divided by its sum */" if softmax else " */")
    )
    plus = " + cf_from_bf16(bias2[j])" if spec.bias2 else ""
    if spec.bias2:
        w.line("/* bias2 added in fp32 before the one rounding */")
    with w.block("for (long i = 0; i < mc; ++i)"):
        w.line("const float* restrict src = Eacc + i * LDE;")
        w.line("uint16_t* restrict dst = E_b + i * sEm;")
        if softmax:
            empty = "0.0f" if spec.safe else "NAN"
            w.line("/* a row with no key above -inf has no mass: zeros where the softmax is safe")
            w.line("   (SDPA), else NaN (torch.softmax); a NaN in Eacc stays */")
            w.line(f"const float inv = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : {empty};")
            w.line(f"for (long j = 0; j < N; ++j) dst[j] = cf_to_bf16(src[j] * inv{plus});")
        else:
            w.line(f"for (long j = 0; j < N; ++j) dst[j] = cf_to_bf16(src[j]{plus});")


def _emit_epilogue(w: Writer, spec: GemmChainSpec) -> None:
    """P = bf16(f(S)) on the rows the tiles computed, zeros past the l block's keys."""
    ep = spec.epilogue
    if ep is Epilogue.SOFTMAX:
        _emit_online_softmax(w, spec)
        return
    said = "S" if ep is Epilogue.NONE else f"{ep.value}(S)"
    said = f"{said} * S3" if spec.gated else said
    said = said.replace("S", "(S + bias1)", 1) if spec.bias1 else said
    w.line(f"/* P = bf16({said}), f in fp32 (NaN stays NaN); zeros past lr (D's rows there are")
    w.line("   zero too) */")
    with w.block("for (long i = 0; i < rt16; ++i)"):
        w.line("const float* restrict s = S + i * TLP;")
        if spec.gated:
            w.line("const float* restrict s3 = S3 + i * TLP;")
        w.line("uint16_t* restrict p = P + i * TLP;")
        w.line("#pragma omp simd")
        with w.block("for (long j = 0; j < lr; ++j)"):
            w.line(
                "const float x = s[j]" + (" + cf_from_bf16(bias1[l0 + j]);" if spec.bias1 else ";")
            )
            v = activation_c(ep, "x")
            w.line(f"const float v = ({v})" + (" * s3[j];" if spec.gated else ";"))
            w.line("p[j] = cf_to_bf16(v);")
        w.line("for (long j = lr; j < LBr * 32; ++j) p[j] = 0;")


def _emit_online_softmax(w: Writer, spec: GemmChainSpec) -> None:
    """The online softmax of the block's scores: per row the scores scaled, masked and
    compared with the query (causal) in place, the running max and sum; a row's E so far
    rescaled when its max grows; P = bf16(exp(s - max)), its sum of the rounded values (the
    weights op2 really applies). A row with no unmasked key so far keeps zero mass."""
    w.line("/* online softmax in fp32 per row: a new max rescales the row's E and sum so far;")
    w.line("   P = bf16(exp(v - max)), v = scale s (+ mask), summed as rounded (the weights op2")
    w.line("   applies); the max skips NaN (its exponential is NaN: the row is poisoned) */")
    with w.block("for (long i = 0; i < rt16; ++i)"):
        w.line("float* restrict s = S + i * TLP;")
        w.line("uint16_t* restrict p = P + i * TLP;")
        with w.block("if (i >= rows)"):
            w.line("for (long j = 0; j < LBr * 32; ++j) p[j] = 0; /* rows past the block's */")
            w.line("continue;")
        w.line("const long r = r0 + i;")
        if spec.mask is not MaskKind.NONE:
            w.line("const long mk = (m0 + r) * sMm + l0 * sMl; /* the row's mask at key l0 */")
        w.line("float mx = row_max[r];")
        w.line("/* (vector lanes each skip NaN: the max of their maxima never holds one) */")
        w.line("#pragma omp simd reduction(max : mx)")
        with w.block("for (long j = 0; j < lr; ++j)"):
            if spec.softcap is not None:  # (before any mask: cap tanh(scale s / cap))
                cap = f"{spec.softcap!r}f"
                w.line(f"float v = cf_softcap(s[j] * (scale / {cap}), {cap});")
            else:
                w.line("float v = scale * s[j];")
            if spec.mask is MaskKind.ADDITIVE:
                w.line("v += cf_from_bf16(mask_b[mk + j * sMl]);")
            elif spec.mask is MaskKind.BOOL:
                w.line("v += mask_b[mk + j * sMl] ? 0.0f : -INFINITY; /* as SDPA: NaN stays */")
            if spec.causal:
                w.line("v = l0 + j > m0 + r ? -INFINITY : v;")
            w.line("s[j] = v;")
            w.line("mx = v > mx ? v : mx;")
        with w.block("if (mx > row_max[r] && l0 > l_lo)"):
            w.line("/* (a row with no mass so far: its E and sum are zeros, or NaN from V) */")
            w.line(
                "const float alpha = row_max[r] == -INFINITY ? 0.0f : cf_exp_neg(row_max[r] - mx);"
            )
            w.line("float* restrict e = Eacc + r * LDE;")
            w.line("for (long j = 0; j < N; ++j) e[j] *= alpha;")
            w.line("row_sum[r] *= alpha;")
        w.line("row_max[r] = mx;")
        w.line("const float shift = mx == -INFINITY ? 0.0f : mx; /* all masked: every p is 0 */")
        w.line("float sum = 0.0f;")
        w.line("#pragma omp simd reduction(+ : sum)")
        with w.block("for (long j = 0; j < lr; ++j)"):
            w.line("const uint16_t h = cf_to_bf16(cf_exp_neg(s[j] - shift));")
            w.line("p[j] = h;")
            w.line("sum += cf_from_bf16(h);")
        w.line("row_sum[r] += sum;")
        w.line("for (long j = lr; j < LBr * 32; ++j) p[j] = 0;")
