"""What real models' MLPs need, on the AMX kernels (run through the bit-exact emulation on every
host, ``CHAINFUSE_AMX=emulate``): biases on either GEMM, every activation, nn.Linear's
`[out, in]` weights read as stored (B = W1.T, D = W2.T), the gated (SwiGLU) MLP, and the weights
packed once (`ops.pack_weights`), against the float64 reference with the one tolerance rule.

Each structure is one compiled object (a compile costs seconds); hypothesis draws sizes and
tiles through them (run-time arguments: no compile per draw)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import builders, ops
from chainfuse.codegen.amx_chain import AMX_MAX_L, AMX_MAX_M, amx_workspace_bytes
from chainfuse.compiler import AmxKernel, compile
from chainfuse.ir import ACTIVATION_NAMES
from chainfuse.kernels.amx import ENV_AMX, AmxPath
from chainfuse.runtime import requested_num_threads, set_num_threads
from tests.checks import check_against_reference, torch_activation

torch = pytest.importorskip("torch")
F = torch.nn.functional

AWKWARD = st.one_of(st.sampled_from([1, 7, 17, 31, 33, 63, 65, 129]), st.integers(1, 100))
TILES = st.sampled_from([None, {"m": 32, "l": 32}, {"m": 20, "l": 70}])

#: (between, B transposed, D transposed, bias1, bias2): every activation with both biases and
#: both weights as nn.Linear stores them; each layout and bias alone; softmaxes with biases
STRUCTURES = [
    (None, True, True, True, True),
    ("relu", True, True, True, True),
    ("gelu", True, True, True, True),
    ("gelu_tanh", True, True, True, True),
    ("quick_gelu", True, True, True, True),
    ("silu", True, True, True, True),
    ("relu6", True, True, True, True),
    ("hardswish", True, True, True, True),
    ("mish", True, True, True, True),
    ("squared_relu", True, True, True, True),
    ("gelu", False, True, False, True),
    ("silu", True, False, True, False),
    ("softmax", False, True, False, True),
    ("softmax", True, True, True, True),  # (bias1 before a softmax: an additive mask over l)
]

ACTS = {name: torch_activation(name) for name in (None, *ACTIVATION_NAMES, "softmax")}


@pytest.fixture(autouse=True)
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AMX, "emulate")


def _bf16(x: np.ndarray) -> Any:
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16)  # exact: bf16 values


def _amx(chain: chainfuse.Chain, tiles: dict[str, int] | None = None) -> AmxKernel:
    kernel = compile(chain, tiles=tiles)
    assert isinstance(kernel, AmxKernel) and kernel.amx_path is AmxPath.EMULATED, kernel.arithmetic
    return kernel


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    structure=st.sampled_from(STRUCTURES), b=st.integers(1, 2), M=AWKWARD, N=AWKWARD, K=AWKWARD,
    L=AWKWARD, tiles=TILES, seed=st.integers(0, 2**16),
)  # fmt: skip
def test_amx_model_features_match_the_reference(
    structure: tuple[Any, ...],
    b: int,
    M: int,
    N: int,
    K: int,
    L: int,
    tiles: dict[str, int] | None,
    seed: int,
) -> None:
    between, b_t, d_t, bias1, bias2 = structure
    chain = builders.gemm_chain(b, M, N, K, L, between, "bfloat16", b_transposed=b_t,
                                d_transposed=d_t, bias1=bias1, bias2=bias2)  # fmt: skip
    check_against_reference(_amx(chain, tiles), chain, seed=seed, convert=_bf16)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(M=AWKWARD, N=AWKWARD, K=AWKWARD, L=AWKWARD, tiles=TILES, seed=st.integers(0, 2**16))
@pytest.mark.parametrize(("act", "transposed"), [("silu", True), ("gelu_tanh", False)])
def test_amx_gated_mlp_matches_the_reference(
    act: str, transposed: bool, M: int, N: int, K: int, L: int, tiles: Any, seed: int
) -> None:
    chain = builders.gated_mlp_chain(1, M, N, K, L, act, "bfloat16", b_transposed=transposed,
                                     d_transposed=transposed)  # fmt: skip
    check_against_reference(_amx(chain, tiles), chain, seed=seed, convert=_bf16)


def test_the_gated_workspace_bound_is_the_kernels_own() -> None:
    # (the up projection's panel and scores too: what the dispatch weighs against the bound)
    chain = builders.gated_mlp_chain(1, AMX_MAX_M, 24, 40, AMX_MAX_L, "silu", "bfloat16")
    kernel = _amx(chain, {"m": AMX_MAX_M, "l": AMX_MAX_L})
    assert 4 * kernel._per == amx_workspace_bytes(40, 24, gated=True)
    assert amx_workspace_bytes(40, 24, gated=True) > amx_workspace_bytes(40, 24)


def _mlp(M: int, K: int, L: int, N: int, seed: int) -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, M, K, generator=g).bfloat16()
    w1 = (torch.randn(L, K, generator=g) / K**0.5).bfloat16()
    w2 = (torch.randn(N, L, generator=g) / L**0.5).bfloat16()
    b1, b2 = torch.randn(L, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
    return x, w1, w2, b1, b2


@pytest.mark.parametrize(
    ("M", "K", "L", "N", "act"),
    [(1, 1, 1, 1, "gelu"), (7, 33, 65, 17, "gelu_tanh"), (65, 64, 96, 32, None),
     (40, 17, AMX_MAX_L + 37, 19, "silu")],  # (l blocks past the first: slices of the packing)
)  # fmt: skip
def test_weights_packed_once_give_the_same_bits(
    M: int, K: int, L: int, N: int, act: str | None
) -> None:
    """A call reading the packed weights computes what one packing them per row block does,
    bit for bit; its replay (the same call again) too; and the packing is what it reads: a
    packing of other weights gives those weights' result."""
    x, w1, w2, b1, b2 = _mlp(M, K, L, N, seed=M + L)
    packed = ops.pack_weights(w1.T, w2.T)
    plain = ops.gemm_chain(x, w1.T, w2.T, act, bias1=b1, bias2=b2)
    for _ in range(2):
        got = ops.gemm_chain(x, w1.T, w2.T, act, bias1=b1, bias2=b2, packed=packed)
        assert torch.equal(got, plain)
    want = F.linear(ACTS[act](F.linear(x.double(), w1.double(), b1.double())), w2.double(),
                    b2.double())  # fmt: skip
    chain = builders.gemm_chain(1, 2 * M, N, K, L, act, "bfloat16", b_transposed=True,
                                d_transposed=True, bias1=True, bias2=True)  # fmt: skip
    chainfuse.reference.assert_close(got.double().numpy(), want.numpy(), chain)
    other = (torch.randn(L, K) / K**0.5).bfloat16()
    read = ops.gemm_chain(x, w1.T, w2.T, act, bias1=b1, bias2=b2,
                          packed=ops.pack_weights(other.T, w2.T))  # fmt: skip
    assert torch.equal(read, ops.gemm_chain(x, other.T, w2.T, act, bias1=b1, bias2=b2))


def test_threads_share_one_packing() -> None:
    """Row blocks on three threads read the one packing: the result of one thread packing per
    l block, bit for bit."""
    x, w1, w2, b1, b2 = _mlp(200, 17, AMX_MAX_L + 37, 19, seed=8)  # 400 rows: several blocks
    before = requested_num_threads()
    try:
        set_num_threads(1)
        want = ops.gemm_chain(x, w1.T, w2.T, "gelu", bias1=b1, bias2=b2)
        set_num_threads(3)
        packed = ops.pack_weights(w1.T, w2.T)
        got = ops.gemm_chain(x, w1.T, w2.T, "gelu", bias1=b1, bias2=b2, packed=packed)
    finally:
        set_num_threads(before)
    assert torch.equal(got, want)


def test_gated_weights_packed_once_give_the_same_bits() -> None:
    x, w1, w2, _, _ = _mlp(37, 40, 70, 24, seed=3)
    w3 = (torch.randn(70, 40) / 40**0.5).bfloat16()
    packed = ops.pack_weights(w1.T, w2.T, w3.T)
    plain = ops.gated_mlp(x, w1.T, w3.T, w2.T, "silu")
    assert torch.equal(ops.gated_mlp(x, w1.T, w3.T, w2.T, "silu", packed=packed), plain)
    swapped = ops.pack_weights(w1.T, w2.T, w1.T)  # (the up projection's weights read from it)
    got = ops.gated_mlp(x, w1.T, w3.T, w2.T, "silu", packed=swapped)
    assert torch.equal(got, ops.gated_mlp(x, w1.T, w1.T, w2.T, "silu"))


def test_numpy_weights_pack_too() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, w1, w2, _, _ = _mlp(9, 20, 40, 12, seed=4)

    def array(t: Any) -> np.ndarray:
        return t.float().numpy().astype(ml_dtypes.bfloat16)

    A, B, D = array(x[0]), array(w1).T, array(w2).T
    packed = ops.pack_weights(B, D)
    assert packed.dtype == np.uint16
    got = ops.gemm_chain(A, B, D, "relu", packed=packed)
    assert np.array_equal(got.view(np.uint16), ops.gemm_chain(A, B, D, "relu").view(np.uint16))


def test_the_fp32_path_reads_the_weights_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the AMX kernels a packing is not read: the result is the weights' own."""
    monkeypatch.setenv(ENV_AMX, "off")
    x, w1, w2, _, _ = _mlp(9, 20, 40, 12, seed=5)
    other = ops.pack_weights(torch.zeros_like(w1).T, w2.T)
    got = ops.gemm_chain(x, w1.T, w2.T, "gelu", packed=other)
    assert torch.equal(got, ops.gemm_chain(x, w1.T, w2.T, "gelu"))


def test_packings_that_do_not_fit_the_call_are_errors() -> None:
    x, w1, w2, _, _ = _mlp(9, 20, 40, 12, seed=6)
    packed = ops.pack_weights(w1.T, w2.T)
    with pytest.raises(ValueError, match=r"packed: holds a two-GEMM chain's weights of K, L, N"):
        ops.gemm_chain(x[..., :10], w1[:, :10].T, w2.T, packed=packed)
    with pytest.raises(ValueError, match=r"packed: holds a two-GEMM chain's.*gated MLP's"):
        ops.gated_mlp(x, w1.T, w1.T, w2.T, packed=packed)
    with pytest.raises(ValueError, match=r"packed: not made by chainfuse\.ops\.pack_weights"):
        ops.gemm_chain(x, w1.T, w2.T, packed=torch.zeros(packed.numel(), dtype=torch.int16))
    with pytest.raises(TypeError, match="packed: expected pack_weights' 1-D int16 tensor"):
        ops.gemm_chain(x, w1.T, w2.T, packed=packed.float())
    with pytest.raises(TypeError, match="packed: expected pack_weights' result"):
        ops.gemm_chain(x, w1.T, w2.T, packed=[1, 2])
    with pytest.raises(ValueError, match=r"packed: B differs per batch"):
        ops.gemm_chain(x, torch.stack([w1.T, w1.T]), torch.stack([w2.T, w2.T]), packed=packed)
    with pytest.raises(ValueError, match=r"packed: a packing of bf16 weights.*torch\.float32"):
        ops.gemm_chain(x.float(), w1.T.float(), w2.T.float(), packed=packed)
    with pytest.raises(TypeError, match="B: expected bfloat16"):
        ops.pack_weights(w1.T.float(), w2.T.float())
    with pytest.raises(ValueError, match=r"D: expected 20 rows \(B's L\)"):
        ops.pack_weights(w1.T[:, :20], w2.T)
    with pytest.raises(ValueError, match="B: expected a 2-D weight"):
        ops.pack_weights(w1.T[None], w2.T)


def test_a_change_of_the_amx_setting_takes_effect_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ops' caches (kernels and replays) are keyed by `CHAINFUSE_AMX`: a call after it
    changes runs the kernel the new setting chooses, not the one an earlier call compiled."""
    x, w1, w2, b1, b2 = _mlp(9, 20, 40, 12, seed=7)
    ops.calls.clear()
    paths = []
    for mode in ("off", "emulate", "off", "emulate"):
        monkeypatch.setenv(ENV_AMX, mode)
        ops.gemm_chain(x, w1.T, w2.T, "gelu", bias1=b1, bias2=b2)
        ops.gemm_chain(x, w1.T, w2.T, "gelu", bias1=b1, bias2=b2)  # (its replay)
        (hit,) = [r for key, r in ops.calls.replays.items() if key[3] == mode]
        paths.append(hit.kernel.arithmetic.split(":")[0])
    assert paths == ["fp32-fma", AmxPath.EMULATED.value] * 2
    assert ops.calls.info()["gemm_kernels"].size == 2
