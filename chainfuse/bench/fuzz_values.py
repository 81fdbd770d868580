"""Operands of the fuzz campaign (`chainfuse.bench.fuzz`): awkward sizes, values (NaN and inf at
random positions, large magnitudes), each dtype's rounding, and the memory layouts a caller may
pass (rows strided, dims permuted, a negative stride, a broadcast view with stride 0).

Every operand is drawn as float64 values first and rounded to its dtype; the reference reads
those rounded values, so the kernel and the oracle see the very same numbers.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "AWKWARD",
    "Kind",
    "Layout",
    "Operand",
    "as_float64",
    "inject",
    "overflow_of",
    "place",
    "rounded",
    "size",
    "torch_or_none",
]

#: sizes that hit the tails of every tile: 1, primes, and one below / above powers of two
AWKWARD = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 32, 33, 48, 63, 64, 65, 96, 127, 128, 129, 191)


class Kind(enum.Enum):
    """What the caller passes: numpy arrays or torch CPU tensors."""

    NUMPY = "numpy"
    TORCH = "torch"


class Layout(enum.Enum):
    """How an operand lies in memory (its last dim contiguous in all of them)."""

    CONTIGUOUS = "contiguous"
    STRIDED = "strided"  # rows further apart than their length (a slice of wider rows)
    PERMUTED = "permuted"  # two leading dims swapped in memory (a transposed view)
    NEGATIVE = "negstride"  # the first dim walked backwards (numpy only)
    CHANNELS_LAST = "channels_last"  # 4-D [N, C, H, W] with C innermost in memory


@dataclasses.dataclass
class Operand:
    """One argument of a call: what the call gets, and the float64 (or bool) values the
    reference reads, of the array's own shape."""

    name: str
    array: Any
    values: np.ndarray


def torch_or_none() -> Any:
    """The torch module, or None where it is not installed (its categories are skipped)."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    try:
        return importlib.import_module("torch")
    except ImportError:
        return None


def size(rng: np.random.Generator, cap: int) -> int:
    """An awkward size up to `cap` (most of the time), or any size from 1 to `cap`."""
    pool = [s for s in AWKWARD if s <= cap]
    if rng.random() < 0.8:
        return int(pool[rng.integers(len(pool))])
    return int(rng.integers(1, cap + 1))


def rounded(values: np.ndarray, dtype: str) -> np.ndarray:
    """float64 `values` rounded to `dtype` (overflow: inf), as float64."""
    if dtype == "float32":
        return values.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return values.astype(np.float16).astype(np.float64)
    torch = torch_or_none()
    out: np.ndarray = torch.from_numpy(values).to(torch.bfloat16).double().numpy()
    return out


def overflow_of(dtype: str) -> float:
    """The smallest magnitude that rounds to inf in `dtype`."""
    if dtype == "float16":
        return 65520.0
    return float(np.finfo(np.float32).max) * (1 + 2.0**-25) if dtype == "float32" else 3.39e38


def inject(rng: np.random.Generator, values: np.ndarray, what: str) -> None:
    """Put NaN (`what` "nan") or +-inf ("inf") at one to three random positions of `values`."""
    for _ in range(int(rng.integers(1, 4))):
        at = tuple(int(rng.integers(n)) for n in values.shape)
        values[at] = np.nan if what == "nan" else (np.inf if rng.random() < 0.5 else -np.inf)


def _storage(dtype: str, kind: Kind) -> Any:
    if dtype == "bool":
        return np.bool_ if kind is Kind.NUMPY else torch_or_none().bool
    if kind is Kind.NUMPY:
        return np.dtype(dtype)
    return getattr(torch_or_none(), dtype)


def place(
    values: np.ndarray,
    dtype: str,
    kind: Kind,
    layout: Layout,
    rng: np.random.Generator,
    expand: Sequence[int] | None = None,
) -> Any:
    """An array of `kind` and `dtype` ("bool" for masks) holding `values` (already rounded to
    `dtype`) in `layout`; memory a view does not cover holds NaN (a read outside the view shows
    up in the result). `expand`: the shape the array is then seen with, its dims of 1 stretched
    (stride 0, no copy)."""
    shape = values.shape
    nd = len(shape)
    buf_shape = list(shape)
    swap: tuple[int, int] | None = None
    if layout is Layout.STRIDED and nd:
        buf_shape[-1] += int(rng.integers(1, 9))
    elif layout is Layout.PERMUTED and nd >= 3:
        i, j = sorted(int(a) for a in rng.choice(nd - 1, 2, replace=False))
        swap = (i, j)
        buf_shape[i], buf_shape[j] = buf_shape[j], buf_shape[i]
    elif layout is Layout.CHANNELS_LAST and nd == 4:
        buf_shape = [shape[0], shape[2], shape[3], shape[1]]
    store = _storage(dtype, kind)
    fill = False if dtype == "bool" else math.nan
    if kind is Kind.NUMPY:
        buf: Any = np.full(buf_shape, fill, dtype=store)
    else:
        buf = torch_or_none().full(buf_shape, fill, dtype=store)
    view = buf
    if layout is Layout.STRIDED and nd:
        view = buf[..., : shape[-1]]
    elif swap is not None:
        view = buf.swapaxes(*swap)
    elif layout is Layout.CHANNELS_LAST and nd == 4:
        view = buf.permute(0, 3, 1, 2) if kind is Kind.TORCH else buf.transpose(0, 3, 1, 2)
    elif layout is Layout.NEGATIVE and nd and kind is Kind.NUMPY:
        view = buf[::-1]
    if kind is Kind.NUMPY:
        view[...] = values
    else:
        source = values if dtype == "bool" else values.astype(np.float32)
        view.copy_(torch_or_none().from_numpy(np.ascontiguousarray(source)))
    if expand is not None and tuple(expand) != tuple(shape):
        view = np.broadcast_to(view, expand) if kind is Kind.NUMPY else view.expand(*expand)
    return view


def as_float64(x: Any) -> np.ndarray:
    """A result (numpy array or torch tensor of any float dtype) as a float64 numpy array."""
    if hasattr(x, "detach"):
        out: np.ndarray = x.detach().double().numpy()
        return out
    return np.asarray(x, dtype=np.float64)
