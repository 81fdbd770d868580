"""NaN and inf where PyTorch's ops put them, at the places a fused kernel skips work: keys a
boolean mask excludes (SDPA adds the mask as -inf, so a NaN or +inf score stays NaN), rows with
no key left, and convolution taps that read the padding (0 * inf and 0 * NaN are NaN)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import ops

torch = pytest.importorskip("torch")
F = torch.nn.functional

NAN, INF = float("nan"), float("inf")


def _same_specials(got: Any, want: Any) -> None:
    got, want = got.double(), want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isposinf(got), torch.isposinf(want))
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [NAN, INF])
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_a_special_at_a_masked_key_reaches_every_row_as_in_sdpa(
    dtype: Any, where: str, value: float, kind: str
) -> None:
    """A NaN or inf in a key (or value) every query's mask excludes: SDPA's rows are NaN (the
    mask is added, and 0 * NaN in P V is NaN); so are ours, for every tail of the key blocks."""
    g = torch.Generator().manual_seed(3)
    for sk in (6, 37, 70):
        q, k, v = (torch.randn(2, 3, n, 24, generator=g).to(dtype) for n in (5, sk, sk))
        keep = torch.rand(5, sk, generator=g) > 0.3
        keep[:, 0], keep[:, sk - 2] = True, False
        mask = keep if kind == "bool" else torch.where(keep, 0.0, -INF).to(dtype)
        (k if where == "k" else v)[1, 2, sk - 2, 3] = value
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = ops.attention(q, k, v, attn_mask=mask)
        assert torch.isnan(want).any() and torch.isfinite(want).any()  # (the case tests)
        _same_specials(got, want)


def test_rows_without_keys_are_zeros_as_sdpas() -> None:
    """A row whose every key is masked: zeros, as PyTorch's CPU SDPA gives."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (9, 33, 33))
    keep = torch.rand(9, 33, generator=g) > 0.5
    keep[4] = False
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    got = ops.attention(q, k, v, attn_mask=keep)
    assert (want[:, :, 4] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 40])
def test_gemm_chain_softmax_row_of_minus_inf_is_nan_as_torchs(rows: int) -> None:
    """`softmax(A @ B) @ D` with a row of all -inf scores: NaN there, as torch.softmax gives
    (the unfused chain has no "safe" softmax), and the other rows finite."""
    g = torch.Generator().manual_seed(5)
    A, B, D = (
        torch.randn(rows, 11, generator=g),
        torch.rand(11, 19, generator=g),
        torch.randn(19, 6),
    )
    A[rows // 2] = -INF  # (B > 0: every score of that row is -inf)
    want = torch.softmax(A @ B, -1) @ D
    got = ops.gemm_chain(A, B, D, between="softmax")
    assert torch.isnan(want[rows // 2]).all()
    _same_specials(got, want)


@settings(max_examples=25, deadline=None)
@given(
    h=st.integers(3, 11),
    w=st.integers(3, 11),
    taps=st.sampled_from([(1, 1), (3, 3), (2, 3), (3, 1)]),
    taps2=st.sampled_from([(1, 1), (3, 3), (2, 2)]),
    stride=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.tuples(st.integers(0, 2), st.integers(0, 2)),
    bad=st.sampled_from(["w1", "w2", "both"]),
    value=st.sampled_from([NAN, INF, -INF]),
    between=st.sampled_from([None, "relu"]),
    channels_last=st.booleans(),
    depthwise=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conv_padding_taps_meet_non_finite_weights_as_in_pytorch(
    h: int,
    w: int,
    taps: tuple[int, int],
    taps2: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    bad: str,
    value: float,
    between: str | None,
    channels_last: bool,
    depthwise: bool,
    seed: int,
) -> None:
    """A non-finite weight whose tap reads the padding: PyTorch's output is NaN there (a zero
    times inf or NaN) and in every position of the second conv that reads such a value. The
    kernel skips padded taps; the result is NaN at exactly PyTorch's positions, on the first
    call and on the remembered call after it, whatever x's memory order. (Some of PyTorch's
    own convolution algorithms skip padded taps, so its answer there depends on the layout and
    sizes; the oracle is the arithmetic itself, PyTorch's convs over explicitly zero-padded
    operands, which the float64 reference shares.) A depthwise second conv carries a channel's
    NaN to that channel alone."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, h, w, generator=g)
    w1 = torch.randn(4, 3, *taps, generator=g)
    w2 = torch.randn(4, 1, *taps2, generator=g) if depthwise else torch.randn(5, 4, *taps2,
                                                                              generator=g)  # fmt: skip
    groups = 4 if depthwise else 1
    for name, t in (("w1", w1), ("w2", w2)):
        if bad in (name, "both"):
            at = tuple(int(torch.randint(0, n, (1,), generator=g)) for n in t.shape)
            t[at] = value
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    if min(h, w) + 2 * padding[0] < max(taps):
        return  # (the first conv's kernel does not fit: refused, tested elsewhere)
    first = F.conv2d(F.pad(x, [padding[0]] * 4), w1, stride=stride[0])
    if min(first.shape[-2:]) + 2 * padding[1] < max(taps2):
        return  # (the second conv's kernel does not fit)
    hidden = F.relu(first) if between == "relu" else first
    want = F.conv2d(F.pad(hidden, [padding[1]] * 4), w2, stride=stride[1], groups=groups)
    for _ in range(2):
        got = ops.conv_chain(x, w1, w2, stride=stride, padding=padding, between=between,
                             groups=(1, groups))  # fmt: skip
        _same_specials(got, want)
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def test_conv_padding_nan_numpy_out_and_compiled() -> None:
    """The same through numpy operands, a preallocated `out`, and a compiled kernel called
    directly. A NaN in w1 makes its channel NaN everywhere: through x inside, through the
    padding at the top row and left column (which the kernel alone leaves finite)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((1, 2, 6, 7)).astype(np.float32)
    w1 = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((2, 3, 1, 1)).astype(np.float32)
    w1[1, 0, 0, 0] = NAN
    first = F.conv2d(F.pad(torch.from_numpy(x), [1] * 4), torch.from_numpy(w1))
    want = F.conv2d(first, torch.from_numpy(w2)).numpy()
    assert np.isnan(want).all()
    out = np.empty_like(want)
    got = ops.conv_chain(x, w1, w2, padding=(1, 0), out=out)
    assert got is out
    assert (np.isnan(got) == np.isnan(want)).all()
    chain = chainfuse.conv_chain_spec(1, 2, 6, 7, 3, 3, 3, 2, 1, 1, padding=(1, 0))
    assert (np.isnan(chainfuse.compile(chain)(x, w1, w2)) == np.isnan(want)).all()
    assert not np.isnan(ops.conv_chain(x, np.nan_to_num(w1), w2, padding=(1, 0))).any()
