"""bf16 conv -> [activation] -> conv chains on AMX tiles, run through the bit-exact emulation on every
host (``CHAINFUSE_AMX=emulate``): NCHW and channels-last, strides, padding, 1x1 and 3x3 and
other windows, tails of every tile (16 pixels, 32 channels of a reduction, 16 output channels),
biases and activations, NaN/inf; checked against the float64 reference with the one tolerance rule at
bf16's unit roundoff. Sizes stay small: the emulation is scalar C."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.builders import conv_out_size
from chainfuse.compiled import AmxConvKernel
from chainfuse.compiler import compile_conv
from chainfuse.kernels.amx import ENV_AMX, AmxPath, amx_status
from chainfuse.runtime import requested_num_threads, set_num_threads

torch = pytest.importorskip("torch")
F = torch.nn.functional


@pytest.fixture(autouse=True)
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AMX, "emulate")


#: (N, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between)
CASES = [
    (1, 3, 9, 11, 5, 3, 3, 7, 1, 1, (1, 1), (1, 0), "relu"),  # 3x3 -> 1x1, channels < a tile
    (2, 17, 13, 7, 33, 3, 3, 20, 3, 3, (2, 1), (1, 1), None),  # stride 2; K1 33: 3 tiles
    (1, 40, 6, 37, 16, 1, 1, 17, 3, 3, (1, 2), (0, 1), "relu"),  # 37 pixels: 32 + a tail of 5
    (1, 1, 5, 5, 1, 1, 1, 1, 1, 1, (1, 1), (0, 0), None),  # one channel everywhere
    (1, 33, 7, 7, 31, 2, 5, 13, 5, 2, (3, 2), (2, 1), "relu"),  # odd windows, stride 3
]


def _run(
    case: tuple[Any, ...], channels_last: bool, bias: bool = False, after: str | None = None,
    tiles: dict[str, int] | None = None, seed: int = 0, path: AmxPath = AmxPath.EMULATED,
) -> tuple[Any, np.ndarray, chainfuse.Chain]:  # fmt: skip
    N, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between = case
    chain = chainfuse.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=stride,
                                      padding=padding, between=between, dtype="bfloat16")  # fmt: skip
    kernel = compile_conv(chain, tiles=tiles, after=after)
    assert isinstance(kernel, AmxConvKernel) and kernel.amx_path is path
    x = reference.random_inputs(chain, seed=seed)
    rng = np.random.default_rng(seed)
    b = [torch.from_numpy(rng.standard_normal(k).astype(np.float32)).bfloat16() if bias else None
         for k in (K1, K2)]  # fmt: skip
    args = [torch.from_numpy(x[n]).bfloat16() for n in ("X", "W1", "W2")]
    if channels_last:
        args[0] = args[0].contiguous(memory_format=torch.channels_last)
    y = kernel(*args, *b)
    assert y.dtype == torch.bfloat16
    # the result follows x's memory order (tiny shapes can be both orders at once)
    if channels_last and not args[0].is_contiguous():
        assert y.is_contiguous(memory_format=torch.channels_last)
    elif not args[0].is_contiguous(memory_format=torch.channels_last):
        assert y.is_contiguous()
    bias_np = [None if t is None else t.float().numpy() for t in b]
    want = reference.run_conv_chain(chain, x, *bias_np, after)
    return y, want, chain


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_amx_conv_chain_matches_reference(case: tuple[Any, ...], channels_last: bool) -> None:
    y, want, chain = _run(case, channels_last, seed=case[1])
    reference.assert_close(y.float().numpy(), want, chain)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    C=st.sampled_from([1, 2, 31, 33]), H=st.sampled_from([1, 5, 8]), W=st.sampled_from([3, 17, 34]),
    K1=st.sampled_from([1, 15, 17, 32]), K2=st.sampled_from([1, 16, 19]),
    window=st.sampled_from([(1, 1, 1, 1), (3, 3, 1, 1), (1, 1, 3, 3), (3, 3, 3, 3), (2, 3, 3, 1)]),
    stride=st.sampled_from([(1, 1), (2, 1), (1, 2)]),
    between=st.sampled_from([None, "relu", "silu", "gelu", "gelu_tanh", "quick_gelu", "relu6",
                             "hardswish", "mish", "squared_relu"]),
    channels_last=st.booleans(),
)  # fmt: skip
def test_amx_conv_chain_of_drawn_sizes(
    C: int, H: int, W: int, K1: int, K2: int, window: tuple[int, int, int, int],
    stride: tuple[int, int], between: str | None, channels_last: bool,
) -> None:  # fmt: skip
    R1, S1, R2, S2 = window
    padding = (R1 // 2, R2 // 2)
    P1 = conv_out_size(H, R1, stride[0], padding[0])
    Q1 = conv_out_size(W, S1, stride[0], padding[0])
    assume(H + 2 * padding[0] >= R1 and W + 2 * padding[0] >= S1)
    assume(P1 + 2 * padding[1] >= R2 and Q1 + 2 * padding[1] >= S2)
    case = (2, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between)
    y, want, chain = _run(case, channels_last, bias=True, seed=C + W)
    reference.assert_close(y.float().numpy(), want, chain)


@pytest.mark.parametrize(
    ("between", "after"), [(None, None), (None, "relu"), ("silu", "silu"), ("gelu", "gelu_tanh"),
                           ("quick_gelu", None), ("mish", "hardswish"), ("relu6", "squared_relu")],
)  # fmt: skip
def test_amx_conv_chain_with_biases(between: str | None, after: str | None) -> None:
    y, want, chain = _run((*CASES[1][:-1], between), True, bias=True, after=after, seed=4)
    reference.assert_close(y.float().numpy(), want, chain)


@pytest.mark.parametrize("band", [1, 2, 5])
def test_amx_conv_bands_recompute_their_halo_on_threads(band: int) -> None:
    before = requested_num_threads()
    set_num_threads(2)
    try:
        y, want, chain = _run(CASES[1], False, tiles={"p2": band}, seed=band)
    finally:
        set_num_threads(before)
    reference.assert_close(y.float().numpy(), want, chain)


def test_amx_conv_numpy_operands() -> None:
    # numpy has no bf16: torch's bf16 tensors are the way in; a float32 array is refused clearly
    chain = chainfuse.conv_chain_spec(1, 4, 6, 6, 4, 3, 3, 4, 1, 1, padding=(1, 0),
                                      dtype="bfloat16")  # fmt: skip
    kernel = compile_conv(chain)
    x = np.zeros((1, 4, 6, 6), np.float32)
    w1, w2 = np.zeros((4, 4, 3, 3), np.float32), np.zeros((4, 4, 1, 1), np.float32)
    with pytest.raises(TypeError, match="x: expected dtype bfloat16"):
        kernel(x, w1, w2)


@pytest.mark.parametrize("fault", ["dropped tap", "one tile"])
def test_a_dropped_tap_or_tile_fails_the_check(fault: str) -> None:
    # the tolerance fails a kernel that loses one tap of the window or one 16x16 output tile
    case = (1, 8, 9, 20, 20, 3, 3, 18, 3, 3, (1, 1), (1, 1), "relu")
    N, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between = case
    chain = chainfuse.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=stride,
                                      padding=padding, between=between, dtype="bfloat16")  # fmt: skip
    x = reference.random_inputs(chain, seed=2)
    given = {n: a.copy() for n, a in x.items()}
    if fault == "dropped tap":
        given["W1"][:, :, 1, 2] = 0.0
    y = compile_conv(chain)(*(torch.from_numpy(given[n]).bfloat16() for n in ("X", "W1", "W2")))
    out = y.float().numpy()
    if fault == "one tile":
        out[0, :16, 4, :16] = 0.0
    else:  # (the kernel itself is right on what it was given)
        reference.assert_close(out, reference.run(chain, given)["Y2"], chain)
    with pytest.raises(AssertionError):
        reference.assert_close(out, reference.run(chain, x)["Y2"], chain)


@pytest.mark.parametrize("at", [("X", (0, 2, 4, 6)), ("W1", (1, 0, 0, 0)), ("W2", (2, 3, 2, 2))])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_amx_conv_nan_and_inf_propagate_as_pytorch(bad: float, at: tuple[str, Any]) -> None:
    # padded taps are computed with zeros: a NaN weight poisons every pixel, as PyTorch's
    # float32 convolution does (its bf16 one skips the padded taps on some hosts: oneDNN with
    # AVX512-BF16), so the reference convolves the bf16 values in float32, Z rounded to bf16
    case = (1, 5, 10, 12, 6, 3, 3, 4, 3, 3, (1, 1), (1, 1), "relu")
    N, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between = case
    chain = chainfuse.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=stride,
                                      padding=padding, between=between, dtype="bfloat16")  # fmt: skip
    x = reference.random_inputs(chain, seed=7)
    x[at[0]][at[1]] = bad
    args = [torch.from_numpy(x[n]).bfloat16() for n in ("X", "W1", "W2")]
    ours = compile_conv(chain)(*args).float().numpy()
    x32, w1, w2 = (a.float() for a in args)
    z = torch.relu(F.conv2d(x32, w1, padding=1)).bfloat16().float()
    theirs = F.conv2d(z, w2, padding=1).numpy()
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(ours), test(theirs)), test.__name__
    assert not np.isfinite(ours).all()


def test_amx_conv_says_what_it_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = chainfuse.conv_chain_spec(1, 4, 6, 6, 4, 3, 3, 4, 1, 1, dtype="bfloat16")
    kernel = compile_conv(chain)
    assert kernel.arithmetic.startswith("amx-bf16 (emulated):")
    assert kernel.arithmetic in kernel.source and "CF_TILE_DPBF16PS" in kernel.source
    f32 = chainfuse.conv_chain_spec(1, 4, 6, 6, 4, 3, 3, 4, 1, 1)
    assert compile_conv(f32).arithmetic.startswith("fp32-fma:")
    with pytest.raises(ValueError, match="halo"):
        compile_conv(chain, halo="keep")
    with pytest.raises(ValueError, match="tile of p2 only"):
        compile_conv(chain, tiles={"c": 8})
    wide = chainfuse.conv_chain_spec(1, 8192, 3, 8192, 8, 3, 3, 8, 1, 1, dtype="bfloat16")
    with pytest.raises(ValueError, match="one output row's padded input"):
        compile_conv(wide)
    monkeypatch.setenv(ENV_AMX, "off")
    with pytest.raises(TypeError, match=f"AMX tiles only.*{ENV_AMX}=off"):
        compile_conv(chain)


@pytest.mark.parametrize("channels_last", [False, True])
def test_ops_conv_chain_runs_bf16_tensors_on_the_amx_kernel(
    channels_last: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ops.conv_chain` with bf16 tensors: the AMX kernel (here emulated), the result checked
    against the float64 reference, called twice (the remembered call too); with the AMX kernels
    off, an error naming CHAINFUSE_AMX; mixed dtypes an error naming the arguments."""
    from chainfuse import ops
    from chainfuse.ops.calls import calls

    calls.clear()  # (kernels are remembered by sizes, not by CHAINFUSE_AMX)
    N, C, H, W, K1, R1, S1, K2, R2, S2, stride, padding, between = CASES[1]
    chain = chainfuse.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=stride,
                                      padding=padding, between=between, dtype="bfloat16")  # fmt: skip
    x = reference.random_inputs(chain, seed=5)
    args = [torch.from_numpy(x[n]).bfloat16() for n in ("X", "W1", "W2")]
    if channels_last:
        args[0] = args[0].contiguous(memory_format=torch.channels_last)
    want = reference.run_conv_chain(chain, x, None, None, None)
    for _ in range(2):
        y = ops.conv_chain(*args, stride=stride, padding=padding, between=between)
        assert y.dtype == torch.bfloat16
        reference.assert_close(y.float().numpy(), want, chain)
    with pytest.raises(TypeError, match="w2: expected dtype bfloat16"):
        ops.conv_chain(args[0], args[1], args[2].float(), stride=stride, padding=padding)
    calls.clear()
    monkeypatch.setenv(ENV_AMX, "off")
    with pytest.raises(TypeError, match=ENV_AMX):
        ops.conv_chain(*args, stride=stride, padding=padding, between=between)
    calls.clear()


def test_amx_conv_weights_packed_once_are_read_in_place_of_the_weights() -> None:
    """`ops.pack_conv_weights` of bf16 weights: the AMX kernel's tiles, the same bits as a call
    that packs them itself, for other image sizes and layouts too; the packed values are what
    is read (zeros packed give zeros); packing made for the other dtype is an error naming
    `packed`."""
    from chainfuse import ops

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 33, 13, 11, generator=g).bfloat16()
    w1 = (torch.randn(40, 33, 3, 3, generator=g) / 8).bfloat16()
    w2 = (torch.randn(17, 40, 1, 1, generator=g) / 6).bfloat16()
    b1, b2 = torch.randn(40, generator=g).bfloat16(), torch.randn(17, generator=g).bfloat16()
    args = {"padding": (1, 0), "between": "mish", "after": "hardswish"}
    packed = ops.pack_conv_weights(x, w1, w2, **args)
    assert packed.micro == "amx"
    for image in (
        x,
        torch.randn(1, 33, 29, 7).bfloat16().contiguous(memory_format=torch.channels_last),
    ):
        want = ops.conv_chain(image, w1, w2, b1, b2, **args)
        assert torch.equal(ops.conv_chain(image, w1, w2, b1, b2, **args, packed=packed), want)
    zeros = ops.pack_conv_weights(x, w1 * 0, w2 * 0, padding=(1, 0))
    assert not ops.conv_chain(x, w1, w2, padding=(1, 0), packed=zeros).any()
    with pytest.raises(ValueError, match="packed: weights packed for the bf16 AMX kernel"):
        ops.conv_chain(x.float(), w1.float(), w2.float(), padding=(1, 0), packed=packed)
    fp32 = ops.pack_conv_weights(x.float(), w1.float(), w2.float(), padding=(1, 0))
    with pytest.raises(ValueError, match="packed: weights packed for float32 kernels"):
        ops.conv_chain(x, w1, w2, padding=(1, 0), packed=fp32)


@pytest.mark.skipif(not amx_status()[0], reason=f"no AMX here: {amx_status()[1]}")
@pytest.mark.parametrize("channels_last", [False, True])
def test_amx_unit_matches_the_emulation_bit_for_bit_in_conv(
    channels_last: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    emulated, _, _ = _run(CASES[2], channels_last, bias=True, after="relu", seed=3)
    monkeypatch.setenv(ENV_AMX, "auto")
    real, _, _ = _run(CASES[2], channels_last, bias=True, after="relu", seed=3, path=AmxPath.REAL)
    assert torch.equal(real.view(torch.int16), emulated.view(torch.int16))
