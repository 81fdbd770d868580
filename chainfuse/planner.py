"""The planner: enumerate block orders and compute-at depths, choose tiles per level, rank by time.

No autotuning: every candidate is costed by `chainfuse.model`, and the search is small because
most orders are equivalent (docs/design.md):

1. *Structures.* Batch-like loops go outermost with tile 1, convolution taps innermost and whole;
   every ordered subset of the other legal loops is a candidate prefix, the rest in every order
   (at most three). Orders with equal `Nest` signatures are costed once (`considered`).
2. *Tiles.* Per cache level, outermost first: grow a uniform tile (multiples of the register
   block) until the level's `USABLE` share is full, then coordinate rounds; inner tiles never
   exceed outer ones. At the outermost level the objective counts the cores' deal, as `estimate`.
3. *Rank.* Every structure is ranked by `estimate(...).time_s`, then refined (all of them for a
   plain chain, the best `SCREENED` for a convolution); one whose least flops cannot beat the
   best so far (its time with the flops at the peak) is skipped, except `TIED` of those whose
   quick tiles tie with it. Unfused execution is costed too, its best order refined.
4. *Choose* (`model.choose`): the fastest plan, or among those within `TIE` of it the one moving
   the fewest bytes from the outermost level; a fused plan moving more of them than the unfused
   execution is chosen only where predicted faster by more than `TIE`.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chainfuse.hardware import Hardware, MemoryLevel, resolve
from chainfuse.ir import Chain, Contraction, Role, Softmax
from chainfuse.model import (
    TIE,
    Cost,
    LevelCost,
    LoopKind,
    Nest,
    causal_softmax,
    choose,
    code_flops,
    code_level,
    computed_share,
    deal,
    efficiency,
    estimate,
    kernel_of,
    least_flops,
    level_cost,
    moved_bytes,
    rescale_factors,
    rescaled,
    splits,
    traffic,
)

__all__ = ["USABLE", "Plan", "PlanningError", "plan", "register_block"]

# fraction of a level the working set may fill: caches are not ideal (conflicts, code, the
# lines the hardware prefetchers bring) (docs/tuning.md)
USABLE = 0.6
UNFUSED_ROUNDS = 2  # rounds refining the unfused execution's tiles (docs/tuning.md)
TIED = 2  # structures that can only tie with the fastest refined (docs/tuning.md#tied)
SCREENED = 3  # structures refined when costing is slow (affine indices); plain chains: all
MAX_PREFIX = 4  # longest shared prefix enumerated (beyond it the orders are equivalent in practice)


class PlanningError(ValueError):
    """No legal plan exists (e.g. a level too small for the smallest tiles)."""


Tiles = tuple[tuple[str, int], ...]
# a costed candidate: the cost, its nest, tiles per level, the loops split across cores
_Choice = tuple[Cost, Nest, dict[str, dict[str, int]], tuple[str, ...]]


@dataclass(frozen=True)
class Plan:
    """A chain's schedule and the model's predictions for it. Frozen, hashable, JSON round-trips.

    `tiles` holds, per cache level (innermost first), the tile of every loop in the blocks that
    level holds; `predicted_bytes` maps each level to the bytes read from it (outermost last).
    """

    chain: str
    hardware: str
    fused: bool
    order: tuple[str, ...]
    depth: int
    tiles: tuple[tuple[str, Tiles], ...]
    parallel: tuple[str, ...]
    threads: int
    register_block: tuple[int, int]
    bytes_per_level: tuple[tuple[str, int], ...]
    used_per_level: tuple[tuple[str, int], ...]
    flops: int
    predicted_time_s: float
    compute_time_s: float
    unfused_time_s: float
    bound: str
    considered: int
    split: tuple[str, int] | None = None  # (loop, quantum) idle cores split (`model.deal`)

    @property
    def predicted_bytes(self) -> dict[str, int]:
        return dict(self.bytes_per_level)

    @property
    def prefix(self) -> tuple[str, ...]:
        return self.order[: self.depth]

    def tiles_at(self, level: str) -> dict[str, int] | None:
        for name, tiles in self.tiles:
            if name == level:
                return dict(tiles)
        return None

    @property
    def levels(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tiles)

    def to_json(self) -> str:
        data: dict[str, Any] = {
            "chain": self.chain,
            "hardware": self.hardware,
            "fused": self.fused,
            "order": list(self.order),
            "depth": self.depth,
            "tiles": {lvl: dict(t) for lvl, t in self.tiles},
            "tile_levels": [lvl for lvl, _ in self.tiles],
            "parallel": list(self.parallel),
            "threads": self.threads,
            "register_block": list(self.register_block),
            "predicted_bytes": dict(self.bytes_per_level),
            "byte_levels": [lvl for lvl, _ in self.bytes_per_level],
            "used_bytes": dict(self.used_per_level),
            "used_levels": [lvl for lvl, _ in self.used_per_level],
            "flops": self.flops,
            "predicted_time_s": self.predicted_time_s,
            "compute_time_s": self.compute_time_s,
            "unfused_time_s": self.unfused_time_s,
            "bound": self.bound,
            "considered": self.considered,
            "split": list(self.split) if self.split is not None else None,
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        d = json.loads(text)
        order = tuple(d["order"])
        return cls(
            chain=d["chain"],
            hardware=d["hardware"],
            fused=bool(d["fused"]),
            order=order,
            depth=int(d["depth"]),
            tiles=tuple(
                (lvl, tuple((n, int(d["tiles"][lvl][n])) for n in order if n in d["tiles"][lvl]))
                for lvl in d["tile_levels"]
            ),
            parallel=tuple(d["parallel"]),
            threads=int(d["threads"]),
            register_block=(int(d["register_block"][0]), int(d["register_block"][1])),
            bytes_per_level=tuple(
                (lvl, int(d["predicted_bytes"][lvl])) for lvl in d["byte_levels"]
            ),
            used_per_level=tuple((lvl, int(d["used_bytes"][lvl])) for lvl in d["used_levels"]),
            flops=int(d["flops"]),
            predicted_time_s=float(d["predicted_time_s"]),
            compute_time_s=float(d["compute_time_s"]),
            unfused_time_s=float(d["unfused_time_s"]),
            bound=d["bound"],
            considered=int(d["considered"]),
            split=(str(d["split"][0]), int(d["split"][1])) if d.get("split") else None,
        )

    def __str__(self) -> str:
        loops = list(self.order)
        head = f"plan for {self.chain} on {self.hardware}"
        kind = "fused (one kernel)" if self.fused else "unfused (one kernel per op)"
        lines = [
            head,
            f"  {kind}; order {' > '.join(self.order)}; shared prefix "
            f"{' > '.join(self.prefix) or '-'} (depth {self.depth})",
            f"  parallel over {', '.join(self.parallel) or '-'} on {self.threads} thread(s); "
            f"register block {self.register_block[0]}x{self.register_block[1]}"
            + (f"; idle cores split {self.split[0]}" if self.split else ""),
        ]
        width = max(6, *(len(n) for n in loops))
        lines.append("  tiles  " + " ".join(f"{n:>{width}}" for n in loops) + "   holds")
        used = dict(self.used_per_level)
        for lvl, tiles in self.tiles:
            t = dict(tiles)
            row = " ".join(f"{t.get(n, 0):>{width}}" for n in loops)
            lines.append(f"  {lvl:<6} {row}   {_size(used.get(lvl, 0))}")
        lines.append("  bytes read from each level:")
        for lvl, b in self.bytes_per_level:
            lines.append(f"    {lvl:<6} {_size(b):>10}")
        gflop = self.flops / 1e9
        lines.append(
            f"  predicted {self.predicted_time_s * 1e3:.3f} ms ({self.bound}-bound, "
            f"{gflop:.3f} GFLOP executed); unfused {self.unfused_time_s * 1e3:.3f} ms; "
            f"{self.considered} distinct schedules considered"
        )
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def register_block(chain: Chain, hardware: Hardware) -> tuple[int, int]:
    """The (mr, nr) register block of the chain's micro-kernel (`model.kernel_of`: the one
    `kernels.select` picks, or the AMX block for a bf16 chain on AMX); (1, 1) where none.

    Rows of a contraction's output tile come in multiples of mr, columns of nr.
    """
    kernel = kernel_of(chain, hardware)
    return (1, 1) if kernel is None else (kernel.mr, kernel.nr)


def _roles(chain: Chain) -> tuple[list[str], list[str]]:
    """Batch-like loops (index every tensor that moves, reduce nothing) and convolution taps.

    A softmax's mask does not count: one broadcast over the heads would make the heads a loop
    to tile for its reuse, taking room the code's tiles need. Its re-reads are still counted."""
    moving = [
        acc for op in chain.ops for acc in (*op.reads, op.output)
        if chain.tensor(acc.tensor).role is not Role.INTERMEDIATE
        and not (isinstance(op, Softmax) and acc is op.mask)
    ]  # fmt: skip
    reductions = {n for op in chain.ops for n in op.reduction}
    batch = [
        lp.name for lp in chain.loops
        if lp.name not in reductions and all(lp.name in acc.loops for acc in moving)
    ]  # fmt: skip
    taps: list[str] = []
    for op in chain.ops:
        for acc in op.reads:
            for ix in acc.index:
                for name, _ in ix.terms[1:]:
                    if name not in taps:
                        taps.append(name)
    return batch, taps


def _quanta(chain: Chain, mr: int, nr: int) -> dict[str, int]:
    """The tile multiple of each loop: mr for output rows, nr for output columns, else 1."""
    q = dict.fromkeys(chain.extents, 1)
    for op in chain.ops:
        if not isinstance(op, Contraction) or len(op.output.index) < 2:
            continue
        if any(len(ix.terms) > 1 for acc in op.reads for ix in acc.index):
            continue  # convolutions: implicit GEMM rows are pixels, no fixed multiple
        rows, cols = op.output.index[-2].loops[0], op.output.index[-1].loops[0]
        q[rows] = max(q[rows], mr)
        q[cols] = max(q[cols], nr)
    return q


#: Share of the innermost cache a fused GEMM chain's first micro-kernel panel may take.
PANEL_SHARE = 0.5
#: A reduction up to this many times the panel's steps is left whole (`_panel_caps`).
WHOLE_REDUCTION = 2.5


def _panel_caps(chain: Chain, hw: Hardware, nr: int) -> dict[str, int]:
    """The largest code-level tile of the first GEMM's reduction in a fused GEMM chain: its packed
    panel of nr columns takes at most `PANEL_SHARE` of the innermost cache; a reduction of at most
    `WHOLE_REDUCTION` times that stays whole (docs/tuning.md). {} where nothing is capped."""
    if len(chain.contractions) < 2 or code_level(hw) == hw.levels[0].name:
        return {}
    first = chain.contractions[0]
    if len(first.reduction) != 1:
        return {}
    steps = max(1, int(hw.levels[0].capacity * PANEL_SHARE) // (nr * 4))  # fp32 (bf16 too)
    k = first.reduction[0]
    if chain.extents[k] <= WHOLE_REDUCTION * steps:
        return {}
    return {k: steps}


def _candidates(extent: int, quantum: int) -> list[int]:
    """Tile sizes worth trying for one loop: its quantum doubled up to the whole extent, and the
    even halves and thirds of the extent (they avoid a small tail tile)."""
    out = {extent}
    t = quantum
    while t < extent:
        out.add(t)
        t *= 2
    for parts in (2, 3):
        share = -(-extent // parts)
        even = -(-share // quantum) * quantum
        if even < extent:
            out.add(even)
    return sorted(out)


@dataclass
class _Search:
    chain: Chain
    hw: Hardware
    threads: int
    quanta: dict[str, int]
    fixed: dict[str, int]  # loops whose tile never changes (batch: 1, taps: whole)
    split: tuple[str, int] | None = None  # (loop, quantum) that cores a deal leaves idle split
    caps: dict[str, int] = field(default_factory=dict)  # largest code-level tiles (fused nests)
    evaluations: int = 0
    too_small: MemoryLevel | None = None  # the last level no tiles fitted, for the error
    memo: dict[tuple[object, ...], float | None] = field(default_factory=dict)
    model_memo: dict[tuple[object, ...], Any] = field(default_factory=dict)  # shared by all nests
    costs: dict[tuple[Nest, tuple[int, ...]], LevelCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # per cache level: (usable bytes, bandwidth of the level outside it with all cores busy)
        self.levels: list[tuple[float, float]] = []
        for i, lv in enumerate(self.hw.levels[:-1]):
            cap = (lv.capacity / self.threads if lv.shared else lv.capacity) * USABLE
            self.levels.append((cap, self._bandwidth(i, self.threads)))
        self.peak = self.hw.peak(self.chain.dtype)
        names = [lv.name for lv in self.hw.levels]
        self.code = names.index(code_level(self.hw))  # the level the generated code tiles
        self.rescaled = rescaled(self.chain)
        self.efficiency = efficiency(self.chain, self.hw)
        self.causal = causal_softmax(self.chain) is not None
        self.free: dict[Nest, tuple[list[str], dict[str, tuple[str, ...]]]] = {}
        self.units: dict[tuple[str, ...], list[tuple[str, ...]]] = {}
        self.ext = ext = self.chain.extents  # (a property that builds a dict)
        self.candidates = {n: _candidates(ext[n], self.quanta[n]) for n in ext}

    def _bandwidth(self, level: int, workers: int) -> float:
        """Bytes/s that `workers` busy cores read from the level outside `level` (as `estimate`)."""
        outer = self.hw.levels[level + 1]
        return outer.aggregate_bandwidth(workers) if outer.shared else outer.bandwidth * workers

    def capacity(self, level: int) -> float:
        return self.levels[level][0]

    def level_objective(
        self, nest: Nest, level: int, tiles: Mapping[str, int], parallel: tuple[str, ...]
    ) -> float | None:
        """Predicted seconds of the bytes this level's tiles move and the flops they execute;
        None when the working set does not fit. The outermost level counts the busy cores and the
        imbalance of their deal (as `estimate`); inner levels assume every core busy."""
        tkey = tuple([tiles[n] for n in nest.order])
        outermost = level == len(self.levels) - 1
        # (not id(nest): ids get reused)
        key = (nest, parallel if outermost else (), level, tkey, self.split if outermost else None)
        if key in self.memo:
            return self.memo[key]
        cost = self.costs.get((nest, tkey))
        if cost is None:  # the same tiles come up at several levels: cost them once
            cost = self.costs[(nest, tkey)] = level_cost(nest, tiles)
            self.evaluations += 1
        cap, bw = self.levels[level]
        score = None
        if cost.used <= cap:
            workers, imbalance = self.threads, 1.0
            if outermost:
                ext = self.ext
                # (whether the inner levels keep a block one code-level block, as a split
                # needs, is not known yet: `estimate` checks it on the final tiles)
                split = None
                if self.split is not None and nest.fused:  # (unfused ops run on their own)
                    split = (ext[self.split[0]], self.split[1])
                dims = tuple((ext[n], tiles[n]) for n in parallel)
                workers, imbalance = deal(dims, self.threads, split)
                bw = self._bandwidth(level, workers)
            flops: float = cost.flops
            moved = cost.total
            if self.causal and nest.fused:  # (what the code reads: `model.moved_bytes`)
                moved = sum(b for _, _, b in moved_bytes(nest, cost, tiles))
            if level == self.code:  # the code's tiles: rescaling, calls, packing (`model`)
                factors = rescale_factors(self.chain, tiles, self.rescaled) if nest.fused else None
                packed = moved
                if self.efficiency is not None and self.efficiency.direct:
                    n_ops = len(self.chain.ops)
                    packed = sum(self.efficiency.packed_bytes(cost.moved, n_ops, tiles, self.ext))
                flops = code_flops(self.efficiency, cost.op_flops, factors, tiles, self.ext, packed)
            score = (moved / bw + flops / self.peak / workers) * imbalance
        self.memo[key] = score
        return score

    def cannot_beat(self, nest: Nest, parallel: Sequence[str], best: Cost) -> bool:
        """Whether `nest` is not worth costing: its `least_time` already takes as long as `best`
        with its flops at the peak (to a relative 1e-9). Exact without the micro-kernel's terms;
        with them, a structure computing no less than `best` is taken to gain nothing by them."""
        return self.least_time(nest, parallel) >= best.plain_s * (1 - 1e-9)

    def least_time(self, nest: Nest, parallel: Sequence[str]) -> float:
        """A bound no tiles beat: `nest`'s least flops at the peak on as many cores as its
        parallel loops can occupy, perfectly balanced."""
        units = math.prod(self.ext[n] for n in parallel)
        workers = max(1, min(self.threads, units))
        if self.split is not None and nest.fused:
            workers = self.threads
        least: float = least_flops(nest)
        if nest.fused:  # (a causal softmax's rows in blocks of one: the scores kept)
            least *= computed_share(self.chain, dict.fromkeys(self.ext, 1))
        return least / (self.peak * workers)

    def _free(self, nest: Nest) -> tuple[list[str], dict[str, tuple[str, ...]]]:
        """The loops whose tiles are searched (twins follow their leader) and the twins."""
        ext = self.ext
        blocks = {n for opn in nest.ops for n, k in opn.kinds.items() if k is not LoopKind.DERIVED}
        free = [n for n in nest.order if n not in self.fixed and ext[n] > 1 and n in blocks]
        key = tuple(free)
        if key not in self.units:  # (a chain's loops' uses: the same for every nest)
            self.units[key] = _units(self.chain, free)
        twins = {u[0]: u[1:] for u in self.units[key] if len(u) > 1}
        free = [n for n in free if not any(n in rest for rest in twins.values())]
        return free, twins

    def tiles_for(
        self,
        nest: Nest,
        level: int,
        upper: Mapping[str, int],
        parallel: tuple[str, ...],
        rounds: int = 2,
    ) -> dict[str, int] | None:
        ext = self.ext
        if nest not in self.free:
            self.free[nest] = self._free(nest)
        free, twins = self.free[nest]
        caps = self.caps if level == self.code and nest.fused else {}
        cands = {
            n: [t for t in self.candidates[n] if t <= min(upper.get(n, ext[n]), caps.get(n, t))]
            or [min(self.quanta[n], upper.get(n, ext[n]))]
            for n in free
        }
        tiles = {n: self.fixed.get(n, ext[n]) for n in nest.order}

        def tied(t: dict[str, int]) -> dict[str, int]:
            for lead, rest in twins.items():
                t.update(dict.fromkeys(rest, t[lead]))
            return t

        for n in free:
            tiles[n] = cands[n][0]
        tiles = tied(tiles)
        best = self.level_objective(nest, level, tiles, parallel)
        if best is None:
            return None
        # grow every free tile together while the level still holds the working set
        step = 1
        while step < max(map(len, cands.values()), default=0):
            trial = tied({**tiles, **{n: cands[n][min(step, len(cands[n]) - 1)] for n in free}})
            if trial == tiles:
                break
            score = self.level_objective(nest, level, trial, parallel)
            if score is None:
                break
            if score <= best:
                tiles, best = trial, score
            step += 1
        for _ in range(rounds):
            improved = False
            for n in free:
                for t in cands[n]:
                    if t == tiles[n]:
                        continue
                    trial = tied({**tiles, n: t})
                    score = self.level_objective(nest, level, trial, parallel)
                    if score is None:
                        break  # a larger tile holds more: none of the rest fits either
                    # a tie goes to the larger tile: fewer blocks, so less loop and call overhead
                    # (packing, micro-kernel prologues) that the byte and flop counts do not see
                    if score < best * (1 - 1e-9) or (score <= best * (1 + 1e-9) and t > tiles[n]):
                        tiles, best, improved = trial, score, improved or score < best * (1 - 1e-9)
            if not improved:
                break
        if level == self.code and self.rescaled and nest.fused:
            tiles, best = self._exchange(nest, level, parallel, tiles, best, free, cands, tied)
        return tiles

    def _exchange(
        self,
        nest: Nest,
        level: int,
        parallel: tuple[str, ...],
        tiles: dict[str, int],
        best: float,
        free: list[str],
        cands: Mapping[str, list[int]],
        tied: Callable[[dict[str, int]], dict[str, int]],
    ) -> tuple[dict[str, int], float]:
        """Trade a smaller tile of a shared loop for a larger tile of the l an online softmax runs
        over (fewer rescalings: `model.rescale_factors`): from a full block, neither move alone
        fits or wins, so the coordinate search cannot take them."""
        ext = self.ext
        reductions = {op.axis for op in self.chain.ops if isinstance(op, Softmax)}
        # room is made by the shared loops' other tiles (attention's rows), never by another
        # reduction's or a private loop's, whose smaller tiles cost what the model does not see
        contracted = {r for op in self.chain.ops for r in op.reduction}
        room = [b for b in free if b in nest.prefix and b not in contracted]
        for a in free:
            if a not in reductions:
                continue
            for t in cands[a]:
                if t <= tiles[a] or tiles[a] >= ext[a]:
                    continue
                for b in room:
                    for u in reversed(cands[b]):
                        if u >= tiles[b]:
                            continue
                        trial = tied({**tiles, a: t, b: u})
                        score = self.level_objective(nest, level, trial, parallel)
                        if score is None:
                            continue
                        if score < best * (1 - 1e-9):
                            tiles, best = trial, score
                        break
        return tiles, best

    def all_levels(
        self, nest: Nest, parallel: tuple[str, ...], rounds: int = 2
    ) -> dict[str, dict[str, int]] | None:
        """Tiles for every cache level, outermost first, each within the one outside it.

        Where the inner tiles do not allow the split of idle cores the outermost tiles were costed
        with, the search runs again without it: a plan never counts on cores left idle."""
        tiles = self._all_levels(nest, parallel, rounds)
        if self.split is None or tiles is None or not nest.fused:
            return tiles
        if splits(nest, tiles, parallel, self.split) is not None:
            return tiles
        split, self.split = self.split, None
        try:
            return self._all_levels(nest, parallel, rounds)
        finally:
            self.split = split

    def _all_levels(
        self, nest: Nest, parallel: tuple[str, ...], rounds: int
    ) -> dict[str, dict[str, int]] | None:
        out: dict[str, dict[str, int]] = {}
        upper: Mapping[str, int] = {}
        for level in range(len(self.hw.levels) - 2, -1, -1):
            tiles = self.tiles_for(nest, level, upper, parallel, rounds)
            if tiles is None:
                self.too_small = self.hw.levels[level]
                return None
            out[self.hw.levels[level].name] = tiles
            upper = tiles
        return {name: out[name] for name in reversed(list(out))}


def _signature(chain: Chain, loop: str) -> tuple[object, ...]:
    """How a loop is used, up to which dimension it indexes: equal for twins like a conv's p, q."""
    ext = chain.extents
    uses = []
    for i, op in enumerate(chain.ops):
        for acc in (*op.reads, op.output):
            for ix in acc.index:
                if loop in ix.loops:
                    partners = tuple(sorted(ext[o] for o, _ in ix.terms if o != loop))
                    uses.append((i, acc.tensor, ix.coeff(loop), partners, ix.offset))
    return (ext[loop], tuple(sorted(uses)))


def _units(chain: Chain, loops: Sequence[str]) -> list[tuple[str, ...]]:
    """The loops grouped into twins (same signature: a convolution's p and q), in chain order.

    Swapping twins maps the chain onto itself, so only one order of a pair needs costing, and
    the pair moves through the prefix together.
    """
    units: list[list[str]] = []
    sigs: list[tuple[object, ...]] = []
    for loop in loops:
        sig = _signature(chain, loop)
        if sig in sigs:
            units[sigs.index(sig)].append(loop)
        else:
            units.append([loop])
            sigs.append(sig)
    return [tuple(u) for u in units]


def _structures(
    chain: Chain, batch: Sequence[str], taps: Sequence[str]
) -> list[tuple[tuple[str, ...], int]]:
    """(order, depth) candidates: batch + ordered prefix subset + every order of the rest."""
    ext = chain.extents
    others = [n for n in chain.extents if n not in batch and n not in taps and ext[n] > 1]
    trivial = [n for n in chain.extents if n not in batch and n not in taps and ext[n] == 1]
    legal = []
    for n in others:  # a loop that cannot be shared alone cannot be shared with others either
        try:
            Nest(chain, (*batch, n, *[o for o in chain.extents if o not in batch and o != n]),
                 len(batch) + 1)  # fmt: skip
        except ValueError:
            continue
        legal.append(n)
    units = _units(chain, legal)
    out = []
    for size in range(0, min(MAX_PREFIX, len(units)) + 1):
        for chosen in itertools.permutations(units, size):
            prefix = tuple(n for unit in chosen for n in unit)
            rest = [n for n in others if n not in prefix]
            tails = itertools.permutations(rest) if len(rest) <= 3 else [tuple(rest)]
            for tail in tails:
                order = (*batch, *prefix, *tail, *taps, *trivial)
                out.append((order, len(batch) + len(prefix)))
    return out


def plan(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    fuse: bool | None = None,
    structures: Sequence[tuple[tuple[str, ...], int]] | None = None,
    quanta: Mapping[str, int] | None = None,
    split: tuple[str, int] | None = None,
) -> Plan:
    """Choose the block order, compute-at depth, tiles per level and parallel split of `chain`.

    `hardware`: a `Hardware`, a preset name, or None for this machine; `fuse` forces fused (True)
    or unfused (False); `structures` restricts the fused (order, depth) candidates to a backend's;
    `quanta` overrides some loops' tile multiples; `split` ((loop, quantum)) is a loop the kernel
    splits among the cores its deal leaves idle (`model.deal`).
    """
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    # (a 16-bit chain on a CPU without its engine is planned at the fp32 units' rate)
    hw = resolve(hardware).for_chain(chain.dtype)
    nthreads = threads or hw.cores
    if nthreads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads}")
    mr, nr = register_block(chain, hw)
    batch, taps = _roles(chain)
    ext = chain.extents
    fixed = {**dict.fromkeys(batch, 1), **{n: ext[n] for n in taps}}
    if split is not None and split[0] not in ext:
        raise ValueError(f"split: {split[0]!r} is not a loop of {chain.name}")
    search = _Search(
        chain, hw, nthreads, {**_quanta(chain, mr, nr), **(quanta or {})}, fixed, split,
        caps=_panel_caps(chain, hw, nr) if not taps else {},
    )  # fmt: skip
    if len(hw.levels) < 2:
        raise PlanningError(f"hardware {hw.name!r} needs at least one cache level and memory")

    # every distinct structure: quick tiles at every level, ranked by the final cost
    seen: set[object] = set()
    scored: list[_Choice] = []
    best: _Choice | None = None
    if fuse is not False:
        candidates = _structures(chain, batch, taps) if structures is None else structures
        for order, depth in candidates:
            try:
                nest = Nest(chain, order, depth, memo=search.model_memo)
            except ValueError:
                continue  # illegal prefix (a producer's reduction or a windowed loop)
            sig = nest.signature()
            if sig in seen:
                continue
            seen.add(sig)
            parallel = _parallel(nest, batch)
            if best is not None and search.cannot_beat(nest, parallel, best[0]):
                continue
            tiles_all = search.all_levels(nest, parallel, rounds=0)
            if tiles_all is None:
                continue
            cost = estimate(nest, tiles_all, hw, parallel, nthreads, split)
            scored.append((cost, nest, tiles_all, parallel))
            if best is None or cost.time_s < best[0].time_s:
                best = scored[-1]
    scored.sort(key=lambda c: c[0].time_s)  # stable: ties keep the enumeration order

    # refining every structure keeps a larger cache from losing the optimum (the quick search
    # can rank last what refining makes best); convolutions cost too much per evaluation. Of
    # those that cannot beat the best but tie with it, `TIED` moving the fewest bytes are refined
    plain = all(nest.plain for _, nest, _, _ in scored)
    final: dict[Nest, _Choice] = {c[1]: c for c in scored}
    rounds = 2 if plain else 1

    def refine(nest: Nest, parallel: tuple[str, ...]) -> _Choice | None:
        tiles_all = search.all_levels(nest, parallel, rounds=rounds)
        if tiles_all is None:
            return None
        cost = estimate(nest, tiles_all, hw, parallel, nthreads, split)
        if cost.time_s <= final[nest][0].time_s * (1 + 1e-9):  # (refining keeps the time)
            final[nest] = (cost, nest, tiles_all, parallel)
        return final[nest]

    tied: list[_Choice] = []
    for choice in scored if plain else scored[:SCREENED]:
        assert best is not None
        _, nest, _, parallel = choice
        if nest is not best[1] and search.cannot_beat(nest, parallel, best[0]):
            if choice[0].time_s <= best[0].time_s * (1 + TIE):
                tied.append(choice)  # its quick tiles already tie: refined below
            continue
        done = refine(nest, parallel)
        if done is not None and done[0].time_s < best[0].time_s:
            best = done
    for _, nest, _, parallel in sorted(tied, key=lambda c: traffic(c[0]))[:TIED]:
        refine(nest, parallel)

    unfused = _unfused(chain, search, batch, taps, hw, nthreads)
    considered = len(seen) + 1
    if unfused is None and best is None:
        lv = search.too_small or hw.levels[0]
        raise PlanningError(
            f"no plan of {chain.name} fits {hw.name}: its smallest tiles need more than "
            f"{USABLE:.0%} of level {lv.name} ({lv.capacity}-byte capacity)"
        )
    if fuse is True and best is None:
        raise PlanningError(f"no fused plan of {chain.name} fits {hw.name}")
    # the fastest, or of those tying with it the one moving the fewest outer bytes (`model.rank`)
    fused = [(c[0], c) for c in final.values()]
    cost, chosen = choose(fused, None if fuse is True or unfused is None else (unfused[0], unfused))
    _, nest, tiles_all, parallel = chosen
    # the split, where it puts cores the deal of the parallel loops leaves idle to work
    used_split = None
    share = splits(nest, tiles_all, parallel, split) if nest.fused else None
    if share is not None and split is not None:
        outer = tiles_all[list(tiles_all)[-1]]
        dims = tuple((ext[n], outer.get(n, ext[n])) for n in parallel)
        if deal(dims, nthreads, share)[0] > deal(dims, nthreads)[0]:
            used_split = split
    return Plan(
        chain=chain.name,
        hardware=hw.name,
        fused=nest.fused,
        order=nest.order,
        depth=nest.depth,
        tiles=tuple((lvl, tuple((n, t[n]) for n in nest.order)) for lvl, t in tiles_all.items()),
        parallel=parallel,
        threads=nthreads,
        register_block=(mr, nr),
        bytes_per_level=cost.bytes_per_level,
        used_per_level=cost.used_per_level,
        flops=cost.flops,
        predicted_time_s=cost.time_s,
        compute_time_s=cost.compute_s,
        unfused_time_s=unfused[0].time_s if unfused else math.inf,
        bound=cost.bound,
        considered=considered,
        split=used_split,
    )


def _parallel(nest: Nest, batch: Sequence[str]) -> tuple[str, ...]:
    out = list(batch)
    for n in nest.parallel_candidates:
        if n not in out:
            out.append(n)
    return tuple(out)


def _unfused(
    chain: Chain,
    search: _Search,
    batch: Sequence[str],
    taps: Sequence[str],
    hw: Hardware,
    threads: int,
) -> _Choice | None:
    """Each op on its own (intermediates through memory), in the best of a few orders."""
    others = [n for n in chain.extents if n not in batch and n not in taps]
    best: _Choice | None = None
    reductions = {n for op in chain.ops for n in op.reduction}
    spatial = [n for n in others if n not in reductions]
    red = [n for n in others if n in reductions]
    # the orders differ in the lead loop only; those whose nests have equal signatures move the
    # same bytes for every tile choice, so they are costed on one nest (its costs are cached)
    # and differ in the parallel split alone
    costed: dict[object, Nest] = {}
    best_same: Nest | None = None
    for head in itertools.permutations(spatial, min(1, len(spatial))):
        order = (*batch, *head, *[n for n in spatial if n not in head], *red, *taps)
        nest = Nest(chain, order, 0, fused=False, memo=search.model_memo)
        same = costed.setdefault(nest.signature()[:2], nest)
        lead = tuple(n for n in (*batch, *head) if n not in reductions)
        tiles = search.all_levels(same, lead, rounds=0)
        if tiles is None:
            continue
        cost = estimate(same, tiles, hw, lead, threads)
        if best is None or cost.time_s < best[0].time_s:
            best, best_same = (cost, nest, tiles, lead), same
    # the best order's tiles refined as a fused nest's are: quick tiles alone can make
    # unfused execution look several times slower than it is (an MLP's, on many cores)
    if best is not None and best_same is not None:
        tiles = search.all_levels(best_same, best[3], rounds=UNFUSED_ROUNDS)
        refined = estimate(best_same, tiles, hw, best[3], threads) if tiles else None
        if tiles and refined and refined.time_s < best[0].time_s:
            best = (refined, best[1], tiles, best[3])
    return best


def timed_plan(
    chain: Chain, hardware: Hardware | str | None = None, **kwargs: Any
) -> tuple[Plan, float]:
    """`plan(...)` and the seconds it took (what `chainfuse plan` and the benchmarks print)."""
    start = time.perf_counter()
    result = plan(chain, hardware, **kwargs)
    return result, time.perf_counter() - start
