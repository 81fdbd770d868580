"""Fuzz cases of the gated (SwiGLU) MLP: `ops.gated_mlp` and `chainfuse.torch.gated_mlp`
(`chainfuse.bench.fuzz`): x [..., M, K] with 2-D weights as stored or as nn.Linear's `W.T`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from chainfuse import builders, ops
from chainfuse.bench.fuzz_cases import (
    Case,
    describe_operand,
    gemm_flops_ok,
    oracle_torch,
    pick,
    reference_of,
    special,
)
from chainfuse.bench.fuzz_values import Kind, Layout, Operand, inject, place, rounded, size
from chainfuse.ir import ACTIVATION_NAMES

__all__ = ["gated_case"]

_NAMES = frozenset({"X", "W1", "W3", "W2", "act", "out"})


def gated_case(
    rng: np.random.Generator, dtype: str, entries: list[str], compact: bool = False
) -> Case:
    """A random gated MLP call: sizes, leading dims of x, the weights' storage, NaN/inf or large
    values, numpy (float32) or torch, `ops` or the torch operator."""
    features: list[str] = []
    act = str(
        pick(rng, list(ACTIVATION_NAMES), [6 if a == "silu" else 1 for a in ACTIVATION_NAMES])
    )
    entry = str(pick(rng, [e for e in entries if e in ("ops", "torch")]))
    torch_too = "torch" in entries  # (entries without "torch": no torch here)
    if entry == "torch" or dtype != "float32":
        kind = Kind.TORCH
    else:
        kind = Kind(pick(rng, ["numpy", "torch"] if torch_too else ["numpy"]))
    features += [act, entry, kind.value]
    while True:
        M, N, K, L = (size(rng, 65 if compact else 129) for _ in range(4))
        lead = pick(rng, [(), (1,), (2,), (2, 3)])
        if gemm_flops_ok(math.prod(lead), M, N, K, 2 * L):
            break
    linear = rng.random() < 0.5  # the weights as nn.Linear stores them: W.T views
    if linear:
        features.append("W.T")
    if lead:
        features.append(f"{len(lead) + 2}d")
    shapes = {"X": (*lead, M, K), "W1": (K, L), "W3": (K, L), "W2": (L, N)}
    scales = {"X": 1.0, "W1": 1 / math.sqrt(K), "W3": 1 / math.sqrt(K), "W2": 1 / math.sqrt(L)}
    what = special(rng, features, dtype)
    if what == "large":
        scales["X"] *= 10 ** rng.uniform(0.5, 1.5)
    values = {n: scales[n] * rng.standard_normal(s) for n, s in shapes.items()}
    if what in ("nan", "inf"):
        inject(rng, values[pick(rng, list(values))], what)
    values = {n: rounded(v, dtype) for n, v in values.items()}
    operands = []
    for n, v in values.items():
        if linear and n != "X":
            array = place(np.ascontiguousarray(v.T), dtype, kind, Layout.CONTIGUOUS, rng).T
        else:
            array = place(v, dtype, kind, Layout.CONTIGUOUS, rng)
        operands.append(Operand(n, array, v))
    rows = math.prod(lead) * M
    full = {"A": values["X"].reshape(1, rows, K), "B": values["W1"][None],
            "B3": values["W3"][None], "D": values["W2"][None]}  # fmt: skip
    chain = builders.gated_mlp_chain(1, rows, N, K, L, act, dtype)
    expected = reference_of(chain, full, "E").reshape(*lead, M, N)
    X, W1, W3, W2 = (o.array for o in operands)
    call: Any
    if entry == "ops":
        desc = f"ops.gated_mlp(X, W1, W3, W2, act={act!r})"

        def call() -> Any:
            return ops.gated_mlp(X, W1, W3, W2, act=act)

    else:
        desc = f"chainfuse.torch.gated_mlp(X, W1, W3, W2, act={act!r})"

        def call() -> Any:
            import chainfuse.torch

            return chainfuse.torch.gated_mlp(X, W1, W3, W2, act=act)

    oracle = None
    if what in ("nan", "inf") or (what == "large" and dtype == "float16"):
        oracle = oracle_torch(lambda t: _unfused(t, values, act, dtype))
    return Case("gated_mlp", dtype, tuple(features), operands, call, expected, chain, _NAMES,
                desc + "  " + "; ".join(describe_operand(o) for o in operands), full, oracle,
                False)  # fmt: skip


def _unfused(torch: Any, values: dict[str, np.ndarray], act: str, dtype: str) -> Any:
    """PyTorch's unfused ops in the same dtype: (act(X @ W1) * (X @ W3)) @ W2."""
    X, W1, W3, W2 = (torch.from_numpy(values[n]).to(getattr(torch, dtype)) for n in values)
    from chainfuse.ops.activations import torch_activations

    return (torch_activations()[act](X @ W1) * (X @ W3)) @ W2
