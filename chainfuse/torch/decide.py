"""Fuse or not: time the fused call against the ops it replaces, on the graph's own shapes.

The baseline is the chain's nodes run as PyTorch runs them outside a compiler (its MKL/oneDNN
GEMMs, its SDPA and convolutions): the calls Inductor also makes for them on a CPU, where it
does not fuse GEMM -> GEMM. The fused call must beat it by `MARGIN` and give the same numbers
within a loose sanity bound; else the chain stays unfused. The decision is kept on disk beside
the kernel cache (`<cache_dir>/decisions/`), keyed by everything the timing depends on, so a
second compile of the same model on the same host decides without timing.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chainfuse import builders, config, planner
from chainfuse.runtime import cache
from chainfuse.runtime.files import write_atomic

__all__ = ["MARGIN", "Decision", "decide", "predicted_time", "time_call"]

#: the fused call is kept where it takes at most this share of the baseline's time
MARGIN = 0.97
_VERSION = 1  # of the decision record: bumped when what is measured changes


@dataclass(frozen=True)
class Decision:
    fuse: bool
    why: str
    fused_s: float | None = None
    baseline_s: float | None = None
    predicted_s: float | None = None
    cached: bool = False


def time_call(fn: Callable[[], Any], budget_s: float = 0.02) -> float:
    """Seconds per call of `fn`: calls are batched to fill `budget_s`, best batch of three."""
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    reps = max(1, min(1000, int(budget_s / once)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def _path(key: str) -> Path:
    return config.cache_dir() / "decisions" / key[:2] / f"{key}.json"


def decision_key(parts: Sequence[Any]) -> str:
    """The cache key of a decision: what was timed and where (host, threads, versions)."""
    from chainfuse import __version__

    host = cache._host_fingerprint()
    text = json.dumps([_VERSION, __version__, torch.__version__, host, *parts], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _close(got: Any, want: Any) -> bool:
    """A sanity bound on the fused result (the numerics are tested against the float64
    reference; this catches a wrongly wired rewrite before it is kept)."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return False
    if got.shape != want.shape:
        return False
    g, w = got.double(), want.double()
    tol = 2e-2 if want.dtype in (torch.bfloat16, torch.float16) else 1e-3
    return bool(((g - w).abs().max() <= tol * max(1.0, float(w.abs().max()))).item())


def decide(
    key_parts: Sequence[Any],
    fused: Callable[[], Any],
    baseline: Callable[[], Any],
    predicted_s: float | None,
    measure: bool = True,
) -> Decision:
    """Time `fused` and `baseline` (interleaved), keep the faster, remember the answer.
    `measure=False` fuses without timing (the fused result is still checked)."""
    key = decision_key(key_parts)
    path = _path(key)
    if measure and path.exists():
        try:
            return Decision(**{**json.loads(path.read_text()), "cached": True})
        except (OSError, ValueError, TypeError):
            pass  # a damaged record: decide again
    try:
        got = fused()
    except (RuntimeError, ValueError, TypeError) as exc:
        return Decision(False, f"the fused call failed: {exc}", predicted_s=predicted_s)
    want = baseline()
    if not _close(got, want):
        return Decision(False, "the fused result differs from the unfused one",
                        predicted_s=predicted_s)  # fmt: skip
    if not measure:
        return Decision(True, "fused without timing (measure=False)", predicted_s=predicted_s)
    f1, b1 = time_call(fused), time_call(baseline)
    f2, b2 = time_call(fused), time_call(baseline)
    f, b = min(f1, f2), min(b1, b2)
    fuse = f <= MARGIN * b
    why = f"fused call {b / f:.2f}x as fast as the unfused ops" + ("" if fuse else ": kept unfused")
    result = Decision(fuse, why, f, b, predicted_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = asdict(result)
    record.pop("cached")
    write_atomic(path, json.dumps(record).encode())
    return result


def predicted_time(kind: str, dims: dict[str, Any], dtype: torch.dtype) -> float | None:
    """The planner's predicted time of the fused chain (None where the planner has no builder
    for it or refuses the chain)."""
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    try:
        if kind == "mlp":
            chain = builders.gemm_chain(1, dims["M"], dims["N"], dims["K"], dims["L"],
                                        dims["between"], name[dtype])  # fmt: skip
        elif kind == "attention":
            chain = builders.attention_chain(
                dims["batch"], dims["heads"], dims["seq_q"], dims["seq_k"], dims["d"],
                dims["dv"], causal=dims["causal"], dtype=name[dtype],
            )  # fmt: skip
        else:
            return None
        return float(planner.plan(chain, threads=torch.get_num_threads()).predicted_time_s)
    except (ValueError, KeyError, TypeError):
        return None
