"""The packing routines that match a micro-kernel's panels (`pack_a`, `pack_b`, zero-padded
tails), and `emit_with_packing`: the kernel and its packing, what a generated source includes."""

from __future__ import annotations

from chainfuse.kernels.contract import MicroKernel

__all__ = [
    "AT_WHOLE",
    "DIRECT_ROW_STRIPS",
    "emit_with_packing",
    "keeps_a_whole",
    "pack_a",
    "pack_b",
]

#: A GEMM chain's code reads the fp32 slivers of a weight stored transposed (rows contiguous
#: along the reduction: nn.Linear's weights, attention's K) in place, not packed, in row blocks
#: of at most this many nr-strips: a cold weight streams in under the micro-kernel's FMAs, where
#: packing it is a pass of its own (docs/tuning.md). Here, below both, because the code
#: (`codegen.row_block`) and the model's packing term (`model.efficiency`) follow it alike.
DIRECT_ROW_STRIPS = 16
#: Floats of Aᵀ a GEMM chain's thread keeps packed whole: all of k, packed once per row block
#: for every l block (docs/tuning.md#at_whole); the code schedule and the model's packing term
#: read it alike.
AT_WHOLE = 1 << 20


def keeps_a_whole(k: int, tile_k: int, tile_m: int, nr: int) -> bool:
    """Whether a GEMM chain's code packs Aᵀ's row block whole (all `k`, once for every l
    block; `AT_WHOLE`) rather than one k block at a time, packed again for each l block."""
    return min(k, tile_k) == k or -(-tile_m // nr) * nr * k <= AT_WHOLE


def pack_a(kernel: MicroKernel, *, transposed: bool = False) -> str:
    """C of ``<name>_pack_a`` (or ``_pack_at``): one ``mr``-row sliver of A into ``Ap``.

    ``pack_a(kc, m, A, lda, Ap)``: rows ``0:m``, columns ``0:kc`` of row-major ``A``;
    ``pack_at(kc, m, At, ldat, Ap)``: the same from ``At`` = A transposed (``kc x m``, row-major).
    Rows ``m:mr`` are zeros, so a tail block needs no special case in the micro-kernel.
    """
    mr, name = kernel.mr, kernel.name
    if transposed:
        return f"""
/* Ap[p*{mr} + i] = At[p*ldat + i] for i < m, 0 up to {mr}: A given transposed (kc x m). */
static inline void {name}_pack_at(int kc, int m, const float* restrict At, long ldat,
                                  float* restrict Ap)
{{
    if (m == {mr}) {{ /* the common, whole sliver: straight copies the compiler vectorises */
        for (int p = 0; p < kc; ++p) {{
            for (int i = 0; i < {mr}; ++i) Ap[(long)p * {mr} + i] = At[p * ldat + i];
        }}
        return;
    }}
    for (int p = 0; p < kc; ++p) {{
        for (int i = 0; i < {mr}; ++i) {{
            Ap[(long)p * {mr} + i] = i < m ? At[p * ldat + i] : 0.0f;
        }}
    }}
}}
"""
    tb = kernel.transpose_block
    blocks, first = "", "0"
    if tb and kernel.transpose is not None and mr >= tb:
        # rows in groups of tb, tb steps at a time, transposed in registers (a float at a time,
        # a 12-row kernel's tail sliver of 8-11 keys cost a short attention much of its time)
        first = "i0"
        blocks = f"""
    int i0 = 0;
    for (; i0 + {tb} <= m; i0 += {tb}) {{
        int p = 0;
        for (; p + {tb} <= kc; p += {tb}) {name}_transpose(A + i0 * lda + p, lda, Ap + (long)p * {mr} + i0, {mr});
        for (; p < kc; ++p) {{
            for (int i = i0; i < i0 + {tb}; ++i) Ap[(long)p * {mr} + i] = A[i * lda + p];
        }}
    }}"""
    return f"""
/* Ap[p*{mr} + i] = A[i*lda + p] for i < m, 0 up to {mr}: A row-major (m x kc). */
static inline void {name}_pack_a(int kc, int m, const float* restrict A, long lda,
                                 float* restrict Ap)
{{{blocks}
    for (int i = {first}; i < m; ++i) {{ /* row by row: contiguous reads, a strided write stream */
        const float* restrict row = A + i * lda;
        for (int p = 0; p < kc; ++p) Ap[(long)p * {mr} + i] = row[p];
    }}
    /* the zeros row by row too: a run of them per step was compiled to a `rep stos`, whose
       start-up cost every step of a tail sliver more than its stores (docs/performance.md) */
    for (int i = m; i < {mr}; ++i) {{
        for (int p = 0; p < kc; ++p) Ap[(long)p * {mr} + i] = 0.0f;
    }}
}}
"""


def pack_b(kernel: MicroKernel, *, transposed: bool = False) -> str:
    """C of ``<name>_pack_b`` (or ``_pack_bt``): one ``nr``-column sliver of B into ``Bp``.

    ``pack_b(kc, n, B, ldb, Bp)``: rows ``0:kc``, columns ``0:n`` of row-major ``B``;
    ``pack_bt(kc, n, Bt, ldbt, Bp, scale)``: the same from ``Bt`` = B transposed (``n x kc``,
    row-major; attention's ``K`` in ``Q·Kᵀ``), times ``scale`` on the way (attention's softmax
    scale folded into the packing of ``Qᵀ``, not a pass of its own; 1 is exact). Columns
    ``n:nr`` are zeros.
    """
    nr, name = kernel.nr, kernel.name
    if transposed:
        tb = kernel.transpose_block
        blocks = ""
        if tb:
            blocks = f"""
    /* whole groups of {tb} columns: {tb}x{tb} blocks transposed in registers, then the last steps */
    const int jw = n / {tb} * {tb};
    if (jw > 0) {{
        float s[{tb}];
        for (int j = 0; j < {tb}; ++j) s[j] = scale;
        int p = 0;
        for (; p + {tb} <= kc; p += {tb}) {{
            for (int j = 0; j < jw; j += {tb}) {{
                {name}_transpose_scaled(Bt + j * ldbt + p, ldbt, Bp + (long)p * {nr} + j, {nr}, s);
            }}
        }}
        for (; p < kc; ++p) {{
            for (int j = 0; j < jw; ++j) Bp[(long)p * {nr} + j] = Bt[j * ldbt + p] * scale;
        }}
    }}"""
        # with register transposes it is kept out of line: called once per strip, and inlined
        # into a generated kernel's big function it cost half a second of compile time
        linkage = "static __attribute__((noinline))" if tb else "static inline"
        first = "jw" if tb else "0"
        return f"""
/* Bp[p*{nr} + j] = Bt[j*ldbt + p] * scale for j < n, 0 up to {nr}: B given transposed (n x kc).
   The zeros row by row (contiguous stores): a tail strip of 16 queries column by column wrote
   {nr} - 16 scalar zeros {nr} floats apart per step */
{linkage} void {name}_pack_bt(int kc, int n, const float* restrict Bt, long ldbt,
                                  float* restrict Bp, float scale)
{{{blocks}
    for (int j = {first}; j < n; ++j) {{
        const float* restrict col = Bt + j * ldbt;
        for (int p = 0; p < kc; ++p) Bp[(long)p * {nr} + j] = col[p] * scale;
    }}
    if (n < {nr}) {{
        for (int p = 0; p < kc; ++p) {{
            for (int j = n; j < {nr}; ++j) Bp[(long)p * {nr} + j] = 0.0f;
        }}
    }}
}}
"""
    return f"""
/* Bp[p*{nr} + j] = B[p*ldb + j] for j < n, 0 up to {nr}: B row-major (kc x n). */
static inline void {name}_pack_b(int kc, int n, const float* restrict B, long ldb,
                                 float* restrict Bp)
{{
    for (int p = 0; p < kc; ++p) {{
        const float* restrict row = B + p * ldb;
        float* restrict dst = Bp + (long)p * {nr};
        if (n == {nr}) {{
            for (int j = 0; j < {nr}; ++j) dst[j] = row[j];
        }} else {{
            for (int j = 0; j < {nr}; ++j) dst[j] = j < n ? row[j] : 0.0f;
        }}
    }}
}}
"""


def emit_with_packing(kernel: MicroKernel) -> str:
    """The micro-kernel and its four packing routines: what a generated kernel includes once."""
    parts = [
        kernel.emit(),
        kernel.transpose(kernel) if kernel.transpose is not None else "",
        pack_a(kernel),
        pack_a(kernel, transposed=True),
        pack_b(kernel),
        pack_b(kernel, transposed=True),
    ]
    return "".join(parts)
