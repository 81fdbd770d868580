"""`gated_mlp`: a Llama-style SwiGLU MLP, `(act(X @ W1) * (X @ W3)) @ W2`, in one kernel.

y = chainfuse.ops.gated_mlp(x, gate.weight.T, up.weight.T, down.weight.T)   # nn.Linear's, as stored

The kernel runs the gate's and the up projection's GEMMs side by side on each block of the
hidden dim (both panels packed together, both score tiles in cache), multiplies them, and runs
the down projection on the product: the hidden activations never reach memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chainfuse import builders
from chainfuse.operands import is_torch
from chainfuse.ops.arguments import (
    dtype_of,
    inference_only,
    new_result,
    no_work,
    on_cpu,
    plain,
    shape_of,
    subclassed,
)
from chainfuse.ops.calls import amx_setting, calls, replay, run, signature
from chainfuse.ops.gemm_chain import steps_of, swapped, transposed
from chainfuse.ops.packed import packed_for_call
from chainfuse.ops.views import lead_merged
from chainfuse.runtime import get_num_threads

__all__ = ["gated_mlp", "gated_mlp_shape"]


def gated_mlp(
    X: Any, W1: Any, W3: Any, W2: Any, act: str = "silu", out: Any = None, *, packed: Any = None
) -> Any:
    """`(act(X @ W1) * (X @ W3)) @ W2` for X [..., M, K], W1 and W3 [K, L], W2 [L, N] (2-D
    weights: X's leading dims are rows of one call), or X [b, M, K] with weights [b, K, L],
    [b, L, N]. `act` is "silu" (Llama's SwiGLU), "gelu" (erf), "gelu_tanh" (GeGLU) or another of
    `ir.ACTIVATION_NAMES` ("relu": ReGLU).

    float32, bfloat16 or float16 in and out (fp32 arithmetic inside). The weights are read as
    stored: row-major, or the transposes of row-major matrices (nn.Linear's `weight.T`); W1 and
    W3 must lie alike (the same strides). Returns [..., M, N] of X's kind; `out=` writes into a
    preallocated result. K = 0 or L = 0 gives zeros. `packed`: bf16 2-D weights packed once by
    `ops.pack_weights(W1, W2, W3)`, which the AMX kernels read instead of packing them per row
    block (the fp32 path reads the weights as stored)."""
    threads = get_num_threads()
    key = None
    if act.__class__ is str:
        sig = signature((X, W1, W3, W2, out, packed))
        if sig is not None:
            key = ("gated_mlp", act, threads, amx_setting(), sig)
            replays = calls.replays
            hit = replays.get(key)
            if hit is not None:
                replays.hits += 1
                pk = 0 if packed is None else packed_for_call(packed, X, W1, W2, W3)
                return replay(hit, (X, W1, W3, W2), out, threads, pk)
            replays.misses += 1
    if subclassed(X, W1, W3, W2, out):
        found = gated_mlp(plain(X), plain(W1), plain(W3), plain(W2), act, plain(out),
                          packed=plain(packed))  # fmt: skip
        return found if out is None else out
    dtype = dtype_of("X, W1, W3, W2", X, W1, W3, W2)
    sx, s1, s3, s2 = (shape_of(n, x, float32=False)
                      for n, x in (("X", X), ("W1", W1), ("W3", W3), ("W2", W2)))  # fmt: skip
    shape = gated_mlp_shape(sx, s1, s3, s2)
    builders.gated_mlp_chain(1, 1, 1, 1, 1, act, dtype)  # (act's error, before any work)
    inference_only("X, W1, W3, W2", X, W1, W3, W2)
    on_cpu("X, W1, W3, W2, out", X, W1, W3, W2, out)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    batched = len(s1) == 3
    M, K = sx[-2], sx[-1]
    L, N = s1[-1], s2[-1]
    packed_at = 0 if packed is None else packed_for_call(packed, X, W1, W2, W3)
    if 0 in shape or K == 0 or L == 0:  # (act(0) * 0: zeros)
        return no_work("X", X, shape, 0, out)
    b_t = transposed(W1)
    if transposed(W3) != b_t or (b_t and steps_of(W3) != steps_of(W1)):
        raise ValueError(
            f"W3: expected the layout of W1 (strides {steps_of(W1)}), got strides {steps_of(W3)}"
        )
    d_t = transposed(D := W2)
    if batched:
        A = X
        rows = None
    else:
        rows = lead_merged(X, len(sx) - 1) if len(sx) > 2 else X
        if rows is None:  # (leading dims whose strides do not merge: one call per index)
            result = out if out is not None else new_result(X, shape)[0]
            for at in np.ndindex(*sx[:-2]):
                result[at] = gated_mlp(X[at], W1, W3, W2, act, packed=packed)
            return result
        A = rows[None]
    B, B3, D = (x if len(x.shape) == 3 else x[None] for x in (W1, W3, D))
    B, B3 = (swapped(x) if b_t else x for x in (B, B3))
    D = swapped(D) if d_t else D
    batch = sx[0] if batched else 1
    M = A.shape[1]
    kernel = calls.gated_kernels((batch, M, N, K, L), act, dtype, threads, b_t, d_t,
                                 amx_setting())  # fmt: skip
    user_out, like = out, False
    if user_out is None:
        user_out, like = new_result(X, shape)
    elif not (user_out.is_contiguous() if is_torch(user_out) else user_out.flags.c_contiguous):
        found = gated_mlp(X, W1, W3, W2, act, packed=packed)
        user_out[...] = found
        return user_out
    into = user_out.reshape(batch, M, N)
    run(kernel, (A, B, B3, D), into, threads, key, user_out, like, packed_at=packed_at)
    return user_out


def gated_mlp_shape(
    sx: tuple[Any, ...], s1: tuple[Any, ...], s3: tuple[Any, ...], s2: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The shape of `gated_mlp`'s result for operands of these shapes (sizes may be symbolic),
    after the checks `gated_mlp` makes of them, raising the same errors."""
    if len(sx) < 2 or len(s1) not in (2, 3) or len(s2) != len(s1):
        raise ValueError(
            f"X, W1, W2: expected X [..., M, K] with weights [K, L], [L, N] (or all three with a"
            f" batch dim), got shapes {tuple(sx)}, {tuple(s1)}, {tuple(s2)}"
        )
    if tuple(s3) != tuple(s1):
        raise ValueError(f"W3: expected W1's shape {tuple(s1)}, got {tuple(s3)}")
    if len(s1) == 3 and (len(sx) != 3 or not sx[0] == s1[0] == s2[0]):
        raise ValueError(
            f"X, W1, W2: batched weights need X [b, M, K] of their batch, got shapes "
            f"{tuple(sx)}, {tuple(s1)}, {tuple(s2)}"
        )
    if s1[-2] != sx[-1]:
        raise ValueError(f"W1: expected {sx[-1]} rows (X's K), got shape {tuple(s1[-2:])}")
    if s2[-2] != s1[-1]:
        raise ValueError(f"W2: expected {s1[-1]} rows (W1's L), got shape {tuple(s2[-2:])}")
    return (*sx[:-1], s2[-1])
