"""`torch.compile(model, backend="chainfuse")` on whole models built from small configs (random
weights, nothing downloaded): Hugging Face BERT, ViT (also at a larger image: more tokens than
one tile), GPT-2, a Llama-style model, Phi-3 (gate and up projections in one weight), Falcon
(linears written `x @ W.T`), Bloom (ALiBi attention written out with `baddbmm`), GPT-Neo and
MPT (attention written out with masked-out scores filled by `where` / `masked_fill`), MPNet
(its position bias added to the scores in place), a Whisper encoder (conv stem, then attention
over its frames), PyTorch's TransformerEncoderLayer (its fused fast path too), a ResNet-style
conv net and a plain MLP.

Every chain the installed chainfuse can run is fused (`measure=False`: no timing, so the
rewrites themselves are what is tested), and the model's output is compared with the model run
in float64: the chainfuse model's error may be at most 4x eager PyTorch's own error at the same
dtype (plus 1e-6 of the output's size), the whole-model form of the project's tolerance rule
(both are roundings of the same float64 result). Greedy generation must give eager's tokens.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
cft = pytest.importorskip("chainfuse.torch")

from chainfuse.runtime import cache  # noqa: E402
from chainfuse.torch.backend import Backend, Options, Report  # noqa: E402
from chainfuse.torch.rewrite import Capabilities  # noqa: E402

nn = torch.nn


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: Any) -> Any:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(x + y)


def _with_statistics(net: Any) -> Any:
    """`net` with batch norms whose running statistics and affine terms are not 0 and 1, so
    that folding them into the convolutions and linears is tested."""
    for m in net.modules():
        if isinstance(m, nn.BatchNorm1d | nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return net


def _resnet() -> Any:
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                        _Block(16), _Block(16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                        nn.Linear(16, 10))  # fmt: skip
    return _with_statistics(net)


class _ConvBnSiLU(nn.Module):
    """YOLOv5/v8's `Conv`: conv (no bias) -> batch norm -> SiLU in place (or `act`: YOLOv4's
    Mish, MobileNet's ReLU6 and hardswish)."""

    def __init__(self, c1: int, c2: int, k: int, s: int = 1, act: Any = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, k // 2, bias=False)
        self.bn, self.act = nn.BatchNorm2d(c2), act or nn.SiLU(inplace=True)

    def forward(self, x: Any) -> Any:
        return self.act(self.bn(self.conv(x)))


class _Bottleneck(nn.Module):
    """YOLO's bottleneck: two Conv-BN-SiLU, a residual around them."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.cv1, self.cv2 = _ConvBnSiLU(c, c, 3), _ConvBnSiLU(c, c, 3)

    def forward(self, x: Any) -> Any:
        return x + self.cv2(self.cv1(x))


class _C2f(nn.Module):
    """YOLOv8's C2f: a 1x1 conv, its channels split in two, a bottleneck on the second half (a
    strided view of the 1x1 conv's result), the three concatenated into a 1x1 conv."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.cv1, self.cv2 = _ConvBnSiLU(c, c, 1), _ConvBnSiLU(3 * c // 2, c, 1)
        self.m = _Bottleneck(c // 2)

    def forward(self, x: Any) -> Any:
        a, b = self.cv1(x).chunk(2, 1)
        return self.cv2(torch.cat([a, b, self.m(b)], 1))


def _yolo() -> Any:
    net = nn.Sequential(_ConvBnSiLU(3, 16, 3, 2), _Bottleneck(16), _ConvBnSiLU(16, 24, 3, 2),
                        _C2f(24))  # fmt: skip
    return _with_statistics(net)


def _conv_acts() -> Any:
    """Conv-BN-act blocks with the other activations: two chains, mish between and hardswish
    after, relu6 between and squared relu after; then MobileNet-V2's projection (a 1x1 conv and
    batch norm, no activation) into the next block's expansion (1x1, BN, ReLU6): a third."""
    net = nn.Sequential(_ConvBnSiLU(3, 16, 3, 2, nn.Mish()), _ConvBnSiLU(16, 24, 3, 1, nn.Hardswish()),
                        _ConvBnSiLU(24, 24, 1, 1, nn.ReLU6(inplace=True)),
                        _ConvBnSiLU(24, 16, 3, 1, transformers.activations.ReLUSquaredActivation()),
                        nn.Conv2d(16, 8, 1, bias=False), nn.BatchNorm2d(8),
                        _ConvBnSiLU(8, 48, 1, 1, nn.ReLU6(inplace=True)))  # fmt: skip
    return _with_statistics(net)


CAPS = Capabilities.detect()
MLPS = 2 * CAPS.bias  # per two layers: MLPs with a bias before the activation


def _model(name: str) -> tuple[Any, tuple[Any, ...], int]:
    """A model, its inputs and how many chains the installed chainfuse must fuse in it (its
    attention always; its MLPs where the installed kernels take their form)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 17))
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128}  # fmt: skip
    if name == "bert":
        config = transformers.BertConfig(vocab_size=100, **small)
        return transformers.BertModel(config), (ids,), 2 + MLPS
    if name == "bert-written":  # attention written out: matmul, scale, softmax, matmul
        cfg = transformers.BertConfig(vocab_size=100, attn_implementation="eager", **small)
        return transformers.BertModel(cfg), (ids,), 2 + MLPS
    if name == "vit":
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, **small)
        return transformers.ViTModel(cfg), (torch.randn(2, 3, 32, 32),), 2 + MLPS
    if name == "vit-large-image":  # 145 tokens: past one tile, not a multiple of any
        cfg = transformers.ViTConfig(image_size=96, patch_size=8, **small)
        return transformers.ViTModel(cfg), (torch.randn(1, 3, 96, 96),), 2 + MLPS
    if name == "whisper":  # 2 * 37 mel frames -> 37 positions after the stride-2 conv stem
        cfg = transformers.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=4,
                                         encoder_ffn_dim=128, num_mel_bins=16,
                                         max_source_positions=37)  # fmt: skip
        return _whisper_encoder(cfg), (torch.randn(2, 16, 74),), 2 + MLPS
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100)
        tanh = MLPS * ("gelu_tanh" in CAPS.activations)
        return transformers.GPT2LMHeadModel(cfg), (ids,), 2 + tanh
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=100, num_key_value_heads=2, **small)
        gated = 2 * (CAPS.gated_mlp and "silu" in CAPS.activations)
        return transformers.LlamaForCausalLM(cfg), (ids,), 2 + gated
    if name == "nemotron":  # squared relu between the MLP's linears
        cfg = transformers.NemotronConfig(vocab_size=100, num_key_value_heads=2, **small)
        return (
            transformers.NemotronForCausalLM(cfg),
            (ids,),
            2 + 2 * ("squared_relu" in CAPS.activations),
        )
    if name == "phi3":  # the gated MLP's gate and up weights are one (its result chunked)
        cfg = transformers.Phi3Config(vocab_size=100, num_key_value_heads=2, pad_token_id=0,
                                      **small)  # fmt: skip
        gated = 2 * (CAPS.gated_mlp and "silu" in CAPS.activations)
        return transformers.Phi3ForCausalLM(cfg), (ids,), 2 + gated
    if name == "falcon":  # linears written out as `x @ self.weight.T`
        cfg = transformers.FalconConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4)  # fmt: skip
        return transformers.FalconForCausalLM(cfg), (ids,), 2 + 2 * CAPS.weight_views
    if name == "bloom":  # ALiBi: scores are `baddbmm(alibi, q, kᵀ)`, reshaped around the mask
        cfg = transformers.BloomConfig(vocab_size=100, hidden_size=64, n_layer=2, n_head=4)
        return transformers.BloomForCausalLM(cfg), (ids,), 2 + MLPS
    if name == "gpt-neo":  # written out: where(causal, s, finfo.min) + mask, local layers too
        cfg = transformers.GPTNeoConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
                                        intermediate_size=128, window_size=8,
                                        attention_types=[[["global", "local"], 1]])  # fmt: skip
        return (
            transformers.GPTNeoForCausalLM(cfg),
            (ids,),
            2 + MLPS * ("gelu_tanh" in CAPS.activations),
        )
    if name == "mpt":  # written out: ALiBi added, masked_fill(finfo.min), softmax in float32
        cfg = transformers.MptConfig(vocab_size=100, d_model=64, n_heads=4, n_layers=2,
                                     expansion_ratio=2)  # fmt: skip
        return transformers.MptForCausalLM(cfg), (ids,), 2 + 2 * ("gelu" in CAPS.activations)
    if name == "gemma2":  # soft-capped scores (tanh), sliding-window layers, gated tanh-GELU MLP
        cfg = transformers.Gemma2Config(vocab_size=100, num_key_value_heads=2, head_dim=16,
                                        sliding_window=8, attn_logit_softcapping=50.0,
                                        query_pre_attn_scalar=16, **small)  # fmt: skip
        gated = 2 * (CAPS.gated_mlp and "gelu_tanh" in CAPS.activations)
        return transformers.Gemma2ForCausalLM(cfg), (ids,), 2 + gated
    if name == "mpnet":  # written out, the position bias added in place (`scores += bias`)
        cfg = transformers.MPNetConfig(vocab_size=100, **small)
        padding = torch.ones(2, 17, dtype=torch.long)
        padding[1, 12:] = 0
        return transformers.MPNetModel(cfg), (ids, padding), 2 + MLPS
    if name in ("encoder-layer", "encoder-fast"):  # (PyTorch's fast path off, then on)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        return layer, (torch.randn(2, 17, 64),), 1 + CAPS.bias
    if name == "resnet":
        return _resnet(), (torch.randn(2, 3, 16, 16),), 2
    if name == "yolo":  # conv -> BN -> SiLU -> conv -> BN -> SiLU three times; channels-last
        x = torch.randn(2, 3, 33, 30).contiguous(memory_format=torch.channels_last)
        return _yolo(), (x,), 3
    if name == "mlp-stack":  # the second MLP reads the first's result (replaced when fused)
        net = nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU6(), nn.Linear(256, 64),
                            nn.Linear(64, 96, bias=False), nn.Mish(), nn.Linear(96, 64))  # fmt: skip
        return net, (torch.randn(2, 17, 64),), 2
    if name == "tabular":  # Linear -> BatchNorm1d -> ReLU -> Dropout twice: the norms folded
        net = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.1),
                            nn.Linear(64, 48, bias=False), nn.BatchNorm1d(48), nn.ReLU(),
                            nn.Linear(48, 1))  # fmt: skip
        return _with_statistics(net), (torch.randn(37, 32),), 1
    if name == "levit":  # Linear -> flatten -> BatchNorm1d -> view back -> hardswish MLPs
        cfg = transformers.LevitConfig(image_size=32, hidden_sizes=[32, 48, 64], depths=[1, 1, 1],
                                       num_attention_heads=[2, 2, 2], key_dim=[8, 8, 8])  # fmt: skip
        return _with_statistics(transformers.LevitModel(cfg)), (torch.randn(2, 3, 32, 32),), 11
    if name == "efficientnet":  # padding="same" / "valid", expansion -> depthwise with SiLU,
        # the squeeze-excitation's conv -> silu -> conv
        cfg = transformers.EfficientNetConfig(image_size=32, depth_coefficient=0.5)
        model = _with_statistics(transformers.EfficientNetModel(cfg))
        return model, (torch.randn(2, 3, 32, 35),), 20
    if name.startswith("mobilenet-v2"):  # expansion -> depthwise chains (17 blocks, 18 chains)
        # TF's padding (the default): the zeros an F.pad adds before each conv join the chain
        # as the conv's padding, before and after (stride 2's (0, 1, 0, 1) on a square image)
        tf = name.endswith("-tf")
        cfg = transformers.MobileNetV2Config(image_size=32, depth_multiplier=0.25, tf_padding=tf)
        model = _with_statistics(transformers.MobileNetV2Model(cfg))
        return model, (torch.randn(2, 3, 32, 29 + 3 * tf),), 18
    if name == "conv-acts":
        return _conv_acts(), (torch.randn(2, 3, 19, 22),), 3
    if name == "mlp":  # no bias on the first GEMM: a chain every chainfuse build fuses
        net = nn.Sequential(nn.Linear(64, 256, bias=False), nn.ReLU(), nn.Dropout(0.1),
                            nn.Linear(256, 64))  # fmt: skip
        return net, (torch.randn(2, 17, 64),), 1
    raise AssertionError(name)


def _whisper_encoder(config: Any) -> Any:
    """Whisper's encoder alone (the decoder is not built; transformers 5.x keeps the class in
    its modeling module, not at the top level)."""
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    return WhisperEncoder(config)


def _tensor(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple):
        return out[0]
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _run(model: Any, inputs: tuple[Any, ...], dtype: Any) -> Any:
    model = model.to(dtype).train().eval()  # (train() drops what a model caches in one dtype:
    # LeViT's attention biases)
    args = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        return _tensor(model(*args)).double()


def _compiled(model: Any, report: Report, **options: Any) -> Any:
    options = {"mode": "eager", "measure": False, **options}
    return torch.compile(model, backend=Backend(Options(**options), report), fullgraph=True)


def _check_close(model: Any, inputs: tuple[Any, ...], dtype: Any, report: Report,
                 **options: Any) -> None:  # fmt: skip
    torch._dynamo.reset()
    model = model.eval()
    want = _run(model, inputs, torch.float64)
    eager = _run(model, inputs, dtype)
    got = _run(_compiled(model, report, **options), inputs, dtype)
    scale = float(want.abs().max())
    eager_err = float((eager - want).abs().max())
    err = float((got - want).abs().max())
    assert err <= 4 * eager_err + 1e-6 * max(1.0, scale), (err, eager_err, scale)


# (GPT-2 and the Llama-style model in float32: the generation test; CI time kept short)
CASES = [("bert", "float32"), ("bert-written", "float32"), ("vit", "float32"),
         ("vit-large-image", "float32"), ("whisper", "float32"), ("encoder-layer", "float32"), ("encoder-fast", "float32"), ("resnet", "float32"), ("yolo", "float32"), ("conv-acts", "float32"), ("mobilenet-v2", "float32"), ("mobilenet-v2-tf", "float32"), ("efficientnet", "float32"), ("nemotron", "float32"), ("mlp-stack", "float32"), ("tabular", "float32"), ("tabular", "bfloat16"), ("levit", "float32"), ("mlp", "float32"), ("phi3", "float32"), ("falcon", "float32"),
         ("bloom", "float32"), ("gpt-neo", "float32"), ("mpt", "float32"), ("mpnet", "float32"), ("gemma2", "float32"), ("gemma2", "bfloat16"), ("bert", "bfloat16"), ("bloom", "bfloat16"), ("vit", "bfloat16"), ("gpt2", "bfloat16"), ("llama", "bfloat16")]  # fmt: skip


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_model_matches_eager_with_its_chains_fused(name: str, dtype: str) -> None:
    model, inputs, chains = _model(name)
    report = Report()
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(name != "encoder-layer")  # (off: its general path)
    try:
        _check_close(model, inputs, getattr(torch, dtype), report)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    assert report.graphs == 1  # fullgraph=True too: no graph break
    fused = [c for c in report.chains if c.fused]
    assert len(fused) >= chains, [(c.name, c.why) for c in report.chains]


@pytest.mark.parametrize(("name", "dtype"), [("resnet", "float32"), ("yolo", "float32"),
                                           ("conv-acts", "float32"), ("mobilenet-v2-tf", "float32"),
                                           ("resnet", "bfloat16"),
                                           ("conv-acts", "bfloat16")])  # fmt: skip
def test_frozen_conv_chains_read_their_weights_packed_once(
    name: str, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused conv chain of frozen weights reads them packed at compile time (a constant of
    the graph, batch norms folded in), never per call; the model's output within the rule.
    bf16: the AMX conv kernel (emulated here), its VNNI tiles packed once."""
    from chainfuse.kernels.amx import ENV_AMX
    from chainfuse.torch import backend as backend_mod

    monkeypatch.setenv(ENV_AMX, "emulate")

    graphs: list[Any] = []
    real = backend_mod.Backend._compile

    def kept(self: Any, gm: Any, *args: Any, **kwargs: Any) -> Any:
        graphs.append(gm)
        return real(self, gm, *args, **kwargs)

    monkeypatch.setattr(backend_mod.Backend, "_compile", kept)
    model, inputs, chains = _model(name)
    report = Report()
    _check_close(model, inputs, getattr(torch, dtype), report)
    fused = [c for c in report.chains if c.fused]
    assert len(fused) >= chains and all("weights packed once" in c.why for c in fused)
    (gm,) = graphs
    packed = [n for n in gm.graph.nodes if n.op == "get_attr" and "_cf_cpk_" in str(n.target)]
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.chainfuse.conv_chain.default]
    assert len(calls) == len(fused) and len(packed) == len(calls)
    assert all(n.args[9] in packed for n in calls)


@pytest.mark.parametrize("name", ["conv-acts", "tabular"])
def test_dynamic_shapes_keep_every_chain(name: str) -> None:
    """`dynamic=True`: the same chains as with static shapes, though Dynamo then passes a
    module's float attributes (ReLU6's bounds, a norm's eps) as graph inputs; every size's
    output within the rule, one graph for the sizes past the first."""
    model, inputs, chains = _model(name)
    model = model.eval()
    torch._dynamo.reset()
    report = Report()
    options = Options(mode="eager", measure=False)
    compiled = torch.compile(model, backend=Backend(options, report), dynamic=True)
    x = inputs[0]
    for rows in (x.shape[0], x.shape[0] + 3, x.shape[0] + 9):
        sized = torch.randn(rows, *x.shape[1:])
        with torch.no_grad():
            got, want, eager = compiled(sized).double(), model.double()(sized.double()), None
            model.float()
            eager = model(sized).double()
        scale, eager_err = float(want.abs().max()), float((eager - want).abs().max())
        assert float((got - want).abs().max()) <= 4 * eager_err + 1e-6 * max(1.0, scale)
    assert len([c for c in report.chains if c.fused]) == chains == len(report.chains)
    assert report.graphs == 1


def test_batch_norms_after_linears_fold_only_into_frozen_weights() -> None:
    """Unfrozen, the tabular MLP's chain is reported, not fused, with the reason; the model
    still gives eager's output."""
    model, inputs, _ = _model("tabular")
    report = Report()
    _check_close(model, inputs, torch.float32, report, freeze=False)
    (chain,) = report.chains
    assert not chain.fused and "folded only into frozen weights" in chain.why


def test_bf16_depthwise_chains_are_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 (AMX emulated) an expansion -> depthwise chain is reported, not fused: the
    depthwise conv runs in float32 only; the model still gives eager's output."""
    from chainfuse.kernels.amx import ENV_AMX

    monkeypatch.setenv(ENV_AMX, "emulate")
    net = nn.Sequential(nn.Conv2d(8, 48, 1), nn.ReLU6(), nn.Conv2d(48, 48, 3, padding=1, groups=48))
    report = Report()
    _check_close(net.eval(), (torch.randn(1, 8, 9, 9),), torch.bfloat16, report)
    (chain,) = report.chains
    assert not chain.fused and "a depthwise second conv runs in float32 only" in chain.why


def test_inductor_with_freezing_runs_the_fused_chains() -> None:
    """The default mode: the rewritten graph compiled by Inductor, parameters frozen (the MLP's
    weights packed once as constants)."""
    model, inputs, chains = _model("mlp")
    report = Report()
    _check_close(model, inputs, torch.float32, report, mode="inductor")
    assert sum(c.fused for c in report.chains) >= chains


@pytest.mark.parametrize("name", ["gpt2", "llama", "phi3", "bloom", "gemma2"])
def test_greedy_generation_gives_eager_tokens_without_recompiling(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """32 new tokens, one sequence length more at each step: one graph for all of them, and no
    chainfuse kernel compiled after the first step; the first step's logits within the rule
    of `_check_close`."""
    torch._dynamo.reset()
    model, _, chains = _model(name)
    model = model.eval()
    report = Report()
    compiled = torch.compile(model, backend=Backend(Options(mode="eager", measure=False), report),
                             fullgraph=True)  # fmt: skip
    builds: list[Any] = []
    real = cache._compile

    def counted(*args: Any) -> Any:
        builds.append(args)
        return real(*args)

    prompt = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(1))

    def greedy(fn: Any) -> list[int]:
        ids = prompt
        with torch.no_grad():
            for step in range(32):
                torch._dynamo.mark_dynamic(ids, 1)  # the sequence length: one graph for all
                logits = fn(ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
                if step == 0:  # the first step compiled what it needs; nothing after it may
                    monkeypatch.setattr(cache, "_compile", counted)
        return [int(t) for t in ids[0, 8:]]

    assert greedy(compiled) == greedy(model)
    with torch.no_grad():
        got = compiled(prompt, use_cache=False).logits.double()
        eager = model(prompt, use_cache=False).logits.double()
        want = model.double()(prompt, use_cache=False).logits
    err, eager_err = float((got - want).abs().max()), float((eager - want).abs().max())
    assert err <= 4 * eager_err + 1e-6 * max(1.0, float(want.abs().max())), (err, eager_err)
    assert report.graphs == 1
    assert not builds
    assert sum(c.fused for c in report.chains) >= chains, [(c.name, c.why) for c in report.chains]


def test_training_graphs_are_compiled_unchanged() -> None:
    torch._dynamo.reset()
    model, inputs, _ = _model("mlp")
    report = Report()
    out = _compiled(model.train(), report)(*inputs)
    out.sum().backward()
    assert not report.chains and "needs a backward" in report.notes[0]
    assert model[0].weight.grad is not None


def test_explain_reports_chains_reasons_and_share(capsys: pytest.CaptureFixture[str]) -> None:
    torch._dynamo.reset()
    model, inputs, _ = _model("bert")
    found = cft.explain(model.eval(), *inputs, mode="eager", measure=False)
    text = capsys.readouterr().out
    assert "chains found: 4" in text and "scaled_dot_product_attention" in text
    assert "linear+bias -> gelu -> linear+bias" in text
    assert "compute ops in no chain:" in text and "% of the compiled model's time" in text
    assert 0.0 <= found.share <= 1.5


def test_backend_is_found_without_importing_chainfuse() -> None:
    code = (
        "import sys, torch\n"
        "found = torch._dynamo.lookup_backend('chainfuse')\n"
        "print(type(found).__module__, 'chainfuse.torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "chainfuse.torch.backend True"


@pytest.mark.parametrize("name", ["bert", "llama", "phi3"])
def test_frozen_bf16_weights_are_packed_once_for_the_amx_kernels(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With Inductor and freezing, a bf16 model's MLP weights are constants: the backend packs
    them once for the AMX kernels (emulated here: any host) and every call reads that packing.
    The model's output is held to `_check_close`'s rule, with every MLP on an AMX kernel."""
    import importlib

    from chainfuse import ops
    from chainfuse.kernels.amx import AmxPath
    from chainfuse.torch import rewrite

    monkeypatch.setenv("CHAINFUSE_AMX", "emulate")
    packings: list[tuple[int, ...]] = []
    real_pack = ops.pack_weights

    def pack(*weights: Any) -> Any:
        packings.append(tuple(w.shape[1] for w in weights))
        return real_pack(*weights)

    monkeypatch.setattr(rewrite.ops, "pack_weights", pack)
    reads: list[int] = []
    real_run = importlib.import_module("chainfuse.ops.calls").run

    def counted(kernel: Any, *args: Any, packed_at: int = 0, **kwargs: Any) -> Any:
        if packed_at:
            assert kernel.arithmetic.startswith(AmxPath.EMULATED.value), kernel.arithmetic
            reads.append(packed_at)
        return real_run(kernel, *args, packed_at=packed_at, **kwargs)

    real_replay = importlib.import_module("chainfuse.ops.calls").replay

    def replayed(r: Any, operands: Any, out: Any, threads: int, packed_at: int = 0) -> Any:
        if packed_at:  # (a repeat call: what the first one's checks found, its packing too)
            reads.append(packed_at)
        return real_replay(r, operands, out, threads, packed_at)

    for module in ("chainfuse.ops.gemm_chain", "chainfuse.ops.gated_mlp"):
        monkeypatch.setattr(importlib.import_module(module), "run", counted)
        monkeypatch.setattr(importlib.import_module(module), "replay", replayed)
    model, inputs, chains = _model(name)
    report = Report()
    _check_close(model, inputs, torch.bfloat16, report, mode="inductor")
    mlps = 2  # two layers, one MLP each
    assert len(packings) == mlps, packings
    assert len(reads) >= mlps
    said = [c.name for c in report.chains if "weights packed once for the AMX kernels" in c.why]
    assert len(said) == mlps, [(c.name, c.why) for c in report.chains]
    # (every fused chain has the planner's prediction, the gated MLP's too)
    assert all(c.decision and c.decision.predicted_s for c in report.chains if c.fused)
    assert sum(c.fused for c in report.chains) >= chains, [(c.name, c.why) for c in report.chains]


def test_bloom_bf16_attention_runs_on_the_amx_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bloom in bf16 under Inductor with freezing, the AMX kernels emulated (any host): its
    ALiBi attention (baddbmm scores, the mask and bias as one mask tensor) runs on an AMX
    kernel, every chain is fused, and the output keeps `_check_close`'s rule."""
    import importlib

    from chainfuse.kernels.amx import AmxPath

    monkeypatch.setenv("CHAINFUSE_AMX", "emulate")
    module = importlib.import_module("chainfuse.ops.attention")
    arithmetic: list[str] = []
    real_run = module.run

    def counted(kernel: Any, *args: Any, **kwargs: Any) -> Any:
        arithmetic.append(kernel.arithmetic)
        return real_run(kernel, *args, **kwargs)

    monkeypatch.setattr(module, "run", counted)
    model, inputs, chains = _model("bloom")
    report = Report()
    _check_close(model, inputs, torch.bfloat16, report, mode="inductor")
    assert arithmetic and all(a.startswith(AmxPath.EMULATED.value) for a in arithmetic), arithmetic
    assert sum(c.fused for c in report.chains) >= chains, [(c.name, c.why) for c in report.chains]
