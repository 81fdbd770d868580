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

A producer's output loop that is not in the prefix is *derived*: the producer computes exactly the
region its consumer reads during one prefix iteration (a 3x3 consumer needs a halo, so the
producer recomputes the overlap; a loop of the consumer that is in the prefix but not in the
producer makes the producer recompute its whole tile each iteration). Intermediates move nothing
but occupy memory for the whole prefix iteration.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from chainfuse.ir import Access, Affine, Chain, Contraction, Op, Role

if TYPE_CHECKING:
    from chainfuse.hardware import Hardware

__all__ = [
    "Cost",
    "LevelCost",
    "LoopKind",
    "Nest",
    "compulsory_bytes",
    "estimate",
    "example_dv",
    "level_cost",
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
        memo: dict[tuple[object, ...], int] | None = None,
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
        reason = self._illegal()
        if reason:
            raise ValueError(f"order {self.order} depth {depth}: {reason}")
        self.ops = tuple(self._op_nest(i, op) for i, op in enumerate(chain.ops))
        # for each derived (op, loop): the consumers' indices of that output dim
        self._derived: dict[tuple[int, str], tuple[tuple[int, Affine], ...]] = {}
        for i, op in enumerate(chain.ops):
            for d, ix in enumerate(op.output.index):
                if self.ops[i].kind_or_none(ix.loops[0]) is not LoopKind.DERIVED:
                    continue
                self._derived[(i, ix.loops[0])] = tuple(
                    (chain.ops.index(c), _access_of(c, op.output.tensor).index[d])
                    for c in chain.consumers(op.output.tensor)
                )
        # sums over tile iterations, by the tiles they depend on; they depend on the prefix only as
        # a set, so nests whose prefixes hold the same loops may share one (`memo`)
        self.memo: dict[tuple[object, ...], int] = {} if memo is None else memo
        self._static: dict[tuple[object, ...], Any] = {}  # tile-independent facts, computed once
        self.plain = all(
            _is_plain(ix) or not ix.terms
            for op in chain.ops
            for acc in op.reads
            for ix in acc.index
        )

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

    def _op_nest(self, index: int, op: Op) -> OpNest:
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
        private = tuple(n for n in self.order[self.depth :] if kinds.get(n) is LoopKind.PRIVATE)
        return OpNest(index, self.prefix + private, kinds)

    @cached_property
    def _fast(self) -> _FastCost | None:
        return _FastCost(self) if self.plain else None

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

    # -- intervals ------------------------------------------------------------------------------
    def interval(
        self, op_index: int, loop: str, tiles: Mapping[str, int], at: Mapping[str, int]
    ) -> tuple[int, int]:
        """Inclusive range of `loop` in op `op_index`'s block when block loops sit at tile `at`.

        A block loop missing from `at` covers its whole extent (what one prefix iteration
        covers for a consumer's private loop).
        """
        n = self.extents[loop]
        kind = self.ops[op_index].kind(loop)
        if kind is not LoopKind.DERIVED:
            if loop not in at:
                return 0, n - 1
            t = min(tiles.get(loop, n), n)
            return at[loop] * t, _min(n, (at[loop] + 1) * t) - 1
        # the consumer's private loops run whole within one prefix iteration
        shared = {k: v for k, v in at.items() if k in self.prefix}
        lo, hi = n, -1
        for ci, ix in self._derived[(op_index, loop)]:
            clo, chi = _bounds_at(self, ci, ix, tiles, shared)
            lo = _min(lo, _max(clo, 0))
            hi = _max(hi, _min(chi, n - 1))
        return lo, hi

    def relevant(self, op_index: int, loops: Iterable[str]) -> tuple[str, ...]:
        """The loops whose tiles decide the intervals of `loops` in op `op_index` (sorted)."""
        names = tuple(sorted(loops))
        key = ("rel", op_index, names)
        if key not in self._static:
            out: set[str] = set(names)
            for loop in names:
                for ci, ix in self._derived.get((op_index, loop), ()):
                    out.update(self.relevant(ci, ix.loops))
            self._static[key] = tuple(sorted(out))
        found: tuple[str, ...] = self._static[key]
        return found


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


def _moves(nest: Nest, loop: str, tiles: Mapping[str, int]) -> bool:
    """A loop with a single tile never changes any region: it neither reloads nor recomputes."""
    return _trips(nest.extents[loop], tiles.get(loop, nest.extents[loop])) > 1


def _trips(n: int, t: int) -> int:
    return -(-n // max(1, min(t, n)))


def _min(a: Any, b: Any) -> Any:
    """Elementwise minimum: numpy's for the arrays of a tile enumeration, the builtin (much
    cheaper) for plain integers."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.minimum(a, b)
    return a if a < b else b


def _max(a: Any, b: Any) -> Any:
    """Elementwise maximum, as `_min`."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a > b else b


def _span(lo: Any, hi: Any, size: int) -> Any:
    """Elements of [lo, hi] inside [0, size); works on numbers and on arrays of them."""
    return _max(0, _min(hi, size - 1) - _max(lo, 0) + 1)


def _is_plain(ix: Affine) -> bool:
    return len(ix.terms) == 1 and ix.terms[0][1] == 1 and ix.offset == 0


def _region_sum(
    nest: Nest, op_index: int, acc: Access, tiles: Mapping[str, int], loops: Iterable[str]
) -> int:
    """Sum over the tile iterations of `loops` of the number of elements of `acc` touched."""
    chain = nest.chain
    shape = chain.tensor(acc.tensor).shape
    loops = tuple(loops)
    # group dims by the block loops that move them; sum each group separately (they factorize)
    groups: list[tuple[set[str], list[int]]] = []
    for d, ix in enumerate(acc.index):
        src: set[str] = set()
        for loop in ix.loops:
            src |= nest._sources(op_index, loop) & set(loops)
        for g in groups:
            if g[0] & src:
                g[0].update(src)
                g[1].append(d)
                break
        else:
            groups.append((src, [d]))
    total = 1
    for src, dims in groups:
        if not src:
            total *= math.prod(
                _span(*_bounds_at(nest, op_index, acc.index[d], tiles, {}), shape[d]) for d in dims
            )
            continue
        if len(dims) == 1 and _is_plain(acc.index[dims[0]]) and len(src) == 1:
            total *= shape[dims[0]]  # the tiles of one plain loop cover it exactly once
            continue
        names = sorted(src)
        rel = nest.relevant(op_index, {n for d in dims for n in acc.index[d].loops} | src)
        key = ("sum", op_index, acc.tensor, tuple(dims), tuple(names),
               tuple(tiles.get(n, 0) for n in rel))  # fmt: skip
        if key not in nest.memo:
            at = _tile_grid(nest, names, tiles)
            spans = [_span(*_bounds_at(nest, op_index, acc.index[d], tiles, at), shape[d])
                     for d in dims]  # fmt: skip
            nest.memo[key] = int(np.sum(math.prod(spans)))
        total *= nest.memo[key]
    return total


def _footprint(
    nest: Nest, op_index: int, acc: Access, tiles: Mapping[str, int], whole_prefix: bool
) -> int:
    """Elements of `acc` one block touches (a full, non-edge tile); with `whole_prefix`, what one
    prefix iteration touches (an intermediate must hold that)."""
    opn = nest.ops[op_index]
    rel = nest.relevant(op_index, acc.loops)
    key = ("foot", op_index, acc.tensor, whole_prefix, tuple(tiles.get(n, 0) for n in rel))
    if key not in nest.memo:
        at = {n: 0 for n in opn.enclosing if not (whole_prefix and n not in nest.prefix)}
        shape = nest.chain.tensor(acc.tensor).shape
        total = 1
        for d, ix in enumerate(acc.index):
            total *= _span(*_bounds_at(nest, op_index, ix, tiles, at), shape[d])
        nest.memo[key] = total
    return nest.memo[key]


def _bounds_at(
    nest: Nest, op_index: int, ix: Affine, tiles: Mapping[str, int], at: Mapping[str, int]
) -> tuple[int, int]:
    lo: Any = ix.offset
    hi: Any = ix.offset
    for loop, c in ix.terms:
        a, b = nest.interval(op_index, loop, tiles, at)
        lo = lo + (c * a if c > 0 else c * b)
        hi = hi + (c * b if c > 0 else c * a)
    return lo, hi


class _FastCost:
    """`level_cost` for chains whose every index is one loop or a constant (GEMMs, attention).

    Then each access' region sum is its element count and each footprint a product of tiles,
    so everything that does not depend on the tiles is worked out once per nest.
    """

    def __init__(self, nest: Nest) -> None:
        chain = nest.chain
        ext = nest.extents
        self.extents = ext
        # per access: (op, tensor, itemsize, elements, enclosing, influencing, footprint dims)
        self.accesses: list[tuple[int, str, int, int, tuple[str, ...], frozenset[str],
                                  tuple[tuple[str | None, int], ...]]] = []  # fmt: skip
        self.held: list[list[tuple[int, tuple[tuple[str | None, int], ...]]]] = []
        self.flops: list[tuple[int, tuple[str, ...]]] = []
        live = _live_intermediates(nest)
        for opn, op in zip(nest.ops, chain.ops, strict=True):
            held: list[tuple[int, tuple[tuple[str | None, int], ...]]] = []
            for acc in (*op.reads, op.output):
                if acc.tensor in nest.intermediate:
                    continue
                t = chain.tensor(acc.tensor)
                dims = tuple(
                    (None, 1) if not ix.terms else _fast_dim(opn, ix.loops[0], ext)
                    for ix in acc.index
                )
                elems = math.prod(
                    size for ix, size in zip(acc.index, t.shape, strict=True) if ix.terms
                )
                infl = frozenset(nest._influencing(opn, acc))
                self.accesses.append((opn.index, t.name, t.dtype.itemsize, elems, opn.enclosing,
                                      infl, dims))  # fmt: skip
                held.append((t.dtype.itemsize, dims))
            for name in live[opn.index]:
                t = chain.tensor(name)
                producer = chain.producer(name)
                assert producer is not None
                dims = tuple(
                    (ix.loops[0], ext[ix.loops[0]]) if ix.loops[0] in nest.prefix
                    else (None, ext[ix.loops[0]])
                    for ix in producer.output.index
                )  # fmt: skip
                held.append((t.dtype.itemsize, dims))
            self.held.append(held)
            per = 2 if isinstance(op, Contraction) else 1
            recompute = tuple(n for n in nest.prefix if n not in op.loops)
            self.flops.append((per * math.prod(ext[n] for n in op.loops), recompute))

    def __call__(self, tiles: Mapping[str, int]) -> LevelCost:
        trips = {}
        for n, e in self.extents.items():
            t = tiles.get(n, e)
            trips[n] = 1 if t >= e else -(-e // max(1, t))
        moved = []
        for op_index, name, item, elems, enclosing, infl, _ in self.accesses:
            star = -1
            for i, n in enumerate(enclosing):
                if trips[n] > 1 and n in infl:
                    star = i
            mult = elems * item
            for n in enclosing[: star + 1]:
                if n not in infl:
                    mult *= trips[n]
            moved.append((op_index, name, mult))
        used = 0
        for held in self.held:
            total = 0
            for itemsize, dims in held:
                size = itemsize
                for dim_loop, extent in dims:
                    if dim_loop is None:
                        size *= extent
                    else:
                        t = tiles.get(dim_loop, extent)
                        size *= t if t < extent else extent
                total += size
            if total > used:
                used = total
        flops = tuple(f * math.prod([trips[n] for n in rec]) for f, rec in self.flops)
        return LevelCost(tuple(moved), used, flops)


def _fast_dim(opn: OpNest, loop: str, ext: Mapping[str, int]) -> tuple[str | None, int]:
    """A plain dim's block extent: its loop's tile, or the whole extent for a derived loop."""
    if opn.kind(loop) is LoopKind.DERIVED:
        return None, ext[loop]
    return loop, ext[loop]


def level_cost(nest: Nest, tiles: Mapping[str, int]) -> LevelCost:
    """Bytes moved into a level whose tiles are `tiles`, bytes it must hold, flops executed."""
    if nest._fast is not None:
        return nest._fast(tiles)
    chain = nest.chain
    moved: list[tuple[int, str, int]] = []
    used = 0
    flops: list[int] = []
    live = _live_intermediates(nest)
    for opn, op in zip(nest.ops, chain.ops, strict=True):
        held = 0
        for acc in (*op.reads, op.output):
            item = chain.tensor(acc.tensor).dtype.itemsize
            if acc.tensor in nest.intermediate:
                continue
            held += int(_footprint(nest, opn.index, acc, tiles, whole_prefix=False)) * item
            infl = {n for n in nest._influencing(opn, acc) if _moves(nest, n, tiles)}
            star = max((i for i, n in enumerate(opn.enclosing) if n in infl), default=-1)
            mult = 1
            for n in opn.enclosing[: star + 1]:
                if n not in infl:
                    mult *= _trips(nest.extents[n], tiles.get(n, nest.extents[n]))
            region = _region_sum(nest, opn.index, acc, tiles, opn.enclosing[: star + 1])
            moved.append((opn.index, acc.tensor, int(region * mult * item)))
        for name in live[opn.index]:
            producer = chain.producer(name)
            assert producer is not None
            pi = chain.ops.index(producer)
            item = chain.tensor(name).dtype.itemsize
            held += int(_footprint(nest, pi, producer.output, tiles, whole_prefix=True)) * item
        used = max(used, held)
        flops.append(int(_op_flops(nest, opn, op, tiles)))
    return LevelCost(tuple(moved), used, tuple(flops))


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


def _op_flops(nest: Nest, opn: OpNest, op: Op, tiles: Mapping[str, int]) -> int:
    per = 2 if isinstance(op, Contraction) else 1
    own = {n for n in op.loops}
    recompute = 1
    for n in nest.prefix:
        if n not in own and not any(n in nest._sources(opn.index, m) for m in own):
            recompute *= _trips(nest.extents[n], tiles.get(n, nest.extents[n]))
    # the op's iteration space summed over the prefix tiles that size its derived loops
    groups: list[tuple[set[str], list[str]]] = []
    for loop in op.loops:
        src = set(nest._sources(opn.index, loop) & set(nest.prefix))
        for g in groups:
            if g[0] & src:
                g[0].update(src)
                g[1].append(loop)
                break
        else:
            groups.append((src, [loop]))
    total = 1
    for src, loops in groups:
        if len(loops) == 1 and opn.kind(loops[0]) is not LoopKind.DERIVED:
            total *= nest.extents[loops[0]]
            continue
        names = sorted(src)
        rel = nest.relevant(opn.index, loops)
        key = ("flops", opn.index, tuple(loops), tuple(tiles.get(n, 0) for n in rel))
        if key not in nest.memo:
            at = _tile_grid(nest, names, tiles)
            lengths = [_len(nest.interval(opn.index, lp, tiles, at)) for lp in loops]
            nest.memo[key] = int(np.sum(math.prod(lengths)))
        total *= nest.memo[key]
    return per * total * recompute


def _tile_grid(nest: Nest, names: Sequence[str], tiles: Mapping[str, int]) -> dict[str, Any]:
    """Every combination of the tile indices of `names`, as arrays (one entry per block)."""
    if not names:
        return {}
    trips = [_trips(nest.extents[n], tiles.get(n, nest.extents[n])) for n in names]
    grid = np.indices(trips).reshape(len(names), -1)
    return dict(zip(names, grid, strict=True))


def _len(iv: tuple[Any, Any]) -> Any:
    return _max(0, iv[1] - iv[0] + 1)


def compulsory_bytes(chain: Chain) -> int:
    """Every input read once and every output written once: no schedule moves less."""
    total = 0
    for t in chain.tensors:
        if t.role is Role.INTERMEDIATE:
            continue
        if t.role is Role.OUTPUT:
            total += t.nbytes
            continue
        # only the elements some op reads (a strided conv may skip rows of its input)
        total += t.nbytes if _reads_all(chain, t.name) else _read_elements(chain, t.name)
    return total


def _reads_all(chain: Chain, name: str) -> bool:
    return all(
        all(_is_plain(ix) or not ix.terms for ix in _access_of(op, name).index)
        for op in chain.consumers(name)
    )


def _read_elements(chain: Chain, name: str) -> int:
    t = chain.tensor(name)
    ext = chain.extents
    touched = 1
    acc = _access_of(chain.consumers(name)[0], name)
    for d, ix in enumerate(acc.index):
        values: set[int] = set()
        ranges = [range(ext[n]) for n in ix.loops]
        for combo in itertools.product(*ranges):
            v = ix.offset + sum(c * x for (_, c), x in zip(ix.terms, combo, strict=True))
            if 0 <= v < t.shape[d]:
                values.add(v)
        touched *= len(values)
    return touched * t.dtype.itemsize


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
) -> Cost:
    """Predicted time of running `nest` with per-level `tiles` on `hardware`.

    `tiles[level]` are the tiles of the blocks held in `level`; the bytes read *from* the next
    level out are those `level_cost` gives for them, so `tiles["L2"]` decides the traffic between
    L3 and L2, which is charged at L3's bandwidth. A fused nest overlaps everything:
    `max(compute, max over levels of bytes / bandwidth)`; unfused ops run one after another, so
    their times add up. The parallel loops' blocks are dealt to the cores (`threads`, default
    all), and the imbalance of that deal stretches every term.
    """
    cores = threads or hardware.cores
    outer_tiles = tiles[list(tiles)[-1]] if tiles else {}
    units = math.prod(
        _trips(nest.extents[n], outer_tiles.get(n, nest.extents[n])) for n in parallel
    )
    workers = max(1, min(cores, units))
    imbalance = -(-units // workers) * workers / units
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
        moved.append((outer.name, cost.total))
        used.append((inner.name, cost.used))
        mem.append((outer.name, cost.total / bw * imbalance))
        per_op = [0] * n_ops
        for i, _, b in cost.moved:
            per_op[i] += b
        for i in range(n_ops):
            op_time[i].append(per_op[i] / bw * imbalance)
    if not op_flops:
        op_flops = tuple(
            _op_flops(nest, o, op, {}) for o, op in zip(nest.ops, nest.chain.ops, strict=True)
        )
    for i, f in enumerate(op_flops):
        op_time[i][0] = f / peak * imbalance
    compute = sum(parts[0] for parts in op_time)
    if nest.fused:
        time = max([compute, *(t for _, t in mem)])
    else:
        time = sum(max(parts) for parts in op_time)
    return Cost(tuple(moved), tuple(used), sum(op_flops), compute, tuple(mem), imbalance, time)
