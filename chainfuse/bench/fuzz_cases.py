"""The random cases of the fuzz campaign (`chainfuse.bench.fuzz`): one `Case` per (seed, index),
drawn from its own random stream, so any case is rebuilt exactly by its seed and index.

A case holds the call (a closure over the operands), the float64 reference of its result (from
`chainfuse.reference`, on the very values the call reads), the chain whose tolerance applies,
and, where PyTorch defines which elements are NaN or inf (NaN/inf inputs, fully masked rows,
16-bit overflow), PyTorch's own result to compare those positions with.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from chainfuse import reference
from chainfuse.bench.fuzz_values import Kind, Layout, Operand, torch_or_none
from chainfuse.ir import Chain

__all__ = ["Case", "pick"]


@dataclasses.dataclass
class Case:
    """One fuzz case: `call()` runs it; its result must match `expected` (float64, in the
    result's shape) within `chain`'s tolerance, and `oracle()` (PyTorch's result, float64) at
    its NaN and inf positions. `names`: the arguments an error may name; `may_refuse`: a clear
    error naming one of them is an answer (a view or input the op may refuse)."""

    op: str
    dtype: str
    features: tuple[str, ...]
    operands: list[Operand]
    call: Callable[[], Any]
    expected: np.ndarray
    chain: Chain
    names: frozenset[str]
    describe: str
    inputs: dict[str, np.ndarray] | None = None
    oracle: Callable[[], np.ndarray] | None = None
    may_refuse: bool = False
    out: Any = None
    peak: float | None = None  # the magnitude of the sums before an activation after them


def pick(rng: np.random.Generator, options: Any, weights: Any = None) -> Any:
    """One of `options` (a sequence), with optional relative `weights`."""
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / np.sum(weights)
    return options[int(rng.choice(len(options), p=p))]


def layout_for(rng: np.random.Generator, kind: Kind, ndim: int, plain: bool) -> Layout:
    """A random layout an op takes as given (numpy: a negative stride too); `plain`: contiguous."""
    if plain:
        return Layout.CONTIGUOUS
    options = [Layout.CONTIGUOUS, Layout.STRIDED]
    weights: list[float] = [6, 2]
    if ndim >= 3:
        options.append(Layout.PERMUTED)
        weights.append(1.5)
    if ndim >= 3 and kind is Kind.NUMPY:
        options.append(Layout.NEGATIVE)
        weights.append(1)
    return Layout(pick(rng, options, weights))


def special(rng: np.random.Generator, features: list[str], dtype: str) -> str | None:
    """Which special values a case carries: "nan", "inf", "large" or None (most cases)."""
    what = pick(rng, [None, "nan", "inf", "large"], [10, 2, 1.5, 1.5])
    if what is not None:
        features.append(what)
    return str(what) if what is not None else None


def oracle_torch(fn: Callable[[Any], Any]) -> Callable[[], np.ndarray] | None:
    """`fn(torch)` as a deferred float64 result, or None without torch."""
    torch = torch_or_none()
    if torch is None:
        return None

    def run() -> np.ndarray:
        with torch.no_grad():
            out: np.ndarray = fn(torch).detach().double().numpy()
        return out

    return run


def describe_operand(o: Operand) -> str:
    """name: kind dtype shape strides, as the reproducer prints it."""
    x = o.array
    if hasattr(x, "stride") and callable(x.stride):
        strides = tuple(x.stride())
        kind = f"torch.{str(x.dtype).split('.')[-1]}"
    else:
        strides = tuple(s // x.itemsize for s in x.strides) if hasattr(x, "strides") else ()
        kind = f"{type(x).__name__}.{x.dtype}"
    shape = tuple(getattr(x, "shape", ()))
    bad = ""
    if o.values.dtype != np.bool_:
        n_nan, n_inf = int(np.isnan(o.values).sum()), int(np.isinf(o.values).sum())
        finite = o.values[np.isfinite(o.values)]
        peak = float(np.abs(finite).max()) if finite.size else 0.0
        bad = f" max|x|={peak:.3g}" + (f" nan={n_nan}" if n_nan else "")
        bad += f" inf={n_inf}" if n_inf else ""
    return f"{o.name}: {kind} shape={shape} strides={strides}{bad}"


def reference_of(chain: Chain, inputs: dict[str, np.ndarray], name: str) -> np.ndarray:
    out: np.ndarray = reference.run(chain, inputs)[name]
    return out


def gemm_flops_ok(b: int, M: int, N: int, K: int, L: int) -> bool:
    """Keeps a case to milliseconds: the two products' multiply-adds bounded."""
    return b * M * L * (K + N) <= 600_000 and b * M * max(K, L, N) <= 60_000


def lead_of(*leads: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast of batch shapes (numpy's rule)."""
    return tuple(np.broadcast_shapes(*leads))


def flat(x: np.ndarray, tail: int) -> np.ndarray:
    """`x` with all but its last `tail` dims merged into one (a copy where needed)."""
    return x.reshape((math.prod(x.shape[: x.ndim - tail]), *x.shape[x.ndim - tail :]))
