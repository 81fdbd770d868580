"""The analytical data-movement model: what a block loop nest moves, holds and computes.

Pure functions of (Chain, schedule, tiles, Hardware). A *schedule* is a block order (a permutation
of the chain's loops) and a compute-at depth: `order[:depth]` is the *prefix* shared by every op of
the fused chain; each op then runs its remaining loops (its *private* loops) in `order`'s order::

    order m l k n, depth 2 (the DESIGN.md example):      for m_o: for l_o:
                                                              for k_o: C_t += A[m_o,k_o] B[k_o,l_o]
                                                              for n_o: E[m_o,n_o] += C_t D[l_o,n_o]

The data moved into a level by access X of op p (DESIGN.md's rule): walk the loops enclosing p's
block from the inside out; l* is the innermost one that changes X's tile. X is reloaded on every
iteration of l* and of every loop outside it, and reused across the loops inside l*::

    DM(X) = sum over the iterations of the loops indexing X of |X tile|
            * prod over non-indexing loops at or outside l* of ceil(N / T)

With tiles that divide the extents this is `footprint(X) * prod ceil(N/T)`; with tails the sum
counts each clipped edge tile at its real size, and a convolution's footprint comes from the
bounds of its affine indices, so the input halo `(T_P - 1) * stride + R` appears by itself.
Where clipping or a sum of loops maps consecutive blocks to the same region (a halo clipped to
the same rows at a border, `p + r` with the tap `r` tiled), the buffer still holds it and
nothing is reloaded: those blocks are subtracted (`_Compiled._repeats`), so the model stays equal
to the simulator for every tiling, not just the planner's.

A producer's output loop that is not in the prefix is *derived*: the producer computes exactly the
region its consumer reads during one prefix iteration (a 3x3 consumer needs a halo, so the
producer recomputes the overlap; a loop of the consumer that is in the prefix but not in the
producer makes the producer recompute its whole tile each iteration). Intermediates move nothing
but occupy memory for the whole prefix iteration.

Planning evaluates this thousands of times, so a nest is compiled once (`_Shape`, `_Compiled`):
each access' regions become `chainfuse.footprint` expressions, and an evaluation is integer
arithmetic plus memo lookups of the expressions' values by the tiles they read.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

from chainfuse.footprint import (
    Dim,
    Expr,
    dim_leaves,
    distinct,
    grid_sum,
    leaves,
    may_repeat,
    plain_loop,
    point_span,
    repeat_sum,
)
from chainfuse.ir import Access, Affine, Chain, Contraction, Op, Role, Softmax

if TYPE_CHECKING:
    from chainfuse.hardware import Hardware

__all__ = [
    "RESCALE_STEPS",
    "Cost",
    "LevelCost",
    "LoopKind",
    "Nest",
    "causal_share",
    "causal_softmax",
    "code_level",
    "compulsory_bytes",
    "computed_share",
    "estimate",
    "example_dv",
    "keys_share",
    "least_flops",
    "level_cost",
    "moved_bytes",
    "rescale_factors",
    "rescaled",
]


class LoopKind(enum.Enum):
    """How a loop runs around one op's block in a nest."""

    PREFIX = "prefix"  # shared block loop, outside every op
    PRIVATE = "private"  # the op's own block loop, inside the prefix
    DERIVED = "derived"  # an output loop of a producer, sized by what its consumer reads


class OpNest:
    """One op's view of a nest: which loops enclose its block and how each of its loops runs."""

    def __init__(self, index: int, enclosing: tuple[str, ...], kinds: dict[str, LoopKind]) -> None:
        self.index = index
        self.enclosing = enclosing  # block loops around the op, outermost first
        self.kinds = kinds

    def kind(self, loop: str) -> LoopKind:
        return self.kinds[loop]

    def kind_or_none(self, loop: str) -> LoopKind | None:
        return self.kinds.get(loop)

    def __repr__(self) -> str:
        return f"OpNest({self.index}, {self.enclosing}, {self.kinds})"


class Nest:
    """A chain with a block order and a compute-at depth, checked for legality.

    `fused=False` runs every op on its own (depth 0) and intermediates go through memory.
    """

    def __init__(
        self,
        chain: Chain,
        order: Sequence[str],
        depth: int,
        fused: bool = True,
        memo: dict[tuple[object, ...], Any] | None = None,
    ) -> None:
        names = [lp.name for lp in chain.loops]
        if sorted(order) != sorted(names):
            raise ValueError(f"order {tuple(order)} must be a permutation of the loops {names}")
        if not 0 <= depth <= len(order):
            raise ValueError(f"depth {depth} out of range 0..{len(order)}")
        if not fused and depth != 0:
            raise ValueError("an unfused nest has depth 0")
        self.chain = chain
        self.order = tuple(order)
        self.depth = depth
        self.fused = fused
        self.prefix = self.order[:depth]
        self.extents = chain.extents
        self.intermediate = (
            {t.name for t in chain.intermediates} if fused else set[str]()
        )  # tensors that never leave the fuse level
        # region sums and footprints by (structure, tiles they read): keys name everything the
        # value depends on, so every nest of a chain may share one memo (the planner does)
        self.memo: dict[tuple[object, ...], Any] = {} if memo is None else memo
        # what depends on the prefix only as a set is worked out once per memo
        key = ("layout", frozenset(self.prefix), fused)
        if key not in self.memo:
            self.memo[key] = self._layout()
        reason, kinds, plain, self._derived, self._static = self.memo[key]
        if reason:
            raise ValueError(f"order {self.order} depth {depth}: {reason}")
        self.plain: bool = plain
        self.ops = tuple(
            OpNest(i, self.prefix + tuple(n for n in self.order[depth:]
                                          if k.get(n) is LoopKind.PRIVATE), k)
            for i, k in enumerate(kinds)
        )  # fmt: skip

    def _layout(self) -> tuple[str | None, list[dict[str, LoopKind]], bool, Any, Any]:
        """Legality, each op's loop kinds, the derived loops' consumer indices: all depend on
        which loops the prefix holds, not on their order."""
        chain = self.chain
        reason = self._illegal()
        if reason:
            return reason, [], False, {}, {}
        kinds = [self._kinds(op) for op in chain.ops]
        # for each derived (op, loop): the consumers' indices of that output dim
        derived: dict[tuple[int, str], tuple[tuple[int, Affine], ...]] = {}
        for i, op in enumerate(chain.ops):
            for d, ix in enumerate(op.output.index):
                if kinds[i].get(ix.loops[0]) is not LoopKind.DERIVED:
                    continue
                derived[(i, ix.loops[0])] = tuple(
                    (chain.ops.index(c), _access_of(c, op.output.tensor).index[d])
                    for c in chain.consumers(op.output.tensor)
                )
        plain = all(
            _is_plain(ix) or not ix.terms
            for op in chain.ops
            for acc in op.reads
            for ix in acc.index
        )
        static: dict[tuple[object, ...], Any] = {}  # tile-independent facts, computed on demand
        return None, kinds, plain, derived, static

    def _illegal(self) -> str | None:
        """Why this prefix cannot be shared by all ops, or None."""
        for op in self.chain.ops:
            if op.output.tensor not in self.intermediate:
                continue
            for loop in op.reduction:
                if loop in self.prefix:
                    return f"{loop!r} reduces {op.output.tensor!r}, which a later op consumes"
            for consumer in self.chain.consumers(op.output.tensor):
                acc = _access_of(consumer, op.output.tensor)
                for d, ix in enumerate(op.output.index):
                    loop = ix.loops[0]
                    if loop in self.prefix and acc.index[d] != ix:
                        return (
                            f"{loop!r} indexes {op.output.tensor!r} through {acc.index[d]} in its "
                            "consumer and cannot be a shared loop"
                        )
        return None

    def _kinds(self, op: Op) -> dict[str, LoopKind]:
        kinds: dict[str, LoopKind] = {}
        derived = set()
        if op.output.tensor in self.intermediate:
            derived = {ix.loops[0] for ix in op.output.index}
        for loop in op.loops:
            if loop in self.prefix:
                kinds[loop] = LoopKind.PREFIX
            elif loop in derived:
                kinds[loop] = LoopKind.DERIVED
            else:
                kinds[loop] = LoopKind.PRIVATE
        return kinds

    @cached_property
    def _compiled(self) -> _Compiled:
        return _Compiled(self)

    @cached_property
    def parallel_candidates(self) -> tuple[str, ...]:
        """Leading prefix loops whose iterations write disjoint outputs (safe to split)."""
        out: list[str] = []
        for loop in self.prefix:
            if any(loop in op.reduction for op in self.chain.ops):
                break
            out.append(loop)
        return tuple(out)

    def signature(self) -> tuple[object, ...]:
        """Equal signatures cost the same for every tile choice: used to prune orders."""
        sig: list[object] = []
        for opn, op in zip(self.ops, self.chain.ops, strict=True):
            for acc in (*op.reads, op.output):
                if acc.tensor in self.intermediate:
                    continue
                infl = self._influencing(opn, acc)
                star = max((i for i, n in enumerate(opn.enclosing) if n in infl), default=-1)
                outside = frozenset(n for n in opn.enclosing[: star + 1] if n not in infl)
                sig.append((opn.index, acc.tensor, outside))
            sig.append(frozenset(n for n in self.prefix if n not in op.loops))
        return (tuple(sig), frozenset(self.prefix), self.parallel_candidates)

    def _influencing(self, opn: OpNest, acc: Access) -> frozenset[str]:
        """Block loops whose iteration changes the region of `acc` touched by op `opn`."""
        key = ("infl", opn.index, acc.tensor)
        if key not in self._static:
            out: set[str] = set()
            for ix in acc.index:
                for loop in ix.loops:
                    out |= self._sources(opn.index, loop)
            self._static[key] = frozenset(out)
        found: frozenset[str] = self._static[key]
        return found

    def _sources(self, op_index: int, loop: str) -> frozenset[str]:
        key = ("src", op_index, loop)
        if key not in self._static:
            self._static[key] = self._find_sources(op_index, loop)
        found: frozenset[str] = self._static[key]
        return found

    def _find_sources(self, op_index: int, loop: str) -> frozenset[str]:
        if (op_index, loop) not in self._derived:
            return frozenset((loop,))
        out: set[str] = set()
        for ci, ix in self._derived[(op_index, loop)]:
            for cl in ix.loops:
                ckind = self.ops[ci].kind(cl)
                if ckind is LoopKind.PREFIX:
                    out.add(cl)
                elif ckind is LoopKind.DERIVED:
                    out |= self._sources(ci, cl)
        return frozenset(out)


def _access_of(op: Op, tensor: str) -> Access:
    for acc in op.reads:
        if acc.tensor == tensor:
            return acc
    raise KeyError(tensor)


@dataclass(frozen=True)
class LevelCost:
    """What one level's tiles imply: bytes moved per (op, tensor), bytes held, flops done."""

    moved: tuple[tuple[int, str, int], ...]  # (op index, tensor, bytes)
    used: int  # bytes: max over ops of the op's tiles plus the live intermediates
    op_flops: tuple[int, ...]  # flops each op executes, recompute included

    @property
    def flops(self) -> int:
        return sum(self.op_flops)

    @property
    def total(self) -> int:
        return sum(b for _, _, b in self.moved)

    def by_tensor(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, name, b in self.moved:
            out[name] = out.get(name, 0) + b
        return out


def _trips(n: int, t: int) -> int:
    return -(-n // max(1, min(t, n)))


@functools.lru_cache(maxsize=4096)
def deal(
    dims: tuple[tuple[int, int], ...], cores: int, split: tuple[int, int] | None = None
) -> tuple[int, float]:
    """(busy workers, imbalance) of the blocks of the parallel loops `dims` ((extent, tile)
    each, outermost first) dealt to `cores` as the generated kernels deal them: in row-major
    order, a contiguous share of ceil(blocks / workers) blocks each. The imbalance is the
    busiest worker's work over the average, work counted in elements, so that tail blocks
    weigh what they hold: 768 rows in blocks of 512 on 2 cores leave one core 512 rows and the
    other 256 (imbalance 4/3, though each has one block).

    `split` ((extent, quantum) of one more loop): with fewer blocks than cores, the
    ``cores // blocks`` cores of each block split that loop's range into contiguous shares of
    ``ceil(extent / (parts * quantum)) * quantum`` (an MLP's 64 tokens are one block; the GEMM
    chain kernels then split the hidden dimension l and add the shares up). The busiest share
    stretches the imbalance: 4096 in quanta of 6 on 2 cores (2052 and 2044) is 1.002, 100 on 3
    cores (36, 36, 28) 1.08."""
    tiles = [max(1, min(t, n)) for n, t in dims]
    trips = [-(-n // t) for (n, _), t in zip(dims, tiles, strict=True)]
    units = math.prod(trips)
    workers = max(1, min(cores, units))
    if split is not None and units < cores:
        extent, quantum = split
        parts = cores // units
        per = -(-extent // (parts * quantum)) * quantum
        busy = -(-extent // per)  # shares that hold any of the range
        _, imbalance = deal(dims, units)
        return units * busy, imbalance * min(per, extent) * busy / extent
    if units == 1:
        return workers, 1.0
    share = -(-units // workers)
    # blocks and elements of everything inside each loop (the suffix products)
    inner_blocks = [math.prod(trips[i + 1 :]) for i in range(len(dims))]
    inner_elems = [math.prod(n for n, _ in dims[i + 1 :]) for i in range(len(dims))]

    def done(x: int) -> int:
        """Elements in the first `x` blocks (row-major)."""
        total, scale = 0, 1  # scale: elements of the enclosing blocks x falls in
        levels = zip(dims, tiles, trips, inner_blocks, inner_elems, strict=True)
        for (n, _), t, k, blocks, elems in levels:
            q, x = divmod(x, blocks)
            total += scale * min(q * t, n) * elems
            if q >= k:
                return total
            scale *= min(t, n - q * t)
        return total

    busiest = max(done(min(units, (w + 1) * share)) - done(w * share) for w in range(workers))
    return workers, busiest * workers / math.prod(n for n, _ in dims)


def splits(
    nest: Nest,
    tiles: Mapping[str, Mapping[str, int]],
    parallel: Sequence[str],
    split: tuple[str, int] | None,
) -> tuple[int, int] | None:
    """The `deal` split argument ((extent, quantum)) of `split` for these tiles, or None: the
    kernels that split a loop do it for a block that is one block of the level inside the
    outermost (the rows of one code-level block; a block of several would need its shares
    added up once per row block)."""
    if split is None or not tiles:
        return None
    levels = list(tiles)
    ext = nest.extents
    outer = tiles[levels[-1]]
    inner = tiles[levels[-2]] if len(levels) > 1 else outer
    for n in parallel:
        if min(outer.get(n, ext[n]), ext[n]) > min(inner.get(n, ext[n]), ext[n]):
            return None
    loop, quantum = split
    return ext[loop], quantum


def _is_plain(ix: Affine) -> bool:
    return len(ix.terms) == 1 and ix.terms[0][1] == 1 and ix.offset == 0


def _expr(nest: Nest, op_index: int, loop: str, prefix_only: bool) -> Expr:
    """The interval of `loop` in op `op_index`'s block as a `footprint` expression.

    Block loops are tiled (all of them, or with `prefix_only` only the shared prefix: what one
    prefix iteration covers); a derived loop covers what its consumers read, where the consumers'
    own private loops run whole within the prefix iteration. (It depends on which loops the
    prefix holds, not their order: nests sharing that share the expression, built once.)
    """
    key = ("expr", op_index, loop, prefix_only)
    found: Expr | None = nest._static.get(key)
    if found is None:
        found = nest._static[key] = _build_expr(nest, op_index, loop, prefix_only)
    return found


def _build_expr(nest: Nest, op_index: int, loop: str, prefix_only: bool) -> Expr:
    kind = nest.ops[op_index].kind(loop)
    n = nest.extents[loop]
    if kind is LoopKind.DERIVED:
        uses = tuple(
            (ix.offset, tuple((c, _expr(nest, ci, cl, True)) for cl, c in ix.terms))
            for ci, ix in nest._derived[(op_index, loop)]
        )
        return ("d", n, uses)
    if prefix_only and kind is not LoopKind.PREFIX:
        return ("w", n)
    return ("t", loop, n)


def _dims(nest: Nest, op_index: int, acc: Access, prefix_only: bool) -> tuple[Dim, ...]:
    key = ("dims", op_index, acc, prefix_only)
    found: tuple[Dim, ...] | None = nest._static.get(key)
    if found is None:
        found = nest._static[key] = _build_dims(nest, op_index, acc, prefix_only)
    return found


def _build_dims(nest: Nest, op_index: int, acc: Access, prefix_only: bool) -> tuple[Dim, ...]:
    shape = nest.chain.tensor(acc.tensor).shape
    return tuple(
        (size, (ix.offset, tuple((c, _expr(nest, op_index, loop, prefix_only))
                                 for loop, c in ix.terms)))
        for ix, size in zip(acc.index, shape, strict=True)
    )  # fmt: skip


# A memoised quantity: (id, getter of the tiles it reads, dims, summed over all blocks or one)
_Recipe = tuple[int, Callable[[Mapping[str, int]], object], tuple[Dim, ...], bool]
# A block footprint: itemsize x constant, plain tiled dims (loop, cap), index of a recipe or -1
_Point = tuple[int, tuple[tuple[str, int], ...], int]


class _Shape:
    """The part of a nest's cost that depends on which loops its prefix holds, not their order.

    Per access: its influencing loops, and its region summed over the blocks split into a
    constant (a plain loop's tiles cover it once; a dim no block loop moves is whole) times
    `footprint` recipes; per op: its block footprints and its flops the same way. Recipes are
    interned in the memo by structure, so nests of a chain share their memoised values.
    """

    def __init__(self, nest: Nest) -> None:
        chain = nest.chain
        ext = nest.extents
        self.memo = nest.memo
        self.recipes: list[_Recipe] = []
        self.recipe_loops: list[tuple[str, ...]] = []
        self._index: dict[tuple[bool, tuple[Dim, ...]], int] = {}
        # per access: (op, tensor, itemsize, influencing loops, constant, recipe indices, the
        # loops of its plain dims)
        self.accesses: list[
            tuple[int, str, int, frozenset[str], int, tuple[int, ...], frozenset[str]]
        ] = []
        self.held: list[list[_Point]] = []
        self.flops: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []
        self.least_flops = 0  # no tiles execute fewer
        live = _live_intermediates(nest)
        for opn, op in zip(nest.ops, chain.ops, strict=True):
            held: list[_Point] = []
            for acc in (*op.reads, op.output):
                if acc.tensor in nest.intermediate:
                    continue
                t = chain.tensor(acc.tensor)
                dims = _dims(nest, opn.index, acc, prefix_only=False)
                const, recipes, plain = self._sums(dims)
                infl = nest._influencing(opn, acc)
                self.accesses.append(
                    (opn.index, t.name, t.dtype.itemsize, infl, const, recipes, plain)
                )
                held.append(self._point(t.dtype.itemsize, dims))
            for name in live[opn.index]:
                producer = chain.producer(name)
                assert producer is not None
                dims = _dims(nest, chain.ops.index(producer), producer.output, prefix_only=True)
                held.append(self._point(chain.tensor(name).dtype.itemsize, dims))
            self.held.append(held)
            per = 2 if isinstance(op, Contraction) else 1
            own = op.loops
            recompute = tuple(
                n for n in nest.prefix
                if n not in own and not any(n in nest._sources(opn.index, m) for m in own)
            )  # fmt: skip
            loops = tuple((ext[lp], (0, ((1, _expr(nest, opn.index, lp, True)),))) for lp in own)
            const, recipes, _ = self._sums(loops)
            self.flops.append((per * const, recompute, recipes))
            self.least_flops += per * const * math.prod(self._least(r) for r in recipes)

    def _least(self, recipe: int) -> int:
        """A lower bound of a loop's iteration counts summed over the blocks: a derived loop
        runs at least over the values its consumers read. 0 (no bound) for a group of loops."""
        dims = self.recipes[recipe][2]
        if len(dims) != 1:
            return 0
        values = distinct(dims[0][1][1][0][1])
        return 0 if values is None else len(values)

    def _recipe(self, dims: tuple[Dim, ...], grid: bool) -> int:
        if (grid, dims) not in self._index:
            rid = self.memo.setdefault(("recipe", grid, dims), len(self.memo))
            names = sorted(leaves(sub for _, (_, terms) in dims for _, sub in terms))
            self._index[(grid, dims)] = len(self.recipes)
            self.recipes.append((rid, operator.itemgetter(*names), dims, grid))
            self.recipe_loops.append(tuple(names))
        return self._index[(grid, dims)]

    def _sums(self, dims: tuple[Dim, ...]) -> tuple[int, tuple[int, ...], frozenset[str]]:
        """Split the sum over all blocks of the product of the dims' spans into independent
        factors: dims moved by disjoint sets of loops sum separately. (The split depends on the
        dims alone; nests sharing the memo share it.) Also the loops of the plain dims."""
        key = ("sums", dims)
        if key not in self.memo:
            self.memo[key] = _split_sums(dims)
        const, groups, plain = self.memo[key]
        return const, tuple(self._recipe(g, grid=True) for g in groups), plain

    def _point(self, itemsize: int, dims: tuple[Dim, ...]) -> _Point:
        key = ("point", dims)
        if key not in self.memo:
            self.memo[key] = _split_point(dims)
        const, simple, rest = self.memo[key]
        return itemsize * const, simple, self._recipe(rest, grid=False) if rest else -1


def _split_sums(
    dims: tuple[Dim, ...],
) -> tuple[int, tuple[tuple[Dim, ...], ...], frozenset[str]]:
    groups: list[tuple[set[str], list[Dim]]] = []
    for d in dims:
        src = set(dim_leaves(d))
        joined = [g for g in groups if g[0] & src]
        for g in joined:
            src |= g[0]
            groups.remove(g)
        groups.append((src, [x for g in joined for x in g[1]] + [d]))
    const = 1
    rest = []
    plain_loops = set()
    for src, group in groups:
        plain = plain_loop(group[0]) if len(group) == 1 else None
        if not src:  # no block loop moves it: one block, the whole range
            const *= point_span(group, {})
        elif plain is not None:
            const *= min(plain[1], group[0][0])  # a plain loop's tiles cover it once
            plain_loops.add(plain[0])
        else:
            rest.append(tuple(group))
    return const, tuple(rest), frozenset(plain_loops)


def _split_point(dims: tuple[Dim, ...]) -> tuple[int, tuple[tuple[str, int], ...], tuple[Dim, ...]]:
    """A block's footprint as constant dims, plain tiled dims (loop, cap) and the rest."""
    const = 1
    simple = []
    rest = []
    for d in dims:
        plain = plain_loop(d)
        if not dim_leaves(d):
            const *= point_span((d,), {})
        elif plain is not None:
            simple.append((plain[0], min(plain[1], d[0])))
        else:
            rest.append(d)
    return const, tuple(simple), tuple(rest)


def _moving(
    enclosing: tuple[str, ...], infl: frozenset[str]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The enclosing loops that move a region (`infl`), innermost first, each with the loops
    outside it that do not."""
    inward = enclosing[::-1]
    return tuple(
        (n, tuple(m for m in inward[i + 1 :] if m not in infl))
        for i, n in enumerate(inward)
        if n in infl
    )


class _Compiled:
    """`level_cost` of one nest with every tile-independent fact worked out once (`_Shape`,
    shared by the nests whose prefixes hold the same loops, plus the loops enclosing each op):
    an evaluation is plain-int arithmetic and one memo lookup per distinct recipe."""

    def __init__(self, nest: Nest) -> None:
        key = ("shape", frozenset(nest.prefix), nest.fused)
        if key not in nest.memo:
            nest.memo[key] = _Shape(nest)
        shape: _Shape = nest.memo[key]
        self.extents = nest.extents
        self.memo = nest.memo
        self.recipes = shape.recipes
        # per access, the loops enclosing its op that move its region, innermost first, each
        # with the loops outside it that do not move the region
        self.accesses = [
            (op, name, item, _moving(nest.ops[op].enclosing, infl),
             const, recipes, (nest.ops[op].enclosing, infl, plain) if recipes else None)
            for op, name, item, infl, const, recipes, plain in shape.accesses
        ]  # fmt: skip
        self.recipe_loops = shape.recipe_loops
        self.held = shape.held
        self.flops = shape.flops
        self.least_flops = shape.least_flops

    def __call__(self, tiles: Mapping[str, int]) -> LevelCost:
        full = {}  # tiles clamped to [1, extent]: equal blocks, equal memo keys
        trips = {}
        for n, e in self.extents.items():
            t = tiles.get(n, e)
            if t >= e:
                full[n], trips[n] = e, 1
            else:
                t = max(1, t)
                full[n], trips[n] = t, -(-e // t)
        memo = self.memo
        values = []
        for rid, get, dims, grid in self.recipes:
            key = (rid, get(full))
            found = memo.get(key)
            if found is None:
                found = memo[key] = grid_sum(dims, full) if grid else point_span(dims, full)
            values.append(found)
        moved = []
        for op_index, name, item, moving, const, recipes, repeat in self.accesses:
            # the region reloads on every trip of the loops at or outside the innermost loop
            # that moves it; the region sum already counts the moving loops' trips
            mult = const * item
            for n, outside in moving:
                if trips[n] > 1:
                    for m in outside:
                        mult *= trips[m]
                    break
            for r in recipes:
                mult *= values[r]
            if repeat is not None and mult:
                mult -= const * item * self._repeats(repeat, recipes, trips, full, values)
            moved.append((op_index, name, mult))
        used = 0
        for held in self.held:
            total = 0
            for size, simple, rest in held:
                for loop, cap in simple:
                    t = full[loop]
                    size *= t if t < cap else cap
                if rest >= 0:
                    size *= values[rest]
                total += size
            if total > used:
                used = total
        flops = []
        for const, recompute, recipes in self.flops:
            for n in recompute:
                const *= trips[n]
            for r in recipes:
                const *= values[r]
            flops.append(const)
        return LevelCost(tuple(moved), used, tuple(flops))

    def _repeats(
        self,
        repeat: tuple[tuple[str, ...], frozenset[str], frozenset[str]],
        recipes: tuple[int, ...],
        trips: Mapping[str, int],
        full: Mapping[str, int],
        values: list[Any],
    ) -> int:
        """Elements of the blocks (of an access with non-plain dims) whose region is the one the
        block before left in the buffer, so that nothing is reloaded: the sum above charges
        every block.

        The blocks run in lexicographic order of the enclosing loops; a step from one block to
        the next advances a *carry* loop and wraps every moving loop inside it. A step whose
        moving loops include a plain one always changes the region; otherwise the region is
        unchanged exactly when every non-plain group of dims is, and as the groups' loops are
        disjoint the sum over those steps is a product of per-group sums (`repeat_sum`).
        """
        enclosing, infl, plain = repeat
        last = -1  # the innermost moving loop: loops inside it never change the region
        first = 0  # a moving plain loop changes the region at every step up to its own carry
        for i, n in enumerate(enclosing):
            if n in infl and trips[n] > 1:
                last = i
                if n in plain:
                    first = i + 1
        if first > last:
            return 0
        memo = self.memo
        # every step moves some group (the innermost moving loop is in one); when no group
        # that moves can repeat its region at all, no step repeats
        for r in recipes:
            rid, get, dims, _ = self.recipes[r]
            if any(trips[n] > 1 for n in self.recipe_loops[r]):
                may_key = ("may repeat", rid, get(full))
                may = memo.get(may_key)
                if may is None:
                    may = memo[may_key] = may_repeat(dims, full)
                if may:
                    break
        else:
            return 0
        total = 0
        for j in range(first, last + 1):
            carry = enclosing[j]
            if trips[carry] == 1:
                continue
            wraps = {n for n in enclosing[j + 1 : last + 1] if trips[n] > 1}
            count = 1
            for n in enclosing[:j]:
                if n not in infl:
                    count *= trips[n]
            if carry not in infl:
                count *= trips[carry] - 1
            for r in recipes:
                loops = self.recipe_loops[r]
                step = tuple(1 if n == carry else 2 if n in wraps else 0 for n in loops)
                if any(step):
                    rid, get, dims, _ = self.recipes[r]
                    key = ("repeat", rid, get(full), step)
                    found = memo.get(key)
                    if found is None:
                        found = memo[key] = repeat_sum(
                            dims, full, dict(zip(loops, step, strict=True))
                        )
                    count *= found
                else:
                    count *= values[r]
                if not count:
                    break
            total += count
        return total


def level_cost(nest: Nest, tiles: Mapping[str, int]) -> LevelCost:
    """Bytes moved into a level whose tiles are `tiles`, bytes it must hold, flops executed.

    A loop missing from `tiles` is one whole tile.
    """
    return nest._compiled(tiles)


def least_flops(nest: Nest) -> int:
    """A lower bound of the flops `nest` executes whatever its tiles (recompute can only add)."""
    return nest._compiled.least_flops


def _live_intermediates(nest: Nest) -> list[list[str]]:
    """For each op, the intermediates alive while it runs (produced at or before, read at/after)."""
    chain = nest.chain
    out: list[list[str]] = [[] for _ in chain.ops]
    for name in nest.intermediate:
        producer = chain.producer(name)
        assert producer is not None
        first = chain.ops.index(producer)
        last = max(chain.ops.index(c) for c in chain.consumers(name))
        for i in range(first, last + 1):
            out[i].append(name)
    return out


def compulsory_bytes(chain: Chain) -> int:
    """Every output written once and every input element some output depends on read once: no
    schedule moves less.

    An output needs all of itself; an op's result is needed only where its consumers read it (a
    strided consumer skips rows), and an op needs its inputs only where its needed iterations
    read them: a fused producer never computes, nor reads the inputs of, rows nobody reads.
    (Each dim of an access is indexed by loops of its own, so the needed elements of a tensor
    are a product of per-dim sets.)
    """
    ext = chain.extents
    needed: dict[str, list[set[int]]] = {}  # per intermediate: the values of each dim read
    read: dict[str, int] = {}  # per input: the elements read
    for op in reversed(chain.ops):  # consumers before their producers
        values: dict[str, Iterable[int]] = {n: range(ext[n]) for n in op.loops}
        for ix, vals in zip(op.output.index, needed.get(op.output.tensor, ()), strict=False):
            values[ix.loops[0]] = vals  # an output dim is indexed by one loop
        for acc in op.reads:
            t = chain.tensor(acc.tensor)
            dims = [
                _index_values(ix, values, size) for ix, size in zip(acc.index, t.shape, strict=True)
            ]
            if t.role is Role.INTERMEDIATE:
                seen = needed.setdefault(acc.tensor, [set[int]() for _ in dims])
                for have, new in zip(seen, dims, strict=True):
                    have |= new
            else:
                read[acc.tensor] = max(read.get(acc.tensor, 0), math.prod(map(len, dims)))
    inputs = sum(n * chain.tensor(name).dtype.itemsize for name, n in read.items())
    return inputs + sum(t.nbytes for t in chain.outputs)


def _index_values(ix: Affine, values: Mapping[str, Iterable[int]], size: int) -> set[int]:
    """The values an index takes inside [0, size) when its loops take `values`."""
    sums = {ix.offset}
    for loop, c in ix.terms:
        sums = {s + c * v for s in sums for v in values[loop]}
    return {v for v in sums if 0 <= v < size}


#: An online softmax over l, in tiles of l, rescales the accumulators of the GEMM it feeds once
#: per tile (and that GEMM's micro-kernel calls run over one tile of l each, their accumulators
#: loaded and stored every time); the GEMM that makes its scores, when its k runs in tiles,
#: loads and stores the score tile once per tile of k before the softmax may start. Each costs
#: about this many of the GEMM's k steps per call. Measured on the attention workloads
#: (interleaved, 1 thread): one or two tiles of l instead of two to four, 1.1-4.8 % faster on
#: eight of the nine plans it changed (level on the ninth), which bytes and flops alone do not
#: see. (GEMM chains without a softmax show no such gain:
#: there fewer, longer calls lose to the bytes they move, so their GEMMs are not stretched.)
RESCALE_STEPS = 3.0


def code_level(hardware: Hardware) -> str:
    """The level whose tiles the generated loop nest uses: the largest per-core cache."""
    private = [lv.name for lv in hardware.levels[:-1] if not lv.shared]
    return private[-1] if private else hardware.levels[0].name


def rescaled(chain: Chain) -> dict[int, str]:
    """In a chain with an online softmax, its GEMMs (op index -> the loop each reduces: the
    scores' k, the softmax's l); no GEMM of a chain without one."""
    if not any(isinstance(op, Softmax) for op in chain.ops):
        return {}
    return {
        i: op.reduction[0]
        for i, op in enumerate(chain.ops)
        if isinstance(op, Contraction) and len(op.reduction) == 1
    }


def rescale_factors(
    chain: Chain, tiles: Mapping[str, int], fed: Mapping[int, str] | None = None
) -> tuple[float, ...]:
    """Per op of a fused nest: what its compute time is stretched by around an online softmax,
    `tiles` being the code level's (`code_level`): 1 + RESCALE_STEPS / (the tile of its
    reduction) for the GEMMs of a softmax chain (`rescaled`, or `fed` when the caller has it),
    1 for every other op; and, with a causal softmax, every op times the share of the scores
    its row blocks compute (`causal_share`)."""
    ext = chain.extents
    fed = rescaled(chain) if fed is None else fed
    share = computed_share(chain, tiles)
    return tuple(
        share
        * (
            1.0 + RESCALE_STEPS / min(tiles.get(fed[i], ext[fed[i]]), ext[fed[i]])
            if i in fed
            else 1.0
        )
        for i in range(len(chain.ops))
    )


def causal_softmax(chain: Chain) -> Softmax | None:
    """The chain's causal softmax (one with a row loop), if it has one."""
    return next(
        (op for op in chain.ops if isinstance(op, Softmax) and op.causal and op.row is not None),
        None,
    )


def computed_share(chain: Chain, tiles: Mapping[str, int]) -> float:
    """The share of a fused nest's flops its code computes with the code level's `tiles`: 1,
    or with a causal softmax `causal_share` of its rows' tile (tiles of 1: the scores kept)."""
    op = causal_softmax(chain)
    if op is None or op.row is None:
        return 1.0
    ext = chain.extents
    return causal_share(ext[op.row], ext[op.axis], tiles.get(op.row, ext[op.row]))


def moved_bytes(
    nest: Nest, cost: LevelCost, tiles: Mapping[str, int]
) -> tuple[tuple[int, str, int], ...]:
    """`cost.moved` of a level whose tiles are `tiles`, for a fused nest with a causal softmax
    as its code reads: a block of rows reads the tensors indexed by the keys (k, v, a mask)
    only up to its last row's key (`keys_share`), and the scores between the GEMMs only that
    far (`causal_share`). Other nests, and tensors without the keys' loop: as counted (the
    tile simulator counts every key)."""
    if not nest.fused:
        return cost.moved
    chain = nest.chain
    causal = causal_softmax(chain)
    if causal is None or causal.row is None:
        return cost.moved
    ext = chain.extents
    rows, keys = ext[causal.row], ext[causal.axis]
    tile = tiles.get(causal.row, rows)
    out = []
    indexed: dict[str, set[str]] = {}  # tensor -> the loops its accesses index it by
    for op in chain.ops:
        for acc in (*op.reads, op.output):
            indexed.setdefault(acc.tensor, set()).update(n for ix in acc.index for n in ix.loops)
    for i, name, b in cost.moved:
        loops = indexed.get(name, set())
        if causal.axis in loops:
            share = causal_share if causal.row in loops else keys_share
            b = round(b * share(rows, keys, tile))
        out.append((i, name, b))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def keys_share(rows: int, keys: int, tile: int) -> float:
    """The share of the keys a causal softmax's blocks of `tile` rows (of `rows`) read on
    average: each block's up to its last row's (top-left aligned)."""
    tile = max(1, min(tile, rows))
    blocks = range(0, rows, tile)
    return sum(min(keys, min(start + tile, rows)) for start in blocks) / (len(blocks) * keys)


@functools.lru_cache(maxsize=4096)
def causal_share(rows: int, keys: int, tile: int) -> float:
    """The share of a causal softmax's `rows` x `keys` scores (row i keeps keys 0..i, top-left
    aligned) that a fused kernel computes when it runs the rows in blocks of `tile`: a block
    computes every key up to its last row's (the rows before it mask some), and skips the rest.
    A tile of 1 gives the share kept: the least any tiles compute. Measured on Zen 3 (12 heads
    x 1024 x 64, 1 thread): row blocks of 352 (this share 0.67; the plan before the model knew
    it) took 1.33-1.38x the time of blocks of 16-64 (0.51-0.53)."""
    tile = max(1, min(tile, rows))
    computed = 0
    for start in range(0, rows, tile):
        block = min(tile, rows - start)
        computed += block * min(keys, start + block)
    return computed / (rows * keys)


def example_dv(M: int, N: int, K: int, L: int, T_M: int, T_L: int, itemsize: int = 4) -> float:
    """DESIGN.md's closed form for order m > l > {k | n}: `M L (K+N) (1/T_L + 1/T_M)` elements."""
    return M * L * (K + N) * (1 / T_L + 1 / T_M) * itemsize


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
    the next level in (`splits`).
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
    for inner, outer in itertools.pairwise(levels):
        if inner.name not in tiles:
            continue
        cost = level_cost(nest, tiles[inner.name])
        op_flops = cost.op_flops
        bw = outer.aggregate_bandwidth(workers) if outer.shared else outer.bandwidth * workers
        per_op = [0] * n_ops
        for i, _, b in moved_bytes(nest, cost, tiles[inner.name]):
            per_op[i] += b
        total = sum(per_op)
        moved.append((outer.name, total))
        used.append((inner.name, cost.used))
        mem.append((outer.name, total / bw * imbalance))
        for i in range(n_ops):
            op_time[i].append(per_op[i] / bw * imbalance)
    if not op_flops:
        op_flops = level_cost(nest, {}).op_flops
    # (an online softmax only where it is fused: unfused, the softmax runs over whole rows,
    # and a causal one computes every score)
    code_tiles = tiles.get(code_level(hardware), {})
    factors = rescale_factors(nest.chain, code_tiles) if nest.fused else (1.0,) * n_ops
    for i, f in enumerate(op_flops):
        op_time[i][0] = f / peak * imbalance * factors[i]
    compute = sum(parts[0] for parts in op_time)
    if nest.fused:
        time = max([compute, *(t for _, t in mem)])
    else:
        time = sum(max(parts) for parts in op_time)
    executed = sum(op_flops)
    if nest.fused:
        executed = round(executed * computed_share(nest.chain, code_tiles))
    return Cost(tuple(moved), tuple(used), executed, compute, tuple(mem), imbalance, time)
