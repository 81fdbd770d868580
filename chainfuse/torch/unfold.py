"""See through PyTorch's attention modules: Dynamo keeps `F.multi_head_attention_forward`
(`nn.MultiheadAttention`) and the encoder layer's fused fast path
(`torch._transformer_encoder_layer_fwd`, an `nn.TransformerEncoderLayer` in eval mode) as one
node each. `unfold` writes each as the ops it runs, so that the finder sees the attention and
the MLP inside:

    out, _ = multi_head_attention_forward(x, x, x, E, H, W_in, b_in, ..., W_out, b_out, ...)
    ==>
    qkv = linear(x, W_in, b_in).unflatten(-1, (3, H, E // H)).permute(2, 1, 3, 0, 4)
    out = linear(sdpa(qkv[0], qkv[1], qkv[2], mask).permute(2, 0, 1, 3).flatten(-2), W_out, b_out)

Each unfolded form computes what the op computes, NaN included:
  - multi-head attention: self- or cross-attention (packed or separate projection weights),
    `key_padding_mask` and `attn_mask` (boolean or additive, 2-D or per head) merged as PyTorch
    merges them, the `is_causal` hint; with `need_weights=False` it calls SDPA as PyTorch does;
    with `need_weights=True` and the weights unused it writes the scores, the softmax and the
    product out (PyTorch's own form there: a row with every key masked out is NaN);
  - the encoder layer's fast path: its mask (mask type 1 `[batch, keys]`, else broadcast to
    `[batch, heads, queries, keys]`) counts as boolean, nonzero meaning left out, and a row
    with every key left out is NaN, as in PyTorch's kernel; then the residual adds, the layer
    norms (before or after, `norm_first`) and the ReLU or GELU MLP.
Anything else (returned weights used, bias_k/v, add_zero_attn, static k/v, dropout while
training, unbatched inputs, sizes computed at run time) stays one node, and `unfold` says why.
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from chainfuse.torch.kinds import value_of

__all__ = ["unfold", "unfoldable"]

F = torch.nn.functional
_MHA = inspect.signature(F.multi_head_attention_forward)
_ENCODER_ARGS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight",
                 "proj_bias", "use_gelu", "norm_first", "eps", "norm1_weight", "norm1_bias",
                 "norm2_weight", "norm2_bias", "ffn1_weight", "ffn1_bias", "ffn2_weight",
                 "ffn2_bias", "mask", "mask_type")  # fmt: skip


class _Writer:
    """Inserts ops before one node of a graph."""

    def __init__(self, graph: fx.Graph, before: fx.Node) -> None:
        self.graph, self.before = graph, before

    def fn(self, target: Callable[..., Any], *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.before):
            return self.graph.call_function(target, args, kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self.before):
            return self.graph.call_method(name, args, kwargs)

    def rows(self, t: Any, start: int, stop: int) -> Any:
        """Rows `start:stop` of a weight or bias (None stays None)."""
        return None if t is None else self.fn(operator.getitem, t, slice(start, stop))

    def heads(self, x: fx.Node, w: Any, b: Any, parts: int, heads: int, dim: int) -> list[fx.Node]:
        """`linear(x, w, b)` of x `[seq, batch, E]` as `parts` tensors `[batch, heads, seq,
        dim]` (the projection's output viewed, not copied)."""
        out = self.method("unflatten", self.fn(F.linear, x, w, b), -1, (parts, heads, dim))
        split = self.method("permute", out, 2, 1, 3, 0, 4)
        return [self.fn(operator.getitem, split, i) for i in range(parts)]

    def written_attention(self, q: fx.Node, k: fx.Node, v: fx.Node, dim: int,
                          add: fx.Node | None = None,
                          fill: fx.Node | None = None) -> fx.Node:  # fmt: skip
        """softmax(q kᵀ / sqrt(dim) + add, with -inf where `fill`) v, written out."""
        scores = self.fn(torch.matmul, q, self.method("transpose", k, -2, -1))
        scores = self.fn(operator.mul, scores, math.sqrt(1.0 / dim))
        if add is not None:
            scores = self.fn(operator.add, scores, add)
        if fill is not None:
            scores = self.method("masked_fill", scores, fill, -math.inf)
        return self.fn(torch.matmul, self.method("softmax", scores, -1), v)


def _rank(node: Any) -> int | None:
    value = value_of(node)
    return value.dim() if isinstance(value, torch.Tensor) else None


def _mha_refusal(bound: dict[str, Any]) -> str | None:
    if bound.get("is_causal", False) and bound.get("attn_mask") is None:
        return "is_causal without attn_mask (PyTorch's own error)"
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if bound.get(name) is not None:
            return f"a {name}"
    if bound.get("add_zero_attn", False):
        return "add_zero_attn"
    if bound.get("training", True) and bound["dropout_p"]:
        return "dropout while training"
    if not isinstance(bound["num_heads"], int) or not isinstance(bound["embed_dim_to_check"], int):
        return "head counts computed at run time"
    if bound["embed_dim_to_check"] % bound["num_heads"]:
        return "embed_dim not a multiple of num_heads (PyTorch's own error)"
    if any(_rank(bound[n]) != 3 for n in ("query", "key", "value")):
        return "unbatched (or unknown) query, key or value: expected [seq, batch, embed_dim]"
    for name, ranks in (("key_padding_mask", (2,)), ("attn_mask", (2, 3))):
        if bound.get(name) is not None and _rank(bound[name]) not in ranks:
            return f"a {name} of rank {_rank(bound[name])} (expected {ranks})"
    return None


def _canonical(w: _Writer, mask: fx.Node, like: fx.Node) -> fx.Node:
    """A boolean mask as PyTorch's `_canonical_mask` makes it additive (-inf where true, in the
    query's dtype); an additive one as it is."""
    value = value_of(mask)
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return mask
    dtype = value_of(like).dtype
    return w.method("masked_fill", w.fn(torch.zeros_like, mask, dtype=dtype), mask, -math.inf)


def _unfold_mha(graph: fx.Graph, node: fx.Node, bound: dict[str, Any]) -> fx.Node:
    """`F.multi_head_attention_forward` as its ops (its output, `[seq, batch, E]`)."""
    w = _Writer(graph, node)
    query, key, value = bound["query"], bound["key"], bound["value"]
    heads, embed = bound["num_heads"], bound["embed_dim_to_check"]
    dim = embed // heads
    need_weights, is_causal = bound.get("need_weights", True), bound.get("is_causal", False)
    b, wi = bound.get("in_proj_bias"), bound.get("in_proj_weight")
    separate = bool(bound.get("use_separate_proj_weight", False))
    if not separate and query is key is value:  # (one projection, as PyTorch's)
        q, k, v = w.heads(query, wi, b, 3, heads, dim)
    elif not separate and key is value:
        q = w.heads(query, w.rows(wi, 0, embed), w.rows(b, 0, embed), 1, heads, dim)[0]
        k, v = w.heads(key, w.rows(wi, embed, 3 * embed), w.rows(b, embed, 3 * embed), 2, heads,
                       dim)  # fmt: skip
    else:  # (a projection each: rows of the packed weight, or weights of their own)
        weights = ([bound[f"{n}_proj_weight"] for n in "qkv"] if separate else
                   [w.rows(wi, i * embed, (i + 1) * embed) for i in range(3)])  # fmt: skip
        q, k, v = (w.heads(x, weights[i], w.rows(b, i * embed, (i + 1) * embed), 1, heads, dim)[0]
                   for i, x in enumerate((query, key, value)))  # fmt: skip
    padding, mask = bound.get("key_padding_mask"), bound.get("attn_mask")
    causal = is_causal and padding is None and not need_weights
    if causal:
        mask = None  # (PyTorch drops the mask for the hint: SDPA's is_causal)
    merged = None
    if mask is not None:  # [q, k] broadcasts; [batch * heads, q, k] -> [batch, heads, q, k]
        merged = _canonical(w, mask, query)
        if _rank(mask) == 3:
            merged = w.method("unflatten", merged, 0, (-1, heads))
    if padding is not None:  # [batch, k] -> [batch, 1, 1, k]
        keys = w.method("unsqueeze", w.method("unsqueeze", _canonical(w, padding, query), 1), 1)
        merged = keys if merged is None else w.fn(operator.add, merged, keys)
    if need_weights:
        out = w.written_attention(q, k, v, dim, add=merged)
    else:
        out = w.fn(F.scaled_dot_product_attention, q, k, v, merged, is_causal=causal)
    rows = w.method("flatten", w.method("permute", out, 2, 0, 1, 3), -2)
    return w.fn(F.linear, rows, bound["out_proj_weight"], bound["out_proj_bias"])


def _encoder_refusal(bound: dict[str, Any]) -> str | None:
    # (eps may be a node: under dynamic=True Dynamo passes floats as values read at run time)
    constants = ("embed_dim", "num_heads", "use_gelu", "norm_first", "mask_type")
    if any(isinstance(bound.get(n), fx.Node) for n in constants):
        return "sizes or settings computed at run time"
    if _rank(bound["src"]) != 3:
        return "src not [batch, seq, embed_dim] (a nested tensor, or its shape unknown)"
    if bound["embed_dim"] % bound["num_heads"]:
        return "embed_dim not a multiple of num_heads"
    if bound.get("mask") is not None:
        rank = _rank(bound["mask"])
        expected = 2 if bound.get("mask_type") in (0, 1) else 4
        if bound.get("mask_type") not in (0, 1, 2) or rank != expected:
            return f"a mask of rank {rank} with mask_type {bound.get('mask_type')}"
    return None


def _unfold_encoder_layer(graph: fx.Graph, node: fx.Node, bound: dict[str, Any]) -> fx.Node:
    """`torch._transformer_encoder_layer_fwd` as its ops (its output, `[batch, seq, E]`)."""
    w = _Writer(graph, node)
    src, embed, heads = bound["src"], bound["embed_dim"], bound["num_heads"]
    dim = embed // heads
    norm_first = bound["norm_first"]

    def norm(x: fx.Node, i: int) -> fx.Node:
        weight, bias = bound[f"norm{i}_weight"], bound[f"norm{i}_bias"]
        return w.fn(F.layer_norm, x, (embed,), weight, bias, bound["eps"])

    x = norm(src, 1) if norm_first else src
    qkv = w.method("unflatten", w.fn(F.linear, x, bound["qkv_weight"], bound["qkv_bias"]), -1,
                   (3, heads, dim))  # fmt: skip
    split = w.method("permute", qkv, 2, 0, 3, 1, 4)  # [3, batch, heads, seq, dim]
    q, k, v = (w.fn(operator.getitem, split, i) for i in range(3))
    mask = bound.get("mask")
    if mask is None:
        out = w.fn(F.scaled_dot_product_attention, q, k, v)
    else:
        dropped = w.fn(torch.ne, mask, 0)
        if bound["mask_type"] == 1:  # [batch, keys] -> [batch, 1, 1, keys]
            dropped = w.method("unsqueeze", w.method("unsqueeze", dropped, 1), 1)
        out = w.written_attention(q, k, v, dim, fill=dropped)
    rows = w.method("flatten", w.method("transpose", out, 1, 2), -2)
    x = w.fn(operator.add, w.fn(F.linear, rows, bound["proj_weight"], bound["proj_bias"]), src)
    if not norm_first:
        x = norm(x, 1)
    h = norm(x, 2) if norm_first else x
    hidden = w.fn(F.linear, h, bound["ffn1_weight"], bound["ffn1_bias"])
    hidden = w.fn(F.gelu if bound["use_gelu"] else F.relu, hidden)
    y = w.fn(operator.add, w.fn(F.linear, hidden, bound["ffn2_weight"], bound["ffn2_bias"]), x)
    return norm(y, 2) if not norm_first else y


def _mha_node(graph: fx.Graph, node: fx.Node) -> str | None:
    """Write out one `F.multi_head_attention_forward` node; None, or why it is kept whole."""
    bound = dict(_MHA.bind(*node.args, **node.kwargs).arguments)
    users = list(node.users)
    why = _mha_refusal(bound)
    if why is None and any(
        u.target is not operator.getitem or (u.args[1] != 0 and u.users) for u in users
    ):
        why = "its attention weights are used"
    if why is not None:
        return why
    out = _unfold_mha(graph, node, bound)
    for user in users:  # (getitem 0: the output; an unused getitem 1: the weights)
        if user.args[1] == 0:
            out.meta["example_value"] = value_of(user)
            user.replace_all_uses_with(out)
        graph.erase_node(user)
    graph.erase_node(node)
    return None


def _encoder_node(graph: fx.Graph, node: fx.Node) -> str | None:
    """Write out one `torch._transformer_encoder_layer_fwd` node; None, or why it is kept
    whole."""
    if len(node.args) + len(node.kwargs) != len(_ENCODER_ARGS):
        return "an unknown signature"
    bound = {**dict(zip(_ENCODER_ARGS, node.args, strict=False)), **node.kwargs}
    why = _encoder_refusal(bound)
    if why is not None:
        return why
    out = _unfold_encoder_layer(graph, node, bound)
    out.meta["example_value"] = value_of(node)  # (what a later layer's refusal reads)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return None


# the ops `unfold` writes out: what each is, in words, and its writer
_WRITERS: dict[Any, tuple[str, Callable[[fx.Graph, fx.Node], str | None]]] = {
    F.multi_head_attention_forward: ("multi-head attention", _mha_node),
    torch._transformer_encoder_layer_fwd: ("an encoder layer's fast path", _encoder_node),
}


def unfoldable(graph: fx.Graph) -> bool:
    """Whether `graph` holds a node `unfold` may write out."""
    return any(n.op == "call_function" and n.target in _WRITERS for n in graph.nodes)


def unfold(graph: fx.Graph) -> tuple[list[str], list[tuple[str, str]]]:
    """Unfold every multi-head-attention and encoder-layer node that can be; returns what was
    written out (a phrase a node) and (node, why not) for the others."""
    written: list[str] = []
    left = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _WRITERS:
            continue
        what, write = _WRITERS[node.target]
        name = node.name
        why = write(graph, node)
        if why is None:
            written.append(f"{name} ({what})")
        else:
            left.append((name, f"{what} kept whole: {why}"))
    return written, left
