"""PyTorch's own function of each activation chainfuse's chains take (`ir.ACTIVATION_NAMES`):
what the backend's finder compares written-out forms with, what a call handed to PyTorch runs,
and the oracle of the fuzzers. Built on first use: the core imports without torch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from chainfuse.ir import ACTIVATION_NAMES

__all__ = ["torch_activations"]


@functools.cache
def torch_activations() -> dict[str, Callable[[Any], Any]]:
    """The functions by name, in the order of `ir.ACTIVATION_NAMES`."""
    import torch

    F = torch.nn.functional
    table: dict[str, Callable[[Any], Any]] = {
        "relu": torch.relu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t),
        "silu": F.silu,
        "relu6": F.relu6,
        "hardswish": F.hardswish,
        "mish": F.mish,
        "squared_relu": lambda t: torch.relu(t) ** 2,
    }
    if tuple(table) != ACTIVATION_NAMES:  # (a new activation named in one list only)
        raise RuntimeError(f"torch_activations: {list(table)} against {ACTIVATION_NAMES}")
    return table
