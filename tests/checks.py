"""The numerics tests' one reference check: a kernel run on the chain's random inputs matches the
float64 reference within `chainfuse.reference.tolerance`, the project's one tolerance rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import chainfuse
from chainfuse import reference


def check_against_reference(
    kernel: Callable[..., Any],
    chain: chainfuse.Chain,
    *,
    seed: int = 0,
    scale: float = 1.0,
    softmax_term: bool = False,
    convert: Callable[[np.ndarray], Any] | None = None,
) -> tuple[Any, dict[str, np.ndarray]]:
    """Run `kernel` on `reference.random_inputs(chain, seed, scale)` (each passed through
    `convert`, e.g. to a torch tensor) and `reference.assert_close` its output to the chain's
    first output in float64; `softmax_term` adds the bound's input-dependent softmax part.
    Returns the output as the kernel gave it and the inputs."""
    inputs = reference.random_inputs(chain, seed=seed, scale=scale)
    args = [inputs[t.name] if convert is None else convert(inputs[t.name]) for t in chain.inputs]
    out = kernel(*args)
    want = reference.run(chain, inputs)[chain.outputs[0].name]
    got = out.detach().float().numpy() if hasattr(out, "detach") else np.asarray(out)
    reference.assert_close(got, want, chain, inputs=inputs if softmax_term else None)
    return out, inputs


def torch_activation(name: str | None) -> Callable[[Any], Any]:
    """PyTorch's op for a GEMM chain's `between` (None: identity): what a model's MLP runs."""
    from chainfuse.ops.activations import torch_activations

    if name is None:
        return lambda h: h
    if name == "softmax":
        return lambda h: h.softmax(-1)
    return torch_activations()[name]


def huge_in_float64(f: Callable[[Any], Any], s: Any) -> Any:
    """PyTorch's `f(s)`, except where `|s| > 1e30`: there `f` in float64, rounded to `s`'s
    dtype. PyTorch's vectorized float32 and bf16 gelu overflow there on some hosts (AVX-512:
    3e38 -> inf, +inf -> NaN; its scalar path gives 3e38 and +inf): the reference for NaN and
    inf placement is the arithmetic's, not one code path's."""
    import torch

    big = s.abs() > 1e30
    if not bool(big.any()):
        return f(s)
    return torch.where(big, f(s.double()).to(s.dtype), f(s))
