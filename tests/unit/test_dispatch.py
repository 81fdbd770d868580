"""Dispatch that never makes a model slower: a 16-bit call no AMX kernel runs goes to PyTorch where
the model predicts PyTorch's faster, counted as a fallback; elsewhere chainfuse runs it. The
model's answer is forced both ways with presets (`ops.dispatch.host`)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import chainfuse
from chainfuse import builders, ops, reference
from chainfuse.codegen.amx_chain import amx_unsupported
from chainfuse.codegen.gemm_spec import match_gemm_chain
from chainfuse.hardware import Hardware
from chainfuse.ir import DType
from chainfuse.kernels.amx import ENV_AMX
from chainfuse.ops import dispatch

torch = pytest.importorskip("torch")
cft = pytest.importorskip("chainfuse.torch")
handoff = pytest.importorskip("chainfuse.torch.handoff")
F = torch.nn.functional

AMX = "xeon-8480"  # an AMX machine: PyTorch's bf16 GEMMs at the AMX rate
NO_BF16 = "xeon-gold-6240"  # no 16-bit unit: PyTorch's bf16 at about the fp32 rate
BF16_REASON = "bfloat16 where PyTorch is predicted faster (no AMX kernel runs it here)"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`host(name)`: the machine the dispatch models (AMX off, as on a host without it)."""
    monkeypatch.setenv(ENV_AMX, "off")
    cft.fallbacks.clear()

    def use(name: str) -> None:
        monkeypatch.setattr(dispatch, "host", lambda: Hardware.preset(name))

    yield use
    cft.fallbacks.clear()


def _qkv(dtype: Any, seq: int = 64, d: int = 64) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(seq)
    return tuple(torch.randn(1, 2, seq, d, generator=g).to(dtype) for _ in range(3))  # type: ignore[return-value]


# -- the model's decision --------------------------------------------------------------------------


def test_amx_machine_without_amx_kernels_prefers_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AMX, "off")
    amx = Hardware.preset(AMX)
    for make in (
        lambda dt: builders.attention_chain(1, 12, 512, 512, 64, 64, dtype=dt),
        lambda dt: builders.gemm_chain(12, 512, 64, 64, 512, "relu", dt),
        lambda dt: builders.gemm_chain(1, 512, 768, 768, 3072, "gelu", dt),  # a BERT-base MLP
    ):
        assert dispatch.torch_faster(make("bfloat16"), 1, amx)
        assert not dispatch.torch_faster(make("bfloat16"), 1, Hardware.preset(NO_BF16))
        assert not dispatch.torch_faster(make("float32"), 1, amx)


def test_pytorch_rate_is_the_machines_16_bit_peak_else_the_fp32_rate() -> None:
    amx, plain = Hardware.preset(AMX), Hardware.preset(NO_BF16)
    assert dispatch.torch_rate(amx, DType.BFLOAT16) == amx.peak(DType.BFLOAT16)
    assert dispatch.torch_rate(amx, DType.FLOAT16) == amx.peak(DType.FLOAT32)
    rate = dispatch.TORCH_HALF_RATE * plain.peak(DType.FLOAT32)
    assert dispatch.torch_rate(plain, DType.BFLOAT16) == rate <= plain.peak(DType.FLOAT32)


def test_an_amx_kernel_is_never_handed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = builders.attention_chain(1, 12, 512, 512, 64, 64, dtype="bfloat16")
    monkeypatch.setenv(ENV_AMX, "emulate")  # (the AMX kernel runs: emulated here)
    assert not dispatch.torch_faster(chain, 1, Hardware.preset(AMX))
    causal = builders.attention_chain(1, 12, 512, 512, 64, 64, causal=True, dtype="bfloat16")
    if amx_unsupported(match_gemm_chain(causal)):  # (no AMX kernel for it: the model decides)
        assert dispatch.torch_faster(causal, 1, Hardware.preset(AMX))


# -- chainfuse.torch -------------------------------------------------------------------------------


def test_attention_goes_to_sdpa_where_pytorch_is_faster(host: Any) -> None:
    host(AMX)
    q, k, v = _qkv(torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="predicted faster"):
        got = cft.attention(q, k, v)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v))  # PyTorch's own numbers
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per reason
        cft.attention(q, k, v, scale=0.5)
    assert cft.fallbacks == {BF16_REASON: 2}
    assert cft.fallbacks == {BF16_REASON: 2}
    assert handoff.attention_reason(*_qkv(torch.float32), None, False) is None  # fp32: chainfuse's


def test_attention_runs_chainfuse_where_it_is_faster(host: Any) -> None:
    host(NO_BF16)
    q, k, v = _qkv(torch.bfloat16)
    chain = builders.attention_chain(1, 2, 64, 64, 64, 64, dtype="bfloat16")
    got = cft.attention(q, k, v)
    assert not cft.fallbacks
    inputs = {n: x.float().numpy() for n, x in zip("QKV", (q, k, v), strict=True)}
    reference.assert_close(got.float().numpy(), reference.run(chain, inputs)["O"], chain)


def test_patch_sdpa_counts_the_handed_calls(host: Any) -> None:
    host(AMX)
    q, k, v = _qkv(torch.bfloat16)
    with cft.patch_sdpa() as patch, pytest.warns(RuntimeWarning, match="predicted faster"):
        got = F.scaled_dot_product_attention(q, k, v)
    assert patch.fallbacks == {BF16_REASON: 1} and patch.calls == 0
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v))
    with cft.patch_sdpa(strict=True) as strict:  # strict: chainfuse runs what it can
        F.scaled_dot_product_attention(q, k, v)
    assert strict.calls == 1 and not strict.fallbacks


def test_gemm_chain_goes_to_pytorchs_ops_where_they_are_faster(host: Any) -> None:
    host(AMX)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 65, 64, generator=g).bfloat16()
    w1 = torch.randn(64, 256, generator=g).bfloat16()
    w2 = torch.randn(256, 64, generator=g).bfloat16()
    with pytest.warns(RuntimeWarning, match="predicted faster"):
        got = cft.gemm_chain(x, w1, w2, "gelu")
    assert torch.equal(got, F.gelu(x @ w1) @ w2)
    assert cft.fallbacks == {BF16_REASON: 1}
    with pytest.raises(ValueError, match="D: expected 256 rows"):  # chainfuse's errors stand
        cft.gemm_chain(x, w1, w2[:7], "gelu")
    strided = torch.randn(64, 512, generator=g).bfloat16()[:, ::2]  # (no dim contiguous)
    with pytest.raises(ValueError, match="contiguous"):  # what chainfuse refuses stays refused
        cft.gemm_chain(x, strided, w2, "gelu")
    assert cft.fallbacks == {BF16_REASON: 1}


def test_numpy_callers_keep_computing_and_are_told_the_path(host: Any) -> None:
    host(AMX)
    chain = builders.gemm_chain(1, 9, 8, 16, 24, "relu", "float16")
    inputs = reference.random_inputs(chain, seed=0)
    A, B, D = (inputs[n].astype(np.float16) for n in "ABD")
    got = ops.gemm_chain(A, B, D, between="relu")  # numpy: nothing to hand to
    assert got.dtype == np.float16 and not cft.fallbacks
    kernel = chainfuse.compile(chain)
    assert kernel.arithmetic.startswith("fp32-fma:") and kernel.arithmetic in kernel.source


def test_rows_vary_builds_the_other_row_counts_kernels_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under `rows_vary` a chain's first call also builds it at the least row count of each
    other micro-kernel a row count selects (here: up to 16 rows "a", up to 63 "b", then "c"),
    once per chain; outside it, a call builds its own kernel alone."""
    calls = sys.modules["chainfuse.ops.calls"]  # (the package's `calls` is the cache object)
    built: list[tuple[int, ...]] = []

    def build(sizes: tuple[int, ...], *rest: Any) -> tuple[int, ...]:
        built.append(sizes)
        return sizes

    def kernel_of(rows: int) -> str:
        return "a" if rows <= 16 else "b" if rows < 64 else "c"

    monkeypatch.setattr(calls, "micro_kernel", kernel_of)
    kernels = calls.Kernels(build, lambda sizes, *rest: (sizes[1], 1), calls._rows_at(1))
    kernels((2, 8, 5), "x")
    assert built == [(2, 8, 5)]
    with calls.rows_vary():
        kernels((2, 9, 5), "x")
        kernels((2, 70, 5), "x")  # (its class is built: the cache answers)
        kernels((2, 9, 6), "x")  # another chain
    assert built == [(2, 8, 5), (2, 9, 5), (2, 17, 5), (2, 64, 5), (2, 70, 5), (2, 9, 6),
                     (2, 17, 6), (2, 64, 6)]  # fmt: skip
    kernels.cache_clear()
    assert kernels.cache_info().currsize == 0


def test_rows_vary_moves_an_attention_masks_query_dim_with_the_rows() -> None:
    from chainfuse.ops.calls import _attention_rows

    rest = (False, "additive", None, (1, 1, 8, 12), "float32", 2, None, None)
    sizes, moved = _attention_rows((1, 4, 8, 12, 16, 16), rest, 17)
    assert sizes == (1, 4, 17, 12, 16, 16) and moved[3] == (1, 1, 17, 12)
    broadcast = (False, "additive", None, (1, 1, 1, 12), "float32", 2, None, None)
    assert _attention_rows((1, 4, 8, 12, 16, 16), broadcast, 17)[1] == broadcast
