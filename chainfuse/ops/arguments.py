"""The checks every op makes of its operands before a kernel's own, whose errors use the
caller's argument names, and the op's new results."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from chainfuse.operands import apart, is_torch, layout_of

__all__ = [
    "batch_dims",
    "dtype_name",
    "dtype_of",
    "empty_result",
    "grad_refused",
    "inference_only",
    "inner_contiguous",
    "new_result",
    "no_work",
    "on_cpu",
    "operands_of",
    "out_apart",
    "plain",
    "shape_of",
    "steps_of",
    "subclassed",
]


def shape_of(name: str, x: Any, float32: bool = True) -> tuple[int, ...]:
    """The argument's shape; errors use the caller's argument names."""
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    if float32 and str(x.dtype) not in ("float32", "torch.float32"):
        raise TypeError(f"{name}: expected dtype float32, got {x.dtype}")
    if isinstance(shape, tuple):  # numpy's, or a torch.Size: ints already
        return tuple(shape)
    return tuple(int(s) for s in shape)


_DTYPES = {"float32": "float32", "torch.float32": "float32", "bfloat16": "bfloat16",
           "torch.bfloat16": "bfloat16", "float16": "float16", "torch.float16": "float16"}  # fmt: skip


_NAMES: dict[Any, str | None] = {}  # dtype object -> its name in _DTYPES (str() is slow)


def dtype_name(dtype: Any) -> str | None:
    """The chain dtype name of an operand's dtype object (None: not one chainfuse takes)."""
    try:
        return _NAMES[dtype]
    except KeyError:
        name = _NAMES[dtype] = _DTYPES.get(str(dtype))
        return name
    except TypeError:  # an unhashable dtype attribute: not an array we take
        return None


def dtype_of(names: str, *xs: Any) -> str:
    """The common dtype of the operands: float32, bfloat16 (a torch.bfloat16 tensor or a numpy
    array of ml_dtypes.bfloat16) or float16; anything else, or a mix, is an error naming them."""
    first = getattr(xs[0], "dtype", None)
    if all(getattr(x, "dtype", None) is first for x in xs):  # one dtype object: name it once
        found = [dtype_name(first)]
    else:
        found = [dtype_name(getattr(x, "dtype", None)) for x in xs]
    if None in found or len(set(found)) != 1:
        got = ", ".join(str(getattr(x, "dtype", type(x).__name__)) for x in xs)
        raise TypeError(f"{names}: expected all float32, all bfloat16 or all float16, got {got}")
    return str(found[0])


def operands_of(names: str, x: Any, y: Any, z: Any) -> tuple[str, tuple[tuple[int, ...], ...]]:
    """The three operands' common dtype name and their shapes. The common case (one dtype
    object, tuple shapes) takes a few attribute reads: a short call's kernel takes tens of us,
    and each generic helper call a microsecond; anything else goes the generic way, whose errors
    name the operands."""
    dt = getattr(x, "dtype", None)
    same = dt is not None and getattr(y, "dtype", None) is dt and getattr(z, "dtype", None) is dt
    dtype = (dtype_name(dt) if same else None) or dtype_of(names, x, y, z)
    sx, sy, sz = getattr(x, "shape", None), getattr(y, "shape", None), getattr(z, "shape", None)
    if isinstance(sx, tuple) and isinstance(sy, tuple) and isinstance(sz, tuple):
        return dtype, (sx, sy, sz)
    labels = names.split(", ")
    return dtype, tuple(
        shape_of(n, a, float32=False) for n, a in zip(labels, (x, y, z), strict=True)
    )


def no_work(name: str, like: Any, shape: tuple[int, ...], value: Any = 0, out: Any = None) -> Any:
    """The result of a call with a zero-size dimension, where no kernel has anything to do (as in
    PyTorch: an empty result, or zeros where a sum runs over nothing): `value` (0, or an array
    that broadcasts to `shape`) as a new array of `like`'s kind and dtype, or written into
    `out`. `like` (the argument `name`) must be on the CPU, as a call with work requires."""
    if is_torch(like) and like.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device {like.device}")
    if out is None:
        if is_torch(like):
            out = sys.modules["torch"].zeros(shape, dtype=like.dtype)
        else:
            out = np.zeros(shape, dtype=like.dtype)
    elif tuple(out.shape) != shape or out.dtype != like.dtype:
        raise ValueError(
            f"out: expected shape {shape} and dtype {like.dtype}, got {tuple(out.shape)} "
            f"{out.dtype}"
        )
    out[...] = value
    return out


def empty_result(like: Any, shape: tuple[int, ...], same: bool) -> Any:
    """A new result of `like`'s kind and dtype: `empty_like(like)` when `same` (a contiguous
    tensor of that shape: without arguments it costs half of `torch.empty`)."""
    if type(like) is np.ndarray:
        return np.empty(shape, like.dtype)
    torch = sys.modules["torch"]
    return torch.empty_like(like) if same else torch.empty(shape, dtype=like.dtype)


def new_result(like: Any, shape: tuple[int, ...]) -> tuple[Any, bool]:
    """A new result for a call on `like` (`empty_result`), and whether it is `empty_like(like)`."""
    same = is_torch(like) and tuple(like.shape) == shape and bool(like.is_contiguous())
    return empty_result(like, shape, same), same


def batch_dims(
    sq: Sequence[Any], sk: Sequence[Any], sv: Sequence[Any], n: int, names: str = "q, k, v"
) -> tuple[Any, ...]:
    """The first `n` dims of shapes `sq`, `sk`, `sv` broadcast (each equal or 1; sizes may be
    symbolic), or a ValueError naming them (as `names`)."""
    batch = []
    for dims in zip(sq[:n], sk[:n], sv[:n], strict=True):
        wide = [d for d in dims if d != 1]
        if any(d != wide[0] for d in wide):
            raise ValueError(
                f"{names}: batch dims {tuple(sq[:n])}, {tuple(sk[:n])}, {tuple(sv[:n])} "
                "do not broadcast"
            )
        batch.append(wide[0] if wide else 1)
    return tuple(batch)


def grad_refused(name: str) -> str:
    """The error for a torch operand `name` that requires grad while grad mode is on."""
    return (
        f"{name}: requires grad, and chainfuse's kernels have no backward (inference only): "
        f"call under torch.no_grad() or torch.inference_mode(), or pass {name}.detach()"
    )


def inference_only(names: str, *xs: Any) -> None:
    """torch tensors that require grad, while grad mode is on, are an error naming the first:
    chainfuse's kernels have no backward, and a result detached from the graph without a word
    would surface later as a missing gradient."""
    for i, x in enumerate(xs):
        if getattr(x, "requires_grad", False) is True and is_torch(x):
            if sys.modules["torch"].is_grad_enabled():
                raise RuntimeError(grad_refused(names.split(", ")[i]))
            return


def inner_contiguous(names: str, *xs: Any) -> None:
    """Operands whose last dim is not contiguous (the kernels read rows in place) are an error
    naming the first by the caller's name (the kernel's own check names its chain's tensors)."""
    for i, x in enumerate(xs):
        if x.shape and x.shape[-1] > 1 and 0 not in x.shape:  # (empty: nothing to read)
            step = x.strides[-1] // x.itemsize if type(x) is np.ndarray else x.stride(-1)
            if step != 1:
                raise ValueError(
                    f"{names.split(', ')[i]}: its last dimension must be contiguous (stride 1, "
                    f"got {step}); pass np.ascontiguousarray(x) or x.contiguous()"
                )


def on_cpu(names: str, *xs: Any) -> None:
    """torch operands on another device, or not dense (sparse, mkldnn), are an error naming the
    first by the caller's name (the kernel's own check names its chain's tensors: Q, not q)."""
    for i, x in enumerate(xs):
        if x is not None and is_torch(x):
            if not x.is_cpu:
                raise ValueError(
                    f"{names.split(', ')[i]}: expected a CPU tensor, got device {x.device}"
                )
            if x.layout is not sys.modules["torch"].strided:  # sparse, mkldnn: no strides
                raise TypeError(
                    f"{names.split(', ')[i]}: expected a dense (strided) tensor, got layout "
                    f"{x.layout}"
                )


def plain(x: Any) -> Any:
    """A numpy array subclass (np.memmap, a user's own) as a plain ndarray over its memory;
    anything else as it is."""
    return np.asarray(x) if isinstance(x, np.ndarray) and type(x) is not np.ndarray else x


def subclassed(*xs: Any) -> bool:
    """Whether any of `xs` is a numpy array subclass (`plain` makes it one the kernels take)."""
    return any(isinstance(x, np.ndarray) and type(x) is not np.ndarray for x in xs)


def out_apart(names: str, out: Any, *xs: Any) -> None:
    """An `out=` sharing memory with an operand (named by `names`), or whose own elements
    overlap, is an error naming both: for calls that write `out` piece by piece themselves."""
    if out is None:
        return

    def at(x: Any) -> int:
        return int(x.ctypes.data) if isinstance(x, np.ndarray) else int(x.data_ptr())

    named = [(n, at(x), layout_of(x, tuple(x.shape)))
             for n, x in zip(names.split(", "), xs, strict=True) if x is not None]  # fmt: skip
    apart((at(out), layout_of(out, tuple(out.shape))), named)


def steps_of(x: Any) -> tuple[int, ...]:
    """x's strides in elements."""
    if type(x) is np.ndarray or isinstance(x, np.ndarray):
        return tuple(s // x.itemsize for s in x.strides)
    return tuple(x.stride())
