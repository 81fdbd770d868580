"""`gemm_chain`: `between(A @ B + bias1) @ D + bias2` in one kernel, batch dims broadcast as
numpy's matmul's; B and D read as stored, nn.Linear's `[out, in]` weights too.

E = chainfuse.ops.gemm_chain(A, B, D, between="relu")   # relu(A @ B) @ D, batched
E = chainfuse.ops.gemm_chain(x, W1.T, W2.T, "gelu_tanh", bias1=b1, bias2=b2)  # an MLP block
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chainfuse import builders
from chainfuse.ir import Activation
from chainfuse.operands import is_torch
from chainfuse.ops import gpu
from chainfuse.ops.arguments import (
    batch_dims,
    dtype_name,
    inference_only,
    new_result,
    no_work,
    on_cpu,
    operands_of,
    out_apart,
    plain,
    shape_of,
    steps_of,
    subclassed,
)
from chainfuse.ops.calls import amx_setting, calls, replay, run, signature
from chainfuse.ops.packed import packed_for_call
from chainfuse.ops.views import lead_merged, stretched
from chainfuse.runtime import get_num_threads

__all__ = ["gemm_chain", "gemm_chain_shape", "steps_of", "swapped", "transposed"]


def gemm_chain(
    A: Any,
    B: Any,
    D: Any,
    between: Activation | str | None = None,
    out: Any = None,
    *,
    bias1: Any = None,
    bias2: Any = None,
    packed: Any = None,
) -> Any:
    """`between(A @ B + bias1) @ D + bias2` for A [b, M, K] (or [M, K]), B [b, K, L], D [b, L, N].

    float32, or bfloat16 or float16 in and out (fp32 arithmetic inside; `Kernel.arithmetic`
    says so).
    `between` is None, an activation of `ir.ACTIVATION_NAMES` ("relu", "gelu" (erf),
    "gelu_tanh", "quick_gelu" (x sigmoid(1.702 x)), "silu", "relu6", "hardswish", "mish",
    "squared_relu") or "softmax" (over L). `bias1` [L] and `bias2` [N] (1-D, the inputs' dtype) are
    optional; bias1 is added before `between` (with a softmax, to the scores). Returns
    [b, M, N] ([M, N] for 2-D inputs) of the inputs' kind; `out=` writes into a preallocated
    result. Zero-size dimensions give what numpy's matmul gives (an empty result, or zeros for
    K = 0 or L = 0, plus the biases' terms; the mean of D's rows for K = 0 with softmax, whose
    scores are then all equal).

    B and D are read as stored where their last dim is contiguous, or where they are the
    transposes of such (`W1.T`, `W2.T` of nn.Linear weights `[out, in]`: stride 1 along their
    second-to-last dim); never copied.

    Other ranks broadcast as numpy's matmul broadcasts them: A [..., M, K], B [..., K, L],
    D [..., L, N], the batch dims aligned from the right, each equal or 1 (`gemm_chain_shape`).
    An MLP's x [batch, tokens, dim] with 2-D weights is one call over batch x tokens rows (the
    weights read once), where x's rows lie evenly in memory (see `_gemm_chain_broadcast`).

    `packed`: bf16 B and D (2-D, or the same for every batch) packed once by
    `ops.pack_weights(B, D)`: the AMX kernels read them from there instead of packing them per
    row block (the fp32 path reads B and D as stored); an error where it packs other sizes.
    """
    if A.__class__ is not np.ndarray and gpu.routed(A, B, D, out):  # CUDA, or triton asked for
        if packed is not None:
            raise ValueError("packed: the AMX kernels' weights; pass it with CPU tensors")
        return gpu.gemm_chain(A, B, D, between, out, bias1=bias1, bias2=bias2)
    threads = get_num_threads()
    key = None
    if between is None or between.__class__ is str or isinstance(between, Activation):
        sig = signature((A, B, D, out, bias1, bias2, packed))
        if sig is not None:
            key = ("gemm_chain", between, threads, amx_setting(), sig)
            replays = calls.replays
            hit = replays.get(key)
            if hit is not None:
                replays.hits += 1
                pk = 0 if packed is None else packed_for_call(packed, A, B, D)
                return replay(hit, _operands(A, B, D, bias1, bias2), out, threads, pk)
            replays.misses += 1
    if subclassed(A, B, D, out, bias1, bias2):  # (np.memmap and such: plain arrays)
        found = gemm_chain(plain(A), plain(B), plain(D), between, plain(out),
                           bias1=plain(bias1), bias2=plain(bias2), packed=plain(packed))  # fmt: skip
        return found if out is None else out
    dtype, (sa, sb, sd) = operands_of("A, B, D", A, B, D)
    biases = bias1, bias2
    _bias_kinds(biases, dtype)
    if (
        not len(sa) == len(sb) == len(sd)
        or len(sa) not in (2, 3)
        or not sa[:-2] == sb[:-2] == sd[:-2]
    ):
        return _gemm_chain_broadcast(A, B, D, between, out, (sa, sb, sd), biases, packed)
    inference_only("A, B, D, bias1, bias2", A, B, D, bias1, bias2)
    on_cpu("A, B, D, out, bias1, bias2", A, B, D, out, bias1, bias2)
    flat = len(sa) == 2
    user_out, first = out, A
    if flat:
        A, B, D = A[None], B[None], D[None]
        sa, sb, sd = (1, *sa), (1, *sb), (1, *sd)
        if out is not None:
            out = out[None]
    # nn.Linear's weights as stored: B = W1.T, D = W2.T read through their transposes
    b_t, d_t = transposed(B), transposed(D)
    operands = _operands(A, swapped(B) if b_t else B, swapped(D) if d_t else D, *biases)
    batch, M, K = sa
    if sb[1] != K:
        raise ValueError(f"B: expected {K} rows (A's K), got shape {sb[1:]}")
    L = sb[2]
    if sd[1] != L:
        raise ValueError(f"D: expected {L} rows (B's L), got shape {sd[1:]}")
    N = sd[2]
    if between is not None and not isinstance(between, (str, Activation)):
        raise TypeError(f"between: expected None or an activation name, got {between!r}")
    for name, bias, size, what in (("bias1", bias1, L, "B's L"), ("bias2", bias2, N, "D's N")):
        if bias is not None and tuple(bias.shape) != (size,):
            raise ValueError(f"{name}: expected shape ({size},) ({what}), got {tuple(bias.shape)}")
    packed_at = 0 if packed is None else packed_for_call(packed, A, B, D)
    if 0 in (batch, M, N, K, L):
        builders.gemm_chain(
            1, 1, 1, 1, 1, between, dtype
        )  # the errors a call with work would raise
        if K == 0 and L > 0 and bias1 is not None and batch * M * N > 0:
            # scores of bias1 alone: a kernel of K = 1 over zeros computes them
            zeros = _zeros_like(A, (batch, M, 1)), _zeros_like(A, (batch, 1, L))
            found = gemm_chain(*zeros, D, between, out, bias1=bias1, bias2=bias2)
            return found[0] if flat and out is None else user_out if flat else found
        value: Any = 0
        if K == 0 and L > 0 and between == "softmax":  # equal scores: every row weighs 1/L
            if is_torch(D):
                value = D.float().mean(-2, keepdim=True)
            else:
                value = np.asarray(D, np.float32).mean(-2, keepdims=True)
        if bias2 is not None:  # (a sum over nothing, plus bias2)
            term = bias2.float() if is_torch(bias2) else np.asarray(bias2, np.float32)
            value = value + term.reshape(1, 1, -1)  # (as [batch, M, N] broadcasts)
        if flat:
            return no_work(
                "A", A[0], (M, N), value if isinstance(value, int) else value[0], user_out
            )
        return no_work("A", A, (batch, M, N), value, out)
    kernel = calls.gemm_kernels(
        (batch, M, N, K, L), between, dtype, threads, b_t, d_t, bias1 is not None,
        bias2 is not None, amx_setting(),
    )  # fmt: skip
    like = False
    if user_out is None:
        user_out, like = new_result(first, (M, N) if flat else (batch, M, N))
        out = user_out[None] if flat else user_out
    run(kernel, operands, out, threads, key, user_out, like, packed_at=packed_at)
    return user_out


def gemm_chain_shape(sa: Sequence[Any], sb: Sequence[Any], sd: Sequence[Any]) -> tuple[Any, ...]:
    """The shape of `gemm_chain`'s result for A, B, D of shapes `sa`, `sb`, `sd` (2-D and up,
    batch dims broadcast as numpy's matmul broadcasts them; sizes may be symbolic), after the
    checks `gemm_chain` makes of them, raising the same errors."""
    if min(len(sa), len(sb), len(sd)) < 2:
        raise ValueError(
            f"A, B, D: expected [..., rows, cols] each, got shapes {tuple(sa)}, {tuple(sb)}, "
            f"{tuple(sd)}"
        )
    if sb[-2] != sa[-1]:
        raise ValueError(f"B: expected {sa[-1]} rows (A's K), got shape {tuple(sb[-2:])}")
    if sd[-2] != sb[-1]:
        raise ValueError(f"D: expected {sb[-1]} rows (B's L), got shape {tuple(sd[-2:])}")
    n = max(len(sa), len(sb), len(sd)) - 2
    pa, pb, pd = ((1,) * (n + 2 - len(s)) + tuple(s) for s in (sa, sb, sd))
    return (*batch_dims(pa, pb, pd, n, "A, B, D"), sa[-2], sd[-1])


def _gemm_chain_broadcast(
    A: Any,
    B: Any,
    D: Any,
    between: Any,
    out: Any,
    shapes: tuple[tuple[int, ...], ...],
    biases: tuple[Any, Any],
    packed: Any = None,
) -> Any:
    """`gemm_chain` on operands of other ranks than all 2-D or all 3-D, or 3-D ones of different
    batch sizes: the batch dims broadcast (`gemm_chain_shape`). Where B and D have no batch of
    their own (2-D weights, an MLP's) and A's batch and rows lie evenly in memory (a contiguous
    A does), A is seen as [batch x M, K]: one 2-D call, the weights read once. Else every
    operand is stretched to the batch shape (stride 0, no copy) and the batch dims merged into
    one where their strides allow (one 3-D call), or one 3-D call per index of all but the
    last. `out` (the result's shape) is written in place where it is contiguous."""
    sa, sb, sd = shapes
    shape = gemm_chain_shape(sa, sb, sd)
    n = len(shape) - 2
    lead = shape[:n]
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    out_apart("A, B, D", out, A, B, D)  # (the calls below may write out a batch at a time)
    pa, pb, pd = ((1,) * (n + 2 - len(s)) + s for s in shapes)
    A, B, D = A.reshape(pa), B.reshape(pb), D.reshape(pd)  # (views: leading dims of 1)
    whole = out is not None and (out.is_contiguous() if is_torch(out) else out.flags.c_contiguous)
    if 0 in shape:  # an empty result (a sum over no k or l has rows: the calls below)
        return no_work("A", A, shape, 0, out)
    if pb[:n] == pd[:n] == (1,) * n and pa[:n] == lead:
        rows = lead_merged(A, n + 1)  # [batch x M, K]
        if rows is not None:
            flat = out.reshape(-1, shape[-1]) if whole else None
            part = gemm_chain(rows, B.reshape(pb[n:]), D.reshape(pd[n:]), between, out=flat,
                              bias1=biases[0], bias2=biases[1], packed=packed)  # fmt: skip
            return out if flat is not None else _written(part.reshape(shape), out)
    operands = [stretched(x, (*lead, *x.shape[n:])) for x in (A, B, D)]
    merged = [lead_merged(x, n) for x in operands]
    if all(x is not None for x in merged):
        flat = out.reshape(-1, *shape[n:]) if whole else None
        part = gemm_chain(merged[0], merged[1], merged[2], between, out=flat,
                          bias1=biases[0], bias2=biases[1], packed=packed)  # fmt: skip
        return out if flat is not None else _written(part.reshape(shape), out)
    result = out if out is not None else new_result(A, shape)[0]
    for at in np.ndindex(*lead[:-1]):
        result[at] = gemm_chain(operands[0][at], operands[1][at], operands[2][at], between,
                                bias1=biases[0], bias2=biases[1], packed=packed)  # fmt: skip
    return result


def _written(result: Any, out: Any) -> Any:
    """`result`, or `out` with `result` copied into it (an `out=` the kernel could not write in
    place: not contiguous)."""
    if out is None:
        return result
    out[...] = result
    return out


def _operands(A: Any, B: Any, D: Any, bias1: Any, bias2: Any) -> tuple[Any, ...]:
    """A call's operands in its chain's input order: A, B, D, then the biases it has."""
    if bias1 is None and bias2 is None:
        return A, B, D
    return (A, B, D, *(x for x in (bias1, bias2) if x is not None))


def _bias_kinds(biases: tuple[Any, Any], dtype: str) -> None:
    """Biases that are not arrays of the inputs' dtype are errors naming them (their shapes
    are checked once L and N are known)."""
    for name, bias in zip(("bias1", "bias2"), biases, strict=True):
        if bias is None:
            continue
        shape = shape_of(name, bias, float32=False)
        if len(shape) != 1:
            raise ValueError(f"{name}: expected a 1-D vector, got shape {shape}")
        if dtype_name(bias.dtype) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (the inputs'), got {bias.dtype}")


def transposed(x: Any) -> bool:
    """Whether x [..., r, c] lies as the transpose of a row-major matrix does (`W.T`): its last
    dim not contiguous, the one before it contiguous. Such an operand is read as stored."""
    shape = x.shape
    if shape[-1] <= 1 or shape[-2] <= 1 or 0 in shape:
        return False
    steps = steps_of(x)
    return steps[-1] != 1 and steps[-2] == 1


def swapped(x: Any) -> Any:
    """x with its last two dims swapped: a view of the same memory."""
    return np.swapaxes(x, -1, -2) if isinstance(x, np.ndarray) else x.transpose(-1, -2)


def _zeros_like(x: Any, shape: tuple[int, ...]) -> Any:
    """Zeros of x's kind and dtype."""
    if isinstance(x, np.ndarray):
        return np.zeros(shape, x.dtype)
    return x.new_zeros(shape)
