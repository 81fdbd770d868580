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
  stores ``v < 0 ? 0 : v`` of what it would store (NaN stays NaN, as torch.relu's) (a ReLU on the finished block while it is in
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
from collections.abc import Callable
from dataclasses import dataclass, field

from chainfuse.hardware import Hardware, Isa
from chainfuse.ir import DType

__all__ = [
    "MicroKernel",
    "Problem",
    "Score",
    "holds_head",
    "named_heads",
    "scores_exp_parts",
    "wide_multiples",
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
            C[i * ldc + j] = accumulate & RELU_AT_STORE ? (r < 0.0f ? 0.0f : r) : r;
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
#define RELU_AT_STORE 2 /* accumulate's bit: v < 0 ? 0 : v (NaN kept) of the block as it is stored */
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


def scores_exp_parts(mr: int) -> tuple[int, ...]:
    """Rows of the short `scores_exp` blocks (``<name>_scores_exp_part<r>``) a kernel of `mr`
    rows emits: about a third and two thirds of them and all but one (6: 2, 4 and 5). The keys
    past a strip's whole blocks (lc mod mr of them) run the smallest that holds them, its rows
    past theirs repeating their last: at most a row of FMAs more, not a whole block's."""
    return tuple(sorted({r for r in (mr // 3, 2 * mr // 3, mr - 1) if 0 < r < mr}))


def wide_multiples(kernel: MicroKernel) -> bool:
    """Whether a value head of any multiple of `nr` dims goes into E's rows as well, `nr`
    columns at a time (`codegen.gemm_spec.wide_heads` has `nr`: its wide block, once per block
    of columns)."""
    return kernel.wide is not None and kernel.nr in kernel.wide_cols


def named_heads(kernel: MicroKernel) -> tuple[int, ...]:
    """The wide blocks' widths that the generated code tests for by name (`N == w`): all of
    them, but those `wide_multiples` covers with its `N % NR == 0`."""
    return tuple(c for c in kernel.wide_cols if not (wide_multiples(kernel) and c % kernel.nr == 0))


def holds_head(kernel: MicroKernel, n: int) -> bool:
    """Whether a wide block of `kernel` holds a value head of `n` dims (the generated code's
    run-time test, `codegen.gemm_spec.wide_test`, in Python)."""
    return n in named_heads(kernel) or (wide_multiples(kernel) and n % kernel.nr == 0)
