"""The GPU target's calls: GEMM chains, MLPs and attention on torch tensors as Triton kernels.

`ops.gemm_chain` and `ops.attention` hand a call here (`routed`) when an operand is a CUDA
tensor, or when `CHAINFUSE_BACKEND=triton` asks for the Triton kernels on torch CPU tensors:
those run under Triton's interpreter, the same kernels a GPU runs, so every host tests them.
Each call plans its shape with `gpu_plan.plan_triton` (cached per shape), generates the source
of its structure once (`codegen.triton`), loads it (`runtime.triton`) and launches one program
per block of the grid. Operands are read in place through their strides (batch and head dims of
1 broadcast with stride 0); the result is a new contiguous tensor, or `out=`.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from chainfuse import builders, config
from chainfuse.codegen.triton import Between, Mask, TritonSpec, emit, kernel_name
from chainfuse.gpu_plan import TritonPlan, plan_triton
from chainfuse.ir import ACTIVATION_NAMES, DType
from chainfuse.operands import is_torch
from chainfuse.ops.activations import torch_activations
from chainfuse.ops.sdpa import attention_dims, check_flags
from chainfuse.runtime.triton import INSTALL_HINT, launch, load_triton, triton_available

__all__ = ["attention", "gemm_chain", "mlp", "routed"]

LOG2E = 1.4426950408889634
_DTYPES = {"torch.float32": DType.FLOAT32, "torch.float16": DType.FLOAT16,
           "torch.bfloat16": DType.BFLOAT16}  # fmt: skip


def routed(*xs: Any) -> bool:
    """Whether a call with these operands runs the Triton kernels: one is a CUDA tensor, or
    `CHAINFUSE_BACKEND=triton` and they are torch tensors."""
    first = xs[0]
    if first.__class__ is np.ndarray or not is_torch(first):
        return False
    # (every call asks: attribute reads only, the environment parsed only when set)
    if any(getattr(x, "is_cuda", False) for x in xs):
        return True
    return bool(os.environ.get(config.ENV_BACKEND)) and config.backend() == "triton"


def _torch() -> Any:
    return sys.modules.get("torch") or __import__("torch")


def _checked(names: str, *xs: Any) -> tuple[DType, bool]:
    """(dtype, interpret) of torch operands on one device; errors name the argument."""
    torch = _torch()
    labels = names.split(", ")
    devices = set()
    for name, x in zip(labels, xs, strict=True):
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.layout is not torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}")
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                f"{name} requires grad: chainfuse's kernels have no backward; call under "
                "torch.no_grad() or torch.inference_mode()"
            )
        devices.add(x.device)
    if len(devices) > 1:
        raise ValueError(f"{names}: expected one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    dtype = _DTYPES.get(str(xs[0].dtype))
    if dtype is None:
        raise TypeError(f"{labels[0]}: expected float32, float16 or bfloat16, got {xs[0].dtype}")
    same = [(n, x) for n, x in zip(labels, xs, strict=True) if n in ("out", *labels[1:3])]
    for name, x in same:
        if x is not None and x.dtype != xs[0].dtype:
            raise TypeError(f"{name}: expected {xs[0].dtype} ({labels[0]}'s dtype), got {x.dtype}")
    if not triton_available():
        where = "CUDA tensors" if device.type == "cuda" else "CHAINFUSE_BACKEND=triton"
        raise ModuleNotFoundError(f"{where} run chainfuse's Triton kernels: {INSTALL_HINT}")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{labels[0]}: expected a CUDA or CPU tensor, got device {device}")
    return dtype, device.type == "cpu"


@functools.lru_cache(maxsize=512)
def _plan(chain_args: tuple[Any, ...], kind: str, hardware: str) -> TritonPlan:
    chain = (builders.attention_chain if kind == "attention" else builders.gemm_chain)(*chain_args)
    return plan_triton(chain, hardware)


def _hardware(x: Any) -> str:
    """The machine a call plans for: its CUDA device, or (interpreted) the h100 preset."""
    return f"cuda:{x.device.index or 0}" if x.is_cuda else "h100"


@functools.cache
def _kernel(spec: TritonSpec) -> Any:
    """The loaded kernel of a structure (its source generated once per process)."""
    return load_triton(emit(spec), kernel_name(spec), spec.interpret)


def _launch(
    spec: TritonSpec,
    plan: TritonPlan,
    tensors: list[Any],
    sizes: tuple[int, int, int, int, int, int, int],
    strides: Sequence[tuple[int, ...]],
    scale: float,
) -> None:
    kernel = _kernel(spec)
    batch, heads, group, M, N, K, L = sizes
    tiles_m, tiles_n = -(-M // plan.block_m), -(-N // plan.block_n)
    grid = (batch * heads * tiles_m * tiles_n,)
    flat = [s for four in strides for s in four]
    meta = {
        "BLOCK_M": plan.block_m,
        "BLOCK_N": plan.block_n,
        "BLOCK_K": plan.block_k,
        "BLOCK_L": plan.block_l,
        "A_RESIDENT": plan.block_k >= K,
        "num_warps": plan.num_warps,
        "num_stages": plan.num_stages,
    }
    args = [*tensors, M, N, K, L, heads, group, tiles_m, tiles_n, *flat, scale]
    launch(kernel, grid, args, meta, spec.interpret)


def _four(x: Any) -> tuple[int, int, int, int]:
    """A 4-D view's strides, 0 along a dim of size 1 (broadcast)."""
    return tuple(0 if n == 1 else s for n, s in zip(x.shape, x.stride(), strict=True))  # type: ignore[return-value]


def gemm_chain(
    A: Any,
    B: Any,
    D: Any,
    between: Any = None,
    out: Any = None,
    *,
    bias1: Any = None,
    bias2: Any = None,
    tf32: bool = False,
) -> Any:
    """`between(A @ B + bias1) @ D + bias2` as one Triton kernel; the semantics of
    `ops.gemm_chain` (the activations the Triton generator has)."""
    return mlp(A, B, D, bias1, bias2, activation=between, out=out, tf32=tf32, _name="A, B, D")


def mlp(
    x: Any,
    w1: Any,
    w2: Any,
    b1: Any = None,
    b2: Any = None,
    *,
    activation: Any = "gelu",
    gate: Any = None,
    out: Any = None,
    tf32: bool = False,
    _name: str = "x, w1, w2",
) -> Any:
    """`act(x @ w1 + b1) @ w2 + b2` (weights in x @ w form) as one Triton kernel; with `gate`
    (w3, shaped as w1) the gated form `(act(x @ w1 + b1) * (x @ w3)) @ w2 + b2` (SwiGLU with
    silu). `activation`: None, one of `ir.ACTIVATION_NAMES`, or "softmax" (over the hidden dim,
    not gated). Batch dims broadcast as numpy's matmul's."""
    names = _name.split(", ")
    word = "none" if activation is None else str(getattr(activation, "value", activation))
    if word not in {b.value for b in Between}:
        choices = ", ".join(repr(b.value) for b in Between if b.value in ACTIVATION_NAMES)
        raise ValueError(
            f"{'between' if _name.startswith('A') else 'activation'}: expected None, {choices}"
            f" or 'softmax', got {activation!r}"
        )
    between = Between(word)
    dtype, interpret = _checked(f"{_name}, b1, b2, gate, out", x, w1, w2, b1, b2, gate, out)
    torch = _torch()
    if min(x.dim(), w1.dim(), w2.dim()) < 2:
        raise ValueError(f"{_name}: expected [..., rows, cols] each, got shapes "
                         f"{tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}")  # fmt: skip
    M, K = x.shape[-2:]
    if w1.shape[-2] != K:
        raise ValueError(
            f"{names[1]}: expected {K} rows ({names[0]}'s K), got shape {tuple(w1.shape[-2:])}"
        )
    L = w1.shape[-1]
    if w2.shape[-2] != L:
        raise ValueError(
            f"{names[2]}: expected {L} rows ({names[1]}'s L), got shape {tuple(w2.shape[-2:])}"
        )
    N = w2.shape[-1]
    if gate is not None and tuple(gate.shape[-2:]) != (K, L):
        raise ValueError(f"gate: expected [..., {K}, {L}] as {names[1]}, got {tuple(gate.shape)}")
    for name, bias, n in (("b1", b1, L), ("b2", b2, N)):
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"{name}: expected shape ({n},), got {tuple(bias.shape)}")
    if gate is not None and between in (Between.NONE, Between.SOFTMAX):
        raise ValueError(f"gate: a gated MLP needs an activation, got {activation!r}")
    try:
        lead = torch.broadcast_shapes(
            *(t.shape[:-2] for t in (x, w1, w2) + ((gate,) if gate is not None else ()))
        )
    except RuntimeError:
        raise ValueError(f"{_name}: batch dims {tuple(x.shape[:-2])}, {tuple(w1.shape[:-2])}, "
                         f"{tuple(w2.shape[:-2])} do not broadcast") from None  # fmt: skip
    shape = (*lead, M, N)
    if out is not None and tuple(out.shape) != shape:
        raise ValueError(f"out: expected shape {shape}, got {tuple(out.shape)}")
    result = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if 0 in shape:
        return result
    if K == 0 or L == 0:  # a sum over nothing: no kernel, the same arithmetic on zeros
        c = torch.zeros((*lead, M, L), dtype=torch.float32, device=x.device)
        c = c + (b1.float() if b1 is not None else 0)
        if between is Between.SOFTMAX:
            h = c.softmax(-1)
        elif between is not Between.NONE:
            h = torch_activations()[between.value](c)
        else:
            h = c
        h = h * 0 if gate is not None else h  # (x @ gate: zeros)
        e = h @ w2.float() + (b2.float() if b2 is not None else 0)
        result.copy_(torch.broadcast_to(e, shape))
        return result
    # an MLP's x [..., tokens, dim] against 2-D weights: one [rows, dim] call where x's rows
    # lie evenly in memory (weights read once per row block, not per batch entry)
    rows = lead and w1.dim() == w2.dim() == 2 and (gate is None or gate.dim() == 2)
    if rows and result.is_contiguous():
        try:
            xv, rv = x.view(-1, K), result.view(-1, N)
        except RuntimeError:  # x's rows do not lie evenly: one launch per batch entry below
            xv = rv = None
        if xv is not None:
            mlp(
                xv, w1, w2, b1, b2, activation=activation, gate=gate, out=rv, tf32=tf32, _name=_name
            )
            return result
    n = len(lead)
    ops4 = []
    for t in (x, w1, w2, result) + ((gate,) if gate is not None else ()):
        t = t.reshape((1,) * (n + 2 - t.dim()) + tuple(t.shape)) if t.dim() < n + 2 else t
        t = t.expand(*lead, *t.shape[-2:])
        ops4.append(t)
    if n > 2:  # more than two batch dims: one launch per index of all but the last two
        for at in np.ndindex(*lead[:-2]):
            mlp(ops4[0][at], ops4[1][at], ops4[2][at], b1, b2, activation=activation,
                gate=ops4[4][at] if gate is not None else None, out=ops4[3][at], tf32=tf32,
                _name=_name)  # fmt: skip
        return result
    ops4 = [t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t for t in ops4]
    xa, wb, wd, e = ops4[:4]
    batch, heads = e.shape[0], e.shape[1]
    spec = TritonSpec(dtype, between, bias1=b1 is not None, bias2=b2 is not None,
                      gated=gate is not None, tf32=tf32, interpret=interpret)  # fmt: skip
    plan_between = (
        between.value if between in (Between.RELU, Between.GELU, Between.SOFTMAX) else None
    )
    plan = _plan((batch * heads, M, N, K, L, plan_between, dtype.value), "gemm", _hardware(x))
    tensors = [xa, wb, wd, e] + ([ops4[4]] if gate is not None else [])
    tensors += [t for t in (b1, b2) if t is not None]
    strides = [_four(xa), _four(wb), _four(wd), _four(e)]
    if gate is not None:
        strides.append(_four(ops4[4]))
    _launch(spec, plan, tensors, (batch, heads, 1, M, N, K, L), strides, LOG2E)
    return result


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
    """SDPA semantics as one Triton kernel (the arguments as `ops.attention`'s)."""
    check_flags(is_causal, enable_gqa, dropout_p)
    cap = builders.check_softcap(softcap)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale: expected a real number or None, got {scale!r}")
    dtype, interpret = _checked(
        "q, k, v, attn_mask",
        q,
        k,
        v,
        None if attn_mask is None or attn_mask.dtype == _torch().bool else attn_mask,
    )
    torch = _torch()
    if attn_mask is not None and attn_mask.device != q.device:
        raise ValueError(f"attn_mask: expected device {q.device} (q's), got {attn_mask.device}")
    if min(q.dim(), k.dim(), v.dim()) < 2:
        raise ValueError(f"q, k, v: expected [..., seq, dim] each, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    rank = max(q.dim(), k.dim(), v.dim(), 4)
    q4, k4, v4 = (t.reshape((1,) * (rank - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    if rank > 4:  # batch dims before the heads: merged into one (a view where strides allow)
        lead = torch.broadcast_shapes(q4.shape[:-3], k4.shape[:-3], v4.shape[:-3])
        q4, k4, v4 = (
            t.expand(*lead, *t.shape[-3:]).reshape(-1, *t.shape[-3:]) for t in (q4, k4, v4)
        )
    sq, sk, sv = tuple(q4.shape), tuple(k4.shape), tuple(v4.shape)
    batch, heads, kv_heads = attention_dims(sq, sk, sv, bool(enable_gqa))
    if sk[3] != sq[3]:
        raise ValueError(f"k: expected head dim {sq[3]} (q's), got {sk[3]}")
    if sv[2] != sk[2]:
        raise ValueError(f"v: expected {sk[2]} keys (k's), got {sv[2]}")
    if kv_heads != heads and not (enable_gqa and heads % kv_heads == 0):
        raise ValueError(f"k, v: expected q's heads (or pass enable_gqa=True), got {kv_heads} "
                         f"heads against q's {heads}")  # fmt: skip
    if sk[1] != sv[1] and 1 not in (sk[1], sv[1]):  # grouped each on its own: repeated (a copy)
        k4 = k4.repeat_interleave(kv_heads // sk[1], dim=1)
        v4 = v4.repeat_interleave(kv_heads // sv[1], dim=1)
    q4 = q4.expand(batch, heads, *sq[2:])
    k4, v4 = k4.expand(batch, kv_heads, *sk[2:]), v4.expand(batch, kv_heads, *sv[2:])
    M, K, L, N = sq[2], sq[3], sk[2], sv[3]
    full = (batch, heads, M, L)
    mask_kind = Mask.NONE
    m4 = None
    if attn_mask is not None:
        mshape = tuple(attn_mask.shape)
        if rank > 4 and len(mshape) > 3:  # its batch dims merged as q's, k's and v's
            m = attn_mask.reshape((1,) * (rank - len(mshape)) + mshape)
            attn_mask = m.expand(*lead, *m.shape[-3:]).reshape(-1, *m.shape[-3:])
        if not builders.broadcasts(tuple(attn_mask.shape), full):
            raise ValueError(
                f"attn_mask: shape {tuple(attn_mask.shape)} does not broadcast to {full}"
            )
        m4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(full)
        if attn_mask.dtype == torch.bool:
            mask_kind, m4 = Mask.BOOL, m4.view(torch.uint8)
        else:
            if attn_mask.dtype != q.dtype:
                raise TypeError(
                    f"attn_mask: expected dtype bool or {q.dtype} (q's), got {attn_mask.dtype}"
                )
            mask_kind = Mask.ADDITIVE
    result = torch.empty((batch, heads, M, N), dtype=q.dtype, device=q.device)
    if 0 in (batch, heads, M, N):
        return result.reshape(_result_shape(q, k, v, M, N))
    if L == 0:
        return result.zero_().reshape(_result_shape(q, k, v, M, N))
    s = 1.0 / math.sqrt(K) if scale is None else float(scale)
    spec = TritonSpec(dtype, Between.SOFTMAX, mask_kind, bool(is_causal), interpret=interpret,
                      softcap=cap)  # fmt: skip
    plan = _plan(
        (
            batch,
            heads,
            M,
            L,
            K,
            N,
            bool(is_causal),
            None if mask_kind is Mask.NONE else mask_kind.value,
            None,
            None,
            dtype.value,
            cap,
        ),
        "attention",
        _hardware(q),
    )
    tensors = [q4, k4.transpose(-1, -2), v4, result] + ([m4] if m4 is not None else [])
    strides = [_four(q4), _four(k4.transpose(-1, -2)), _four(v4), _four(result)]
    if m4 is not None:
        strides.append(_four(m4))
    # (the kernel's scores: base 2, or soft-capping's argument 2 s / cap)
    factor = LOG2E if cap is None else 2.0 / cap
    _launch(spec, plan, tensors, (batch, heads, heads // kv_heads, M, N, K, L), strides, s * factor)
    return result.reshape(_result_shape(q, k, v, M, N))


def _result_shape(q: Any, k: Any, v: Any, M: int, N: int) -> tuple[int, ...]:
    """SDPA's result shape: the batch dims of q, k, v broadcast (k's heads grouped), q's rows,
    v's head dim."""
    torch = _torch()
    lead_q = tuple(q.shape[:-2])
    n = max(q.dim(), k.dim(), v.dim()) - 2
    pad = (1,) * (n - len(lead_q)) + lead_q
    others = [tuple(t.shape[:-2]) for t in (k, v)]
    others = [(1,) * (n - len(o)) + o for o in others]
    # heads (dim -3) follow q's; the other batch dims broadcast
    if n >= 1:
        rest = torch.broadcast_shapes(pad[:-1], *(o[:-1] for o in others)) if n > 1 else ()
        heads = pad[-1] if pad[-1] != 1 else max(o[-1] for o in others)
        return (*rest, heads, M, N)
    return (M, N)
