"""The code schedule of a GEMM chain: what its compiled kernel runs, decided once in Python.

The planner's `Plan` gives tiles per memory level for the model's loop nest. The generated C
needs more: the code-level tiles after the backend's own adjustments (a causal chain's row
blocks, a softmax chain's n blocks, a head a wide block holds), and the path choices that follow
from sizes (how far the row path reaches, Aᵀ packed whole or per k block, how many packed
blocks of D a row block keeps, whether threads split l). `schedule_gemm_chain` makes every one
of them; the kernel passes them to the C as run-time arguments (`arguments`, laid out as
`SCHEDULE`), so the C decides none of them itself, and `Kernel.describe()` prints this object.

    plan (tiles per level) --schedule_gemm_chain--> CodeSchedule --arguments--> the C's schedule[]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chainfuse.codegen.gemm_spec import (
    Epilogue,
    GemmChainShape,
    GemmChainSpec,
    holds_head,
    wide_heads,
)
from chainfuse.codegen.rows import ROWS_FIT, ROWS_MAX, fits_rows, row_path_rows, rows_past_strips
from chainfuse.codegen.softmax import exponentiates_beside_op1
from chainfuse.hardware import Hardware
from chainfuse.ir import Chain, DType, Softmax
from chainfuse.kernels import MicroKernel
from chainfuse.kernels.calibration import calibration
from chainfuse.kernels.packing import keeps_a_whole
from chainfuse.model import code_level
from chainfuse.planner import Plan

__all__ = [
    "DT_PANELS",
    "NARROW_ROWS",
    "SCHEDULE",
    "WIDE_ROWS",
    "CodeSchedule",
    "TileChange",
    "causal_m_tile",
    "last_cache_bytes",
    "masked_rows",
    "rows_run",
    "schedule_gemm_chain",
    "softmax_n_tile",
]

#: A softmax chain keeps up to this many packed n blocks of D (all of it) for the row blocks of
#: its batch that follow (`row_block`: reuse_d) (docs/tuning.md)
DT_PANELS = 4
#: A causal 16-bit chain's least row block (docs/tuning.md)
WIDE_ROWS = 64
#: A mask that varies along the rows runs in row blocks of at most this many rows: the keys it
#: leaves out at a block's start and end (a causal mask's, a sliding window's) are not
#: computed (`cf_narrow_keys`), and smaller blocks leave out more (docs/tuning.md)
NARROW_ROWS = 64
#: Slots of the C's `schedule` argument (longs), in order
SCHEDULE = ("rows_max", "a_k", "d_blocks", "split")

_TILES = ("T_M", "T_L", "T_K", "T_N")


@dataclass(frozen=True)
class TileChange:
    """One code-level tile the backend runs other than the planner's, and why."""

    tile: str
    planned: int
    code: int
    reason: str


@dataclass(frozen=True)
class CodeSchedule:
    """Everything the compiled GEMM-chain code runs for one chain and plan (see the module):
    `spec` (what is compiled, with the code-level tiles), the plan's tiles before `changes`, and
    the path choices. Sizes are (batch0, batch1, M, N, K, L) as compiled."""

    spec: GemmChainSpec
    loops: tuple[str, str, str, str]  # the chain's m, l, k, n
    sizes: tuple[int, int, int, int, int, int]
    planned: tuple[int, int, int, int]  # the plan's code-level T_M, T_L, T_K, T_N
    changes: tuple[TileChange, ...]
    outer_m: int  # rows of m per parallel block: the plan's outermost m tile
    a_k: int  # Aᵀ's packed k: all of K (kept for every l block) or one k block
    d_blocks: int  # packed n blocks of D a row block keeps for the next ones (1: packed anew)
    cache_bytes: int  # the last cache level's capacity: what B and D must fit in (ROWS_FIT)

    @property
    def tiles(self) -> tuple[int, int, int, int]:
        """(T_M, T_L, T_K, T_N) as the code runs them."""
        spec = self.spec
        return spec.T_M, spec.T_L, spec.T_K, spec.T_N

    @property
    def exps_beside_op1(self) -> bool:
        """A softmax's exponentials run during op1's next block (`cf_scores_strip`)."""
        return exponentiates_beside_op1(self.spec)

    @property
    def wide_head(self) -> bool:
        """op2 holds the whole value head in registers (the kernel's wide blocks): one n tile
        (the generated code's `to_e` tests that too)."""
        n, tile = self.sizes[3], self.tiles[3]
        return bool(wide_heads(self.spec)) and tile >= n and holds_head(self.spec.kernel, n)

    def bd_bytes(self, keys: int | None = None, strides: tuple[int, ...] | None = None) -> float:
        """Bytes of all of B and D over the batch for `keys` of l (None: the compiled L), as a
        call with the kernel's `strides` reads them (a batch dim of stride 0 broadcasts: it
        counts once; None: dense)."""
        nb0, nb1, _, N, K, L = self.sizes
        s = strides or (1,) * 12
        b = float(nb0 if s[3] else 1) * float(nb1 if s[4] else 1) * float(K)
        d = float(nb0 if s[6] else 1) * float(nb1 if s[7] else 1) * float(N)
        return (b + d) * float(L if keys is None else keys) * float(self.spec.dtype.itemsize)

    def row_path_rows(self, bd_bytes: float | None = None) -> int:
        """Row blocks of at most this many rows of m take the row path (`bd_bytes`: of B and D
        as a call reads them; None: dense, as compiled)."""
        bd = self.bd_bytes() if bd_bytes is None else bd_bytes
        return row_path_rows(self.spec, bd, self.cache_bytes)

    @property
    def reach_varies(self) -> bool:
        """Whether the row path's reach can change with a call's keys or strides: where
        ROWS_FIT applies and some row block is longer than ROWS_FIT rows."""
        return fits_rows(self.spec) and self.sizes[2] > ROWS_FIT

    def split(self, threads: int) -> int:
        """How many threads share one block's l range: fewer parallel blocks than threads, each
        one row block (an MLP's few tokens); never a softmax's, whose shares would need their
        maxima merged."""
        nb0, nb1, M = self.sizes[:3]
        T_M = self.spec.T_M
        outer = max(self.outer_m, T_M)
        blocks = nb0 * nb1 * -(-M // outer)
        if self.spec.epilogue is Epilogue.SOFTMAX or blocks >= threads:
            return 1
        return threads // blocks if outer <= T_M or M <= T_M else 1

    def arguments(self, threads: int, bd_bytes: float | None = None) -> list[int]:
        """The C's `schedule` argument (laid out as `SCHEDULE`) for a call on `threads`."""
        return [self.row_path_rows(bd_bytes), self.a_k, self.d_blocks, self.split(threads)]

    def describe(self, threads: int = 1) -> str:
        """The schedule as a few lines of text (`Kernel.describe`)."""
        m, l_, k, n = self.loops
        M, uk = self.sizes[2], self.spec.kernel
        tiles = " ".join(f"{t}={v}" for t, v in zip(_TILES, self.tiles, strict=True))
        lines = [
            f"  code tiles {tiles}; parallel blocks of {max(self.outer_m, self.spec.T_M)} rows of {m}"
        ]
        lines += [f"  {c.tile} {c.planned} -> {c.code}: {c.reason}" for c in self.changes]
        reach = self.row_path_rows()
        if reach >= M:
            lines.append(
                f"  the row path for all {M} rows of {m} (<= {reach}), no register block"
                f" (built for {uk.name}'s ISA)"
            )
            return "\n".join(lines)
        mr, nr = uk.mr, uk.nr
        lines.append(
            f"  micro-kernel {uk.name}; op1's blocks {mr} rows of {l_} by {nr} of {m},"
            f" op2's {mr} of {n} by {nr} of {m} (or {mr} of {m} by {nr} of {n} where it writes"
            f" {self.spec.tensors[3]} directly)"
        )
        whole = "whole, kept for every l block" if self.a_k == self.sizes[4] else "per k block"
        lines.append(f"  Aᵀ packed {whole} ({self.a_k} of {k})")
        if self.d_blocks > 1:
            lines.append(f"  {self.d_blocks} packed n blocks of D kept for the next row blocks")
        if self.exps_beside_op1:
            lines.append(
                f"  the softmax's exponentials: each block of {mr} rows of {l_} during the next"
                f" block's FMAs (whole strips of {nr} of {m}, {k} in one block)"
            )
        if self.wide_head:
            lines.append(f"  op2 holds the whole value head ({self.sizes[3]} of {n}) in registers")
        split = self.split(threads)
        if split > 1:
            lines.append(f"  on {threads} threads: {split} share each block's range of {l_}")
        outer = max(self.outer_m, self.spec.T_M)
        T_M = self.spec.T_M
        tails = {r % T_M for r in (outer, M % outer or outer)} - {0}
        short = sorted(t for t in tails if t <= reach)
        if short:
            lines.append(
                f"  a last row block of {' or '.join(map(str, short))} rows of {m}: the row path"
            )
        blocks = {T_M for r in (outer, M % outer or outer) if r >= T_M} | tails
        few = sorted({rows_past_strips(b, uk) for b in blocks} - {0})
        if few and split == 1:
            rows = "row" if few == [1] else "rows"
            lines.append(
                f"  a row block's last {' or '.join(map(str, few))} {rows} of {m} past whole"
                f" blocks of {nr}: the row path"
            )
        return "\n".join(lines)


def schedule_gemm_chain(
    chain: Chain,
    shape: GemmChainShape,
    plan: Plan,
    kernel: MicroKernel,
    hardware: Hardware,
    overrides: Mapping[str, int] | None = None,
) -> CodeSchedule:
    """The code schedule of `chain` (matched as `shape`) under `plan` with `kernel`: the plan's
    code-level tiles, the backend's changes to them, `overrides` (loop name -> tile) last, and
    the path choices that follow (the module's docstring)."""
    first, second = chain.contractions[0], chain.contractions[-1]  # (a gated MLP has three)
    m, l_ = first.output.loops[-2:]
    k, n = first.reduction[0], second.output.loops[-1]
    ext = chain.extents
    M, N, K, L = ext[m], ext[n], ext[k], ext[l_]
    softmax = shape.epilogue is Epilogue.SOFTMAX
    planned = plan.tiles_at(code_level(hardware))
    assert planned is not None
    code = dict(planned)
    changes: list[TileChange] = []

    def change(loop: str, value: int, reason: str) -> None:
        if value != code[loop]:
            tile = _TILES[(m, l_, k, n).index(loop)]
            changes.append(TileChange(tile, code[loop], value, reason))
            code[loop] = value

    wide = softmax and chain.dtype is DType.FLOAT32 and not shape.d_transposed
    if wide and kernel.nr != N and holds_head(kernel, N):
        if calibration(kernel.name).split(N, kernel.nr) <= 1.0:
            change(n, N, "a wide block holds the whole value head: one n block")
        elif code[n] >= N:
            change(n, kernel.nr, f"a head of {N // kernel.nr} blocks runs faster in parts than"
                   " through the wide block here (calibration split_multiple)")  # fmt: skip
    elif softmax:
        change(n, softmax_n_tile(N, code[n], kernel.mr, kernel.part_rows),
               "even n blocks run fewer of the micro-kernel's rows")  # fmt: skip
    if shape.causal and chain.dtype is not DType.FLOAT32:
        least = min(WIDE_ROWS, -(-M // kernel.nr) * kernel.nr)
        change(m, max(code[m], least), "16-bit k and v are widened per row block: causal"
               f" blocks of at least {WIDE_ROWS} rows")  # fmt: skip
    if softmax and masked_rows(chain, m) and code[m] > NARROW_ROWS:
        change(m, max(kernel.nr, NARROW_ROWS // kernel.nr * kernel.nr), "a mask that varies"
               f" along {m}: row blocks of at most {NARROW_ROWS} rows leave out more of its keys")  # fmt: skip
    outer_m = (plan.tiles_at(plan.levels[-1]) or {}).get(m, M)
    change(m, causal_m_tile(M, code[m], outer_m, kernel.nr, L, shape.causal),
           "a causal tail block on the row path would cost more")  # fmt: skip
    for loop, tile in (overrides or {}).items():
        change(loop, tile, "given")
    spec = GemmChainSpec(
        batch=shape.batch,
        tensors=shape.tensors,
        b_transposed=shape.b_transposed,
        epilogue=shape.epilogue,
        mask=shape.mask,
        causal=shape.causal,
        safe=shape.safe,
        softcap=shape.softcap,
        T_M=code[m],
        T_L=code[l_],
        T_K=code[k],
        T_N=code[n],
        kernel=kernel,
        dtype=chain.dtype,
        d_transposed=shape.d_transposed,
        bias1=shape.bias1 is not None and not softmax,  # (a softmax's is its mask)
        bias2=shape.bias2 is not None,
        gated=shape.gate is not None,
    )
    TK = min(K, spec.T_K)
    nb = [1] * (2 - len(shape.batch)) + [ext[b] for b in shape.batch]
    return CodeSchedule(
        spec=spec,
        loops=(m, l_, k, n),
        sizes=(nb[0], nb[1], M, N, K, L),
        planned=(planned[m], planned[l_], planned[k], planned[n]),
        changes=tuple(changes),
        outer_m=outer_m,
        a_k=K if keeps_a_whole(K, TK, spec.T_M, kernel.nr) else TK,
        d_blocks=-(-N // spec.T_N) if softmax and spec.T_N < N <= DT_PANELS * spec.T_N else 1,
        cache_bytes=last_cache_bytes(hardware),
    )


def last_cache_bytes(hardware: Hardware) -> int:
    """The capacity of the last level before memory (0 where the machine lists no cache)."""
    return hardware.levels[-2].capacity if len(hardware.levels) > 1 else 0


def rows_run(extent: int, tile: int, mr: int, part: int) -> int:
    """The micro-kernel rows `extent` rows in blocks of `tile` run: whole mr-row slivers, and a
    block's tail of at most `part` rows (the kernel's `part_rows`) runs `part` rows, a longer one
    mr rows."""
    total = 0
    for start in range(0, extent, tile):
        full, rest = divmod(min(tile, extent - start), mr)
        total += full * mr + (0 if rest == 0 else part if rest <= part else mr)
    return total


def masked_rows(chain: Chain, m: str) -> bool:
    """Whether `chain`'s softmax has a mask that varies along `m` (the rows)."""
    return any(
        isinstance(op, Softmax) and op.mask is not None and m in op.mask.loops for op in chain.ops
    )


def causal_m_tile(extent: int, tile: int, outer: int, nr: int, keys: int, causal: bool) -> int:
    """The planner's row-block tile of m (`tile`, in parallel blocks of `outer` rows) as the
    generated code runs a causal chain: where the tile leaves a block of ROWS_MAX rows or fewer
    (the row path's, ~3x slower per score), a tile up to seven strips (`nr`) larger replaces it
    if that costs less, weighing the scores each block computes (docs/tuning.md)."""

    def cost(t: int) -> int:
        block, total = max(outer, t), 0
        for mo in range(0, extent, block):
            end = min(extent, mo + block)
            for m0 in range(mo, end, t):
                rows = min(t, end - m0)
                total += rows * min(keys, m0 + rows) * (3 if rows <= ROWS_MAX else 1)
        return total

    block = max(outer, tile)
    short = any(0 < r % tile <= ROWS_MAX for r in (min(block, extent), extent % block))
    if not causal or extent <= ROWS_MAX or tile >= extent or not short:
        return tile
    last = -(-extent // nr) * nr
    options = list(range(tile, min(last, tile + 7 * nr) + 1, nr))
    return min(options, key=lambda t: (cost(t), t))


def softmax_n_tile(extent: int, tile: int, mr: int, part: int) -> int:
    """A softmax chain's n tile as the code runs it where no wide block holds the value head:
    op2 computes Eᵀ with n along the micro-kernel's mr rows, and where the planner's tile is
    all of n, two or three even blocks that run fewer rows take its place (docs/tuning.md)."""
    if tile < extent or part == 0:
        return tile
    best, best_rows = tile, rows_run(extent, tile, mr, part)
    for parts in (2, 3):
        even = -(-extent // parts)
        rows = rows_run(extent, even, mr, part)
        if rows < best_rows:
            best, best_rows = even, rows
    return best
