"""Predicted time of a plan: the bytes each level moves at its bandwidth against the flops at
the cores' peak, stretched by the imbalance of the cores' deal, the micro-kernel's efficiency
for the code's tiles (`efficiency`) and the softmax terms."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chainfuse.model.efficiency import efficiency
from chainfuse.model.nest import Nest
from chainfuse.model.softmax import computed_share, rescale_factors
from chainfuse.model.traffic import deal, level_cost, moved_bytes, splits

if TYPE_CHECKING:
    from chainfuse.hardware import Hardware

__all__ = ["Cost", "code_level", "estimate"]


def code_level(hardware: Hardware) -> str:
    """The level whose tiles the generated loop nest uses: the largest per-core cache."""
    private = [lv.name for lv in hardware.levels[:-1] if not lv.shared]
    return private[-1] if private else hardware.levels[0].name


@dataclass(frozen=True)
class Cost:
    """The model's verdict on a whole plan: bytes per level, time per part, the bound."""

    bytes_per_level: tuple[tuple[str, int], ...]  # bytes read from each level, innermost first
    used_per_level: tuple[tuple[str, int], ...]  # bytes each cache level must hold
    flops: int  # executed, recompute included
    compute_s: float
    memory_s: tuple[tuple[str, float], ...]
    imbalance: float
    time_s: float
    kernel_s: float = 0.0  # of compute_s: what the micro-kernel's efficiency terms add

    @property
    def plain_s(self) -> float:
        """The time with the flops at the peak (no efficiency terms): what bounds by least
        flops compare with."""
        worst = max((t for _, t in self.memory_s), default=0.0)
        return max(self.compute_s - self.kernel_s, worst) if self.kernel_s else self.time_s

    @property
    def bound(self) -> str:
        worst = max(self.memory_s, key=lambda kv: kv[1], default=("compute", 0.0))
        return "compute" if self.compute_s >= worst[1] else worst[0]


def estimate(
    nest: Nest,
    tiles: Mapping[str, Mapping[str, int]],
    hardware: Hardware,
    parallel: Sequence[str] = (),
    threads: int | None = None,
    split: tuple[str, int] | None = None,
) -> Cost:
    """Predicted time of running `nest` with per-level `tiles` on `hardware`.

    `tiles[level]` are the tiles of the blocks held in `level`; the bytes read *from* the next
    level out are those `level_cost` gives for them, so `tiles["L2"]` decides the traffic between
    L3 and L2, which is charged at L3's bandwidth. A fused nest overlaps everything:
    `max(compute, max over levels of bytes / bandwidth)`; unfused ops run one after another, so
    their times add up. The parallel loops' blocks at the outermost level are dealt to the cores
    (`threads`, default all), as the generated kernels deal them (`deal`), and the imbalance of
    that deal stretches every term. `split` ((loop, quantum)): cores a deal leaves idle split
    that loop of each block (`deal`), where every block of the parallel loops is one block of
    the next level in (`splits`). Compute counts the micro-kernel's efficiency for the code
    level's tiles and its packing (`efficiency`).
    """
    cores = threads or hardware.cores
    outer_tiles = tiles[list(tiles)[-1]] if tiles else {}
    ext = nest.extents
    dims = tuple((ext[n], outer_tiles.get(n, ext[n])) for n in parallel)
    workers, imbalance = deal(dims, cores, splits(nest, tiles, parallel, split))
    peak = hardware.peak(nest.chain.dtype) * workers
    levels = list(hardware.levels)
    n_ops = len(nest.chain.ops)
    op_time = [[0.0] for _ in range(n_ops)]  # per op: compute, then each level's memory time
    moved: list[tuple[str, int]] = []
    used: list[tuple[str, int]] = []
    mem: list[tuple[str, float]] = []
    op_flops: tuple[int, ...] = ()
    code = code_level(hardware)
    terms = efficiency(nest.chain, hardware)
    packed = [0.0] * n_ops  # flops' worth of packing what the code level's tiles bring in
    for inner, outer in itertools.pairwise(levels):
        if inner.name not in tiles:
            continue
        cost = level_cost(nest, tiles[inner.name])
        op_flops = cost.op_flops
        bw = outer.aggregate_bandwidth(workers) if outer.shared else outer.bandwidth * workers
        per_op = [0] * n_ops
        level_moved = moved_bytes(nest, cost, tiles[inner.name])
        for i, _, b in level_moved:
            per_op[i] += b
        total = sum(per_op)
        moved.append((outer.name, total))
        used.append((inner.name, cost.used))
        mem.append((outer.name, total / bw * imbalance))
        for i in range(n_ops):
            op_time[i].append(per_op[i] / bw * imbalance)
        if inner.name == code and terms is not None:
            to_pack = terms.packed_bytes(level_moved, n_ops, tiles[inner.name], ext)
            packed = [terms.pack_flops(b) for b in to_pack]
    if not op_flops:
        op_flops = level_cost(nest, {}).op_flops
    # (an online softmax only where it is fused: unfused, the softmax runs over whole rows,
    # and a causal one computes every score)
    code_tiles = tiles.get(code, {})
    factors = rescale_factors(nest.chain, code_tiles) if nest.fused else (1.0,) * n_ops
    stretch = terms.stretch(code_tiles, ext) if terms is not None else (1.0,) * n_ops
    kernel = 0.0
    for i, f in enumerate(op_flops):
        op_time[i][0] = (f * factors[i] * stretch[i] + packed[i]) / peak * imbalance
        kernel += (f * factors[i] * (stretch[i] - 1) + packed[i]) / peak * imbalance
    compute = sum(parts[0] for parts in op_time)
    if nest.fused:
        time = max([compute, *(t for _, t in mem)])
    else:
        time = sum(max(parts) for parts in op_time)
    executed = sum(op_flops)
    if nest.fused:
        executed = round(executed * computed_share(nest.chain, code_tiles))
    return Cost(tuple(moved), tuple(used), executed, compute, tuple(mem), imbalance, time, kernel)
