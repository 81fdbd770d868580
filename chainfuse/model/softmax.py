"""The terms an online or causal softmax adds to the model: GEMMs stretched by the rescale, and
the share of the scores a causal kernel computes with its row blocks."""

from __future__ import annotations

import functools
from collections.abc import Mapping

from chainfuse.ir import Chain, Contraction, Softmax

__all__ = [
    "RESCALE_STEPS",
    "causal_share",
    "causal_softmax",
    "computed_share",
    "keys_share",
    "rescale_factors",
    "rescaled",
]

#: Per call, an online softmax's rescale (and the scores' k-tile pass) costs about this many of
#: the GEMM's k steps, so softmax chains prefer long tiles of l (docs/tuning.md).
RESCALE_STEPS = 3.0


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
    `tiles` being the code level's (`code_level`): 1 + RESCALE_STEPS x (its calls: tiles of its
    reduction, a tail tile included) / (the reduction's extent) for the GEMMs of a softmax
    chain (`rescaled`, or `fed` when the caller has it), 1 for every other op; and, with a
    causal softmax, every op times the share of the scores its row blocks compute
    (`causal_share`)."""
    ext = chain.extents
    fed = rescaled(chain) if fed is None else fed
    share = computed_share(chain, tiles)
    return tuple(
        share
        * (1.0 + RESCALE_STEPS * _calls(ext[fed[i]], tiles.get(fed[i], 0)) if i in fed else 1.0)
        for i in range(len(chain.ops))
    )


def _calls(extent: int, tile: int) -> float:
    """Calls a step over `extent` in tiles of `tile` (0: whole): a tail tile is a call too."""
    tile = extent if tile <= 0 else min(tile, extent)
    return -(-extent // tile) / extent


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
    A tile of 1 gives the share kept: the least any tiles compute."""
    tile = max(1, min(tile, rows))
    computed = 0
    for start in range(0, rows, tile):
        block = min(tile, rows - start)
        computed += block * min(keys, start + block)
    return computed / (rows * keys)
