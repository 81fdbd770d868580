"""PyTorch integration: the only module of chainfuse that needs torch (imported lazily: importing
`chainfuse` does not import this module).

`attention`, `gemm_chain`, `gated_mlp` and `conv_chain` are also the operators
`torch.ops.chainfuse.*`,
with shape functions, so that `torch.compile` (and `torch.export`) keep each in their graphs
as one opaque call instead of tracing into chainfuse's Python, where they would break the graph
at the kernel's ctypes call. Called outside a compiled region, they run the kernel directly:
the dispatcher's per-call cost stays out of a short call.

Their kernels run on ``torch.get_num_threads()`` threads, as PyTorch's own ops do, unless
`chainfuse.set_num_threads` set a count.
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from chainfuse import ops
from chainfuse.builders import check_softcap
from chainfuse.ops.arguments import grad_refused
from chainfuse.ops.attention import known_attention
from chainfuse.ops.conv_chain import paddings, pair
from chainfuse.runtime.threads import call_threads, reset_call_threads, threads_for
from chainfuse.torch.handoff import (
    attention_reason,
    count,
    fallbacks,
    gemm_chain_reason,
    torch_gemm_chain,
)

__all__ = [
    "SDPAPatch",
    "attention",
    "conv_chain",
    "fallbacks",
    "gated_mlp",
    "gemm_chain",
    "patch_sdpa",
]


_LIBRARY = torch.library.Library("chainfuse", "DEF")  # type: ignore[no-untyped-call]


class _Operator:
    """`torch.ops.chainfuse.<name>`, defined through the dispatcher's library API: its schema
    from the kernel's annotations (`torch.library.infer_schema`), the kernel registered for
    `devices`, a shape function by `register_fake`. (`torch.library.custom_op` wraps the kernel
    in its autograd and tracing layers: some 50 us a call, as much as a small chain's kernel;
    these operators have no backward: `ops` refuses inputs that need one.) Called, it calls the
    operator."""

    def __init__(
        self,
        name: str,
        kernel: Callable[..., Any],
        devices: tuple[str, ...],
        tags: tuple[torch.Tag, ...] = (),
    ) -> None:
        self.name = f"chainfuse::{name}"
        schema = torch.library.infer_schema(kernel, mutates_args=())
        _LIBRARY.define(name + schema, tags=tags)  # type: ignore[no-untyped-call]
        for device in devices:
            _LIBRARY.impl(name, kernel, device.upper())  # type: ignore[no-untyped-call]
        self.op = getattr(torch.ops.chainfuse, name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(self.name, fake, lib=_LIBRARY)
        return fake


def _operator(
    name: str, devices: tuple[str, ...] = ("cpu",), tags: tuple[torch.Tag, ...] = ()
) -> Callable[[Callable[..., Any]], _Operator]:
    """Decorator: the kernel as the operator `torch.ops.chainfuse.<name>` (`_Operator`)."""
    return lambda kernel: _Operator(name, kernel, devices, tags)


def _on_torch_threads(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with its kernels on ``torch.get_num_threads()`` threads, as
    PyTorch's own ops run (unless `chainfuse.set_num_threads` set a count)."""
    token = call_threads(torch.get_num_threads())
    try:
        return fn(*args, **kwargs)
    finally:
        reset_call_threads(token)


@_operator("attention", ("cpu", "cuda"))
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """The operator's CPU and CUDA kernel: `ops.attention` (CUDA: Triton), which checks every
    argument (or PyTorch's SDPA, where `attention_reason` says so and there is no softcap)."""
    if softcap is None:
        handed: torch.Tensor | None = _handed_attention(
            q, k, v, attn_mask, is_causal, scale, enable_gqa
        )
        if handed is not None:
            return handed
    out: torch.Tensor = _on_torch_threads(
        ops.attention, q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa, softcap=softcap,
    )  # fmt: skip
    return out


@_attention_op.register_fake
def _attention_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
) -> torch.Tensor:
    """The result a compiler plans with: q's shape with v's head dim, batch and heads broadcast
    with k's and v's, q's dtype, contiguous (as the kernel returns it). The shapes are checked
    here as `ops.attention` checks them, so that a compiled graph with wrong sizes fails while
    it is traced, naming the argument."""
    return q.new_empty(ops.attention_shape(q.shape, k.shape, v.shape, enable_gqa))


def attention(
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
    softcap: float | None = None,
) -> Any:
    """`torch.nn.functional.scaled_dot_product_attention` semantics (inference, no dropout).

    As in PyTorch's SDPA on CPU, a boolean mask marks the positions that take part, a float mask
    is added to the scores, and an `attn_mask` together with `is_causal=True` applies both (as
    its fused kernel does; its math path, taken where v's head dim differs from q's, refuses
    the pair);
    `enable_gqa=True` lets k and v have fewer heads (a divisor of q's), each serving a group of
    q's heads. `softcap` (keyword-only; Gemma 2's attention): the scaled scores s become
    `softcap * tanh(s / softcap)` before the mask is added; SDPA has no such argument.
    `dropout_p` (keyword-only here) must be 0. Inputs that require grad are refused
    while grad mode is on (no backward): use `torch.no_grad()` or `torch.inference_mode()`.
    Inside `torch.compile` it is the operator `torch.ops.chainfuse.attention` (see the module).
    A 16-bit call no AMX kernel runs goes to PyTorch's SDPA where the model predicts it faster
    (`handoff`), counted in `fallbacks`.
    """
    return _attend(q, k, v, attn_mask, is_causal, scale, dropout_p, enable_gqa, decide=True,
                   softcap=softcap)  # fmt: skip


def _attend(
    q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool, scale: float | None,
    dropout_p: float, enable_gqa: bool, decide: bool, softcap: float | None = None,
) -> Any:  # fmt: skip
    """`attention`; `decide=False`: chainfuse's kernel without asking whether PyTorch's is
    faster (`patch_sdpa` has asked)."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        raise TypeError(f"attn_mask: expected dtype bool or {q.dtype} (q's), got {attn_mask.dtype}")
    if torch.compiler.is_compiling():
        if dropout_p != 0:
            raise ValueError(
                f"dropout_p: expected 0.0, got {dropout_p!r}: chainfuse's attention is for "
                "inference (no dropout, no backward)"
            )
        _refuse_grad("q, k, v, attn_mask", q, k, v, attn_mask)
        if softcap is not None:  # (the operator's schema: a float)
            softcap = check_softcap(softcap)
        return _attention_op(q, k, v, attn_mask, bool(is_causal), scale, bool(enable_gqa),
                             softcap)  # fmt: skip
    # (no autograd context needed: the kernel writes a fresh tensor outside the graph)
    if decide and q.dtype in _HALF and dropout_p == 0 and softcap is None:
        handed = _handed_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)
        if handed is not None:
            return handed
    if dropout_p.__class__ is float and dropout_p == 0.0:
        # a call like one made before (a decoding step) without the context below, a
        # measurable share of a short call
        done = known_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa,
                               threads_for(torch.get_num_threads()), softcap)[0]  # fmt: skip
        if done is not None:
            return done
    return _on_torch_threads(ops.attention, q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                             scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa,
                             softcap=softcap)  # fmt: skip


_HALF = (torch.bfloat16, torch.float16)


def _torch_sdpa() -> Any:
    """PyTorch's SDPA as it was before the outermost active patch."""
    return _ACTIVE[0]._saved if _ACTIVE else torch.nn.functional.scaled_dot_product_attention


def _handed_attention(
    q: Any, k: Any, v: Any, attn_mask: Any, is_causal: bool, scale: float | None,
    enable_gqa: bool,
) -> Any:  # fmt: skip
    """PyTorch's SDPA of a 16-bit call that chainfuse's kernels could run but the model predicts
    slower than PyTorch's (`handoff`), counted in `fallbacks`; None for every other call."""
    why = attention_reason(q, k, v, attn_mask, is_causal)
    if why is None or _unsupported(q, k, v, attn_mask, 0.0) is not None:
        return None  # (chainfuse's own errors, or not a call its kernels take)
    ops.attention_shape(q.shape, k.shape, v.shape, enable_gqa)  # (chainfuse's shape errors)
    count(fallbacks, why, "attention")
    return _torch_sdpa()(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)  # fmt: skip


def _unsupported(q: Any, k: Any, v: Any, attn_mask: Any, dropout_p: float) -> str | None:
    """Why chainfuse's kernels cannot run this SDPA call (None: they can). Only what they lack;
    what PyTorch itself refuses (mismatched shapes) is not here: chainfuse raises its own error
    for it."""
    tensor = torch.Tensor
    if not (isinstance(q, tensor) and isinstance(k, tensor) and isinstance(v, tensor)):
        return "arguments that are not tensors"
    for t in (q, k, v, attn_mask):
        if t is not None and t.device.type != "cpu":
            return f"{t.device.type} tensors"
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ):
        return f"dtype {q.dtype}" if q.dtype == k.dtype == v.dtype else "mixed dtypes"
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, q.dtype):
        return f"an attn_mask of dtype {attn_mask.dtype}"
    if dropout_p != 0:
        return "dropout_p > 0"
    if torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, attn_mask) if t is not None
    ):
        return "inputs that require grad"
    if min(q.dim(), k.dim(), v.dim()) < 2:
        return f"{min(q.dim(), k.dim(), v.dim())}-D inputs"
    return None


def _rows(t: Any) -> Any:
    """`t` with its last dimension contiguous, as the kernels read q, k and v (a copy where it
    is not: s·d elements beside the attention's s²·d multiply-adds; the mask is read element
    by element, with any strides)."""
    return t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous()


#: the active `SDPAPatch`es, outermost first
_ACTIVE: list[SDPAPatch] = []


class SDPAPatch:
    """While active (a `with` block), `torch.nn.functional.scaled_dot_product_attention` is
    chainfuse's attention: a model that calls SDPA through the module, as Hugging Face models
    and most others do, runs chainfuse's kernels without a change to its code.

    A call chainfuse's kernels cannot run (another device, float64, dropout_p > 0 while
    training, inputs that require grad, 1-D inputs) goes to PyTorch's own SDPA, and is counted
    in `fallbacks` by its reason, with one warning per reason; with `strict=True` it is an error
    instead. (q, k or v whose last dimension is not contiguous runs here, from a contiguous
    copy.) A 16-bit call that no AMX kernel runs and for which the model predicts PyTorch's SDPA
    faster (`handoff`) goes there too, counted the same way (with `strict=True`, chainfuse's
    kernel runs it). `calls` counts the calls chainfuse ran. Errors of the call itself
    (mismatched shapes) are raised as chainfuse raises them, never passed on. Patches nest;
    each restores what it replaced. The patch is process-wide (the module attribute), not per
    thread.
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.calls = 0
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._saved: Any = None

    def __enter__(self) -> SDPAPatch:
        if any(p is self for p in _ACTIVE):
            raise RuntimeError("patch_sdpa: this patch is already active (use a new one to nest)")
        functional = torch.nn.functional
        # fallbacks go to SDPA as it was before the outermost active patch
        self._saved = _ACTIVE[0]._saved if _ACTIVE else functional.scaled_dot_product_attention
        _ACTIVE.append(self)
        functional.scaled_dot_product_attention = self._sdpa
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        functional = torch.nn.functional
        ours = any(functional.scaled_dot_product_attention == p._sdpa for p in _ACTIVE)
        _ACTIVE[:] = [p for p in _ACTIVE if p is not self]
        if ours:  # (exited in any order: the innermost patch still active, or SDPA as it was)
            functional.scaled_dot_product_attention = _ACTIVE[-1]._sdpa if _ACTIVE else self._saved

    def _sdpa(
        self,
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        """SDPA's signature (its fifth positional argument is dropout_p)."""
        why = _unsupported(query, key, value, attn_mask, dropout_p)
        # (compiled, the operator decides when it runs)
        if (
            why is None
            and query.dtype in _HALF
            and not self.strict
            and not torch.compiler.is_compiling()
        ):
            why = attention_reason(query, key, value, attn_mask, is_causal)
            if why is not None:  # (the kernels could run it: no error under strict)
                ops.attention_shape(query.shape, key.shape, value.shape, enable_gqa)
                count(self.fallbacks, why, "patch_sdpa")
                return self._saved(query, key, value, attn_mask=attn_mask, is_causal=is_causal,
                                   scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        if why is None:
            self.calls += 1
            query, key, value = _rows(query), _rows(key), _rows(value)
            return _attend(query, key, value, attn_mask, is_causal, scale, 0.0, enable_gqa,
                           decide=False)  # fmt: skip
        if self.strict:
            raise ValueError(f"scaled_dot_product_attention: chainfuse cannot run calls with {why}")
        if not self.fallbacks[why]:
            warnings.warn(
                f"chainfuse.torch.patch_sdpa: calls with {why} run PyTorch's SDPA (chainfuse's "
                "kernels cannot); see the patch's fallbacks",
                RuntimeWarning,
                stacklevel=2,
            )
        self.fallbacks[why] += 1
        return self._saved(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)  # fmt: skip


def patch_sdpa(strict: bool = False) -> SDPAPatch:
    """`with chainfuse.torch.patch_sdpa() as patch: model(x)`: the model's calls of
    `torch.nn.functional.scaled_dot_product_attention` run chainfuse's attention (see
    `SDPAPatch`; `patch.calls`, `patch.fallbacks` say what ran where)."""
    return SDPAPatch(strict=strict)


def _refuse_grad(names: str, *xs: Any) -> None:
    """Inside a compiled region (where `ops` is not traced): inputs that require grad while grad
    mode is on are an error naming the first, as `ops` raises it eagerly."""
    if torch.is_grad_enabled():
        for name, t in zip(names.split(", "), xs, strict=True):
            if t is not None and t.requires_grad:
                raise RuntimeError(grad_refused(name))


@_operator("gemm_chain", ("cpu", "cuda"))
def _gemm_chain_op(
    A: torch.Tensor,
    B: torch.Tensor,
    D: torch.Tensor,
    between: str | None,
    bias1: torch.Tensor | None,
    bias2: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The operator's CPU and CUDA kernel: `ops.gemm_chain` (CUDA: Triton), which checks every
    argument (or PyTorch's ops, where `gemm_chain_reason` says so; they read B and D, not
    `packed`, the weights `ops.pack_weights` packed for the AMX kernels)."""
    why = gemm_chain_reason(A, B, D, between, bias1, bias2)
    if why is not None and not torch.is_grad_enabled():
        count(fallbacks, why, "gemm_chain")
        handed: torch.Tensor = torch_gemm_chain(A, B, D, between, bias1, bias2)
        return handed
    out: torch.Tensor = _on_torch_threads(
        ops.gemm_chain, A, B, D, between=between, bias1=bias1, bias2=bias2, packed=packed
    )
    return out


@_gemm_chain_op.register_fake
def _gemm_chain_shape(
    A: torch.Tensor,
    B: torch.Tensor,
    D: torch.Tensor,
    between: str | None,
    bias1: torch.Tensor | None,
    bias2: torch.Tensor | None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., M, N] of A's dtype, contiguous, the batch dims broadcast: `ops.gemm_chain_shape`,
    which checks the sizes as `ops.gemm_chain` checks them (the biases' too)."""
    shape = ops.gemm_chain_shape(A.shape, B.shape, D.shape)
    _bias_shape("bias1", bias1, B.shape[-1], "B's L", A.dtype)
    _bias_shape("bias2", bias2, D.shape[-1], "D's N", A.dtype)
    return A.new_empty(shape)


def _bias_shape(name: str, bias: torch.Tensor | None, size: Any, what: str, dtype: Any) -> None:
    """A bias that is not a vector of `size` elements of `dtype`: the error `ops` raises."""
    if bias is None:
        return
    if bias.dim() != 1 or bias.shape[0] != size:
        raise ValueError(f"{name}: expected shape ({size},) ({what}), got {tuple(bias.shape)}")
    if bias.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (the inputs'), got {bias.dtype}")


def gemm_chain(
    A: Any,
    B: Any,
    D: Any,
    between: str | None = None,
    bias1: Any = None,
    bias2: Any = None,
    packed: Any = None,
) -> Any:
    """`chainfuse.ops.gemm_chain` for torch tensors: `between(A @ B + bias1) @ D + bias2` in one
    kernel (`between`: None, an activation of `ir.ACTIVATION_NAMES` or "softmax";
    B and D may be nn.Linear weights' transposes, `W.T`, read as stored; `packed`: bf16 weights
    packed once by `ops.pack_weights`, for the AMX kernels); inside `torch.compile`, the
    operator `torch.ops.chainfuse.gemm_chain`."""
    if torch.compiler.is_compiling():
        _refuse_grad("A, B, D, bias1, bias2", A, B, D, bias1, bias2)
        return _gemm_chain_op(A, B, D, between, bias1, bias2, packed)
    why = gemm_chain_reason(A, B, D, between, bias1, bias2)
    if why is not None and not _needs_grad(A, B, D, bias1, bias2):
        ops.gemm_chain_shape(A.shape, B.shape, D.shape)  # (chainfuse's shape errors)
        _bias_shape("bias1", bias1, B.shape[-1], "B's L", A.dtype)
        _bias_shape("bias2", bias2, D.shape[-1], "D's N", A.dtype)
        count(fallbacks, why, "gemm_chain")
        return torch_gemm_chain(A, B, D, between, bias1, bias2)
    return _on_torch_threads(
        ops.gemm_chain, A, B, D, between=between, bias1=bias1, bias2=bias2, packed=packed
    )


@_operator("gated_mlp")
def _gated_mlp_op(
    X: torch.Tensor,
    W1: torch.Tensor,
    W3: torch.Tensor,
    W2: torch.Tensor,
    act: str,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The operator's CPU kernel: `ops.gated_mlp`, which checks every argument."""
    out: torch.Tensor = _on_torch_threads(ops.gated_mlp, X, W1, W3, W2, act, packed=packed)
    return out


@_gated_mlp_op.register_fake
def _gated_mlp_fake(
    X: torch.Tensor,
    W1: torch.Tensor,
    W3: torch.Tensor,
    W2: torch.Tensor,
    act: str,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., M, N] of X's dtype, contiguous: `ops.gated_mlp_shape`'s checks and result."""
    return X.new_empty(ops.gated_mlp_shape(X.shape, W1.shape, W3.shape, W2.shape))


def gated_mlp(X: Any, W1: Any, W3: Any, W2: Any, act: str = "silu", packed: Any = None) -> Any:
    """`chainfuse.ops.gated_mlp` for torch tensors: `(act(X @ W1) * (X @ W3)) @ W2` in one
    kernel (Llama's SwiGLU MLP: `gated_mlp(x, gate.weight.T, up.weight.T, down.weight.T)`;
    `packed`: bf16 weights packed once by `ops.pack_weights(W1, W2, W3)`, for the AMX
    kernels); inside `torch.compile`, the operator `torch.ops.chainfuse.gated_mlp`."""
    if torch.compiler.is_compiling():
        _refuse_grad("X, W1, W3, W2", X, W1, W3, W2)
        return _gated_mlp_op(X, W1, W3, W2, act, packed)
    return _on_torch_threads(ops.gated_mlp, X, W1, W3, W2, act, packed=packed)


def _needs_grad(*xs: torch.Tensor | None) -> bool:
    """Inputs chainfuse refuses (grad mode on, an input that requires grad): its error stands."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


def _conv_out(x: torch.Tensor, shape: tuple[Any, ...]) -> torch.Tensor:
    """The result of a conv chain in x's memory order: channels-last where x is (its channels
    dense and innermost), else NCHW; the operator's kernel and its shape function agree on it."""
    last = (
        x.shape[1] > 1 and x.stride(1) == 1 and x.is_contiguous(memory_format=torch.channels_last)
    )
    fmt = torch.channels_last if last else torch.contiguous_format
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)


def _conv_shape(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    stride: list[int],
    padding: list[int],
    groups: int = 1,
) -> tuple[Any, ...]:
    if x.dim() != 4 or w1.dim() != 4 or w2.dim() != 4:
        raise ValueError(
            f"x, w1, w2: expected 4-D [N, C, H, W] and [K, C, R, S], got shapes "
            f"{tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    if w1.shape[1] != x.shape[1]:
        raise ValueError(f"w1: expected {x.shape[1]} input channels (x's C), got {w1.shape[1]}")
    per_group = w1.shape[0] // groups if groups in (1, w1.shape[0]) else None
    if per_group is None:
        raise ValueError(
            f"groups: expected 1 or w1's {w1.shape[0]} output channels (depthwise), got {groups}"
        )
    if w2.shape[1] != per_group or w2.shape[0] % groups:
        raise ValueError(
            f"w2: expected {per_group} input channels (w1's output channels / groups {groups}), "
            f"got shape {tuple(w2.shape)}"
        )
    h, w = x.shape[2], x.shape[3]
    after = padding[2] if len(padding) > 2 else padding[1]  # (the second conv's, after)
    for name, weight, st, pad in (("w1", w1, stride[0], 2 * padding[0]),
                                  ("w2", w2, stride[1], padding[1] + after)):  # fmt: skip
        r, s = weight.shape[2], weight.shape[3]
        if h + pad < r or w + pad < s:
            raise ValueError(f"{name}: kernel {r}x{s} is larger than its padded input "
                             f"{h + pad}x{w + pad}")  # fmt: skip
        h, w = (h + pad - r) // st + 1, (w + pad - s) // st + 1
    return (x.shape[0], w2.shape[0], h, w)


# flexible layout: Inductor passes x as its graph holds it (channels-last where it runs its
# convolutions so), not copied back to the traced graph's order; the result follows x's order
# (`_conv_out`), in the shape function too
@_operator("conv_chain", tags=(torch.Tag.flexible_layout,))
def _conv_chain_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    between: str | None,
    after: str | None,
    packed: torch.Tensor | None = None,
    micro: str | None = None,
    finite: bool = False,
    groups: int = 1,
) -> torch.Tensor:
    """The operator's CPU kernel: `ops.conv_chain` into a result laid out as `_conv_out` says
    (`ops.conv_chain` checks every argument); `packed`, `micro`, `finite`: the fields of
    `ops.PackedConvWeights` (weights packed once), or None; `groups`: the second conv's;
    `padding`: the first conv's and the second's, then the second's after each axis where it
    differs."""
    out = _conv_out(x, _conv_shape(x, w1, w2, stride, padding, groups))
    weights = None if packed is None else ops.PackedConvWeights(packed, micro or "", finite)
    pads = (padding[0], padding[1] if len(padding) < 3 else (padding[1], padding[2]))
    _on_torch_threads(ops.conv_chain, x, w1, w2, b1, b2, stride=(stride[0], stride[1]),
                      padding=pads, between=between, after=after,
                      out=out, packed=weights, groups=(1, groups))  # fmt: skip
    return out


@_conv_chain_op.register_fake
def _conv_chain_fake(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    between: str | None,
    after: str | None,
    packed: torch.Tensor | None = None,
    micro: str | None = None,
    finite: bool = False,
    groups: int = 1,
) -> torch.Tensor:
    return _conv_out(x, _conv_shape(x, w1, w2, stride, padding, groups))


def _padding(value: Any) -> list[int]:
    """padding as the operator's ints (`ops.conv_chain.paddings`): the first conv's, the
    second's, and the second's after each axis where that differs."""
    pad1, pad2, after = paddings(value)
    return [pad1, pad2] if after == pad2 else [pad1, pad2, after]


def conv_chain(
    x: Any,
    w1: Any,
    w2: Any,
    b1: Any = None,
    b2: Any = None,
    stride: int | tuple[int, int] = (1, 1),
    padding: int | tuple[int, int | tuple[int, int]] = (0, 0),
    between: str | None = None,
    after: str | None = None,
    groups: int | tuple[int, int] = (1, 1),
) -> Any:
    """`chainfuse.ops.conv_chain` for torch tensors (conv -> [bias, activation] -> conv, fused);
    inside `torch.compile`, the operator `torch.ops.chainfuse.conv_chain`, whose result is
    channels-last where x is."""
    if torch.compiler.is_compiling():
        _refuse_grad("x, w1, w2, b1, b2", x, w1, w2, b1, b2)
        pairs = list(pair("stride", stride, 1)), _padding(padding)
        g1, g2 = pair("groups", groups, 1)
        if g1 != 1:
            raise ValueError(f"groups: the first conv's groups must be 1, got {groups!r}")
        if x.dim() == 3:  # unbatched [C, H, W]: one image, as conv2d takes it
            return _conv_chain_op(x[None], w1, w2, b1, b2, *pairs, between, after,
                                  groups=g2)[0]  # fmt: skip
        return _conv_chain_op(x, w1, w2, b1, b2, *pairs, between, after, groups=g2)
    return _on_torch_threads(ops.conv_chain, x, w1, w2, b1, b2, stride=stride, padding=padding,
                             between=between, after=after, groups=groups)  # fmt: skip


# the torch.compile backend ("chainfuse") and its explainer: after the operators they emit
from chainfuse.torch.backend import compile  # noqa: E402
from chainfuse.torch.explain import explain  # noqa: E402

__all__ += ["compile", "explain"]
