"""Weights packed once for the AMX kernels: `pack_weights(B, D)` lays an MLP's bf16 weights out
as the tiles TDPBF16PS reads (VNNI pairs), so that a call passing `packed=` reads them as they
are instead of packing B and D per row block, every call.

P = chainfuse.ops.pack_weights(W1.T, W2.T)              # once, e.g. when a model is frozen
E = chainfuse.ops.gemm_chain(x, W1.T, W2.T, "gelu", bias1=b1, bias2=b2, packed=P)

The packing depends on the weights' values and sizes only (not on the call's rows, tiles or
threads), so one packing serves every call with those weights. A call still passes B and D:
the fp32 path (no AMX, or `CHAINFUSE_AMX=off`) reads them as stored and ignores `packed`. The
packing is a copy: after the weights change, pack them again.

Layout (uint16, bf16 bits): a 64-byte header of 8 int64 (`MAGIC`, `VERSION`, K, L, N, gated,
0, 0), then B's tiles over all of l, [a gated MLP's B3's,] then D's, each laid out as
`codegen.amx_chain`'s `cf_amx_pack_vnni` lays out a panel, zeros past K, L and N.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chainfuse.codegen.amx_chain import PACKED_HEADER
from chainfuse.operands import is_torch
from chainfuse.ops.arguments import dtype_name, shape_of, steps_of

__all__ = ["MAGIC", "VERSION", "pack_weights", "packed_for_call", "packed_pointer"]

MAGIC = 0x4B50_4643  # "CFPK" read little-endian
VERSION = 1


def pack_weights(B: Any, D: Any, B3: Any = None) -> Any:
    """B [K, L] and D [L, N] (and a gated MLP's up projection B3 [K, L]), bfloat16 torch
    tensors or numpy arrays of ml_dtypes.bfloat16, stored either way (`W.T` views of
    nn.Linear's weights included), packed for the AMX kernels: a 1-D int16 tensor (torch
    inputs) or uint16 array (numpy) to pass as `packed=` to `gemm_chain` (`gated_mlp` with B3).
    """
    K, L = _matrix("B", B)
    L2, N = _matrix("D", D)
    if L2 != L:
        raise ValueError(f"D: expected {L} rows (B's L), got shape {(L2, N)}")
    if B3 is not None and _matrix("B3", B3) != (K, L):
        raise ValueError(f"B3: expected B's shape {(K, L)}, got {tuple(B3.shape)}")
    header = np.array([MAGIC, VERSION, K, L, N, int(B3 is not None), 0, 0], np.int64)
    assert header.nbytes == 2 * PACKED_HEADER
    kp, lp, np_ = _padded(K, L, N)
    parts = [header.view(np.uint16), _vnni(_bits(B), kp, lp)]
    if B3 is not None:
        parts.append(_vnni(_bits(B3), kp, lp))
    parts.append(_vnni(_bits(D), lp, np_))
    packed = np.concatenate([p.reshape(-1) for p in parts])
    if is_torch(B):
        import torch

        return torch.from_numpy(packed.view(np.int16))
    return packed


def packed_pointer(packed: Any, K: int, L: int, N: int, gated: bool) -> int:
    """The address of `packed` (`pack_weights`'s) after checking that it packs weights of a
    call's sizes (K, L, N; gated or not): a clear error where it does not."""
    if packed.__class__ is np.ndarray or isinstance(packed, np.ndarray):
        if packed.dtype not in (np.uint16, np.int16) or packed.ndim != 1:
            raise TypeError(f"packed: expected pack_weights' 1-D uint16 array, got "
                            f"{packed.dtype} of shape {packed.shape}")  # fmt: skip
        if not packed.flags.c_contiguous:
            raise ValueError("packed: expected a contiguous array (pack_weights' own)")
        header = packed[:PACKED_HEADER].view(np.int64) if packed.size >= PACKED_HEADER else None
        address, size = int(packed.ctypes.data), packed.size
    elif is_torch(packed):
        import torch

        if packed.dtype not in (torch.int16, torch.uint16) or packed.dim() != 1:
            raise TypeError(f"packed: expected pack_weights' 1-D int16 tensor, got "
                            f"{packed.dtype} of shape {tuple(packed.shape)}")  # fmt: skip
        if packed.device.type != "cpu" or not packed.is_contiguous():
            raise ValueError("packed: expected a contiguous CPU tensor (pack_weights' own)")
        host = packed[:PACKED_HEADER].numpy() if packed.numel() >= PACKED_HEADER else None
        header = host.view(np.int64) if host is not None else None
        address, size = packed.data_ptr(), packed.numel()
    else:
        raise TypeError(f"packed: expected pack_weights' result, got {type(packed).__name__}")
    if header is None or int(header[0]) != MAGIC:
        raise ValueError("packed: not made by chainfuse.ops.pack_weights")
    if int(header[1]) != VERSION:
        raise ValueError(f"packed: made by another chainfuse (layout {int(header[1])}, this "
                         f"one reads {VERSION}): pack the weights again")  # fmt: skip
    have = tuple(int(v) for v in header[2:6])
    if have != (K, L, N, int(gated)):
        kinds = ("a two-GEMM chain's", "a gated MLP's")
        raise ValueError(f"packed: holds {kinds[have[3]]} weights of K, L, N = {have[:3]}; this"
                         f" call is {kinds[int(gated)]} of {(K, L, N)}")  # fmt: skip
    kp, lp, np_ = _padded(K, L, N)
    if size != PACKED_HEADER + (1 + int(gated)) * kp * lp + lp * np_:
        raise ValueError(f"packed: {size} elements, not the {K}x{L}x{N} packing's")
    return address


def packed_for_call(packed: Any, A: Any, B: Any, D: Any, B3: Any = None) -> int:
    """The address of `packed` for a call on A, B, D [, B3], checked: weights the same for
    every batch (2-D, or batch dims of 1 or of stride 0), bf16 (the packing's dtype), and
    `pack_weights`' of their sizes."""
    if dtype_name(A.dtype) != "bfloat16":
        raise ValueError(f"packed: a packing of bf16 weights for the AMX kernels; this call's "
                         f"operands are {A.dtype}")  # fmt: skip
    for name, x in (("B", B), ("D", D), ("B3", B3)):
        if x is None:
            continue
        lead = zip(x.shape[:-2], steps_of(x)[:-2], strict=True)
        if any(size > 1 and step != 0 for size, step in lead):
            raise ValueError(f"packed: {name} differs per batch ({tuple(x.shape)}); packed "
                             "weights are one 2-D matrix each")  # fmt: skip
    K, L, N = A.shape[-1], B.shape[-1], D.shape[-1]
    return packed_pointer(packed, K, L, N, B3 is not None)


def _matrix(name: str, x: Any) -> tuple[int, int]:
    shape = shape_of(name, x, float32=False)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D weight, got shape {shape}")
    if dtype_name(x.dtype) != "bfloat16":
        raise TypeError(f"{name}: expected bfloat16 (the AMX kernels' weights), got {x.dtype}")
    if is_torch(x) and x.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor (the AMX kernels'), got {x.device}")
    return shape[0], shape[1]


def _bits(x: Any) -> np.ndarray:
    """x's values as their bf16 bits, uint16, row-major."""
    if is_torch(x):
        import torch

        bits: np.ndarray = x.detach().contiguous().view(torch.int16).numpy()
        return bits.view(np.uint16)
    return np.ascontiguousarray(x).view(np.uint16)


def _padded(K: int, L: int, N: int) -> tuple[int, int, int]:
    """K and L to whole 32s (k blocks, l blocks), N to whole 16s (tiles): the packing's sizes."""
    return -(-K // 32) * 32, -(-L // 32) * 32, -(-N // 16) * 16


def _vnni(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """x [r, c] zero-padded to [rows, cols] (whole 32s, whole 16s) as VNNI tiles, column tile
    major: tile (p, c) at (c * rows / 32 + p) * 512, its row q holding x[32p + 2q, 16c + j] and
    x[32p + 2q + 1, 16c + j] at 2j and 2j + 1 (`cf_amx_pack_vnni`'s layout)."""
    padded = np.zeros((rows, cols), np.uint16)
    padded[: x.shape[0], : x.shape[1]] = x
    tiles = padded.reshape(rows // 32, 16, 2, cols // 16, 16)  # [p, q, e, c, j]
    return tiles.transpose(3, 0, 1, 4, 2).copy()  # [c, p, q, j, e]
