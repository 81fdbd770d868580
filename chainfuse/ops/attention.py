"""`attention`: SDPA's semantics, fused into one kernel per call (or one per member of a group).

out = chainfuse.ops.attention(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False)
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from chainfuse import builders
from chainfuse.operands import is_torch
from chainfuse.ops import gpu
from chainfuse.ops.arguments import (
    batch_dims,
    inference_only,
    inner_contiguous,
    new_result,
    no_work,
    on_cpu,
    operands_of,
    plain,
    shape_of,
    subclassed,
)
from chainfuse.ops.calls import (
    amx_setting,
    bucket_key,
    bucketed,
    calls,
    replay,
    replay_keys,
    run,
    signature,
)
from chainfuse.ops.sdpa import attention_dims, attention_shape, check_flags
from chainfuse.ops.views import lead_merged, stretched
from chainfuse.runtime import get_num_threads

__all__ = ["attention", "known_attention"]


def known_attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any,
    is_causal: Any,
    scale: Any,
    enable_gqa: Any,
    threads: int,
    softcap: Any = None,
) -> tuple[Any, tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """(the result, None, None) of an `attention` call (no dropout) like one run before
    (`replay`, or `replay_keys` for another key length in a known bucket); else (None, its
    `calls.replays` key, its `calls.by_keys` key) for `run` to remember it by (None where it
    cannot be replayed: plain bools, a float or no scale, operands all of a kind).
    `chainfuse.torch` calls it first, to skip its own per-call work on a known call."""
    if (
        (is_causal is False or is_causal is True)
        and (enable_gqa is False or enable_gqa is True)
        and (scale is None or scale.__class__ is float)
        and (softcap is None or softcap.__class__ is float)
    ):
        sig = signature((q, k, v, attn_mask))
        if sig is not None:
            # (the signature last: `bucket_key` reads it there)
            cap = () if softcap is None else (softcap,)
            key = ("attention", is_causal, enable_gqa, scale, threads, amx_setting(), *cap, sig)
            replays = calls.replays
            hit = replays.get(key)
            if hit is not None:
                replays.hits += 1
                return replay(hit, (q, k, v, attn_mask), None, threads), None, None
            replays.misses += 1
            found = bucket_key(key, attn_mask)
            if found is None:
                return None, key, None
            by_keys, n = found  # 4-D: another key length in a bucket known, or strides
            memo = calls.by_keys
            hit = memo.get(by_keys)
            if hit is None:
                memo.misses += 1
            else:
                memo.hits += 1
                done = replay_keys(hit, (q, k, v, attn_mask), n, threads, key)
                if done is not None:
                    return done, None, None
            return None, key, by_keys
    return None, None, None


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
    softcap: float | None = None,
) -> Any:
    """`softmax(q kᵀ * scale + mask) v`, fused, for numpy arrays or torch CPU tensors, float32,
    bfloat16 or float16 (an additive mask then has q's dtype too, as in PyTorch).

    q [batch, heads, seq_q, d_qk] (or [batch, seq_q, d_qk]), k [.., seq_k, d_qk],
    v [.., seq_k, d_v]; more batch dims before the heads are fine too (SDPA's (N, ..., H, L, E)),
    and so are 2-D operands and operands of different ranks (aligned from the right). A batch
    size or head count of 1 in any of them broadcasts against the others' as in PyTorch (read
    in place, not copied). `attn_mask` is boolean (True takes part) or additive
    float, and broadcasts to [batch, heads, seq_q, seq_k] as in PyTorch; `is_causal` masks keys after each
    query (top-left aligned, PyTorch's rule); both may be given. A query whose keys are all
    masked gets zeros, and so does every query when there are no keys (seq_k = 0); an empty q
    gives an empty result. `scale` defaults to 1/sqrt(d_qk). `softcap` (soft-capping: Gemma 2's
    attention, FlashAttention's `softcap`), a number > 0: the scaled scores s become
    `softcap * tanh(s / softcap)` before the mask is added.

    `enable_gqa` (grouped-query attention, PyTorch's rule): k and v may have fewer heads than
    q, a divisor of them; key head j serves query heads j*g .. j*g + g-1 (g = q's heads / k's),
    read in place, never repeated in memory. k and v may have different head counts then, each
    a divisor of q's (each grouped on its own, as PyTorch does): both are repeated along the
    heads to the least common multiple of the two (a copy of one or both, as large as they
    are). `dropout_p` is accepted for SDPA's signature and must be 0 (inference). torch inputs
    that require grad are refused while grad mode is on: the kernel has no backward, and a
    result silently cut from the graph would be wrong later.
    """
    if q.__class__ is not np.ndarray and gpu.routed(q, k, v, attn_mask):  # CUDA, or triton
        return gpu.attention(q, k, v, attn_mask, is_causal, scale, dropout_p=dropout_p,
                             enable_gqa=enable_gqa, softcap=softcap)  # fmt: skip
    threads = get_num_threads()
    key = by_keys = None
    if dropout_p.__class__ is float and dropout_p == 0.0:
        done, key, by_keys = known_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa,
                                             threads, softcap)  # fmt: skip
        if done is not None:
            return done
    if subclassed(q, k, v, attn_mask):  # (np.memmap and such: plain arrays over their memory)
        return attention(plain(q), plain(k), plain(v), plain(attn_mask), is_causal, scale,
                         dropout_p=dropout_p, enable_gqa=enable_gqa, softcap=softcap)  # fmt: skip
    # (identity tests first: each check costs a measurable share of a short call)
    if (
        (is_causal is not False and is_causal is not True)
        or (enable_gqa is not False and enable_gqa is not True)
        or dropout_p.__class__ is not float
        or dropout_p != 0.0
    ):
        check_flags(is_causal, enable_gqa, dropout_p)
    if softcap is not None:
        softcap = builders.check_softcap(softcap)
    dtype, (sq, sk, sv) = operands_of("q, k, v", q, k, v)
    if min(len(sq), len(sk), len(sv)) < 2:
        raise ValueError(f"q, k, v: expected [..., seq, dim] each, got shapes {sq}, {sk}, {sv}")
    inference_only("q, k, v, attn_mask", q, k, v, attn_mask)
    on_cpu("q, k, v, attn_mask", q, k, v, attn_mask)
    inner_contiguous("q, k, v", q, k, v)
    if not len(sq) == len(sk) == len(sv) or len(sq) == 2:
        return _attention_ranks(q, k, v, attn_mask, is_causal, scale, enable_gqa, softcap)
    if len(sq) > 4:
        return _attention_nd(q, k, v, attn_mask, is_causal, scale, enable_gqa, softcap)
    flat = len(sq) == 3
    # 3-D inputs: [batch, seq, dim] as one head per batch, or, with enable_gqa, their first
    # dim as the heads (PyTorch groups dim -3, whatever it is)
    lifted = flat and bool(enable_gqa) and (sk[0] != sq[0] or sv[0] != sq[0])
    first = q
    if lifted:
        q, k, v = q[None], k[None], v[None]
        sq, sk, sv = (1, *sq), (1, *sk), (1, *sv)
    elif flat:
        q, k, v = q[:, None], k[:, None], v[:, None]
        sq, sk, sv = (sq[0], 1, *sq[1:]), (sk[0], 1, *sk[1:]), (sv[0], 1, *sv[1:])
    wide = attention_dims(sq, sk, sv, bool(enable_gqa))
    if sk[1] != sv[1] and 1 not in (sk[1], sv[1]):
        # GQA with k's and v's heads grouped each on its own: both repeated along the heads to
        # the least common multiple of theirs (attention_dims' kv heads), the one grouping the
        # kernel reads: a copy of k or v or both, so no replay of the caller's own is recorded
        k, v = (_heads_repeated(x, wide[2] // s[1]) for x, s in ((k, sk), (v, sv)))
        sk, sv = (*sk[:1], wide[2], *sk[2:]), (*sv[:1], wide[2], *sv[2:])
        key = by_keys = None
    if (*sq[:2], *sk[:2], *sv[:2]) != (wide[0], wide[1], *(wide[0], wide[2]) * 2):
        # batch or head dims of 1 stretched as PyTorch broadcasts them: views with stride 0,
        # read in place. A repeat call replays these strides; the replay by key length is not
        # recorded (it rebinds the caller's own k and v, which are not the stretched views)
        batch, heads, kv_heads = wide
        q = stretched(q, (batch, heads, *sq[2:]))
        k, v = (stretched(x, (batch, kv_heads, *s[2:])) for x, s in ((k, sk), (v, sv)))
        sq, sk, sv = (batch, heads, *sq[2:]), (batch, kv_heads, *sk[2:]), (batch, kv_heads, *sv[2:])
        by_keys = None
    batch, heads, seq_q, d_qk = sq
    kv_heads = sk[1]
    if kv_heads != heads and not (enable_gqa and kv_heads > 0 and heads % kv_heads == 0):
        want = "a divisor of q's heads" if enable_gqa else "q's heads (or pass enable_gqa=True)"
        raise ValueError(
            f"k, v: expected {want}, got {kv_heads} heads against q's {heads} "
            f"(shapes {tuple(sq)}, {tuple(sk)}, {tuple(sv)})"
        )
    if sk[3] != d_qk:
        raise ValueError(f"k: expected head dim {d_qk} (q's), got {sk[3]}")
    seq_k = sk[2]
    if sv[2] != seq_k:
        raise ValueError(f"v: expected {seq_k} keys (k's), got {sv[2]}")
    mask_kind = None
    mask_shape = None
    if attn_mask is not None:
        mask_shape = shape_of("attn_mask", attn_mask, float32=False)
        if len(mask_shape) < 2:  # a scalar or one row of keys: [1, 1] / [1, seq_k], broadcast
            mask_shape = (1,) * (2 - len(mask_shape)) + mask_shape
            attn_mask = attn_mask.reshape(mask_shape)
        mask_dtype = str(getattr(attn_mask, "dtype", ""))
        mask_kind = "bool" if mask_dtype in ("bool", "torch.bool") else "additive"
        if flat and not lifted and len(mask_shape) == 3:  # [batch, seq_q, seq_k], 3-D inputs
            attn_mask = attn_mask[:, None]
            mask_shape = (mask_shape[0], 1, *mask_shape[1:])
        full = (batch, heads, seq_q, seq_k)  # (q's heads: with GQA, k's are fewer)
        if not builders.broadcasts(mask_shape, full):
            raise ValueError(f"attn_mask: shape {mask_shape} does not broadcast to {full}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale: expected a real number or None, got {scale!r}")
        scale = float(scale)
    if 0 in (batch, heads, seq_q, seq_k, sv[3]):  # no work: PyTorch's empty result or zeros
        result = no_work("q", q, (batch, heads, seq_q, sv[3]))
        return result[0] if lifted else result[:, 0] if flat else result
    causal = bool(is_causal)
    # the result in the caller's shape; the kernel writes it through a 4-D view
    shape = (heads, seq_q, sv[3]) if lifted else (batch, seq_q, sv[3]) if flat else None
    result, like = new_result(first, shape or (batch, heads, seq_q, sv[3]))
    out = result[None] if lifted else result[:, None] if flat else result
    if kv_heads != heads:
        _grouped(q, k, v, attn_mask, causal, scale, softcap, mask_kind, mask_shape, dtype, out,
                 (threads, key, result, like, by_keys))  # fmt: skip
    else:
        kernel, keys = bucketed((batch, heads, seq_q, seq_k, d_qk, sv[3]), causal, mask_kind,
                                 scale, mask_shape, dtype, threads, softcap)  # fmt: skip
        inputs = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
        run(kernel, inputs, out, threads, key, result, like, keys, by_keys)
    return result


def _attention_ranks(
    q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None, gqa: bool,
    cap: float | None,
) -> Any:  # fmt: skip
    """`attention` on q, k, v of different ranks, or 2-D ([seq, dim]): each seen with leading
    dims of 1 up to the highest rank (3 at least), as PyTorch's broadcasting aligns them (a
    3-D q beside 4-D k and v is [heads, seq, dim]); the result has the highest rank."""
    rank = max(len(q.shape), len(k.shape), len(v.shape))
    padded = max(rank, 3)
    q, k, v = (x.reshape((1,) * (padded - len(x.shape)) + tuple(x.shape)) for x in (q, k, v))
    out = attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa,
                    softcap=cap)  # fmt: skip
    return out.reshape(out.shape[padded - rank :]) if padded > rank else out


def _attention_nd(
    q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None, gqa: bool,
    cap: float | None,
) -> Any:  # fmt: skip
    """`attention` on q, k, v of 5 or more dims, [*batch, heads, seq, dim] (SDPA's
    (N, ..., H, L, E)): the batch dims broadcast, then merge into one where every operand's
    memory allows it (a contiguous one does: one 4-D call, the result a view of its result),
    else one 4-D call per index of the batch dims but the last, into a new result."""
    n = len(q.shape) - 3
    lead = batch_dims(q.shape, k.shape, v.shape, n)
    if 0 in lead:  # no work: an empty result
        return no_work("q", q, attention_shape(q.shape, k.shape, v.shape, gqa))
    operands = [stretched(x, (*lead, *x.shape[n:])) for x in (q, k, v)]
    if mask is not None:  # (its last 3 dims: checked by the 4-D calls)
        m = tuple(mask.shape)
        inner = (1,) * (3 - len(m)) + m[-3:]
        if not builders.broadcasts(m[:-3], lead):
            full = (*lead, q.shape[-3], q.shape[-2], k.shape[-2])
            raise ValueError(f"attn_mask: shape {m} does not broadcast to {full}")
        operands.append(stretched(mask.reshape(inner) if len(m) < 3 else mask, (*lead, *inner)))
    merged = [lead_merged(x, n) for x in operands]
    if all(x is not None for x in merged):
        four = attention(merged[0], merged[1], merged[2],
                         attn_mask=merged[3] if mask is not None else None,
                         is_causal=causal, scale=scale, enable_gqa=gqa, softcap=cap)  # fmt: skip
        return four.reshape(*lead, *four.shape[1:])
    result: Any = None
    for at in np.ndindex(*lead[:-1]):
        qa, ka, va = (x[at] for x in operands[:3])
        part = attention(qa, ka, va, attn_mask=operands[3][at] if mask is not None else None,
                         is_causal=causal, scale=scale, enable_gqa=gqa, softcap=cap)  # fmt: skip
        if result is None:
            result, _ = new_result(part, (*lead, *part.shape[1:]))
        result[at] = part
    return result


def _heads_repeated(x: Any, times: int) -> Any:
    """`x` [batch, heads, seq, dim] with each head repeated `times` times in a row (a new
    array or tensor; `x` itself when `times` is 1): PyTorch's `repeat_interleave` on dim 1."""
    if times == 1:
        return x
    return np.repeat(x, times, axis=1) if type(x) is np.ndarray else x.repeat_interleave(times, 1)


def _split_heads(x: Any, kv_heads: int, group: int) -> Any:
    """[heads, ...] as [kv_heads, group, ...] (a view: one dim split in two)."""
    if type(x) is np.ndarray:
        return x.reshape(kv_heads, group, *x.shape[1:])
    return x.unflatten(0, (kv_heads, group))


def _broadcast_heads(x: Any, group: int) -> Any:
    """[kv_heads, seq, dim] as [kv_heads, group, seq, dim], each head seen `group` times (a
    view with a stride of 0)."""
    shape = (x.shape[0], group, *x.shape[1:])
    if type(x) is np.ndarray:
        return np.broadcast_to(x[:, None], shape)
    return x[:, None].expand(*shape)


def _grouped(
    q: Any, k: Any, v: Any, mask: Any, causal: bool, scale: float | None, cap: float | None,
    mask_kind: str | None,
    mask_shape: tuple[int, ...] | None, dtype: str, out: Any,
    call: tuple[int, tuple[Any, ...] | None, Any, bool, tuple[Any, ...] | None],
) -> None:  # fmt: skip
    """Grouped-query attention (4-D operands, k and v with heads/g heads) with k and v in place,
    into `out` [batch, heads, seq_q, d_v] (a contiguous result, or a view of one), scores capped
    by `cap` (softcap); `call` is `run`'s (threads, key, result, like, by_keys).

    Without causality, and either with one query and a mask (if any) that does not vary over
    the heads, or without a mask and with q's heads g at a time one after the other in memory
    (a contiguous q), q is seen as [batch, kv_heads, g * seq_q, d]: one call whose blocks of
    queries are g times longer (remembered for a repeat call). Else, with a batch of one (a
    prefill), one call on q seen as [kv_heads, g, seq_q, d] and k, v as [kv_heads, g, seq, d]
    with a stride of 0 over g (remembered too). Otherwise one call per member of the group on
    the strided views q[:, j::g] and out[:, j::g] (a mask along the heads sliced the same
    way)."""
    batch, heads, seq_q, d_qk = (int(s) for s in q.shape)
    kv_heads, seq_k, d_v = int(k.shape[1]), int(k.shape[2]), int(v.shape[3])
    group = heads // kv_heads
    torch = is_torch(q)
    threads, key, result, like, by_keys = call
    row = q.stride(2) if torch else q.strides[2]
    head = q.stride(1) if torch else q.strides[1]
    per_head = mask_shape is not None and len(mask_shape) >= 3 and mask_shape[-3] == heads > 1
    # one query (a decoding step): a mask that is the same for every head (a padding mask) is
    # the same for every row of the merged call too, and k and v are read once per group
    if not causal and (seq_q == 1 or (mask is None and head == seq_q * row)) and not per_head:
        sizes = (batch, kv_heads, group * seq_q, seq_k, d_qk, d_v)
        kernel, keys = bucketed(sizes, False, mask_kind, scale, mask_shape, dtype, threads, cap)
        merged = (batch, kv_heads, group * seq_q)
        if torch:
            q_all, out_all = q.view(*merged, d_qk), out.view(*merged, d_v)
        else:  # views: q's heads are contiguous, and so is out
            q_all, out_all = q.reshape(*merged, d_qk), out.reshape(*merged, d_v)
        merged_inputs = (q_all, k, v) if mask is None else (q_all, k, v, mask)
        run(kernel, merged_inputs, out_all, threads, key, result, like, keys, by_keys)
        return
    if batch == 1:
        # one call: the kv heads as the batch, each one's group of q heads as its heads, k and
        # v read in place for all of them (a stride of 0 over the group). A repeat call
        # replays it; the replay by key length is not recorded (it rebinds the caller's own k
        # and v, which are not these views)
        split = [_split_heads(x[0], kv_heads, group) for x in (q, out)]
        kv = [_broadcast_heads(x[0], group) for x in (k, v)]
        operands: tuple[Any, ...] = (split[0], *kv)
        if mask is not None:
            m = mask.reshape((1,) * (4 - len(mask.shape)) + tuple(mask.shape))[0]
            operands += (_split_heads(m, kv_heads, group) if per_head else m[None],)
        one = (kv_heads, group, seq_q, seq_k, d_qk, d_v)
        shape = tuple(int(s) for s in operands[3].shape) if mask is not None else None
        kernel, keys = bucketed(one, causal, mask_kind, scale, shape, dtype, threads, cap)
        run(kernel, operands, split[1], threads, key, result, like, keys, None)
        return
    if per_head and mask_shape is not None:
        mask_shape = (*mask_shape[:-3], kv_heads, *mask_shape[-2:])
    sizes = (batch, kv_heads, seq_q, seq_k, d_qk, d_v)
    kernel, keys = bucketed(sizes, causal, mask_kind, scale, mask_shape, dtype, threads, cap)
    for j in range(group):
        inputs = [q[:, j::group], k, v]
        if mask is not None:
            inputs.append(mask[..., j::group, :, :] if per_head else mask)
        run(kernel, tuple(inputs), out[:, j::group], threads, None, None, False, keys)
