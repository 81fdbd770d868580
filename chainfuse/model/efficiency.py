"""The micro-kernel in the compute time: how fast it runs what a plan's tiles make it do.

Flops at the peak treat every plan's arithmetic alike; the code does not run alike. On a CPU the
GEMMs run a micro-kernel (`kernels.select`), and the code-level tiles (`time.code_level`) decide
two costs that measured calibration points (`kernels.calibration`, docs/tuning.md#calibration)
put into the compute time:

- *k steps a call*: a contraction's micro-kernel calls run the code tile of its reduction (a
  GEMM chain's first GEMM: T_K; the second: T_L) and are slower per flop the shorter they are:
  each call's share of the op's time is divided by `Calibration.speed(steps)`, the tail call
  (the extent's remainder after whole tiles) at its own, shorter, length;
- *packing*: every element brought into the code level is packed into a panel (or stored back)
  once per load, costing `pack_flops` of the kernel's flops each: the elements the level's
  tiles move (`traffic.level_cost`) times that, at the peak. Only GEMM chains pack per load: a
  softmax chain packs a head's V once for all its row blocks (`DT_PANELS`) and a conv chain's
  code packs by its bands, so there the term would order plans by loads that pack nothing
  (re-ranked against measured plans it lowered rho; docs/tuning.md#calibration). Nor does a
  GEMM chain pack weights stored transposed in row blocks of up to `DIRECT_ROW_STRIPS` strips,
  whose slivers its code reads in place (`in_place`). A GEMM chain's Aᵀ, which the code packs
  whole once per row block for every l block (`kernels.packing.keeps_a_whole`), is charged
  once per row block, however often the level's tiles bring it in (`packed_bytes`).

- *a split value head*: an attention's second GEMM runs the kernel's wide block (the whole
  value head in registers, `MicroKernel.wide`) where the code tile of the head's loop holds the
  head; tiled in parts it takes the Eᵀ path, at `Calibration.split` of that speed (below 1:
  the wide block is faster; above 1, measured for heads of several blocks on some hosts: the
  Eᵀ path is). Not for a head of one block where the softmax is causal: its row blocks
  measured no difference (docs/tuning.md#calibration).

An online softmax's rescale per tile is the fourth term (`softmax.rescale_factors`). Other chips
(GPU, NPU presets) and chains with no contraction keep the plain flops.

    compute(op) = flops(op) * calls(op) / peak * rescale(op)
                  + moved_into_code_level(op) / itemsize * pack_flops / peak
    calls(op)   = sum over its calls of steps / speed(steps), over the reduction's extent
                  (/ Calibration.split: an attention's second GEMM with its value head split)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from chainfuse.hardware import DeviceKind, Hardware
from chainfuse.ir import Chain, Contraction, DType, Softmax
from chainfuse.kernels import MicroKernel, Problem, select
from chainfuse.kernels.amx import AMX_BF16_32X32
from chainfuse.kernels.calibration import Calibration, calibration, several_blocks
from chainfuse.kernels.contract import holds_head
from chainfuse.kernels.packing import DIRECT_ROW_STRIPS, keeps_a_whole

__all__ = ["Efficiency", "code_flops", "efficiency", "kernel_of"]


@functools.lru_cache(maxsize=512)
def kernel_of(chain: Chain, hardware: Hardware) -> MicroKernel | None:
    """The micro-kernel `kernels.select` picks for the chain's first contraction on `hardware`
    (a bf16 chain on AMX: the AMX block, which fills the tile registers); None where there is
    none (no contraction of two loops, no CPU kernel for the dtype)."""
    if hardware.matrix_engine(chain.dtype):
        return AMX_BF16_32X32
    first = chain.contractions[0] if chain.contractions else None
    if first is None or len(first.output.index) < 2:
        return None
    ext = chain.extents
    rows, cols = first.output.index[-2].loops[0], first.output.index[-1].loops[0]
    red = math.prod(ext[n] for n in first.reduction) or 1
    try:
        return select(Problem(chain.dtype, ext[rows], ext[cols], red), hardware)
    except ValueError:
        return None


@dataclass(frozen=True)
class Efficiency:
    """A chain's efficiency terms on one machine (module docstring)."""

    calibration: Calibration
    steps: tuple[tuple[str, ...], ...]  # per op: the loops whose code tiles make a call's steps
    itemsize: int
    packs: bool = True  # whether the code packs what each load brings in (module docstring)
    rows: str = ""  # the loop of the code's row blocks (a GEMM chain's m), for `in_place`
    direct: tuple[tuple[str, int], ...] = ()  # (tensor, most rows of a block reading it in place)
    head: tuple[int, str, float] | None = None  # (op, loop, `Calibration.split`): split head
    # (A, its reduction loop, nr, its elements per row of m, batches included): `_kept_a`
    a: tuple[str, str, int, int] | None = None
    memo: dict[tuple[int, ...], tuple[float, ...]] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    def stretch(self, tiles: Mapping[str, int], extents: Mapping[str, int]) -> tuple[float, ...]:
        """Per op: what its flops' time is multiplied by for the code-level `tiles`."""
        loops = self._loops
        key = tuple(min(tiles.get(n, extents[n]), extents[n]) for n in loops)
        found = self.memo.get(key)
        if found is None:
            tile = dict(zip(loops, key, strict=True))
            calls = [self._calls(red, tile, extents) for red in self.steps]
            if self.head is not None and tile[self.head[1]] < extents[self.head[1]]:
                calls[self.head[0]] /= self.head[2]
            found = self.memo[key] = tuple(calls)
        return found

    @functools.cached_property
    def _loops(self) -> tuple[str, ...]:
        head = (self.head[1],) if self.head is not None else ()  # (its tile decides)
        return tuple(dict.fromkeys((*(n for red in self.steps for n in red), *head)))

    def _calls(
        self, red: tuple[str, ...], tile: Mapping[str, int], ext: Mapping[str, int]
    ) -> float:
        """Time per step of the op's micro-kernel calls over its reduction, relative to the
        kernel's best: whole tiles of steps, then the remainder (1.0: not a contraction)."""
        if not red:
            return 1.0
        steps, extent = math.prod(tile[n] for n in red), math.prod(ext[n] for n in red)
        if steps <= 0 or extent <= 0:
            return 1.0
        speed = self.calibration.speed
        whole, rest = divmod(extent, steps)
        time = whole * steps / speed(steps) + (rest / speed(rest) if rest else 0.0)
        return time / extent

    def in_place(self, tiles: Mapping[str, int], extents: Mapping[str, int]) -> frozenset[str]:
        """The tensors the code reads in place, not packed, at the code-level `tiles`."""
        if not self.direct:
            return frozenset()
        rows = min(tiles.get(self.rows, extents[self.rows]), extents[self.rows])
        return frozenset(t for t, most in self.direct if rows <= most)

    def packed_bytes(
        self, moved: Iterable[tuple[int, str, int]], n_ops: int,
        tiles: Mapping[str, int], extents: Mapping[str, int],
    ) -> list[int]:  # fmt: skip
        """Per op, the bytes of `moved` ((op, tensor, bytes) into the code level) that the code
        packs: all but those of the tensors it reads in place (`in_place`)."""
        skip = self.in_place(tiles, extents)
        kept = self._kept_a(tiles, extents)
        out = [0] * n_ops
        for i, name, b in moved:
            if name not in skip:
                out[i] += kept[1] if kept is not None and name == kept[0] else b
        return out

    def _kept_a(
        self, tiles: Mapping[str, int], extents: Mapping[str, int]
    ) -> tuple[str, int] | None:
        """(A, the bytes the code packs of it) where it packs each row block of Aᵀ whole, once
        for every l block: every row of A once, its row blocks padded to whole nr-strips."""
        if self.a is None:
            return None
        name, k, nr, per_row = self.a
        rows = extents[self.rows]
        tile_m = min(tiles.get(self.rows, rows), rows)
        if not keeps_a_whole(extents[k], tiles.get(k, extents[k]), tile_m, nr):
            return None
        whole, rest = divmod(rows, tile_m)
        padded = whole * -(-tile_m // nr) * nr + -(-rest // nr) * nr
        return name, padded * per_row * self.itemsize

    def pack_flops(self, moved_bytes: int) -> float:
        """The flops' worth of packing what the code level's tiles bring in."""
        if not self.packs:
            return 0.0
        return moved_bytes / self.itemsize * self.calibration.pack_flops


@functools.lru_cache(maxsize=512)
def efficiency(chain: Chain, hardware: Hardware) -> Efficiency | None:
    """The chain's terms on `hardware`; None off a CPU, on a matrix engine (no calibration of
    its own yet) or without a micro-kernel."""
    if hardware.kind is not DeviceKind.CPU or hardware.matrix_engine(chain.dtype):
        return None
    kernel = kernel_of(chain, hardware)
    if kernel is None:
        return None
    steps = tuple(op.reduction if isinstance(op, Contraction) else () for op in chain.ops)
    softmax = any(isinstance(op, Softmax) for op in chain.ops)
    windowed = any(
        len(ix.terms) > 1 for op in chain.contractions for a in op.reads for ix in a.index
    )
    packs = not (softmax or windowed)
    rows, direct = _direct(chain, kernel) if packs else ("", ())
    cal = calibration(kernel.name)
    return Efficiency(cal, steps, chain.dtype.itemsize, packs, rows, direct,
                      _wide_head(chain, kernel, cal), _packed_a(chain, kernel, rows))  # fmt: skip


def code_flops(
    terms: Efficiency | None,
    op_flops: Sequence[int],
    factors: Sequence[float] | None,
    tiles: Mapping[str, int],
    extents: Mapping[str, int],
    moved: int,
) -> float:
    """The flops' worth of the work at the code level's `tiles` (the planner's objective there):
    each op's flops times its softmax `factors` (None: 1) and `terms`' stretch, plus packing the
    `moved` bytes (those the code packs: not the tensors it reads in place, `in_place`)."""
    factors = factors or (1.0,) * len(op_flops)
    if terms is None:
        return sum(f * x for f, x in zip(op_flops, factors, strict=True))
    stretch = terms.stretch(tiles, extents)
    flops = sum(f * x * y for f, x, y in zip(op_flops, factors, stretch, strict=True))
    return flops + terms.pack_flops(moved)


def _wide_head(
    chain: Chain, kernel: MicroKernel, cal: Calibration
) -> tuple[int, str, float] | None:
    """(op index, value loop, `Calibration.split`) of an attention whose second GEMM the code
    runs on the kernel's wide block when its value head is whole (`kernels.contract.holds_head`:
    float32, V's rows dense along the head), or None: no such block, or a head of one block
    under a causal softmax (module docstring)."""
    softmax = [op for op in chain.ops if isinstance(op, Softmax)]
    if kernel.wide is None or chain.dtype is not DType.FLOAT32 or len(softmax) != 1:
        return None
    if len(chain.contractions) != 2:
        return None
    op2 = chain.contractions[1]
    value, v = op2.output.loops[-1], op2.inputs[1]
    head = chain.extents[value]
    if not v.loops or v.loops[-1] != value or not holds_head(kernel, head):
        return None
    if softmax[0].causal and not several_blocks(head, kernel.nr):
        return None
    return chain.ops.index(op2), value, cal.split(head, kernel.nr)


def _packed_a(chain: Chain, kernel: MicroKernel, rows: str) -> tuple[str, str, int, int] | None:
    """`Efficiency.a` of a GEMM chain whose code packs A's row blocks (`_direct` found its row
    loop): A, the first GEMM's reduction loop, the kernel's nr, A's elements per row."""
    if not rows:
        return None
    first = chain.contractions[0]
    a = first.inputs[0]
    ext = chain.extents
    per_row = math.prod(ext[n] for n in a.loops if n != rows)
    return a.tensor, first.reduction[0], kernel.nr, per_row


def _direct(chain: Chain, kernel: MicroKernel) -> tuple[str, tuple[tuple[str, int], ...]]:
    """An fp32 GEMM chain's row loop (A's m) and, per weight stored transposed (read by a
    contraction with its rows along the reduction: nn.Linear's `[out, in]`), the most rows of a
    row block whose code reads its slivers in place (`kernels.packing.DIRECT_ROW_STRIPS`
    strips). Weights in the other layout, read in place by the code in row blocks of fewer
    strips, stay charged as packed: re-ranked against measured plans of the paper's GEMM chains,
    not charging them lowered rho (docs/tuning.md#calibration)."""
    if chain.dtype is not DType.FLOAT32 or len(chain.contractions) < 2:
        return "", ()
    first = chain.contractions[0]
    a = first.inputs[0]
    if len(a.loops) < 2:
        return "", ()
    inputs = {t.name for t in chain.inputs}
    most = DIRECT_ROW_STRIPS * kernel.nr
    direct: dict[str, int] = {}
    for op in chain.contractions:
        for acc in op.inputs:
            if acc.tensor == a.tensor or acc.tensor not in inputs or not acc.loops:
                continue
            if acc.loops[-1] in op.reduction:
                direct[acc.tensor] = most
    return a.loops[-2], tuple(direct.items())
