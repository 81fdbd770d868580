"""Attention whose k and v are views of a projection's output (`[batch, seq, heads * dim]`
transposed to `[batch, heads, seq, dim]`: rows heads * dim apart), as models pass them. Where a
thread runs several row blocks of a head it reads that head's k and v from a contiguous copy
(`row_block.copies_kv`); the copy must hold the right head's rows, for every head, group
member, batch item, key length and thread count."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _projected(
    batch: int,
    heads: int,
    kv_heads: int,
    seq_q: int,
    seq_k: int,
    d: int,
    gap: int,
    seed: int,
    dtype: str = "float32",
) -> tuple[Any, Any, Any]:
    """q, k and v as transposed views of one projection's output, rows `gap` elements wider
    than the heads' (a fused QKV projection, GPT-2's `c_attn`, leaves the others' between)."""
    g = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * d + gap
    rows = max(seq_q, seq_k)
    x = torch.randn(batch, rows, width, generator=g)
    x[:, :, : heads * d] *= d**-0.25
    x = x.to(getattr(torch, dtype))  # (before the views: a copy of one would be contiguous)
    q = x[:, :seq_q, : heads * d].view(batch, seq_q, heads, d).transpose(1, 2)
    k = x[:, :seq_k, heads * d : (heads + kv_heads) * d]
    v = x[:, :seq_k, (heads + kv_heads) * d : (heads + 2 * kv_heads) * d]
    k, v = (t.reshape(batch, seq_k, kv_heads, d).transpose(1, 2) for t in (k, v))
    return q, k, v


def _want(q: Any, k: Any, v: Any, mask: Any, causal: bool, gqa: bool) -> Any:
    m = None if mask is None else mask.double()
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=m, is_causal=causal, enable_gqa=gqa
    ).nan_to_num(0.0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq_q=st.sampled_from([7, 17, 63, 65, 129, 200, 301]),
    extra=st.sampled_from([0, 0, 5, 64]),
    heads=st.sampled_from([(2, 2), (4, 2), (3, 1), (4, 4)]),
    batch=st.integers(1, 2),
    d=st.sampled_from([8, 16, 17, 64]),
    causal=st.booleans(),
    masked=st.booleans(),
    gap=st.sampled_from([0, 3, 300]),
    threads=st.integers(1, 3),
    dtype=st.sampled_from(["float32", "bfloat16"]),
)
def test_k_and_v_rows_apart_match_sdpa(
    seq_q: int,
    extra: int,
    heads: tuple[int, int],
    batch: int,
    d: int,
    causal: bool,
    masked: bool,
    gap: int,
    threads: int,
    dtype: str,
) -> None:
    seq_k = seq_q + extra
    q, k, v = _projected(batch, *heads, seq_q, seq_k, d, gap, seq_q * 7 + d, dtype)
    mask = None
    if masked:  # a sliding window, filled as models fill it, broadcast over the heads
        i, j = torch.arange(seq_q)[:, None] + extra, torch.arange(seq_k)[None, :]
        keep = (j <= i) & (j > i - 40)
        mask = torch.zeros(1, 1, seq_q, seq_k).masked_fill(~keep, torch.finfo(torch.float32).min)
    if dtype == "bfloat16":
        mask = None if mask is None else mask.bfloat16()
    gqa = heads[0] != heads[1]
    chainfuse.set_num_threads(threads)
    try:
        got = chainfuse.ops.attention(q, k, v, mask, causal, enable_gqa=gqa)
    finally:
        chainfuse.set_num_threads(None)
    chain = chainfuse.attention_chain(batch, heads[0], seq_q, seq_k, d, d, dtype=dtype)
    reference.assert_close(got.float().numpy(), _want(q, k, v, mask, causal, gqa).numpy(), chain)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_copy_of_k_and_v_gives_what_contiguous_ones_give(
    threads: int, causal: bool, dtype: str
) -> None:
    """With row blocks of 16 rows every thread copies each head it meets: the result is the
    contiguous operands' bit for bit (the same code reads the same numbers), for every head."""
    q, k, v = _projected(2, 4, 4, 200, 203, 32, 100, threads, dtype)
    assert k.stride(2) == v.stride(2) == 4 * 3 * 32 + 100
    chain = chainfuse.attention_chain(2, 4, 200, 203, 32, 32, causal=causal, dtype=dtype)
    kernel = chainfuse.compile(chain, tiles={"m": 16})
    chainfuse.set_num_threads(threads)
    try:
        apart = kernel(q, k, v)
        together = kernel(q.contiguous(), k.contiguous(), v.contiguous())
    finally:
        chainfuse.set_num_threads(None)
    assert torch.equal(apart, together)
    want = _want(q, k, v, None, causal, False)
    reference.assert_close(apart.float().numpy(), want.numpy(), chain)


def test_numpy_views_of_a_projection_read_alike() -> None:
    """The same for numpy arrays: views with rows apart, in place."""
    x = np.random.default_rng(3).standard_normal((150, 3 * 2 * 16 + 7), dtype=np.float32)
    q, k, v = (x[:, i * 32 : (i + 1) * 32].reshape(150, 2, 16).transpose(1, 0, 2) for i in range(3))
    chain = chainfuse.attention_chain(1, 2, 150, 150, 16, 16, causal=True)
    kernel = chainfuse.compile(chain, tiles={"m": 16})
    got = kernel(q[None], k[None], v[None])
    want = reference.run(chain, {"Q": q[None], "K": k[None], "V": v[None]})["O"]
    reference.assert_close(got, want, chain)
    assert np.array_equal(got, kernel(*(np.ascontiguousarray(t[None]) for t in (q, k, v))))
