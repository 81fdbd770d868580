"""bf16 GEMM chains and attention: bf16 in and out, fp32 arithmetic inside.

This CPU path (no AMX / AVX512-BF16 kernel registered) widens bf16 to fp32 while packing, runs
the fp32 micro-kernel, keeps the intermediate in fp32 and rounds the output to bf16 once. Checked
against the float64 reference with the one tolerance rule at bf16's unit roundoff (the inputs
are exactly representable in bf16, so the oracle reads the very numbers the kernel reads), and
PyTorch's own bf16 result is held to the same rule as a second opinion on the rule itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.compiler import compile

torch = pytest.importorskip("torch")

AWKWARD = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129]), st.integers(1, 150))


def _bf16(x: np.ndarray) -> object:
    return torch.from_numpy(x).to(torch.bfloat16)  # exact: the values are bf16 already


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2), M=AWKWARD, N=AWKWARD, K=AWKWARD, L=AWKWARD,
    between=st.sampled_from([None, "relu", "gelu", "softmax"]),
    tiles=st.sampled_from([None, {"m": 16, "l": 6, "k": 7, "n": 6}]),
)  # fmt: skip
def test_bf16_gemm_chain_matches_reference(
    b: int, M: int, N: int, K: int, L: int, between: str | None, tiles: dict[str, int] | None
) -> None:
    chain = chainfuse.gemm_chain(b, M, N, K, L, between, dtype="bfloat16")
    x = reference.random_inputs(chain, seed=M + 3 * L)
    kernel = compile(chain, tiles=tiles)
    out = kernel(*[_bf16(x[t.name]) for t in chain.inputs])
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (b, M, N)
    reference.assert_close(out.float().numpy(), reference.run(chain, x)["E"], chain, inputs=x)


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_q", [65, 3])  # 3: the few-query path (`_rows`)
def test_bf16_attention_matches_reference_and_torch(
    mask: str | None, causal: bool, seq_q: int
) -> None:
    chain = chainfuse.attention_chain(2, 3, seq_q, 47, 40, 59, causal=causal, mask=mask,
                                      dtype="bfloat16")  # fmt: skip
    x = reference.random_inputs(chain, seed=4)
    out = compile(chain)(*[_bf16(x[t.name]) if t.name != "mask" or mask == "additive"
                           else torch.from_numpy(x[t.name]) for t in chain.inputs])  # fmt: skip
    want = reference.run(chain, x)["O"]
    reference.assert_close(out.float().numpy(), want, chain, inputs=x)
    if causal and mask is not None:
        return  # SDPA takes one or the other
    q, k, v = (_bf16(x[n]) for n in ("Q", "K", "V"))
    m = None if mask is None else (_bf16(x["mask"]) if mask == "additive"
                                   else torch.from_numpy(x["mask"]))  # fmt: skip
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                              is_causal=causal)  # fmt: skip
    reference.assert_close(theirs.float().numpy(), want, chain, inputs=x)


@pytest.mark.parametrize(("dv", "tiles"), [(37, {"m": 16}), (20, {"m": 16, "n": 6})])
def test_bf16_attention_packs_each_value_head_once_for_its_row_blocks(
    dv: int, tiles: dict[str, int]
) -> None:
    # several row blocks per head: V widened and packed by the first, kept for the rest (in one
    # n block, or in four of 6 columns each), heads told apart by where their V starts
    chain = chainfuse.attention_chain(2, 3, 50, 41, 19, dv, dtype="bfloat16")
    x = reference.random_inputs(chain, seed=dv)
    kernel = compile(chain, tiles=tiles)
    assert kernel.spec.T_M < 50
    out = kernel(*[_bf16(x[t.name]) for t in chain.inputs])
    reference.assert_close(out.float().numpy(), reference.run(chain, x)["O"], chain, inputs=x)


def test_bf16_kernel_says_what_it_computes_in() -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8, "relu", dtype="bfloat16")
    kernel = compile(chain)
    assert "bf16" in kernel.spec.name
    assert "fp32 micro-kernel" in kernel.arithmetic and "bf16" in kernel.arithmetic
    assert kernel.arithmetic in kernel.source  # the header records the path taken
    assert "fp32 micro-kernel" in compile(chainfuse.gemm_chain(1, 8, 8, 8, 8)).arithmetic


def test_bf16_kernel_rejects_float32_inputs() -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8, dtype="bfloat16")
    x = reference.random_inputs(chain)
    kernel = compile(chain)
    with pytest.raises(TypeError, match="A: expected dtype bfloat16"):
        kernel(*[torch.from_numpy(x[t.name]) for t in chain.inputs])


def test_ops_and_torch_attention_take_bf16() -> None:
    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(2)
    A, B, D = (torch.randn(2, n, m, generator=g).to(torch.bfloat16)
               for n, m in ((9, 5), (5, 11), (11, 3)))  # fmt: skip
    E = chainfuse.ops.gemm_chain(A, B, D, between="relu")
    assert E.dtype == torch.bfloat16 and tuple(E.shape) == (2, 9, 3)
    chain = chainfuse.gemm_chain(2, 9, 3, 5, 11, "relu", dtype="bfloat16")
    x = {"A": A.float().numpy(), "B": B.float().numpy(), "D": D.float().numpy()}
    reference.assert_close(E.float().numpy(), reference.run(chain, x)["E"], chain)

    q, k, v = (torch.randn(1, 2, 13, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.randn(13, 13, generator=g).to(torch.bfloat16)
    ours = cft.attention(q, k, v, attn_mask=mask)
    assert ours.dtype == torch.bfloat16
    chain = chainfuse.attention_chain(1, 2, 13, 13, 8, 8, mask="additive", mask_shape=(13, 13),
                                      dtype="bfloat16")  # fmt: skip
    x = {"Q": q.float().numpy(), "K": k.float().numpy(), "V": v.float().numpy(),
         "mask": mask.float().numpy()}  # fmt: skip
    reference.assert_close(ours.float().numpy(), reference.run(chain, x)["O"], chain, inputs=x)
    with pytest.raises(TypeError, match="q, k, v: expected all float32 or all bfloat16"):
        cft.attention(q, k.float(), v)
    with pytest.raises(TypeError, match=r"attn_mask: expected dtype bool or torch.bfloat16"):
        cft.attention(q, k, v, attn_mask=mask.float())
