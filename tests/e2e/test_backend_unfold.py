"""The backend sees through PyTorch's attention modules (`chainfuse.torch.unfold`):
`nn.MultiheadAttention` (self- and cross-attention, masks, the `is_causal` hint, weights asked
for but unused) and the encoder layer's fused fast path (`nn.TransformerEncoderLayer` in eval
mode: masks, `norm_first`, ReLU or GELU), whose attention and MLP are then fused.

Each compiled module's output is held to the whole-model rule of `test_backend_models`: its
error against the module run in float64 at most 4x eager PyTorch's own (plus 1e-6 of the
output's size), NaN exactly where eager has NaN. The reference is what the graph Dynamo traced
computes: for `nn.MultiheadAttention` that is its general path (eager's own fast path, taken
outside `torch.compile`, gives NaN where SDPA gives zeros: a row with every key masked out), so
the references run with PyTorch's fast path off; the encoder layer's graph is the fast path
itself, and its references run it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
cft = pytest.importorskip("chainfuse.torch")

from chainfuse.torch.backend import Backend, Options, Report  # noqa: E402
from chainfuse.torch.rewrite import Capabilities  # noqa: E402

nn = torch.nn
CAPS = Capabilities.detect()
L, S, E, H = 10, 7, 64, 4  # queries, keys of the cross-attention, width, heads


def _compiled(fn: Callable[..., Any], report: Report, **options: Any) -> Any:
    options = {"mode": "eager", "measure": False, **options}
    return torch.compile(fn, backend=Backend(Options(**options), report), fullgraph=True)


def _check(module: Any, call: Callable[..., Any], inputs: tuple[Any, ...], fastpath: bool,
           report: Report, dtype: Any = torch.float32) -> None:  # fmt: skip
    """Compile `call(module, *inputs)` and hold its output to the rule above."""
    torch._dynamo.reset()
    module = module.eval()
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with torch.no_grad():

            def run(m: Any, dt: Any) -> Any:
                args = [x.to(dt) if x.is_floating_point() else x for x in inputs]
                return call(m.to(dt), *args).double()

            want = run(module, torch.float64)
            eager = run(module, dtype)
            module = module.to(dtype)
            args = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
            got = _compiled(lambda *a: call(module, *a), report)(*args).double()
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(eager.isnan(), nan)
    want, got, eager = (t.masked_fill(nan, 0.0) for t in (want, got, eager))
    err, eager_err = float((got - want).abs().max()), float((eager - want).abs().max())
    assert err <= 4 * eager_err + 1e-6 * max(1.0, float(want.abs().max())), (err, eager_err)
    assert report.graphs == 1


def _fused(report: Report) -> list[str]:
    return [c.form for c in report.chains if c.fused]


def _masks() -> dict[str, dict[str, Any]]:
    """`nn.MultiheadAttention`'s masks (True: left out), each kind PyTorch takes."""
    g = torch.Generator().manual_seed(3)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, 6:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    row = torch.zeros(L, L, dtype=torch.bool)
    row[2] = True  # (query 2 sees no key)
    return {
        "none": {},
        "padding": {"key_padding_mask": pad},
        "causal hint": {"attn_mask": causal, "is_causal": True},
        "hint and padding": {  # (PyTorch: then the merged masks, not the hint, are used)
            "attn_mask": torch.randn(L, L, generator=g),
            "key_padding_mask": torch.zeros(2, L).masked_fill(pad, -math.inf),
            "is_causal": True,
        },
        "boolean 2-D": {"attn_mask": causal < 0},
        "additive and padding": {
            "attn_mask": causal,
            "key_padding_mask": torch.zeros(2, L).masked_fill(pad, -math.inf),
        },
        "per head": {"attn_mask": torch.randn(2 * H, L, L, generator=g)},
        "a row with no key": {"attn_mask": row, "key_padding_mask": pad},
    }


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", list(_masks()))
def test_multihead_self_attention_is_unfolded_and_fused(
    mask: str, batch_first: bool, need_weights: bool
) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first)
    x = torch.randn(2, L, E) if batch_first else torch.randn(L, 2, E)
    kwargs = _masks()[mask]
    report = Report()
    if need_weights:  # (PyTorch takes the hint only with need_weights off)
        kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}

    def call(m: Any, a: Any) -> Any:
        masks = {k: v.to(a.dtype) if v.is_floating_point() else v
                 for k, v in kwargs.items() if isinstance(v, torch.Tensor)}  # fmt: skip
        return m(a, a, a, need_weights=need_weights, is_causal=kwargs.get("is_causal", False),
                 **masks)[0]  # fmt: skip

    _check(mha, call, (x,), fastpath=False, report=report)
    # SDPA as PyTorch calls it; written out (PyTorch's form) where the weights are asked for
    want = "matmul -> scale" if need_weights else "scaled_dot_product_attention"
    assert [f for f in _fused(report) if f.startswith(want)], [c.why for c in report.chains]
    assert not [why for _, why in report.skipped if "kept whole" in why]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("form", ["cross", "three inputs", "separate weights"])
def test_multihead_cross_attention_is_unfolded_and_fused(form: str, batch_first: bool) -> None:
    torch.manual_seed(0)
    kdim, vdim = (32, 48) if form == "separate weights" else (E, E)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=vdim)

    def seq(n: int, width: int) -> Any:
        return torch.randn(2, n, width) if batch_first else torch.randn(n, 2, width)

    pad = torch.zeros(2, S, dtype=torch.bool)
    pad[0, 4:] = True
    x, memory, other = seq(L, E), seq(S, kdim), seq(S, vdim)

    def call(m: Any, a: Any, k: Any, v: Any) -> Any:
        value = k if form == "cross" else v
        return m(a, k, value, key_padding_mask=pad, need_weights=False)[0]

    report = Report()
    _check(mha, call, (x, memory, other), fastpath=False, report=report)
    assert _fused(report) == ["scaled_dot_product_attention"]


@pytest.mark.parametrize(
    ("why", "make", "call"),
    [
        ("its attention weights are used", lambda: nn.MultiheadAttention(E, H),
         lambda m, a: (lambda o, w: o + w.sum())(*m(a, a, a))),
        ("a bias_k", lambda: nn.MultiheadAttention(E, H, add_bias_kv=True),
         lambda m, a: m(a, a, a, need_weights=False)[0]),
        ("add_zero_attn", lambda: nn.MultiheadAttention(E, H, add_zero_attn=True),
         lambda m, a: m(a, a, a, need_weights=False)[0]),
    ],
)  # fmt: skip
def test_multihead_attention_kept_whole_says_why(why: str, make: Any, call: Any) -> None:
    torch.manual_seed(0)
    report = Report()
    _check(make(), call, (torch.randn(L, 2, E),), fastpath=False, report=report)
    assert not report.chains
    assert [w for _, w in report.skipped if w == f"multi-head attention kept whole: {why}"]


def _layer_masks() -> dict[str, dict[str, Any]]:
    """The encoder layer's masks (True or nonzero: left out)."""
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, 7:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    soft = torch.zeros(L, L)
    soft[:, 3] = -1.0  # (the fast path leaves out every key whose mask is not 0)
    row = torch.zeros(L, L, dtype=torch.bool)
    row[2] = True
    every = pad.clone()
    every[1] = True  # (batch item 1: every key padding)
    return {
        "none": {},
        "padding": {"src_key_padding_mask": pad},
        "causal": {"src_mask": causal},
        "additive, not -inf": {"src_mask": soft},
        "causal and padding": {"src_mask": causal < 0, "src_key_padding_mask": pad},
        "a row with no key": {"src_mask": row},
        "an item with no key": {"src_key_padding_mask": every},
    }


@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("mask", list(_layer_masks()))
def test_encoder_layer_fast_path_is_unfolded_and_fused(
    mask: str, norm_first: bool, act: str
) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 128, batch_first=True, activation=act,
                                       norm_first=norm_first)  # fmt: skip
    kwargs = _layer_masks()[mask]

    def call(m: Any, a: Any) -> Any:
        return m(a, **{k: v.to(a.dtype) if v.is_floating_point() else v
                       for k, v in kwargs.items()})  # fmt: skip

    report = Report()
    _check(layer, call, (torch.randn(2, L, E),), fastpath=True, report=report)
    attention = "scaled_dot_product_attention" if mask == "none" else "matmul -> scale"
    forms = _fused(report)
    assert [f for f in forms if f.startswith(attention)], [c.why for c in report.chains]
    assert len(forms) == 1 + (CAPS.bias and act in CAPS.activations), forms
    assert not [why for _, why in report.skipped if "kept whole" in why or "fused" in why]


def test_encoder_and_decoder_stacks_are_unfolded_and_fused() -> None:
    """`nn.TransformerEncoder` (its default nested-tensor setting: under `torch.compile` the
    graph keeps dense tensors, so padded positions have values, where eager gives zeros) and
    a decoder layer with a causal mask and cross-attention over padded memory."""
    torch.manual_seed(0)
    stack = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, H, 128, batch_first=True), 2)
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[1, 7:] = True
    report = Report()
    x = torch.randn(2, L, E)
    _check(stack, lambda m, a: m(a, src_key_padding_mask=pad)[:, :7], (x,), fastpath=True,
           report=report)  # fmt: skip
    assert len(_fused(report)) == 2 * (1 + CAPS.bias)
    assert [n for n in report.notes if n.count("an encoder layer's fast path") == 2]
    decoder = nn.TransformerDecoderLayer(E, H, 128, batch_first=True)
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    memory_pad = torch.zeros(2, S, dtype=torch.bool)
    memory_pad[0, 5:] = True

    def decode(m: Any, a: Any, memory: Any) -> Any:
        return m(a, memory, tgt_mask=causal.to(a.dtype), tgt_is_causal=True,
                 memory_key_padding_mask=memory_pad)  # fmt: skip

    report = Report()
    _check(decoder, decode, (x, torch.randn(2, S, E)), fastpath=True, report=report)
    assert _fused(report).count("scaled_dot_product_attention") == 2


def test_encoder_layer_in_bfloat16() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 128, batch_first=True, activation="gelu")
    pad = torch.zeros(2, L, dtype=torch.bool)
    pad[0, 8:] = True
    report = Report()
    _check(layer, lambda m, a: m(a, src_key_padding_mask=pad), (torch.randn(2, L, E),),
           fastpath=True, report=report, dtype=torch.bfloat16)  # fmt: skip
    assert _fused(report)


def test_encoder_layer_serves_every_sequence_length_from_one_graph() -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 128, batch_first=True).eval()
    report = Report()
    compiled = torch.compile(layer, backend=Backend(Options(mode="eager", measure=False), report),
                             dynamic=True, fullgraph=True)  # fmt: skip
    with torch.no_grad():
        for n in (9, 23, 40):
            x = torch.randn(2, n, E)
            pad = torch.zeros(2, n, dtype=torch.bool)
            pad[1, n - 3 :] = True
            got = compiled(x, src_key_padding_mask=pad)
            want = layer(x, src_key_padding_mask=pad)
            assert float((got - want).abs().max()) <= 1e-4
    assert report.graphs == 1
    assert _fused(report)


def test_a_graph_with_nothing_fused_keeps_pytorchs_own_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no chain ends up fused (`fuse=False` here), the graph compiled is the one Dynamo
    gave: the encoder layer's fast path, not the ops `unfold` wrote it as."""
    torch._dynamo.reset()
    compiled_graphs: list[Any] = []
    real = Backend._compile

    def record(self: Backend, gm: Any, inputs: Any, freeze: bool) -> Any:
        compiled_graphs.append(gm)
        return real(self, gm, inputs, freeze)

    monkeypatch.setattr(Backend, "_compile", record)
    layer = nn.TransformerEncoderLayer(E, H, 128, batch_first=True).eval()
    report = Report()
    x = torch.randn(2, L, E)
    with torch.no_grad():
        got = _compiled(layer, report, fuse=False)(x)
        assert torch.equal(got, layer(x))
    assert report.chains and not _fused(report)
    targets = [n.target for n in compiled_graphs[-1].graph.nodes]
    assert torch._transformer_encoder_layer_fwd in targets
