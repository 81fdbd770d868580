"""Functional ops: numpy arrays or torch CPU tensors in, the same kind out.

Each op builds the chain for its arguments' shapes, compiles it on first use, and keeps the
compiled kernel for later calls with the same shapes (kernels whose generated source is equal
share one compiled object on disk, so a new shape often costs a plan and a load, not a compile).

    E = chainfuse.ops.gemm_chain(A, B, D, between="relu")   # relu(A @ B) @ D, batched
"""

from __future__ import annotations

import functools
from typing import Any

from chainfuse import ir
from chainfuse.compiler import Kernel, compile
from chainfuse.ir import Activation, Chain

__all__ = ["gemm_chain"]


def _shape(name: str, x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    return tuple(int(s) for s in shape)


@functools.lru_cache(maxsize=256)
def _kernel(chain: Chain) -> Kernel:
    return compile(chain)


def gemm_chain(
    A: Any, B: Any, D: Any, between: Activation | str | None = None, out: Any = None
) -> Any:
    """`between(A @ B) @ D` for A [b, M, K] (or [M, K]), B [b, K, L], D [b, L, N], float32.

    `between` is None, "relu", "gelu" or "softmax" (over L). Returns [b, M, N] ([M, N] for 2-D
    inputs) of the inputs' kind; `out=` writes into a preallocated result.
    """
    sa, sb, sd = _shape("A", A), _shape("B", B), _shape("D", D)
    if not len(sa) == len(sb) == len(sd) or len(sa) not in (2, 3):
        raise ValueError(f"A, B, D: expected all 2-D or all 3-D, got shapes {sa}, {sb}, {sd}")
    flat = len(sa) == 2
    if flat:
        A, B, D = A[None], B[None], D[None]
        sa, sb, sd = (1, *sa), (1, *sb), (1, *sd)
        if out is not None:
            out = out[None]
    batch, M, K = sa
    if sb[0] != batch or sd[0] != batch:
        raise ValueError(f"A, B, D: batch sizes differ: {sa[0]}, {sb[0]}, {sd[0]}")
    if sb[1] != K:
        raise ValueError(f"B: expected {K} rows (A's K), got shape {sb[1:]}")
    L = sb[2]
    if sd[1] != L:
        raise ValueError(f"D: expected {L} rows (B's L), got shape {sd[1:]}")
    N = sd[2]
    result = _kernel(ir.gemm_chain(batch, M, N, K, L, between))(A, B, D, out=out)
    return result[0] if flat else result
