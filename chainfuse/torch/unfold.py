"""See through `nn.MultiheadAttention`: Dynamo keeps `F.multi_head_attention_forward` as one
node; for self-attention without masks it is unfolded into the ops it runs, so the finder sees
the SDPA call inside.

    out, _ = multi_head_attention_forward(x, x, x, E, H, W_in, b_in, ..., W_out, b_out, ...)
    ==>
    qkv = linear(x, W_in, b_in).unflatten(-1, (3, H, E // H)).permute(2, 1, 3, 0, 4)
    out = linear(sdpa(qkv[0], qkv[1], qkv[2]).permute(2, 0, 1, 3).flatten(-2), W_out, b_out)

Anything else (masks, separate projection weights, bias_k/v, returned weights, dropout while
training) stays one node, and `unfold` says why. The encoder layer's fused fast path
(`torch._transformer_encoder_layer_fwd`) is PyTorch's own kernel and is not unfolded: the
finder reports it.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx

__all__ = ["unfold"]

F = torch.nn.functional


def _refusal(bound: dict[str, Any]) -> str | None:
    if not (bound["query"] is bound["key"] is bound["value"]):
        return "not self-attention (query, key and value differ)"
    if bound.get("need_weights", True):
        return "it returns the attention weights"
    for name in ("key_padding_mask", "attn_mask", "bias_k", "bias_v", "static_k", "static_v"):
        if bound.get(name) is not None:
            return f"a {name}"
    if bound.get("use_separate_proj_weight", False) or bound.get("add_zero_attn", False):
        return "separate projection weights or add_zero_attn"
    if bound.get("is_causal", False) or (bound.get("training", True) and bound["dropout_p"]):
        return "is_causal or dropout while training"
    if not isinstance(bound["num_heads"], int) or not isinstance(bound["embed_dim_to_check"], int):
        return "head counts computed at run time"
    return None


def unfold(graph: fx.Graph) -> list[tuple[str, str]]:
    """Unfold every multi-head-attention node that can be; returns (node, why not) for the
    others."""
    signature = inspect.signature(F.multi_head_attention_forward)
    left = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not F.multi_head_attention_forward:
            continue
        bound = dict(signature.bind(*node.args, **node.kwargs).arguments)
        why = _refusal(bound)
        users = list(node.users)
        if why is None and not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            why = "its attention weights are used"
        if why is not None:
            left.append((node.name, f"multi-head attention kept whole: {why}"))
            continue
        heads, dim = bound["num_heads"], bound["embed_dim_to_check"]
        with graph.inserting_before(node):
            qkv = graph.call_function(
                F.linear, (bound["query"], bound["in_proj_weight"], bound["in_proj_bias"])
            )
            split = graph.call_method("unflatten", (qkv, -1, (3, heads, dim // heads)))
            parts = graph.call_method("permute", (split, 2, 1, 3, 0, 4))
            q, k, v = (graph.call_function(operator.getitem, (parts, i)) for i in range(3))
            attn = graph.call_function(F.scaled_dot_product_attention, (q, k, v))
            rows = graph.call_method("permute", (attn, 2, 0, 1, 3))
            flat = graph.call_method("flatten", (rows, -2))
            out = graph.call_function(
                F.linear, (flat, bound["out_proj_weight"], bound["out_proj_bias"])
            )
        for user in users:
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(node)
    return left
