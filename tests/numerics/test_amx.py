"""bf16 GEMM chains on AMX tiles, run through the bit-exact emulation on every host
(``CHAINFUSE_AMX=emulate``): the very code an AMX host runs, checked against the float64
reference with the one tolerance rule at bf16's unit roundoff (the rule counts the intermediate's
rounding to bf16, one stored tensor per op). Sizes stay small: the emulation is scalar C. On an
AMX host the unit's results are compared with the emulation's bit for bit.

Softmax chains of O(1) scores are held to the rule without its input-dependent softmax part
(`softmax_term`): that part allows for scores rounded to bf16, which these kernels keep in fp32,
and at bf16 it is loose enough to pass a kernel that drops whole l blocks; large scores get it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.codegen.amx_chain import AMX_MAX_L, AMX_MAX_M, amx_workspace_bytes, emit_amx_chain
from chainfuse.compiled import ALONE_S
from chainfuse.compiler import AmxKernel, compile
from chainfuse.kernels.amx import ENV_AMX, AmxPath, amx_status
from chainfuse.runtime import CompileError, build, requested_num_threads, set_num_threads
from tests.checks import check_against_reference, huge_in_float64

torch = pytest.importorskip("torch")

BETWEEN = [None, "relu", "gelu", "softmax"]


@pytest.fixture(autouse=True)
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AMX, "emulate")


def _bf16(x: np.ndarray) -> Any:
    return torch.from_numpy(x).to(torch.bfloat16)  # exact: the values are bf16 already


def _amx(chain: chainfuse.Chain, tiles: dict[str, int] | None = None) -> AmxKernel:
    kernel = compile(chain, tiles=tiles)
    assert isinstance(kernel, AmxKernel) and kernel.amx_path is AmxPath.EMULATED
    return kernel


@pytest.mark.parametrize("between", BETWEEN)
@pytest.mark.parametrize(
    ("b", "M", "N", "K", "L", "tiles"),
    [
        (1, 1, 1, 1, 1, None),
        (2, 7, 17, 33, 65, None),  # tails of every tile: 16-row, 16-column, 32-k, 32-key
        (1, 65, 13, 64, 29, None),  # k whole 32s: A's rows read in place but the last block's
        (2, 48, 32, 64, 96, None),  # every row tile whole: A in place throughout
        (1, 100, 37, 41, 101, {"m": 32, "l": 32}),  # 4 row blocks x 4 l blocks
        (3, 17, 1, 31, 47, {"m": 20, "l": 40}),  # tiles rounded up to whole 32s
    ],
)  # fmt: skip
def test_amx_gemm_chain_matches_reference(
    between: str | None, b: int, M: int, N: int, K: int, L: int, tiles: dict[str, int] | None
) -> None:
    chain = chainfuse.gemm_chain(b, M, N, K, L, between, dtype="bfloat16")
    kernel = _amx(chain, tiles)
    out, _ = check_against_reference(kernel, chain, seed=M + L, convert=_bf16)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (b, M, N)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.sampled_from([1, 7, 16, 17, 31, 33, 47, 65]), N=st.sampled_from([1, 5, 16, 19, 33]),
    K=st.sampled_from([1, 2, 31, 32, 37, 64]), L=st.sampled_from([1, 3, 32, 43, 70]),
    between=st.sampled_from(BETWEEN), magnitude=st.sampled_from([1.0, 30.0]),
)  # fmt: skip
def test_amx_gemm_chain_of_drawn_sizes(
    M: int, N: int, K: int, L: int, between: str | None, magnitude: float
) -> None:
    chain = chainfuse.gemm_chain(2, M, N, K, L, between, dtype="bfloat16")
    check_against_reference(_amx(chain), chain, seed=K, scale=magnitude,
                            softmax_term=magnitude > 1, convert=_bf16)  # fmt: skip


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_amx_mlp_matches_reference(act: str | None) -> None:
    chain = chainfuse.mlp_chain(37, 48, 70, 24, act, dtype="bfloat16")
    check_against_reference(_amx(chain), chain, seed=5, convert=_bf16)


def test_amx_attention_without_mask_matches_reference() -> None:
    # Kᵀ stored [l][k]: packed into VNNI tiles from its rows; the softmax's scale applied
    chain = chainfuse.attention_chain(1, 2, 19, 45, 40, 24, dtype="bfloat16")
    check_against_reference(_amx(chain), chain, seed=2, convert=_bf16)


def test_a_reduction_too_long_for_whole_tiles_takes_the_fp32_path_and_says_why() -> None:
    # k runs whole in AMX tiles: past AMX_MAX_WORKSPACE the fp32 path (which tiles k) runs it
    chain = chainfuse.gemm_chain(1, 3, 2, 50_000, 5, "relu", dtype="bfloat16")
    kernel = compile(chain)
    assert not isinstance(kernel, AmxKernel)
    assert kernel.arithmetic.startswith("fp32-fma:") and "K = 50000" in kernel.arithmetic
    check_against_reference(kernel, chain, seed=1, convert=_bf16)


def test_the_workspace_bound_is_the_kernels_own() -> None:
    # amx_workspace_bytes (what the dispatch weighs) is the C's CF_AMX_REGIONS at the largest tiles
    chain = chainfuse.gemm_chain(1, AMX_MAX_M, 24, 40, AMX_MAX_L, "softmax", dtype="bfloat16")
    kernel = _amx(chain, {"m": AMX_MAX_M, "l": AMX_MAX_L})
    assert (kernel.spec.T_M, kernel.spec.T_L) == (AMX_MAX_M, AMX_MAX_L)
    assert 4 * kernel._per == amx_workspace_bytes(40, 24)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_only_bf16_chains_take_amx(dtype: str) -> None:
    chain = chainfuse.attention_chain(1, 1, 8, 8, 8, 8, causal=True, mask="bool", dtype=dtype)
    kernel = compile(chain)
    assert not isinstance(kernel, AmxKernel) and kernel.arithmetic.startswith("fp32-fma:")


@pytest.mark.parametrize("between", BETWEEN)
def test_amx_batch_dims_broadcast_and_strided_rows(between: str | None) -> None:
    g = torch.Generator().manual_seed(3)
    A = torch.randn(2, 3, 2 * 19, 21, generator=g).to(torch.bfloat16)[:, :, ::2]  # rows 2K apart
    B = torch.randn(21, 35, generator=g).to(torch.bfloat16) / 5  # one B, D for the batch
    D = torch.randn(35, 9, generator=g).to(torch.bfloat16)
    E = chainfuse.ops.gemm_chain(A, B, D, between=between)
    assert E.dtype == torch.bfloat16 and tuple(E.shape) == (2, 3, 19, 9)
    chain = chainfuse.gemm_chain(6, 19, 9, 21, 35, between, dtype="bfloat16")
    x = {"A": A.float().reshape(6, 19, 21).numpy(),
         "B": np.broadcast_to(B.float().numpy(), (6, 21, 35)),
         "D": np.broadcast_to(D.float().numpy(), (6, 35, 9))}  # fmt: skip
    want = reference.run(chain, x)["E"].reshape(2, 3, 19, 9)
    reference.assert_close(E.float().numpy(), want, chain)


@pytest.mark.parametrize("between", [None, "softmax"])
def test_amx_threads_claim_blocks_with_their_own_tiles(between: str | None) -> None:
    # each OpenMP thread configures its own tiles (the emulation's tile state is per thread)
    chain = chainfuse.gemm_chain(12, 96, 64, 64, 128, between, dtype="bfloat16")
    kernel = _amx(chain, {"m": 32, "l": 32})
    assert kernel.plan.predicted_time_s >= ALONE_S  # (not run on the calling thread alone)
    before = requested_num_threads()
    set_num_threads(3)
    try:
        check_against_reference(kernel, chain, seed=4, convert=_bf16)
    finally:
        set_num_threads(before)


@pytest.mark.parametrize("between", BETWEEN)
def test_amx_source_builds_for_the_unit(between: str | None) -> None:
    # the tile instructions' build compiles on any host whose compiler takes -mamx-tile (no run)
    chain = chainfuse.gemm_chain(2, 9, 9, 9, 9, between, dtype="bfloat16")
    spec = _amx(chain).spec
    source = emit_amx_chain(spec, f"{spec.name} for the unit", AmxPath.REAL)
    assert "-mamx-tile -mamx-bf16" in source
    try:
        build(source, spec.name, AmxPath.REAL.cflags)
    except CompileError as err:
        if "amx" in err.stderr and "unrecognized" in err.stderr:
            pytest.skip(f"the compiler has no AMX flags: {err.stderr.strip()[:200]}")
        raise


def _torch_unfused(A: Any, B: Any, D: Any, between: str | None) -> Any:
    C = torch.bmm(A, B)
    P = {None: C, "relu": torch.relu(C), "gelu": huge_in_float64(torch.nn.functional.gelu, C),
         "softmax": torch.softmax(C, -1)}[between]  # fmt: skip
    return torch.bmm(P, D)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the reference's inf - inf)
@pytest.mark.parametrize("between", BETWEEN)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_amx_nan_and_inf_propagate_as_pytorch(between: str | None, bad: float) -> None:
    chain = chainfuse.gemm_chain(1, 33, 17, 40, 37, between, dtype="bfloat16")
    x = reference.random_inputs(chain, seed=9)
    x["A"][0, 3, 5] = bad  # one row of C non-finite
    x["B"][0, 7, 20] = bad  # one column of C
    x["D"][0, 30, 2] = bad  # one column of E
    args = [_bf16(x[t.name]) for t in chain.inputs]
    ours = _amx(chain)(*args).float().numpy()
    theirs = _torch_unfused(*args, between).float().numpy()
    assert np.array_equal(np.isnan(ours), np.isnan(theirs))
    assert np.array_equal(np.isposinf(ours), np.isposinf(theirs))
    assert np.array_equal(np.isneginf(ours), np.isneginf(theirs))
    assert not np.isfinite(ours).all()
    reference.assert_close(ours, reference.run(chain, x)["E"], chain, inputs=x)


def test_amx_softmax_of_an_all_minus_inf_row_is_nan_as_torch_softmax() -> None:
    # gemm_chain's softmax is unsafe (torch.softmax's); attention's safe rows: test_amx_attention
    chain = chainfuse.gemm_chain(1, 20, 9, 8, 40, "softmax", dtype="bfloat16")
    x = reference.random_inputs(chain, seed=2)
    x["A"][0, 5] = 0.0
    x["A"][0, 5, 0] = float("-inf")  # row 5's scores: -inf (B's first row all positive)
    x["B"][0, 0] = np.abs(x["B"][0, 0]) + 0.5
    ours = _amx(chain)(*(_bf16(x[t.name]) for t in chain.inputs)).float().numpy()
    assert np.isnan(ours[0, 5]).all() and np.isfinite(np.delete(ours[0], 5, axis=0)).all()


def test_amx_kernel_says_what_it_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8, "relu", dtype="bfloat16")
    kernel = _amx(chain)
    assert kernel.arithmetic.startswith("amx-bf16 (emulated):")
    assert kernel.arithmetic in kernel.source and "CF_TILE_DPBF16PS" in kernel.source
    assert "-DCF_AMX_EMULATE" in kernel.source and "amx-bf16 (emulated)" in kernel.describe()
    monkeypatch.setenv(ENV_AMX, "off")
    assert "fp32 micro-kernel" in compile(chain).arithmetic


@pytest.mark.skipif(not amx_status()[0], reason=f"no AMX here: {amx_status()[1]}")
@pytest.mark.parametrize("between", BETWEEN)
def test_amx_unit_matches_the_emulation_bit_for_bit(
    between: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = chainfuse.gemm_chain(2, 70, 33, 100, 90, between, dtype="bfloat16")
    x = reference.random_inputs(chain, seed=11)
    args = [_bf16(x[t.name]) for t in chain.inputs]
    emulated = _amx(chain)(*args)
    monkeypatch.setenv(ENV_AMX, "auto")
    real = compile(chain)
    assert isinstance(real, AmxKernel) and real.amx_path is AmxPath.REAL
    assert torch.equal(real(*args).view(torch.int16), emulated.view(torch.int16))
