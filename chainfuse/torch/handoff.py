"""16-bit calls the torch entry points hand to PyTorch, and the count of them.

Where no AMX kernel can run a bf16 (or fp16) call (no AMX, the permission refused,
``CHAINFUSE_AMX=off``, a chain the AMX generator does not take), chainfuse would compute it widened
to fp32; where the model predicts PyTorch's own 16-bit ops faster than that (`ops.dispatch`),
`chainfuse.torch.attention`, `gemm_chain` and `patch_sdpa()` run PyTorch's instead. Each such
call is counted by its reason (`fallbacks` here, a patch's own `fallbacks` for `patch_sdpa`)
with one warning per reason, as the calls the kernels cannot run are: never a silent change.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from chainfuse import builders
from chainfuse.hardware import Hardware
from chainfuse.ir import Activation, Chain, DType
from chainfuse.kernels.amx import ENV_AMX
from chainfuse.ops import dispatch, gpu
from chainfuse.ops.calls import Memo, key_bucket
from chainfuse.ops.dispatch import torch_faster
from chainfuse.runtime.threads import threads_for
from chainfuse.torch.kinds import TORCH_ACTIVATIONS

__all__ = ["attention_reason", "count", "fallbacks", "gemm_chain_reason", "torch_gemm_chain"]

#: calls `chainfuse.torch.attention` and `gemm_chain` handed to PyTorch, by reason
fallbacks: collections.Counter[str] = collections.Counter()

_HALF = {torch.bfloat16: DType.BFLOAT16, torch.float16: DType.FLOAT16}


def _reason(dtype: DType) -> str:
    return f"{dtype.value} where PyTorch is predicted faster (no AMX kernel runs it here)"


def count(counter: collections.Counter[str], why: str, where: str) -> None:
    """Count one call handed to PyTorch, warning on the first of each reason."""
    if not counter[why]:
        warnings.warn(
            f"chainfuse.torch.{where}: calls with {why} run PyTorch's own ops; see the fallbacks",
            RuntimeWarning,
            stacklevel=3,
        )
    counter[why] += 1


@functools.lru_cache(maxsize=512)
def _attention_chain(
    heads: int, seq_q: int, seq_k: int, d: int, dv: int, causal: bool, mask: str | None,
    dtype: DType,
) -> Chain:  # fmt: skip
    return builders.attention_chain(1, heads, seq_q, seq_k, d, dv, causal, mask, dtype=dtype)


#: decisions by the call's plain sizes, the thread count and ``CHAINFUSE_AMX``, each with the
#: machine it was made for: a repeat call (a decoding step) neither builds nor hashes a chain
_decided = Memo[tuple[Any, ...], tuple[Hardware, str | None]](1024)


def _decide(key: tuple[Any, ...], chain_of: Callable[[], Chain], threads: int) -> str | None:
    """The reason for the call `key` describes (None: chainfuse runs it), remembered."""
    hw = dispatch.host()
    hit = _decided.get(key)
    if hit is not None and hit[0] is hw:
        return hit[1]
    try:
        chain = chain_of()
    except (ValueError, TypeError):
        why = None  # (chainfuse raises its own error for the call)
    else:
        why = _reason(chain.dtype) if torch_faster(chain, threads, hw) else None
    _decided.remember(key, (hw, why))
    return why


def attention_reason(q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool) -> str | None:
    """Why this SDPA call goes to PyTorch (None: chainfuse runs it). Only 16-bit calls with
    work; sequence lengths are rounded up to the buckets `ops.attention` plans in, so that a
    decoder's growing keys do not plan anew each step."""
    dtype = _HALF.get(q.dtype)
    if dtype is None or min(q.dim(), k.dim(), v.dim()) < 2 or 0 in (*q.shape, *k.shape, *v.shape):
        return None
    if q.device.type != "cpu" or gpu.routed(q, k, v, attn_mask):  # the Triton kernels run it
        return None
    mask = None if attn_mask is None else "bool" if attn_mask.dtype == torch.bool else "additive"
    threads = threads_for(torch.get_num_threads())
    key = ("attention", dtype, tuple(q.shape), k.shape[-2], v.shape[-1], bool(is_causal), mask,
           threads, os.environ.get(ENV_AMX))  # fmt: skip

    def chain() -> Chain:
        sizes = (key_bucket(q.shape[-2]), key_bucket(k.shape[-2]), q.shape[-1], v.shape[-1])
        heads = math.prod(q.shape[:-2])
        return _attention_chain(heads, *sizes, bool(is_causal), mask, dtype)

    return _decide(key, chain, threads)


@functools.lru_cache(maxsize=512)
def _gemm_chain(batch: int, m: int, n: int, k: int, l_: int, between: Any, dtype: DType) -> Chain:
    return builders.gemm_chain(batch, m, n, k, l_, between, dtype)


def gemm_chain_reason(
    A: Any, B: Any, D: Any, between: Any, bias1: Any = None, bias2: Any = None
) -> str | None:
    """Why this `gemm_chain` call goes to PyTorch (None: chainfuse runs it); an MLP's rows (2-D
    weights) count as one batch, as `ops.gemm_chain` runs them. B and D may be nn.Linear's
    `W.T` views; biases (vectors of the operands' dtype) are decided as the chain without
    them is (they move a vector next to a weight)."""
    tensor = torch.Tensor
    if not (isinstance(A, tensor) and isinstance(B, tensor) and isinstance(D, tensor)):
        return None
    dtype = _HALF.get(A.dtype)
    if dtype is None or not A.dtype == B.dtype == D.dtype or min(A.dim(), B.dim(), D.dim()) < 2:
        return None
    if 0 in (*A.shape, *B.shape, *D.shape) or gpu.routed(A, B, D):  # (routed: Triton runs it)
        return None
    for x in (A, B, D):  # (what chainfuse refuses stays refused: its errors)
        if x.device.type != "cpu" or (x.shape[-1] > 1 and x.stride(-1) != 1 and x is A):
            return None
        if x.shape[-1] > 1 and x.stride(-1) != 1 and x.stride(-2) != 1:
            return None
    for bias in (bias1, bias2):
        if bias is not None and (not isinstance(bias, tensor) or bias.dtype != A.dtype):
            return None
    if not (between is None or isinstance(between, str | Activation)):
        return None  # (chainfuse raises its own error for the call)
    k, l_, n = A.shape[-1], B.shape[-1], D.shape[-1]
    if B.dim() == D.dim() == 2:
        batch, m = 1, A.numel() // k
    else:
        batch = max(math.prod(x.shape[:-2]) for x in (A, B, D))  # (ops checks the dims)
        m = A.shape[-2]
    threads = threads_for(torch.get_num_threads())
    name = between.value if isinstance(between, Activation) else between
    key = ("gemm_chain", dtype, batch, m, n, k, l_, name, threads, os.environ.get(ENV_AMX))
    return _decide(key, lambda: _gemm_chain(batch, key_bucket(m), n, k, l_, name, dtype), threads)


def torch_gemm_chain(
    A: Any, B: Any, D: Any, between: Any, bias1: Any = None, bias2: Any = None
) -> Any:
    """`between(A @ B + bias1) @ D + bias2` in PyTorch's own ops, as an unfused 16-bit model
    runs it (the intermediate in the operands' dtype)."""
    name = between.value if isinstance(between, Activation) else between
    if name not in (None, "identity", "softmax", *TORCH_ACTIVATIONS):
        choices = ", ".join(repr(n) for n in TORCH_ACTIVATIONS)
        raise ValueError(f"between: expected None, {choices} or 'softmax', got {between!r}")
    C = torch.matmul(A, B)
    if bias1 is not None:
        C = C + bias1
    if name == "softmax":
        C = torch.softmax(C, dim=-1)
    elif name in TORCH_ACTIVATIONS:
        C = TORCH_ACTIVATIONS[name](C)
    E = torch.matmul(C, D)
    return E if bias2 is None else E + bias2
