"""Masks with structure (causal, sliding windows, left and right padding, given as tensors): the
keys a row block's mask leaves out at its start and end are not computed, which must not change
any result. Checked against PyTorch's SDPA in float64 over sizes and tiles that put the mask's
edges inside and between blocks, with -inf and `finfo.min` fills, boolean masks, rows that keep
no key, and NaN or inf at left-out keys (which must still reach every row, as in SDPA)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.codegen.row_block import EXCLUDED_BELOW

torch = pytest.importorskip("torch")
F = torch.nn.functional
MIN32 = torch.finfo(torch.float32).min


def _keep(kind: str, sq: int, sk: int, b: int, width: int) -> Any:
    """[b, 1, sq, sk] booleans: which keys each query keeps."""
    q = torch.arange(sq)[:, None] + (sk - sq)  # (bottom-right aligned, as a KV cache's)
    k = torch.arange(sk)[None, :]
    causal = k <= q
    if kind == "causal":
        keep = causal
    elif kind == "window":
        keep = causal & (k > q - width)
    elif kind == "left-pad":
        keep = causal[None] & (k[None] >= torch.arange(b)[:, None, None] * width)
        return keep[:, None]
    elif kind == "right-pad":
        keep = k < sk - width
    elif kind == "no-key-rows":  # rows 0..width-1 keep nothing
        keep = causal & (q >= width + (sk - sq))
    else:
        raise AssertionError(kind)
    return keep.expand(b, sq, sk)[:, None]


def _as(keep: Any, fill: str) -> Any:
    if fill == "bool":
        return keep
    return torch.zeros(keep.shape).masked_fill(~keep, float("-inf") if fill == "-inf" else MIN32)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["causal", "window", "left-pad", "right-pad", "no-key-rows"]),
    fill=st.sampled_from(["-inf", "min", "bool"]),
    sq=st.sampled_from([1, 7, 17, 64, 65, 129, 200]),
    extra=st.sampled_from([0, 0, 3, 64]),
    width=st.integers(1, 70),
    b=st.integers(1, 2),
    d=st.sampled_from([8, 17, 64]),
)
def test_structured_masks_match_sdpa(
    kind: str, fill: str, sq: int, extra: int, width: int, b: int, d: int
) -> None:
    sk = sq + extra
    g = torch.Generator().manual_seed(sq * 131 + width)
    q, k, v = (torch.randn(b, 3, s, d, generator=g) for s in (sq, sk, sk))
    mask = _as(_keep(kind, sq, sk, b, width), fill)
    chain = chainfuse.attention_chain(b, 3, sq, sk, d, d)
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask if fill == "bool" else mask.double()
    )
    # (PyTorch's CPU SDPA gives zeros for rows with no key; its math path NaN: as the kernel, 0)
    want = want.nan_to_num(0.0)
    got = chainfuse.ops.attention(q, k, v, attn_mask=mask)
    reference.assert_close(got.numpy(), want.numpy(), chain)


@pytest.mark.parametrize("where", ["k", "v", "q"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("fill", ["-inf", "min", "bool"])
def test_a_special_at_a_left_out_key_still_reaches_every_row(
    where: str, value: float, fill: str
) -> None:
    """A causal mask leaves out the keys after each row block's last query; a NaN or inf at one
    of them (or in q) makes SDPA's rows NaN, and so the kernel computes them all then."""
    sq = sk = 600  # (several row blocks: the first ones leave out the last keys)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 600, 32, generator=g) for _ in range(3))
    {"q": q, "k": k, "v": v}[where][0, 1, 590 if where != "q" else 3, 5] = value
    mask = _as(_keep("causal", sq, sk, 1, 0), fill)
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask if fill == "bool" else mask.double()
    )
    got = chainfuse.ops.attention(q, k, v, attn_mask=mask)
    assert torch.equal(got.isnan(), want.isnan())
    assert got.isnan().any()
    finite = ~want.isnan()
    reference.assert_close(
        got[finite].numpy(), want[finite].numpy(), chainfuse.attention_chain(1, 2, sq, sk, 32, 32)
    )


def _sdpa64(q: Any, k: Any, v: Any, mask: Any) -> Any:
    return F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double()
    ).nan_to_num(0.0)


@pytest.mark.parametrize("tile", [16, 64, 128])
@pytest.mark.parametrize("where", ["k", "v"])
def test_each_head_checks_its_own_left_out_keys(tile: int, where: str) -> None:
    """A mask broadcast over the heads says the same for every head's row block, and the
    heads share its answer; each head's k and v are still checked on their own, once a head
    (tiles 16 and 64: many row blocks) or the keys each block leaves out (128: two blocks).
    A NaN at a key head 1 leaves out for most rows reaches all of head 1's rows, no other head's."""
    sq = 200
    g = torch.Generator().manual_seed(tile)
    q, k, v = (torch.randn(1, 3, sq, 16, generator=g) for _ in range(3))
    {"k": k, "v": v}[where][0, 1, 190, 3] = float("nan")
    mask = _as(_keep("causal", sq, sq, 1, 0), "min")
    chain = chainfuse.attention_chain(
        1, 3, sq, sq, 16, 16, mask="additive", mask_shape=tuple(mask.shape)
    )
    kernel = chainfuse.compile(chain, tiles={"m": tile})
    got = torch.from_numpy(kernel(q.numpy(), k.numpy(), v.numpy(), mask.numpy()))
    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask.double()
    )
    assert torch.equal(got.isnan(), want.isnan())
    assert got[0, 1, :, 3].isnan().all() and not got[0, ::2].isnan().any()
    finite = ~want.isnan()
    reference.assert_close(got[finite].numpy(), want[finite].numpy(), chain)


@pytest.mark.parametrize("tile", [16, 64])
def test_a_mask_per_batch_item_narrows_each_item_its_own_way(tile: int) -> None:
    """Left padding of another length in each batch item, the mask broadcast over the heads:
    each item's heads share that item's answers, row block by row block, not another's."""
    b, sq = 3, 200
    g = torch.Generator().manual_seed(tile + 1)
    q, k, v = (torch.randn(b, 4, sq, 16, generator=g) for _ in range(3))
    keep = _keep("causal", sq, sq, 1, 0).expand(b, 1, sq, sq).clone()
    for i, pad in enumerate((130, 0, 50)):  # (the first item narrows most)
        keep[i, :, :, :pad] = False
    mask = _as(keep, "-inf")
    chain = chainfuse.attention_chain(
        b, 4, sq, sq, 16, 16, mask="additive", mask_shape=tuple(mask.shape)
    )
    kernel = chainfuse.compile(chain, tiles={"m": tile})
    got = kernel(q.numpy(), k.numpy(), v.numpy(), mask.numpy())
    reference.assert_close(got, _sdpa64(q, k, v, mask).numpy(), chain)


def test_rows_that_keep_no_key_weigh_every_key_alike_with_finfo_min() -> None:
    """A row whose every key is filled with finfo.min (not -inf): eager's softmax weighs every key
    alike, so the keys other rows leave out are computed for it too."""
    sq = sk = 130
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 1, 130, 16, generator=g) for _ in range(3))
    keep = _keep("causal", sq, sk, 1, 0).clone()
    keep[..., 2, :] = False
    mask = _as(keep, "min")
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0 + mask.double()
    want = torch.softmax(s, -1) @ v.double()
    got = chainfuse.ops.attention(q, k, v, attn_mask=mask)
    assert torch.allclose(got[0, 0, 2].double(), v[0, 0].double().mean(0), atol=1e-5)
    reference.assert_close(
        got.numpy(), want.numpy(), chainfuse.attention_chain(1, 1, 130, 130, 16, 16)
    )


def test_the_threshold_is_below_every_score() -> None:
    assert EXCLUDED_BELOW <= -1e37 and np.float32(EXCLUDED_BELOW) + np.float32(2.0**100) < 0


@pytest.mark.parametrize("fill", ["-inf", "min", "bool"])
@pytest.mark.parametrize("kind", ["causal", "window", "left-pad", "no-key-rows"])
def test_structured_masks_on_emulated_amx(
    monkeypatch: pytest.MonkeyPatch, kind: str, fill: str
) -> None:
    """The same on the bf16 AMX kernels, through their bit-exact emulation."""
    from chainfuse.kernels.amx import ENV_AMX

    monkeypatch.setenv(ENV_AMX, "emulate")
    chainfuse.ops.calls.clear()  # (kernels are kept by sizes, not by the AMX path)
    try:
        b, sq, sk, d = 2, 200, 203, 32
        g = torch.Generator().manual_seed(len(kind) + len(fill))
        q, k, v = (torch.randn(b, 2, s, d, generator=g).bfloat16() for s in (sq, sk, sk))
        mask = _as(_keep(kind, sq, sk, b, 37), fill)
        mask = mask if fill == "bool" else mask.bfloat16()
        want = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), attn_mask=mask if fill == "bool" else mask.double()
        ).nan_to_num(0.0)
        got = chainfuse.ops.attention(q, k, v, attn_mask=mask)
        chain = chainfuse.attention_chain(b, 2, sq, sk, d, d, dtype="bfloat16")
        reference.assert_close(got.float().numpy(), want.numpy(), chain)
    finally:
        chainfuse.ops.calls.clear()
