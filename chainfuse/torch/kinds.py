"""What each operator of a Dynamo FX graph is to the chain finder: DNNFusion's mapping types.

A chain is compute-intensive ops (GEMMs, convolutions, attention) joined by ops that map each
element to one element (one-to-one: activations, a scale, eval dropout) or that only re-label
memory (pure views). Anything else between two compute ops (a reduction such as LayerNorm, a
shuffle that copies, a concatenation) ends the chain. The finder asks `kind_of` and
`activation_at`, and never names an operator itself.
"""

from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Activation", "Kind", "activation_at", "constant_of", "kind_of", "value_of"]

F = torch.nn.functional


class Kind(enum.Enum):
    """An operator's mapping type, as the finder uses it."""

    LINEAR = "linear"  # F.linear, addmm, x @ W: a GEMM with a weight
    MATMUL = "matmul"  # a GEMM of two activations (scores = q @ kᵀ)
    CONV = "conv"  # conv2d
    SDPA = "sdpa"  # scaled_dot_product_attention
    ONE_TO_ONE = "one-to-one"  # elementwise: may sit between compute ops
    IDENTITY = "identity"  # eval dropout, contiguous, a cast to the same dtype
    VIEW = "view"  # re-labels memory, moves nothing
    REDUCTION = "reduction"  # LayerNorm, softmax, mean: many-to-one
    SHUFFLE = "shuffle"  # cat, index, copies: reorganize
    OPAQUE = "opaque"  # a fused op of PyTorch's own (the encoder-layer fast path)
    OTHER = "other"


_TABLE: dict[Any, Kind] = {
    F.linear: Kind.LINEAR,
    torch._C._nn.linear: Kind.LINEAR,
    torch.addmm: Kind.LINEAR,
    torch.matmul: Kind.MATMUL,
    operator.matmul: Kind.MATMUL,
    torch.bmm: Kind.MATMUL,
    "matmul": Kind.MATMUL,
    F.conv2d: Kind.CONV,
    torch.conv2d: Kind.CONV,
    F.scaled_dot_product_attention: Kind.SDPA,
    torch._C._nn.scaled_dot_product_attention: Kind.SDPA,
    F.dropout: Kind.IDENTITY,
    "contiguous": Kind.IDENTITY,
    "view": Kind.VIEW,
    "reshape": Kind.VIEW,
    "transpose": Kind.VIEW,
    "permute": Kind.VIEW,
    "t": Kind.VIEW,
    "unsqueeze": Kind.VIEW,
    "unflatten": Kind.VIEW,
    "flatten": Kind.VIEW,
    torch.reshape: Kind.VIEW,
    torch.transpose: Kind.VIEW,
    torch.flatten: Kind.VIEW,
    F.layer_norm: Kind.REDUCTION,
    F.batch_norm: Kind.ONE_TO_ONE,  # eval: a per-channel scale and shift
    F.softmax: Kind.REDUCTION,
    torch.softmax: Kind.REDUCTION,
    "softmax": Kind.REDUCTION,
    "mean": Kind.REDUCTION,
    torch.cat: Kind.SHUFFLE,
    operator.getitem: Kind.SHUFFLE,
    torch._transformer_encoder_layer_fwd: Kind.OPAQUE,
    torch._native_multi_head_attention: Kind.OPAQUE,
    F.multi_head_attention_forward: Kind.OPAQUE,
}
for _fn in (F.relu, torch.relu, F.gelu, F.silu, torch.tanh, torch.sigmoid, F.sigmoid, torch.pow,
            operator.add, operator.mul, operator.truediv, operator.sub, operator.neg, torch.rsqrt,
            "relu", "gelu", "silu", "tanh", "sigmoid", "pow", "float", "to", "mul", "add"):  # fmt: skip
    _TABLE[_fn] = Kind.ONE_TO_ONE


def kind_of(node: fx.Node) -> Kind:
    """The mapping type of `node` (OTHER for placeholders, outputs and unknown ops)."""
    if node.op not in ("call_function", "call_method"):
        return Kind.OTHER
    try:
        kind = _TABLE.get(node.target, Kind.OTHER)
    except TypeError:  # an unhashable target
        return Kind.OTHER
    if kind is Kind.ONE_TO_ONE and node.target in ("to", "float"):
        return Kind.IDENTITY if _same_dtype(node) else Kind.ONE_TO_ONE
    return kind


def value_of(node: Any) -> Any:
    """The example value Dynamo traced for `node` (a fake tensor), or None."""
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _same_dtype(node: fx.Node) -> bool:
    src, out = value_of(node.args[0]) if node.args else None, value_of(node)
    return (
        isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.dtype == out.dtype
    )


def constant_of(arg: Any) -> float | None:
    """A Python number argument as a float; None for anything else (a tensor, a node)."""
    if isinstance(arg, bool) or not isinstance(arg, int | float):
        return None
    return float(arg)


@dataclass(frozen=True)
class Activation:
    """An activation found in a graph: its name in chainfuse's vocabulary and the node whose
    value is the activation's result (the last node of a written-out form)."""

    name: str
    end: fx.Node
    nodes: tuple[fx.Node, ...]


def _single(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _call(node: Any, *targets: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and (node.target in targets)
    )


def _scaled(node: Any, x: fx.Node, want: float) -> bool:
    """`node` is `want * x` (either order)."""
    if not _call(node, operator.mul, torch.mul, "mul") or len(node.args) != 2:
        return False
    a, b = node.args
    c = constant_of(a) if b is x else constant_of(b) if a is x else None
    return c is not None and math.isclose(c, want, rel_tol=1e-4)


def activation_at(x: fx.Node) -> Activation | None:
    """The activation applied to `x` by its users, where `x` has no other use: a call
    (relu, gelu, gelu(approximate="tanh"), silu) or a written-out form (tanh-GELU as GPT-2
    writes it, quick-GELU `x * sigmoid(1.702 x)`, SiLU `x * sigmoid(x)`). None when `x`'s users
    are not exactly one activation."""
    users = list(x.users)
    if len(users) == 1:
        u = users[0]
        if _call(u, F.relu, torch.relu, "relu") and len(u.args) == 1:
            return Activation("relu", u, (u,))
        if _call(u, F.silu, "silu") and len(u.args) == 1:
            return Activation("silu", u, (u,))
        if _call(u, F.gelu, "gelu") and len(u.args) == 1:
            approximate = u.kwargs.get("approximate", "none")
            return Activation("gelu_tanh" if approximate == "tanh" else "gelu", u, (u,))
    return _written_out(x, users)


def _written_out(x: fx.Node, users: list[fx.Node]) -> Activation | None:
    if len(users) == 2:  # x * sigmoid(c * x): silu (c = 1) or quick-GELU (c = 1.702)
        sig = next((u for u in users if _call(u, torch.sigmoid, F.sigmoid, "sigmoid")), None)
        prod = next((u for u in users if _call(u, operator.mul, torch.mul, "mul") and any(
            _call(a, torch.sigmoid, F.sigmoid, "sigmoid") for a in u.args)), None)  # fmt: skip
        if (
            sig is not None
            and prod is not None
            and sig.args[0] is x
            and (set(prod.args) == {x, sig})
        ):
            return Activation("silu", prod, (sig, prod))
        inner = next((u for u in users if _scaled(u, x, 1.702)), None)
        if prod is not None and inner is not None and len(inner.users) == 1:
            sig = _single(inner)
            if (
                sig is not None
                and _call(sig, torch.sigmoid, F.sigmoid, "sigmoid")
                and set(prod.args) == {x, sig}
            ):
                return Activation("quick_gelu", prod, (inner, sig, prod))
    if len(users) == 3:  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): GPT-2's gelu_new
        half = next((u for u in users if _scaled(u, x, 0.5)), None)
        cube = next((u for u in users if _call(u, torch.pow, "pow") and u.args[0] is x), None)
        if half is None or cube is None or constant_of(cube.args[1]) != 3.0:
            return None
        chain = [cube]
        for step in ("scale", "sum", "scale", "tanh", "one", "out"):
            nxt = _single(chain[-1])
            if nxt is None:
                return None
            ok = {
                "scale": _call(nxt, operator.mul, torch.mul, "mul"),
                "sum": _call(nxt, operator.add, torch.add, "add") and x in nxt.args,
                "tanh": _call(nxt, torch.tanh, "tanh"),
                "one": _call(nxt, operator.add, torch.add, "add"),
                "out": _call(nxt, operator.mul, torch.mul, "mul") and half in nxt.args,
            }[step]
            if not ok:
                return None
            chain.append(nxt)
        if not (_scaled(chain[1], cube, 0.044715) and _scaled(chain[3], chain[2], 0.7978845608)):
            return None
        return Activation("gelu_tanh", chain[-1], (half, *chain))
    return None
