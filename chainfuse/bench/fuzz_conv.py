"""Fuzz cases of conv chains: `ops.conv_chain`, `chainfuse.torch.conv_chain` and kernels of
`chainfuse.compile(conv_chain_spec(...))` called directly (`chainfuse.bench.fuzz`). float32
only, as the conv kernels are."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import chainfuse
from chainfuse import builders, ops, reference
from chainfuse.bench.fuzz_cases import Case, describe_operand, oracle_torch, pick, special
from chainfuse.bench.fuzz_gemm import subclassed
from chainfuse.bench.fuzz_values import Kind, Layout, Operand, inject, place, rounded, size
from chainfuse.bench.fuzz_values import torch_or_none as _torch
from chainfuse.ir import ACTIVATION_NAMES, Activation

__all__ = ["conv_case"]

_NAMES = frozenset({"x", "w1", "w2", "b1", "b2", "stride", "padding", "between", "after", "out",
                    "groups", "X", "W1", "W2", "K2"})  # fmt: skip
_CHANNELS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 32)


def _geometry(rng: np.random.Generator, alias: bool, depthwise: bool) -> tuple[int, ...]:
    """(N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, after) of a valid, small
    chain (`after`: the second conv's padding after each axis, TF's "SAME" at stride 2 one more
    than before); with
    `alias`, one whose result has x's shape (so out= can be x itself); `depthwise`: a second
    conv of groups K1 (K2 = K1)."""
    while True:
        N = int(pick(rng, [1, 1, 2, 3]))
        C, K1, K2 = (int(pick(rng, _CHANNELS)) for _ in range(3))
        H, W = size(rng, 40), size(rng, 40)
        R1, S1, R2, S2 = (int(pick(rng, [1, 2, 3, 3, 5])) for _ in range(4))
        st1, st2 = (int(pick(rng, [1, 1, 2, 3])) for _ in range(2))
        pad1, pad2 = (int(pick(rng, [0, 0, 1, 2])) for _ in range(2))
        after = pad2 + int(pick(rng, [0, 0, 0, 0, 1]))
        if alias:
            R1 = S1 = R2 = S2 = int(pick(rng, [1, 3]))
            st1 = st2 = 1
            pad1 = pad2 = after = R1 // 2
            K2 = C
        if depthwise:
            K1 = K2
        P1 = builders.conv_out_size(H, R1, st1, pad1)
        Q1 = builders.conv_out_size(W, S1, st1, pad1)
        if P1 < 1 or Q1 < 1 or H + 2 * pad1 < R1 or W + 2 * pad1 < S1:
            continue
        P2 = builders.conv_out_size(P1, R2, st2, pad2, after)
        Q2 = builders.conv_out_size(Q1, S2, st2, pad2, after)
        if P2 < 1 or Q2 < 1 or P1 + pad2 + after < R2 or Q1 + pad2 + after < S2:
            continue
        work = N * (K1 * P1 * Q1 * C * R1 * S1 + K2 * P2 * Q2 * K1 * R2 * S2)
        try:  # (a window that reads only padding along a whole dim: the IR has no such chain)
            builders.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, (st1, st2), (pad1, pad2),
                                     depthwise=depthwise, pad_after=after)  # fmt: skip
        except ValueError:
            continue
        if work <= 1_500_000:
            return N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, after


#: what a conv chain may apply between and after its convolutions (relu drawn most: ResNet's)
_ACTS = [None, "relu", "silu", *(a for a in ACTIVATION_NAMES if a not in ("relu", "silu"))]


def _activation(name: str | None, y: Any) -> Any:
    """PyTorch's own `name` of y: the unfused oracle's."""
    from chainfuse.ops.activations import torch_activations

    return y if name is None else torch_activations()[name](y)


def conv_case(
    rng: np.random.Generator, dtype: str, entries: list[str], compact: bool = False
) -> Case:
    """A random conv chain call: sizes, strides, paddings, biases, activations between and after,
    NCHW / channels-last / refused layouts, numpy-integer strides, out=, NaN/inf or large."""
    torch = _torch()
    features: list[str] = []
    entry = str(pick(rng, entries, [{"ops": 6, "torch": 2, "compile": 2}[e] for e in entries]))
    features.append(entry)
    kind = Kind.TORCH if entry == "torch" else Kind(
        pick(rng, ["numpy", "torch"] if torch is not None else ["numpy"]))  # fmt: skip
    features.append(kind.value)
    out_mode = pick(rng, [None, "out", "out-alias"], [12, 2, 1]) if entry == "ops" else None
    depthwise = rng.random() < 0.25  # (MobileNet's expansion -> depthwise)
    N, C, H, W, K1, R1, S1, K2, R2, S2, st1, st2, pad1, pad2, pad2_after = _geometry(
        rng, out_mode == "out-alias", depthwise
    )
    depthwise = depthwise and K1 > 1  # (one channel: a dense conv, the same sums)
    groups = (1, K1) if depthwise else (1, 1)
    if depthwise:
        features.append("depthwise")
    between = pick(rng, _ACTS, [3, 4, 2] + [1] * (len(_ACTS) - 3))
    after = None if entry == "compile" else pick(rng, _ACTS, [6, 2] + [1] * (len(_ACTS) - 2))
    features += [f"between-{between or 'none'}", f"after-{after or 'none'}"]
    if (st1, st2) != (1, 1):
        features.append("stride")
    if (pad1, pad2) != (0, 0):
        features.append("padding")
    biased = rng.random() < 0.4
    if biased:
        features.append("bias")
    what = special(rng, features, dtype)
    big = 10 ** rng.uniform(2, 8) if what == "large" else 1.0
    per_group = 1 if depthwise else K1
    shapes = {"x": (N, C, H, W), "w1": (K1, C, R1, S1), "w2": (K2, per_group, R2, S2),
              "b1": (K1,), "b2": (K2,)}  # fmt: skip
    stds = {"x": big, "w1": 1 / math.sqrt(C * R1 * S1), "w2": 1 / math.sqrt(per_group * R2 * S2),
            "b1": 0.3 * big, "b2": 0.3 * big}  # fmt: skip
    names = ["x", "w1", "w2", *(["b1", "b2"] if biased else [])]
    values = {x: stds[x] * rng.standard_normal(shapes[x]) for x in names}
    if what in ("nan", "inf"):
        inject(rng, values[pick(rng, names)], what)
    values = {x: rounded(v, dtype) for x, v in values.items()}
    unbatched = N == 1 and entry != "compile" and out_mode is None and rng.random() < 0.15
    if unbatched:
        features.append("unbatched")
    operands: list[Operand] = []
    may_refuse = False
    for x in names:
        v = values[x]
        layout = Layout.CONTIGUOUS
        if v.ndim == 4 and out_mode is None:
            options = [Layout.CONTIGUOUS, Layout.CHANNELS_LAST, Layout.STRIDED]
            weights = [6, 3, 0.25]  # (strided and negative strides: refused, most likely)
            if kind is Kind.NUMPY:
                options.append(Layout.NEGATIVE)
                weights.append(0.25)
            layout = pick(rng, options, weights)
        if layout in (Layout.STRIDED, Layout.NEGATIVE):
            may_refuse = True  # (conv operands: NCHW or channels-last, else a clear error)
        if layout is not Layout.CONTIGUOUS:
            features.append(f"{x}-{layout.value}")
        passed = v[0] if unbatched and x == "x" else v
        array = place(passed, dtype, kind, layout if passed.ndim == 4 else Layout.CONTIGUOUS,
                      rng)  # fmt: skip
        operands.append(Operand(x, array, passed))
    if kind is Kind.NUMPY and entry == "ops" and out_mode is None and rng.random() < 0.05:
        operands[0].array = subclassed(rng, np.ascontiguousarray(operands[0].array), features)
        may_refuse = True
    stride: Any = (st1, st2) if st1 != st2 or rng.random() < 0.5 else st1
    padding: Any = (pad1, pad2) if pad1 != pad2 or rng.random() < 0.5 else pad1
    if pad2_after != pad2:
        padding = (pad1, (pad2, pad2_after))
        features.append("pad-after")
    if entry == "ops" and rng.random() < 0.1:  # numpy integers, as shapes arithmetic gives them
        features.append("np-int")
        stride = np.int64(stride) if isinstance(stride, int) else tuple(np.int64(s) for s in stride)
        padding = np.int64(padding) if isinstance(padding, int) else tuple(
            np.int64(p) if isinstance(p, int) else tuple(map(np.int64, p)) for p in padding)  # fmt: skip
        may_refuse = True
    chain = builders.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, (st1, st2),
                                     (pad1, pad2), between, "float32", depthwise,
                                     pad2_after)  # fmt: skip
    inputs = {"X": values["x"], "W1": values["w1"], "W2": values["w2"]}
    b1, b2 = (values.get(x) for x in ("b1", "b2"))
    sums = reference.run_conv_chain(chain, inputs, b1, b2)
    expected = sums if after is None else reference.activate(Activation(after), sums)
    finite = np.abs(sums[np.isfinite(sums)])
    peak = max(float(finite.max()) if finite.size else 0.0,
               float(np.max(np.abs(expected[np.isfinite(expected)]), initial=0.0)))  # fmt: skip
    if unbatched:
        expected = expected[0]
    arrays = {o.name: o.array for o in operands}
    x_, w1, w2 = arrays["x"], arrays["w1"], arrays["w2"]
    a1, a2 = arrays.get("b1"), arrays.get("b2")
    out: Any = None
    if out_mode == "out":
        out = np.empty(expected.shape, np.float32) if kind is Kind.NUMPY else torch.empty(
            expected.shape, dtype=torch.float32)  # fmt: skip
        features.append("out")
    elif out_mode == "out-alias":
        out = x_
        features.append("out-alias")
        may_refuse = True
    if entry == "ops":
        desc = "ops.conv_chain"

        def call() -> Any:
            return ops.conv_chain(x_, w1, w2, a1, a2, stride=stride, padding=padding,
                                  between=between, after=after, out=out, groups=groups)  # fmt: skip

    elif entry == "torch":
        desc = "chainfuse.torch.conv_chain"

        def call() -> Any:
            import chainfuse.torch

            return chainfuse.torch.conv_chain(
                x_,
                w1,
                w2,
                a1,
                a2,
                stride=stride,
                padding=padding,
                between=between,
                after=after,
                groups=groups,
            )

    else:
        desc = f"chainfuse.compile({chain.name})"

        def call() -> Any:
            return chainfuse.compile(chain)(x_, w1, w2, a1, a2)

    desc += f"(stride={stride!r}, padding={padding!r}, between={between!r}, after={after!r}"
    desc += f", groups={groups!r})  " if depthwise else ")  "
    oracle = None
    if what in ("nan", "inf"):

        def unfused(t: Any) -> Any:
            f = t.nn.functional
            tx, t1, t2 = (t.from_numpy(values[x]) for x in ("x", "w1", "w2"))
            tb1, tb2 = (None if v is None else t.from_numpy(v) for v in (b1, b2))
            y = f.conv2d(tx, t1, tb1, stride=st1, padding=pad1)
            y = _activation(between, y)
            y = f.pad(y, (pad2, pad2_after, pad2, pad2_after))
            y = f.conv2d(y, t2, tb2, stride=st2, groups=groups[1])
            y = _activation(after, y)
            return y[0] if unbatched else y

        oracle = oracle_torch(unfused)
    return Case("conv_chain", dtype, tuple(features), operands, call, expected, chain, _NAMES,
                desc + "; ".join(describe_operand(o) for o in operands),
                None, oracle, may_refuse, out, peak)  # fmt: skip
