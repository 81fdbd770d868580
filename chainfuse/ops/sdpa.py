"""The argument rules of SDPA (`torch.nn.functional.scaled_dot_product_attention`) that
`attention` (CPU and GPU) and `chainfuse.torch` share: the flags it takes, how q, k and v
broadcast and group, and the result's shape, for sizes that may be symbolic (a compiler's).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from chainfuse.ops.arguments import batch_dims

__all__ = ["attention_dims", "attention_shape", "check_flags"]


def check_flags(is_causal: Any, enable_gqa: Any, dropout_p: Any) -> None:
    """Raise what SDPA's flags are checked for: `is_causal` and `enable_gqa` bools (numpy's
    too), `dropout_p` zero (inference). A caller on a hot path tests the common values first
    and calls this only where one differs."""
    if not isinstance(is_causal, bool | np.bool_):
        raise TypeError(
            f"is_causal: expected a bool, got {is_causal!r} (dropout_p and enable_gqa are "
            "keyword-only here: SDPA's fifth positional argument is dropout_p)"
        )
    if not isinstance(enable_gqa, bool | np.bool_):
        raise TypeError(f"enable_gqa: expected a bool, got {enable_gqa!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        raise ValueError(
            f"dropout_p: expected 0.0, got {dropout_p!r}: chainfuse's attention is for inference "
            "(no dropout, no backward)"
        )


def attention_dims(
    sq: Sequence[Any], sk: Sequence[Any], sv: Sequence[Any], gqa: bool
) -> tuple[Any, Any, Any]:
    """(batch, q's heads, k's and v's heads) of an attention on 4-D q, k, v of shapes `sq`,
    `sk`, `sv`, broadcast as `torch.nn.functional.scaled_dot_product_attention` broadcasts
    them: each batch size and head count equal or 1 (a 1 stretches; q's heads stretch to k's
    only without `gqa`, and k's and v's one head to q's heads unless `gqa` groups them).
    Other sizes are a ValueError naming the three shapes."""
    batch, heads, kv_heads = sq[0], sq[1], sk[1]
    for n in (sk[0], sv[0]):
        if n != batch and batch != 1 and n != 1:
            raise ValueError(
                f"q, k, v: batch sizes {sq[0]}, {sk[0]}, {sv[0]} do not broadcast "
                f"(shapes {tuple(sq)}, {tuple(sk)}, {tuple(sv)})"
            )
        batch = n if batch == 1 else batch
    if sv[1] != kv_heads:
        if kv_heads != 1 and sv[1] != 1 and not gqa:
            raise ValueError(
                f"k, v: head counts {sk[1]} and {sv[1]} differ (shapes {tuple(sk)}, {tuple(sv)})"
            )
        if kv_heads != 1 and sv[1] != 1:
            # GQA groups k's heads and v's each on its own (PyTorch's rule): both must divide
            # q's; both are then seen with the least common multiple of theirs (`attention`)
            if heads % kv_heads != 0 or heads % sv[1] != 0:
                raise ValueError(
                    f"k, v: expected head counts that divide q's {heads}, got {sk[1]} and "
                    f"{sv[1]} (shapes {tuple(sq)}, {tuple(sk)}, {tuple(sv)})"
                )
            kv_heads = math.lcm(int(kv_heads), int(sv[1]))
        else:
            kv_heads = sv[1] if kv_heads == 1 else kv_heads
    if kv_heads == 1 and heads > 1 and not gqa:
        kv_heads = heads
    elif heads == 1 and kv_heads > 1 and not gqa:
        heads = kv_heads
    return batch, heads, kv_heads


def attention_shape(
    sq: Sequence[Any], sk: Sequence[Any], sv: Sequence[Any], gqa: bool
) -> tuple[Any, ...]:
    """The shape of `attention`'s result for q, k, v of shapes `sq`, `sk`, `sv` (any ranks of 2
    and up, aligned from the right; sizes may be symbolic, as a compiler's are), after the
    checks `attention` makes of them, raising the same errors."""
    if min(len(sq), len(sk), len(sv)) < 2:
        raise ValueError(
            f"q, k, v: expected [..., seq, dim] each, got shapes {tuple(sq)}, {tuple(sk)}, "
            f"{tuple(sv)}"
        )
    if sk[-1] != sq[-1]:
        raise ValueError(f"k: expected head dim {sq[-1]} (q's), got {sk[-1]}")
    if sv[-2] != sk[-2]:
        raise ValueError(f"v: expected {sk[-2]} keys (k's), got {sv[-2]}")
    # ranks aligned from the right (`_attention_ranks`): leading dims of 1, 3-D at least
    rank = max(len(sq), len(sk), len(sv))
    sq, sk, sv = ((1,) * (max(rank, 3) - len(s)) + tuple(s) for s in (sq, sk, sv))
    lead: tuple[Any, ...]
    if len(sq) > 4:  # batch dims broadcast (`_attention_nd`), heads as below
        heads = attention_dims((1, sq[-3]), (1, sk[-3]), (1, sv[-3]), gqa)[1]
        lead = (*batch_dims(sq, sk, sv, len(sq) - 3), heads)
    elif len(sq) == 4:  # batch and heads broadcast
        lead = attention_dims(sq, sk, sv, gqa)[:2]
    elif gqa and (sk[0] != sq[0] or sv[0] != sq[0]):  # 3-D with GQA: the first dim: heads
        lead = (sq[0],)
    else:
        lead = attention_dims((sq[0], 1), (sk[0], 1), (sv[0], 1), False)[:1]
    shape = (*lead, sq[-2], sv[-1])
    return shape[len(shape) - rank :]
