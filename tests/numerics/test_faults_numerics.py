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
import chainfuse.config
import chainfuse.torch
from chainfuse import ops, reference
from chainfuse.compiler import compile
from chainfuse.hardware import resolve
from chainfuse.kernels import available
from tests.checks import huge_in_float64

torch = pytest.importorskip("torch")
F = torch.nn.functional

NAN, INF = float("nan"), float("inf")
HOST = resolve(None)
REFERENCE_KERNEL = next(k for k in available() if not k.isa and k.mr == k.nr)


def _hardware(kind: str) -> Any:
    """The host, or the host without SIMD flags (the portable vector kernel)."""
    return HOST if kind == "host" else dataclasses.replace(HOST, isa=frozenset())


def _between(name: str | None, s: Any) -> Any:
    """PyTorch's unfused op between the GEMMs (the reference for NaN and inf placement; gelu
    of huge values as `huge_in_float64` takes them)."""
    if name == "gelu":
        return huge_in_float64(F.gelu, s)
    if name == "relu":
        return torch.relu(s)
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
        # (a row of only -inf scores is NaN, as torch.softmax's); scores beyond
        # FLT_MAX / log2(e) overflow the base-2 exponent's scaling (a known limit)
        values = [NAN, INF, -INF, 1e38, -1e38, 0.0, -0.0, 2.5, -2.5, 1e-30, -1e-30]
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


# --- out= aliasing ------------------------------------------------------------------------


def _as(kind: str, x: np.ndarray) -> Any:
    return torch.from_numpy(x) if kind == "torch" else x


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("alias", ["A", "B", "D"])
def test_out_aliasing_an_input_is_an_error_naming_both(kind: str, alias: str) -> None:
    """`out=` an input (square sizes, so the shapes fit) is refused on the first call, on a
    repeat (the replay path) and after a call with a separate out of the same layout."""
    rng = np.random.default_rng(1)
    A, B, D = (_as(kind, rng.standard_normal((2, 8, 8)).astype(np.float32)) for _ in range(3))
    operands = {"A": A, "B": B, "D": D}
    before = [np.asarray(x).copy() for x in (A, B, D)]
    for _ in range(2):
        with pytest.raises(ValueError, match=f"out: overlaps the input {alias}"):
            ops.gemm_chain(A, B, D, out=operands[alias])
    separate = _as(kind, np.empty((2, 8, 8), np.float32))
    ops.gemm_chain(A, B, D, out=separate)  # (remembered: the next call is a replay)
    with pytest.raises(ValueError, match=f"out: overlaps the input {alias}"):
        ops.gemm_chain(A, B, D, out=operands[alias])
    for x, was in zip((A, B, D), before, strict=True):
        assert (np.asarray(x) == was).all()  # (nothing written)
    kernel = compile(chainfuse.gemm_chain(2, 8, 8, 8, 8))
    with pytest.raises(ValueError, match=f"out: overlaps the input {alias}"):
        kernel(A, B, D, out=operands[alias])
    with pytest.raises(ValueError, match="out: overlaps the input A"):
        ops.gemm_chain(A[None], B, D, out=A[None])  # (the broadcast path)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_out_beside_its_inputs_in_one_buffer_is_fine(kind: str) -> None:
    """Interleaved halves of one buffer share no element: out in one, A in the other, on the
    first call and on replays."""
    rng = np.random.default_rng(2)
    buf = rng.standard_normal((2, 8, 16)).astype(np.float32)
    B, D = (rng.standard_normal((2, 8, 8)).astype(np.float32) for _ in range(2))
    want = buf[:, :, 8:].astype(np.float64) @ B @ D
    whole = _as(kind, buf)
    for _ in range(3):
        ops.gemm_chain(whole[:, :, 8:], _as(kind, B), _as(kind, D), out=whole[:, :, :8])
        np.testing.assert_allclose(np.asarray(whole)[:, :, :8], want, rtol=1e-4, atol=1e-4)


def test_self_overlapping_out_is_an_error() -> None:
    """An out with a stride of 0 (an expanded view) would get two results in one element."""
    A, B, D = (np.ones((2, 8, 8), np.float32) for _ in range(3))
    expanded = torch.zeros(1, 8, 8).expand(2, 8, 8)
    with pytest.raises(ValueError, match="out: its elements overlap"):
        ops.gemm_chain(*(torch.from_numpy(x) for x in (A, B, D)), out=expanded)
    zero = np.zeros(8 * 8, np.float32)
    strided = np.lib.stride_tricks.as_strided(zero, (2, 8, 8), (0, 32, 4), writeable=True)
    with pytest.raises(ValueError, match="out: its elements overlap"):
        ops.gemm_chain(A, B, D, out=strided)


def test_conv_out_aliasing_an_input_is_an_error() -> None:
    """conv_chain's out= the input x (same shape: 3x3 convs with padding 1, K2 = C)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((3, 4, 3, 3)).astype(np.float32)
    for _ in range(2):
        with pytest.raises(ValueError, match="out: overlaps the input x"):
            ops.conv_chain(x, w1, w2, padding=1, out=x)
    ops.conv_chain(x, w1, w2, padding=1, out=np.empty_like(x))
    with pytest.raises(ValueError, match="out: overlaps the input x"):
        ops.conv_chain(x, w1, w2, padding=1, out=x)  # (a replay)


# --- arguments of other kinds ------------------------------------------------------------


def test_ndarray_subclasses_are_taken(tmp_path: Any) -> None:
    """np.memmap (and any ndarray subclass) is an array: inputs and out=."""
    rng = np.random.default_rng(6)
    A, B, D = (rng.standard_normal((2, 8, 8)).astype(np.float32) for _ in range(3))
    mapped = np.memmap(tmp_path / "a.bin", np.float32, "w+", shape=A.shape)
    mapped[:] = A
    out = np.memmap(tmp_path / "out.bin", np.float32, "w+", shape=A.shape)
    want = A.astype(np.float64) @ B @ D
    np.testing.assert_allclose(ops.gemm_chain(mapped, B, D), want, rtol=1e-4, atol=1e-4)
    assert ops.gemm_chain(A, B, D, out=out) is out
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
    q = mapped[None]
    np.testing.assert_allclose(ops.attention(q, q, q), ops.attention(A[None], A[None], A[None]),
                               rtol=1e-6, atol=1e-6)  # fmt: skip
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    w1, w2 = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((3, 4, 3, 3))
    w1, w2 = w1.astype(np.float32), w2.astype(np.float32)
    np.testing.assert_array_equal(ops.conv_chain(x.view(np.memmap), w1, w2),
                                  ops.conv_chain(x, w1, w2))  # fmt: skip


class _Tagged(torch.Tensor):
    """A user's own tensor subclass."""


def test_tensor_subclasses_are_taken() -> None:
    rng = np.random.default_rng(8)
    A, B, D = (torch.from_numpy(rng.standard_normal((2, 8, 8)).astype(np.float32))
               for _ in range(3))  # fmt: skip
    want = ops.gemm_chain(A, B, D)
    torch.testing.assert_close(ops.gemm_chain(A.as_subclass(_Tagged), B, D).as_subclass(
        torch.Tensor), want)  # fmt: skip
    with torch.no_grad():
        weight = torch.nn.Parameter(B)
        torch.testing.assert_close(ops.gemm_chain(A, weight, D), want)
        torch.testing.assert_close(chainfuse.torch.gemm_chain(A, weight, D), want)


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
def test_tensors_without_strides_are_an_error_naming_them(layout: str) -> None:
    A, B, D = (torch.ones(8, 8) for _ in range(3))
    odd = {"sparse_coo": B.to_sparse(), "sparse_csr": B.to_sparse_csr(),
           "mkldnn": B.to_mkldnn()}[layout]  # fmt: skip
    with pytest.raises(TypeError, match="B: expected a dense"):
        ops.gemm_chain(A, odd, D)
    with pytest.raises(TypeError, match="k: expected a dense"):
        ops.attention(A[None], odd[None] if layout == "sparse_coo" else odd, D[None])
    x, w = torch.ones(1, 8, 8, 8), torch.ones(8, 8, 1, 1)
    oddx = {"sparse_coo": x.to_sparse(), "sparse_csr": x, "mkldnn": x.to_mkldnn()}[layout]
    if layout != "sparse_csr":
        with pytest.raises(TypeError, match="x: expected a dense"):
            ops.conv_chain(oddx, w, w)


def test_conv_stride_and_padding_take_numpy_integers() -> None:
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 3, 9, 9)).astype(np.float32)
    w1 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((5, 4, 3, 3)).astype(np.float32)
    want = ops.conv_chain(x, w1, w2, stride=(2, 1), padding=1)
    got = ops.conv_chain(x, w1, w2, stride=(np.int64(2), np.int32(1)), padding=np.int64(1))
    np.testing.assert_array_equal(got, want)
    torch.testing.assert_close(
        chainfuse.torch.conv_chain(torch.from_numpy(x), torch.from_numpy(w1),
                                   torch.from_numpy(w2), stride=np.int64(1)),
        torch.from_numpy(ops.conv_chain(x, w1, w2)),
    )  # fmt: skip
    with pytest.raises(ValueError, match="stride: expected two integers"):
        ops.conv_chain(x, w1, w2, stride=2.0)


def test_patch_sdpa_exited_out_of_order_restores_sdpa() -> None:
    import chainfuse.torch as cft

    original = F.scaled_dot_product_attention
    outer, inner = cft.patch_sdpa(), cft.patch_sdpa()
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    q = torch.randn(1, 2, 5, 8)
    F.scaled_dot_product_attention(q, q, q)
    assert inner.calls == 1  # (the inner patch still active)
    inner.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is original


# --- threads -----------------------------------------------------------------------------


def _in_threads(work: Any, n: int) -> list[Any]:
    """`work(i)` for i < n, each in its own thread, started together; results by i."""
    results: list[Any] = [None] * n
    start = threading.Barrier(n)

    def run(i: int) -> None:
        start.wait()
        try:
            results[i] = work(i)
        except BaseException as err:  # (re-raised below, in the test's thread)
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("between", [None, "softmax"])
def test_one_kernel_called_from_8_threads_at_once(between: str | None) -> None:
    """Each thread its own data, many calls each, through the kernel and through `ops` (its
    replay path): every result is its own thread's."""
    chain = chainfuse.gemm_chain(2, 37, 19, 24, 41, between)
    kernel = compile(chain)
    inputs = [reference.random_inputs(chain, seed=i) for i in range(8)]
    wants = [reference.run(chain, x)[chain.outputs[0].name] for x in inputs]

    def work(i: int) -> None:
        args = [inputs[i][t.name] for t in chain.inputs]
        for _ in range(20):
            reference.assert_close(kernel(*args), wants[i], chain)
            reference.assert_close(ops.gemm_chain(*args, between=between), wants[i], chain)

    _in_threads(work, 8)


def test_different_shapes_compiled_from_threads_into_one_empty_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six threads compile six chains (two of them the same) at once into an empty kernel
    cache: every kernel is right."""
    monkeypatch.setenv(chainfuse.config.ENV_CACHE_DIR, str(tmp_path))
    shapes = [(1, 9, 5, 7, 11), (2, 13, 8, 6, 17), (1, 9, 5, 7, 11), (3, 5, 3, 2, 4),
              (1, 33, 16, 16, 40), (2, 7, 6, 5, 3)]  # fmt: skip
    betweens = [None, "relu", None, "gelu", "softmax", "relu"]

    def work(i: int) -> None:
        chain = chainfuse.gemm_chain(*shapes[i], betweens[i])
        kernel = compile(chain)
        inputs = reference.random_inputs(chain, seed=i)
        got = kernel(*(inputs[t.name] for t in chain.inputs))
        reference.assert_close(got, reference.run(chain, inputs)[chain.outputs[0].name], chain)

    _in_threads(work, len(shapes))


# --- 64-bit offsets ----------------------------------------------------------------------


_FAR = 2**31 + 37  # elements: past what a 32-bit int (or a product of two) holds


def _huge_region(path: Any, nbytes: int) -> np.ndarray:
    """A sparse file of `nbytes` mapped as float32 (no memory or disk is taken until a page is
    touched: the views below touch a few); skips where it cannot be made."""
    mmap = pytest.importorskip("mmap")
    try:
        with open(path, "w+b") as f:
            f.truncate(nbytes)
            region = mmap.mmap(f.fileno(), nbytes)
    except (OSError, OverflowError, ValueError) as err:
        pytest.skip(f"cannot map {nbytes >> 30} GiB of address space: {err}")
    return np.frombuffer(region, np.float32)


def _far_view(region: np.ndarray, at: int, shape: tuple[int, ...], strides: tuple[int, ...],
              values: np.ndarray | None) -> np.ndarray:  # fmt: skip
    """A view of `region` from element `at` with element `strides`, set to `values`."""
    view = np.lib.stride_tricks.as_strided(region[at:], shape, tuple(4 * s for s in strides),
                                           writeable=True)  # fmt: skip
    if values is not None:
        view[...] = values
    return view


@pytest.mark.parametrize("between", [None, "softmax"])
def test_offsets_past_2_to_the_31_elements(between: str | None, tmp_path: Any) -> None:
    """Views over one sparse mapping whose batch strides (A, D, out) and row stride (B's k) are
    past 2^31 elements, so every offset the kernel forms for them is a 64-bit product: the
    result is the reference's (a 32-bit product would read or write elsewhere)."""
    b, M, K, L, N = 2, 5, 3, 9, 6
    region = _huge_region(tmp_path / "region", 4 * (8 * _FAR))
    rng = np.random.default_rng(12)
    a, bb, d = (rng.standard_normal(s).astype(np.float32) for s in ((b, M, K), (b, K, L),
                                                                   (b, L, N)))  # fmt: skip
    A = _far_view(region, 0, (b, M, K), (_FAR, K, 1), a)  # batch stride past 2^31
    B = _far_view(region, 2 * _FAR, (b, K, L), (L, _FAR, 1), bb)  # row stride past 2^31
    D = _far_view(region, 5 * _FAR + 64, (b, L, N), (_FAR, N, 1), d)
    out = _far_view(region, 6 * _FAR + 128, (b, M, N), (_FAR // 2 + 3, N, 1), None)
    chain = chainfuse.gemm_chain(b, M, N, K, L, between)
    compile(chain)(A, B, D, out=out)
    want = reference.run(chain, {"A": a, "B": bb, "D": d})[chain.outputs[0].name]
    reference.assert_close(np.array(out), want, chain)
    np.testing.assert_allclose(ops.gemm_chain(A, B, D, between=between), want, rtol=1e-4,
                               atol=1e-4)  # fmt: skip


def test_attention_offsets_past_2_to_the_31_elements(tmp_path: Any) -> None:
    """Attention with q's and v's head strides and the mask's query stride past 2^31."""
    region = _huge_region(tmp_path / "region", 4 * (8 * _FAR))
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (4, 7, 7))
    mask = rng.standard_normal((1, 1, 4, 7)).astype(np.float32)
    Q = _far_view(region, 0, q.shape, (0, _FAR, 8, 1), q)
    V = _far_view(region, 3 * _FAR, v.shape, (0, _FAR, 8, 1), v)
    Mk = _far_view(region, 6 * _FAR, mask.shape, (0, 0, _FAR // 3, 1), mask)
    got = ops.attention(Q, k, V, Mk)
    want = F.scaled_dot_product_attention(*(torch.from_numpy(x).double() for x in (q, k, v)),
                                          attn_mask=torch.from_numpy(mask).double())  # fmt: skip
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)


def _every_chain_kind() -> list[Any]:
    from chainfuse import builders

    kinds: list[Any] = [chainfuse.gemm_chain(2, 33, 17, 9, 40, b)
                        for b in (None, "relu", "gelu", "softmax")]  # fmt: skip
    kinds.append(chainfuse.attention_chain(2, 3, 17, 40, 16, 16, causal=True, mask="additive"))
    kinds.append(chainfuse.attention_chain(1, 2, 3, 40, 16, 16, mask="bool", dtype="float16"))
    kinds.append(chainfuse.gemm_chain(1, 9, 8, 7, 6, "relu", dtype="bfloat16"))
    kinds.append(builders.conv_chain_spec(1, 3, 9, 9, 4, 3, 3, 5, 3, 3, stride=(1, 1),
                                          padding=(1, 1), between="relu"))  # fmt: skip
    return kinds


def test_emitted_strides_and_sizes_are_64_bit() -> None:
    """In the generated C of every chain kind, no stride, leading dimension or size is an int
    (an offset formed from one could wrap past 2^31), and every int product is of tile-local
    counts (rows and columns of a block, bounded by the tiles)."""
    stride = re.compile(r"\b(?:unsigned\s+)?int\s+\*?\s*(s[A-Z]\w*|ld\w*|\w*stride\w*|[hwcx]s|"
                        r"[MNKL]|off\w*)\b")  # fmt: skip
    product = re.compile(r"\bint\s+(\w+)\s*=\s*([^;]*\*[^;]*);")
    local = {"n", "mc", "lc", "nc", "j", "s", "NR", "MR", "width", "i", "e", "ne", "r", "p",
             "st", "pad", "DIRECT_FAR_STRIPS", "pf", "CF_NW", "cf_pf_share", "CF_MAX", "full",
             "rest"}  # fmt: skip
    for chain in _every_chain_kind():
        source = compile(chain).source
        assert not stride.findall(source), (chain.name, stride.findall(source))
        for name, rhs in product.findall(source):
            if any(op in rhs for op in ("&&", "||", "!=", "==", "<=")):
                continue  # (a flag: a comparison's truth, not an offset)
            names = set(re.findall(r"\b[A-Za-z_]\w*\b", rhs))
            assert names <= local, (chain.name, name, rhs, names - local)
