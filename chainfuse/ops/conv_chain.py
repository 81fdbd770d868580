"""`conv_chain`: conv2d -> [activation] -> conv2d (-> [activation]) in one kernel, PyTorch's
layouts.

y = chainfuse.ops.conv_chain(x, w1, w2, stride=(2, 1), padding=(1, 0), between="relu")
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from chainfuse import builders
from chainfuse.codegen.amx_conv import AMX_PACKED
from chainfuse.codegen.conv import conv_activation
from chainfuse.compiled import finite as _finite
from chainfuse.ops.arguments import (
    dtype_name,
    inference_only,
    no_work,
    on_cpu,
    plain,
    shape_of,
    subclassed,
)
from chainfuse.ops.calls import ConvReplay, amx_setting, calls, replay_conv, signature
from chainfuse.runtime import get_num_threads

__all__ = ["PackedConvWeights", "conv_chain", "pack_conv_weights", "paddings", "pair"]


@dataclass(frozen=True)
class PackedConvWeights:
    """A conv chain's w1 and w2 packed once (`pack_conv_weights`), as the fp32 kernels of one
    micro-kernel read them, or the bf16 AMX kernel (VNNI tiles): `conv_chain(..., packed=...)`
    reads these instead of packing the weights each call. They hold the weights' values when
    packed: pack again after the weights change."""

    data: Any  # float32 (bf16 pairs, for AMX), 64-byte aligned: a tensor or an array
    micro: str  # the micro-kernel they are packed for ("amx": the AMX kernel)
    finite: bool  # every weight finite (no NaN a padded tap would spread: `padded_taps`)


def conv_chain(
    x: Any,
    w1: Any,
    w2: Any,
    b1: Any = None,
    b2: Any = None,
    stride: int | tuple[int, int] = (1, 1),
    padding: int | tuple[int, int | tuple[int, int]] = (0, 0),
    between: str | None = None,
    after: str | None = None,
    out: Any = None,
    packed: PackedConvWeights | None = None,
    groups: int | tuple[int, int] = (1, 1),
) -> Any:
    """`conv2d(between(conv2d(x, w1, b1, stride[0], padding[0])), w2, b2, stride[1], padding[1],
    groups=groups[1])`, fused into one kernel, then `after` on the result. `between` and `after` are None or one of
    `ir.ACTIVATION_NAMES` (relu, the gelus, silu as YOLO's conv -> BN -> SiLU, relu6, hardswish,
    mish as YOLOv4's, squared_relu).

    `x` [N, C, H, W] and the weights [K, C, R, S] (PyTorch's layouts; dilation 1) are
    float32 numpy arrays or torch CPU tensors (or bf16 tensors: AMX kernels, `CHAINFUSE_AMX`),
    in NCHW or channels-last memory order, read
    through their strides (no copy of a whole tensor): channels-last input in place (the
    micro-kernel reads slivers of pixels where they are, all rows of taps in one call; only
    windows touching the padding are packed), NCHW input row band by row band through a
    channels-last buffer per thread. The result has `x`'s kind and memory order (numpy: NCHW),
    or is written into `out` (channels-last: in place; NCHW: a band of rows at a time through a
    channels-last buffer per thread). An unbatched `x` [C, H, W] gives [K2, P, Q], as PyTorch's
    conv2d does. `packed`: w1 and w2 as `pack_conv_weights` packed them (for x's dtype), read in
    place of packing them in each call (which reads and writes every weight once: most of a
    call's time where the images are small and the channels many). The second conv's padding
    may be `(before, after)` each axis (TF's "SAME" at stride 2: `padding=(0, (0, 1))`, as an
    `F.pad` of `(0, 1, 0, 1)` before it would give). `groups`, per conv as
    PyTorch's conv2d takes it: the first conv's is 1; the second's 1, or w1's K1 output channels
    (depthwise, w2 [K1, 1, R2, S2]: MobileNet's expansion -> depthwise), on float32.
    """
    if len(getattr(x, "shape", ())) == 3:  # unbatched: one image, as conv2d takes it
        one = conv_chain(x[None], w1, w2, b1, b2, stride, padding, between, after,
                         None if out is None else out[None], packed, groups)  # fmt: skip
        return one[0] if out is None else out
    if packed is not None and not isinstance(packed, PackedConvWeights):
        raise TypeError(f"packed: expected pack_conv_weights' result, got {type(packed).__name__}")
    micro = None if packed is None else packed.micro
    threads = get_num_threads()
    key = None
    if (
        _plain_pair(stride)
        and _plain_padding(padding)
        and _plain_pair(groups)
        and (between is None or between.__class__ is str)
        and (after is None or after.__class__ is str)
    ):
        sig = signature((x, w1, w2, b1, b2, out))
        if sig is not None:
            key = ("conv_chain", stride, padding, between, after, threads, amx_setting(), sig,
                   micro, groups)  # fmt: skip
            replays = calls.conv_replays
            hit = replays.get(key)
            if hit is not None:
                replays.hits += 1
                at = None if packed is None else hit.kernel.check_packed(packed.data)
                done = replay_conv(hit, (x, w1, w2, b1, b2), out, threads, at)
                return hit.kernel.padded_taps(done, w1, w2, packed is not None and packed.finite)
            replays.misses += 1
    if subclassed(x, w1, w2, b1, b2, out):  # (np.memmap and such: plain arrays over their memory)
        found = conv_chain(plain(x), plain(w1), plain(w2), plain(b1), plain(b2), stride, padding,
                           between, after, plain(out), packed, groups)  # fmt: skip
        return found if out is None else out
    sizes, dtype = _checked(x, w1, w2, b1, b2, out, stride, padding, between, after, groups)
    N, _, H, W, _, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, _, pad2_after = sizes
    if N == 0:  # no images: an empty result (numpy's and PyTorch's answer)
        P1, Q1 = builders.conv_out_size(H, R1, st1, pad1), builders.conv_out_size(W, S1, st1, pad1)
        P2, Q2 = (
            builders.conv_out_size(P1, R2, st2, pad2, pad2_after),
            builders.conv_out_size(Q1, S2, st2, pad2, pad2_after),
        )
        return no_work("x", x, (0, K2, P2, Q2), 0, out)
    if packed is not None and (packed.micro == AMX_PACKED) != (dtype == "bfloat16"):
        for_amx = "the bf16 AMX kernel" if packed.micro == AMX_PACKED else "float32 kernels"
        raise ValueError(f"packed: weights packed for {for_amx}, got {dtype} x, w1, w2")
    kernel = calls.conv_kernels(sizes, between, after, dtype, amx_setting(), micro, threads)
    at = None if packed is None else kernel.check_packed(packed.data)
    out, pointers, strides, channels_last = kernel.bind(x, w1, w2, b1, b2, out)
    kernel.launch(pointers, strides, threads, at)
    if key is not None:
        layouts = tuple(kernel.layouts((x, w1, w2, b1, b2, out)))
        calls.conv_replays.remember(
            key, ConvReplay(kernel, strides, kernel.out_shape, channels_last, layouts)
        )
    return kernel.padded_taps(out, w1, w2, packed is not None and packed.finite)


def _checked(
    x: Any, w1: Any, w2: Any, b1: Any, b2: Any, out: Any, stride: Any, padding: Any,
    between: str | None, after: str | None, groups: Any = (1, 1),
) -> tuple[tuple[int, ...], str]:  # fmt: skip
    """A conv chain call's checks of its operands and arguments (each error names one): its
    sizes `(N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, depthwise, pad2_after)`
    and its
    dtype."""
    N, C, H, W = _conv_operand("x", x, 4, batch=True)
    on_cpu("x, w1, w2, b1, b2, out", x, w1, w2, b1, b2, out)
    inference_only("x, w1, w2, b1, b2", x, w1, w2, b1, b2)
    K1, C1, R1, S1 = _conv_operand("w1", w1, 4)
    K2, C2, R2, S2 = _conv_operand("w2", w2, 4)
    dtype = dtype_name(x.dtype)
    if dtype not in ("float32", "bfloat16"):
        raise TypeError(f"x: expected dtype float32 (or bfloat16: AMX kernels), got {x.dtype}")
    for name, arg in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
        if arg is not None and dtype_name(getattr(arg, "dtype", None)) != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (x's), got {arg.dtype}")
    if C1 != C:
        raise ValueError(f"w1: expected {C} input channels (x's C), got shape {(K1, C1, R1, S1)}")
    g1, g2 = pair("groups", groups, 1)
    if g1 != 1:
        raise ValueError(f"groups: the first conv's groups must be 1, got {groups!r}")
    if g2 not in (1, K1):
        raise ValueError(
            f"groups: the second conv's groups must be 1 or w1's {K1} output channels "
            f"(depthwise), got {groups!r}"
        )
    depthwise = g2 == K1 and K1 > 1  # (one channel: a dense conv, the same sums)
    if depthwise and (K2, C2) != (K1, 1):
        raise ValueError(
            f"w2: expected [{K1}, 1, R, S] for a depthwise second conv (groups {K1}), "
            f"got shape {(K2, C2, R2, S2)}"
        )
    if not depthwise and C2 != K1:
        raise ValueError(
            f"w2: expected {K1} input channels (w1's output channels), got shape {(K2, C2, R2, S2)}"
        )
    if depthwise and dtype != "float32":
        raise TypeError(f"groups: a depthwise second conv runs in float32 only, got {dtype} x")
    for name, bias, k in (("b1", b1, K1), ("b2", b2, K2)):
        if bias is not None and _conv_operand(name, bias, 1) != (k,):
            raise ValueError(f"{name}: expected shape ({k},), got {tuple(bias.shape)}")
    st1, st2 = pair("stride", stride, 1)
    pad1, pad2, pad2_after = paddings(padding)
    conv_activation(between, "between")
    conv_activation(after, "after")
    if H + 2 * pad1 < R1 or W + 2 * pad1 < S1:
        raise ValueError(
            f"w1: kernel {R1}x{S1} is larger than the padded input {H + 2 * pad1}x{W + 2 * pad1}"
        )
    P1, Q1 = builders.conv_out_size(H, R1, st1, pad1), builders.conv_out_size(W, S1, st1, pad1)
    both = pad2 + pad2_after
    if P1 + both < R2 or Q1 + both < S2:
        raise ValueError(
            f"w2: kernel {R2}x{S2} is larger than the first conv's padded output "
            f"{P1 + both}x{Q1 + both}"
        )
    sizes = (N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, int(depthwise), pad2_after)
    return sizes, dtype


def _conv_operand(name: str, x: Any, ndim: int, batch: bool = False) -> tuple[int, ...]:
    """Shape of a conv operand after the checks that need no sizes: kind, dtype, device, rank;
    sizes positive (a batch of zero images allowed where `batch`)."""
    shape = shape_of(name, x, float32=False)  # (the dtype: checked by the caller)
    device = getattr(x, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device {device}")
    if len(shape) != ndim:
        also = " [N, C, H, W] (or 3, [C, H, W]: one image)" if batch else ""
        raise ValueError(f"{name}: expected {ndim} dims{also}, got shape {shape}")
    if any(s <= 0 for s in shape[int(batch) :]) or shape[0] < 0:
        what = "sizes after the batch" if batch else "sizes"
        raise ValueError(f"{name}: {what} must be positive, got shape {shape}")
    return shape


def pair(name: str, value: Any, least: int) -> tuple[int, int]:
    """`value` (stride, padding or groups) as the two convs' ints, each >= `least`: one int
    serves both."""
    if isinstance(value, numbers.Integral):  # (numpy's integers too)
        pair: tuple[Any, ...] = (value, value)
    else:
        try:
            pair = tuple(value)
        except TypeError:
            pair = ()
    if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, numbers.Integral)
                             for v in pair):  # fmt: skip
        raise ValueError(
            f"{name}: expected two integers (first conv, second conv) or one for both, got {value!r}"
        )
    if any(v < least for v in pair):
        raise ValueError(f"{name}: expected integers >= {least}, got {value!r}")
    return int(pair[0]), int(pair[1])


def paddings(value: Any) -> tuple[int, int, int]:
    """(the first conv's padding, the second's before and after each axis) from `padding`: one
    int for both, or (first, second) where second may be (before, after)."""
    if isinstance(value, tuple | list) and len(value) == 2 and isinstance(value[1], tuple | list):
        pad1 = pair("padding", (value[0], value[0]), 0)[0]
        if len(value[1]) != 2:
            raise ValueError(f"padding: the second conv's (before, after) is two integers, "
                             f"got {value!r}")  # fmt: skip
        pad2, pad2_after = pair("padding", tuple(value[1]), 0)
        return pad1, pad2, pad2_after
    pad1, pad2 = pair("padding", value, 0)
    return pad1, pad2, pad2


def _plain_padding(value: Any) -> bool:
    """A padding a key may hold as given: `_plain_pair`, or (int, (int, int))."""
    if _plain_pair(value):
        return True
    return value.__class__ is tuple and len(value) == 2 and value[0].__class__ is int and (
        _plain_pair(value[1]) and value[1].__class__ is tuple)  # fmt: skip


def _plain_pair(value: Any) -> bool:
    """An int or a tuple of two ints (no bools): a stride or padding a key may hold as given."""
    if value.__class__ is int:
        return True
    return value.__class__ is tuple and len(value) == 2 and all(v.__class__ is int for v in value)


def pack_conv_weights(
    x: Any,
    w1: Any,
    w2: Any,
    stride: int | tuple[int, int] = (1, 1),
    padding: int | tuple[int, int | tuple[int, int]] = (0, 0),
    between: str | None = None,
    after: str | None = None,
    groups: int | tuple[int, int] = (1, 1),
) -> PackedConvWeights:
    """w1 and w2 packed once for `conv_chain` calls with these weights, e.g. a model's frozen
    weights: float32, for the micro-kernel a call with `x` (its shape: the images may differ
    later) and these arguments runs on, as its panels; bfloat16, as the AMX kernel's VNNI tiles
    (which depend on the weights' shapes alone). Pass the result as
    `conv_chain(..., packed=...)`."""
    if len(getattr(x, "shape", ())) == 3:
        x = x[None]
    sizes, dtype = _checked(x, w1, w2, None, None, None, stride, padding, between, after, groups)
    sizes = (max(sizes[0], 1), *sizes[1:])  # (no images: packed for one)
    kernel = calls.conv_kernels(sizes, between, after, dtype, amx_setting(), None,
                                get_num_threads())  # fmt: skip
    finite = _finite(w1) and _finite(w2)
    return PackedConvWeights(kernel.pack(w1, w2), kernel.micro, finite)
