"""Operands seen with other shapes at the same memory: stretched (stride 0) or dims merged."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from chainfuse.operands import is_torch

__all__ = ["lead_merged", "stretched"]


def lead_merged(x: Any, n: int) -> Any:
    """`x` with its first `n` dims seen as one (no copy), or None where its strides do not
    allow it (a stretched dim before one that is not, say)."""
    shape = tuple(x.shape)
    torch = is_torch(x)
    steps = tuple(x.stride()) if torch else tuple(s // x.itemsize for s in x.strides)
    dims = [(shape[i], steps[i]) for i in range(n) if shape[i] != 1]
    if any(outer != inner * size for (_, outer), (size, inner) in itertools.pairwise(dims)):
        return None
    size = int(np.prod(shape[:n]))
    new_shape, new_steps = (size, *shape[n:]), (dims[-1][1] if dims else 0, *steps[n:])
    if torch:
        return x.as_strided(new_shape, new_steps)
    return np.lib.stride_tricks.as_strided(
        x, new_shape, tuple(s * x.itemsize for s in new_steps), writeable=False
    )


def stretched(x: Any, shape: tuple[int, ...]) -> Any:
    """`x` seen with `shape`, its dims of 1 stretched (stride 0): the same memory."""
    if tuple(x.shape) == shape:
        return x
    return np.broadcast_to(x, shape) if type(x) is np.ndarray else x.expand(*shape)
