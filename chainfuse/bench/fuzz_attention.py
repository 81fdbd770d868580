"""Fuzz cases of attention: `ops.attention`, `chainfuse.torch.attention`, SDPA under
`chainfuse.torch.patch_sdpa`, and kernels of `chainfuse.compile(attention_chain(...))` called
directly (`chainfuse.bench.fuzz`).

Every case is built in a canonical form, q [*lead, heads, seq_q, d] (lead: one or two batch
dims), and passed with fewer dims where its rank says so (3-D: no heads; 2-D: no batch either).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

import chainfuse
from chainfuse import builders, ops
from chainfuse.bench.fuzz_cases import (
    Case,
    describe_operand,
    flat,
    layout_for,
    oracle_torch,
    pick,
    reference_of,
    special,
)
from chainfuse.bench.fuzz_values import Kind, Layout, Operand, inject, place, rounded, size
from chainfuse.bench.fuzz_values import torch_or_none as _torch

__all__ = ["attention_case"]

_NAMES = frozenset({"q", "k", "v", "attn_mask", "is_causal", "scale", "enable_gqa", "dropout_p",
                    "Q", "K", "V", "mask", "O", "out", "query", "key", "value"})  # fmt: skip
#: head dims: their scale (1/sqrt(d)) is part of a kernel's source, so the set stays small
_HEAD_DIMS = (1, 3, 8, 16, 17, 32, 64, 65)
_SCALES = (None, None, None, 0.5, 0.125)


def _mask_shape(rng: np.random.Generator, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts to `full` (the op's [*lead, heads, seq_q, seq_k], or fewer dims
    for 3-D and 2-D inputs): the whole of it, or with leading dims dropped or set to 1."""
    n = len(full)
    choice = int(rng.integers(6))
    if choice == 0:
        return full
    if choice == 1:
        return full[-2:]  # [seq_q, seq_k]
    if choice == 2:
        return full[-1:]  # one row of keys, for every query
    if choice == 3 and n >= 3:  # a padding mask: [batch, 1.., 1, seq_k]
        return (full[0], *(1,) * (n - 2), full[-1])
    shape = [d if rng.random() < 0.5 else 1 for d in full[:-2]] + list(full[-2:])
    return tuple(shape[int(rng.integers(0, n - 1)) if rng.random() < 0.3 else 0 :])


def attention_case(
    rng: np.random.Generator, dtype: str, entries: list[str], compact: bool = False
) -> Case:
    """A random attention call: ranks 2 to 5, broadcast batch and heads, GQA, every mask kind
    and broadcast mask shape, causal, fully masked rows, layouts, NaN/inf or large values.
    `compact`: fewer kernel structures (one scale, masks [seq_q, seq_k], causal without a
    mask), so a short run compiles little."""
    torch = _torch()
    features: list[str] = []
    entry = str(pick(rng, entries, [{"ops": 6, "torch": 2, "sdpa": 1, "compile": 2}[e]
                                    for e in entries]))  # fmt: skip
    features.append(entry)
    if entry in ("torch", "sdpa") or dtype == "bfloat16":
        kind = Kind.TORCH
    else:
        kind = Kind(pick(rng, ["numpy", "torch"] if torch is not None else ["numpy"]))
    features.append(kind.value)
    rank = 4 if entry == "compile" else int(pick(rng, [4, 3, 2, 5], [6, 2, 1, 1]))
    if rank != 4:
        features.append(f"rank{rank}")
    while True:
        b = int(pick(rng, [1, 1, 2, 3])) if rank != 2 else 1
        h = int(pick(rng, [1, 2, 3, 4, 6, 8])) if rank >= 4 else 1
        sq, sk = size(rng, 129), size(rng, 129)
        d, dv = int(pick(rng, _HEAD_DIMS)), int(pick(rng, _HEAD_DIMS))
        if b * h * sq * sk * (d + dv) <= 500_000:
            break
    lead = (b,) if rank != 5 else (b, int(pick(rng, [1, 2, 3])))
    gqa = rank >= 4 and h > 1 and entry != "compile" and rng.random() < 0.3
    hk = hv = h
    if gqa:
        divisors = [g for g in range(1, h) if h % g == 0]
        hk = hv = int(pick(rng, divisors))
        if rng.random() < 0.2:
            hv = int(pick(rng, divisors))
        features.append("gqa")
    elif rank >= 4 and h > 1 and entry != "compile" and rng.random() < 0.15:
        hk = hv = 1  # one k/v head broadcast to every query head
        features.append("bcast_heads")
    leads = {x: lead for x in "qkv"}
    if rank >= 3 and entry != "compile" and rng.random() < 0.2:
        one = pick(rng, ["q", "k", "v"])
        leads[one] = (1, *lead[1:])
        features.append("bcast_batch")
    heads = {"q": h, "k": hk, "v": hv}
    tails = {"q": (sq, d), "k": (sk, d), "v": (sk, dv)}
    canon = {x: (*leads[x], heads[x], *tails[x]) for x in "qkv"}
    what = special(rng, features, dtype)
    stds = {"q": 1.0, "k": 1.0, "v": 1.0}
    if what == "large":
        stds["q"] = 10 ** rng.uniform(0.5, 2.0 if dtype == "float16" else 3.0)
        stds["v"] = 10 ** rng.uniform(1.0, 4.0 if dtype == "float16" else 8.0)
    values = {x: stds[x] * rng.standard_normal(canon[x]) for x in "qkv"}
    if what in ("nan", "inf"):
        inject(rng, values[pick(rng, ["q", "k", "v"])], what)
    values = {x: rounded(v, dtype) for x, v in values.items()}
    drop = {4: 0, 5: 0, 3: 1, 2: 2}[rank]  # 3-D: no heads dim; 2-D: no batch either
    passed = {x: v.reshape(v.shape[drop:]) if drop == 2 else (v[..., 0, :, :] if drop else v)
              for x, v in values.items()}  # fmt: skip
    causal = bool(rng.random() < 0.3)
    if causal:
        features.append("causal")
    mask_kind = pick(rng, [None, "bool", "additive"], [3, 2, 2])
    if compact and causal:
        mask_kind = None
    full_lead = tuple(np.broadcast_shapes(*leads.values()))
    op_lead = {0: (*full_lead, h), 1: full_lead, 2: ()}[drop]  # the result's dims before seq_q
    op_full = (*op_lead, sq, sk)
    mask_values = mask_array = None
    if mask_kind is not None:
        features.append(f"mask-{mask_kind}")
        mshape = _mask_shape(rng, op_full) if not compact else op_full[-2:]
        if mshape != op_full:
            features.append("mask-bcast")
        keep = rng.random(mshape) < 0.75
        empty = None
        if rng.random() < 0.25 and len(mshape) >= 2 and mshape[-2] > 1:
            empty = int(rng.integers(mshape[-2]))
            keep[..., empty, :] = False  # a fully masked row
            features.append("masked-rows")
        if mask_kind == "bool":
            mask_values = keep
        else:
            masked = -1.0e4 if rng.random() < 0.5 else -np.inf  # (finite: as float16 masks are)
            if masked > -np.inf:  # each row's first key kept: a row all at -1e4 is an ordinary
                keep[..., 0] = True  # row shifted by 1e4, past what the tolerance rule covers
            mask_values = np.where(keep, rng.standard_normal(mshape), masked)
            if empty is not None:  # (all -1e4: an ordinary row, its scores shifted by 1e4)
                mask_values[..., empty, :] = -np.inf
            mask_values = rounded(mask_values, dtype)
        mask_array = place(mask_values, "bool" if mask_kind == "bool" else dtype, kind,
                           Layout.CONTIGUOUS, rng)  # fmt: skip
    scale = pick(rng, _SCALES) if not compact else 0.125
    if scale is not None:
        features.append("scale")
    operands: list[Operand] = []
    plain = entry == "compile" and rng.random() < 0.5
    for x in "qkv":
        layout = layout_for(rng, kind, passed[x].ndim, plain)
        if layout is not Layout.CONTIGUOUS:
            features.append(layout.value)
        operands.append(Operand(x, place(passed[x], dtype, kind, layout, rng), passed[x]))
    if mask_array is not None and mask_values is not None:
        operands.append(Operand("attn_mask", mask_array, mask_values))
    # the reference: every operand broadcast to [*lead, h, .., ..], k and v heads repeated
    full = {x: np.broadcast_to(v, (*full_lead, heads[x], *tails[x])) for x, v in values.items()}
    for x in "kv":
        if heads[x] != h:
            reps = h // heads[x]
            full[x] = np.repeat(full[x], reps, axis=-3) if gqa else np.broadcast_to(
                full[x], (*full_lead, h, *tails[x]))  # fmt: skip
    bt = math.prod(full_lead)
    inputs = {"Q": flat(full["q"], 3), "K": flat(full["k"], 3), "V": flat(full["v"], 3)}
    if mask_values is not None:
        m = np.broadcast_to(mask_values, op_full)
        if drop == 1:
            m = m[..., None, :, :]
        m = np.broadcast_to(m, (*full_lead, h, sq, sk))
        inputs["mask"] = np.ascontiguousarray(flat(m, 3))
    chain = builders.attention_chain(bt, h, sq, sk, d, dv, causal, mask_kind, scale, None, dtype)
    result_shape = (*op_lead, sq, dv)
    expected = reference_of(chain, inputs, "O").reshape(result_shape)
    q, k, v = (o.array for o in operands[:3])
    mask = mask_array
    desc: str
    if entry == "ops":
        desc = "ops.attention"

        def call() -> Any:
            return ops.attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                 enable_gqa=gqa)  # fmt: skip

    elif entry == "torch":
        desc = "chainfuse.torch.attention"

        def call() -> Any:
            import chainfuse.torch

            return chainfuse.torch.attention(q, k, v, attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=gqa)  # fmt: skip

    elif entry == "sdpa":
        desc = "F.scaled_dot_product_attention under chainfuse.torch.patch_sdpa(strict=True)"

        def call() -> Any:
            import chainfuse.torch

            with chainfuse.torch.patch_sdpa(strict=True):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
                )

    else:
        tiles = None
        if rng.random() < 0.5:
            tiles = {lp: size(rng, 64) for lp in "mlkn" if rng.random() < 0.5}
            features.append("tiles")
        kchain = builders.attention_chain(b, h, sq, sk, d, dv, causal, mask_kind, scale,
                                          mask_values.shape if mask_values is not None else None,
                                          dtype)  # fmt: skip
        desc = f"chainfuse.compile({kchain.name}, tiles={tiles})"
        by_name = {"Q": q, "K": k, "V": v, "mask": mask}

        def call() -> Any:
            kernel = chainfuse.compile(kchain, tiles=tiles)
            return kernel(*(by_name[t.name] for t in kchain.inputs))

    desc += f"(is_causal={causal}, scale={scale}, enable_gqa={gqa})  "
    oracle = None
    if (what in ("nan", "inf") or "masked-rows" in features) and not (causal and mask_kind):
        oracle = oracle_torch(lambda t: _sdpa(t, inputs, causal, scale).reshape(result_shape))
    may_refuse = "negstride" in features
    return Case("attention", dtype, tuple(features), operands, call, expected, chain, _NAMES,
                desc + "; ".join(describe_operand(o) for o in operands), inputs,
                oracle, may_refuse)  # fmt: skip


def _sdpa(torch: Any, inputs: dict[str, np.ndarray], causal: bool, scale: float | None) -> Any:
    """PyTorch's SDPA in float64 on the reference's operands (a mask or causal: PyTorch defines
    no result for both, and a causal mask is not a bool mask to it where NaN or inf meet one)."""
    q, k, v = (torch.from_numpy(inputs[x]) for x in "QKV")
    mask = None if "mask" not in inputs else torch.from_numpy(inputs["mask"])
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale
    )
