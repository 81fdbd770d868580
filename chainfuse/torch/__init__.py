"""PyTorch integration: the only module of chainfuse that needs torch (imported lazily)."""

from __future__ import annotations

from typing import Any

from chainfuse import ops

__all__ = ["attention"]


def attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> Any:
    """`torch.nn.functional.scaled_dot_product_attention` semantics (inference, no dropout).

    As in PyTorch, an explicit `attn_mask` together with `is_causal=True` is an error, a boolean
    mask marks the positions that take part, and a float mask is added to the scores;
    `enable_gqa=True` lets k and v have fewer heads (a divisor of q's), each serving a group of
    q's heads. `dropout_p` (keyword-only here) must be 0. Inputs that require grad are refused
    while grad mode is on (no backward): use `torch.no_grad()` or `torch.inference_mode()`.
    """
    import torch

    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if attn_mask is not None:
        if is_causal:
            raise ValueError("attn_mask: must be None when is_causal=True (as in PyTorch's SDPA)")
        if attn_mask.dtype not in (torch.bool, q.dtype):
            raise TypeError(
                f"attn_mask: expected dtype bool or {q.dtype} (q's), got {attn_mask.dtype}"
            )
    # (no autograd context needed: the kernel writes a fresh tensor outside the graph)
    return ops.attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                         dropout_p=dropout_p, enable_gqa=enable_gqa)  # fmt: skip
