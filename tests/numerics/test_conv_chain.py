"""Fused conv -> [activation] -> conv kernels against the float64 reference.

Sizes, strides, paddings and tiles are run-time arguments of a compiled conv kernel; what is
compiled in is the micro-kernel, the two activations and the halo policy. So the hypothesis tests, which
draw hundreds of shapes, go through a handful of compiled objects (each draw still plans, as a
user's call would).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import ops, reference
from chainfuse.bench import workloads
from chainfuse.builders import conv_out_size
from chainfuse.codegen.conv import Halo, match_conv_chain
from chainfuse.compiler import compile_conv
from chainfuse.ir import Pointwise

KINDS = ("numpy", "torch_nchw", "torch_channels_last")


def _as(kind: str, a: np.ndarray[Any, Any]) -> Any:
    """`a` (NCHW numpy) as the given kind of input; 1-D arrays stay plain for torch kinds."""
    if kind == "numpy":
        return a
    t = torch.from_numpy(np.ascontiguousarray(a))
    if kind == "torch_channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t


def _numpy(y: Any) -> np.ndarray[Any, Any]:
    return y.numpy() if isinstance(y, torch.Tensor) else np.asarray(y)


def _check_ops(
    chain: chainfuse.Chain,
    stride: tuple[int, int],
    padding: Any,
    between: str | None,
    kind: str,
    bias: bool = False,
    after: str | None = None,
    seed: int = 0,
) -> None:
    inputs = reference.random_inputs(chain, seed=seed)
    rng = np.random.default_rng(seed)
    K1, K2 = inputs["W1"].shape[0], inputs["W2"].shape[0]
    b1 = rng.standard_normal(K1).astype(np.float32) if bias else None
    b2 = rng.standard_normal(K2).astype(np.float32) if bias else None
    args = [_as(kind, inputs[name]) for name in ("X", "W1", "W2")]
    biases = [None if b is None else _as(kind, b) for b in (b1, b2)]
    groups = (1, K1) if match_conv_chain(chain).depthwise else (1, 1)
    y = ops.conv_chain(*args, *biases, stride=stride, padding=padding, between=between,
                       after=after, groups=groups)  # fmt: skip
    assert type(y) is type(args[0])
    # the result follows x's memory order (tiny shapes can be both orders at once)
    if kind == "torch_channels_last" and not args[0].is_contiguous():
        assert y.is_contiguous(memory_format=torch.channels_last)
    elif kind == "torch_nchw" and not args[0].is_contiguous(memory_format=torch.channels_last):
        assert y.is_contiguous()
    want = reference.run_conv_chain(chain, inputs, b1, b2, after)
    reference.assert_close(_numpy(y), want, chain)


# -- the paper's eight chains ---------------------------------------------------------------------


@pytest.mark.parametrize("between", [None, "relu"])
@pytest.mark.parametrize("name", [w.name for w in workloads.CONV])
def test_paper_chains(name: str, between: str | None) -> None:
    w = workloads.find(name)
    assert isinstance(w, workloads.ConvWorkload)
    chain = w.chain(between)
    _check_ops(chain, (w.stride1, w.stride2), (w.R1 // 2, w.R2 // 2), between,
               "torch_channels_last")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["numpy", "torch_nchw"])
@pytest.mark.parametrize("name", [w.name for w in workloads.CONV])
def test_paper_chains_nchw_with_bias(name: str, kind: str) -> None:
    w = workloads.find(name)
    assert isinstance(w, workloads.ConvWorkload)
    chain = w.chain("relu")
    _check_ops(chain, (w.stride1, w.stride2), (w.R1 // 2, w.R2 // 2), "relu", kind, bias=True,
               after="relu")  # fmt: skip


# -- drawn chains ---------------------------------------------------------------------------------

SPATIAL = st.one_of(st.sampled_from([1, 2, 7, 13, 17, 31, 53, 59, 60]), st.integers(1, 60))
CHANNELS = st.one_of(st.sampled_from([1, 3, 7, 16, 17, 63, 65, 127, 130]), st.integers(1, 130))
KERNEL = st.sampled_from([1, 3, 5])
#: the activations a conv chain takes (relu drawn most: ResNet's)
ACTS = [
    "relu",
    "silu",
    "gelu",
    "gelu_tanh",
    "quick_gelu",
    "relu6",
    "hardswish",
    "mish",
    "squared_relu",
]
BETWEEN = [None, "relu", *ACTS]
STRIDE = st.integers(1, 4)
PAD = st.integers(0, 2)
MAX_FLOP = 1.5e8  # keeps one draw (kernel + float64 reference) well under a second


@st.composite
def conv_chains(draw: st.DrawFn) -> tuple[chainfuse.Chain, tuple[int, int], Any]:
    N = draw(st.sampled_from([1, 1, 1, 2, 3]))
    C, K1, K2 = draw(CHANNELS), draw(CHANNELS), draw(CHANNELS)
    depthwise = draw(st.sampled_from([False, False, False, True]))  # (MobileNet's expansion)
    K2 = K1 if depthwise else K2
    H, W = draw(SPATIAL), draw(SPATIAL)
    R1, R2 = draw(KERNEL), draw(KERNEL)
    S1 = draw(st.sampled_from([R1, R1, 1, 3, 5]))
    S2 = draw(st.sampled_from([R2, R2, 1, 3, 5]))
    st1, st2, pad1, pad2 = draw(STRIDE), draw(STRIDE), draw(PAD), draw(PAD)
    # (TF's "SAME" at stride 2: one more zero after than before)
    after = pad2 + draw(st.sampled_from([0, 0, 0, 1, -1] if pad2 else [0, 0, 0, 1]))
    assume(H + 2 * pad1 >= R1 and W + 2 * pad1 >= S1)
    P1, Q1 = conv_out_size(H, R1, st1, pad1), conv_out_size(W, S1, st1, pad1)
    assume(P1 + pad2 + after >= R2 and Q1 + pad2 + after >= S2)
    P2, Q2 = conv_out_size(P1, R2, st2, pad2, after), conv_out_size(Q1, S2, st2, pad2, after)
    flop = 2 * N * (P1 * Q1 * K1 * C * R1 * S1 + P2 * Q2 * K2 * (1 if depthwise else K1) * R2 * S2)
    assume(flop <= MAX_FLOP)
    between = draw(st.sampled_from(BETWEEN))
    try:
        chain = chainfuse.conv_chain_spec(N, C, H, W, K1, R1, S1, K2, R2, S2, stride=(st1, st2),
                                          padding=(pad1, pad2), between=between,
                                          depthwise=depthwise, pad_after=after)  # fmt: skip
    except ValueError as err:  # the IR refuses a conv whose windows see only padding along a dim
        assert "never hits" in str(err)
        assume(False)
        raise
    return chain, (st1, st2), (pad1, pad2) if after == pad2 else (pad1, (pad2, after))


def _ops_test(examples: int):  # type: ignore[no-untyped-def]
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(
        drawn=conv_chains(),
        kind=st.sampled_from(KINDS),
        bias=st.booleans(),
        after=st.sampled_from([None, None, *ACTS]),
        seed=st.integers(0, 3),
    )
    def check(
        drawn: tuple[chainfuse.Chain, tuple[int, int], Any],
        kind: str,
        bias: bool,
        after: str | None,
        seed: int,
    ) -> None:
        chain, stride, padding = drawn
        mid = chain.ops[1]
        between = mid.fn.value if isinstance(mid, Pointwise) else None
        _check_ops(chain, stride, padding, between, kind, bias, after, seed)

    return check


test_drawn_chains_through_ops = _ops_test(45)
test_drawn_chains_through_ops_many = pytest.mark.slow(_ops_test(400))


def _tiles_test(examples: int):  # type: ignore[no-untyped-def]
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(
        drawn=conv_chains(),
        halo=st.sampled_from(["keep", "recompute"]),
        band=st.integers(1, 9),
        c_block=st.sampled_from([1, 5, 8, 16, 200]),
        k1_block=st.sampled_from([1, 7, 8, 64, 200]),
        kind=st.sampled_from(KINDS),
        threads=st.sampled_from([1, 1, 2, 3]),
    )
    def check(
        drawn: tuple[chainfuse.Chain, tuple[int, int], Any],
        halo: str,
        band: int,
        c_block: int,
        k1_block: int,
        kind: str,
        threads: int,
    ) -> None:
        """Every halo policy and tile (bands of 1..9 rows, channel blocks with tails) is right,
        on 1 to 3 threads (each with its own range of bands, row buffers and halo start)."""
        chain = drawn[0]
        tiles = {"p2": band, "c": c_block, "k1": k1_block}
        kernel = compile_conv(chain, halo=halo, tiles=tiles, threads=threads)
        assert kernel.halo is Halo(halo)
        inputs = reference.random_inputs(chain)
        chainfuse.set_num_threads(threads)
        try:
            y = kernel(*[_as(kind, inputs[n]) for n in ("X", "W1", "W2")])
        finally:
            chainfuse.set_num_threads(None)
        reference.assert_close(_numpy(y), reference.run(chain, inputs)["Y2"], chain)

    return check


test_drawn_chains_forced_tiles_and_halo = _tiles_test(30)
test_drawn_chains_forced_tiles_and_halo_many = pytest.mark.slow(_tiles_test(300))


# -- structure: one kernel, shared objects, visible halo policy ----------------------------------


def test_fused_chain_is_one_kernel_call() -> None:
    """One call of one compiled function, whose workspace cannot hold the intermediate."""
    w = workloads.find("resnet50-1x1-3x3")
    assert isinstance(w, workloads.ConvWorkload)
    chain = w.chain("relu")
    kernel = compile_conv(chain)
    calls = []
    fn = kernel._fn

    def counted(*args: Any) -> None:
        calls.append(args)
        fn(*args)

    kernel._fn = counted
    inputs = reference.random_inputs(chain)
    y = kernel(inputs["X"], inputs["W1"], inputs["W2"])
    assert len(calls) == 1
    reference.assert_close(y, reference.run(chain, inputs)["Y2"], chain)
    exported = [line for line in kernel.source.splitlines() if line.startswith(("void ", "long "))]
    assert [line.split("(")[0] for line in exported] == [
        f"long {kernel.name}_workspace",
        f"void {kernel.name}_pack",  # (the weights packed once, for a caller that keeps them)
        f"void {kernel.name}",
    ]
    intermediate = chain.tensor("Y1").size
    # a thread's workspace: a band of rows of Y1 (as many as the plan's L2 tile takes: 8 of 56
    # with a 512 KiB L2, 28 with 2 MiB) and packed edge slivers, never all of Y1
    assert kernel._per < intermediate


def test_shapes_share_one_compiled_object() -> None:
    # K1 = 64 for both: `select` ranks micro-kernels by how little of their blocks the output
    # channels leave idle, so other channel counts may choose another micro-kernel (another
    # object); a multiple of every kernel's nr gives the same choice for any pixel count
    a = chainfuse.conv_chain_spec(1, 5, 9, 11, 64, 3, 3, 6, 1, 1, stride=(1, 1), padding=(1, 0),
                                  between="relu")  # fmt: skip
    b = chainfuse.conv_chain_spec(2, 17, 30, 8, 64, 5, 5, 9, 3, 3, stride=(2, 3), padding=(2, 1),
                                  between="relu")  # fmt: skip
    ka = compile_conv(a, halo="keep")
    kb = compile_conv(b, halo="keep")
    assert ka.path == kb.path
    assert ka.tiles != kb.tiles or ka.shape != kb.shape


def test_halo_policy_is_recorded() -> None:
    chain = chainfuse.conv_chain_spec(1, 8, 40, 40, 8, 1, 1, 8, 3, 3, stride=(1, 1),
                                      padding=(0, 1))  # fmt: skip
    kernel = compile_conv(chain)
    assert kernel.halo in (Halo.KEEP, Halo.RECOMPUTE)
    assert f"halo: {kernel.halo.value}" in kernel.source
    assert "conv1 rows" in kernel.halo_reason
    forced = compile_conv(chain, halo="recompute")
    assert forced.halo is Halo.RECOMPUTE and "halo: recompute" in forced.source
    assert "#define HALO_KEEP 0" in forced.source


def test_compile_dispatches_conv_chains() -> None:
    chain = chainfuse.conv_chain_spec(1, 3, 8, 8, 4, 3, 3, 5, 1, 1, padding=(1, 0))
    kernel: Any = chainfuse.compile(chain)
    assert type(kernel).__name__ == "ConvKernel"
    inputs = reference.random_inputs(chain)
    reference.assert_close(kernel(inputs["X"], inputs["W1"], inputs["W2"]),
                           reference.run(chain, inputs)["Y2"], chain)  # fmt: skip


def test_out_argument_and_output_format() -> None:
    chain = chainfuse.conv_chain_spec(2, 6, 10, 9, 8, 3, 3, 5, 3, 3, stride=(1, 2),
                                      padding=(1, 1), between="relu")  # fmt: skip
    inputs = reference.random_inputs(chain)
    want = reference.run(chain, inputs)["Y2"]
    x = torch.from_numpy(inputs["X"]).contiguous(memory_format=torch.channels_last)
    w1, w2 = torch.from_numpy(inputs["W1"]), torch.from_numpy(inputs["W2"])
    out = torch.empty(want.shape, dtype=torch.float32)  # NCHW out from a channels-last input
    y = ops.conv_chain(x, w1, w2, stride=(1, 2), padding=(1, 1), between="relu", out=out)
    assert y is out
    reference.assert_close(out.numpy(), want, chain)
    z = ops.conv_chain(inputs["X"], inputs["W1"], inputs["W2"], stride=(1, 2), padding=1,
                       between="relu")  # fmt: skip
    assert isinstance(z, np.ndarray) and z.flags.c_contiguous
    reference.assert_close(z, want, chain)


def test_weights_change_between_calls() -> None:
    """Weights are packed on every call (no panel cache): new values in the same arrays, and
    new arrays at the same sizes, give new results; the compiled kernel is reused by sizes."""
    chain = chainfuse.conv_chain_spec(1, 5, 9, 8, 7, 3, 3, 6, 1, 1, stride=(1, 1),
                                      padding=(1, 0), between="relu")  # fmt: skip
    inputs = reference.random_inputs(chain, seed=3)
    x, w1, w2 = inputs["X"], inputs["W1"].copy(), inputs["W2"].copy()
    ops.conv_chain(x, w1, w2, padding=(1, 0), between="relu")
    misses = ops.calls.info()["conv_kernels"].misses
    w1 *= -0.5
    w2[:, :3] = 1.0
    y = ops.conv_chain(x, w1, w2, padding=(1, 0), between="relu")
    assert ops.calls.info()["conv_kernels"].misses == misses
    reference.assert_close(y, reference.run(chain, {"X": x, "W1": w1, "W2": w2})["Y2"], chain)


def test_a_repeat_call_rechecks_what_its_key_does_not_fix() -> None:
    """A call with an earlier call's operand kinds, shapes, strides and dtypes runs from what
    the earlier checks found (`ops.calls.conv_replays`): new arrays at new addresses are read, a new
    result keeps the input's memory order, and what the key leaves out is still refused."""
    chain = chainfuse.conv_chain_spec(2, 5, 9, 8, 7, 3, 3, 6, 1, 1, stride=(1, 1),
                                      padding=(1, 0), between="relu")  # fmt: skip
    args = {"stride": (1, 1), "padding": (1, 0), "between": "relu"}
    for seed in range(3):
        inputs = reference.random_inputs(chain, seed=seed)
        want = reference.run(chain, inputs)["Y2"]
        x, w1, w2 = (torch.from_numpy(inputs[n]) for n in ("X", "W1", "W2"))
        for xx in (x, x.contiguous(memory_format=torch.channels_last)):
            for _ in range(2):
                y = ops.conv_chain(xx, w1, w2, **args)  # type: ignore[arg-type]
                reference.assert_close(y.numpy(), want, chain)
                cl = xx.is_contiguous(memory_format=torch.channels_last)
                assert y.is_contiguous(memory_format=torch.channels_last) == cl
        b1, b2 = torch.randn(7), torch.randn(6)
        with_bias = F.conv2d(torch.relu(F.conv2d(x, w1, b1, padding=(1, 1))), w2, b2)
        for _ in range(2):
            y = ops.conv_chain(x, w1, w2, b1, b2, **args)  # type: ignore[arg-type]
            torch.testing.assert_close(y, with_bias, rtol=1e-4, atol=1e-4)
        out = np.full(want.shape, np.nan, np.float32)
        for _ in range(2):
            assert ops.conv_chain(inputs["X"], inputs["W1"], inputs["W2"], out=out, **args) is out
            reference.assert_close(out, want, chain)
    assert any(key[0] == "conv_chain" for key in ops.calls.conv_replays)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out: the output array is read-only"):
        ops.conv_chain(inputs["X"], inputs["W1"], inputs["W2"], out=out, **args)
    w1.requires_grad_(True)
    with pytest.raises(RuntimeError, match="w1: requires grad"):
        ops.conv_chain(x, w1, w2, **args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stride: expected two integers"):
        ops.conv_chain(x, w1.detach(), w2, stride=(1, True), padding=(1, 0), between="relu")


# -- errors name the argument ---------------------------------------------------------------------


def _args() -> tuple[np.ndarray[Any, Any], ...]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 9, 9)).astype(np.float32)
    w1 = rng.standard_normal((6, 4, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((5, 6, 1, 1)).astype(np.float32)
    return x, w1, w2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda x, w1, w2: (x, w1[:, :3], w2), r"w1: expected 4 input channels"),
        (lambda x, w1, w2: (x, w1, w2[:, :5]), r"w2: expected 6 input channels"),
        (lambda x, w1, w2: (x[:, :, :0], w1, w2), r"x: sizes after the batch must be positive"),
        (lambda x, w1, w2: (x, w1[:0], w2[:, :0]), r"w1: sizes must be positive"),
        (lambda x, w1, w2: (x[:, :, :2, :2], w1, w2), r"w1: kernel 3x3 is larger"),
        (lambda x, w1, w2: (x, w1, np.ones((5, 6, 9, 9), np.float32)), r"w2: kernel 9x9"),
        (lambda x, w1, w2: (x.astype(np.float64), w1, w2), r"x: expected dtype float32"),
        (lambda x, w1, w2: (x, w1.astype(np.float16), w2), r"w1: expected dtype float32"),
        (lambda x, w1, w2: (x[..., ::2, :], w1, w2), r"x: expected a NCHW or channels_last"),
        (lambda x, w1, w2: (x, w1, w2[0]), r"w2: expected 4 dims"),
        (lambda x, w1, w2: (x[0, 0], w1, w2), r"x: expected 4 dims \[N, C, H, W\] \(or 3"),
        (lambda x, w1, w2: ([[1.0]], w1, w2), r"x: expected a numpy array or a torch tensor"),
    ],
)
def test_errors_name_the_argument(change: Any, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        ops.conv_chain(*change(*_args()), padding=(0, 0))


# -- a depthwise second convolution (MobileNet's expansion -> depthwise) --------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("C", "H", "K", "stride"), [(16, 23, 96, 2), (24, 14, 144, 1), (7, 9, 65, 1)]
)
def test_expansion_into_depthwise_matches_pytorch(
    C: int, H: int, K: int, stride: int, kind: str
) -> None:
    """conv 1x1 -> relu6 -> depthwise 3x3 (groups = channels) -> relu6, as PyTorch computes it,
    channels past one chunk of the depthwise loop (64) and short of one, every layout; the
    weights packed once give the same result."""
    gen = torch.Generator().manual_seed(C)
    x = torch.randn(2, C, H, H + 2, generator=gen)
    w1, w2 = torch.randn(K, C, 1, 1, generator=gen) / C**0.5, torch.randn(K, 1, 3, 3, generator=gen)
    b1, b2 = torch.randn(K, generator=gen), torch.randn(K, generator=gen)
    want = F.relu6(F.conv2d(F.relu6(F.conv2d(x.double(), w1.double(), b1.double())), w2.double(),
                            b2.double(), stride=stride, padding=1, groups=K))  # fmt: skip
    args = [_as(kind, t.numpy()) for t in (x, w1, w2, b1, b2)]
    kw: dict[str, Any] = {"stride": (1, stride), "padding": (0, 1), "between": "relu6",
                          "after": "relu6", "groups": (1, K)}  # fmt: skip
    chain = chainfuse.conv_chain_spec(2, C, H, H + 2, K, 1, 1, K, 3, 3, stride=(1, stride),
                                      padding=(0, 1), between="relu6", depthwise=True)  # fmt: skip
    packed = ops.pack_conv_weights(args[0], args[1], args[2], **kw)
    for y in (ops.conv_chain(*args, **kw), ops.conv_chain(*args, **kw, packed=packed)):
        reference.assert_close(_numpy(y), want.numpy(), chain)


def test_depthwise_is_one_kernel_whose_name_says_so() -> None:
    chain = chainfuse.conv_chain_spec(1, 8, 9, 9, 32, 1, 1, 32, 3, 3, padding=(0, 1),
                                      between="relu", depthwise=True)  # fmt: skip
    kernel = compile_conv(chain)
    assert kernel.shape.depthwise and "dwconv" in kernel.name
    assert kernel.chain.tensor("W2").shape == (32, 1, 3, 3)
    # the depthwise stage runs no micro-kernel: 9 multiply-adds a channel and pixel, not 9*K1
    from chainfuse.codegen.conv import useful_flops

    assert useful_flops(kernel.shape) == 2 * 81 * 32 * (8 + 9)


def test_padding_after_differs_from_before_as_tf_same() -> None:
    """The second conv's padding `(before, after)`: TF's "SAME" at stride 2 (`(0, 1)`), as
    PyTorch computes it over an explicit `F.pad`, dense and depthwise, both layouts; errors."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 16, 15, generator=gen)
    w1 = torch.randn(24, 6, 1, 1, generator=gen)
    for w2, groups in ((torch.randn(24, 1, 3, 3, generator=gen), 24),
                       (torch.randn(7, 24, 3, 3, generator=gen), 1)):  # fmt: skip
        for before, after in ((0, 1), (1, 2), (2, 0)):
            z = F.relu(F.conv2d(x.double(), w1.double()))
            want = F.conv2d(F.pad(z, (before, after, before, after)), w2.double(), stride=2,
                            groups=groups)  # fmt: skip
            chain = chainfuse.conv_chain_spec(2, 6, 16, 15, 24, 1, 1, w2.shape[0], 3, 3,
                                              stride=(1, 2), padding=(0, before), between="relu",
                                              depthwise=groups > 1, pad_after=after)  # fmt: skip
            for xx in (x, x.contiguous(memory_format=torch.channels_last)):
                got = ops.conv_chain(xx, w1, w2, stride=(1, 2), padding=(0, (before, after)),
                                     between="relu", groups=(1, groups))  # fmt: skip
                reference.assert_close(got.numpy(), want.numpy(), chain)
    with pytest.raises(ValueError, match="padding: expected integers >= 0"):
        ops.conv_chain(x, w1, w1.new_ones(24, 24, 1, 1), padding=(0, (0, -1)))
    with pytest.raises(ValueError, match=r"padding: the second conv's \(before, after\)"):
        ops.conv_chain(x, w1, w1.new_ones(24, 24, 1, 1), padding=(0, (0, 1, 2)))
    with pytest.raises(ValueError, match="pad_after must be None or a non-negative integer"):
        chainfuse.conv_chain_spec(1, 4, 9, 9, 6, 1, 1, 6, 3, 3, pad_after=-1)


def test_depthwise_errors_name_the_argument() -> None:
    x = np.ones((1, 4, 9, 9), np.float32)
    w1, w2 = np.ones((6, 4, 1, 1), np.float32), np.ones((6, 1, 3, 3), np.float32)
    with pytest.raises(ValueError, match="groups: the first conv's groups must be 1"):
        ops.conv_chain(x, w1, w2, groups=(2, 6))
    with pytest.raises(ValueError, match="groups: the second conv's groups must be 1 or w1's 6"):
        ops.conv_chain(x, w1, w2, groups=(1, 3))
    with pytest.raises(ValueError, match=r"w2: expected \[6, 1, R, S\] for a depthwise"):
        ops.conv_chain(x, w1, np.ones((6, 6, 3, 3), np.float32), groups=(1, 6))
    with pytest.raises(ValueError, match="w2: expected 6 input channels"):
        ops.conv_chain(x, w1, w2)  # (depthwise weights without groups)
    with pytest.raises(ValueError, match="groups: expected two integers"):
        ops.conv_chain(x, w1, w2, groups="depthwise")
    bf = torch.ones(1, 4, 9, 9, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="groups: a depthwise second conv runs in float32 only"):
        ops.conv_chain(bf, torch.from_numpy(w1).bfloat16(), torch.from_numpy(w2).bfloat16(),
                       groups=(1, 6))  # fmt: skip
    with pytest.raises(ValueError, match="K2: a depthwise second convolution has K1 = 6"):
        chainfuse.conv_chain_spec(1, 4, 9, 9, 6, 1, 1, 5, 3, 3, depthwise=True)


def test_errors_bias_stride_padding_between_device() -> None:
    x, w1, w2 = _args()
    with pytest.raises(ValueError, match=r"b1: expected shape \(6,\)"):
        ops.conv_chain(x, w1, w2, b1=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="stride: expected integers >= 1"):
        ops.conv_chain(x, w1, w2, stride=(1, 0))
    with pytest.raises(ValueError, match="padding: expected integers >= 0"):
        ops.conv_chain(x, w1, w2, padding=(-1, 0))
    with pytest.raises(
        ValueError, match=r"between: expected None or one of \['relu', .*'squared_relu'\]"
    ):
        ops.conv_chain(x, w1, w2, between="tanh")
    with pytest.raises(ValueError, match=r"after: expected None or one of \['relu'"):
        ops.conv_chain(x, w1, w2, after="softmax")
    with pytest.raises(ValueError, match="x: expected a CPU tensor, got device meta"):
        ops.conv_chain(torch.empty(1, 4, 9, 9, device="meta"), w1, w2)
    with pytest.raises(ValueError, match="out: expected shape"):
        ops.conv_chain(x, w1, w2, out=np.empty((1, 5, 9, 9), np.float32))
    t = torch.from_numpy(x)
    with pytest.raises(ValueError, match="x: expected a NCHW or channels_last"):
        ops.conv_chain(t.transpose(2, 3), w1, w2)


@pytest.mark.parametrize("kind", KINDS)
def test_no_images_give_an_empty_result(kind: str) -> None:
    x, w1, w2 = _args()
    y = ops.conv_chain(
        _as(kind, x[:0]), _as(kind, w1), _as(kind, w2), stride=(2, 1), padding=(1, 0)
    )
    assert type(y) is type(_as(kind, x)) and tuple(y.shape) == (0, 5, 5, 5)
    out = _as(kind, np.empty((0, 5, 5, 5), np.float32))
    assert ops.conv_chain(_as(kind, x[:0]), w1, w2, stride=(2, 1), padding=(1, 0), out=out) is out
    with pytest.raises(ValueError, match=r"out: expected shape \(0, 5, 5, 5\)"):
        ops.conv_chain(x[:0], w1, w2, stride=(2, 1), padding=(1, 0), out=np.empty((0, 5, 9, 9)))


def test_a_fused_block_too_big_for_l1_still_compiles() -> None:
    """A 5x5 window over enough intermediate channels overflows L1 for any tiles: the plan then
    starts at the next level (found by hypothesis with 127 channels and a 32 KiB L1: no fused
    plan fitted, an error). One output pixel's window alone outgrows this host's L1 here."""
    l1 = chainfuse.Hardware.detect().levels[0].capacity
    chain = chainfuse.conv_chain_spec(1, 1, 7, 7, l1 // 100 + 1, 1, 1, 1, 5, 5, between="relu")
    kernel = compile_conv(chain)
    assert "L1" not in dict(kernel.plan.tiles)
    x = reference.random_inputs(chain)
    out = kernel(x["X"], x["W1"], x["W2"])
    reference.assert_close(out, reference.run(chain, x)["Y2"], chain)


@pytest.mark.parametrize("kind", ["torch", "numpy", "out", "channels-last"])
def test_one_unbatched_image_as_conv2d_takes_it(kind: str) -> None:
    # x [C, H, W] gives [K2, P, Q], as PyTorch's conv2d does for an unbatched input
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 5, 12, 9, generator=g)
    if kind == "channels-last":
        x = x.to(memory_format=torch.channels_last)
    x = x[0]
    w1, w2 = torch.randn(7, 5, 3, 3, generator=g), torch.randn(4, 7, 1, 1, generator=g)
    kw: dict[str, Any] = {"stride": (2, 1), "padding": (1, 0), "between": "relu"}
    theirs = F.conv2d(F.relu(F.conv2d(x.double(), w1.double(), None, 2, 1)), w2.double())
    if kind == "numpy":
        ours = torch.from_numpy(ops.conv_chain(x.numpy(), w1.numpy(), w2.numpy(), **kw))
    elif kind == "out":
        out = torch.empty(4, 6, 5)
        assert ops.conv_chain(x, w1, w2, out=out, **kw) is out
        ours = out
    else:
        ours = ops.conv_chain(x, w1, w2, **kw)
    assert ours.shape == theirs.shape == (4, 6, 5)
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


# -- weights packed once ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_weights_packed_once_give_the_same_result(kind: str) -> None:
    # packed for one call's shapes, read by calls of other images (batch, height, width): the
    # same arithmetic as packing them in the call, so the same bits
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((24, 13, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((19, 24, 1, 3)).astype(np.float32)
    b1, b2 = rng.standard_normal(24).astype(np.float32), rng.standard_normal(19).astype(np.float32)
    kw: dict[str, Any] = {"stride": (2, 1), "padding": (1, 1), "between": "silu", "after": "relu"}
    x0 = _as(kind, rng.standard_normal((1, 13, 17, 9)).astype(np.float32))
    args = [_as(kind, a) for a in (w1, w2, b1, b2)]
    packed = ops.pack_conv_weights(x0, args[0], args[1], **kw)
    assert isinstance(packed, ops.PackedConvWeights) and packed.finite
    for shape in ((1, 13, 17, 9), (3, 13, 8, 21)):
        x = _as(kind, rng.standard_normal(shape).astype(np.float32))
        want = ops.conv_chain(x, *args, **kw)
        got = ops.conv_chain(x, *args, **kw, packed=packed)
        again = ops.conv_chain(x, *args, **kw, packed=packed)  # (a replay)
        assert np.array_equal(_numpy(got), _numpy(want)) and np.array_equal(
            _numpy(again), _numpy(want)
        )


def test_weights_packed_with_a_nan_place_it_as_unpacked() -> None:
    # a NaN weight whose tap reads the padding: the same NaN positions packed or not
    rng = np.random.default_rng(4)
    x = rng.standard_normal((1, 5, 7, 6)).astype(np.float32)
    w1 = rng.standard_normal((8, 5, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((6, 8, 3, 3)).astype(np.float32)
    w2[2, 1, 0, 0] = np.nan
    packed = ops.pack_conv_weights(x, w1, w2, padding=(1, 1), between="relu")
    assert not packed.finite
    want = ops.conv_chain(x, w1, w2, padding=(1, 1), between="relu")
    got = ops.conv_chain(x, w1, w2, padding=(1, 1), between="relu", packed=packed)
    assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.nan_to_num(got), np.nan_to_num(want))


def test_packed_weights_errors_name_the_argument() -> None:
    x, w1, w2 = _args()
    packed = ops.pack_conv_weights(x, w1, w2)
    other = ops.pack_conv_weights(x, w1[:5], np.ascontiguousarray(w2[:, :5]))
    with pytest.raises(ValueError, match=r"^packed: expected \d+ float32 values"):
        ops.conv_chain(x, w1, w2, packed=other)
    with pytest.raises(TypeError, match="packed: expected pack_conv_weights' result"):
        ops.conv_chain(x, w1, w2, packed=packed.data)  # type: ignore[arg-type]
    misaligned = ops.PackedConvWeights(np.empty(packed.data.size + 1, np.float32)[1:],
                                       packed.micro, True)  # fmt: skip
    with pytest.raises(ValueError, match="packed: expected 64-byte aligned"):
        ops.conv_chain(x, w1, w2, packed=misaligned)
    with pytest.raises(ValueError, match="micro: no fp32 micro-kernel 'nope'"):
        ops.conv_chain(x, w1, w2, packed=ops.PackedConvWeights(packed.data, "nope", True))
    with pytest.raises(TypeError, match=r"x: expected dtype float32 \(or bfloat16"):
        ops.pack_conv_weights(x.astype(np.float64), w1, w2)


def test_packed_weights_are_what_the_call_reads() -> None:
    # packed weights hold the values they were packed with: a call reads them, not w1 and w2
    x, w1, w2 = _args()
    want = ops.conv_chain(x, w1, w2, padding=(1, 0), between="gelu")
    packed = ops.pack_conv_weights(x, w1, w2, padding=(1, 0), between="gelu")
    w1 *= 2.0
    got = ops.conv_chain(x, w1, w2, padding=(1, 0), between="gelu", packed=packed)
    assert np.array_equal(got, want)
    assert not np.allclose(ops.conv_chain(x, w1, w2, padding=(1, 0), between="gelu"), want)


@pytest.mark.parametrize("halo", ["keep", "recompute"])
def test_one_small_image_is_cut_into_a_band_for_each_thread(halo: str) -> None:
    # one 7x7 image on two threads: two bands (4 and 3 rows), the halo kept or recomputed
    from chainfuse.compiler import spread_bands
    from chainfuse.runtime import requested_num_threads, set_num_threads

    chain = chainfuse.conv_chain_spec(1, 40, 7, 7, 24, 1, 1, 20, 3, 3, padding=(0, 1),
                                      between="relu")  # fmt: skip
    before = requested_num_threads()
    set_num_threads(2)
    try:
        kernel = compile_conv(chain, threads=2, halo=halo)
        inputs = reference.random_inputs(chain, seed=5)
        y = kernel(inputs["X"], inputs["W1"], inputs["W2"])
    finally:
        set_num_threads(before)
    assert kernel.tiles.band_rows == 4
    reference.assert_close(y, reference.run(chain, inputs)["Y2"], chain)
    shape = kernel.shape
    assert spread_bands(shape, 7, 1) == 7 and spread_bands(shape, 2, 2) == 2
    assert spread_bands(dataclasses.replace(shape, N=2), 7, 2) == 7
