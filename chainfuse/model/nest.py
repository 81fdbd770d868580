"""A chain's block loop nest: a block order, a compute-at depth, and whether the order is legal.

`order[:depth]` is the *prefix* every op of the fused chain shares; each op then runs its own
(*private*) loops in `order`'s order; a producer's output loop outside the prefix is *derived*
from what its consumer reads (docs/design.md)::

    order m l k n, depth 2:      for m_o: for l_o:
                                      for k_o: C_t += A[m_o,k_o] B[k_o,l_o]
                                      for n_o: E[m_o,n_o] += C_t D[l_o,n_o]
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from functools import cached_property
from typing import Any, NamedTuple

from chainfuse.ir import Access, Affine, Chain, Op

__all__ = ["Layout", "LoopKind", "Nest", "OpNest", "access_of", "is_plain"]


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


class Layout(NamedTuple):
    """What a nest's legality and loop kinds depend on: the set of loops in its prefix."""

    reason: str | None  # why the prefix is illegal, or None
    kinds: list[dict[str, LoopKind]]  # per op: how each of its loops runs
    plain: bool  # every read index is one loop with stride 1 (or a constant)
    # (op, derived loop) -> (consumer op, its index of that output dim) pairs
    derived: dict[tuple[int, str], tuple[tuple[int, Affine], ...]]
    static: dict[tuple[object, ...], Any]  # tile-independent facts, computed on demand


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
        layout: Layout = self.memo[key]
        if layout.reason:
            raise ValueError(f"order {self.order} depth {depth}: {layout.reason}")
        kinds = layout.kinds
        self.plain = layout.plain
        self.derived = layout.derived  # (op, derived loop) -> (consumer op, its index) pairs
        self.static = layout.static  # tile-independent facts shared by nests of this prefix set
        self.ops = tuple(
            OpNest(i, self.prefix + tuple(n for n in self.order[depth:]
                                          if k.get(n) is LoopKind.PRIVATE), k)
            for i, k in enumerate(kinds)
        )  # fmt: skip

    def _layout(self) -> Layout:
        """Legality, each op's loop kinds, the derived loops' consumer indices: all depend on
        which loops the prefix holds, not on their order."""
        chain = self.chain
        reason = self._illegal()
        if reason:
            return Layout(reason, [], False, {}, {})
        kinds = [self._kinds(op) for op in chain.ops]
        # for each derived (op, loop): the consumers' indices of that output dim
        derived: dict[tuple[int, str], tuple[tuple[int, Affine], ...]] = {}
        for i, op in enumerate(chain.ops):
            for d, ix in enumerate(op.output.index):
                if kinds[i].get(ix.loops[0]) is not LoopKind.DERIVED:
                    continue
                derived[(i, ix.loops[0])] = tuple(
                    (chain.ops.index(c), access_of(c, op.output.tensor).index[d])
                    for c in chain.consumers(op.output.tensor)
                )
        plain = all(
            is_plain(ix) or not ix.terms for op in chain.ops for acc in op.reads for ix in acc.index
        )
        return Layout(None, kinds, plain, derived, {})

    def _illegal(self) -> str | None:
        """Why this prefix cannot be shared by all ops, or None."""
        for op in self.chain.ops:
            if op.output.tensor not in self.intermediate:
                continue
            for loop in op.reduction:
                if loop in self.prefix:
                    return f"{loop!r} reduces {op.output.tensor!r}, which a later op consumes"
            for consumer in self.chain.consumers(op.output.tensor):
                acc = access_of(consumer, op.output.tensor)
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
                infl = self.influencing(opn, acc)
                star = max((i for i, n in enumerate(opn.enclosing) if n in infl), default=-1)
                outside = frozenset(n for n in opn.enclosing[: star + 1] if n not in infl)
                sig.append((opn.index, acc.tensor, outside))
            sig.append(frozenset(n for n in self.prefix if n not in op.loops))
        return (tuple(sig), frozenset(self.prefix), self.parallel_candidates)

    def influencing(self, opn: OpNest, acc: Access) -> frozenset[str]:
        """Block loops whose iteration changes the region of `acc` touched by op `opn`."""
        key = ("infl", opn.index, acc.tensor)
        if key not in self.static:
            out: set[str] = set()
            for ix in acc.index:
                for loop in ix.loops:
                    out |= self.sources(opn.index, loop)
            self.static[key] = frozenset(out)
        found: frozenset[str] = self.static[key]
        return found

    def sources(self, op_index: int, loop: str) -> frozenset[str]:
        """The prefix loops that move `loop` of op `op_index` (itself unless it is derived)."""
        key = ("src", op_index, loop)
        if key not in self.static:
            self.static[key] = self._find_sources(op_index, loop)
        found: frozenset[str] = self.static[key]
        return found

    def _find_sources(self, op_index: int, loop: str) -> frozenset[str]:
        if (op_index, loop) not in self.derived:
            return frozenset((loop,))
        out: set[str] = set()
        for ci, ix in self.derived[(op_index, loop)]:
            for cl in ix.loops:
                ckind = self.ops[ci].kind(cl)
                if ckind is LoopKind.PREFIX:
                    out.add(cl)
                elif ckind is LoopKind.DERIVED:
                    out |= self.sources(ci, cl)
        return frozenset(out)


def access_of(op: Op, tensor: str) -> Access:
    """The access by which `op` reads `tensor`."""
    for acc in op.reads:
        if acc.tensor == tensor:
            return acc
    raise KeyError(tensor)


def is_plain(ix: Affine) -> bool:
    """An index that is one loop with stride 1 and no offset."""
    return len(ix.terms) == 1 and ix.terms[0][1] == 1 and ix.offset == 0
