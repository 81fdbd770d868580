"""Find the chains chainfuse fuses in a Dynamo FX graph (torch-level ops, before decomposition).

Walks from every compute op (`kinds.Kind`) through what may sit between two compute ops
(one-to-one elementwise ops, eval dropout, views) to the next compute op:

    linear(+bias) -> act -> [dropout] -> linear(+bias)          (act: `ir.ACTIVATION_NAMES`)
    act(x W1) * (x W3) -> W2                                     (gated MLP, no biases)
    a, b = (x W13).chunk(2, -1); act(a) * b -> W2                (the same, W1 and W3 fused)
    scaled_dot_product_attention(q, k, v, ...)                   (dropout_p = 0)
    q @ kᵀ -> [* or / scale] -> [+ or += mask | masked_fill(m, -inf) | where(keep, ., min)
              | max(., min)]... -> softmax(-1) -> [dropout] -> @ v
    baddbmm(bias, q, kᵀ) -> [+ mask] -> softmax(-1) -> @ v        (ALiBi, as Bloom's)
    conv2d(+bias) -> [eval batch_norm] -> [act] -> conv2d(+bias) -> [batch_norm] -> [act]

`linear` is `F.linear(x, W, b)`, `torch.addmm(b, x, W)` (GPT-2's Conv1D) or `x @ W.t()`
(also `W.T`) / `x @ W` followed by `+ b`. Every compute op left out gets a reason
(`Finding.skipped`). Finding changes nothing: `rewrite` replaces the chains.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from chainfuse.torch.kinds import (
    TORCH_ACTIVATIONS,
    Kind,
    activation_at,
    constant_of,
    kind_of,
    value_of,
)

__all__ = ["ChainKind", "Finding", "Found", "Gemm", "find"]

F = torch.nn.functional


class ChainKind(enum.Enum):
    MLP = "mlp"
    GATED_MLP = "gated-mlp"
    SDPA = "sdpa"
    ATTENTION = "attention"  # written out: matmul, scale, mask, softmax, matmul
    CONV = "conv-chain"


@dataclass(frozen=True, eq=False)
class Gemm:
    """One GEMM with a weight: `end = x @ W' (+ bias)`, `W' = W.T` where `transposed` (W stored
    [out, in] as nn.Linear keeps it), else W itself ([in, out], as addmm's). `half`: 0 or 1
    where the chain takes only that half of the GEMM's outputs (W' split in two along its
    output features: a gated MLP whose W1 and W3 are one weight, its result `chunk`ed).
    `view`: the `W.t()` node the GEMM reads (a written-out `x @ W.t()`), an input of its chain.
    `bn`: an eval batch norm over the GEMM's output features after `end` (`nn.BatchNorm1d` of
    a `[rows, features]` result, as tabular MLPs have it, or of the result's rows flattened and
    viewed back, as LeViT's `flatten(0, 1)` and `reshape_as`: `bn_views`), folded into the
    weight and bias; `out` is then the batch norm's node, or the view back."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    transposed: bool
    bias: fx.Node | None
    end: fx.Node
    words: str  # "linear+bias", "addmm", "x @ W.t() + b"
    half: int | None = None
    view: fx.Node | None = None  # the graph's own `W.t()` node, where the GEMM reads one
    bn: fx.Node | None = None
    bn_views: tuple[fx.Node, ...] = ()  # (the flattening view before the norm, the one after)

    @property
    def out(self) -> fx.Node:
        """The node whose value the GEMM's result is (after its batch norm, if any)."""
        if self.bn_views:
            return self.bn_views[-1]
        return self.bn if self.bn is not None else self.end

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        """The GEMM's own nodes in graph order: the product, its bias add, its batch norm (and
        the views around it)."""
        norm = (self.bn_views[0], self.bn, self.bn_views[1]) if self.bn_views else (self.bn,)
        return tuple(dict.fromkeys(n for n in (self.node, self.end, *norm) if n is not None))


@dataclass(frozen=True, eq=False)
class Found:
    """A chain: its nodes in graph order (the last one's value is the chain's result) and the
    operands its fused call takes (`parts`, per kind)."""

    kind: ChainKind
    form: str
    nodes: tuple[fx.Node, ...]
    parts: dict[str, Any]

    @property
    def output(self) -> fx.Node:
        return self.nodes[-1]

    @property
    def name(self) -> str:
        return f"{self.kind.value}@{self.nodes[0].name}"


@dataclass
class Finding:
    chains: list[Found] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node, why not)


def _is_weight(node: Any) -> bool:
    """A 2-D tensor that is an input of the graph (a parameter) or one of its constants."""
    if not isinstance(node, fx.Node) or node.op not in ("placeholder", "get_attr"):
        return False
    value = value_of(node)
    return value is None or (isinstance(value, torch.Tensor) and value.dim() == 2)


def _is_vector(node: Any) -> bool:
    value = value_of(node)
    return isinstance(node, fx.Node) and isinstance(value, torch.Tensor) and value.dim() == 1


def _transpose_of(node: Any) -> fx.Node | None:
    """W where `node` is `W.t()`, `W.T`, `W.transpose(0, 1)` or `W.permute(1, 0)` of a weight."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    args: Any = node.args
    swap = (
        (node.target in ("t", torch.t) and len(args) == 1)
        or (node.target is getattr and len(args) == 2 and args[1] in ("T", "mT"))
        or (node.target in ("transpose", torch.transpose) and {*args[1:]} in ({0, 1}, {-1, -2}))
        or (node.target == "permute" and tuple(args[1:]) in ((1, 0), ((1, 0),)))
    )
    weight: fx.Node | None = args[0] if swap and _is_weight(args[0]) else None
    return weight


def gemm_at(node: fx.Node) -> Gemm | None:
    """`node` as a GEMM with a weight, its bias add included, or None."""
    if kind_of(node) is not Kind.LINEAR and kind_of(node) is not Kind.MATMUL:
        return None
    args: Any = node.args
    if node.target is torch.addmm:
        if len(args) != 3 or node.kwargs or not _is_vector(args[0]):
            return None
        w_t = _transpose_of(args[2])
        if w_t is None and not _is_weight(args[2]):
            return None
        view = args[2] if w_t is not None else None
        return Gemm(node, args[1], w_t or args[2], w_t is not None, args[0], node, "addmm",
                    view=view)  # fmt: skip
    if kind_of(node) is Kind.LINEAR:
        bias: Any = args[2] if len(args) > 2 else node.kwargs.get("bias")
        if not _is_weight(args[1]) or (bias is not None and not _is_vector(bias)):
            return None
        words = "linear+bias" if bias is not None else "linear"
        return Gemm(node, args[0], args[1], True, bias, node, words)
    if len(args) != 2 or not isinstance(args[0], fx.Node):
        return None
    weight, transposed = _transpose_of(args[1]), True
    if weight is None:
        weight, transposed = (args[1], False) if _is_weight(args[1]) else (None, False)
    if weight is None:
        return None
    end, bias = node, None
    users: list[Any] = list(node.users)
    if len(users) == 1 and users[0].target in (operator.add, torch.add, "add"):
        other = [a for a in users[0].args if a is not node]
        if len(other) == 1 and _is_vector(other[0]) and not users[0].kwargs:
            end, bias = users[0], other[0]
    words = ("x @ W.t()" if transposed else "x @ W") + (" + b" if bias is not None else "")
    view = args[1] if transposed else None
    return Gemm(node, args[0], weight, transposed, bias, end, words, view=view)


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _eval_dropout(node: fx.Node) -> bool:
    if node.target is not F.dropout:
        return False
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get("training", True)
    return training is False


def _passes(node: fx.Node) -> bool:
    """Ops a chain walks through between two compute ops: eval dropout, a same-dtype cast,
    `contiguous`, and views that keep the last dimension (they only re-label rows)."""
    kind = kind_of(node)
    if kind is Kind.IDENTITY:
        return node.target is not F.dropout or _eval_dropout(node)
    if kind is Kind.VIEW and node.target in ("view", "reshape", torch.reshape):
        src, out = value_of(node.args[0]), value_of(node)
        return (
            isinstance(src, torch.Tensor)
            and isinstance(out, torch.Tensor)
            and src.shape[-1] == out.shape[-1]
        )
    return False


def _walk(node: fx.Node, taken: list[fx.Node]) -> tuple[fx.Node, str]:
    """Follow `node`'s single users through `_passes` ops (appended to `taken`). Returns the
    first user that is not passed through and the words for what stopped the walk."""
    while True:
        nxt = _single_user(node)
        if nxt is None:
            return node, f"its result has {len(node.users)} users"
        if not _passes(nxt):
            return nxt, ""
        taken.append(nxt)
        node = nxt


def _why(nxt: fx.Node) -> str:
    kind = kind_of(nxt)
    label = nxt.target if isinstance(nxt.target, str) else getattr(nxt.target, "__name__", nxt.name)
    if kind in (Kind.REDUCTION, Kind.SHUFFLE):
        return f"followed by {label} ({kind.value}: ends a chain)"
    if kind is Kind.VIEW:
        return f"followed by {label} (a reshape that moves the last dimension: ends a chain)"
    if kind is Kind.ONE_TO_ONE:
        return f"followed by {label} (an elementwise op chainfuse has no epilogue for here)"
    return f"followed by {label}"


def _with_bn(g: Gemm) -> Gemm:
    """g with the eval batch norm its result feeds where that normalizes its output features:
    a 2-D result (BatchNorm1d's channels are its columns), or one whose leading dims a view
    flattens into rows for the norm and a view after it restores; else g."""
    value = value_of(g.end)
    if g.half is not None or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return g
    # (LeViT's view back is `reshape_as(norm, result)`: the result's other user, for its shape)
    views = [u for u in g.end.users if kind_of(u) is Kind.VIEW and u.args[0] is g.end]
    rows = g.end if value.dim() == 2 else views[0] if len(views) == 1 else None
    flat = value_of(rows) if rows is not None else None
    if rows is None or not isinstance(flat, torch.Tensor) or flat.dim() != 2:
        return g
    if rows is not g.end and (kind_of(rows) is not Kind.VIEW or flat.shape[-1] != value.shape[-1]):
        return g
    bn = _batch_norm(rows)
    if bn is None:
        return g
    around: tuple[fx.Node, ...] = ()
    if rows is not g.end:  # (and back to the result's shape)
        back = _single_user(bn)
        shaped = value_of(back) if back is not None else None
        if back is None or kind_of(back) is not Kind.VIEW or not isinstance(shaped, torch.Tensor):
            return g
        if tuple(shaped.shape) != tuple(value.shape) or set(g.end.users) - {rows, back}:
            return g
        around = (rows, back)
    return dataclasses.replace(g, bn=bn, bn_views=around, words=f"{g.words} -> batch_norm")


def _mlp(g1: Gemm, gemms: dict[fx.Node, Gemm]) -> Found | str:
    taken: list[fx.Node] = []
    g1 = _with_bn(g1)
    act = activation_at(g1.out)  # (a written-out activation has several users of g1's result)
    if act is None:
        node, why = _walk(g1.out, taken)
        # (through a view: a written-out activation's several users are the view's)
        act = activation_at(taken[-1]) if taken else None
        if act is None:
            return why or _why(node)
    taken.extend(act.nodes)
    node, why = _walk(act.end, taken)
    g2 = gemms.get(node)
    if why or g2 is None or g2.x is not (taken[-1] if taken else act.end):
        return why or f"its {act.name} is {_why(node)}, not by a GEMM with a weight"
    g2 = _with_bn(g2)
    nodes = [*g1.nodes, *taken, *g2.nodes]
    dropout = " -> dropout" if any(n.target is F.dropout for n in taken) else ""
    form = f"{g1.words} -> {act.name}{dropout} -> {g2.words}"
    parts = {"first": g1, "second": g2, "between": act.name}
    return Found(ChainKind.MLP, form, tuple(nodes), parts)


def _gated(g1: Gemm, gemms: dict[fx.Node, Gemm]) -> Found | None:
    """`act(x W1) * (x W3) -> W2`, or the same with W1 and W3 one weight whose result is split
    in two halves (`_halves`), the activation on either."""
    if g1.bias is not None:
        return None
    halves = _halves(g1.end)
    if halves is None:
        return _gated_from(g1, gemms, None, 0)
    return _gated_from(g1, gemms, halves, 0) or _gated_from(g1, gemms, halves, 1)


def _gated_from(
    g: Gemm, gemms: dict[fx.Node, Gemm], halves: tuple[fx.Node, fx.Node] | None, i: int
) -> Found | None:
    """The gated MLP whose activation reads g's result, or its half `i` of `halves` (then the
    other half is what the activation's result is multiplied by)."""
    act = activation_at(g.end if halves is None else halves[i])
    if act is None:
        return None
    prod = _single_user(act.end)
    if prod is None or prod.target not in (operator.mul, torch.mul, "mul") or len(prod.args) != 2:
        return None
    operand: Any = prod.args[1] if prod.args[0] is act.end else prod.args[0]
    if not isinstance(operand, fx.Node) or len(operand.users) != 1:
        return None
    if halves is not None:  # one weight, split in two: its other half is the multiplicand
        if operand is not halves[1 - i] or set(halves[i].users) - set(act.nodes):
            return None
        g1, g3 = dataclasses.replace(g, half=i), dataclasses.replace(g, half=1 - i)
        split: Any = halves[0].args[0]
        up: tuple[fx.Node, ...] = (g.node, split, *halves)
    else:
        found3 = next((c for c in gemms.values() if c.end is operand), None)
        if found3 is None or found3.x is not g.x or found3.bias is not None:
            return None
        g1, g3, up = g, found3, (g.node, found3.node)
    taken: list[fx.Node] = []
    node, why = _walk(prod, taken)
    g2 = gemms.get(node)
    if why or g2 is None or g2.bias is not None or g2.x is not (taken[-1] if taken else prod):
        return None
    if not (g1.transposed == g2.transposed == g3.transposed):
        return None
    nodes = (*up, *act.nodes, prod, *taken, g2.node)
    if halves is not None:
        form = f"{act.name}(half {i} of {g.words}) * half {1 - i} -> {g2.words}"
    else:
        form = f"{act.name}({g1.words}) * {g3.words} -> {g2.words}"
    return Found(ChainKind.GATED_MLP, form, nodes, {"up": (g1, g3), "down": g2, "act": act.name})


def _halves(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The two `getitem`s of `node.chunk(2, -1)` (or a `split` of its last dimension into two
    equal halves) where that is `node`'s only use; else None."""
    split = _single_user(node)
    value = value_of(node)
    if split is None or not isinstance(value, torch.Tensor) or value.shape[-1] % 2:
        return None
    args: Any = split.args
    if len(args) < 2 or args[0] is not node:
        return None
    dim = args[2] if len(args) > 2 else split.kwargs.get("dim", 0)
    half = value.shape[-1] // 2
    halved = (split.target in ("chunk", torch.chunk) and args[1] == 2) or (
        split.target in ("split", torch.split) and args[1] in (half, [half, half], (half, half))
    )
    if not halved or dim not in (-1, value.dim() - 1):
        return None
    index = {u.args[1] if u.target is operator.getitem and len(u.args) == 2 else None: u
             for u in split.users}  # fmt: skip
    if len(split.users) != 2 or set(index) != {0, 1}:
        return None
    return index[0], index[1]


def _sdpa(node: fx.Node) -> Found | str:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, node.args, strict=False))
    bound.update(node.kwargs)
    if constant_of(bound.get("dropout_p", 0.0)) != 0.0:
        return "dropout_p is not 0 (chainfuse's attention is for inference)"
    for name in ("is_causal", "enable_gqa"):
        if isinstance(bound.get(name, False), fx.Node):
            return f"{name} is computed at run time"
    parts = {
        "q": bound["query"],
        "k": bound["key"],
        "v": bound["value"],
        "mask": bound.get("attn_mask"),
        "is_causal": bool(bound.get("is_causal", False)),
        "scale": bound.get("scale"),
        "gqa": bool(bound.get("enable_gqa", False)),
    }
    return Found(ChainKind.SDPA, "scaled_dot_product_attention", (node,), parts)


def _softmax_last(node: fx.Node) -> bool:
    if node.target not in (F.softmax, torch.softmax, "softmax"):
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    value = value_of(node)
    rank = value.dim() if isinstance(value, torch.Tensor) else None
    return bool(dim == -1 or (rank is not None and dim == rank - 1))


def _baddbmm(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None, float, float] | None:
    """`beta * bias + alpha * (q @ kᵀ)` (`torch.baddbmm`, Bloom's scores with ALiBi) as (q, kᵀ,
    bias or None, beta, alpha), or None."""
    if node.target not in (torch.baddbmm, "baddbmm"):
        return None
    bound: dict[str, Any] = dict(zip(("input", "batch1", "batch2"), node.args, strict=False))
    bound.update(node.kwargs)
    beta, alpha = constant_of(bound.get("beta", 1.0)), constant_of(bound.get("alpha", 1.0))
    bias, q, kt = (bound.get(name) for name in ("input", "batch1", "batch2"))
    if beta is None or alpha is None or set(bound) - {"input", "batch1", "batch2", "beta", "alpha"}:
        return None
    if not (isinstance(bias, fx.Node) and isinstance(q, fx.Node) and isinstance(kt, fx.Node)):
        return None
    return q, kt, bias if beta != 0.0 else None, beta, alpha


def _attention(mm: fx.Node) -> Found | str | None:
    """`q @ kᵀ` (or `baddbmm(bias, q, kᵀ)`) -> scale -> masks -> softmax -> @ v, or None when
    `mm` is not a score GEMM. Between the scores and the softmax: additive masks, fills of
    masked-out scores (`masked_fill(m, -inf)`, `where(keep, s, finfo.min)`), a floor under the
    masked scores (`max(s, finfo.min)`), reshapes that keep
    the last dimension (Bloom: `[b·h, q, k] -> [b, h, q, k]` around its mask, and back), and an
    upcast for the softmax that is cast back after it."""
    scores = _baddbmm(mm)
    if scores is None:
        a, b = (mm.args[0], mm.args[1]) if len(mm.args) == 2 else (None, None)
        if mm.kwargs or not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or _is_weight(b):
            return None
        if kind_of(mm) is not Kind.MATMUL:
            return None
        scores = (a, b, None, 0.0, 1.0)
    q, kt, bias, beta, scale = scores
    taken: list[fx.Node] = []
    # what the graph does to the scores' additive terms on the way to the softmax, in order:
    # ("view", node) re-labels them, ("add", node, mask) adds a mask, ("fill", node, where,
    # value) sets them to value where `where` is true, ("floor", node, value) raises them to value
    steps: list[tuple[Any, ...]] = []
    node, scaled, words, softcap = mm, False, [], None
    while (nxt := _single_user(node)) is not None:
        masked = any(step[0] != "view" for step in steps)
        if softcap is None and not masked and bias is None and (capped := _softcap(nxt, node)):
            # c tanh(k s) as soft-capping: cap |c|, the scale times k c (no scale after it; a
            # baddbmm's bias is inside the tanh: not taken)
            k, outer, nodes = capped
            scale, softcap, scaled = scale * k * outer, abs(outer), True
            words.append("softcap")
            taken.extend(nodes[:-1])
            nxt = nodes[-1]
        elif (c := _factor(nxt, node)) is not None and not (scaled or masked):
            # (a scale before any mask)
            scale, beta, scaled = scale * c, beta * c, True
            words.append("scale")
        elif _passes(nxt):
            if kind_of(nxt) is Kind.VIEW:
                steps.append(("view", nxt))
        elif _upcast(nxt):
            pass  # (the softmax in float32: cast back after it, below)
        elif _adds_to(nxt, node):
            other = [a for a in nxt.args if a is not node]
            if len(other) != 1 or not isinstance(other[0], fx.Node) or not _same_shape(nxt, node):
                break
            steps.append(("add", nxt, other[0]))
            words.append("+ mask")
        elif (fill := _fill(nxt, node)) is not None:
            steps.append(("fill", nxt, *fill))
            words.append(str(nxt.target if isinstance(nxt.target, str) else nxt.target.__name__))
        elif (floor := _floor(nxt, node)) is not None:
            steps.append(("floor", nxt, floor))
            words.append("max")
        else:
            break
        taken.append(nxt)
        node = nxt
    if nxt is None or not _softmax_last(nxt):
        return None
    taken.append(nxt)
    if not _dtype_is(nxt, mm):  # (softmax(dtype=float32), or an upcast before it)
        cast = _single_user(nxt)
        if cast is None or cast.target not in ("to", "type") or not _dtype_is(cast, mm):
            return "softmax in another dtype, not cast back to the scores' dtype"
        taken.append(cast)
    end, why = _walk(taken[-1], taken)
    if why or kind_of(end) is not Kind.MATMUL or end.args[0] is not (taken[-1]):
        return why or "softmax is not followed by a matmul with v"
    probs, score = value_of(end.args[0]), value_of(mm)
    if not (isinstance(probs, torch.Tensor) and isinstance(score, torch.Tensor)) or (
        probs.shape != score.shape
    ):
        return "the probabilities reach the matmul with v in another shape than the scores"
    head = "baddbmm" if mm.target in (torch.baddbmm, "baddbmm") else "matmul"
    form = " -> ".join([head, *words, "softmax", "matmul"])
    adds = [step[2] for step in steps if step[0] == "add"]
    parts = {"q": q, "kt": kt, "v": end.args[1], "scale": scale, "bias": bias, "bias_scale": beta,
             "softcap": softcap, "steps": tuple(steps), "masks": tuple(adds),
             # one mask added, nothing else: the kernel takes it as it is
             "mask": adds[0] if len(steps) == 1 and adds and bias is None else None}  # fmt: skip
    return Found(ChainKind.ATTENTION, form, (mm, *taken, end), parts)


def _adds_to(node: fx.Node, scores: fx.Node) -> bool:
    """`scores + m`, `m + scores`, or `scores += m` (MPNet's position bias: in place on the
    scores, which have no other use)."""
    if node.kwargs:
        return False
    if node.target in (operator.iadd, "add_"):
        return bool(node.args) and node.args[0] is scores
    return node.target in (operator.add, torch.add, "add")


def _factor(node: fx.Node, x: fx.Node) -> float | None:
    """c where `node` is `x * c`, `c * x` or `x / c` for a constant number c, else None."""
    if node.target not in (operator.mul, operator.truediv, torch.mul, torch.div, "mul", "div"):
        return None
    if node.kwargs or len(node.args) != 2 or x not in node.args:
        return None
    divides = node.target in (operator.truediv, torch.div, "div")
    if divides and node.args[0] is not x:
        return None
    c = constant_of(node.args[1] if node.args[0] is x else node.args[0])
    if c is None or (divides and c == 0.0):
        return None
    return 1.0 / c if divides else c


_TANH = (torch.tanh, torch.nn.functional.tanh, "tanh")


def _softcap(node: fx.Node, scores: fx.Node) -> tuple[float, float, list[fx.Node]] | None:
    """Soft-capping of the scores, `c * tanh(k * scores)` (Gemma 2: `tanh(s / cap) * cap`), as
    (k, c, its nodes from `node`); k is 1 without a factor before the tanh. None otherwise."""
    nodes: list[fx.Node] = []
    k = _factor(node, scores)
    inner: fx.Node | None = node
    if k is not None:
        nodes.append(node)
        inner = _single_user(node)
    else:
        k = 1.0
    if inner is None or inner.target not in _TANH or inner.kwargs:
        return None
    if len(inner.args) != 1 or inner.args[0] is not (nodes[-1] if nodes else scores):
        return None
    out = _single_user(inner)
    c = _factor(out, inner) if out is not None else None
    if out is None or c is None or c == 0.0:
        return None
    return k, c, [*nodes, inner, out]


#: a fill of masked-out scores is taken where it sets them to a value so far below any score
#: that `score + value` rounds to `value` (|score| < 2^103 in float32 and bfloat16): -inf, or
#: `torch.finfo(float32 or bfloat16).min` as models write it
FILL_BELOW = -1e37


def _fill(node: fx.Node, scores: fx.Node) -> tuple[fx.Node, float, bool] | None:
    """`masked_fill(scores, m, value)` and `where(m, value, scores)` as (m, value, True),
    `where(keep, scores, value)` as (keep, value, False), for a value at or below `FILL_BELOW`;
    else None."""
    args: Any = node.args
    if node.target in ("masked_fill", torch.masked_fill) and len(args) == 3 and not node.kwargs:
        where, other, value, fill_where_true = args[1], args[0], args[2], True
    elif node.target is torch.where and len(args) == 3 and not node.kwargs:
        keep = args[1] is scores  # where(keep, scores, value), else where(fill, value, scores)
        where, other, value, fill_where_true = (
            args[0],
            args[1 if keep else 2],
            args[2 if keep else 1],
            not keep,
        )
    else:
        return None
    number = constant_of(value) if not isinstance(value, fx.Node) else _tensor_constant(value)
    if other is not scores or not isinstance(where, fx.Node) or number is None:
        return None
    if number > FILL_BELOW or not _same_shape(node, scores):
        return None
    return where, number, fill_where_true


def _tensor_constant(node: fx.Node) -> float | None:
    """The number of a 0-d `torch.tensor(number, ...)` (GPT-Neo's mask value) or
    `torch.full((), number, ...)` node, or None."""
    if node.target is torch.tensor and len(node.args) == 1:
        return constant_of(node.args[0])
    if node.target is torch.full and len(node.args) == 2 and node.args[0] in ((), []):
        return constant_of(node.args[1])
    return None


_MAX = (torch.max, torch.maximum, "max", "maximum")
_CLAMP_MIN = (torch.clamp, torch.clamp_min, "clamp", "clamp_min")


def _floor(node: fx.Node, scores: fx.Node) -> float | None:
    """The value v of a floor under the scores, `max(scores, v)` (XGLM's `torch.max(s + mask,
    full((), finfo.min))`), `maximum` or `clamp(min=v)`, for v at or below `FILL_BELOW`; else
    None. Only a sum of masks so far below the scores can reach it, so the floor applies to
    what is added to the scores (`rewrite.score_terms`), not to the scores."""
    args: Any = node.args
    if not args or args[0] is not scores:
        return None
    if node.target in _MAX and len(args) == 2 and not node.kwargs:
        value: Any = args[1]
    elif node.target in _CLAMP_MIN and set(node.kwargs) <= {"min"}:
        rest = [*args[1:2], *node.kwargs.values()]
        if len(rest) != 1 or len(args) > 2:
            return None
        value = rest[0]
    else:
        return None
    number = _tensor_constant(value) if isinstance(value, fx.Node) else constant_of(value)
    if number is None or number > FILL_BELOW or not _same_shape(node, scores):
        return None
    return number


def _upcast(node: fx.Node) -> bool:
    """A cast of the scores to float32 (`.float()`, `.to(torch.float32)`) before a softmax."""
    out = value_of(node)
    return (
        node.target in ("float", "to")
        and isinstance(out, torch.Tensor)
        and out.dtype == torch.float32
        and kind_of(node) is not Kind.IDENTITY
    )


def _same_shape(node: fx.Node, like: fx.Node) -> bool:
    a, b = value_of(node), value_of(like)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def _dtype_is(node: fx.Node, like: fx.Node) -> bool:
    a, b = value_of(node), value_of(like)
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype


def conv_at(node: fx.Node) -> dict[str, Any] | None:
    """A conv2d's operands, or None where chainfuse's conv chain cannot take it (dilation other
    than 1, padding "same" other than the same on every side). `groups` is as given: `_conv`
    says where it may be other than 1."""
    if kind_of(node) is not Kind.CONV:
        return None
    names = ("x", "w", "b", "stride", "padding", "dilation", "groups")
    bound: dict[str, Any] = {"b": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}
    bound.update(zip(names, node.args, strict=False))
    bound.update({k if k not in ("input", "weight", "bias") else k[0]: v
                  for k, v in node.kwargs.items()})  # fmt: skip
    if not isinstance(bound["groups"], int) or bound["dilation"] not in (1, (1, 1), [1, 1]):
        return None
    if not isinstance(bound["w"], fx.Node):
        return None
    if isinstance(bound["padding"], str):  # "valid", or "same" (stride 1) where symmetric
        bound["padding"] = _named_padding(bound["padding"], value_of(bound["w"]))
        if bound["padding"] is None:
            return None
    for name in ("stride", "padding"):
        v = bound[name]
        v = (v, v) if isinstance(v, int) else tuple(v)
        if len(v) != 2 or v[0] != v[1]:  # (the kernel takes one stride and pad per conv)
            return None
        bound[name] = v[0]
    return bound


def _named_padding(name: str, w: Any) -> int | None:
    """conv2d's `padding="valid"` (none) or `"same"` (stride 1: the output the input's size) as
    the pad on every side, where that is one number: an odd square kernel; else None."""
    if name == "valid":
        return 0
    if name != "same" or not isinstance(w, torch.Tensor) or w.dim() != 4:
        return None
    r, s = int(w.shape[2]), int(w.shape[3])
    return (r - 1) // 2 if r == s and r % 2 == 1 else None


def _batch_norm(node: fx.Node) -> fx.Node | None:
    """`node`'s single user where it is an eval-mode batch_norm (folded into the conv)."""
    bn = _single_user(node)
    if bn is None or bn.target is not F.batch_norm:
        return None
    training = bn.args[5] if len(bn.args) > 5 else bn.kwargs.get("training", False)
    return bn if training is False else None


#: the activations a conv chain takes between its convolutions and after the second: every
#: one the finder recognises
CONV_ACTIVATIONS = tuple(TORCH_ACTIVATIONS)


def _depthwise(conv: dict[str, Any]) -> bool:
    """A depthwise conv2d: a filter per channel (groups = its channels, weight [K, 1, R, S])."""
    w = value_of(conv["w"])
    return (
        isinstance(w, torch.Tensor)
        and w.dim() == 4
        and conv["groups"] == w.shape[0] > 1
        and w.shape[1] == 1
    )


def _conv(c1: fx.Node) -> Found | str | None:
    first = conv_at(c1)
    if first is None:
        return None
    if first["groups"] != 1:
        kind = "a depthwise" if _depthwise(first) else f"a grouped (groups={first['groups']})"
        return f"{kind} conv2d is not the first of a conv chain (only its second)"
    bn1 = _batch_norm(c1)
    end = bn1 or c1
    act = activation_at(end)
    if act is not None and act.name not in CONV_ACTIVATIONS:
        act = None
    mid = act.end if act is not None else end  # (no activation: MobileNet-V2's projection)
    c2 = _single_user(mid)
    padded: tuple[int, int] | None = (0, 0)
    pad = c2 if c2 is not None and c2.target in _PADS else None
    if pad is not None:  # TF's "SAME" padding written out (Hugging Face's MobileNets)
        padded = _zero_pad(pad)
        if padded is None:
            sides = pad.args[1] if len(pad.args) > 1 else pad.kwargs.get("pad")
            return (f"an F.pad other than zeros the same before both axes and after both "
                    f"({sides}) before its conv2d")  # fmt: skip
        c2 = _single_user(pad)
    second = conv_at(c2) if c2 is not None else None
    if second is not None and second["groups"] != 1 and not _depthwise(second):
        return f"it feeds a grouped conv2d (groups={second['groups']}): not depthwise"
    if c2 is None or second is None or second["x"] is not (pad or mid):
        if act is None:
            return f"not followed by an activation ({', '.join(CONV_ACTIVATIONS)}) or a conv2d"
        return f"its {act.name} does not feed a conv2d chainfuse can run"
    bn2 = _batch_norm(c2)
    taken = (*(act.nodes if act is not None else ()), *([pad] if pad is not None else []))
    assert padded is not None
    before, after = second["padding"] + padded[0], second["padding"] + padded[1]
    second = {**second, "padding": before, "pad_after": after}
    nodes: list[fx.Node] = [c1, *([bn1] if bn1 else []), *taken, c2, *([bn2] if bn2 else [])]
    last = activation_at(nodes[-1])
    after = last.name if last is not None and last.name in CONV_ACTIVATIONS else None
    if last is not None and after:
        nodes.extend(last.nodes)
    between = act.name if act is not None else None
    form = "conv2d" + (" -> batch_norm" if bn1 else "") + (f" -> {between}" if between else "")
    dw = " (depthwise)" if second["groups"] != 1 else ""
    form += " -> pad" if pad is not None else ""
    form += (
        f" -> conv2d{dw}" + (" -> batch_norm" if bn2 else "") + (f" -> {after}" if after else "")
    )
    parts = {"first": first, "second": second, "bn1": bn1, "bn2": bn2, "between": between,
             "after": after, "groups": second["groups"], "convs": (c1, c2)}  # fmt: skip
    return Found(ChainKind.CONV, form, tuple(nodes), parts)


#: `F.pad` as a traced graph calls it
_PADS = (F.pad, torch._C._nn.pad)


def _zero_pad(node: fx.Node) -> tuple[int, int] | None:
    """The zeros an `F.pad` of a 4-D tensor adds before and after each of its last two dims,
    where they are the same for both (`(l, r, t, b)` with l = t, r = b: a conv's own padding,
    or TF's "SAME" at stride 2), else None."""
    names = ("x", "pad", "mode", "value")
    bound = {"mode": "constant", "value": None, **dict(zip(names, node.args, strict=False)),
             **node.kwargs}  # fmt: skip
    sides = bound.get("pad")
    out = value_of(node)
    if bound["mode"] != "constant" or bound["value"] not in (None, 0, 0.0):
        return None
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or not isinstance(sides, tuple | list):
        return None
    values = [v for v in sides if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    if len(values) != 4 or len(sides) != 4:
        return None
    left, right, top, bottom = values
    return (left, right) if (left, right) == (top, bottom) else None


def _paired_convs(graph: fx.Graph) -> dict[fx.Node, Found | str]:
    """Each conv2d's chain, where it starts one, choosing among overlapping candidates.

    A conv can be the second of one chain and the first of the next (MobileNet-V2's
    projection -> expansion -> depthwise); the candidates form paths, and of two neighbours at
    most one fuses. On each path the chosen chains are those whose intermediates add up to the
    most elements (the traffic fusion saves): the expansion -> depthwise chain (6x channels)
    over the projection -> expansion one. A conv whose chain was not chosen says why."""
    found: dict[fx.Node, Found | str] = {}
    after: dict[fx.Node, fx.Node] = {}  # first conv -> the second conv of its candidate
    for node in graph.nodes:
        if kind_of(node) is Kind.CONV and (result := _conv(node)) is not None:
            found[node] = result
            if isinstance(result, Found):
                after[node] = result.parts["convs"][1]
    seconds = set(after.values())
    for start in [n for n in after if n not in seconds]:
        path = [start]
        while path[-1] in after:
            path.append(after[path[-1]])
        weights = [_elements(a) for a in path[:-1]]  # edge i: path[i] -> path[i + 1]
        # best[i]: the most elements from the edges 0..i-1 (`chose[i]`: edge i-1 is in it)
        best, chose = [0, 0], [False, False]
        for i, w in enumerate(weights, start=2):
            take = best[i - 2] + w
            best.append(max(take, best[i - 1]))
            chose.append(take > best[i - 1])
        chosen, i = set(), len(weights) + 1
        while i >= 2:
            if chose[i]:
                chosen.add(i - 2)
            i -= 2 if chose[i] else 1
        for edge in set(range(len(weights))) - chosen:
            found[path[edge]] = (
                f"its second conv2d ({path[edge + 1].name}) is fused with the conv2d after it "
                "instead, a larger intermediate"
            )
    return found


def _elements(conv: fx.Node) -> int:
    """Elements of a conv's result (at the traced sizes where they are symbols)."""
    out = value_of(conv)
    if not isinstance(out, torch.Tensor):
        return 0
    sizes = (d.node.hint if isinstance(d, torch.SymInt) else d for d in out.shape)
    return math.prod(int(d) if d is not None else 1 for d in sizes)


#: opaque ops `unfold` writes out, or reports with its reason where it cannot
_UNFOLD_REPORTS = (F.multi_head_attention_forward, torch._transformer_encoder_layer_fwd)


def find(graph: fx.Graph) -> Finding:
    """Every chain in `graph` (no node in two chains) and why each other compute op is not in
    one."""
    found = Finding()
    gemms = {g.node: g for n in graph.nodes if (g := gemm_at(n)) is not None}
    used: set[fx.Node] = set()

    def take(chain: Found) -> None:
        found.chains.append(chain)
        used.update(chain.nodes)

    convs = _paired_convs(graph)
    for node in graph.nodes:
        if node in used:
            continue
        kind = kind_of(node)
        result: Found | str | None = None
        if node in convs:
            result = convs[node]
        elif node in gemms:
            result = _gated(gemms[node], gemms) or _mlp(gemms[node], gemms)
        elif kind is Kind.MATMUL or node.target in (torch.baddbmm, "baddbmm"):
            result = _attention(node) or "a matmul of two activations not in an attention form"
        elif kind is Kind.SDPA:
            result = _sdpa(node)
        elif kind is Kind.CONV:
            result = _conv(node) or "dilation or padding chainfuse's conv chain lacks"
        elif kind is Kind.OPAQUE and node.target not in _UNFOLD_REPORTS:
            result = "PyTorch's fused multi-head attention op, kept whole"
        if isinstance(result, Found):
            if used.isdisjoint(result.nodes):
                take(result)
            else:
                found.skipped.append((node.name, "overlaps a chain found before"))
        elif result is not None:
            found.skipped.append((node.name, result))
    chained = {n.name for n in used}
    found.skipped = [(n, why) for n, why in found.skipped if n not in chained]
    return found
