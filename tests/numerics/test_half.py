"""bf16 and fp16 GEMM chains and attention: 16-bit in and out, fp32 arithmetic inside.

This CPU path (no AMX / AVX512-BF16 / AVX512-FP16 kernel registered) widens the inputs to fp32
while packing, runs the fp32 micro-kernel, keeps the intermediate in fp32 and rounds the output
once. Checked against the float64 reference with the one tolerance rule at the dtype's unit
roundoff (the inputs are exactly representable in it, so the oracle reads the very numbers the
kernel reads), and PyTorch's own result is held to the same rule as a second opinion on the
rule itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.compiler import compile
from tests.checks import check_against_reference

torch = pytest.importorskip("torch")

AWKWARD = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129]), st.integers(1, 150))
HALVES = ["bfloat16", "float16"]
SHORT = {"bfloat16": "bf16", "float16": "fp16"}


def _half(x: np.ndarray, dtype: str) -> object:
    # exact: random_inputs gives values of the dtype already (bf16 ones as float32 arrays)
    return torch.from_numpy(x).to(getattr(torch, dtype))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2), M=AWKWARD, N=AWKWARD, K=AWKWARD, L=AWKWARD,
    between=st.sampled_from([None, "relu", "gelu", "softmax"]),
    tiles=st.sampled_from([None, {"m": 16, "l": 6, "k": 7, "n": 6}]),
    dtype=st.sampled_from(HALVES),
)  # fmt: skip
def test_half_gemm_chain_matches_reference(
    b: int, M: int, N: int, K: int, L: int, between: str | None, tiles: dict[str, int] | None,
    dtype: str,
) -> None:  # fmt: skip
    chain = chainfuse.gemm_chain(b, M, N, K, L, between, dtype=dtype)
    out, _ = check_against_reference(compile(chain, tiles=tiles), chain, seed=M + 3 * L,
                                     softmax_term=True, convert=lambda a: _half(a, dtype))  # fmt: skip
    assert out.dtype == getattr(torch, dtype) and tuple(out.shape) == (b, M, N)


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q", [65, 3])  # 3: the few-query path (`_rows`)
@pytest.mark.parametrize("dtype", HALVES)
def test_half_attention_matches_reference_and_torch(
    mask: str | None, causal: bool, seq_q: int, dtype: str
) -> None:
    chain = chainfuse.attention_chain(2, 3, seq_q, 47, 40, 59, causal=causal, mask=mask,
                                      dtype=dtype)  # fmt: skip
    x = reference.random_inputs(chain, seed=4)
    out = compile(chain)(*[_half(x[t.name], dtype) if t.name != "mask" or mask == "additive"
                           else torch.from_numpy(x[t.name]) for t in chain.inputs])  # fmt: skip
    want = reference.run(chain, x)["O"]
    reference.assert_close(out.float().numpy(), want, chain, inputs=x)
    if causal and mask is not None:
        return  # SDPA takes one or the other
    q, k, v = (_half(x[n], dtype) for n in ("Q", "K", "V"))
    m = None if mask is None else (_half(x["mask"], dtype) if mask == "additive"
                                   else torch.from_numpy(x["mask"]))  # fmt: skip
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                              is_causal=causal)  # fmt: skip
    reference.assert_close(theirs.float().numpy(), want, chain, inputs=x)


@pytest.mark.parametrize(("dv", "tiles"), [(37, {"m": 16}), (20, {"m": 16, "n": 6})])
@pytest.mark.parametrize("dtype", HALVES)
def test_half_attention_packs_each_value_head_once_for_its_row_blocks(
    dv: int, tiles: dict[str, int], dtype: str
) -> None:
    # several row blocks per head: V widened and packed by the first, kept for the rest (in one
    # n block, or in four of 6 columns each), heads told apart by where their V starts
    chain = chainfuse.attention_chain(2, 3, 50, 41, 19, dv, dtype=dtype)
    x = reference.random_inputs(chain, seed=dv)
    kernel = compile(chain, tiles=tiles)
    assert kernel.spec.T_M < 50
    out = kernel(*[_half(x[t.name], dtype) for t in chain.inputs])
    reference.assert_close(out.float().numpy(), reference.run(chain, x)["O"], chain, inputs=x)


@pytest.mark.parametrize("dtype", HALVES)
def test_half_kernel_says_what_it_computes_in(dtype: str) -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8, "relu", dtype=dtype)
    kernel = compile(chain)
    assert {"bfloat16": "_bf16_", "float16": "_f16_"}[dtype] in kernel.spec.name
    assert "fp32 micro-kernel" in kernel.arithmetic and SHORT[dtype] in kernel.arithmetic
    assert kernel.arithmetic in kernel.source  # the header records the path taken
    assert "fp32 micro-kernel" in compile(chainfuse.gemm_chain(1, 8, 8, 8, 8)).arithmetic


@pytest.mark.parametrize("dtype", HALVES)
def test_half_kernel_rejects_float32_inputs(dtype: str) -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8, dtype=dtype)
    x = reference.random_inputs(chain)
    kernel = compile(chain)
    with pytest.raises(TypeError, match=f"A: expected dtype {dtype}"):
        kernel(*[torch.from_numpy(x[t.name].astype(np.float32)) for t in chain.inputs])


@pytest.mark.parametrize("dtype", HALVES)
def test_ops_and_torch_attention_take_half(dtype: str) -> None:
    import chainfuse.torch as cft

    half = getattr(torch, dtype)
    g = torch.Generator().manual_seed(2)
    A, B, D = (torch.randn(2, n, m, generator=g).to(half)
               for n, m in ((9, 5), (5, 11), (11, 3)))  # fmt: skip
    E = chainfuse.ops.gemm_chain(A, B, D, between="relu")
    assert E.dtype == half and tuple(E.shape) == (2, 9, 3)
    chain = chainfuse.gemm_chain(2, 9, 3, 5, 11, "relu", dtype=dtype)
    x = {"A": A.float().numpy(), "B": B.float().numpy(), "D": D.float().numpy()}
    reference.assert_close(E.float().numpy(), reference.run(chain, x)["E"], chain)

    q, k, v = (torch.randn(1, 2, 13, 8, generator=g).to(half) for _ in range(3))
    mask = torch.randn(13, 13, generator=g).to(half)
    ours = cft.attention(q, k, v, attn_mask=mask)
    assert ours.dtype == half
    chain = chainfuse.attention_chain(1, 2, 13, 13, 8, 8, mask="additive", mask_shape=(13, 13),
                                      dtype=dtype)  # fmt: skip
    x = {"Q": q.float().numpy(), "K": k.float().numpy(), "V": v.float().numpy(),
         "mask": mask.float().numpy()}  # fmt: skip
    reference.assert_close(ours.float().numpy(), reference.run(chain, x)["O"], chain, inputs=x)
    with pytest.raises(
        TypeError, match="q, k, v: expected all float32, all bfloat16 or all float16"
    ):
        cft.attention(q, k.float(), v)
    with pytest.raises(TypeError, match=f"attn_mask: expected dtype bool or torch.{dtype}"):
        cft.attention(q, k, v, attn_mask=mask.float())


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129, 211]), st.integers(1, 300)),
    sk=st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129, 257]), st.integers(1, 300)),
    dqk=st.sampled_from([1, 8, 40, 59, 64, 80, 111]), dv=st.sampled_from([1, 16, 37, 64, 96]),
    causal=st.booleans(), mask=st.sampled_from([None, "bool", "additive"]),
    magnitude=st.sampled_from([1.0, 1e2, 1e4]), dtype=st.sampled_from(HALVES),
)  # fmt: skip
def test_half_attention_of_drawn_shapes_matches_reference(
    sq: int, sk: int, dqk: int, dv: int, causal: bool, mask: str | None, magnitude: float,
    dtype: str,
) -> None:  # fmt: skip
    chain = chainfuse.attention_chain(1, 2, sq, sk, dqk, dv, causal=causal, mask=mask,
                                      mask_shape=(1, sq, sk) if mask else None, dtype=dtype)  # fmt: skip
    x = reference.random_inputs(chain, seed=sq * 7 + sk, scale=magnitude)
    out = compile(chain)(*[_half(x[t.name], dtype) if t.name != "mask" or mask == "additive"
                           else torch.from_numpy(x[t.name]) for t in chain.inputs])  # fmt: skip
    assert out.dtype == getattr(torch, dtype)
    assert torch.isfinite(out).all()
    reference.assert_close(out.float().numpy(), reference.run(chain, x)["O"], chain, inputs=x)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize(
    ("kind", "sizes"),
    [("attention", (1, 1031, 160, 300)), ("attention", (5, 300, 700, 9)),
     ("gemm", (3, 290, 700, 300)), ("gemm", (1, 7, 9, 1000))],
)  # fmt: skip
def test_half_row_path_widens_rows_longer_than_its_key_block(
    dtype: str, kind: str, sizes: tuple[int, int, int, int]
) -> None:
    # the row path (<= 8 rows of m) widens four rows of K, V, B or D at a time into one scratch
    # sized for the longest of them (K, N or ROWS_LB): every one of those longer than the rest
    if kind == "attention":
        sq, sk, dqk, dv = sizes
        chain = chainfuse.attention_chain(1, 2, sq, sk, dqk, dv, causal=sq > 1, dtype=dtype)
        name = "O"
    else:
        M, N, K, L = sizes
        chain = chainfuse.gemm_chain(2, M, N, K, L, "gelu", dtype=dtype)
        name = "E"
    x = reference.random_inputs(chain, seed=sum(sizes))
    out = compile(chain)(*[_half(x[t.name], dtype) for t in chain.inputs])
    reference.assert_close(out.float().numpy(), reference.run(chain, x)[name], chain, inputs=x)
