"""`chainfuse bench models`: whole models end to end, `backend="chainfuse"` against eager PyTorch,
Inductor, and Inductor with freezing (fp32 and bf16, 1 and 2 threads).

    chainfuse bench models                 # BERT-base, ViT-base, GPT-2 (1024-token prompt), Llama-style
    chainfuse bench models --quick         # small configs of the same models (~minutes)
    chainfuse bench models --models bert --dtype fp32 --threads 1 --out bench-models

Models are built from their Hugging Face configs with random weights (nothing downloaded; needs
`transformers`). Each variant runs in a process of its own (compiled there), then the variants
are timed interleaved, one call each per round (`--rounds`), and the median is reported with the speed-up over
Inductor with freezing (the alternative a user has) and the share of chainfuse's time spent
in fused chains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["main"]

VARIANTS = ("eager", "inductor", "inductor-freezing", "chainfuse")


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    threads: int
    times_s: dict[str, float]
    fused_chains: int
    chains: int
    fused_share: float

    def speedup(self, over: str) -> float:
        return self.times_s[over] / self.times_s["chainfuse"]


def _models(quick: bool) -> dict[str, Callable[[], tuple[Any, tuple[Any, ...]]]]:
    import importlib

    import torch

    tf: Any = importlib.import_module("transformers")

    def ids(n: int) -> Any:
        return torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(0))

    def image(size: int) -> Any:
        return torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(0))

    # (hidden, layers, heads, intermediate, tokens or pixels) per model; Llama-style: GQA 4:1
    if quick:
        bert, vit, gpt2, llama = (
            (128, 2, 4, 512, 64),
            (128, 2, 4, 512, 64),
            (128, 2, 4, 512, 128),
            (128, 2, 4, 384, 64),
        )
    else:  # BERT-base, ViT-base, GPT-2 (124M) with a 1024-token prompt, a 1024-wide Llama
        bert, vit, gpt2, llama = (
            (768, 12, 12, 3072, 128),
            (768, 12, 12, 3072, 224),
            (768, 12, 12, 3072, 1024),
            (1024, 8, 16, 2816, 256),
        )

    def sizes(c: tuple[int, ...]) -> dict[str, int]:
        return {"hidden_size": c[0], "num_hidden_layers": c[1], "num_attention_heads": c[2],
                "intermediate_size": c[3]}  # fmt: skip

    def make_bert() -> tuple[Any, tuple[Any, ...]]:
        return tf.BertModel(tf.BertConfig(**sizes(bert))), (ids(bert[4]),)

    def make_vit() -> tuple[Any, tuple[Any, ...]]:
        config = tf.ViTConfig(image_size=vit[4], patch_size=16 if not quick else 8, **sizes(vit))
        return tf.ViTModel(config), (image(vit[4]),)

    def make_gpt2() -> tuple[Any, tuple[Any, ...]]:
        config = tf.GPT2Config(n_embd=gpt2[0], n_layer=gpt2[1], n_head=gpt2[2], n_inner=gpt2[3],
                               n_positions=max(1024, gpt2[4]))  # fmt: skip
        return tf.GPT2LMHeadModel(config), (ids(gpt2[4]),)

    def make_llama() -> tuple[Any, tuple[Any, ...]]:
        config = tf.LlamaConfig(num_key_value_heads=llama[2] // 4, vocab_size=32000,
                                **sizes(llama))  # fmt: skip
        return tf.LlamaForCausalLM(config), (ids(llama[4]),)

    return {"bert": make_bert, "vit": make_vit, "gpt2": make_gpt2, "llama": make_llama}


def _variant(name: str, model: Any) -> tuple[Callable[..., Any], Any]:
    """The callable of one variant and the chainfuse report (None for the others)."""
    import torch

    from chainfuse.torch.backend import Backend, Report

    if name == "eager":
        return model, None
    if name == "chainfuse":  # (as chainfuse.torch.compile: freezing on while Dynamo traces)
        report = Report()
        chained: Any = torch.compile(model, backend=Backend(report=report))

        def fused(*args: Any) -> Any:
            with torch._inductor.config.patch(freezing=True):
                return chained(*args)

        return fused, report
    from torch._inductor.compile_fx import compile_fx

    # a backend object of its own per variant: Dynamo keeps one compiled graph per backend, and
    # a second torch.compile with the same one would reuse the first's (unfrozen) graph
    def inductor(gm: Any, example_inputs: Any) -> Any:
        return compile_fx(gm, example_inputs)

    compiled: Any = torch.compile(model, backend=inductor)
    if name == "inductor":
        return compiled, None

    def frozen(*args: Any) -> Any:  # (freezing must be on while Dynamo traces)
        with torch._inductor.config.patch(freezing=True):
            return compiled(*args)

    return frozen, None


def _time_once(fn: Callable[..., Any], args: tuple[Any, ...]) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _worker(conn: Any, name: str, quick: bool, dtype: str, threads: int, variant: str) -> None:
    """One variant of one model in a process of its own: compile, report ready, then time one
    call per request. (In one process the variants would share Dynamo's cache of the model's
    code, and every call would first run the guards of the variants compiled after it.)"""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, inputs = _models(quick)[name]()
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = model.eval().to(torch_dtype)
    inputs = tuple(x.to(torch_dtype) if x.is_floating_point() else x for x in inputs)
    with torch.no_grad():
        start = time.perf_counter()
        fn, report = _variant(variant, model)
        fn(*inputs)
        fn(*inputs)
        conn.send(time.perf_counter() - start)
        while conn.recv() == "time":
            conn.send(_time_once(fn, inputs))
    fused = [c for c in report.chains if c.fused] if report is not None else []
    fused_s = sum(c.decision.fused_s or 0.0 for c in fused if c.decision is not None)
    conn.send((len(fused), len(report.chains) if report is not None else 0, fused_s))


def run_model(name: str, quick: bool, dtype: str, threads: int, rounds: int,
              log: Callable[[str], None]) -> Row:  # fmt: skip
    """The variants compiled one after another, each in its own process, then timed
    interleaved: one call of each per round; the median per variant."""
    import multiprocessing

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
    for _ in range(rounds):
        for variant, pipe in pipes.items():
            pipe.send("time")
            samples[variant].append(pipe.recv())
    stats = []
    for pipe in pipes.values():
        pipe.send("stop")
        stats.append(pipe.recv())
    for proc in procs:
        proc.join()
    times = {v: statistics.median(s) for v, s in samples.items()}
    fused, chains, fused_s = stats[VARIANTS.index("chainfuse")]
    return Row(name, dtype, threads, times, fused, chains, fused_s / times["chainfuse"])


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | dtype | threads | eager ms | inductor ms | inductor+freezing ms | chainfuse ms "
        "| vs inductor+freezing | vs eager | chains fused | fused share |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = {k: f"{v * 1e3:.1f}" for k, v in r.times_s.items()}
        lines.append(
            f"| {r.model} | {r.dtype} | {r.threads} | {t['eager']} | {t['inductor']} | "
            f"{t['inductor-freezing']} | {t['chainfuse']} | "
            f"{r.speedup('inductor-freezing'):.2f}x | {r.speedup('eager'):.2f}x | "
            f"{r.fused_chains}/{r.chains} | {100 * r.fused_share:.1f} % |"
        )
    return "\n".join(lines)


def _log(text: str) -> None:
    print(text, flush=True)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="chainfuse bench models", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small configs of the same models")
    p.add_argument("--models", default="bert,vit,gpt2,llama")
    p.add_argument("--dtype", default="fp32,bf16", help="fp32, bf16 or both")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds")
    p.add_argument("--out", default=None, help="directory for models.md and models.json")
    args = p.parse_args(list(argv))
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("chainfuse bench models: needs transformers (pip install 'chainfuse[bench]')")
        return 2
    makers = ("bert", "vit", "gpt2", "llama")
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in makers]
    dtypes = [d for d in args.dtype.split(",") if d]
    if unknown or any(d not in ("fp32", "bf16") for d in dtypes):
        raise ValueError(f"--models: one of {sorted(makers)}; --dtype: fp32, bf16 "
                         f"(got {args.models!r}, {args.dtype!r})")  # fmt: skip
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
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
        (out / "models.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0
