"""The byte evaluator: what a nest moves into a level, holds there and computes, for given tiles.

The data moved into a level by access X of op p: walk the loops enclosing p's block from the inside
out; l* is the innermost one that changes X's tile. X is reloaded on every iteration of l* and of
every loop outside it, and reused across the loops inside l* (docs/design.md)::

    DM(X) = sum over the iterations of the loops indexing X of |X tile|
            * prod over non-indexing loops at or outside l* of ceil(N / T)

A nest is compiled once (`_Shape`, `Evaluator`): each access' regions become `chainfuse.footprint`
expressions, and an evaluation is integer arithmetic plus memo lookups by the tiles they read.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

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
from chainfuse.ir import Access, Affine, Chain, Contraction, Role
from chainfuse.model.nest import LoopKind, Nest
from chainfuse.model.softmax import causal_share, causal_softmax, keys_share

__all__ = [
    "AccessCharge",
    "AccessSum",
    "Evaluator",
    "LevelCost",
    "Point",
    "Recipe",
    "compulsory_bytes",
    "deal",
    "evaluator",
    "example_dv",
    "least_flops",
    "level_cost",
    "moved_bytes",
    "splits",
]


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


def _expr(nest: Nest, op_index: int, loop: str, prefix_only: bool) -> Expr:
    """The interval of `loop` in op `op_index`'s block as a `footprint` expression.

    Block loops are tiled (all of them, or with `prefix_only` only the shared prefix: what one
    prefix iteration covers); a derived loop covers what its consumers read, where the consumers'
    own private loops run whole within the prefix iteration. (It depends on which loops the
    prefix holds, not their order: nests sharing that share the expression, built once.)
    """
    key = ("expr", op_index, loop, prefix_only)
    found: Expr | None = nest.static.get(key)
    if found is None:
        found = nest.static[key] = _build_expr(nest, op_index, loop, prefix_only)
    return found


def _build_expr(nest: Nest, op_index: int, loop: str, prefix_only: bool) -> Expr:
    kind = nest.ops[op_index].kind(loop)
    n = nest.extents[loop]
    if kind is LoopKind.DERIVED:
        uses = tuple(
            (ix.offset, tuple((c, _expr(nest, ci, cl, True)) for cl, c in ix.terms))
            for ci, ix in nest.derived[(op_index, loop)]
        )
        return ("d", n, uses)
    if prefix_only and kind is not LoopKind.PREFIX:
        return ("w", n)
    return ("t", loop, n)


def _dims(nest: Nest, op_index: int, acc: Access, prefix_only: bool) -> tuple[Dim, ...]:
    key = ("dims", op_index, acc, prefix_only)
    found: tuple[Dim, ...] | None = nest.static.get(key)
    if found is None:
        found = nest.static[key] = _build_dims(nest, op_index, acc, prefix_only)
    return found


def _build_dims(nest: Nest, op_index: int, acc: Access, prefix_only: bool) -> tuple[Dim, ...]:
    shape = nest.chain.tensor(acc.tensor).shape
    return tuple(
        (size, (ix.offset, tuple((c, _expr(nest, op_index, loop, prefix_only))
                                 for loop, c in ix.terms)))
        for ix, size in zip(acc.index, shape, strict=True)
    )  # fmt: skip


class Recipe(NamedTuple):
    """A memoised quantity: a sum of spans over all blocks (`grid`) or one block's span."""

    rid: int  # its id in the memo, shared by nests with the same structure
    get: Callable[[Mapping[str, int]], object]  # the tiles it reads, as the memo key
    dims: tuple[Dim, ...]
    grid: bool


class Point(NamedTuple):
    """A block footprint: `size` times the plain tiled dims times a recipe's value."""

    size: int  # itemsize x the constant dims
    simple: tuple[tuple[str, int], ...]  # plain tiled dims: (loop, cap)
    recipe: int  # index of the recipe of the other dims, or -1


class AccessSum(NamedTuple):
    """An access's region summed over the blocks, split into a constant times recipes."""

    op: int
    tensor: str
    itemsize: int
    influencing: frozenset[str]  # the block loops that move its region
    const: int
    recipes: tuple[int, ...]
    plain: frozenset[str]  # the loops of its plain dims


class AccessCharge(NamedTuple):
    """An `AccessSum` placed in one nest: what an evaluation multiplies out."""

    op: int
    tensor: str
    itemsize: int
    moving: tuple[tuple[str, tuple[str, ...]], ...]  # see `_moving`
    const: int
    recipes: tuple[int, ...]
    repeat: tuple[tuple[str, ...], frozenset[str], frozenset[str]] | None  # `_repeats`' facts


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
        self.recipes: list[Recipe] = []
        self.recipe_loops: list[tuple[str, ...]] = []
        self._index: dict[tuple[bool, tuple[Dim, ...]], int] = {}
        self.accesses: list[AccessSum] = []
        self.held: list[list[Point]] = []
        self.flops: list[tuple[int, tuple[str, ...], tuple[int, ...]]] = []
        self.least_flops = 0  # no tiles execute fewer
        live = _live_intermediates(nest)
        for opn, op in zip(nest.ops, chain.ops, strict=True):
            held: list[Point] = []
            for acc in (*op.reads, op.output):
                if acc.tensor in nest.intermediate:
                    continue
                t = chain.tensor(acc.tensor)
                dims = _dims(nest, opn.index, acc, prefix_only=False)
                const, recipes, plain = self._sums(dims)
                infl = nest.influencing(opn, acc)
                self.accesses.append(
                    AccessSum(opn.index, t.name, t.dtype.itemsize, infl, const, recipes, plain)
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
                if n not in own and not any(n in nest.sources(opn.index, m) for m in own)
            )  # fmt: skip
            loops = tuple((ext[lp], (0, ((1, _expr(nest, opn.index, lp, True)),))) for lp in own)
            const, recipes, _ = self._sums(loops)
            self.flops.append((per * const, recompute, recipes))
            self.least_flops += per * const * math.prod(self._least(r) for r in recipes)

    def _least(self, recipe: int) -> int:
        """A lower bound of a loop's iteration counts summed over the blocks: a derived loop
        runs at least over the values its consumers read. 0 (no bound) for a group of loops."""
        dims = self.recipes[recipe].dims
        if len(dims) != 1:
            return 0
        values = distinct(dims[0][1][1][0][1])
        return 0 if values is None else len(values)

    def _recipe(self, dims: tuple[Dim, ...], grid: bool) -> int:
        if (grid, dims) not in self._index:
            rid = self.memo.setdefault(("recipe", grid, dims), len(self.memo))
            names = sorted(leaves(sub for _, (_, terms) in dims for _, sub in terms))
            self._index[(grid, dims)] = len(self.recipes)
            self.recipes.append(Recipe(rid, operator.itemgetter(*names), dims, grid))
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

    def _point(self, itemsize: int, dims: tuple[Dim, ...]) -> Point:
        key = ("point", dims)
        if key not in self.memo:
            self.memo[key] = _split_point(dims)
        const, simple, rest = self.memo[key]
        return Point(itemsize * const, simple, self._recipe(rest, grid=False) if rest else -1)


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


class Evaluator:
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
            AccessCharge(op, name, item, _moving(nest.ops[op].enclosing, infl),
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


def evaluator(nest: Nest) -> Evaluator:
    """The nest's `Evaluator`, built once per memo (its order, depth and fusion decide it)."""
    key = ("evaluator", nest.order, nest.depth, nest.fused)
    found: Evaluator | None = nest.memo.get(key)
    if found is None:
        found = nest.memo[key] = Evaluator(nest)
    return found


def level_cost(nest: Nest, tiles: Mapping[str, int]) -> LevelCost:
    """Bytes moved into a level whose tiles are `tiles`, bytes it must hold, flops executed.

    A loop missing from `tiles` is one whole tile.
    """
    return evaluator(nest)(tiles)


def least_flops(nest: Nest) -> int:
    """A lower bound of the flops `nest` executes whatever its tiles (recompute can only add)."""
    return evaluator(nest).least_flops


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


def example_dv(M: int, N: int, K: int, L: int, T_M: int, T_L: int, itemsize: int = 4) -> float:
    """The closed form (docs/design.md) for order m > l > {k | n}: `M L (K+N) (1/T_L + 1/T_M)` elements."""
    return M * L * (K + N) * (1 / T_L + 1 / T_M) * itemsize


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
