"""The GPU target's Triton kernels against the float64 reference, with the one tolerance rule.

Where a CUDA device is present these run the compiled kernels on it; everywhere else the same
tests run the same kernels on CPU tensors under Triton's interpreter (`CHAINFUSE_BACKEND=triton`).
Shapes are small and awkward (1, primes, tails of every block, more than one block of each loop)
because the interpreter runs each program in numpy: the file stays within about a minute.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chainfuse.runtime.triton import interpreter_ready, triton_available

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not triton_available():
    pytest.skip("triton is not installed (pip install 'chainfuse[gpu]')", allow_module_level=True)
if not CUDA and not interpreter_ready():  # (imports triton for its interpreter if not yet)
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)

from chainfuse import builders, ops, reference  # noqa: E402
from chainfuse.ops import gpu  # noqa: E402
from tests.checks import check_against_reference  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
AWKWARD = st.sampled_from([1, 2, 7, 16, 17, 31, 63, 65, 129])
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU tensors go to the Triton kernels (interpreted); CUDA tensors would anyway."""
    monkeypatch.setenv("CHAINFUSE_BACKEND", "triton")
    yield


def _convert(dtype: str) -> Callable[[np.ndarray], Any]:
    def convert(a: np.ndarray) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(a))
        return (t if t.dtype == torch.bool else t.to(TORCH[dtype])).to(DEVICE)

    return convert


def _on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args: fn(*args).cpu()


# (batch, M, N, K, L): ones, primes, tails of 16-blocks, more than one block of l and k
GEMM_SHAPES = [(1, 1, 1, 1, 1), (2, 17, 7, 19, 33), (1, 131, 5, 130, 67), (3, 2, 300, 3, 150)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("between", [None, "relu", "gelu", "softmax"])
def test_gemm_chain(between: str | None, dtype: str) -> None:
    _gemm_chain_shapes(between, dtype)


@pytest.mark.parametrize("between", ["gelu_tanh", "quick_gelu", "silu", "relu6", "hardswish",
                                     "mish", "squared_relu"])  # fmt: skip
def test_gemm_chain_other_activations(between: str) -> None:
    _gemm_chain_shapes(between, "float32")


def test_activation_list_is_the_c_kernels() -> None:
    from chainfuse.codegen.triton import Between
    from chainfuse.ir import ACTIVATION_NAMES

    assert [b.value for b in Between] == ["none", *ACTIVATION_NAMES, "softmax"]


def _gemm_chain_shapes(between: str | None, dtype: str) -> None:
    for i, shape in enumerate(GEMM_SHAPES[: 2 if dtype != "float32" else None]):
        chain = builders.gemm_chain(*shape, between=between, dtype=dtype)
        kernel = _on_host(lambda a, b, d: ops.gemm_chain(a, b, d, between=between))
        check_against_reference(kernel, chain, seed=i, convert=_convert(dtype),
                                softmax_term=between == "softmax")  # fmt: skip


def test_gemm_chain_broadcast_and_strides() -> None:
    """An MLP's x [batch, tokens, dim] with 2-D weights, a transposed B and out= in place."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 12, generator=g)
    w1 = torch.randn(20, 12, generator=g).T  # column-major view: strides (1, 12)
    w2 = torch.randn(20, 6, generator=g) / 5
    out = torch.empty(2, 9, 6)
    got = ops.gemm_chain(x.to(DEVICE), w1.to(DEVICE), w2.to(DEVICE), "relu", out=out.to(DEVICE))
    want = torch.relu(x.double() @ w1.double()) @ w2.double()
    chain = builders.gemm_chain(2, 9, 6, 12, 20, "relu")
    reference.assert_close(got.cpu().numpy(), want.numpy(), chain)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    M=AWKWARD,
    N=AWKWARD,
    K=AWKWARD,
    L=AWKWARD,
    between=st.sampled_from([None, "relu", "gelu", "softmax"]),
)
def test_gemm_chain_awkward_sizes(
    b: int, M: int, N: int, K: int, L: int, between: str | None
) -> None:
    chain = builders.gemm_chain(b, M, N, K, L, between=between)
    kernel = _on_host(lambda x, y, z: ops.gemm_chain(x, y, z, between=between))
    with pytest.MonkeyPatch.context() as mp:  # (hypothesis runs outside the fixture's scope)
        mp.setenv("CHAINFUSE_BACKEND", "triton")
        check_against_reference(kernel, chain, convert=_convert("float32"),
                                softmax_term=between == "softmax")  # fmt: skip


def test_zero_sizes() -> None:
    A, B, D = torch.randn(2, 3, 0), torch.randn(2, 0, 4), torch.randn(2, 4, 5)
    assert torch.equal(ops.gemm_chain(A, B, D, "softmax"), D.mean(-2, keepdim=True).expand(2, 3, 5))
    assert ops.gemm_chain(
        torch.randn(0, 3, 2), torch.randn(0, 2, 4), torch.randn(0, 4, 5)
    ).shape == (0, 3, 5)


# (batch, heads, seq_q, seq_k, d_qk, d_v), causal, mask, dtype: ones, primes, more than one block
# of keys, d_qk != d_v, head dims that are not powers of two
ATTENTION = [
    ((1, 1, 1, 1, 16, 16), False, None, "float32"),
    ((2, 3, 17, 29, 40, 24), True, None, "float32"),
    ((1, 2, 31, 67, 64, 64), False, "bool", "float32"),
    ((2, 1, 13, 7, 8, 5), True, "additive", "float32"),
    ((1, 1, 1, 37, 16, 16), False, "bool", "float16"),
    ((2, 3, 17, 29, 40, 24), True, None, "float16"),
    ((2, 1, 13, 7, 8, 5), True, "additive", "bfloat16"),
    ((1, 2, 5, 19, 24, 8), False, "bool", "bfloat16"),
]


@pytest.mark.parametrize(("shape", "causal", "mask", "dtype"), ATTENTION)
def test_attention(shape: tuple[int, ...], causal: bool, mask: str | None, dtype: str) -> None:
    b, _, sq, sk = shape[:4]
    mask_shape = None if mask is None else (sq, sk) if mask == "bool" else (b, 1, 1, sk)
    chain = builders.attention_chain(*shape, causal=causal, mask=mask, mask_shape=mask_shape,
                                     dtype=dtype)  # fmt: skip

    def kernel(q: Any, k: Any, v: Any, m: Any = None) -> Any:
        return ops.attention(q, k, v, attn_mask=m, is_causal=causal).cpu()

    check_against_reference(kernel, chain, convert=_convert(dtype), softmax_term=True)


@pytest.mark.parametrize(("shape", "causal", "mask", "dtype"),
                         [((2, 3, 17, 29, 40, 24), True, None, "float32"),
                          ((1, 2, 31, 67, 64, 64), False, "additive", "bfloat16")])  # fmt: skip
def test_attention_softcap(
    shape: tuple[int, ...], causal: bool, mask: str | None, dtype: str
) -> None:
    """Soft-capped scores (Gemma 2's), the cap small enough to bend most of them."""
    b, sk = shape[0], shape[3]
    chain = builders.attention_chain(*shape, causal=causal, mask=mask, dtype=dtype, softcap=0.5,
                                     mask_shape=None if mask is None else (b, 1, 1, sk))  # fmt: skip

    def kernel(q: Any, k: Any, v: Any, m: Any = None) -> Any:
        return ops.attention(q, k, v, attn_mask=m, is_causal=causal, softcap=0.5).cpu()

    check_against_reference(kernel, chain, convert=_convert(dtype), softmax_term=True, scale=3.0)


def _sdpa64(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """PyTorch's SDPA in float64 (math backend) on the values the kernel reads."""
    return torch.nn.functional.scaled_dot_product_attention(
        q.cpu().double(), k.cpu().double(), v.cpu().double(), **kwargs
    )


@pytest.mark.parametrize(
    ("sq", "sk", "sv", "gqa"),
    [
        ((5, 16), (7, 16), (7, 8), False),  # 2-D
        ((3, 5, 16), (3, 7, 16), (3, 7, 8), False),  # 3-D: [batch, seq, dim]
        ((4, 5, 16), (2, 7, 16), (2, 7, 8), True),  # 3-D with GQA: dim 0 is the heads
        ((2, 2, 3, 5, 16), (2, 1, 3, 7, 16), (2, 1, 3, 7, 8), False),  # 5-D, a broadcast dim
        ((1, 6, 5, 16), (1, 2, 7, 16), (1, 3, 7, 8), True),  # k and v heads grouped apart
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_attention_ranks(
    sq: tuple[int, ...], sk: tuple[int, ...], sv: tuple[int, ...], gqa: bool, masked: bool
) -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=g) for s in (sq, sk, sv))
    # a mask of q's batch dims over the keys (broadcast over the queries)
    mask = torch.rand((*sq[:-2], 1, sk[-2]), generator=g) > 0.3 if masked else None
    got = ops.attention(*(t.to(DEVICE) for t in (q, k, v)), enable_gqa=gqa,
                        attn_mask=None if mask is None else mask.to(DEVICE)).cpu()  # fmt: skip
    want = _sdpa64(q, k, v, enable_gqa=gqa, attn_mask=mask)
    assert got.shape == want.shape
    chain = builders.attention_chain(1, 1, sq[-2], sk[-2], sq[-1], sv[-1])
    reference.assert_close(got.numpy(), want.numpy(), chain)


def test_attention_gqa_broadcast_and_fully_masked_rows() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 11, 24, generator=g)
    k = torch.randn(1, 2, 19, 24, generator=g)  # batch 1 broadcast, 2 key heads for 4 q heads
    v = torch.randn(1, 2, 19, 12, generator=g)
    mask = torch.rand(11, 19, generator=g) > 0.5
    mask[3] = False  # a query with no keys: zeros (PyTorch: NaN)
    got = ops.attention(*(t.to(DEVICE) for t in (q, k, v)), attn_mask=mask.to(DEVICE),
                        enable_gqa=True).cpu()  # fmt: skip
    kk, vv = (t.expand(2, 2, 19, -1).repeat_interleave(2, dim=1).double() for t in (k, v))
    scores = (q.double() @ kk.transpose(-1, -2)) / np.sqrt(24)
    p = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    want = p @ vv
    chain = builders.attention_chain(2, 4, 11, 19, 24, 12, mask="bool", mask_shape=(11, 19))
    reference.assert_close(got.numpy(), want.numpy(), chain)
    assert torch.all(got[:, :, 3] == 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlp_bias_silu_gated(dtype: str) -> None:
    """`(silu(x @ w1 + b1) * (x @ w3)) @ w2 + b2` (SwiGLU) and gelu with biases, one kernel."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 20, generator=g)
    w1, w3 = (torch.randn(20, 37, generator=g) / 4 for _ in range(2))
    w2 = torch.randn(37, 9, generator=g) / 6
    b1, b2 = torch.randn(37, generator=g), torch.randn(9, generator=g)
    t = [a.to(TORCH[dtype]).to(DEVICE) for a in (x, w1, w2, b1, b2, w3)]
    x, w1, w2, b1, b2, w3 = (a.cpu().double() for a in t)  # the values the kernel reads
    chain = builders.mlp_chain(10, 20, 37, 9, "gelu", dtype)
    F = torch.nn.functional
    for act, gate in (("silu", t[5]), ("gelu", None), ("mish", t[5]), ("relu", t[5])):
        got = gpu.mlp(*t[:5], activation=act, gate=gate).cpu().double()
        h = x @ w1 + b1
        h = {"silu": F.silu, "gelu": F.gelu, "mish": F.mish, "relu": F.relu}[act](h)
        h = h * (x @ w3) if gate is not None else h
        reference.assert_close(got.numpy(), (h @ w2 + b2).numpy(), chain)


def test_empty_reductions() -> None:
    """K = 0 or L = 0: what the same arithmetic gives on zeros (biases and the gate included)."""
    x, w1, w3 = torch.randn(3, 0), torch.randn(0, 4), torch.randn(0, 4)
    w2, b1, b2 = torch.randn(4, 2), torch.randn(4), torch.randn(2)
    got = gpu.mlp(x, w1, w2, b1, b2, activation="silu", gate=w3)
    assert torch.equal(got, b2.expand(3, 2))
    got = gpu.mlp(x, w1, w2, b1, b2, activation="gelu")
    torch.testing.assert_close(got, (torch.nn.functional.gelu(b1) @ w2 + b2).expand(3, 2))
    empty = gpu.mlp(torch.randn(3, 5), torch.randn(5, 0), torch.randn(0, 2), activation="relu")
    assert torch.equal(empty, torch.zeros(3, 2))


def test_tf32_opt_in() -> None:
    chain = builders.gemm_chain(1, 20, 9, 33, 17, "relu")
    ins = reference.random_inputs(chain)
    got = gpu.gemm_chain(*(torch.from_numpy(ins[n]).to(DEVICE) for n in "ABD"), "relu", tf32=True)
    want = reference.run(chain, ins)["E"]
    rtol, _ = reference.tolerance(chain)
    # tf32 keeps 10 mantissa bits: fp16's rounding, not fp32's
    reference.assert_close(got.cpu().numpy(), want, chain, dtype=reference.DType.FLOAT16)
    assert rtol < 1e-4


def test_errors_name_the_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    A, B, D = torch.randn(2, 3, 4), torch.randn(2, 4, 5), torch.randn(2, 5, 6)
    with pytest.raises(ValueError, match="B: expected 4 rows"):
        ops.gemm_chain(A, torch.randn(2, 3, 5), D)
    with pytest.raises(TypeError, match="A: expected float32, float16 or bfloat16"):
        ops.gemm_chain(A.double(), B.double(), D.double())
    with pytest.raises(TypeError, match=r"B: expected torch\.float32"):
        ops.gemm_chain(A, B.half(), D)
    with pytest.raises(ValueError, match="between: expected None, 'relu'"):
        ops.gemm_chain(A, B, D, between="tanh")
    with pytest.raises(TypeError, match="out: expected"):
        ops.gemm_chain(A, B, D, out=torch.empty(2, 3, 6, dtype=torch.float16))
    with pytest.raises(ValueError, match="dropout_p"):
        ops.attention(A, A, A, dropout_p=0.1)
    monkeypatch.setattr(gpu, "triton_available", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"chainfuse\[gpu\]"):
        ops.gemm_chain(A, B, D)
    monkeypatch.setenv("CHAINFUSE_BACKEND", "cuda-please")
    with pytest.raises(ValueError, match="CHAINFUSE_BACKEND"):
        ops.gemm_chain(A, B, D)


def test_cpu_tensors_stay_on_the_c_kernels_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAINFUSE_BACKEND")
    assert not gpu.routed(torch.ones(1), torch.ones(1))
    assert not gpu.routed(np.ones(1), None)
    monkeypatch.setenv("CHAINFUSE_BACKEND", "triton")
    assert gpu.routed(torch.ones(1), torch.ones(1))


def test_generated_source_is_readable_and_deterministic() -> None:
    from chainfuse.codegen.triton import Between, Mask, TritonSpec, emit, kernel_name
    from chainfuse.ir import DType

    spec = TritonSpec(DType.FLOAT16, Between.SOFTMAX, Mask.BOOL, causal=True)
    source = emit(spec)
    assert source == emit(TritonSpec(DType.FLOAT16, Between.SOFTMAX, Mask.BOOL, causal=True))
    assert source.startswith(f'"""{kernel_name(spec)}: generated by chainfuse')
    assert "for l0 in range(0, l_end, BLOCK_L):" in source and "tl.exp2" in source
    compile(source, "<triton>", "exec")
