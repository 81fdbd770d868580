"""The chain finder on hand-written modules (each form it knows, and what ends a chain), and the
fuse-or-not decision (the slower call is never kept; the decision is kept on disk)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("chainfuse.torch")

from chainfuse.torch import backend as backend_mod  # noqa: E402
from chainfuse.torch import decide as decide_mod  # noqa: E402
from chainfuse.torch.backend import Backend, Options, Report  # noqa: E402
from chainfuse.torch.finder import ChainKind, find  # noqa: E402
from chainfuse.torch.kinds import value_of  # noqa: E402

nn, F = torch.nn, torch.nn.functional


def _graph(fn: Any, *inputs: Any) -> Any:
    """The Dynamo FX graph of `fn(*inputs)` (as the backend receives it)."""
    graphs: list[Any] = []

    def keep(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    return graphs[0]


W1, W2 = torch.randn(48, 32), torch.randn(32, 48)
B1, B2 = torch.randn(48), torch.randn(32)
X = torch.randn(2, 5, 32)


@pytest.mark.parametrize(
    ("fn", "form"),
    [
        (lambda x: F.linear(F.relu(F.linear(x, W1, B1)), W2, B2),
         "linear+bias -> relu -> linear+bias"),
        (lambda x: F.gelu(x @ W1.t() + B1) @ W2.t() + B2, "x @ W.t() + b -> gelu -> x @ W.t() + b"),
        (lambda x: F.relu(x @ W1.T) @ W2.T + B2, "x @ W.t() -> relu -> x @ W.t() + b"),
        (lambda x: F.linear(F.gelu(F.linear(x, W1), approximate="tanh"), W2),
         "linear -> gelu_tanh -> linear"),
        (lambda x: (lambda h: h * torch.sigmoid(1.702 * h))(x @ W1.t()) @ W2.t(),
         "x @ W.t() -> quick_gelu -> x @ W.t()"),
        (lambda x: (lambda h: h * torch.sigmoid(h))(F.linear(x, W1)) @ W2.t(),
         "linear -> silu -> x @ W.t()"),
        (lambda x: F.linear(F.dropout(F.silu(F.linear(x, W1)), 0.1, False), W2),
         "linear -> silu -> dropout -> linear"),
        # written-out activations are told by what they compute (Bloom's, erf and fast GELUs)
        (lambda x: F.linear((lambda h: h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (
            1 + 0.044715 * h * h))))(F.linear(x, W1)), W2), "linear -> gelu_tanh -> linear"),
        (lambda x: F.linear((lambda h: h * 0.5 * (1.0 + torch.erf(h / math.sqrt(2.0))))(
            F.linear(x, W1, B1)), W2), "linear+bias -> gelu -> linear"),
        (lambda x: F.linear((lambda h: h / (1 + torch.exp(-h)))(F.linear(x, W1)), W2),
         "linear -> silu -> linear"),
        (lambda x: torch.addmm(B2, F.relu(torch.addmm(B1, x[0], W1.t())), W2.t()),
         "addmm -> relu -> addmm"),
        # the modules' calls, told apart by what they compute: ReLU6 is hardtanh(x, 0, 6)
        (lambda x: nn.ReLU6(inplace=True)(x @ W1.t()) @ W2.t(),
         "x @ W.t() -> relu6 -> x @ W.t()"),
        (lambda x: F.linear(nn.Hardswish()(F.linear(x, W1, B1)), W2),
         "linear+bias -> hardswish -> linear"),
        (lambda x: F.linear(nn.Mish()(F.linear(x, W1)), W2), "linear -> mish -> linear"),
        (lambda x: F.linear(F.relu(F.linear(x, W1)) ** 2, W2), "linear -> squared_relu -> linear"),
        (lambda x: F.linear(torch.square(torch.relu(F.linear(x, W1))), W2),
         "linear -> squared_relu -> linear"),
        (lambda x: F.linear(F.dropout(F.relu(F.linear(x, W1)).pow(2), 0.1, False), W2),
         "linear -> squared_relu -> dropout -> linear"),
        (lambda x: F.linear((lambda h: h * torch.tanh(F.softplus(h)))(F.linear(x, W1)), W2),
         "linear -> mish -> linear"),
        (lambda x: F.linear((lambda h: h * (h + 3).clamp(0, 6) / 6)(F.linear(x, W1)), W2),
         "linear -> hardswish -> linear"),
    ],
)  # fmt: skip
def test_mlp_forms(fn: Any, form: str) -> None:
    found = find(_graph(fn, X))
    assert [c.form for c in found.chains] == [form]


def test_linear_batch_norm_mlp_is_found_with_its_norms() -> None:
    """A tabular MLP's `Linear -> BatchNorm1d -> act -> Linear -> BatchNorm1d`: one chain, the
    norms in it (folded into frozen weights when emitted); a norm over another dim than the
    features (a 3-D result: BatchNorm1d's channels are its rows) ends the chain."""
    bn1, bn2 = nn.BatchNorm1d(48).eval(), nn.BatchNorm1d(32).eval()
    flat = torch.randn(7, 32)
    found = find(_graph(lambda x: bn2(F.linear(F.relu(bn1(F.linear(x, W1, B1))), W2)), flat))
    assert [c.form for c in found.chains] == [
        "linear+bias -> batch_norm -> relu -> linear -> batch_norm"
    ]
    rows = nn.BatchNorm1d(5).eval()  # ([2, 5, 48]: normalizes the 5 rows)
    assert not find(_graph(lambda x: F.linear(F.relu(rows(F.linear(x, W1))), W2), X)).chains

    def levit(h: Any, bn: Any) -> Any:  # LeViT's: rows flattened for the norm, viewed back
        return bn(h.flatten(0, 1)).reshape_as(h)

    found = find(_graph(lambda x: levit(F.linear(F.hardswish(levit(F.linear(x, W1), bn1)), W2),
                                        bn2), X))  # fmt: skip
    assert [c.form for c in found.chains] == [
        "linear -> batch_norm -> hardswish -> linear -> batch_norm"
    ]


def _inverted_residual(c: int, expand: int, stride: int) -> Any:
    """MobileNet-V2's block: 1x1 expansion -> BN -> ReLU6 -> depthwise 3x3 -> BN -> ReLU6 ->
    1x1 projection -> BN."""
    wide = c * expand
    return nn.Sequential(nn.Conv2d(c, wide, 1, bias=False), nn.BatchNorm2d(wide), nn.ReLU6(),
                         nn.Conv2d(wide, wide, 3, stride, 1, groups=wide, bias=False),
                         nn.BatchNorm2d(wide), nn.ReLU6(), nn.Conv2d(wide, c, 1, bias=False),
                         nn.BatchNorm2d(c)).eval()  # fmt: skip


def test_inverted_residuals_pair_each_expansion_with_its_depthwise() -> None:
    """Stacked inverted residuals: each conv could pair with the one before or after it
    (projection -> next expansion, expansion -> depthwise); the chains chosen are those with
    the larger intermediates, the expansions into their depthwise convs. The depthwise conv
    cannot start a chain, and a grouped conv that is not depthwise ends one."""
    net = nn.Sequential(_inverted_residual(8, 6, 2), _inverted_residual(8, 6, 1),
                        _inverted_residual(8, 4, 1))  # fmt: skip
    found = find(_graph(net, torch.randn(1, 8, 12, 12)))
    form = "conv2d -> batch_norm -> relu6 -> conv2d (depthwise) -> batch_norm -> relu6"
    assert [c.form for c in found.chains] == [form] * 3
    for chain in found.chains:
        first, second = chain.parts["first"], chain.parts["second"]
        assert first["groups"] == 1 and second["groups"] == value_of(second["w"]).shape[0]
    why = dict(found.skipped)
    assert any("fused with the conv2d after it instead" in r for r in why.values()), why
    head = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.ReLU(), nn.Conv2d(8, 16, 1)).eval()
    found = find(_graph(head, torch.randn(1, 8, 9, 9)))
    assert not found.chains
    assert any("depthwise conv2d is not the first of a conv chain" in r for _, r in found.skipped)
    grouped = nn.Sequential(nn.Conv2d(8, 16, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, groups=4)).eval()
    found = find(_graph(grouped, torch.randn(1, 8, 9, 9)))
    assert not found.chains
    assert any("grouped conv2d (groups=4): not depthwise" in r for _, r in found.skipped)


def test_padding_named_same_or_valid_is_the_convs_padding() -> None:
    """conv2d's `padding="same"` (EfficientNet's) is the pad on every side where that is one
    number (an odd square kernel), `"valid"` none; "same" of an even kernel ends the chain."""
    w1, w2 = torch.randn(16, 8, 1, 1), torch.randn(16, 16, 3, 3)
    x = torch.randn(1, 8, 9, 9)
    (chain,) = find(_graph(lambda x: F.conv2d(F.silu(F.conv2d(x, w1, padding="valid")), w2,
                                              padding="same"), x)).chains  # fmt: skip
    assert (chain.parts["first"]["padding"], chain.parts["second"]["padding"]) == (0, 1)
    even = torch.randn(16, 16, 2, 2)
    found = find(_graph(lambda x: F.conv2d(F.silu(F.conv2d(x, w1)), even, padding="same"), x))
    assert not found.chains


def test_zeros_padded_before_a_conv_are_its_padding() -> None:
    """TF's "SAME" padding written out (`F.pad` before a conv with no padding, as Hugging Face's
    MobileNets do): zeros the same before both axes and after both join the chain as the
    second conv's padding, before and after (stride 2: `(0, 1, 0, 1)`); other pads end it,
    saying so. The fused chain gives eager's result."""
    w1, w2 = torch.randn(24, 8, 1, 1), torch.randn(24, 1, 3, 3)

    def block(sides: tuple[int, ...], value: float = 0.0, stride: int = 1) -> Any:
        return lambda x: F.conv2d(F.pad(F.relu6(F.conv2d(x, w1)), sides, "constant", value), w2,
                                  stride=stride, groups=24)  # fmt: skip

    x = torch.randn(1, 8, 10, 10)
    for sides, stride, pads in (((1, 1, 1, 1), 1, (1, 1)), ((0, 1, 0, 1), 2, (0, 1))):
        (chain,) = find(_graph(block(sides, stride=stride), x)).chains
        assert chain.form == "conv2d -> relu6 -> pad -> conv2d (depthwise)"
        second = chain.parts["second"]
        assert (second["padding"], second["pad_after"]) == pads
        torch._dynamo.reset()
        compiled = torch.compile(block(sides, stride=stride), fullgraph=True,
                                 backend=Backend(Options(mode="eager", measure=False), Report()))  # fmt: skip
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), block(sides, stride=stride)(x))
    for sides, value in (((0, 1, 1, 1), 0.0), ((1, 1, 1, 1), 2.0)):
        found = find(_graph(block(sides, value), x))
        assert not found.chains
        assert any("an F.pad other than zeros the same" in r for _, r in found.skipped)


def test_finder_knows_every_activation_the_kernels_have() -> None:
    from chainfuse.ir import ACTIVATION_NAMES
    from chainfuse.torch.kinds import TORCH_ACTIVATIONS

    assert tuple(TORCH_ACTIVATIONS) == ACTIVATION_NAMES


@pytest.mark.parametrize(
    "act",
    [lambda h: h * torch.sigmoid(1.5 * h),  # no activation chainfuse has
     lambda h: torch.tanh(h) * 2.0,
     lambda h: h * 0.5 * (1.0 + torch.erf(h / 1.5)),
     lambda h: F.gelu(h) * 2.0,  # a GELU, then an op that is not one
     lambda h: F.hardtanh(h, 0.0, 5.0)],  # relu6's op with other bounds
)  # fmt: skip
def test_written_out_functions_that_are_no_activation_end_no_chain(act: Any) -> None:
    found = find(_graph(lambda x: F.linear(act(F.linear(x, W1)), W2), X))
    assert not found.chains


def test_gated_mlp_and_what_ends_a_chain() -> None:
    W3 = torch.randn(48, 32)

    def fn(x: Any) -> Any:
        gated = F.linear(F.silu(F.linear(x, W1)) * F.linear(x, W3), W2)
        return F.linear(F.layer_norm(F.linear(gated, W1), (48,)), W2)

    found = find(_graph(fn, X))
    assert [c.kind for c in found.chains] == [ChainKind.GATED_MLP]
    assert any("layer_norm" in why for _, why in found.skipped)


class _Net(nn.Module):
    """An MLP as models write it (weights as parameters, so the backend freezes them)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.up = nn.Linear(32, 96 if "chunk" in form or "split" in form else 48)
        self.down = nn.Linear(48, 32)
        self.w13 = nn.Parameter(torch.randn(32, 96) / 6)  # an [in, out] weight

    def forward(self, x: Any) -> Any:
        up, down = self.up.weight, self.down.weight
        if self.form == "x @ W.T":  # as Falcon's linears: `x @ self.weight.T` (+ bias)
            return F.gelu(x @ up.T + self.up.bias) @ down.T + self.down.bias
        if self.form == "chunk":  # as Phi-3's gated MLP: one weight for gate and up
            gate, h = F.linear(x, up).chunk(2, dim=-1)
            return F.linear(h * F.silu(gate), down)
        if self.form == "chunk, act on the second half":
            h, gate = F.linear(x, up).chunk(2, dim=-1)
            return F.linear(F.gelu(gate) * h, down)
        if self.form == "split":
            gate, h = torch.split(x @ up.t(), 48, dim=-1)
            return (F.silu(gate) * h) @ down.t()
        if self.form == "split of x @ W":  # [in, out] weights: the halves are column slices
            gate, h = (x @ self.w13).split([48, 48], dim=-1)
            return (F.silu(gate) * h) @ down.t()
        raise AssertionError(self.form)


GATED = {
    "chunk": "silu(half 0 of linear) * half 1 -> linear",
    "chunk, act on the second half": "gelu(half 1 of linear) * half 0 -> linear",
    "split": "silu(half 0 of x @ W.t()) * half 1 -> x @ W.t()",
}


@pytest.mark.parametrize("mode", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["x @ W.T", *GATED, "split of x @ W"])
def test_written_forms_are_fused_and_match(form: str, mode: str) -> None:
    """Written-out GEMMs (`x @ W.T`, as Falcon's) and a gated MLP whose gate and up weights are
    one (`chunk`/`split` of its result, as Phi-3's) are found, fused, and give the module's
    result, with the weights as graph inputs (eager) and frozen (Inductor)."""
    net = _Net(form).eval()
    x = torch.randn(2, 7, 32)
    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(net, backend=Backend(Options(mode=mode, measure=False), report),
                                 fullgraph=True)  # fmt: skip
        got, want = compiled(x), net(x)
    if form == "split of x @ W":  # (W1 and W2 stored differently: not one gated chain)
        assert not [c for c in report.chains if c.fused]
    else:
        (chain,) = report.chains
        assert chain.fused and chain.form == GATED.get(form, chain.form)
    want64 = _net64(net, x)
    assert float((got - want64).abs().max()) <= 4 * float((want - want64).abs().max()) + 1e-6


def _net64(net: nn.Module, x: Any) -> Any:
    import copy

    with torch.no_grad():
        return copy.deepcopy(net).double()(x.double())


def test_gated_halves_that_are_not_a_gated_mlp() -> None:
    """A chunk into three, a half used twice, or halves of the wrong dimension stay unfused."""
    W, W_out = torch.randn(96, 32), torch.randn(32, 96)

    def thirds(x: Any) -> Any:
        a, b, c = F.linear(x, W).chunk(3, dim=-1)
        return F.linear(F.silu(a) * b + c, W2[:, :32])

    def reused(x: Any) -> Any:
        gate, h = F.linear(x, W).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * h, W2) + h.sum()

    def rows(x: Any) -> Any:
        gate, h = F.linear(x, W).chunk(2, dim=0)
        return F.linear(F.silu(gate) * h, W_out)

    for fn in (thirds, reused, rows):
        assert not find(_graph(fn, X)).chains, fn.__name__


def test_written_out_attention_with_a_mask() -> None:
    q, k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 8)
    mask = torch.randn(1, 1, 7, 9)

    def fn(q: Any, k: Any, v: Any, m: Any) -> Any:
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(16) + m, dim=-1) @ v

    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend=Backend(Options(mode="eager", measure=False), report))(
            q, k, v, mask
        )
    (chain,) = report.chains
    assert chain.form == "matmul -> scale -> + mask -> softmax -> matmul" and chain.fused
    torch.testing.assert_close(got, fn(q, k, v, mask), rtol=1e-5, atol=1e-5)


def _channels_first(x: Any, m: Any, form: str) -> Any:
    """Attention over heads stored `[b, h, d, s]` (SqueezeBERT's, from a conv1d): q and v as
    transposed views, kᵀ as it is stored; none has its head dimension contiguous."""
    q, kt, v = x.transpose(-1, -2), x * 0.5, (x + 1.0).transpose(-1, -2)
    if form == "sdpa":
        return F.scaled_dot_product_attention(q, kt.transpose(-1, -2), v, attn_mask=m)
    return F.softmax(q @ kt / 4.0 + m, dim=-1) @ v


@pytest.mark.parametrize("mode", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["written out", "sdpa"])
def test_attention_over_heads_stored_channels_first(form: str, mode: str) -> None:
    """q, k and v whose head dimension is not contiguous are fused (read from contiguous copies
    in the graph), with eager's result within the rule."""
    torch.manual_seed(0)
    x, m = torch.randn(2, 3, 16, 13), torch.randn(2, 1, 1, 13)
    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(_channels_first, fullgraph=True,
                           backend=Backend(Options(mode=mode, measure=False), report))  # fmt: skip
        got, want = fn(x, m, form), _channels_first(x, m, form)
        want64 = _channels_first(x.double(), m.double(), form)
    (chain,) = report.chains
    assert chain.fused, chain.why
    err = float((got.double() - want64).abs().max())
    assert err <= 4 * float((want.double() - want64).abs().max()) + 1e-6


def _alibi_scores(q: Any, k: Any, v: Any, bias: Any, m: Any, form: str) -> Any:
    """Attention as Bloom writes it: scores from `baddbmm(alibi, q, kᵀ)` over [b·h] batches,
    reshaped to [b, h] for the mask and back for the matmul with v; and variants of it."""
    b, h = m.shape[0], q.shape[0] // m.shape[0]
    s = q.shape[1]
    if form == "scaled after":  # the scale applied to the whole sum (bias included)
        scores = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=0.5) * 0.25
    else:
        scores = bias.baddbmm(batch1=q, batch2=k.transpose(-1, -2), beta=1.0, alpha=0.25)
    w = scores.view(b, h, s, -1)
    if form == "boolean mask":  # added, a boolean counts 1 where True
        w = w + (m > 0)
    elif form != "no mask":
        w = w + m
    dtype = torch.float32 if form == "float32 softmax" else None
    p = F.softmax(w, dim=-1, dtype=dtype).to(q.dtype)
    return torch.bmm(F.dropout(p, 0.0, False).view(b * h, s, -1), v)


@pytest.mark.parametrize("mode", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["mask", "scaled after", "boolean mask", "no mask",
                                  "float32 softmax"])  # fmt: skip
def test_written_out_attention_with_alibi(form: str, mode: str) -> None:
    """Bloom's form (ALiBi as baddbmm's input, views around the mask) is one fused call whose
    result is eager's within the rule, in float32 and (softmax in float32) in bfloat16."""
    torch.manual_seed(0)
    b, h, s, d = 2, 3, 13, 16
    dtype = torch.bfloat16 if form == "float32 softmax" else torch.float32
    q, k, v = (torch.randn(b * h, s, d, dtype=dtype) for _ in range(3))
    bias = (torch.arange(s) * torch.rand(b * h, 1, 1)).to(dtype)  # [b·h, 1, s]: per head
    causal = torch.ones(s, s).tril().bool()
    m = torch.zeros(b, 1, s, s).masked_fill(~causal, torch.finfo(torch.float32).min).to(dtype)
    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        fn = torch.compile(_alibi_scores, backend=Backend(Options(mode=mode, measure=False), report),
                           fullgraph=True)  # fmt: skip
        got = fn(q, k, v, bias, m, form)
        want = _alibi_scores(q, k, v, bias, m, form)
        want64 = _alibi_scores(*(t.double() for t in (q, k, v, bias, m)), form)
    (chain,) = report.chains
    assert chain.fused and chain.form.startswith("baddbmm"), chain.why
    assert float((got.double() - want64).abs().max()) <= (
        4 * float((want.double() - want64).abs().max()) + 1e-6
    )


def _filled(q: Any, k: Any, v: Any, m: Any, form: str) -> Any:
    """Attention written out with its masked scores filled, as models and users write it."""
    s = q @ k.transpose(-2, -1)
    if form == "nanoGPT":  # masked_fill(-inf) of a causal buffer's zeros
        s = (s * (1.0 / math.sqrt(k.size(-1)))).masked_fill(m == 0, float("-inf"))
    elif form == "GPT-Neo":  # where(keep, s, finfo.min as a 0-d tensor), then a padding mask
        s = torch.where(m.bool(), s, torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype))
        s = s + torch.zeros(s.shape[0], 1, 1, s.shape[-1], dtype=s.dtype).index_fill(
            -1, torch.tensor([0, 5]), torch.finfo(s.dtype).min)  # fmt: skip
    elif form == "MPT":  # scale, a bias, masked_fill(finfo.min), an upcast for the softmax
        alibi = (torch.arange(s.shape[-1]) * -0.1).to(s.dtype)
        s = (s * 0.25 + alibi).masked_fill(m == 0, torch.finfo(s.dtype).min).float()
    elif form == "where, fill first":  # a reshape, a scale, where(masked, -inf, s), reshaped back
        s = s.view(1, *s.shape) * 0.25
        s = torch.where((m == 0).view(1, 1, 1, *m.shape[-2:]), float("-inf"), s).view(s.shape[1:])
    elif form == "fill -1e4":  # not below every score: not fused (a fill is not an add)
        s = s.masked_fill(m == 0, -1e4)
    elif form == "XGLM":  # a mask of finfo.min added twice (-inf), then max(., finfo.min)
        low = torch.finfo(s.dtype).min
        causal = torch.zeros(m.shape, dtype=s.dtype).masked_fill(m == 0, low)
        causal[..., 3, :] = low  # (row 3: every key masked twice, -inf, raised to min: uniform)
        s = s + causal + causal[..., 3:4, :]
        s = torch.max(s, torch.full((), low, dtype=s.dtype))
    elif form == "clamp -1e4":  # a floor a score could be near: not fused
        s = s + torch.zeros(m.shape, dtype=s.dtype).masked_fill(m == 0, float("-inf"))
        s = s.clamp(min=-1e4)
    elif form == "rows masked out":  # rows with no key left: -inf gives NaN, as in eager
        s = s.masked_fill((m == 0) | (torch.arange(s.shape[-2])[:, None] == 3), float("-inf"))
    elif form == "rows filled with min":  # ... and finfo.min the mean of v, as in eager
        s = s.masked_fill((m == 0) | (torch.arange(s.shape[-2])[:, None] == 3),
                          torch.finfo(s.dtype).min)  # fmt: skip
    return F.softmax(s, dim=-1).to(q.dtype) @ v


def _compiled_eager_64(fn: Any, q: Any, k: Any, v: Any, m: Any, m64: Any, form: str) -> Any:
    """`fn(q, k, v, m, form)` compiled by the backend (Inductor, every chain fused), run eagerly,
    and run eagerly in float64 with the mask `m64`: (the report, the three results)."""
    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(fn, backend=Backend(Options(mode="inductor", measure=False), report),
                                 fullgraph=True)  # fmt: skip
        got, want = compiled(q, k, v, m, form), fn(q, k, v, m, form)
        want64 = fn(q.double(), k.double(), v.double(), m64, form)
    return report, got, want, want64


FILLED = [
    "nanoGPT",
    "GPT-Neo",
    "MPT",
    "where, fill first",
    "fill -1e4",
    "XGLM",
    "clamp -1e4",
    "rows masked out",
    "rows filled with min",
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", FILLED)
def test_written_out_attention_with_filled_scores(form: str, dtype: str) -> None:
    """Masked-out scores filled with -inf or finfo.min (masked_fill, where) or raised to it
    (max) are one fused call with eager's result within the rule, NaN where eager has NaN; a
    fill or a floor with a value a score could be near (-1e4) ends the chain."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(2, 3, 11, 16, dtype=dt) for _ in range(3))
    m = torch.ones(11, 11).tril()[None, None]  # a causal buffer, as nanoGPT registers it
    report, got, want, want64 = _compiled_eager_64(_filled, q, k, v, m, m, form)
    if form in ("fill -1e4", "clamp -1e4"):
        assert not [c for c in report.chains if c.fused]
    else:
        (chain,) = report.chains
        assert chain.fused, chain.why
    assert torch.equal(got.isnan(), want64.isnan()) and torch.equal(want.isnan(), want64.isnan())
    err = (got.double() - want64).nan_to_num().abs().max()
    assert float(err) <= 4 * float((want.double() - want64).nan_to_num().abs().max()) + 1e-6


def _capped(q: Any, k: Any, v: Any, m: Any, form: str) -> Any:
    """Attention with soft-capped scores, as Gemma 2 writes it, and variants of it."""
    s = q @ k.transpose(-2, -1)
    if form == "Gemma 2":  # scale, / cap, tanh, * cap, + mask, float32 softmax cast back
        s = torch.tanh(s * 0.25 / 30.0) * 30.0 + m
        return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    if form == "cap times tanh":  # c tanh(k s): cap c, scale k c
        s = 5.0 * torch.tanh(s * 0.05)
    elif form == "no factor inside":  # cap tanh(s): scale = cap
        s = torch.tanh(s).mul(2.0)
    elif form == "negative cap":  # (-c) tanh(-s / c) = c tanh(s / c)
        s = -3.0 * (s / -3.0).tanh()
    elif form == "then filled":  # a causal fill after the cap
        s = (s.tanh() * 4.0).masked_fill(m < -1.0, float("-inf"))
    elif form == "mask inside":  # the mask added before the cap: not soft-capping the scores
        s = torch.tanh((s + m) / 10.0) * 10.0
    elif form == "another cap outside":  # a factor other than the inner one's inverse kept
        s = torch.tanh(s / 10.0) * 10.0 * 0.5
    return F.softmax(s, dim=-1).to(q.dtype) @ v


CAPPED = ["Gemma 2", "cap times tanh", "no factor inside", "negative cap", "then filled",
          "mask inside", "another cap outside"]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", CAPPED)
def test_written_out_attention_with_capped_scores(form: str, dtype: str) -> None:
    """Soft-capped scores (`c * tanh(k * s)`, Gemma 2's form among them) are one fused call with
    eager's result within the rule; a mask inside the tanh, or a scale after it, ends the chain
    (the kernel caps the scores alone, then adds the mask)."""
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    q, k, v = (2.0 * torch.randn(2, 3, 11, 16, dtype=dt) for _ in range(3))
    causal = torch.ones(11, 11).tril().bool()
    m = torch.zeros(1, 1, 11, 11).masked_fill(~causal, torch.finfo(torch.float32).min).to(dt)
    report, got, want, want64 = _compiled_eager_64(_capped, q, k, v, m, m.double(), form)
    fused = [c for c in report.chains if c.fused]
    if form in ("mask inside", "another cap outside"):
        assert not fused
    else:
        (chain,) = fused
        assert "softcap" in chain.form, chain.form
    err = (got.double() - want64).abs().max()
    assert float(err) <= 4 * float((want.double() - want64).abs().max()) + 1e-6


def test_filled_attention_is_timed_with_its_mask_ops_compiled(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timed against Inductor, a fused chain with ops of its own beside the kernel (the masks
    made one, NaN rows) runs them as Inductor compiles them, and the model keeps eager's result
    whichever way the decision goes; where the decision is recalled, neither side is compiled
    for it."""
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    compiled: list[Any] = []  # the graphs compiled for a chain's decision (isolated)
    real = backend_mod.compile_graph

    def counted(module: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("isolated"):
            compiled.append(module)
        return real(module, *args, **kwargs)

    monkeypatch.setattr(backend_mod, "compile_graph", counted)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    m = torch.ones(40, 40).tril()[None, None]
    for recalled in (False, True):
        report = Report()
        torch._dynamo.reset()
        with torch.no_grad():
            fn = torch.compile(_filled, backend=Backend(Options(mode="inductor"), report))
            got = fn(q, k, v, m, "nanoGPT")
        (chain,) = report.chains
        assert chain.decision is not None and chain.decision.cached is recalled
        assert chain.decision.fused_s and chain.decision.baseline_s
        if recalled:
            assert not compiled
        else:  # the chain's unfused nodes and its fused graph (the mask ops)
            assert any("score_terms" in str(mod.graph) for mod in compiled), chain.why
            compiled.clear()
        torch.testing.assert_close(got, _filled(q, k, v, m, "nanoGPT"), rtol=1e-5, atol=1e-5)


def test_decision_keeps_the_faster_and_is_remembered(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    t = torch.ones(3)

    def slow() -> Any:
        time.sleep(2e-3)
        return t

    first = decide_mod.decide(["case"], slow, lambda: t, None)
    assert not first.fuse and not first.cached
    assert first.fused_s is not None and first.baseline_s is not None
    again = decide_mod.decide(["case"], slow, lambda: t, 0.5)
    assert again.cached and not again.fuse
    assert again.predicted_s == 0.5  # (today's prediction, not the record's)
    assert decide_mod.decide(["other"], lambda: t, slow, None).fuse
    wrong = decide_mod.decide(["wrong"], lambda: t + 1, lambda: t, None)
    assert not wrong.fuse and "differs" in wrong.why
