"""Soft-capped attention (Gemma 2's `softcap * tanh(s / softcap)` of the scaled scores, before the
mask) against the float64 reference with the one tolerance rule, on every CPU path: the tiled and
row paths in fp32 (tiles drawn), bf16 on the emulated AMX kernels, `ops.attention` and
`chainfuse.torch.attention` against PyTorch's ops in float64, and a clear error for a bad cap."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.compiler import AmxKernel, compile
from chainfuse.kernels.amx import ENV_AMX, AmxPath
from tests.checks import check_against_reference

torch = pytest.importorskip("torch")

SEQ = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129, 131, 257]), st.integers(1, 300))
HEAD = st.one_of(st.sampled_from([1, 16, 40, 59, 64, 80, 111]), st.integers(1, 160))
CAPS = st.sampled_from([0.25, 1.0, 5.0, 20.0, 50.0, 1e4])
MAGNITUDE = st.sampled_from([1.0, 3.0, 10.0, 31.6, 100.0, 1e3])
TILES = st.sampled_from([None, {"m": 16, "l": 6, "k": 7, "n": 6}, {"m": 48, "l": 30}])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2), h=st.integers(1, 2), sq=SEQ, sk=SEQ, dqk=HEAD, dv=HEAD,
    causal=st.booleans(), mask=st.sampled_from([None, "bool", "additive"]), cap=CAPS,
    tiles=TILES, magnitude=MAGNITUDE,
)  # fmt: skip
def test_softcapped_attention_matches_reference(
    b: int, h: int, sq: int, sk: int, dqk: int, dv: int, causal: bool, mask: str | None,
    cap: float, tiles: dict[str, int] | None, magnitude: float,
) -> None:  # fmt: skip
    chain = chainfuse.attention_chain(b, h, sq, sk, dqk, dv, causal=causal, mask=mask,
                                      softcap=cap)  # fmt: skip
    out, _ = check_against_reference(compile(chain, tiles=tiles), chain, seed=sq * 7 + sk,
                                     scale=magnitude, softmax_term=True)  # fmt: skip
    assert np.isfinite(out).all()


@pytest.mark.parametrize("tiles", [None, {"m": 16, "l": 6, "k": 7, "n": 6}])
@pytest.mark.parametrize("sq", [3, 70])  # the row path, the tiled path
def test_the_cap_is_applied(sq: int, tiles: dict[str, int] | None) -> None:
    """The check above can fail: the same scores uncapped (scores of ~10, cap 2) are far from
    the capped reference, and the capped kernel is far from the uncapped one."""
    capped = chainfuse.attention_chain(1, 2, sq, 90, 32, 24, softcap=2.0)
    plain = chainfuse.attention_chain(1, 2, sq, 90, 32, 24)
    inputs = reference.random_inputs(capped, seed=1, scale=10.0)
    out = compile(capped, tiles=tiles)(*(inputs[t.name] for t in capped.inputs))
    want = reference.run(capped, inputs)["O"]
    reference.assert_close(out, want, capped, inputs=inputs)
    uncapped = reference.run(plain, inputs)["O"]
    with pytest.raises(AssertionError):
        reference.assert_close(out, uncapped, plain, inputs=inputs)


def _eager64(q: Any, k: Any, v: Any, cap: float, mask: Any = None, causal: bool = False,
             scale: float | None = None, gqa: bool = False) -> Any:  # fmt: skip
    """Gemma 2's eager attention in float64: scale, cap, mask, softmax, values."""
    q, k, v = q.double(), k.double(), v.double()
    if gqa:
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    s = torch.tanh(s / cap) * cap
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    if causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ v


def _chain_of(out: tuple[int, ...], k: tuple[int, ...], cap: float) -> chainfuse.Chain:
    """The chain whose tolerance a result of shape `out` is held to (k: the keys' shape)."""
    lead = (1,) * (4 - len(out)) + tuple(out)
    return chainfuse.attention_chain(*lead[:3], k[-2], k[-1], lead[3], softcap=cap)


CALLS = {  # q, k, v shapes; mask shape (None: none), causal, enable_gqa
    "plain": ((2, 3, 37, 24), (2, 3, 53, 24), (2, 3, 53, 16), None, False, False),
    "causal": ((1, 4, 70, 64), (1, 4, 70, 64), (1, 4, 70, 64), None, True, False),
    "padding": ((2, 2, 19, 32), (2, 2, 41, 32), (2, 2, 41, 32), (2, 1, 1, 41), False, False),
    "full-mask": ((1, 2, 33, 16), (1, 2, 29, 16), (1, 2, 29, 16), (1, 2, 33, 29), False, False),
    "gqa-prefill": ((1, 8, 45, 64), (1, 2, 45, 64), (1, 2, 45, 64), None, True, True),
    "gqa-decode": ((3, 8, 1, 64), (3, 2, 77, 64), (3, 2, 77, 64), (3, 1, 1, 77), False, True),
    "3d": ((3, 21, 8), (3, 30, 8), (3, 30, 8), None, False, False),
}


@pytest.mark.parametrize("dtype", ["float32", "bool-mask"])
@pytest.mark.parametrize("kind", list(CALLS))
def test_ops_and_torch_attention_take_softcap(kind: str, dtype: str) -> None:
    import chainfuse.torch as cft

    sq, sk, sv, ms, causal, gqa = CALLS[kind]
    g = torch.Generator().manual_seed(len(kind))
    q, k, v = (4.0 * torch.randn(s, generator=g) for s in (sq, sk, sv))
    mask = None
    if ms is not None:
        mask = (
            torch.randn(ms, generator=g) > -1.0
            if dtype == "bool-mask"
            else torch.randn(ms, generator=g)
        )
    want = _eager64(q, k, v, 3.0, mask, causal, gqa=gqa).numpy()
    chain = _chain_of(want.shape, sk, 3.0)
    ours = cft.attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa, softcap=3.0)
    reference.assert_close(ours.numpy(), want, chain)
    mnp = None if mask is None else mask.numpy()
    again = chainfuse.ops.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=mnp,
                                    is_causal=causal, enable_gqa=gqa, softcap=3)  # fmt: skip
    reference.assert_close(again, want, chain)


def test_a_repeat_call_with_another_cap_is_not_replayed() -> None:
    """Calls remembered by their operands' layout keep their cap in the key: the same operands
    with another cap (or none) give that cap's result."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (5.0 * torch.randn(1, 2, 9, 32, generator=g) for _ in range(3))
    chain = _chain_of(q.shape, k.shape, 1.0)
    for cap in (1.0, 30.0, None, 1.0, 30.0):
        ours = chainfuse.ops.attention(q, k, v, softcap=cap)
        want = (
            _eager64(q, k, v, cap).numpy()
            if cap is not None
            else torch.nn.functional.scaled_dot_product_attention(
                q.double(), k.double(), v.double()
            ).numpy()
        )
        reference.assert_close(ours.numpy(), want, chain)


@pytest.mark.parametrize(
    ("softcap", "error"),
    [(0.0, ValueError), (-5.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
     (True, TypeError), ("50", TypeError)],
)  # fmt: skip
def test_a_bad_softcap_is_named(softcap: Any, error: type[Exception]) -> None:
    import chainfuse.torch as cft

    q = torch.randn(1, 2, 4, 8)
    for call in (chainfuse.ops.attention, cft.attention):
        with pytest.raises(error, match="softcap"):
            call(q, q, q, softcap=softcap)
    with pytest.raises(error, match="softcap"):
        chainfuse.attention_chain(1, 2, 4, 4, 8, 8, softcap=softcap)


@pytest.mark.parametrize("mask", [None, "additive", "bool"])
@pytest.mark.parametrize(("shape", "causal"), [((1, 2, 37, 70, 64, 64), True),
                                               ((2, 1, 5, 33, 40, 24), False)])  # fmt: skip
def test_bf16_on_emulated_amx(
    monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...], causal: bool, mask: str | None
) -> None:
    monkeypatch.setenv(ENV_AMX, "emulate")
    chain = chainfuse.attention_chain(*shape, causal=causal, mask=mask, dtype="bfloat16",
                                      softcap=4.0)  # fmt: skip
    kernel = compile(chain)
    assert isinstance(kernel, AmxKernel) and kernel.amx_path is AmxPath.EMULATED

    def convert(a: np.ndarray) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return t if a.dtype == np.bool_ else t.to(torch.bfloat16)

    check_against_reference(kernel, chain, seed=5, scale=3.0, convert=convert)
