"""`chainfuse.compile(chain) -> Kernel`: plan, emit C, build (cached), load, call without copies.

    kernel = chainfuse.compile(chainfuse.gemm_chain(12, 512, 64, 64, 512, "relu"))
    E = kernel(A, B, D)            # numpy in, numpy out; torch CPU tensors in, torch out
    kernel(A, B, D, out=E)         # into a preallocated output
    print(kernel.plan); print(kernel.source)

Arrays are passed by pointer and strides: any layout whose last dimension is contiguous works
without a copy; anything else is an error naming the tensor (never a silent copy).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from chainfuse import config
from chainfuse.codegen.c import GemmChainShape, GemmChainSpec, emit_gemm_chain, match_gemm_chain
from chainfuse.hardware import Hardware, resolve
from chainfuse.ir import Affine, Chain, DType, MaskKind, Role, Softmax
from chainfuse.kernels import Problem, select
from chainfuse.planner import Plan, plan
from chainfuse.runtime import build, get_num_threads, load, write_atomic

__all__ = ["Kernel", "compile"]


@dataclass(frozen=True)
class _Arg:
    """A validated array argument: its data pointer and strides in elements."""

    ptr: int
    strides: tuple[int, ...]


def _is_torch(x: object) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _check(
    name: str, x: object, shape: tuple[int, ...], writable: bool = False, dtype: str = "float32"
) -> _Arg:
    """Validate one argument; errors name the tensor and what was expected."""
    if _is_torch(x):
        t: Any = x
        if t.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
        if str(t.dtype) != f"torch.{dtype}":
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.requires_grad and writable:
            raise ValueError(f"{name}: the output must not require grad")
        strides = tuple(int(s) for s in t.stride())
        ptr = int(t.data_ptr())
    elif isinstance(x, np.ndarray):
        if x.dtype != np.dtype(dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: the output array is read-only")
        if any(s % x.itemsize for s in x.strides):
            raise ValueError(f"{name}: strides {x.strides} are not whole elements")
        strides = tuple(s // x.itemsize for s in x.strides)
        ptr = int(x.ctypes.data)
    else:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    if shape and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name}: its last dimension must be contiguous (stride 1, got {strides[-1]}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    return _Arg(ptr, strides)


class Kernel:
    """A compiled chain: call it with the chain's inputs (in `chain.inputs` order)."""

    def __init__(
        self, chain: Chain, plan_: Plan, spec: GemmChainSpec, shape: GemmChainShape, source: str
    ) -> None:
        self.chain = chain
        self.shape = shape
        self.plan = plan_
        self.spec = spec
        self.source = source
        start = time.perf_counter()
        result = build(source, spec.name, spec.kernel.cflags)
        self.compile_seconds = time.perf_counter() - start
        self.cached = result.cached
        self.path = result.path
        lib = load(result.path)
        self._fn = getattr(lib, spec.name)
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [
            ctypes.POINTER(ctypes.c_long),
            ctypes.POINTER(ctypes.c_long),
            ctypes.c_float,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_long),
            ctypes.c_void_p,
            ctypes.c_long,
            ctypes.c_int,
        ]
        self._workspace_fn = getattr(lib, f"{spec.name}_workspace")
        self._workspace_fn.restype = ctypes.c_long
        self._workspace_fn.argtypes = [ctypes.c_long, ctypes.c_long]
        self._local = threading.local()
        soft = [op for op in chain.ops if isinstance(op, Softmax)]
        self._scale = soft[0].scale if soft else 1.0
        self._prepare()

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.path})"

    def _workspace(self, threads: int, per: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        key = (threads, per)
        if getattr(self._local, "key", None) != key:
            self._local.key = key
            self._local.buf = np.empty(threads * per + 16, dtype=np.float32)
        buf: np.ndarray[Any, np.dtype[np.float32]] = self._local.buf
        return buf

    def _mask(self, by_name: dict[str, Any]) -> tuple[int | None, list[int]]:
        """The mask's pointer and its strides along (batch0, batch1, m, l); 0 where it broadcasts."""
        if self._mask_index is None:
            return None, [0, 0, 0, 0]
        name, dtype, index = self._mask_index
        arg = _check(name, by_name[name], self._shapes[name], dtype=dtype)
        by_loop = {ix.loops[0]: st for ix, st in zip(index, arg.strides, strict=True) if ix.loops}
        return arg.ptr, [by_loop.get(lp, 0) if lp is not None else 0 for lp in self._mask_loops]

    def _prepare(self) -> None:
        """What every call needs and no call changes: names, shapes, sizes, workspace size."""
        chain = self.chain
        self._names = [t.name for t in chain.inputs]
        self._shapes = {t.name: t.shape for t in chain.tensors}
        ext = chain.extents
        first, second = chain.contractions
        m, l_ = first.output.loops[-2:]
        K, N = ext[first.reduction[0]], ext[second.output.loops[-1]]
        self._nb = len(self.spec.batch)
        sizes = [1] * (2 - self._nb) + [ext[n] for n in self.spec.batch]
        self._sizes = (ctypes.c_long * 6)(*sizes, ext[m], N, K, ext[l_])
        self._per = int(self._workspace_fn(K, N))
        self._mask_loops: list[str | None] = [None] * (2 - self._nb) + [*self.spec.batch, m, l_]
        self._mask_index: tuple[str, str, tuple[Affine, ...]] | None = None
        soft = next((op for op in chain.ops if isinstance(op, Softmax)), None)
        if soft is not None and soft.mask is not None:
            dtype = "bool" if soft.mask_kind is MaskKind.BOOL else "float32"
            self._mask_index = (soft.mask.tensor, dtype, soft.mask.index)

    def __call__(self, *inputs: Any, out: Any = None) -> Any:
        names = self._names
        if len(inputs) != len(names):
            chain = self.chain.name
            raise TypeError(f"{chain}: expected {len(names)} inputs ({', '.join(names)})")
        a_name, b_name, d_name, e_name = self.spec.tensors
        by_name = dict(zip(names, inputs, strict=True))
        args = [_check(n, by_name[n], self._shapes[n]) for n in (a_name, b_name, d_name)]
        out_shape = self._shapes[e_name]
        if out is None:
            if _is_torch(inputs[0]):
                import torch

                out = torch.empty(out_shape, dtype=torch.float32)
            else:
                out = np.empty(out_shape, dtype=np.float32)
        args.append(_check("out", out, out_shape, writable=True))
        nb = self._nb
        strides: list[int] = []
        for arg in args:
            strides += [0] * (2 - nb) + list(arg.strides[:nb]) + [arg.strides[nb]]
        mask_ptr, mask_strides = self._mask(by_name)
        threads = get_num_threads()
        work = self._workspace(threads, self._per)
        base = (-work.ctypes.data % 64) // 4  # 64-byte aligned start
        self._fn(
            args[0].ptr,
            args[1].ptr,
            args[2].ptr,
            args[3].ptr,
            self._sizes,
            (ctypes.c_long * 12)(*strides),
            ctypes.c_float(self._scale),
            mask_ptr,
            (ctypes.c_long * 4)(*mask_strides),
            work.ctypes.data + 4 * base,
            self._per,
            threads,
        )
        return out


def _structure(chain: Chain, batch: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The (order, depth) the C backend implements: batch, m, l shared; k | n private."""
    first, second = chain.contractions
    m, l_ = first.output.loops[-2:]
    return (*batch, m, l_, first.reduction[0], second.output.loops[-1]), len(batch) + 2


def compile(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    tiles: Mapping[str, int] | None = None,
) -> Kernel:
    """Plan `chain` for this machine, generate and build its fused kernel, and load it.

    `tiles` overrides the planner's tiles of the code level (loop name -> tile; tests and
    tuning use it to reach every path of the generated loops).
    """
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    if chain.dtype is not DType.FLOAT32:
        raise TypeError(
            f"{chain.name}: only float32 chains compile for now, got {chain.dtype.value}"
        )
    hw = resolve(hardware)
    shape = match_gemm_chain(chain)
    batch = shape.batch
    order, depth = _structure(chain, batch)
    first = chain.contractions[0]
    m, l_ = first.output.loops[-2:]
    k, n = order[len(batch) + 2 :]
    ext = chain.extents
    kernel = select(Problem(DType.FLOAT32, ext[m], ext[l_], ext[k]), hw)
    # the generated code computes the transposed chain: m runs along the micro-kernel's nr
    # columns, l and n along its mr rows
    quanta = {m: kernel.nr, l_: kernel.mr, n: kernel.mr}
    chosen = plan(chain, hw, threads=threads, fuse=True, structures=[(order, depth)], quanta=quanta)
    planned = chosen.tiles_at(_code_level(hw))
    assert planned is not None
    tiles = {**planned, **(tiles or {})}
    for loop, t in tiles.items():
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
    spec = GemmChainSpec(
        batch=batch,
        tensors=shape.tensors,
        b_transposed=shape.b_transposed,
        epilogue=shape.epilogue,
        mask=shape.mask,
        causal=shape.causal,
        T_M=tiles[m],
        T_L=tiles[l_],
        T_K=tiles[k],
        T_N=tiles[n],
        kernel=kernel,
    )
    header = _header(chain, chosen, spec)
    return Kernel(chain, chosen, spec, shape, emit_gemm_chain(spec, header))


def _remembered_plan(
    chain: Chain,
    hw: Hardware,
    threads: int | None,
    structure: tuple[tuple[str, ...], int],
    quanta: Mapping[str, int],
) -> Plan:
    """`plan(...)` for the backend's structure, kept on disk next to the compiled kernels.

    Planning costs tens of milliseconds; a process that reuses a compiled kernel should not pay
    it again. The key holds everything the plan depends on, chainfuse's version included.
    """
    import chainfuse

    parts = [chain.to_json(), hw.to_json(), threads, structure, sorted(quanta.items())]
    parts.append(chainfuse.__version__)
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    path = config.cache_dir() / "plans" / key[:2] / f"{key[:32]}.json"
    try:
        return Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        pass
    chosen = plan(chain, hw, threads=threads, fuse=True, structures=[structure], quanta=quanta)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, chosen.to_json().encode())
    except OSError:
        pass  # an unwritable cache only costs planning again next time
    return chosen


def _code_level(hw: Hardware) -> str:
    """The level whose tiles the generated loop nest uses: the largest per-core cache."""
    private = [lv.name for lv in hw.levels[:-1] if not lv.shared]
    return private[-1] if private else hw.levels[0].name


def _header(chain: Chain, chosen: Plan, spec: GemmChainSpec) -> str:
    """The source's opening comment: structure and schedule only (no sizes: those are arguments,
    so the same source, and the same compiled object, serves every size)."""
    ops = "\n".join(f"  {op}" for op in chain.ops)
    roles = ", ".join(
        f"{t.name} ({t.role.value})" for t in chain.tensors if t.role is not Role.INTERMEDIATE
    )
    return (
        f"chainfuse generated kernel {spec.name}\n"
        f"chain:\n{ops}\n"
        f"tensors: {roles}\n"
        f"order {' > '.join(chosen.order)}, shared {' > '.join(chosen.prefix)}; "
        f"tiles T_M={spec.T_M} T_L={spec.T_L} T_K={spec.T_K} T_N={spec.T_N}\n"
        f"micro-kernel {spec.kernel.name} ({spec.kernel.mr}x{spec.kernel.nr}); "
        f"epilogue {spec.epilogue.value}; parallel over {', '.join(chosen.parallel)}"
    )
