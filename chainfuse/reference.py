"""The float64 numpy oracle: what every op and chain of the IR means, and how close is close enough.

Every numerical test in the project compares a kernel against `run` (float64, numpy only) with
`assert_close`, whose bound comes from `tolerance`, the one tolerance rule of the project.

Semantics, written once here so that the planner, the simulator and the code generators can be
checked against them:

- `Contraction`: `out[o] = sum over the loops no output dim uses of in0[...] * in1[...]`. Each
  input is first *gathered* over its loops: a dim indexed by `2*p + r - 1` becomes two axes
  `(p, r)` (an im2col view, built with one `np.take` per dim), a constant index (`Affine()`, used
  by broadcast mask dims of size 1) reads element `offset` and drops the dim. Reads outside the
  tensor are zeros when `Access.zero_pad` is set and a `ValueError` otherwise. The gathered
  operands are then multiplied as one batched matrix product (BLAS), not elementwise in Python,
  so a 64-channel 56x56 convolution takes well under a second.
- `Pointwise`: identity, relu, exact-erf gelu (`torch.nn.functional.gelu`'s default), tanh
  gelu (`approximate="tanh"`), quick gelu `x * sigmoid(1.702 x)`, silu `x * sigmoid(x)`,
  relu6 `min(max(x, 0), 6)`, hardswish `x * relu6(x + 3) / 6`, mish `x * tanh(softplus(x))`,
  squared relu `relu(x)^2`, `alpha * x` (scale), `x + operand` (bias, broadcast over the loops the operand lacks) and
  `x * operand` (mul: a gated MLP's gate times its up projection).
- `Softmax` over loop `axis`: `scale * x` (soft-capped to `cap * tanh(x / cap)` when it has a
  cap), plus an additive mask, or plus -inf where a bool mask
  is False (PyTorch SDPA's convention: a NaN or +inf score stays NaN there), and keep only
  `axis <= row` when causal (PyTorch's `is_causal`, top-left aligned:
  `torch.ones(L, S).tril(0)`; keys after the query are not read). Stable (the row max is
  subtracted). A safe softmax's row whose every position is masked (or is -inf) gives zeros, as
  PyTorch's CPU SDPA returns for fully masked rows; an unsafe one's gives NaN, as `torch.softmax`.

Bool masks stay numpy bool arrays; every other tensor is evaluated in float64.
"""

from __future__ import annotations

import functools
import importlib
import math
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from chainfuse.ir import (
    ACTIVATION_NAMES,
    POINTWISE,
    Access,
    Activation,
    Affine,
    Chain,
    Contraction,
    DType,
    MaskKind,
    Op,
    Pointwise,
    Role,
    Softmax,
)

__all__ = [
    "UNIT_ROUNDOFF",
    "assert_close",
    "evaluate",
    "random_inputs",
    "run",
    "run_conv_chain",
    "tolerance",
]

F64 = NDArray[np.float64]

UNIT_ROUNDOFF: Mapping[DType, float] = {
    DType.FLOAT64: 2.0**-53,
    DType.FLOAT32: 2.0**-24,
    DType.FLOAT16: 2.0**-11,
    DType.BFLOAT16: 2.0**-8,
}
"""Half an ulp at 1.0: the largest relative error of one round-to-nearest in that dtype."""

_SAFETY = 8.0
"""The constant `c` of `tolerance`; see there for why 8."""

_LARGE_NEGATIVE = -1.0e4
"""The "masked" value of random additive masks: exp(-1e4) is 0 in every dtype, and unlike the
customary -1e9 it is finite in float16 (max 65504), so the same mask works for every dtype."""


# -- chain ----------------------------------------------------------------------------------------


def run(
    chain: Chain, inputs: Mapping[str, NDArray[Any]], keep: bool = False
) -> dict[str, NDArray[Any]]:
    """Evaluate `chain` in float64 and return its outputs by name (every tensor if `keep`).

    Inputs are checked before anything runs, because a silently broadcast or transposed input
    would make the oracle agree with a wrong kernel: every chain input must be present, no other
    name may be given, and each shape must equal `Tensor.shape` exactly. Inputs are cast to
    float64, except bool masks, which must be (and stay) numpy bool arrays: reading an additive
    0/-inf mask as a bool one would invert it, so no conversion is guessed.
    """
    env = _check_inputs(chain, inputs)
    for op in chain.ops:
        env[op.output.tensor] = evaluate(op, chain, env)
    names = [t.name for t in (chain.tensors if keep else chain.outputs)]
    return {name: env[name] for name in names}


def _check_inputs(chain: Chain, inputs: Mapping[str, NDArray[Any]]) -> dict[str, NDArray[Any]]:
    expected = {t.name: t for t in chain.inputs}
    unknown = sorted(set(inputs) - set(expected))
    if unknown:
        raise ValueError(
            f"chain {chain.name!r}: unknown input(s) {unknown}; its inputs are {sorted(expected)}"
        )
    bool_masks = _bool_masks(chain)
    env: dict[str, NDArray[Any]] = {}
    for name, t in expected.items():
        if name not in inputs:
            raise ValueError(f"chain {chain.name!r}: input {name!r} {t.shape} is missing")
        value = np.asarray(inputs[name])
        if value.shape != t.shape:
            raise ValueError(f"input {name!r}: expected shape {t.shape}, got {tuple(value.shape)}")
        if name in bool_masks:
            if value.dtype != np.bool_:
                raise ValueError(f"input {name!r} is a bool mask; got dtype {value.dtype}")
            env[name] = value
        elif value.dtype.kind not in "iuf":
            raise ValueError(f"input {name!r}: expected real numbers, got dtype {value.dtype}")
        else:
            env[name] = value.astype(np.float64)
    return env


def _bool_masks(chain: Chain) -> set[str]:
    return {
        op.mask.tensor
        for op in chain.ops
        if isinstance(op, Softmax) and op.mask is not None and op.mask_kind is MaskKind.BOOL
    }


def run_conv_chain(
    chain: Chain,
    inputs: Mapping[str, NDArray[Any]],
    b1: NDArray[Any] | None = None,
    b2: NDArray[Any] | None = None,
    after: str | None = None,
) -> NDArray[np.float64]:
    """`run` of a `conv_chain_spec` chain with what its IR does not hold: per-channel biases
    added to each convolution's result (`b1` before the op between them) and an optional
    activation after the second one (`after`: one of `ir.ACTIVATION_NAMES`). Returns the output (float64). Kept apart from `run`: the IR has no
    bias-after-contraction op for convolutions (yet)."""
    if after is not None and after not in ACTIVATION_NAMES:
        raise ValueError(f"after: expected None or one of {list(ACTIVATION_NAMES)}, got {after!r}")
    env = _check_inputs(chain, inputs)
    first = chain.contractions[0]
    for op in chain.ops:
        value = evaluate(op, chain, env)
        bias = b1 if op is first else (b2 if op is chain.ops[-1] else None)
        if bias is not None:
            value = value + np.asarray(bias, dtype=np.float64).reshape(1, -1, 1, 1)
        env[op.output.tensor] = value
    out: F64 = env[chain.outputs[0].name]
    return out if after is None else activate(Activation(after), out)


# -- ops ------------------------------------------------------------------------------------------


def evaluate(op: Op, chain: Chain, env: dict[str, NDArray[Any]]) -> NDArray[Any]:
    """Compute one op's output tensor (float64, `Tensor.shape`) from the tensors in `env`."""
    extents = chain.extents
    out_loops = _output_loops(op.output)
    if isinstance(op, Contraction):
        (a, la), (b, lb) = (_gather(acc, _real(env, acc), extents) for acc in op.inputs)
        result = _contract(a, la, b, lb, out_loops)
    elif isinstance(op, Pointwise):
        result = _pointwise(op, env, extents, out_loops)
    else:
        result = _softmax(op, env, extents, out_loops)
    shape = chain.tensor(op.output.tensor).shape
    if result.shape != shape:
        result = np.broadcast_to(result, shape)
    # A fresh, writable, C-ordered array: never a view of an input or of another tensor.
    return np.require(result, np.float64, ["C", "W", "O"])


def _output_loops(acc: Access) -> tuple[str, ...]:
    loops: list[str] = []
    for ix in acc.index:
        if len(ix.terms) != 1 or ix.terms[0][1] != 1 or ix.offset != 0:
            raise ValueError(f"output {acc} must index each dim with one loop")
        loops.append(ix.terms[0][0])
    if len(set(loops)) != len(loops):
        raise ValueError(f"output {acc} repeats a loop; its off-diagonal elements are undefined")
    return tuple(loops)


def _real(env: Mapping[str, NDArray[Any]], acc: Access) -> F64:
    return np.asarray(env[acc.tensor], dtype=np.float64)


def _gather(
    acc: Access, data: NDArray[Any], extents: Mapping[str, int]
) -> tuple[NDArray[Any], tuple[str, ...]]:
    """`data` read through `acc`, as an array with one axis per (dim, loop) pair, and the labels.

    A dim indexed by one loop with coefficient 1 stays as it is (no copy); a dim indexed by
    `sum(c * loop) + offset` is replaced by one axis per loop of the expression, gathered with
    `np.take` (a constant index leaves no axis). A loop used by two dims labels two axes, and
    `_dedupe` takes their diagonal. Zero padding is done by padding `data` first, so the gather
    never needs a per-element bounds test.
    """
    if data.ndim != len(acc.index):
        raise ValueError(f"{acc} indexes {len(acc.index)} dims; the array has shape {data.shape}")
    per_dim: list[tuple[tuple[str, ...], NDArray[np.intp] | None]] = []
    widths: list[tuple[int, int]] = []
    for d, (ix, size) in enumerate(zip(acc.index, data.shape, strict=True)):
        coeffs: dict[str, int] = {}
        for loop, c in ix.terms:
            coeffs[loop] = coeffs.get(loop, 0) + c
        loops = tuple(coeffs)
        if len(loops) == 1 and coeffs[loops[0]] == 1 and ix.offset == 0:
            if extents[loops[0]] != size:
                raise ValueError(
                    f"{acc} dim {d}: loop {loops[0]!r} has extent {extents[loops[0]]}, "
                    f"the tensor has size {size}"
                )
            per_dim.append((loops, None))
            widths.append((0, 0))
            continue
        idx = _index_grid(ix, coeffs, extents)
        low, high = int(idx.min()), int(idx.max())
        before, after = max(0, -low), max(0, high - (size - 1))
        if (before or after) and not acc.zero_pad:
            raise ValueError(
                f"{acc} dim {d}: index {ix} ranges over [{low}, {high}], outside [0, {size - 1}] "
                f"of tensor {acc.tensor!r}, and the access has no zero_pad"
            )
        per_dim.append((loops, idx + before))
        widths.append((before, after))
    arr = np.pad(data, widths) if any(w != (0, 0) for w in widths) else data
    for d in reversed(range(len(per_dim))):
        idx_d = per_dim[d][1]
        if idx_d is not None:
            arr = np.take(arr, idx_d, axis=d)
    labels = tuple(loop for loops, _ in per_dim for loop in loops)
    return arr, labels


def _index_grid(
    ix: Affine, coeffs: Mapping[str, int], extents: Mapping[str, int]
) -> NDArray[np.intp]:
    """The index value at every point of the dim's loops: shape = their extents (0-d if none)."""
    grid = np.full((), ix.offset, dtype=np.intp)
    for j, (loop, c) in enumerate(coeffs.items()):
        shape = [1] * len(coeffs)
        shape[j] = extents[loop]
        grid = grid + c * np.arange(extents[loop], dtype=np.intp).reshape(shape)
    return grid


def _dedupe(arr: NDArray[Any], labels: tuple[str, ...]) -> tuple[NDArray[Any], tuple[str, ...]]:
    """Take the diagonal over axes that share a loop, so each loop labels one axis."""
    unique = tuple(dict.fromkeys(labels))
    if len(unique) == len(labels):
        return arr, labels
    letter = {loop: _letter(i) for i, loop in enumerate(unique)}
    spec = "".join(letter[x] for x in labels) + "->" + "".join(letter[x] for x in unique)
    return np.einsum(spec, arr), unique


def _letter(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if i >= len(letters):
        raise ValueError(f"an access uses more than {len(letters)} loops")
    return letters[i]


def _contract(
    a: F64, la: tuple[str, ...], b: F64, lb: tuple[str, ...], out: tuple[str, ...]
) -> F64:
    """`out = sum over the rest of a * b` as one batched matmul `[batch, M, K] @ [batch, K, N]`.

    Loops only one operand has are summed out first; the rest are grouped into batch (both
    operands and the output), M (first operand and output), N (second and output) and K (both
    operands only). One np.matmul then does all the work in BLAS, whatever the loop structure,
    instead of relying on np.einsum's path optimiser to find it.
    """
    a, la = _dedupe(a, la)
    b, lb = _dedupe(b, lb)
    a, la = _sum_out(a, la, keep=set(lb) | set(out))
    b, lb = _sum_out(b, lb, keep=set(la) | set(out))
    missing = [x for x in out if x not in la and x not in lb]
    if missing:
        raise ValueError(f"output loops {missing} are read by neither input")
    batch = [x for x in out if x in la and x in lb]
    left = [x for x in out if x in la and x not in lb]
    right = [x for x in out if x in lb and x not in la]
    red = [x for x in la if x in lb and x not in out]
    size = dict(zip(la, a.shape, strict=True)) | dict(zip(lb, b.shape, strict=True))

    def block(arr: F64, labels: tuple[str, ...], groups: tuple[list[str], ...]) -> F64:
        order = [labels.index(x) for group in groups for x in group]
        flat = [math.prod(size[x] for x in group) for group in groups]
        return np.transpose(arr, order).reshape(flat)

    product = np.matmul(block(a, la, (batch, left, red)), block(b, lb, (batch, red, right)))
    result = product.reshape([size[x] for x in (*batch, *left, *right)])
    current = (*batch, *left, *right)
    return np.transpose(result, [current.index(x) for x in out])


def _sum_out(arr: F64, labels: tuple[str, ...], keep: set[str]) -> tuple[F64, tuple[str, ...]]:
    """Sum over loops only this operand has: `sum_k a[k] * b = (sum_k a[k]) * b`."""
    axes = tuple(i for i, x in enumerate(labels) if x not in keep)
    if not axes:
        return arr, labels
    return arr.sum(axis=axes), tuple(x for x in labels if x in keep)


def _aligned(
    acc: Access, data: NDArray[Any], extents: Mapping[str, int], order: tuple[str, ...]
) -> NDArray[Any]:
    """`data` read through `acc` with axes in `order`; size 1 where `acc` lacks the loop."""
    arr, labels = _dedupe(*_gather(acc, data, extents))
    extra = [x for x in labels if x not in order]
    if extra:
        raise ValueError(f"{acc} uses loops {extra} that the op's output does not have")
    present = [x for x in order if x in labels]
    arr = np.transpose(arr, [labels.index(x) for x in present])
    return arr.reshape([extents[x] if x in labels else 1 for x in order])


def _pointwise(
    op: Pointwise, env: Mapping[str, NDArray[Any]], extents: Mapping[str, int], out: tuple[str, ...]
) -> F64:
    x: F64 = _aligned(op.input, _real(env, op.input), extents, out)
    if op.fn in _OWN:
        return activate(op.fn, x)
    if op.fn is Activation.SCALE:
        return op.alpha * x
    if op.operand is None:
        raise ValueError(f"op '{op}': {op.fn.value} needs an operand")
    operand: F64 = _aligned(op.operand, _real(env, op.operand), extents, out)
    return x * operand if op.fn is Activation.MUL else x + operand


#: the activations that take x alone
_OWN = (Activation.IDENTITY, *POINTWISE)


def activate(fn: Activation, x: F64) -> F64:
    """`fn` (one of the activations that take x alone) of x, in float64."""
    if fn is Activation.IDENTITY:
        return x
    if fn is Activation.RELU:
        return np.maximum(x, 0.0)
    if fn is Activation.GELU:
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if fn is Activation.GELU_TANH:
        with np.errstate(over="ignore", invalid="ignore"):  # (x**3 of a huge x: inf, as torch)
            return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if fn is Activation.QUICK_GELU:
        return x * _sigmoid(1.702 * x)
    if fn is Activation.SILU:
        return x * _sigmoid(x)
    if fn is Activation.RELU6:
        return np.clip(x, 0.0, 6.0)
    with np.errstate(invalid="ignore"):  # (-inf times a zero gate: NaN, as PyTorch's)
        if fn is Activation.HARDSWISH:
            return x * np.clip(x + 3.0, 0.0, 6.0) / 6.0
        if fn is Activation.MISH:
            return x * np.tanh(np.logaddexp(0.0, x))
    if fn is Activation.SQUARED_RELU:
        return np.maximum(x, 0.0) ** 2
    raise ValueError(f"activate: {fn.value} needs an operand")


def _sigmoid(z: F64) -> F64:
    """1 / (1 + exp(-z)) without overflow: exp of -|z| only. NaN stays NaN, -inf gives 0 (so
    `x * sigmoid(x)` of -inf is NaN, as PyTorch's silu)."""
    e = np.exp(-np.abs(z))
    with np.errstate(invalid="ignore"):
        return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def _softmax(
    op: Softmax, env: Mapping[str, NDArray[Any]], extents: Mapping[str, int], out: tuple[str, ...]
) -> F64:
    # One full-size buffer, updated in place: the scores of a long attention are the biggest
    # array the oracle makes, and fresh allocations of that size cost more than the arithmetic.
    x: F64 = np.empty([extents[loop] for loop in out])
    np.multiply(_aligned(op.input, _real(env, op.input), extents, out), op.scale, out=x)
    if op.cap is not None:  # soft-capping: cap tanh(x / cap), before the mask
        np.multiply(np.tanh(np.divide(x, op.cap, out=x), out=x), op.cap, out=x)
    if op.mask is not None and op.mask_kind is MaskKind.ADDITIVE:
        np.add(x, _aligned(op.mask, _real(env, op.mask), extents, out), out=x)
    elif op.mask is not None and op.mask_kind is MaskKind.BOOL:
        mask = np.asarray(env[op.mask.tensor])
        if mask.dtype != np.bool_:
            raise ValueError(f"softmax '{op}': bool mask {op.mask.tensor!r} has dtype {mask.dtype}")
        with np.errstate(invalid="ignore"):  # +inf - inf: NaN, as SDPA's sum gives
            np.add(x, -np.inf, out=x, where=~_aligned(op.mask, mask, extents, out))
    if op.causal:
        if op.row is None:
            raise ValueError(f"softmax '{op}': causal needs a row loop")
        ranks = len(out)
        col = np.arange(extents[op.axis]).reshape(_along(out.index(op.axis), ranks))
        row = np.arange(extents[op.row]).reshape(_along(out.index(op.row), ranks))
        np.copyto(x, -np.inf, where=~(col <= row))
    axis = out.index(op.axis)
    with np.errstate(invalid="ignore"):  # inf - inf in rows holding +inf: NaN, as it should be
        peak = np.max(x, axis=axis, keepdims=True)
        # every position masked (or -inf): zeros when safe, else -inf - -inf makes the row NaN
        empty = (peak == -np.inf) & op.safe
        np.subtract(x, np.where(empty, 0.0, peak), out=x)
        np.exp(x, out=x)
        total = np.sum(x, axis=axis, keepdims=True)
        np.divide(x, np.where(empty, 1.0, total), out=x)
    return x


def _along(axis: int, ranks: int) -> list[int]:
    shape = [1] * ranks
    shape[axis] = -1
    return shape


# -- gelu's erf -----------------------------------------------------------------------------------


@functools.cache
def _scipy_erf() -> Callable[[F64], F64] | None:
    """scipy's vectorised erf if scipy is installed (it is not a core dependency)."""
    try:
        special = importlib.import_module("scipy.special")
    except ImportError:
        return None
    fn: Callable[[F64], F64] = special.erf
    return fn


_math_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_math(x: F64) -> F64:
    """erf from the C library through `math.erf`, element by element: exact, ~10x slower."""
    return np.asarray(_math_erf(x), dtype=np.float64)


def _erf(x: F64) -> F64:
    fn = _scipy_erf()
    return _erf_math(x) if fn is None else np.asarray(fn(x), dtype=np.float64)


# -- inputs ---------------------------------------------------------------------------------------


def random_inputs(chain: Chain, seed: int = 0, scale: float = 1.0) -> dict[str, NDArray[Any]]:
    """Deterministic random inputs for which every intermediate and output is O(1).

    Arrays have the chain's dtype as numpy dtype, except bfloat16, which numpy lacks: those are
    float32 arrays whose values are exactly representable in bfloat16 (rounded to nearest even),
    so a bf16 kernel and the oracle read the very same numbers.

    Values are N(0, 1), except one operand of each contraction (the second if it is an input, a
    "weight"), which is divided by sqrt(reduction length) as in LeCun initialisation, so that
    sums stay O(1) instead of growing with K. If a softmax with scale `s` reads the
    contraction's result, the weight is also divided by `s`, so the softmax sees O(1) scores
    (for attention: Q and K are both N(0, 1), the usual test setup); a weight multiplied by a
    softmax's output is not divided (its rows sum to 1), so V is N(0, 1) too. `scale`
    multiplies every input but the masks (the outputs then grow like a power of it: meant for
    large-magnitude tests). Bool masks are random with the first position of every row along
    the softmax axis kept (that position also survives a causal mask), so no row is masked out
    entirely unless a test builds one on purpose. Additive masks are finite: N(0, 1), with about
    a quarter of the positions at -1e4 (finite in float16), the first of every row ordinary.

    Each tensor has its own stream seeded from `(seed, crc32(name))`, so adding an input to a
    chain does not change the values of the others.
    """
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    std = _input_stds(chain)
    masks = {
        op.mask.tensor: op for op in chain.ops if isinstance(op, Softmax) and op.mask is not None
    }
    result: dict[str, NDArray[Any]] = {}
    for t in chain.inputs:
        rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
        soft = masks.get(t.name)
        if soft is not None and soft.mask_kind is MaskKind.BOOL:
            keep = rng.random(t.shape) < 0.75
            result[t.name] = _keep_first(keep, soft)
            continue
        if soft is not None and soft.mask_kind is MaskKind.ADDITIVE:
            values = rng.standard_normal(t.shape)
            values = np.where(rng.random(t.shape) < 0.25, _LARGE_NEGATIVE, values)
            ordinary = _keep_first(np.zeros(t.shape, dtype=np.bool_), soft)
            values = np.where(ordinary, rng.standard_normal(t.shape), values)
        else:
            values = scale * std.get(t.name, 1.0) * rng.standard_normal(t.shape)
        result[t.name] = _as_dtype(values, t.dtype)
    return result


def _input_stds(chain: Chain) -> dict[str, float]:
    stds: dict[str, float] = {}
    extents = chain.extents
    for op in chain.contractions:
        first, second = (chain.tensor(acc.tensor) for acc in op.inputs)
        weight, other = (second, first) if second.role is Role.INPUT else (first, second)
        if weight.role is not Role.INPUT or weight.name in stds:
            continue
        n = math.prod(extents[x] for x in op.reduction)
        # Softmax rows sum to 1: their product with N(0, 1) values is already O(1).
        std = 1.0 if isinstance(chain.producer(other.name), Softmax) else 1.0 / math.sqrt(n)
        for consumer in chain.consumers(op.output.tensor):
            if isinstance(consumer, Softmax) and consumer.scale != 0.0:
                std /= abs(consumer.scale)
        stds[weight.name] = std
    return stds


def _keep_first(arr: NDArray[np.bool_], soft: Softmax) -> NDArray[np.bool_]:
    """`arr` with True at the first position along the softmax axis.

    True everywhere if the mask is constant along the axis or reads it through an affine index:
    a False there could mask whole rows.
    """
    assert soft.mask is not None
    arr = arr.copy()
    axis_dims = [d for d, ix in enumerate(soft.mask.index) if soft.axis in ix.loops]
    if len(axis_dims) == 1 and soft.mask.index[axis_dims[0]] == Affine.of(soft.axis):
        index: list[slice | int] = [slice(None)] * arr.ndim
        index[axis_dims[0]] = 0
        arr[tuple(index)] = True
    else:
        arr[...] = True
    return arr


def _as_dtype(values: F64, dtype: DType) -> NDArray[Any]:
    if dtype is DType.BFLOAT16:
        return _round_bf16(values)
    return values.astype(np.dtype(dtype.value))


def _round_bf16(values: F64) -> NDArray[np.float32]:
    """float32 values rounded to the nearest bfloat16 (ties to even): its low 16 bits cleared."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> np.uint64(16)) & np.uint64(1)
    bits = (bits + np.uint64(0x7FFF) + lsb) & np.uint64(0xFFFF0000)
    return bits.astype(np.uint32).view(np.float32)


# -- tolerance ------------------------------------------------------------------------------------


def tolerance(chain: Chain, dtype: DType | None = None) -> tuple[float, float]:
    """`(rtol, atol)` for comparing a `dtype` (default: the chain's) kernel with `run`.

    Both are `c * sqrt(n * u_acc**2 + s * u**2)` with `c = 8`, where

    - `n` is the longest reduction path: along the chain's dataflow, the sum of the reduction
      lengths of the contractions (K, then L, ...; C*R*S for a convolution) plus each softmax's
      axis length, maximised over paths;
    - `s` is the number of ops on that path: each writes a tensor rounded to `dtype`;
    - `u` is the unit roundoff of `dtype` (`UNIT_ROUNDOFF`) and `u_acc` that of the accumulator:
      float64 for float64 chains, float32 otherwise (bf16/fp16 kernels accumulate in float32).

    Why the square roots: a kernel's error is a sum of many independent roundings of random
    sign, each of relative size u. Summing n terms makes n of them, and their sum grows like a
    random walk, u*sqrt(n), not like the worst-case bound n*u, which would be so loose that a
    wrong tail (a missing k iteration) could pass. Errors from successive ops add the same way
    (a relative error of the first GEMM's output goes through the second one unamplified), so
    lengths add under the root. The reference's inputs are the kernel's inputs, so input
    rounding does not count; the rounding of each stored result does (`s`, once per op).

    Why c = 8: the kernels measured err by well under 1 of this bound; 8 leaves a wide margin
    for bigger outputs and functions a few ulps off, yet a wrong element still fails
    (docs/tuning.md).

    The measure (`assert_close`) scales atol by max(1, max|expected|): the error of a sum is
    proportional to the size of what was summed, not to the possibly cancelled result.
    """
    dt = chain.dtype if dtype is None else dtype
    u = UNIT_ROUNDOFF[dt]
    u_acc = UNIT_ROUNDOFF[DType.FLOAT64] if dt is DType.FLOAT64 else UNIT_ROUNDOFF[DType.FLOAT32]
    n, s = _longest_path(chain)
    tol = _SAFETY * math.sqrt(n * u_acc**2 + s * u**2)
    return tol, tol


def _longest_path(chain: Chain) -> tuple[int, int]:
    """(reduction length, op count) of the longest dataflow path, each maximised separately."""
    extents = chain.extents
    depth: dict[str, tuple[int, int]] = {}
    for op in chain.ops:
        n_in = max((depth.get(a.tensor, (0, 0))[0] for a in op.reads), default=0)
        s_in = max((depth.get(a.tensor, (0, 0))[1] for a in op.reads), default=0)
        if isinstance(op, Contraction):
            n = math.prod(extents[x] for x in op.reduction)
        elif isinstance(op, Softmax):
            n = extents[op.axis]
        else:
            n = 0
        depth[op.output.tensor] = (n_in + n, s_in + 1)
    return max(d[0] for d in depth.values()), max(d[1] for d in depth.values())


def softmax_error(
    chain: Chain, inputs: Mapping[str, NDArray[Any]], dtype: DType | None = None
) -> NDArray[np.float64] | None:
    """What a softmax between two contractions may add to the output's error, per element.

    A softmax turns a *relative* error of its input into an *absolute* error of an exponent:
    scores `s = scale * sum_k q_k k_k` computed with relative error `tau` (the same random-walk
    estimate as `tolerance`: `tau = c * sqrt(K * u_acc**2 + u**2)`, relative to `sum_k |q_k k_k|`)
    come out as `s + d` with `|d| <= delta = tau * |scale| * sum_k |q_k k_k| + c * u * |s|` (plus
    `c * u * |mask|` where a finite additive mask is added), and
    `exp(s + d)` is off by a factor up to `exp(delta)`. With O(1) scores that is the relative
    error `tolerance` already allows; with large inputs (|q|, |k| ~ 100) `delta` reaches 1 and
    more, and an exact kernel rightly differs from the oracle by far more than `tolerance`.

    The bound is taken relative to each row's largest score `r` (softmax ignores a common shift,
    so only `d_j - d_r` matters): with `e_j = delta_j + delta_r` (0 at `r`),
    `p'_j / p_j` lies in `[exp(-e_j) / Z_hi, exp(e_j) / Z_lo]`, `Z_hi = sum_k p_k exp(e_k)`,
    `Z_lo = sum_k p_k exp(-e_k)`, so `|p'_j - p_j| <= dp_j` (also <= 1), and the output
    `sum_j p_j v_j` moves by at most `sum_j dp_j |v_j|`. Where the softmax is one-hot (huge
    scores, well separated) that is ~0, where scores nearly tie at huge magnitude it is up to
    `|v|`: rounding alone really can pick the other key there.

    None if the chain has no softmax read by its last contraction from a contraction's result.
    """
    softs = [op for op in chain.ops if isinstance(op, Softmax)]
    last = chain.ops[-1]
    if len(softs) != 1 or not isinstance(last, Contraction):
        return None
    (sm,) = softs
    producer = next((op for op in chain.ops if op.output.tensor == sm.input.tensor), None)
    if not isinstance(producer, Contraction) or sm.output.tensor not in (
        acc.tensor for acc in last.inputs
    ):
        return None
    dt = chain.dtype if dtype is None else dtype
    u = UNIT_ROUNDOFF[dt]
    u_acc = UNIT_ROUNDOFF[DType.FLOAT64] if dt is DType.FLOAT64 else UNIT_ROUNDOFF[DType.FLOAT32]
    extents = chain.extents
    env = _check_inputs(chain, inputs)
    absolute = {k: (v if v.dtype == np.bool_ else np.abs(v)) for k, v in env.items()}
    for op in chain.ops:
        if op is sm:
            break
        env[op.output.tensor] = evaluate(op, chain, env)
        absolute[op.output.tensor] = evaluate(op, chain, absolute)
    out = _output_loops(sm.output)
    axis = out.index(sm.axis)
    probs = _softmax(sm, env, extents, out)  # exactly 0 where masked
    n_red = math.prod(extents[x] for x in producer.reduction)
    tau = _SAFETY * math.sqrt(n_red * u_acc**2 + u**2)
    size = _aligned(sm.input, _real(absolute, sm.input), extents, out)
    scores = np.abs(_aligned(sm.input, _real(env, sm.input), extents, out) * sm.scale)
    if sm.cap is not None:
        # cap tanh(s / cap) moves by at most what s moves (its slope is at most 1), is rounded
        # at |cap tanh| <= |s|, and its tanh is evaluated to an absolute error of a few units
        # of roundoff of 1, times cap
        scores = sm.cap * np.tanh(scores / sm.cap) + 4.0 * sm.cap * (u_acc / u)
    delta = tau * abs(sm.scale) * size + _SAFETY * u * scores
    if sm.mask is not None and sm.mask_kind is MaskKind.ADDITIVE:  # s + mask, rounded once
        mask = np.abs(_aligned(sm.mask, _real(env, sm.mask), extents, out))
        delta = delta + _SAFETY * u * np.where(np.isfinite(mask), mask, 0.0)
    # a score made non-finite by an inf or NaN input is exact (-inf: a key of weight 0; +inf or
    # NaN: the row is NaN, compared exactly): no error of its own, and no inf - inf below
    delta = np.where(np.isfinite(delta), delta, 0.0)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lp = np.log(probs)  # -inf where masked or underflowed: those terms vanish below
        top = np.argmax(probs, axis=axis)
        d_top = np.take_along_axis(delta, np.expand_dims(top, axis), axis)
        e = delta + d_top
        np.put_along_axis(e, np.expand_dims(top, axis), 0.0, axis)
        log_hi = np.log(np.sum(np.exp(np.minimum(lp + e, 700.0)), axis=axis, keepdims=True))
        log_lo = np.log(np.sum(np.exp(lp - e), axis=axis, keepdims=True))
        up = np.exp(np.minimum(lp + e - log_lo, 700.0)) - probs
        down = probs - np.exp(lp - e - log_hi)
        dp = np.minimum(np.nan_to_num(np.maximum(np.maximum(up, down), 0.0), nan=0.0), 1.0)
    # a non-finite value makes the outputs it reaches with weight > 0 non-finite (compared
    # exactly); with weight 0 (a masked key) it adds no error: 0 here, not 0 * inf
    finite = {k: v if v.dtype == np.bool_ else np.where(np.isfinite(v), v, 0.0)
              for k, v in absolute.items()}  # fmt: skip
    return evaluate(last, chain, {**finite, sm.output.tensor: dp})


def assert_close(
    actual: NDArray[Any],
    expected: NDArray[Any],
    chain: Chain,
    name: str = "output",
    dtype: DType | None = None,
    inputs: Mapping[str, NDArray[Any]] | None = None,
    peak: float | None = None,
) -> None:
    """Raise AssertionError unless `|a - e| <= atol * max(1, max|e|) + rtol * |e| + extra`
    everywhere.

    `(rtol, atol) = tolerance(chain, dtype)`; `max|e|` is over the finite expected values, or
    `peak` where given: the largest of the values the result was computed from where an
    activation after them shrinks them (a conv chain's ReLU6 `after` clips sums of thousands to
    6; their rounding is of thousands).
    `extra` is `softmax_error(chain, inputs)` when the `inputs` are given and the chain has a
    softmax between two contractions (0 otherwise): the part of the same rounding analysis that
    depends on the inputs' magnitude. Where `expected` is finite, a NaN or inf in `actual`
    fails; where it is not, `actual` must be the same inf or also NaN. The message names the
    worst element (largest error among the failing ones), its index, the bound there, and how
    many elements failed.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape {a.shape} != expected shape {e.shape}")
    rtol, atol = tolerance(chain, dtype)
    finite = np.isfinite(e)
    if peak is None:
        peak = float(np.max(np.abs(e[finite]))) if finite.any() else 0.0
    floor = atol * max(1.0, peak)
    extra = None if inputs is None else softmax_error(chain, inputs, dtype)
    with np.errstate(invalid="ignore"):
        diff = np.abs(a - e)
        bound = floor + rtol * np.abs(np.where(finite, e, 0.0))
        if extra is not None:
            bound = bound + extra
        ok = np.where(finite, diff <= bound, (a == e) | (np.isnan(a) & np.isnan(e)))
    failed = int(np.count_nonzero(~ok))
    if failed == 0:
        return
    worst = np.where(ok, -1.0, np.where(np.isnan(diff), np.inf, diff))
    where = tuple(int(i) for i in np.unravel_index(int(np.argmax(worst)), a.shape))
    dt = (chain.dtype if dtype is None else dtype).value
    raise AssertionError(
        f"{name}: {failed} of {a.size} elements not close (chain {chain.name}, {dt}); "
        f"max abs error {float(diff[where]):.6g} at index {where}: actual {float(a[where])!r}, "
        f"expected {float(e[where])!r}, allowed {float(bound[where]):.6g} "
        f"(rtol={rtol:.3g}, atol={atol:.3g} x max(1, max|expected|={peak:.6g}))"
    )
