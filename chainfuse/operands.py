"""Operands of a compiled kernel's call: check them, and read their pointers and strides.

Arrays are passed by pointer and strides: any layout whose last dimension is contiguous works
without a copy; anything else is an error naming the tensor (never a silent copy). These run on
every kernel call, so the common case takes the fewest attribute lookups.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

__all__ = [
    "NP_DTYPES",
    "TORCH_TYPES",
    "Arg",
    "Layout",
    "apart",
    "check",
    "contiguous",
    "dense_in",
    "dense_strides",
    "empty_like_input",
    "is_torch",
    "layout",
    "layout_of",
    "overlap",
    "pointer",
    "recheck",
    "torch_dtype",
    "torch_empty",
]

#: A validated array argument: its data pointer and its strides in elements (a plain tuple: a
#: call checks four to six of them, and a dataclass would cost a microsecond each)
Arg = tuple[int, tuple[int, ...]]

#: the types found to be torch tensors (`is_torch`): a set lookup after the first
TORCH_TYPES: set[type] = set()


def is_torch(x: object) -> bool:
    """Whether `x` is a torch tensor, found without importing torch."""
    kind = type(x)
    if kind in TORCH_TYPES:
        return True
    if kind.__module__.split(".")[0] == "torch" or any(
        k.__name__ == "Tensor" and k.__module__ == "torch" for k in kind.__mro__
    ):  # (a subclass of torch.Tensor defined anywhere: nn.Parameter, a user's own)
        TORCH_TYPES.add(kind)
        return True
    return False


def check(
    name: str,
    x: object,
    shape: tuple[int, ...],
    writable: bool = False,
    dtype: str = "float32",
    inner_contiguous: bool = True,
) -> Arg:
    """Validate one argument (a numpy array or a CPU tensor of `dtype` and `shape`) and return
    its pointer and element strides; errors name the tensor and what was expected."""
    if type(x) is np.ndarray:
        want = NP_DTYPES.get(dtype)
        if x.dtype != want if want is not None else x.dtype.name != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")
        flags = x.flags
        if writable and not flags.writeable:
            raise ValueError(f"{name}: the output array is read-only")
        if flags.c_contiguous:
            strides = contiguous(shape)
        else:
            size = x.itemsize
            strides = tuple(s // size for s in x.strides)
            if any(s % size for s in x.strides):
                raise ValueError(f"{name}: strides {x.strides} are not whole elements")
        ptr = pointer(x)
    elif is_torch(x):
        t: Any = x
        if not t.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
        if t.dtype is not torch_dtype(dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.shape != shape:  # a torch.Size is a tuple
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.requires_grad and writable:
            raise ValueError(f"{name}: the output must not require grad")
        if t.layout is not sys.modules["torch"].strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
        strides = tuple(t.stride())
        ptr = int(t.data_ptr())
    elif isinstance(x, np.ndarray):  # a subclass: the same checks, the slow way
        return check(name, np.asarray(x), shape, writable, dtype, inner_contiguous)
    else:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    if inner_contiguous and shape and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name}: its last dimension must be contiguous (stride 1, got {strides[-1]}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    return ptr, strides


def recheck(
    name: str, x: Any, shape: tuple[int, ...], dtype: str, inner_contiguous: bool = True
) -> Arg:
    """`check` for an operand whose kind, dtype, device and grad flag a replay key fixed (a
    numpy array or a CPU tensor outside autograd): its shape and strides only, the rest by
    `check`, which also raises what is wrong."""
    if type(x) is np.ndarray:
        if x.shape == shape and x.flags.c_contiguous:
            return pointer(x), contiguous(shape)
    elif x.shape == shape:
        strides = x.stride()
        if strides[-1:] == (1,):
            return x.data_ptr(), strides
    return check(name, x, shape, dtype=dtype, inner_contiguous=inner_contiguous)


def pointer(x: Any) -> int:
    """The data pointer of an operand `check` took before with this kind, shape, strides,
    dtype and (numpy) writeable flag, or is checking now. `from_buffer` takes only whole
    writable buffers."""
    if type(x) is np.ndarray:
        flags = x.flags
        if flags.writeable and flags.c_contiguous:
            return ctypes.addressof(_BYTE.from_buffer(cast(Any, x)))  # 3x .ctypes.data's speed
        return int(x.ctypes.data)
    return int(x.data_ptr())


#: numpy's dtype objects of the chain dtype names that numpy has
NP_DTYPES = {"float32": np.dtype(np.float32), "bool": np.dtype(np.bool_)}
_TORCH_DTYPES: dict[str, Any] = {}


def torch_dtype(dtype: str) -> Any:
    """torch's dtype object of a chain dtype name (torch is imported: a tensor was passed)."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        import torch

        found = _TORCH_DTYPES[dtype] = getattr(torch, dtype)
    return found


_BYTE = ctypes.c_char


def torch_empty(like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """A new contiguous CPU tensor for a call's output: `torch.empty_like` of an input of that
    shape, dtype and layout when there is one (without keyword arguments it costs half as
    much)."""
    found = torch_dtype(dtype)
    torch = sys.modules["torch"]  # imported: `like` is a tensor
    if like.shape == shape and like.dtype is found and like.is_contiguous():
        return torch.empty_like(like)
    return torch.empty(shape, dtype=found)


@functools.lru_cache(maxsize=1024)
def contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape`."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


def dense_strides(
    name: str, x: Any, shape: tuple[int, ...], writable: bool = False, dtype: str = "float32"
) -> Arg:
    """A `dtype` CPU array in NCHW or channels-last (NHWC) memory order, or a contiguous 1-D one.

    The kernel reads and writes through strides, so both orders are zero-copy; any other layout
    (a strided view) is refused rather than silently copied. The checks are `check`'s, and a
    (shape, strides) pair found dense once is remembered (layouts only, never data).
    """
    arg = check(name, x, shape, writable, dtype, inner_contiguous=False)
    strides = arg[1]
    if (shape, strides) not in _DENSE:
        orders = _ORDERS if len(shape) == 4 else ((0,),)
        if not any(dense_in(order, shape, strides) for order in orders):
            kinds = "NCHW or channels_last" if len(shape) == 4 else "contiguous"
            raise ValueError(
                f"{name}: expected a {kinds} array, got strides {strides} for shape {shape}; "
                "pass a contiguous copy (x.contiguous() / np.ascontiguousarray(x))"
            )
        if len(_DENSE) < 4096:
            _DENSE.add((shape, strides))
    return arg


#: (shape, element strides) pairs already found dense (NCHW, channels-last or 1-D contiguous)
_DENSE: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()


_ORDERS = ((0, 1, 2, 3), (0, 2, 3, 1))


def dense_in(order: tuple[int, ...], shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the dims, innermost last in `order`, are packed without gaps (size-1 dims free)."""
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return False
        expected *= shape[d]
    return True


def empty_like_input(
    x: Any, shape: tuple[int, ...], channels_last: bool, dtype: str = "float32"
) -> Any:
    """A new result of `x`'s kind in `x`'s memory order (numpy: NCHW or an NHWC-ordered view),
    of `dtype` (x's own kind of it: a torch dtype for a tensor, numpy's for an array)."""
    if is_torch(x):
        import torch

        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(shape, dtype=getattr(torch, dtype), memory_format=fmt)
    np_dtype = x.dtype if dtype != "float32" else np.float32
    if channels_last:
        N, K, P, Q = shape
        return np.empty((N, P, Q, K), dtype=np_dtype).transpose(0, 3, 1, 2)
    return np.empty(shape, dtype=np_dtype)


#: Where an operand's elements lie: (first byte, one past the last byte) relative to its data
#: pointer, its shape, and its strides in bytes; a call's spans are fixed by its replay key
Layout = tuple[int, int, tuple[int, ...], tuple[int, ...]]


def layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> Layout:
    """The `Layout` of an operand of `shape` and element `strides` (which may be negative)."""
    steps = tuple(s * itemsize for s in strides)
    if 0 in shape:
        return 0, 0, shape, steps
    ends = [(n - 1) * s for n, s in zip(shape, steps, strict=True)]
    lo = sum(e for e in ends if e < 0)
    return lo, sum(e for e in ends if e > 0) + itemsize, shape, steps


def layout_of(x: Any, shape: tuple[int, ...]) -> Layout:
    """The `Layout` of a numpy array or tensor that `check` took as `shape`."""
    if isinstance(x, np.ndarray):
        size = x.itemsize
        return layout(shape, tuple(s // size for s in x.strides), size)
    return layout(shape, tuple(x.stride()), x.element_size())


def overlap(p: int, a: Layout, q: int, b: Layout) -> bool:
    """Whether operands at pointers `p` and `q` with layouts `a` and `b` share a byte: their
    spans first (a few integer comparisons), then numpy's exact test where the spans meet
    (interleaved views, such as the halves of one buffer, share none)."""
    if not (p + a[0] < q + b[1] and q + b[0] < p + a[1]) or a[0] == a[1] or b[0] == b[1]:
        return False
    try:
        shares: Any = np.shares_memory  # (its stubs take only max_work -1 or 0)
        return bool(shares(_bytes_at(p, a), _bytes_at(q, b), max_work=1 << 16))
    except np.exceptions.TooHardError:  # (too costly to decide exactly: taken as overlapping)
        return True


def _bytes_at(ptr: int, at: Layout) -> Any:
    """A numpy view of the bytes an operand covers (a uint8 dim for each element's bytes)."""
    lo, hi, shape, steps = at
    memory: Any = (ctypes.c_char * (hi - lo)).from_address(ptr + lo)
    buf = np.frombuffer(memory, np.uint8)
    item = hi - lo - sum(abs((n - 1) * s) for n, s in zip(shape, steps, strict=True))
    return np.lib.stride_tricks.as_strided(buf[-lo:], (*shape, item), (*steps, 1))


def apart(out: tuple[int, Layout], inputs: Sequence[tuple[str, int, Layout]]) -> None:
    """Raise a ValueError naming `out` and the first input it overlaps in memory (the kernel
    would read what it has already written), or `out` alone when its own elements overlap (a
    stride of 0, an expanded view: two results would land on one element)."""
    e, at = out
    _, _, shape, steps = at
    if _self_overlapping(shape, steps):
        raise ValueError(
            f"out: its elements overlap each other (shape {shape}, byte strides {steps}: an "
            "expanded or self-overlapping view); pass an array with one element per result"
        )
    for name, p, layout_ in inputs:
        if overlap(e, at, p, layout_):
            raise ValueError(
                f"out: overlaps the input {name} in memory (the kernel would read results it "
                f"has written); pass an out that shares no memory with {name}"
            )


def _self_overlapping(shape: tuple[int, ...], steps: tuple[int, ...]) -> bool:
    """Whether two elements may share a byte: each dim's stride, smallest first, must step over
    everything the dims inside it span (a sufficient test; every dense or sliced layout
    passes it)."""
    if 0 in shape:  # (no elements: none overlap)
        return False
    span = 0
    for step, n in sorted((abs(s), n) for n, s in zip(shape, steps, strict=True) if n > 1):
        if step <= span:
            return True
        span += step * (n - 1)
    return False
