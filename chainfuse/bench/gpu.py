"""`chainfuse bench --device cuda`: the Triton kernels against PyTorch on one CUDA GPU.

Suites (fp16 by default, `--dtype` as the CPU bench): GEMM chains on the paper's attention-shaped
workloads against two `torch.bmm`s (and the op between); attention against SDPA's flash backend
and `torch.compile`d SDPA, masked and causal cases against SDPA's default choice (flash refuses
an explicit mask); MLPs (Mixer channel MLPs) against `F.linear`, gelu, `F.linear`. Every result
is checked against the float64 reference with the shared tolerance before it is timed; times are
medians of CUDA-event timings (`triton.testing.do_bench`); "% of peak" is against the preset's
dense tensor-core peak for the dtype (`Hardware.detect("cuda").gpu`). Writes `results.json` with
the CPU bench's `Result` records to `--out`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from chainfuse import builders, reference
from chainfuse.bench import workloads
from chainfuse.bench.results import Result, geomean
from chainfuse.hardware import Hardware
from chainfuse.ops import gpu
from chainfuse.runtime.triton import INSTALL_HINT, triton_available

__all__ = ["main"]

# the paper's twelve attention-shaped workloads (Bert, ViT, Mixer token mixing) and its MLPs
ATTENTION_SHAPED = tuple(w.name for w in workloads.GEMM if not w.name.endswith("-c"))
QUICK_GEMM = ("bert-base", "bert-large", "vit-huge-14")
MLPS = tuple(w.name for w in workloads.GEMM if w.name.endswith("-c"))


def _gemm_workload(name: str) -> workloads.GemmWorkload:
    w = workloads.find(name)
    assert isinstance(w, workloads.GemmWorkload)
    return w


def _bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, return_mode="median"))


def _checked(got: Any, want: Any, chain: Any) -> None:
    reference.assert_close(got.double().cpu().numpy(), want.double().cpu().numpy(), chain)


def _gemm_case(torch: Any, name: str, between: str, dtype: Any, dname: str) -> Result:
    F = torch.nn.functional
    chain = workloads.chain_of(name, None if between == "none" else between, dname)
    b, M, N, K, L = (chain.extents[n] for n in "bmnkl")
    A, B, D = (
        torch.randn(s, device="cuda", dtype=dtype) / math.sqrt(s[-1])
        for s in ((b, M, K), (b, K, L), (b, L, N))
    )

    def f(c: Any) -> Any:
        return c if between == "none" else F.softmax(c, -1)

    def ours() -> Any:
        return gpu.gemm_chain(A, B, D, None if between == "none" else between)

    def two() -> Any:
        return torch.bmm(f(torch.bmm(A, B)), D)

    _checked(ours(), f(A.double() @ B.double()) @ D.double(), chain)
    ms = {"chainfuse": _bench(ours), "torch.bmm x2": _bench(two)}
    return Result("gemm-chain-gpu", name, between, 1, chain.flops() / 1e9, ms, ("torch.bmm x2",),
                  dtype=dname)  # fmt: skip


def _attention_case(
    torch: Any, compiled: Any, name: str, variant: str, dtype: Any, dname: str
) -> Result:
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    w = _gemm_workload(name)
    b, M, N, K, L = w.batch, w.M, w.N, w.K, w.L
    q, k, v = (
        torch.randn(1, b, n, d, device="cuda", dtype=dtype) for n, d in ((M, K), (L, K), (L, N))
    )
    mask = None
    if variant == "padding mask":  # the last eighth of the keys is padding
        mask = torch.ones(1, 1, 1, L, device="cuda", dtype=torch.bool)
        mask[..., L - L // 8 :] = False
    causal = variant == "causal"
    chain = builders.attention_chain(
        1, b, M, L, K, N, causal, None if mask is None else "bool",
        mask_shape=None if mask is None else (1, 1, 1, L), dtype=dname,
    )  # fmt: skip

    def ours() -> Any:
        return gpu.attention(q, k, v, mask, causal)

    def sdpa() -> Any:
        return F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)

    def sdpa_compiled() -> Any:
        return compiled(q, k, v, mask, is_causal=causal)

    want = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), mask, is_causal=causal
    )
    _checked(ours(), want, chain)
    ms = {"chainfuse": _bench(ours), "sdpa": _bench(sdpa), "sdpa compiled": _bench(sdpa_compiled)}
    baselines: tuple[str, ...] = ("sdpa", "sdpa compiled")
    if mask is None:  # flash takes no explicit mask: the masked case is against SDPA's choice
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            ms["sdpa flash"] = _bench(sdpa)
        baselines = ("sdpa flash", *baselines)
    return Result("attention-gpu", name, variant, 1, chain.flops() / 1e9, ms, baselines,
                  dtype=dname)  # fmt: skip


def _mlp_case(torch: Any, name: str, dtype: Any, dname: str) -> Result:
    F = torch.nn.functional
    w = _gemm_workload(name)
    x = torch.randn(w.batch * w.M, w.K, device="cuda", dtype=dtype)
    w1 = torch.randn(w.L, w.K, device="cuda", dtype=dtype) / math.sqrt(w.K)
    w2 = torch.randn(w.N, w.L, device="cuda", dtype=dtype) / math.sqrt(w.L)
    chain = builders.mlp_chain(w.batch * w.M, w.K, w.L, w.N, "gelu", dname)

    def ours() -> Any:
        return gpu.mlp(x, w1.T, w2.T, activation="gelu")

    def torch_mlp() -> Any:
        return F.linear(F.gelu(F.linear(x, w1)), w2)

    _checked(ours(), F.gelu(x.double() @ w1.double().T) @ w2.double().T, chain)
    ms = {"chainfuse": _bench(ours), "F.linear/gelu/F.linear": _bench(torch_mlp)}
    return Result("mlp-gpu", name, "gelu", 1, chain.flops() / 1e9, ms,
                  ("F.linear/gelu/F.linear",), dtype=dname)  # fmt: skip


def main(suites: Sequence[str], quick: bool, dtypes: Sequence[str], out_dir: str) -> int:
    """Run the GPU suites; 2 (with a message) where no CUDA device or Triton is present."""
    try:
        import torch
    except ImportError:
        print("chainfuse bench --device cuda: needs torch with CUDA", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("chainfuse bench --device cuda: no CUDA device here (torch.cuda.is_available() "
              "is False)", file=sys.stderr)  # fmt: skip
        return 2
    if not triton_available():
        print(f"chainfuse bench --device cuda: {INSTALL_HINT}", file=sys.stderr)
        return 2
    hw = Hardware.detect("cuda")
    print(hw)
    gemm_names = QUICK_GEMM if quick else ATTENTION_SHAPED
    att_names = QUICK_GEMM[:2] if quick else ATTENTION_SHAPED
    mlp_names = MLPS[:1] if quick else MLPS
    results: list[Result] = []
    kinds = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    with torch.inference_mode():
        for dname in dtypes:
            dtype = kinds[dname]
            if "gemm-chain" in suites:
                for name in gemm_names:
                    results += [
                        _gemm_case(torch, name, b, dtype, dname) for b in ("none", "softmax")
                    ]
            if "attention" in suites:
                compiled = torch.compile(torch.nn.functional.scaled_dot_product_attention)
                for name in att_names:
                    results += [_attention_case(torch, compiled, name, v, dtype, dname)
                                for v in ("plain", "causal", "padding mask")]  # fmt: skip
            if "mlp" in suites:
                results += [_mlp_case(torch, name, dtype, dname) for name in mlp_names]
    assert hw.gpu is not None
    for r in results:
        peak = hw.gpu.tensor_peak(r.dtype if r.dtype != "float32" else "tf32") or math.nan
        share = r.gflops() * 1e9 / peak
        print(f"{r.suite:<15} {r.workload:<14} {r.variant:<13} {r.dtype:<8} "
              f"{r.ms['chainfuse']:.4f} ms  x{r.speedup():.2f} vs {r.best_baseline()}  "
              f"{share:.1%} of tensor-core peak")  # fmt: skip
    for suite in dict.fromkeys(r.suite for r in results):
        mine = [r for r in results if r.suite == suite]
        print(f"{suite}: geomean x{geomean([r.speedup() for r in mine]):.2f} over the fastest "
              f"baseline ({len(mine)} cases)")  # fmt: skip
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "results-gpu.json").write_text(
        json.dumps({"hardware": hw.name, "results": [r.to_dict() for r in results]}, indent=1)
    )
    print(f"wrote {path / 'results-gpu.json'}")
    return 0
