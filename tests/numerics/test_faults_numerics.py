"""Faults a caller can cause, answered as PyTorch answers them or with an error naming the
argument: NaN and inf inputs propagate where PyTorch's unfused ops put them, 16-bit results
overflow to inf where PyTorch's do, an `out=` overlapping an input is refused, odd array kinds
are taken or named, threads share kernels safely, and index arithmetic is 64-bit."""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import Any

import numpy as np
import pytest

import chainfuse
import chainfuse.compiler
from chainfuse import ops, reference
from chainfuse.compiler import compile
from chainfuse.hardware import resolve
from chainfuse.kernels import available

torch = pytest.importorskip("torch")
F = torch.nn.functional

NAN, INF = float("nan"), float("inf")
HOST = resolve(None)
REFERENCE_KERNEL = next(k for k in available() if not k.isa and k.mr == k.nr)


def _hardware(kind: str) -> Any:
    """The host, or the host without SIMD flags (the portable vector kernel)."""
    return HOST if kind == "host" else dataclasses.replace(HOST, isa=frozenset())


def _between(name: str | None, s: Any) -> Any:
    """PyTorch's unfused op between the GEMMs (the reference for NaN and inf placement)."""
    if name == "relu":
        return torch.relu(s)
    if name == "gelu":
        return F.gelu(s)
    if name == "softmax":
        return torch.softmax(s, -1)
    return s


def _torch_gemm_chain(A: Any, B: Any, D: Any, between: str | None) -> np.ndarray:
    """PyTorch's unfused `between(A @ B) @ D` in float64, with NaN and inf where the same ops
    in float32 (the inputs' dtype) put them: where PyTorch defines the specials."""
    a, b, d = (torch.from_numpy(np.asarray(x, np.float32)) for x in (A, B, D))
    exact = (_between(between, a.double() @ b.double()) @ d.double()).numpy()
    placed = (_between(between, a @ b) @ d).double().numpy()
    return np.where(np.isfinite(placed), exact, placed)


@pytest.mark.parametrize("between", [None, "relu", "gelu", "softmax"])
@pytest.mark.parametrize("machine", ["host", "portable", "reference"])
def test_specials_through_each_activation_are_torchs(
    between: str | None, machine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """K = L = N = 1 with B = D = 1: the result is the activation of A itself, element by
    element (softmax over one key: 1, or NaN for NaN and +-inf), so NaN, +-inf, huge values and
    signed zeros go through each kernel's epilogue exactly as torch's op takes them."""
    if machine == "reference":  # the scalar reference micro-kernel, which select() never picks
        monkeypatch.setattr(chainfuse.compiler, "select_weighted", lambda *a: REFERENCE_KERNEL)
    values = [NAN, INF, -INF, 3e38, -3e38, 0.0, -0.0, 2.5, -2.5, 1e-30, -1e-30]
    if between == "softmax":
        # a row of only -inf scores gives zeros, as a fully masked row (torch: NaN); scores
        # beyond FLT_MAX / log2(e) overflow the base-2 exponent's scaling (known limits)
        values = [NAN, INF, 1e38, -1e38, 0.0, -0.0, 2.5, -2.5, 1e-30, -1e-30]
    M = 37  # (tails of every micro-kernel's block)
    A = np.resize(np.array(values, np.float32), (1, M, 1))
    B, D = np.ones((1, 1, 1), np.float32), np.ones((1, 1, 1), np.float32)
    chain = chainfuse.gemm_chain(1, M, 1, 1, 1, between)
    kernel = compile(chain, hardware=_hardware("host" if machine == "reference" else machine))
    got = kernel(A, B, D)
    want = _torch_gemm_chain(A, B, D, between)
    reference.assert_close(got, want, chain)


@pytest.mark.parametrize("between", [None, "relu", "gelu", "softmax"])
@pytest.mark.parametrize("machine", ["host", "portable"])
@pytest.mark.parametrize(("M", "K", "L", "N"), [(33, 17, 40, 19), (5, 8, 7, 3), (130, 64, 67, 65)])
def test_nan_and_inf_inputs_land_where_torchs_do(
    between: str | None, machine: str, M: int, K: int, L: int, N: int
) -> None:
    """A few NaN and +-inf at random places of A, B and D: the result's NaN and inf are
    exactly where PyTorch's unfused ops put them, everything else within the tolerance."""
    rng = np.random.default_rng(M + K + L + N)
    A, B, D = (rng.standard_normal(s).astype(np.float32) for s in ((2, M, K), (2, K, L), (2, L, N)))
    # (each poisons a row or a column of the result at most: the rest must stay right)
    for x, b, value in ((A, 0, NAN), (A, 1, INF), (D, 0, -INF), (B, 1, NAN)):
        x[(b, *(rng.integers(0, n) for n in x.shape[1:]))] = value
    chain = chainfuse.gemm_chain(2, M, N, K, L, between)
    got = compile(chain, hardware=_hardware(machine))(A, B, D)
    want = _torch_gemm_chain(A, B, D, between)
    assert np.isnan(want).any() and np.isfinite(want).any()  # (the case tests something)
    reference.assert_close(got, want, chain)
    assert (np.isnan(got) == np.isnan(want)).all()


@pytest.mark.parametrize(("between", "after"), [(None, None), ("relu", None), (None, "relu"),
                                                ("relu", "relu")])  # fmt: skip
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv_chain_propagates_nan_as_torch(
    between: str | None, after: str | None, channels_last: bool
) -> None:
    """A NaN and a -inf in x reach conv2's output where PyTorch's unfused convs and relus put
    them (a relu of NaN is NaN)."""
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((2, 3, 11, 10)).astype(np.float32))
    x[0, 1, 4, 4], x[1, 2, 8, 1] = NAN, -INF
    w1 = torch.from_numpy(rng.standard_normal((5, 3, 3, 3)).astype(np.float32))
    w2 = torch.from_numpy(rng.standard_normal((4, 5, 3, 3)).astype(np.float32))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    got = ops.conv_chain(x, w1, w2, padding=1, between=between, after=after)
    y = F.conv2d(x.double(), w1.double(), padding=1)
    y = torch.relu(y) if between else y
    y = F.conv2d(y, w2.double(), padding=1)
    want = (torch.relu(y) if after else y).numpy()
    assert np.isnan(want).any() and np.isfinite(want).any()
    assert (np.isnan(got.numpy()) == np.isnan(want)).all()
    assert (np.isinf(got.numpy()) == np.isinf(want)).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got.numpy()[finite], want[finite], rtol=1e-4, atol=1e-3)


def test_attention_nan_score_poisons_its_row_as_torchs() -> None:
    """A NaN in one query row of q (and one key of k) makes those rows NaN, as PyTorch's
    unfused softmax(q kᵀ) v does; other rows stay right."""
    rng = np.random.default_rng(3)
    q, k, v = (torch.from_numpy(rng.standard_normal((1, 2, n, 16)).astype(np.float32))
               for n in (9, 21, 21))  # fmt: skip
    q[0, 0, 3, 5] = NAN
    k[0, 1, 7, 2] = NAN
    got = ops.attention(q, k, v).numpy()
    s = q.double() @ k.double().transpose(-1, -2) / 4.0
    want = (torch.softmax(s, -1) @ v.double()).numpy()
    assert np.isnan(want).any() and np.isfinite(want).any()
    assert (np.isnan(got) == np.isnan(want)).all()
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)


def _fp16_rounded(x: np.ndarray) -> np.ndarray:
    """float64 values rounded to fp16 as torch rounds them (inf from 65520 up)."""
    return torch.from_numpy(x).half().double().numpy()


@pytest.mark.parametrize("between", [None, "relu", "gelu"])  # (softmax: a convex mix, below)
def test_fp16_gemm_chain_overflows_to_inf_where_torchs_does(between: str | None) -> None:
    """Large magnitudes: the fp16 result is inf exactly where PyTorch's, computed in fp32 and
    rounded once, is (the intermediate is fp32, so it does not overflow), and finite
    elsewhere. Elements within 1 % of the overflow threshold are left out (either rounding is
    right there)."""
    rng = np.random.default_rng(11)
    M, K, L, N = 29, 13, 35, 17
    A, B, D = ((rng.standard_normal(s) * 30).astype(np.float16)
               for s in ((1, M, K), (1, K, L), (1, L, N)))  # fmt: skip
    chain = chainfuse.gemm_chain(1, M, N, K, L, between, dtype="float16")
    exact = _torch_gemm_chain(*(x.astype(np.float32) for x in (A, B, D)), between)
    want = _fp16_rounded(exact)
    got = compile(chain)(*(torch.from_numpy(x) for x in (A, B, D))).double().numpy()
    edge = np.abs(np.abs(exact) / 65520.0 - 1.0) < 0.01
    assert np.isinf(want[~edge]).any() and np.isfinite(want[~edge]).any()
    assert (np.isinf(got) == np.isinf(want))[~edge].all()
    assert (np.sign(got) == np.sign(want))[~edge & np.isinf(want)].all()
    assert not np.isnan(got).any()
    keep = ~edge & np.isfinite(want)
    reference.assert_close(got[keep], exact[keep], chain, dtype=chain.dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_attention_at_the_largest_values_stays_finite(dtype: str) -> None:
    """v at the dtype's largest value and huge scores: every output is a convex mix of v's rows,
    so none may overflow (PyTorch's fp32-computed result is finite), and none is NaN."""
    rng = np.random.default_rng(5)
    tdt = getattr(torch, dtype)
    big = torch.finfo(tdt).max
    q = torch.from_numpy(rng.standard_normal((1, 2, 19, 8)).astype(np.float32) * 100).to(tdt)
    k = torch.from_numpy(rng.standard_normal((1, 2, 23, 8)).astype(np.float32) * 100).to(tdt)
    v = torch.from_numpy(rng.uniform(0.99, 1.0, (1, 2, 23, 8)).astype(np.float32)).to(tdt) * big
    v[..., 1] = -big
    got = ops.attention(q, k, v).double()
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).to(tdt).double()
    assert torch.isfinite(want).all() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=0.0)
