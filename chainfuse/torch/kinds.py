"""What each operator of a Dynamo FX graph is to the chain finder: DNNFusion's mapping types.

A chain is compute-intensive ops (GEMMs, convolutions, attention) joined by ops that map each
element to one element (one-to-one: activations, a scale, eval dropout) or that only re-label
memory (pure views). Anything else between two compute ops (a reduction such as LayerNorm, a
shuffle that copies, a concatenation) ends the chain. The finder asks `kind_of` and
`activation_at`, and never names an operator itself.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from chainfuse.ops.activations import torch_activations

__all__ = [
    "NUMBER",
    "Activation",
    "Kind",
    "activation_at",
    "constant_of",
    "kind_of",
    "number_of",
    "value_of",
]

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
    "reshape_as": Kind.VIEW,
    "view_as": Kind.VIEW,
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
            F.relu6, F.hardtanh, F.hardswish, F.mish, F.softplus, torch.square, torch.clamp,
            torch.clip, operator.add, operator.mul, operator.truediv, operator.sub, operator.neg,
            torch.rsqrt, "relu", "gelu", "silu", "tanh", "sigmoid", "pow", "square", "clamp",
            "clip", "float", "to", "mul", "add"):  # fmt: skip
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


#: `node.meta` key of a number a node computed when the backend ran the graph on its example
#: inputs (under `dynamic=True` a module's float attribute, as ReLU6's 6.0, is a graph input
#: read with `item()`, not a constant of the call)
NUMBER = "chainfuse_number"


def number_of(node: Any) -> float | None:
    """The number a graph node computed on the example inputs (`NUMBER`), or None."""
    return node.meta.get(NUMBER) if isinstance(node, fx.Node) else None


@dataclass(frozen=True)
class Activation:
    """An activation found in a graph: its name in chainfuse's vocabulary and the node whose
    value is the activation's result (the last node of a written-out form)."""

    name: str
    end: fx.Node
    nodes: tuple[fx.Node, ...]


def _call(node: Any, *targets: Any) -> bool:
    return (
        isinstance(node, fx.Node)
        and node.op in ("call_function", "call_method")
        and (node.target in targets)
    )


def activation_at(x: fx.Node) -> Activation | None:
    """The activation applied to `x` by its users, where `x` has no other use: a call (relu,
    gelu, relu6, hardswish, mish, ...: told apart by what it computes, so `hardtanh(x, 0, 6)`
    is relu6) or a written-out form (`_written_out`: GPT-2's tanh-GELU, quick-GELU
    `x * sigmoid(1.702 x)`, `relu(x) ** 2`, ...). None when `x`'s users are not exactly one
    activation."""
    written = _written_out(x)
    if written is not None:
        return written
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
    return _written_out(x)


# Written-out activations are told apart by what they compute, not by how they are written:
# the elementwise ops fed only by x (and numbers) are run on a float64 probe and compared with
# each activation chainfuse has. GPT-2's and Bloom's tanh-GELUs, `x * sigmoid(1.702 x)`,
# `x * 0.5 * (1 + erf(x / sqrt(2)))` and the like all match, whatever their order of ops.
_ELEMENTWISE = {torch.erf, torch.exp, torch.sqrt, "erf", "exp", "sqrt", operator.pow, "div",
                torch.add, torch.mul, torch.div, "sub", torch.sub}  # fmt: skip
_MAX_WRITTEN_OPS = 16  # ops in a written-out activation
_LOOK_AHEAD = 48  # graph nodes past x searched for them (they sit next to each other)
_PROBE = torch.cat([torch.linspace(-9.0, 9.0, 1441, dtype=torch.float64),
                    torch.tensor([1e1, 2e1, 5e1, 1e2, 1e3, 1e4], dtype=torch.float64).repeat(2)
                    * torch.tensor([1.0] * 6 + [-1.0] * 6, dtype=torch.float64)])  # fmt: skip
#: PyTorch's own function of each activation chainfuse's chains take, by its name
TORCH_ACTIVATIONS: dict[str, Any] = torch_activations()
_MATCH = 1e-6  # largest difference from a candidate, relative to max(1, |f|): the candidates
# differ from each other by 4.7e-4 or more (gelu and gelu_tanh), a rounded constant by ~1e-9


def _elementwise(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    try:
        if node.target in _ELEMENTWISE:
            return True
    except TypeError:  # an unhashable target
        return False
    return kind_of(node) in (Kind.ONE_TO_ONE, Kind.IDENTITY) and node.target is not F.batch_norm


def _written_out(x: fx.Node) -> Activation | None:
    """The activation a run of elementwise ops computes from x alone, or None (module
    comment above). The run ends at the first node whose value leaves it, every other node's
    value (and x's) used only inside it."""
    region: list[fx.Node] = []
    inside = {x}
    node = x.next
    for _ in range(_LOOK_AHEAD):
        if len(region) == _MAX_WRITTEN_OPS or node.op == "output":
            break
        args = node.all_input_nodes
        fed = any(a in inside for a in args)
        if (
            fed
            and all(a in inside or number_of(a) is not None for a in args)
            and _elementwise(node)
        ):
            region.append(node)
            inside.add(node)
        node = node.next
    found: Activation | None = None
    for i, end in enumerate(region):
        run = [n for n in region[: i + 1] if n is end or _feeds(n, end, inside)]
        nodes = {x, *run}
        if any(set(n.users) - nodes for n in (x, *run) if n is not end):
            continue
        name = _identify(x, run)
        # the first run that computes an activation, unless a longer one computes another:
        # relu then a square is squared_relu (a longer run of the same one adds a dropout)
        if name is not None and (found is None or name != found.name):
            found = Activation(name, end, tuple(run))
    return found


def _feeds(node: fx.Node, end: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether `node`'s value reaches `end` through nodes of `inside`."""
    seen, todo = set(), [end]
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a is node:
                return True
            if a in inside and a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def _identify(x: fx.Node, run: list[fx.Node]) -> str | None:
    """The candidate activation that `run` (elementwise ops of x) computes, or None."""
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {x: graph.placeholder("x")}
    for n in run:
        env[n] = graph.node_copy(n, lambda a: env[a] if a in env else number_of(a))
    graph.output(env[run[-1]])
    try:
        with torch.no_grad():
            got = fx.GraphModule(torch.nn.Module(), graph)(_PROBE.clone())
    except Exception:  # (an op that does not run on a float64 vector: not an activation)
        return None
    if not isinstance(got, torch.Tensor) or got.shape != _PROBE.shape:
        return None
    got = got.double()
    for name, fn in TORCH_ACTIVATIONS.items():
        want = fn(_PROBE)
        if bool(((got - want).abs() <= _MATCH * want.abs().clamp(min=1.0)).all()):
            return name
    return None
