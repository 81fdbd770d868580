"""`chainfuse bench models`: whole models end to end, `backend="chainfuse"` against eager PyTorch,
Inductor, and Inductor with freezing (fp32 and bf16, 1 and 2 threads).

    chainfuse bench models                 # the full-size models below (fp32, bf16; 1, 2 threads)
    chainfuse bench models --quick         # small configs of the same models (~minutes)
    chainfuse bench models --models whisper,vit384 --dtype fp32 --threads 1 --out bench-models

The models: `bert` (BERT-base, 128 tokens), `vit` (ViT-base, 224 px: 197 tokens), `vit384`
(ViT-base, 384 px: 577 tokens), `vit512` (ViT-base, 512 px: 1025 tokens), `gpt2` (GPT-2 124M, a 1024-token prompt), `llama` (a 1024-wide
8-layer Llama-style model, GQA 4:1, 256 tokens), `llama4k` (4 of its layers, a 4096-token
prompt: attention about a quarter of its flops), `whisper` (the encoder of a Whisper-base-sized
model: 80 mel bins x 3000 frames, a stride-2 conv stem, then 6 layers of attention over 1500
positions) and `nn-encoder` (PyTorch's own `nn.TransformerEncoder`, BERT-base-wide, 4 layers,
GELU, a batch of two 512-token sequences, the second padded to 384 by `src_key_padding_mask`:
eager runs its fused fast path on nested tensors; the backend sees through the fast path). The
causal LMs run as a generation's prefill runs them: `logits_to_keep=1`, so only
the last position's logits are computed (what `generate` passes; the forward of
`GPT2LMHeadModel` and `LlamaForCausalLM` in transformers 5.x takes it) and the vocabulary-wide
head over every position does not swamp the comparison.

Models are built from their Hugging Face configs with random weights (nothing downloaded; needs
`transformers`). Each variant runs in a process of its own (compiled there; OpenMP threads told to
sleep when idle, `OMP_WAIT_POLICY=PASSIVE` unless set, so a waiting variant does not spin while
another is timed), then the variants are timed interleaved, one call each per round (`--rounds`),
every other round in the reverse order.
Reported: each variant's median, and the speed-up over Inductor with freezing (the alternative a
user has) as the median of the per-round ratios (Inductor-with-freezing time / chainfuse time in
the same round: a noisy host slows both alike within a round) with their interquartile range;
the share of chainfuse's time spent in fused chains. `models.json` keeps every round's samples.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["Spread", "main", "speedup"]

VARIANTS = ("eager", "inductor", "inductor-freezing", "chainfuse")
MODELS = (
    "bert", "vit", "vit384", "vit512", "gpt2", "llama", "llama4k", "whisper", "bloom", "gemma2",
    "nn-encoder", "resnet50", "mobilenet-v2", "efficientnet",
)  # fmt: skip
# a model, its positional inputs and its keyword inputs
Built = tuple[Any, tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Spread:
    """A per-round ratio's median and its first and third quartiles."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"


def speedup(theirs: Sequence[float], ours: Sequence[float]) -> Spread:
    """Round by round, their time over ours (above 1: ours faster); the median and quartiles of
    those ratios (not the ratio of the medians: each round's two calls share the host's load)."""
    if len(theirs) != len(ours) or not ours:
        raise ValueError(f"speedup: theirs and ours need the same number (> 0) of rounds "
                         f"(got {len(theirs)} and {len(ours)})")  # fmt: skip
    if any(t <= 0 for t in (*theirs, *ours)):
        raise ValueError("speedup: times must be positive")
    ratios = [t / o for t, o in zip(theirs, ours, strict=True)]
    if len(ratios) == 1:
        return Spread(ratios[0], ratios[0], ratios[0])
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return Spread(statistics.median(ratios), low, high)


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    threads: int
    samples_s: dict[str, list[float]]  # per variant, one call per round, in round order
    fused_chains: int
    chains: int
    fused_share: float

    @property
    def times_s(self) -> dict[str, float]:
        return {v: statistics.median(s) for v, s in self.samples_s.items()}

    def speedup(self, over: str) -> Spread:
        return speedup(self.samples_s[over], self.samples_s["chainfuse"])

    def to_json(self) -> dict[str, Any]:
        spreads = {v: asdict(self.speedup(v)) for v in VARIANTS if v != "chainfuse"}
        return {**asdict(self), "median_s": self.times_s, "speedup_over": spreads}


def _models(quick: bool) -> dict[str, Callable[[], Built]]:
    import importlib

    import torch

    tf: Any = importlib.import_module("transformers")

    def ids(n: int) -> Any:
        return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(0))

    def image(size: int) -> Any:
        return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))

    # (hidden, layers, heads, intermediate, tokens / pixels / positions) per model;
    # Llama-style: GQA 4:1; Whisper: 2 mel frames per position (the conv stem's stride 2)
    if quick:
        bert, vit, vit384, vit512, gpt2, llama, llama4k, whisper, bloom, gemma2, encoder = (
            (128, 2, 4, 512, 64),
            (128, 2, 4, 512, 64),
            (128, 2, 4, 512, 128),
            (128, 2, 4, 512, 160),
            (128, 2, 4, 512, 128),
            (128, 2, 4, 384, 64),
            (128, 2, 4, 384, 256),
            (128, 2, 4, 512, 250),
            (128, 2, 4, 512, 128),
            (128, 2, 4, 512, 128),
            (128, 2, 4, 512, 128),
        )
    else:  # BERT-base, ViT-base at 224, 384 and 512 px, GPT-2 (124M) with a 1024-token
        # prompt, a 1024-wide Llama (and 4 of its layers with a 4096-token prompt), a
        # Whisper-base-sized encoder (1500 positions), a
        # Bloom-560m-wide model (ALiBi attention) with 8 of its 24 layers and a 512-token prompt,
        # a Gemma-2-2B-wide model (soft-capped attention, head dim 256, GQA 2:1, sliding-window
        # layers) with 4 of its 26 layers and a 512-token prompt
        bert, vit, vit384, vit512, gpt2, llama, llama4k, whisper, bloom, gemma2, encoder = (
            (768, 12, 12, 3072, 128),
            (768, 12, 12, 3072, 224),
            (768, 12, 12, 3072, 384),
            (768, 12, 12, 3072, 512),
            (768, 12, 12, 3072, 1024),
            (1024, 8, 16, 2816, 256),
            (1024, 4, 16, 2816, 4096),
            (512, 6, 8, 2048, 1500),
            (1024, 8, 16, 4096, 512),
            (2304, 4, 8, 9216, 512),
            (768, 4, 12, 3072, 512),
        )
    patch = 16 if not quick else 8
    prefill = {"logits_to_keep": 1}  # (as `generate` calls the model on the prompt)

    def sizes(c: tuple[int, ...]) -> dict[str, int]:
        return {"hidden_size": c[0], "num_hidden_layers": c[1], "num_attention_heads": c[2],
                "intermediate_size": c[3]}  # fmt: skip

    def make_bert() -> Built:
        return tf.BertModel(tf.BertConfig(**sizes(bert))), (ids(bert[4]),), {}

    def make_vit(c: tuple[int, ...]) -> Built:
        config = tf.ViTConfig(image_size=c[4], patch_size=patch, **sizes(c))
        return tf.ViTModel(config), (image(c[4]),), {}

    def make_gpt2() -> Built:
        config = tf.GPT2Config(n_embd=gpt2[0], n_layer=gpt2[1], n_head=gpt2[2], n_inner=gpt2[3],
                               n_positions=max(1024, gpt2[4]))  # fmt: skip
        return tf.GPT2LMHeadModel(config), (ids(gpt2[4]),), prefill

    def make_llama(c: tuple[int, ...]) -> Built:
        config = tf.LlamaConfig(num_key_value_heads=c[2] // 4, vocab_size=32000,
                                max_position_embeddings=max(2048, c[4]), **sizes(c))  # fmt: skip
        return tf.LlamaForCausalLM(config), (ids(c[4]),), prefill

    def make_whisper() -> Built:
        # the encoder alone (transformers 5.x keeps its class in the modeling module); it takes
        # exactly 2 * max_source_positions frames, so the quick one has fewer positions
        whisper_encoder = importlib.import_module("transformers.models.whisper.modeling_whisper")
        config = tf.WhisperConfig(d_model=whisper[0], encoder_layers=whisper[1],
                                  encoder_attention_heads=whisper[2], encoder_ffn_dim=whisper[3],
                                  num_mel_bins=80, max_source_positions=whisper[4])  # fmt: skip
        mel = torch.randn(1, 80, 2 * whisper[4], generator=torch.Generator().manual_seed(0))
        return whisper_encoder.WhisperEncoder(config), (mel,), {}

    def make_bloom() -> Built:  # (Bloom's MLP is 4x its hidden size: bloom[3] is that)
        config = tf.BloomConfig(hidden_size=bloom[0], n_layer=bloom[1], n_head=bloom[2],
                                vocab_size=32000)  # fmt: skip
        return tf.BloomForCausalLM(config), (ids(bloom[4]),), prefill

    def make_gemma2() -> Built:  # (eager attention: SDPA has no soft-capping)
        head = 256 if not quick else 32
        config = tf.Gemma2Config(num_key_value_heads=gemma2[2] // 2, head_dim=head,
                                 query_pre_attn_scalar=head, sliding_window=4096,
                                 vocab_size=32000, **sizes(gemma2))  # fmt: skip
        return tf.Gemma2ForCausalLM(config), (ids(gemma2[4]),), prefill

    def make_resnet() -> Built:  # (its bottlenecks' conv 1x1 -> BN -> ReLU -> conv 3x3 chains)
        config = tf.ResNetConfig() if not quick else tf.ResNetConfig(
            embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1])  # fmt: skip
        return tf.ResNetModel(config), (image(224 if not quick else 64),), {}

    def make_mobilenet() -> Built:  # (its expansion -> depthwise chains; torchvision's padding)
        config = tf.MobileNetV2Config(tf_padding=False, depth_multiplier=1.0 if not quick else 0.35)
        return tf.MobileNetV2Model(config), (image(224 if not quick else 64),), {}

    def make_efficientnet() -> Built:  # (B0: expansion -> depthwise with SiLU, padding "same")
        config = tf.EfficientNetConfig() if not quick else tf.EfficientNetConfig(
            image_size=64, depth_coefficient=0.5)  # fmt: skip
        return tf.EfficientNetModel(config), (image(224 if not quick else 64),), {}

    def make_encoder() -> Built:  # (eval mode: the layers' fused fast path where eager runs)
        nn = torch.nn
        layer = nn.TransformerEncoderLayer(encoder[0], encoder[2], encoder[3], batch_first=True,
                                           activation="gelu")  # fmt: skip
        x = torch.randn(2, encoder[4], encoder[0], generator=torch.Generator().manual_seed(0))
        padding = torch.zeros(2, encoder[4], dtype=torch.bool)
        padding[1, encoder[4] * 3 // 4 :] = True
        model = nn.TransformerEncoder(layer, encoder[1])
        return model, (x,), {"src_key_padding_mask": padding}

    return {"bert": make_bert, "vit": lambda: make_vit(vit), "vit384": lambda: make_vit(vit384),
            "vit512": lambda: make_vit(vit512), "gpt2": make_gpt2,
            "llama": lambda: make_llama(llama), "llama4k": lambda: make_llama(llama4k),
            "whisper": make_whisper, "bloom": make_bloom, "gemma2": make_gemma2,
            "nn-encoder": make_encoder, "resnet50": make_resnet,
            "mobilenet-v2": make_mobilenet, "efficientnet": make_efficientnet}  # fmt: skip


def _variant(name: str, model: Any) -> tuple[Callable[..., Any], Any]:
    """The callable of one variant and the chainfuse report (None for the others)."""
    import torch

    from chainfuse.torch.backend import Backend, Report

    if name == "eager":
        return model, None
    if name == "chainfuse":  # (as chainfuse.torch.compile: freezing on while Dynamo traces)
        report = Report()
        chained: Any = torch.compile(model, backend=Backend(report=report))

        def fused(*args: Any, **kwargs: Any) -> Any:
            with torch._inductor.config.patch(freezing=True):
                return chained(*args, **kwargs)

        return fused, report
    from torch._inductor.compile_fx import compile_fx

    # a backend object of its own per variant: Dynamo keeps one compiled graph per backend, and
    # a second torch.compile with the same one would reuse the first's (unfrozen) graph
    def inductor(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs)

    compiled: Any = torch.compile(model, backend=inductor)
    if name == "inductor":
        return compiled, None

    def frozen(*args: Any, **kwargs: Any) -> Any:  # (freezing must be on while Dynamo traces)
        with torch._inductor.config.patch(freezing=True):
            return compiled(*args, **kwargs)

    return frozen, None


def _time_once(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _worker(conn: Any, name: str, quick: bool, dtype: str, threads: int, variant: str) -> None:
    """One variant of one model in a process of its own: compile, report ready, then time one
    call per request. (In one process the variants would share Dynamo's cache of the model's
    code, and every call would first run the guards of the variants compiled after it.)"""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, inputs, kwargs = _models(quick)[name]()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = model.eval().to(torch_dtype)
    inputs = tuple(x.to(torch_dtype) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        start = time.perf_counter()
        fn, report = _variant(variant, model)
        fn(*inputs, **kwargs)
        fn(*inputs, **kwargs)
        conn.send(time.perf_counter() - start)
        while conn.recv() == "time":
            conn.send(_time_once(fn, inputs, kwargs))
    fused = [c for c in report.chains if c.fused] if report is not None else []
    fused_s = sum(c.decision.fused_s or 0.0 for c in fused if c.decision is not None)
    conn.send((len(fused), len(report.chains) if report is not None else 0, fused_s))


def run_model(name: str, quick: bool, dtype: str, threads: int, rounds: int,
              log: Callable[[str], None]) -> Row:  # fmt: skip
    """The variants compiled one after another, each in its own process, then timed
    interleaved: one call of each per round, in the reverse order every other round."""
    import multiprocessing

    # (read by OpenMP when a worker loads torch: its idle threads sleep instead of spinning)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    ctx = multiprocessing.get_context("spawn")
    pipes = {}
    procs = []
    for variant in VARIANTS:
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(theirs, name, quick, dtype, threads, variant))
        proc.start()
        procs.append(proc)
        pipes[variant] = ours
        log(f"{name} {dtype} {threads}t: {variant} ready in {ours.recv():.0f} s")
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        # (the order reversed every other round: a drift of the host's speed within a round
        # favours no variant over the rounds, nor does the call before a variant's)
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            pipes[variant].send("time")
            samples[variant].append(pipes[variant].recv())
    stats = []
    for pipe in pipes.values():
        pipe.send("stop")
        stats.append(pipe.recv())
    for proc in procs:
        proc.join()
    fused, chains, fused_s = stats[VARIANTS.index("chainfuse")]
    share = fused_s / statistics.median(samples["chainfuse"])
    return Row(name, dtype, threads, samples, fused, chains, share)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | dtype | threads | eager ms | inductor ms | inductor+freezing ms | chainfuse ms "
        "| vs inductor+freezing (IQR) | vs eager | chains fused | fused share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = {k: f"{v * 1e3:.1f}" for k, v in r.times_s.items()}
        lines.append(
            f"| {r.model} | {r.dtype} | {r.threads} | {t['eager']} | {t['inductor']} | "
            f"{t['inductor-freezing']} | {t['chainfuse']} | "
            f"{r.speedup('inductor-freezing')} | {r.speedup('eager').median:.2f}x | "
            f"{r.fused_chains}/{r.chains} | {100 * r.fused_share:.1f} % |"
        )
    return "\n".join(lines)


def _log(text: str) -> None:
    print(text, flush=True)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="chainfuse bench models", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small configs of the same models")
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--dtype", default="fp32,bf16", help="comma-separated, of fp32 and bf16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=9, help="interleaved timing rounds")
    p.add_argument("--out", default=None, help="directory for models.md and models.json")
    args = p.parse_args(list(argv))
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("chainfuse bench models: needs transformers (pip install 'chainfuse[bench]')")
        return 2
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    dtypes = [d for d in args.dtype.split(",") if d]
    if unknown:
        raise ValueError(f"--models: of {', '.join(MODELS)} (got {', '.join(unknown)})")
    if not dtypes or any(d not in ("fp32", "bf16") for d in dtypes):
        raise ValueError(f"--dtype: fp32, bf16 or fp32,bf16 (got {args.dtype!r})")
    threads_list = [t for t in args.threads.split(",") if t]
    if not all(t.isdigit() and int(t) > 0 for t in threads_list) or args.rounds < 1:
        raise ValueError(f"--threads: positive integers, comma-separated; --rounds: at least 1 "
                         f"(got {args.threads!r}, {args.rounds})")  # fmt: skip
    rows = []
    for threads in [int(t) for t in threads_list]:
        for name in names:
            for dtype in dtypes:
                row = run_model(name, args.quick, dtype, threads, args.rounds, _log)
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "models.md").write_text(text + "\n")
        (out / "models.json").write_text(json.dumps([r.to_json() for r in rows], indent=1))
    return 0
