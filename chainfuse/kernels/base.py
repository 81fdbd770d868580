"""What a micro-kernel is, the registry that holds them, and `select`.

A micro-kernel computes one register block ``C[0:m, 0:n] (+)= Ap · Bp`` with ``m <= mr``,
``n <= nr`` from packed panels. Every kernel emits the same C signature, so code generators call
any of them the same way::

    static inline void <name>(int kc, const float* restrict Ap, const float* restrict Bp,
                              float* restrict C, long ldc, int m, int n, int accumulate);

- ``Ap`` holds ``kc`` steps of ``mr`` contiguous floats: ``A[i, p] = Ap[p*mr + i]``;
- ``Bp`` holds ``kc`` steps of ``nr`` contiguous floats: ``B[p, j] = Bp[p*nr + j]``;
- ``C`` is row-major with leading dimension ``ldc``; ``accumulate`` bit 0 clear overwrites it
  (without reading it, so NaN garbage there is harmless), set adds to it; bit 1 (``RELU_AT_STORE``)
  stores ``v > 0 ? v : 0`` of what it would store (a ReLU on the finished block while it is in
  registers, instead of a pass over it in memory).

A kernel module supplies only the *full tile*, every accumulator in a register, in two forms:
``<name>_full_s(kc, A, rs, ks, Bp, C, ldc, accumulate)`` reads ``A(i, p) = A[i*rs + p*ks]``
(a packed sliver is ``rs = 1, ks = mr``) and ``<name>_full_g(kc, ng, gs, A, rs, ks, ...)`` runs
``ng`` such groups of ``kc`` steps, group ``g``'s A at ``A + g*gs``, into one register block
(and, with ``part_rows``, ``<name>_full_p``: ``_full_s`` on that many rows; with ``part_cols``,
``<name>_full_c<w>`` / ``_full_gc<w>``: on the first ``w`` columns; and ``<name>_full_rs(...,
accumulate, scale)``, ``_full_s`` with row i times ``scale[i]`` as it is stored, which
`MicroKernel.emit` supplies as a pass over the block where the tile has none). `MicroKernel.emit`
wraps it: a full ``mr x nr`` block goes straight to the fast path; a tail block (``m < mr`` or
``n < nr``) goes out of line (``<name>_tail``, so that call sites inline the full tile only),
runs the full tile (or the part tile, for ``m <= part_rows``, or the narrowest column block
covering ``n``) into an aligned ``C_tile`` on the stack and copies its ``m x n`` corner out (a
narrow block of exactly ``n`` columns and ``mr`` rows writes ``C`` directly). All paths round
identically (the product is formed from zero, then added to ``C``), so results never depend on
where a block falls.
`pack_a` / `pack_b` emit the matching packing routines, zero-padding tails.

Adding an ISA is one module that defines a full-tile emitter, decorates it with `microkernel`, and
is imported by ``chainfuse/kernels/__init__.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import DType

__all__ = [
    "PREFETCH_FAR",
    "REGISTRY",
    "MicroKernel",
    "Problem",
    "Registry",
    "Score",
    "VectorOps",
    "available",
    "emit_vector_tile",
    "emit_with_packing",
    "microkernel",
    "pack_a",
    "pack_b",
    "register",
    "scores_exp_parts",
    "select",
]

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: `MicroKernel.score`: (peak fraction estimate, mr*nr, -registers). Tuples compare left to right.
Score = tuple[float, int, float, int]


@dataclass(frozen=True)
class Problem:
    """The GEMM a micro-kernel is chosen for: ``C[M, N] = A[M, K] · B[K, N]`` in ``dtype``."""

    dtype: DType
    M: int
    N: int
    K: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"problem dtype must be a DType, got {self.dtype!r}")
        for what in ("M", "N", "K"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"problem {what} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class MicroKernel:
    """One register-blocked micro-kernel and what it needs.

    ``kr`` is how many k steps the packed panels interleave (1 for the fixed float layout
    ``Ap[p*mr + i]``; a bf16 dot-product or AMX kernel would pair steps). ``registers`` counts
    the vector registers the full tile keeps live (accumulators, B vectors,
    the broadcast A value); ``flops_per_instruction`` is what one arithmetic instruction of its
    inner loop does (2 x lanes for an FMA kernel, lanes without FMA, 1 for scalar code);
    ``cflags`` are the compiler flags its intrinsics need (``-march=native`` makes them redundant
    on a host that can run it, but they let any x86 host compile it). ``full_tile`` emits the C of
    ``<name>_full_s`` and ``<name>_full_g`` (module docstring), all headers and type definitions
    it uses included (guarded, so several kernels can share one translation unit).

    ``transpose`` (optional) emits ``<name>_transpose(src, lds, dst, ldd)``, a square block of
    ``transpose_block`` floats a side transposed in registers, ``dst[j*ldd + i] =
    src[i*lds + j]``, and ``<name>_transpose_scaled(src, lds, dst, ldd, scale)``, the same
    with ``dst`` row ``j`` times ``scale[j]``: the packing of a transposed operand and the
    generated kernels' transposed stores (a softmax's normalisation included) use them for whole
    blocks (a scalar transpose is one store per element).

    ``part_rows`` (optional, < ``mr``): the full tile also emits ``<name>_full_p``, the same on
    the first ``part_rows`` rows only; a tail block of at most that many rows runs it and costs
    those rows' FMAs, not ``mr`` rows' (N = 64 in rows of 6 leaves a tail of 4).

    ``part_cols`` (optional, a proper divisor of ``nr``, a whole number of vectors): the full
    tile also emits ``<name>_full_c<w>`` and ``<name>_full_gc<w>`` for every multiple ``w`` of
    it below ``nr``, the same on the first ``w`` columns only (``Bp`` keeps its ``nr`` floats a
    step); a tail block of ``n <= w`` columns runs the narrowest that covers it and costs ``w``
    columns' FMAs, not ``nr`` columns' (208 queries in strips of 64 leave one of 16), and
    `score` counts columns in steps of it.

    ``scores_exp`` (optional) emits ``void <name>_scores_exp(kc, A, rs, ks, Bp, C, ep, rows,
    shift, sum)``: the whole block of ``<name>_full_s`` stored at ``C`` (rows ``nr`` floats
    apart, not accumulated) and, spread over its k loop, the ``rows`` rows of ``nr`` floats at
    ``ep`` (the block before it) replaced by ``2^(v - shift)`` and added to ``sum`` (both ``nr``
    floats, per column); and ``<name>_exp2_rows(p, rows, shift, sum)``, the exponentials on
    whole rows alone. A softmax's exponentials then run beside the FMA loop, on the pipes it
    leaves idle, instead of in a pass of their own (``cf_scores_strip`` in
    `chainfuse.codegen.softmax`). For each ``r`` of `scores_exp_parts` it also emits
    ``<name>_scores_exp_part<r>(..., live)``, the same on a block of ``r`` rows of which A has
    ``live`` (the keys past a strip's whole blocks).

    ``wide`` (optional, with ``wide_cols`` and ``wide_mr``) emits ``void <name>_wide<w>(kc, A,
    ks, B, ldb, C, ldc, rows, accumulate, scale)`` for each ``w`` of ``wide_cols``: ``C[0:rows,
    0:w] (+)= A . B`` with ``A(i, p) = A[i + p*ks]`` (broadcast) and ``B(p, j) = B[p*ldb + j]``
    read in place, ``C`` rows ``ldc`` apart, row ``i`` times ``scale[i]`` as it is stored unless
    ``scale`` is NULL (a softmax's division by the sums); all ``wide_mr`` rows of ``A`` are read
    and computed, the first ``rows`` stored. A softmax's op2 then writes E's rows with a whole
    value head of ``w`` columns in registers (V's rows in place, any stride), where ``nr``
    columns would not cover it (`chainfuse.codegen.gemm_spec.wide_heads`).

    ``exp2_strip`` (optional) emits ``cf_exp2_strip(p, rows, shift, sum)``: a softmax strip's
    exponentials ``2^(v - shift)`` on ``rows`` rows of ``nr`` floats in place, summed by column
    into ``sum``, for integer shifts below 2^21 in magnitude; without it the generated code
    runs a portable loop over ``cf_exp2_from``.
    """

    name: str
    isa: frozenset[Isa]
    dtypes: tuple[DType, ...]
    mr: int
    nr: int
    kr: int
    registers: int
    flops_per_instruction: int
    full_tile: Callable[[MicroKernel], str] = field(repr=False)
    cflags: tuple[str, ...] = ()
    transpose: Callable[[MicroKernel], str] | None = field(default=None, repr=False)
    transpose_block: int = 0
    part_rows: int = 0
    part_cols: int = 0
    scores_exp: Callable[[MicroKernel], str] | None = field(default=None, repr=False)
    wide: Callable[[MicroKernel], str] | None = field(default=None, repr=False)
    wide_cols: tuple[int, ...] = ()
    wide_mr: int = 0
    exp2_strip: Callable[[MicroKernel], str] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _IDENT.fullmatch(self.name):
            raise ValueError(f"micro-kernel name must be a C identifier, got {self.name!r}")
        for what in ("mr", "nr", "kr", "registers", "flops_per_instruction"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"micro-kernel {self.name}: {what} must be a positive int")
        if not all(isinstance(flag, Isa) for flag in self.isa):
            raise TypeError(f"micro-kernel {self.name}: isa must hold Isa members")
        if not self.dtypes or not all(isinstance(d, DType) for d in self.dtypes):
            raise TypeError(f"micro-kernel {self.name}: dtypes must be a non-empty DType tuple")
        object.__setattr__(self, "isa", frozenset(self.isa))
        object.__setattr__(self, "dtypes", tuple(self.dtypes))
        object.__setattr__(self, "cflags", tuple(self.cflags))
        if (self.transpose is None) != (self.transpose_block == 0):
            raise ValueError(f"micro-kernel {self.name}: transpose and transpose_block go together")
        if self.transpose_block < 0 or (self.transpose_block and self.nr % self.transpose_block):
            raise ValueError(f"micro-kernel {self.name}: transpose_block must divide nr={self.nr}")
        if isinstance(self.part_rows, bool) or not 0 <= self.part_rows < self.mr:
            raise ValueError(f"micro-kernel {self.name}: part_rows must be in [0, mr={self.mr})")
        pc = self.part_cols
        if (
            isinstance(pc, bool)
            or not isinstance(pc, int)
            or pc < 0
            or pc >= self.nr
            or (pc and self.nr % pc)
        ):
            raise ValueError(
                f"micro-kernel {self.name}: part_cols must be 0 or a divisor of nr={self.nr} "
                f"below it, got {pc!r}"
            )
        if (self.wide is None) != (not self.wide_cols) or (self.wide is None) != (not self.wide_mr):
            raise ValueError(f"micro-kernel {self.name}: wide, wide_cols and wide_mr go together")
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.wide_cols):
            raise ValueError(f"micro-kernel {self.name}: wide_cols must be positive ints")
        if (
            isinstance(self.wide_mr, bool)
            or self.wide_mr < 0
            or (self.wide_mr and self.nr % self.wide_mr)
        ):
            raise ValueError(f"micro-kernel {self.name}: wide_mr must divide nr={self.nr}")
        object.__setattr__(self, "wide_cols", tuple(self.wide_cols))

    @property
    def col_widths(self) -> tuple[int, ...]:
        """The column counts of the narrow blocks (`part_cols`), narrowest first; () if none."""
        pc = self.part_cols
        return tuple(range(pc, self.nr, pc)) if pc else ()

    def applies(self, problem: Problem, hardware: Hardware) -> bool:
        """True when ``hardware`` has every ISA feature this kernel uses and it takes the dtype."""
        return self.isa <= hardware.isa and problem.dtype in self.dtypes

    def score(self, problem: Problem, hardware: Hardware) -> Score:
        """The ranking of `select`, highest first: ``(peak fraction, mr*nr, -loads per FMA,
        -registers)``.

        - peak fraction estimate = (``flops_per_instruction`` / the flops of one arithmetic
          instruction of ``hardware``'s widest vector ISA, `Hardware.instruction_flops`, capped
          at 1) x (share of the padded ``mr x nr`` blocks
          covering ``M x N`` that is useful work: tails compute whole blocks, a column tail
          behind whole ones the narrowest ``part_cols`` block covering it). A wide kernel loses
          to a narrower one where its tails would waste more than its width gains;
        - then the larger register block (fewer loads per FMA, fewer loop trips);
        - then, between blocks of one size, fewer operand loads per FMA (``nr`` / lanes vector
          loads and ``mr`` broadcasts feed ``mr * nr`` / lanes FMAs: 6x64 before 12x32);
        - then fewer registers (room for the compiler). Remaining ties keep registration order.
        """
        width = min(1.0, self.flops_per_instruction / hardware.instruction_flops(problem.dtype))
        padded_m = math.ceil(problem.M / self.mr) * self.mr
        # a column tail behind whole blocks runs the narrowest block covering it; a problem
        # narrower than one block is counted at the full width: the generated code's per-strip
        # work (a softmax over its columns, the stores) is nr wide whatever the block computes
        # (measured, attention over 32 queries: 6x64 with a 32-column block 0.64x of 12x32)
        full, rest = divmod(problem.N, self.nr)
        step = self.part_cols if self.part_cols and full else self.nr
        padded_n = full * self.nr + (math.ceil(rest / step) * step if rest else 0)
        useful = (problem.M * problem.N) / (padded_m * padded_n)
        lanes = max(1, self.flops_per_instruction // 2)
        loads_per_fma = round(lanes / self.nr + 1 / self.mr, 9)
        return (round(width * useful, 9), self.mr * self.nr, -loads_per_fma, -self.registers)

    def emit(self) -> str:
        """C of the micro-kernel's entry points, full tile included.

        ``<name>(kc, Ap, Bp, C, ldc, m, n, accumulate)`` takes a packed sliver ``Ap`` (the fixed
        layout ``Ap[p*mr + i]``); ``<name>_strided(kc, A, rs, ks, Bp, C, ldc, n, accumulate)``
        reads a whole ``mr``-row sliver in place, ``A(i, p) = A[i*rs + p*ks]``: no packing where
        a sliver is used too few times to pay for it (short sequences), and row-major or
        transposed operands alike; ``<name>_grouped(kc, ng, gs, A, rs, ks, Bp, C, ldc, n,
        accumulate)`` the same over ``ng`` runs of ``kc`` steps ``gs`` floats apart, Bp
        contiguous (a convolution's rows of taps in one call: the block stays in registers). A
        partial sliver (``m < mr``) must be packed: its missing rows would be read out of bounds.
        With ``part_cols``, ``<name>_cols(kc, A, rs, ks, Bp, C, ldc, w, accumulate)`` is
        ``_strided`` on ``w`` columns (``nr`` or a narrow block's width) straight into C, the
        rest of the ``nr`` columns set to zero: a generated kernel's tail strip of columns.
        """
        mr, nr, name = self.mr, self.nr, self.name
        pad = " " * (len(name) + 20)
        spad = " " * (len(name) + 28)
        gpad = " " * (len(name) + 27)
        part = self.part_rows
        tail = f"{name}_full_s(kc, A, rs, ks, Bp, C_tile, {nr}, 0);"
        part_call = ""
        if part:  # a block of at most `part` rows costs `part` rows' FMAs
            part_call = f"""    if (m == {part} && n == {nr}) {{
        {name}_full_p(kc, A, rs, ks, Bp, C, ldc, accumulate);
        return;
    }}
"""
            tail = (
                f"if (m <= {part}) {name}_full_p(kc, A, rs, ks, Bp, C_tile, {nr}, 0);\n"
                f"    else {tail}"
            )
        copy = f"""    for (int i = 0; i < m; ++i) {{
        for (int j = 0; j < n; ++j) {{
            const float v = C_tile[i * {nr} + j];
            const float r = accumulate & 1 ? C[i * ldc + j] + v : v;
            C[i * ldc + j] = accumulate & RELU_AT_STORE ? (r > 0.0f ? r : 0.0f) : r;
        }}
    }}"""
        # (the copy again, one level deeper: inside a narrow block's early return)
        nested = copy.strip().replace("\n", "\n    ")
        widths = self.col_widths
        narrow = ""  # a column tail: the narrowest block covering it, else the full width
        narrow_g = ""
        cols_tail = ""
        if widths:
            pc = self.part_cols
            cases = "".join(
                f"        case {w}: {name}_full_c{w}(kc, A, rs, ks, Bp, C, ldc, accumulate); break;\n"
                for w in widths
            )
            cases_g = "".join(
                f"        case {w}: {name}_full_gc{w}(kc, ng, gs, A, rs, ks, Bp, C, ldc, accumulate); "
                "break;\n"
                for w in widths
            )
            cols_tail = f"""
/* {name}_cols_tail: C[0:{mr}, 0:w] (+)= A . Bp for w one of {", ".join(map(str, widths))} */
static __attribute__((noinline)) void {name}_cols_tail(int kc, const float* restrict A, long rs,
    long ks, const float* restrict Bp, float* restrict C, long ldc, int w, int accumulate)
{{
    switch (w) {{
{cases}    }}
}}

static __attribute__((noinline)) void {name}_gcols_tail(int kc, int ng, long gs,
    const float* restrict A, long rs, long ks, const float* restrict Bp, float* restrict C,
    long ldc, int w, int accumulate)
{{
    switch (w) {{
{cases_g}    }}
}}
"""
            # a part-row block may be cheaper still (4 rows of 64 against 6 of 48)
            cheaper = f" && (m > {part} || {mr} * w < {part * nr})" if part else ""
            narrow = f"""    const int w = (n + {pc - 1}) / {pc} * {pc}; /* the narrow block covering n */
    if (w < {nr} && m == {mr} && w == n) {{ /* exactly its columns: straight into C */
        {name}_cols_tail(kc, A, rs, ks, Bp, C, ldc, w, accumulate);
        return;
    }}
    if (w < {nr}{cheaper}) {{
        float C_tile[{mr * nr}] __attribute__((aligned(64)));
        {name}_cols_tail(kc, A, rs, ks, Bp, C_tile, {nr}, w, 0);
        {nested}
        return;
    }}
"""
            narrow_g = f"""    const int w = (n + {pc - 1}) / {pc} * {pc};
    if (w < {nr}) {{
        if (w == n) {{
            {name}_gcols_tail(kc, ng, gs, A, rs, ks, Bp, C, ldc, w, accumulate);
            return;
        }}
        float C_tile[{mr * nr}] __attribute__((aligned(64)));
        {name}_gcols_tail(kc, ng, gs, A, rs, ks, Bp, C_tile, {nr}, w, 0);
        {nested}
        return;
    }}
"""
        cols = ""
        if widths:
            cols = f"""
/* {name}_cols: C[0:{mr}, 0:w] (+)= A . Bp, A(i, p) = A[i*rs + p*ks] read in place, for w = {nr}
   or a multiple of {self.part_cols} below it, straight into C, and C[0:{mr}, w:{nr}] = 0: a
   tail strip of columns kept whole ({nr} wide, zeros past its end, as a zero-padded Bp would
   give) costs its width's FMAs, not {nr} columns' */
static inline void {name}_cols(int kc, const float* restrict A, long rs, long ks,
{spad[:-1]}const float* restrict Bp, float* restrict C, long ldc, int w, int accumulate)
{{
    if (w == {nr}) {{
        {name}_full_s(kc, A, rs, ks, Bp, C, ldc, accumulate);
        return;
    }}
    {name}_cols_tail(kc, A, rs, ks, Bp, C, ldc, w, accumulate);
    for (int i = 0; i < {mr}; ++i) {{
        for (int j = w; j < {nr}; ++j) C[i * ldc + j] = 0.0f;
    }}
}}
"""
        wrapper = f"""{cols_tail}
/* the blocks smaller than {mr}x{nr}, out of line: every call site of the entry points below
   inlines the full tile only (the tails' copies of it cost compile time, not speed) */
static __attribute__((noinline)) void {name}_tail(int kc, const float* restrict A, long rs,
    long ks, const float* restrict Bp, float* restrict C, long ldc, int m, int n, int accumulate)
{{
{part_call}{narrow}    float C_tile[{mr * nr}] __attribute__((aligned(64)));
    {tail}
{copy}
}}

static __attribute__((noinline)) void {name}_grouped_tail(int kc, int ng, long gs,
    const float* restrict A, long rs, long ks, const float* restrict Bp, float* restrict C,
    long ldc, int n, int accumulate)
{{
    const int m = {mr};
{narrow_g}    float C_tile[{mr * nr}] __attribute__((aligned(64)));
    {name}_full_g(kc, ng, gs, A, rs, ks, Bp, C_tile, {nr}, 0);
{copy}
}}

static inline void {name}_full(int kc, const float* restrict Ap, const float* restrict Bp,
{pad}float* restrict C, long ldc, int accumulate)
{{
    {name}_full_s(kc, Ap, 1, {mr}, Bp, C, ldc, accumulate);
}}

/* {name}: C[0:m, 0:n] (+)= Ap . Bp, m <= {mr}, n <= {nr}; Ap[p*{mr} + i], Bp[p*{nr} + j]. */
static inline void {name}(int kc, const float* restrict Ap, const float* restrict Bp,
{pad}float* restrict C, long ldc, int m, int n, int accumulate)
{{
    if (m == {mr} && n == {nr}) {{
        {name}_full(kc, Ap, Bp, C, ldc, accumulate);
        return;
    }}
    {name}_tail(kc, Ap, 1, {mr}, Bp, C, ldc, m, n, accumulate);
}}

/* {name}_grouped: C[0:{mr}, 0:n] (+)= A . Bp over ng groups of kc steps, A(i, g*kc + p) =
   A[g*gs + i*rs + p*ks] read in place (rows of a convolution's taps): one register block. */
static inline void {name}_grouped(int kc, int ng, long gs, const float* restrict A, long rs,
{gpad}long ks, const float* restrict Bp, float* restrict C, long ldc,
{gpad}int n, int accumulate)
{{
    if (n == {nr}) {{
        {name}_full_g(kc, ng, gs, A, rs, ks, Bp, C, ldc, accumulate);
        return;
    }}
    {name}_grouped_tail(kc, ng, gs, A, rs, ks, Bp, C, ldc, n, accumulate);
}}

/* {name}_strided: C[0:{mr}, 0:n] (+)= A . Bp, A(i, p) = A[i*rs + p*ks] read in place. */
static inline void {name}_strided(int kc, const float* restrict A, long rs, long ks,
{spad}const float* restrict Bp, float* restrict C, long ldc, int n,
{spad}int accumulate)
{{
    if (n == {nr}) {{
        {name}_full_s(kc, A, rs, ks, Bp, C, ldc, accumulate);
        return;
    }}
    {name}_tail(kc, A, rs, ks, Bp, C, ldc, {mr}, n, accumulate);
}}
{cols}"""
        flag = """#ifndef RELU_AT_STORE
#define RELU_AT_STORE 2 /* accumulate's bit: v > 0 ? v : 0 of the block as it is stored */
#endif
"""
        tile = self.full_tile(self).rstrip("\n") + "\n"
        if f"{name}_full_rs(" not in tile:  # (a tile that scales in registers emits its own)
            tile += f"""
/* {name}_full_rs: {name}_full_s, then row i of the block times scale[i] (none where scale
   is NULL): a softmax's rows over their sums */
static inline void {name}_full_rs(int kc, const float* restrict A, long rs, long ks,
    const float* restrict Bp, float* restrict C, long ldc, int accumulate,
    const float* restrict scale)
{{
    {name}_full_s(kc, A, rs, ks, Bp, C, ldc, accumulate);
    if (scale) {{
        for (int i = 0; i < {mr}; ++i) {{
            for (int j = 0; j < {nr}; ++j) C[i * ldc + j] *= scale[i];
        }}
    }}
}}
"""
        return flag + tile + wrapper


# -- packing --------------------------------------------------------------------------------------


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
        # rows in groups of tb, tb steps at a time, transposed in registers: a 12-row kernel's
        # tail sliver of 8-11 keys (32 queries over 32 keys) packed its 64 steps a float at a
        # time, 7 % of that attention's time
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
    if (m < {mr}) {{ /* the zeros step by step: contiguous stores */
        for (int p = 0; p < kc; ++p) {{
            for (int i = m; i < {mr}; ++i) Ap[(long)p * {mr} + i] = 0.0f;
        }}
    }}
}}
"""


def pack_b(kernel: MicroKernel, *, transposed: bool = False) -> str:
    """C of ``<name>_pack_b`` (or ``_pack_bt``): one ``nr``-column sliver of B into ``Bp``.

    ``pack_b(kc, n, B, ldb, Bp)``: rows ``0:kc``, columns ``0:n`` of row-major ``B``;
    ``pack_bt(kc, n, Bt, ldbt, Bp, scale)``: the same from ``Bt`` = B transposed (``n x kc``,
    row-major; attention's ``K`` in ``Q·Kᵀ``), times ``scale`` on the way (attention's softmax
    scale folded into the packing of ``Qᵀ``: a pass of its own over the packed strip cost 5 % of
    a 32-key attention; 1 is exact). Columns ``n:nr`` are zeros.
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


def scores_exp_parts(mr: int) -> tuple[int, ...]:
    """Rows of the short `scores_exp` blocks (``<name>_scores_exp_part<r>``) a kernel of `mr`
    rows emits: about a third and two thirds of them and all but one (6: 2, 4 and 5). The keys
    past a strip's whole blocks (lc mod mr of them) run the smallest that holds them, its rows
    past theirs repeating their last: at most a row of FMAs more, not a whole block's."""
    return tuple(sorted({r for r in (mr // 3, 2 * mr // 3, mr - 1) if 0 < r < mr}))


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


#: Floats between A's k steps from which a full tile asks for the next line along each step's
#: row (``_full_s`` and the part tiles): a quarter page, so at most four steps share a page. Below
#: it (a packed sliver, K's rows read along k, a value head's rows 64 floats apart) the hardware
#: prefetchers already follow the stream and the prefetch is one more instruction per step:
#: measured on an AVX2 Zen 3 core, interleaved, 1 thread, it took the 10 attention workloads
#: 0.94-0.99 of the time without it (geomean 0.965) and a ReLU GEMM chain 0.98; a Mixer-C
#: chain (a weight's rows 768 floats apart) keeps it.
PREFETCH_FAR = 256


# -- a full tile for any SIMD ISA -----------------------------------------------------------------


@dataclass(frozen=True)
class VectorOps:
    """How one SIMD ISA spells the handful of operations a broadcast-FMA full tile uses.

    Each op is a C expression template: ``load``/``broadcast`` take ``{ptr}``, ``store`` takes
    ``{ptr}`` and ``{v}``, ``fma`` computes ``{a}*{b} + {c}``, ``add`` ``{a} + {b}``, ``relu``
    ``{v} > 0 ? {v} : 0`` lane by lane (NaN gives 0).
    ``preamble`` holds the includes and (guarded) typedefs/helpers the templates rely on.
    """

    type: str
    lanes: int
    preamble: str
    zero: str
    load: str
    store: str
    broadcast: str
    fma: str
    add: str
    relu: str


def emit_vector_tile(kernel: MicroKernel, ops: VectorOps) -> str:
    """``<name>_full_s`` and ``<name>_full_g`` as outer-product loops: per k step, ``nr/lanes``
    vector loads of Bp, ``mr`` broadcasts of A (row ``i`` at ``A + i*rs``, step ``p`` at
    ``+ p*ks``), ``mr*nr/lanes`` FMAs into accumulators named ``c<i>_<j>``; ``_full_g`` runs
    ``ng`` groups of ``kc`` steps, group ``g``'s A at ``A + g*gs``, into the same accumulators.
    With ``kernel.part_rows``, also ``<name>_full_p``: ``_full_s`` on the first ``part_rows``
    rows only (a tail block of that many rows or fewer costs that many rows' FMAs)."""
    mr, nr, name = kernel.mr, kernel.nr, kernel.name
    if nr % ops.lanes:
        raise ValueError(f"{name}: nr={nr} is not a multiple of {ops.lanes} lanes")
    nv = nr // ops.lanes
    pad = " " * (len(name) + 27)

    if kernel.part_cols % ops.lanes:
        raise ValueError(f"{name}: part_cols={kernel.part_cols} is not a multiple of {ops.lanes}")

    def body(
        rows: int, nv: int = nv, row: str = "a + {i} * rs", scaled: bool = False
    ) -> tuple[list[str], list[str], list[str]]:
        """(zeroed accumulators, one k step, the store) of a block of `rows` rows and `nv`
        vectors of columns (Bp's steps stay nr floats apart); A's element of row i at this
        step is at `row` (formatted with i). `scaled`: row i times ``scale[i]`` as it is
        stored, where ``scale`` is not NULL (an FMA with zero: the product, rounded once)."""
        acc = [[f"c{i}_{j}" for j in range(nv)] for i in range(rows)]
        step = [
            f"        const float* restrict b = Bp + (long)p * {nr};",
            *(
                f"        const {ops.type} b{j} = {ops.load.format(ptr=f'b + {j * ops.lanes}')};"
                for j in range(nv)
            ),
        ]
        for i in range(rows):
            step.append(
                f"        const {ops.type} a{i} = {ops.broadcast.format(ptr=row.format(i=i))};"
            )
            for j in range(nv):
                step.append(
                    f"        {acc[i][j]} = {ops.fma.format(a=f'a{i}', b=f'b{j}', c=acc[i][j])};"
                )
        finish = ["    if (accumulate & 1) {"]
        for i in range(rows):
            for j in range(nv):
                ptr = f"C + {i} * ldc + {j * ops.lanes}"
                add = ops.add.format(a=acc[i][j], b=ops.load.format(ptr=ptr))
                finish.append(f"        {acc[i][j]} = {add};")
        finish.append("    }")
        finish.append("    if (accumulate & RELU_AT_STORE) {")
        for i in range(rows):
            for j in range(nv):
                finish.append(f"        {acc[i][j]} = {ops.relu.format(v=acc[i][j])};")
        finish.append("    }")
        if scaled:
            finish.append("    if (scale) {")
            for i in range(rows):
                finish.append(
                    f"        const {ops.type} s{i} = {ops.broadcast.format(ptr=f'scale + {i}')};"
                )
                for j in range(nv):
                    product = ops.fma.format(a=acc[i][j], b=f"s{i}", c=ops.zero)
                    finish.append(f"        {acc[i][j]} = {product};")
            finish.append("    }")
        for i in range(rows):
            for j in range(nv):
                ptr = f"C + {i} * ldc + {j * ops.lanes}"
                finish.append(f"    {ops.store.format(ptr=ptr, v=acc[i][j])};")
        finish.append("}")
        zero = [
            f"    {ops.type} " + ", ".join(f"{c} = {ops.zero}" for c in acc[i]) + ";"
            for i in range(rows)
        ]
        return zero, step, finish

    def single(rows: int, suffix: str, what: str, nv: int = nv, scaled: bool = False) -> list[str]:
        # A's rows by pointers set once, each step one offset from them all: a base + index
        # address per broadcast, where a + i * rs took GCC a few integer adds a step (A read in
        # place, rs a row: attention's K). Measured on Zen 3, 1 thread, interleaved, the paper
        # attentions: 0.992, 0.994, then 1.002 of the time (within the noise); GEMM chains 1.000
        zero, step, finish = body(rows, nv, "r{i} + o", scaled)
        # (the scaled tile serves one call site, op2's of a softmax's last l block, whose calls
        # run hundreds of steps each: out of line, it spares the kernel's one big function a
        # second inlined copy of the register block, which took 0.8 s more to compile)
        linkage = "__attribute__((noinline))" if scaled else "inline"
        # A read in place down far-apart rows (rs = 1: a weight's rows, each k step a new line,
        # a new page) misses at every step, and the next slivers' calls read the lines after
        # these: ask for the next line along each step's row, so those misses overlap this
        # call's FMAs (measured on a Mixer-C chain, one strip of 64: 18 % less time). Only
        # there (see PREFETCH_FAR): on closer steps the hardware prefetchers follow the rows
        # already, and the extra instruction per step is what the loop pays
        prefetch = [
            f"        if (ks >= {PREFETCH_FAR}) __builtin_prefetch(a + 64 / sizeof(float), 0, 3);"
        ]
        return [
            f"/* {name}_{suffix}: C[0:{rows}, 0:{nv * ops.lanes}] (+)= A . Bp, {rows * nv} "
            f"accumulators in registers{what} */",
            f"static {linkage} void {name}_{suffix}(int kc, const float* restrict A, long rs,"
            " long ks,",
            f"{pad}const float* restrict Bp, float* restrict C, long ldc,",
            f"{pad}int accumulate{', const float* restrict scale' if scaled else ''})",
            "{",
            *zero,
            *(f"    const float* restrict r{i} = A + {i} * rs;" for i in range(rows)),
            "#pragma GCC unroll 4",
            "    for (int p = 0; p < kc; ++p) {",
            "        const long o = (long)p * ks;",
            "        const float* restrict a = A + o;",
            *prefetch,
            *step,
            "    }",
            *finish,
        ]

    def grouped(suffix: str, what: str, nv: int = nv) -> list[str]:
        zero, step, finish = body(mr, nv)
        return [
            f"/* {name}_{suffix}: {what} over ng groups of kc steps, group g's A at A + g*gs, Bp",
            "   contiguous over all ng*kc steps: one register block for several runs of A */",
            f"static inline void {name}_{suffix}(int kc, int ng, long gs, const float* restrict A,",
            f"{pad}long rs, long ks, const float* restrict Bp, float* restrict C,",
            f"{pad}long ldc, int accumulate)",
            "{",
            *zero,
            "    for (int g = 0; g < ng; ++g, A += gs, Bp += (long)kc * " + str(nr) + ") {",
            "#pragma GCC unroll 4",
            "        for (int p = 0; p < kc; ++p) {",
            "            const float* restrict a = A + (long)p * ks;",
            *("    " + line for line in step),
            "        }",
            "    }",
            *finish,
        ]

    parts = [ops.preamble.rstrip("\n"), "", *single(mr, "full_s", ""), ""]
    what = ", row i times scale[i] as it is stored (none where scale is NULL)"
    parts += [*single(mr, "full_rs", what, scaled=True), ""]
    parts += grouped("full_g", "the same")
    if kernel.part_rows:
        parts += ["", *single(kernel.part_rows, "full_p", ": a tail block's rows")]
    for w in kernel.col_widths:  # narrow blocks: a column tail's (part_cols)
        v = w // ops.lanes
        parts += ["", *single(mr, f"full_c{w}", ": a tail block's columns", v)]
        parts += ["", *grouped(f"full_gc{w}", f"C[0:{mr}, 0:{w}] (+)= A . Bp", v)]
    return "\n".join(parts) + "\n"


# -- the registry ---------------------------------------------------------------------------------


class Registry:
    """Micro-kernels by name, in registration order. `REGISTRY` is the one chainfuse uses."""

    def __init__(self) -> None:
        self._kernels: dict[str, MicroKernel] = {}

    def register(self, kernel: MicroKernel) -> MicroKernel:
        """Add ``kernel``; a second kernel with the same name is a `ValueError`."""
        if not isinstance(kernel, MicroKernel):
            raise TypeError(f"can only register a MicroKernel, got {type(kernel).__name__}")
        if kernel.name in self._kernels:
            raise ValueError(f"micro-kernel {kernel.name!r} is already registered")
        self._kernels[kernel.name] = kernel
        return kernel

    def available(self) -> tuple[MicroKernel, ...]:
        return tuple(self._kernels.values())

    def select(self, problem: Problem, hardware: Hardware) -> MicroKernel:
        """The applicable kernel with the highest `MicroKernel.score`."""
        candidates = [k for k in self._kernels.values() if k.applies(problem, hardware)]
        if not candidates:
            known = ", ".join(
                f"{k.name} ({'/'.join(d.value for d in k.dtypes)})" for k in self._kernels.values()
            )
            raise ValueError(
                f"no micro-kernel handles {problem.dtype.value} on {hardware.name!r}; "
                f"registered: {known or 'none'}"
            )
        return max(candidates, key=lambda k: k.score(problem, hardware))

    def select_weighted(
        self, problems: Sequence[tuple[Problem, float]], hardware: Hardware
    ) -> MicroKernel:
        """One kernel for several GEMMs that run with it (a chain's two contractions), each
        weighted by its flops: the highest time-weighted peak fraction, ``sum(w) / sum(w /
        fraction)``, then the first problem's other criteria."""
        if not problems:
            raise ValueError("select_weighted: no problems given")
        first = problems[0][0]
        candidates = [k for k in self._kernels.values() if k.applies(first, hardware)]
        if not candidates:
            return self.select(first, hardware)  # the error that names what is registered
        total = sum(w for _, w in problems)

        def key(k: MicroKernel) -> tuple[float, ...]:
            scores = [(k.score(p, hardware), w) for p, w in problems]
            time = sum(w / sc[0] for sc, w in scores if sc[0] > 0)
            fraction = total / time if time > 0 else 0.0
            return (round(fraction, 9), *scores[0][0][1:])

        return max(candidates, key=key)


REGISTRY = Registry()


def register(kernel: MicroKernel) -> MicroKernel:
    """Add ``kernel`` to `REGISTRY` (duplicate names are a `ValueError`) and return it."""
    return REGISTRY.register(kernel)


def available() -> tuple[MicroKernel, ...]:
    """Every registered micro-kernel, applicable here or not, in registration order."""
    return REGISTRY.available()


def select(problem: Problem, hardware: Hardware) -> MicroKernel:
    """The best applicable micro-kernel for ``problem`` on ``hardware`` (see `MicroKernel.score`)."""
    return REGISTRY.select(problem, hardware)


def select_weighted(problems: Sequence[tuple[Problem, float]], hardware: Hardware) -> MicroKernel:
    """The best applicable micro-kernel for several (problem, flops) run with one kernel."""
    return REGISTRY.select_weighted(problems, hardware)


def microkernel(
    *,
    name: str,
    isa: frozenset[Isa],
    dtypes: tuple[DType, ...],
    mr: int,
    nr: int,
    registers: int,
    flops_per_instruction: int,
    kr: int = 1,
    cflags: tuple[str, ...] = (),
    transpose: Callable[[MicroKernel], str] | None = None,
    transpose_block: int = 0,
    part_rows: int = 0,
    part_cols: int = 0,
    scores_exp: Callable[[MicroKernel], str] | None = None,
    wide: Callable[[MicroKernel], str] | None = None,
    wide_cols: tuple[int, ...] = (),
    wide_mr: int = 0,
    exp2_strip: Callable[[MicroKernel], str] | None = None,
    registry: Registry = REGISTRY,
) -> Callable[[Callable[[MicroKernel], str]], MicroKernel]:
    """Decorator: turn a full-tile emitter into a registered `MicroKernel`.

    ::

        @microkernel(name="avx2_fma_6x16_f32", isa=frozenset({Isa.AVX2, Isa.FMA}), ...)
        def avx2_fma_6x16_f32(kernel: MicroKernel) -> str:
            return emit_vector_tile(kernel, AVX2)
    """

    def wrap(full_tile: Callable[[MicroKernel], str]) -> MicroKernel:
        kernel = MicroKernel(
            name=name,
            isa=isa,
            dtypes=dtypes,
            mr=mr,
            nr=nr,
            kr=kr,
            registers=registers,
            flops_per_instruction=flops_per_instruction,
            full_tile=full_tile,
            cflags=cflags,
            transpose=transpose,
            transpose_block=transpose_block,
            part_rows=part_rows,
            part_cols=part_cols,
            scores_exp=scores_exp,
            wide=wide,
            wide_cols=wide_cols,
            wide_mr=wide_mr,
            exp2_strip=exp2_strip,
        )
        return registry.register(kernel)

    return wrap
