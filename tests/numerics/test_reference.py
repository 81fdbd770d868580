"""The oracle against independent implementations: hand-written numpy, explicit loops, PyTorch.

Every other numerical test trusts `chainfuse.reference`, so here it is checked against code that
shares nothing with it: `A @ B` instead of its batched-matmul contraction, Python loops over
output pixels instead of its im2col gather, `torch.nn.functional` where torch is installed.
"""

from __future__ import annotations

import itertools
import math
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from chainfuse import reference
from chainfuse.builders import attention_chain, conv_chain_spec, from_einsum, gemm_chain
from chainfuse.ir import (
    Access,
    Activation,
    Affine,
    Chain,
    Contraction,
    DType,
    Loop,
    Pointwise,
    Role,
    Softmax,
    Tensor,
)

F64 = NDArray[np.float64]
AWKWARD = st.sampled_from([1, 2, 3, 5, 7, 8, 17])
"""Sizes that are not multiples of anything: tails and size-1 dims are where gathers go wrong."""


def f64(inputs: dict[str, NDArray[Any]]) -> dict[str, F64]:
    return {k: v.astype(np.float64) for k, v in inputs.items()}


def softmax_rows(x: F64) -> F64:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    result: F64 = e / e.sum(axis=-1, keepdims=True)
    return result


def gelu(x: F64) -> F64:
    """torch's exact gelu, one `math.erf` at a time."""
    values = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.ravel().tolist()]
    return np.array(values).reshape(x.shape)


def close(actual: Any, expected: Any) -> None:
    """Two float64 computations of the same sums differ by rounding only."""
    np.testing.assert_allclose(actual, expected, rtol=1e-12, atol=1e-12)


# -- GEMM chains ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), M=AWKWARD, N=AWKWARD, K=AWKWARD, L=AWKWARD,
       between=st.sampled_from([None, "relu", "gelu", "softmax"]))  # fmt: skip
def test_gemm_chain_matches_numpy(
    b: int, M: int, N: int, K: int, L: int, between: str | None
) -> None:
    chain = gemm_chain(b, M, N, K, L, between=between)
    x = f64(reference.random_inputs(chain, seed=M * N + K))
    c = x["A"] @ x["B"]
    if between == "relu":
        c = np.maximum(c, 0)
    elif between == "gelu":
        c = gelu(c)
    elif between == "softmax":
        c = softmax_rows(c)
    close(reference.run(chain, x)["E"], c @ x["D"])


def test_keep_returns_every_tensor() -> None:
    chain = gemm_chain(2, 3, 4, 5, 6, between="relu")
    x = reference.random_inputs(chain)
    got = reference.run(chain, x, keep=True)
    assert list(got) == [t.name for t in chain.tensors]
    assert all(v.flags.writeable and v.flags.owndata for v in got.values())
    close(got["P"], np.maximum(got["C"], 0))
    assert list(reference.run(chain, x)) == ["E"]


def test_from_einsum_three_contractions() -> None:
    """Permuted and batched indices, a loop read by one operand only, and two activations."""
    sizes = {"b": 2, "m": 3, "k": 4, "n": 5, "l": 7, "j": 1}
    chain = from_einsum("mk,bkn->bmn", "bmn,nl->lbm", "lbm,mlj->bj", sizes=sizes,
                        between=("relu", "gelu"))  # fmt: skip
    x = f64(reference.random_inputs(chain, seed=3))
    t0 = np.maximum(np.einsum("mk,bkn->bmn", x["X0"], x["W0"]), 0)
    t1 = gelu(np.einsum("bmn,nl->lbm", t0, x["W1"]))
    close(reference.run(chain, x)["Y"], np.einsum("lbm,mlj->bj", t1, x["W2"]))


# -- attention ------------------------------------------------------------------------------------


def numpy_attention(
    q: F64, k: F64, v: F64, scale: float, causal: bool, mask: NDArray[Any] | None
) -> F64:
    s = scale * q @ np.swapaxes(k, -1, -2)
    keep = np.ones(s.shape, dtype=bool)
    if mask is not None and mask.dtype == np.bool_:
        keep = keep & mask
    elif mask is not None:
        s = s + mask
    if causal:
        keep = keep & np.tril(np.ones(s.shape[-2:], dtype=bool))
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    for idx in np.ndindex(*s.shape[:-1]):  # row by row: a fully masked row stays zero
        row = idx[:-1]
        if keep[idx].any():
            p = softmax_rows(np.where(keep[idx], s[idx], -np.inf))
            out[idx] = p @ v[row]
    return out


MASK_CASES = [
    (False, None, None),
    (True, None, None),
    (False, "bool", None),
    (False, "bool", "2d"),
    (False, "bool", "4d1"),
    (True, "bool", "4d1"),
    (False, "additive", None),
    (True, "additive", "2d"),
]


def mask_shape(kind: str | None, m: int, n: int) -> tuple[int, ...] | None:
    """None: the builder's default [batch, heads, m, n]; "2d": [m, n]; "4d1": [1, 1, m, n]."""
    return {None: None, "2d": (m, n), "4d1": (1, 1, m, n)}[kind]


@pytest.mark.parametrize(("causal", "mask", "shape"), MASK_CASES)
@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), m=AWKWARD, n=AWKWARD, d=AWKWARD, dv=AWKWARD)
def test_attention_matches_numpy(
    causal: bool,
    mask: str | None,
    shape: str | None,
    b: int,
    h: int,
    m: int,
    n: int,
    d: int,
    dv: int,
) -> None:
    chain = attention_chain(b, h, m, n, d, dv, causal=causal, mask=mask,
                            mask_shape=mask_shape(shape, m, n))  # fmt: skip
    raw = reference.random_inputs(chain, seed=m + n)
    x = {k: v if v.dtype == np.bool_ else v.astype(np.float64) for k, v in raw.items()}
    want = numpy_attention(x["Q"], x["K"], x["V"], 1 / math.sqrt(d), causal, x.get("mask"))
    close(reference.run(chain, x)["O"], want)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_row_is_zero(kind: str) -> None:
    chain = attention_chain(1, 2, 4, 6, 3, 5, mask=kind, mask_shape=(4, 6))
    x = reference.random_inputs(chain)
    x["mask"] = x["mask"].copy()
    x["mask"][2] = False if kind == "bool" else -np.inf
    got = reference.run(chain, x, keep=True)
    assert np.all(got["P"][:, :, 2] == 0) and np.all(got["O"][:, :, 2] == 0)
    np.testing.assert_allclose(got["P"][:, :, [0, 1, 3]].sum(axis=-1), 1.0, rtol=1e-14)


def test_large_magnitudes_stay_finite() -> None:
    """Scores of order 1e8: a softmax that does not subtract the row max overflows to inf/NaN."""
    for chain in (gemm_chain(2, 5, 3, 7, 9, between="softmax"),
                  attention_chain(1, 2, 9, 11, 8, 4, causal=True, mask="additive")):  # fmt: skip
        x = reference.random_inputs(chain, seed=1, scale=1e4)
        got = reference.run(chain, x, keep=True)
        assert all(np.isfinite(v).all() for v in got.values())
        np.testing.assert_allclose(got["P"].sum(axis=-1), 1.0, rtol=1e-12)


@pytest.mark.parametrize(("causal", "mask", "shape"), MASK_CASES)
def test_attention_matches_torch_sdpa(causal: bool, mask: str | None, shape: str | None) -> None:
    torch = pytest.importorskip("torch")
    b, h, m, n = 2, 3, 7, 9
    chain = attention_chain(b, h, m, n, 5, 4, causal=causal, mask=mask,
                            mask_shape=mask_shape(shape, m, n))  # fmt: skip
    x = reference.random_inputs(chain, seed=5)
    if "mask" in x:  # a fully masked row: PyTorch's CPU SDPA gives zeros there too
        x["mask"] = x["mask"].copy()
        x["mask"][..., 1, :] = False if mask == "bool" else -np.inf
    t = {
        k: torch.from_numpy(v.astype(bool if v.dtype == np.bool_ else np.float64))
        for k, v in x.items()
    }
    attn_mask = t.get("mask")
    if causal and attn_mask is not None:  # SDPA takes a mask or is_causal, not both
        tril = torch.ones(m, n, dtype=torch.bool).tril()
        if attn_mask.dtype == torch.bool:
            attn_mask = attn_mask & tril
        else:
            attn_mask = attn_mask.masked_fill(~tril, -math.inf)
    want = torch.nn.functional.scaled_dot_product_attention(
        t["Q"], t["K"], t["V"], attn_mask=attn_mask, is_causal=causal and attn_mask is None
    )
    close(reference.run(chain, x)["O"], want.numpy())


# -- convolutions ---------------------------------------------------------------------------------


def naive_conv(x: F64, w: F64, stride: int, pad: int) -> F64:
    """Direct convolution, one output pixel and one tap at a time, bounds tested by hand."""
    batch, _, height, width = x.shape
    out_ch, _, kh, kw = w.shape
    p_out = (height + 2 * pad - kh) // stride + 1
    q_out = (width + 2 * pad - kw) // stride + 1
    y = np.zeros((batch, out_ch, p_out, q_out))
    for n, k, p, q in itertools.product(range(batch), range(out_ch), range(p_out), range(q_out)):
        acc = 0.0
        for r, s in itertools.product(range(kh), range(kw)):
            hh, ww = p * stride + r - pad, q * stride + s - pad
            if 0 <= hh < height and 0 <= ww < width:
                acc += float(x[n, :, hh, ww] @ w[k, :, r, s])
        y[n, k, p, q] = acc
    return y


CONV: dict[str, st.SearchStrategy[Any]] = {
    "N": st.integers(1, 2),
    "C": st.integers(1, 4),
    "H": st.integers(1, 9),
    "W": st.integers(1, 9),
    "K1": st.integers(1, 4),
    "K2": st.integers(1, 4),
    "R1": st.sampled_from([1, 3]),
    "S1": st.sampled_from([1, 3]),
    "R2": st.sampled_from([1, 3]),
    "S2": st.sampled_from([1, 3]),
    "stride": st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "padding": st.tuples(st.integers(0, 2), st.integers(0, 2)),
    "between": st.sampled_from([None, "relu"]),
}


def build_conv(args: dict[str, Any]) -> Chain:
    try:
        return conv_chain_spec(**args)
    except ValueError:  # a kernel larger than its padded input: no such convolution
        assume(False)
        raise


@settings(max_examples=40, deadline=None)
@given(**CONV)
def test_conv_chain_matches_loops(**args: Any) -> None:
    chain = build_conv(args)
    x = f64(reference.random_inputs(chain, seed=args["H"]))
    (st1, st2), (pad1, pad2) = args["stride"], args["padding"]
    y1 = naive_conv(x["X"], x["W1"], st1, pad1)
    z = np.maximum(y1, 0) if args["between"] == "relu" else y1
    close(reference.run(chain, x)["Y2"], naive_conv(z, x["W2"], st2, pad2))


@settings(max_examples=25, deadline=None)
@given(**CONV)
def test_conv_chain_matches_torch(**args: Any) -> None:
    torch = pytest.importorskip("torch")
    chain = build_conv(args)
    x = {
        k: torch.from_numpy(v.astype(np.float64)) for k, v in reference.random_inputs(chain).items()
    }
    (st1, st2), (pad1, pad2) = args["stride"], args["padding"]
    conv2d = torch.nn.functional.conv2d
    y1 = conv2d(x["X"], x["W1"], stride=st1, padding=pad1)
    z = torch.relu(y1) if args["between"] == "relu" else y1
    want = conv2d(z, x["W2"], stride=st2, padding=pad2)
    close(reference.run(chain, {k: v.numpy() for k, v in x.items()})["Y2"], want.numpy())


# -- accesses the builders do not make ------------------------------------------------------------


def plain(tensor: str, *loops: str) -> Access:
    return Access(tensor, tuple(Affine.of(x) for x in loops))


def test_diagonal_constant_and_reversed_indices() -> None:
    """C[j] = sum_i A[i, i] * B[3 - i, 2, j]: a loop in two dims, a constant, coefficient -1."""
    loops = (Loop("i", 4), Loop("j", 3))
    a = plain("A", "i", "i")
    b = Access("B", (Affine((("i", -1),), 3), Affine((), 2), Affine.of("j")))
    tensors = (Tensor("A", (4, 4), DType.FLOAT64, Role.INPUT),
               Tensor("B", (4, 5, 3), DType.FLOAT64, Role.INPUT),
               Tensor("C", (3,), DType.FLOAT64, Role.OUTPUT))  # fmt: skip
    chain = Chain("diag", loops, tensors, (Contraction(plain("C", "j"), (a, b)),)).verify()
    x = f64(reference.random_inputs(chain))
    want = np.einsum("ii,ij->j", x["A"], x["B"][::-1, 2, :])
    close(reference.run(chain, x)["C"], want)


def test_transposed_pointwise_and_broadcast_bias() -> None:
    """F[n,m] = relu(T[m,n]); G[n,m] = F[n,m] + bias[m]; Y[n,j] = sum_m G[n,m] V[m,j]."""
    loops = (Loop("m", 3), Loop("n", 5), Loop("k", 2), Loop("j", 4))
    dt, inp, mid = DType.FLOAT32, Role.INPUT, Role.INTERMEDIATE
    shapes = {"X": ((3, 2), inp), "W": ((2, 5), inp), "T": ((3, 5), mid), "F": ((5, 3), mid),
              "bias": ((3,), inp), "G": ((5, 3), mid), "V": ((3, 4), inp),
              "Y": ((5, 4), Role.OUTPUT)}  # fmt: skip
    tensors = tuple(Tensor(name, shape, dt, role) for name, (shape, role) in shapes.items())
    ops = (
        Contraction(plain("T", "m", "n"), (plain("X", "m", "k"), plain("W", "k", "n"))),
        Pointwise(Activation.RELU, plain("T", "m", "n"), plain("F", "n", "m")),
        Pointwise(Activation.BIAS, plain("F", "n", "m"), plain("G", "n", "m"), plain("bias", "m")),
        Contraction(plain("Y", "n", "j"), (plain("G", "n", "m"), plain("V", "m", "j"))),
    )
    chain = Chain("transposed", loops, tensors, ops).verify()
    x = f64(reference.random_inputs(chain))
    g = np.maximum(x["X"] @ x["W"], 0).T + x["bias"][None, :]
    close(reference.run(chain, x)["Y"], g @ x["V"])


def shifted_chain(zero_pad: bool) -> Chain:
    """B[i] = A[i + 1] * S[i] over i < 4 with A of size 4: the last read is past the end."""
    a = Access("A", (Affine((("i", 1),), 1),), zero_pad=zero_pad)
    tensors = (Tensor("A", (4,), DType.FLOAT64, Role.INPUT),
               Tensor("S", (4,), DType.FLOAT64, Role.INPUT),
               Tensor("B", (4,), DType.FLOAT64, Role.OUTPUT))  # fmt: skip
    return Chain(
        "shift", (Loop("i", 4),), tensors, (Contraction(plain("B", "i"), (a, plain("S", "i"))),)
    )


def test_out_of_range_read_is_zero_only_with_zero_pad() -> None:
    x = {"A": np.array([1.0, 2.0, 3.0, 4.0]), "S": np.ones(4)}
    close(reference.run(shifted_chain(zero_pad=True).verify(), x)["B"], [2.0, 3.0, 4.0, 0.0])
    with pytest.raises(ValueError, match=r"'A'.*zero_pad"):
        reference.run(shifted_chain(zero_pad=False), x)  # not verified: verify() rejects it


# -- input checks ---------------------------------------------------------------------------------


def test_inputs_are_checked() -> None:
    chain = attention_chain(1, 2, 3, 4, 5, 6, mask="bool")
    good = reference.random_inputs(chain)
    with pytest.raises(ValueError, match=r"'K'.*\(1, 2, 4, 5\).*\(1, 2, 5, 4\)"):
        reference.run(chain, good | {"K": np.zeros((1, 2, 5, 4))})
    with pytest.raises(ValueError, match=r"'V'.*missing"):
        reference.run(chain, {k: v for k, v in good.items() if k != "V"})
    with pytest.raises(ValueError, match="'P'"):
        reference.run(chain, good | {"P": np.zeros((1, 2, 3, 4))})
    with pytest.raises(ValueError, match=r"'mask'.*bool"):
        reference.run(chain, good | {"mask": good["mask"].astype(np.float32)})


# -- random inputs --------------------------------------------------------------------------------


def test_random_inputs_are_deterministic_and_typed() -> None:
    chain = attention_chain(2, 2, 16, 16, 8, 8, causal=True, mask="bool", mask_shape=(16, 16))
    a, b = reference.random_inputs(chain, seed=7), reference.random_inputs(chain, seed=7)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["Q"], reference.random_inputs(chain, seed=8)["Q"])
    assert a["Q"].dtype == np.float32 and a["mask"].dtype == np.bool_
    assert a["mask"][:, 0].all() and not a["mask"].all()  # every row keeps its first position
    add = reference.random_inputs(attention_chain(1, 1, 8, 64, 4, 4, mask="additive"))["mask"]
    assert np.isfinite(add).all() and (add <= -1e4).any()
    for dtype, numpy_dtype in (("float64", np.float64), ("float16", np.float16)):
        assert (
            reference.random_inputs(gemm_chain(1, 2, 3, 4, 5, dtype=dtype))["A"].dtype
            == numpy_dtype
        )


def test_bfloat16_inputs_are_representable() -> None:
    x = reference.random_inputs(gemm_chain(1, 7, 3, 5, 9, dtype="bfloat16"))
    for v in x.values():
        assert v.dtype == np.float32
        assert not (v.view(np.uint32) & 0xFFFF).any()
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8])  # ties: to the even neighbour
    assert list(reference._round_bf16(halfway)) == [1.0, 1 + 2**-6]


# -- gelu without scipy ---------------------------------------------------------------------------


def test_erf_fallback_agrees_with_scipy() -> None:
    special = pytest.importorskip("scipy.special")
    x = np.concatenate([np.linspace(-7, 7, 2001), [0.0, 1e-300, -1e-8, 30.0, -np.inf, np.inf]])
    np.testing.assert_allclose(reference._erf_math(x), special.erf(x), rtol=1e-13, atol=1e-300)
    assert np.isnan(reference._erf_math(np.array([np.nan]))).all()


def test_gelu_without_scipy(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = gemm_chain(1, 9, 4, 6, 11, between="gelu", dtype="float64")
    x = reference.random_inputs(chain, scale=3.0)
    with_scipy = reference.run(chain, x, keep=True)["P"]
    monkeypatch.setitem(sys.modules, "scipy.special", None)  # makes `import scipy.special` fail
    reference._scipy_erf.cache_clear()
    try:
        assert reference._scipy_erf() is None
        without = reference.run(chain, x, keep=True)["P"]
    finally:
        reference._scipy_erf.cache_clear()
    np.testing.assert_allclose(without, with_scipy, rtol=1e-13, atol=1e-13)


# -- tolerance and assert_close -------------------------------------------------------------------


def test_tolerance_follows_the_rule() -> None:
    chain = gemm_chain(1, 8, 8, 64, 512, between="softmax")
    rtol, atol = reference.tolerance(chain)
    n, s = 64 + 512 + 512, 3  # K, softmax over L, L; three ops write float32 tensors
    assert rtol == atol == pytest.approx(8 * math.sqrt((n + s) * 2.0**-48))
    order = [
        reference.tolerance(chain, DType(d))[0]
        for d in ("float64", "float32", "float16", "bfloat16")
    ]
    assert order == sorted(order)
    longer = gemm_chain(1, 8, 8, 64, 4096, between="softmax")
    assert reference.tolerance(longer)[0] > rtol
    conv = conv_chain_spec(1, 4, 8, 8, 5, 3, 3, 6, 1, 1)
    assert reference.tolerance(conv)[0] == pytest.approx(8 * math.sqrt((4 * 9 + 5 + 2) * 2.0**-48))


def bf16(x: NDArray[Any]) -> F64:
    return reference._round_bf16(x).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_low_precision_kernels_pass(dtype: str) -> None:
    """A float32 BLAS chain, and one that stores bf16 between float32 matmuls, are close."""
    chain = gemm_chain(2, 64, 48, 256, 384, between="relu", dtype=dtype)
    x = reference.random_inputs(chain, seed=11)
    want = reference.run(chain, x)["E"]
    if dtype == "float32":
        got = np.maximum(x["A"] @ x["B"], 0) @ x["D"]
    else:
        c = bf16(x["A"].astype(np.float32) @ x["B"].astype(np.float32))
        got = bf16(np.maximum(c, 0).astype(np.float32) @ x["D"])
    reference.assert_close(got, want, chain, name="E")
    # ...and the bound is tight enough to see a float16-sized error in a float32 kernel.
    if dtype == "float32":
        with pytest.raises(AssertionError):
            reference.assert_close(want.astype(np.float16), want, chain)


def test_assert_close_reports_the_failure() -> None:
    chain = gemm_chain(2, 3, 4, 5, 6)
    want = reference.run(chain, reference.random_inputs(chain))["E"]
    reference.assert_close(want.astype(np.float32), want, chain)
    bad = want.copy()
    bad[1, 2, 3] += 1e-3 * max(1.0, np.abs(want).max())
    with pytest.raises(AssertionError, match=r"E: 1 of 24 elements.*index \(1, 2, 3\)"):
        reference.assert_close(bad, want, chain, name="E")
    bad[0, 0, 0] = np.nan
    with pytest.raises(AssertionError, match="2 of 24"):
        reference.assert_close(bad, want, chain, name="E")
    with pytest.raises(AssertionError, match="shape"):
        reference.assert_close(want[0], want, chain)
    nan = np.full(3, np.nan)
    reference.assert_close(nan, nan, chain)  # NaN where NaN is expected is fine


# -- the softmax term of the tolerance -----------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    d=st.integers(1, 24),
    magnitude=st.sampled_from([0.3, 1.0, 10.0, 31.6, 100.0, 1e4]),
    mask=st.sampled_from([None, "bool", "additive"]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_softmax_error_bounds_any_score_perturbation_within_delta(
    sq: int, sk: int, d: int, magnitude: float, mask: str | None, causal: bool, seed: int
) -> None:
    """Move every score by up to the delta the bound assumes (random signs, and the extreme
    corners +-delta), recompute the output exactly: it never moves more than the bound says."""
    chain = attention_chain(1, 1, sq, sk, d, d, causal=causal, mask=mask)
    x = reference.random_inputs(chain, seed=seed, scale=magnitude)
    bound = reference.softmax_error(chain, x)
    assert bound is not None and np.isfinite(bound).all()
    q, k, v = (x[n][0, 0].astype(np.float64) for n in ("Q", "K", "V"))
    soft = next(op for op in chain.ops if isinstance(op, Softmax))
    tau = reference._SAFETY * np.sqrt(d * reference.UNIT_ROUNDOFF[DType.FLOAT32] ** 2
                                      + reference.UNIT_ROUNDOFF[DType.FLOAT32] ** 2)  # fmt: skip
    s = q @ k.T * soft.scale
    delta = tau * soft.scale * (np.abs(q) @ np.abs(k).T) + reference._SAFETY * 2**-24 * np.abs(s)
    keep = np.ones((sq, sk), dtype=bool)
    if mask == "additive":
        s = s + x["mask"][0, 0]
    elif mask == "bool":
        keep &= x["mask"][0, 0]
    if causal:
        keep &= np.tri(sq, sk, dtype=bool)

    def attend(scores: np.ndarray) -> np.ndarray:
        z = np.where(keep, scores, -np.inf)
        top = z.max(axis=1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        p = np.exp(z - top)
        total = p.sum(axis=1, keepdims=True)
        return (p / np.where(total > 0, total, 1.0)) @ v

    base = attend(s)
    rng = np.random.default_rng(seed)
    for _ in range(4):
        signs = rng.choice([-1.0, 1.0], size=s.shape) * rng.random(s.shape) ** 0.25
        moved = attend(s + signs * delta)
        assert (np.abs(moved - base) <= bound[0, 0] * (1 + 1e-9) + 1e-12).all()


def test_softmax_error_is_small_where_scores_are_small_or_well_separated() -> None:
    """Not a vacuous bound: O(1) scores get about the plain tolerance; huge, separated scores
    (one-hot softmax) get ~0, so a kernel that picked the wrong key would fail."""
    chain = attention_chain(1, 2, 50, 70, 32, 16)
    _, atol = reference.tolerance(chain)
    small = reference.softmax_error(chain, reference.random_inputs(chain, seed=1))
    assert small is not None and small.max() < 20 * atol
    x = reference.random_inputs(chain, seed=1, scale=1e4)
    huge = reference.softmax_error(chain, x)
    assert huge is not None and np.median(huge) == 0.0
    out = reference.run(chain, x)["O"]
    wrong = out.copy()
    wrong[0, 0, 3] = x["V"][0, 0, 0]  # as if row 3 had attended to key 0 only
    with pytest.raises(AssertionError, match="not close"):
        reference.assert_close(wrong, out, chain, inputs=x)
    assert reference.softmax_error(gemm_chain(1, 8, 8, 8, 8, "relu"),
                                   reference.random_inputs(gemm_chain(1, 8, 8, 8, 8, "relu"))) is None  # fmt: skip
