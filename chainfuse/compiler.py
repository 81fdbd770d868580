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
import dataclasses
import functools
import hashlib
import json
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from chainfuse import config
from chainfuse.codegen.conv import (
    GEOMETRY,
    ConvChainShape,
    ConvChainSpec,
    ConvTiles,
    Halo,
    choose_halo,
    code_tiles,
    emit_conv_chain,
    geometry,
    match_conv_chain,
)
from chainfuse.codegen.gemm_chain import PACKED, emit_gemm_chain
from chainfuse.codegen.gemm_spec import (
    Epilogue,
    GemmChainShape,
    GemmChainSpec,
    holds_head,
    match_gemm_chain,
)
from chainfuse.codegen.rows import ROWS_MAX, row_path_rows, rows_past_strips
from chainfuse.codegen.softmax import exponentiates_beside_op1
from chainfuse.hardware import Hardware, resolve
from chainfuse.ir import Affine, Chain, DType, MaskKind, Role, Softmax
from chainfuse.kernels import Problem, select_weighted
from chainfuse.model import code_level
from chainfuse.planner import Plan, PlanningError, plan
from chainfuse.runtime import build_recipe, files_fingerprint, get_num_threads, load, write_atomic

__all__ = ["ConvKernel", "Kernel", "compile", "compile_conv"]

_A, _B, _D, _E = PACKED["A"], PACKED["B"], PACKED["D"], PACKED["E"]
_STRIDES = slice(PACKED["strides"], PACKED["strides"] + 12)
# Below this predicted time a call runs on one thread: waking a passively waiting OpenMP worker
# and joining it costs 20-60 us here (12 heads of 32 keys: 0.16 ms on two threads, 0.10 on one).
ALONE_S = 40e-6
_MASK, _MASK_STRIDES = PACKED["mask"], slice(PACKED["mask_strides"], PACKED["mask_strides"] + 4)
_KEYS = PACKED["sizes"] + 5  # L: what a call with another number of keys changes


#: A validated array argument: its data pointer and its strides in elements (a plain tuple: a
#: call checks four to six of them, and a dataclass would cost a microsecond each)
_Arg = tuple[int, tuple[int, ...]]


_TORCH_TYPES: set[type] = set()


def _is_torch(x: object) -> bool:
    kind = type(x)
    if kind in _TORCH_TYPES:
        return True
    if kind.__module__.split(".")[0] == "torch":
        _TORCH_TYPES.add(kind)
        return True
    return False


def _check(
    name: str,
    x: object,
    shape: tuple[int, ...],
    writable: bool = False,
    dtype: str = "float32",
    inner_contiguous: bool = True,
) -> _Arg:
    """Validate one argument; errors name the tensor and what was expected.

    Every call of a kernel runs this on each argument, so the common case (a numpy array or a
    CPU tensor of the right dtype and shape) takes the fewest attribute lookups: for a short
    sequence the kernel itself takes tens of microseconds.
    """
    if type(x) is np.ndarray:
        want = _NP_DTYPES.get(dtype)
        if x.dtype != want if want is not None else x.dtype.name != dtype:
            raise TypeError(f"{name}: expected dtype {dtype}, got {x.dtype}")
        if x.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")
        flags = x.flags
        if writable and not flags.writeable:
            raise ValueError(f"{name}: the output array is read-only")
        if flags.c_contiguous:
            strides = _contiguous(shape)
        else:
            size = x.itemsize
            strides = tuple(s // size for s in x.strides)
            if any(s % size for s in x.strides):
                raise ValueError(f"{name}: strides {x.strides} are not whole elements")
        ptr = _pointer(x)
    elif _is_torch(x):
        t: Any = x
        if not t.is_cpu:
            raise ValueError(f"{name}: expected a CPU tensor, got device {t.device}")
        if t.dtype is not _torch_dtype(dtype):
            raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if t.shape != shape:  # a torch.Size is a tuple
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
        if t.requires_grad and writable:
            raise ValueError(f"{name}: the output must not require grad")
        strides = tuple(t.stride())
        ptr = int(t.data_ptr())
    elif isinstance(x, np.ndarray):  # a subclass: the same checks, the slow way
        return _check(name, np.asarray(x), shape, writable, dtype, inner_contiguous)
    else:
        raise TypeError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    if inner_contiguous and shape and shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(
            f"{name}: its last dimension must be contiguous (stride 1, got {strides[-1]}); "
            "pass np.ascontiguousarray(x) or x.contiguous()"
        )
    return ptr, strides


def _recheck(
    name: str, x: Any, shape: tuple[int, ...], dtype: str, inner_contiguous: bool = True
) -> _Arg:
    """`_check` for an operand whose kind, dtype, device and grad flag a replay key fixed (a
    numpy array or a CPU tensor outside autograd): its shape and strides only, the rest by
    `_check`, which also raises what is wrong."""
    if type(x) is np.ndarray:
        if x.shape == shape and x.flags.c_contiguous:
            return _pointer(x), _contiguous(shape)
    elif x.shape == shape:
        strides = x.stride()
        if strides[-1:] == (1,):
            return x.data_ptr(), strides
    return _check(name, x, shape, dtype=dtype, inner_contiguous=inner_contiguous)


def _pointer(x: Any) -> int:
    """The data pointer of an operand `_check` took before with this kind, shape, strides,
    dtype and (numpy) writeable flag, or is checking now. `from_buffer` takes only whole
    writable buffers."""
    if type(x) is np.ndarray:
        flags = x.flags
        if flags.writeable and flags.c_contiguous:
            return ctypes.addressof(_BYTE.from_buffer(cast(Any, x)))  # 3x .ctypes.data's speed
        return int(x.ctypes.data)
    return int(x.data_ptr())


_NP_DTYPES = {"float32": np.dtype(np.float32), "bool": np.dtype(np.bool_)}
_TORCH_DTYPES: dict[str, Any] = {}


def _torch_dtype(dtype: str) -> Any:
    """torch's dtype object of a chain dtype name (torch is imported: a tensor was passed)."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        import torch

        found = _TORCH_DTYPES[dtype] = getattr(torch, dtype)
    return found


_BYTE = ctypes.c_char


def _torch_empty(like: Any, shape: tuple[int, ...], dtype: str) -> Any:
    """A new contiguous CPU tensor for a call's output. `torch.empty_like` of an input of that
    shape, dtype and layout when there is one: without keyword arguments it costs half as
    much (~1.3 us against ~3.5 us, a tenth of a short attention call)."""
    torch_dtype = _torch_dtype(dtype)
    torch = sys.modules["torch"]  # imported: `like` is a tensor
    if like.shape == shape and like.dtype is torch_dtype and like.is_contiguous():
        return torch.empty_like(like)
    return torch.empty(shape, dtype=torch_dtype)


@functools.lru_cache(maxsize=1024)
def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape`."""
    out = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        out[i] = out[i + 1] * shape[i + 1]
    return tuple(out)


class _Built:
    """Build (or find in the cache) and load a generated source; what both kernels record.

    The source is generated from the spec and the header (`recipe`) only when the cache does
    not already hold its object (`build_recipe`), or when `source` is read."""

    compile_seconds: float
    cached: bool
    path: Path
    _source: str | None = None
    _make_source: Callable[[], str]

    def _build(
        self, make_source: Callable[[], str], recipe: str, name: str, cflags: tuple[str, ...]
    ) -> ctypes.CDLL:
        start = time.perf_counter()
        self._make_source = make_source
        result = build_recipe(recipe, name, self._generate, cflags)
        self.compile_seconds = time.perf_counter() - start
        self.cached = result.cached
        self.path = result.path
        return load(result.path)

    def _generate(self) -> str:
        if self._source is None:
            self._source = self._make_source()
        return self._source

    @property
    def source(self) -> str:
        """The generated C source of this kernel (the header names its chain and plan)."""
        return self._generate()


class Kernel(_Built):
    """A compiled chain: call it with the chain's inputs (in `chain.inputs` order)."""

    def __init__(
        self,
        chain: Chain,
        plan_: Plan,
        spec: GemmChainSpec,
        shape: GemmChainShape,
        header: str,
        cache_bytes: int,
    ) -> None:
        self.chain = chain
        self.shape = shape
        self.plan = plan_
        self.spec = spec
        self.arithmetic = arithmetic(spec)
        lib = self._build(
            lambda: emit_gemm_chain(spec, header), f"{spec.name}\n{header}", spec.name,
            spec.kernel.cflags,
        )  # fmt: skip
        # one pointer argument: ctypes converts each argument of a call (~0.2 us apiece)
        self._fn = getattr(lib, f"{spec.name}_packed")
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p]
        self._workspace_fn = getattr(lib, f"{spec.name}_workspace")
        self._workspace_fn.restype = ctypes.c_long
        self._workspace_fn.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
        # the plan's tiles: run-time arguments of the object, which every plan shares
        self._tiles = (spec.T_M, spec.T_L, spec.T_K, spec.T_N)
        self._local = threading.local()
        # the last cache level's bytes: how far the row path reaches (`row_path_rows`)
        self._cache_bytes = cache_bytes
        soft = [op for op in chain.ops if isinstance(op, Softmax)]
        self._scale = soft[0].scale if soft else 1.0
        self._dtype = chain.dtype.value  # of every input and the output (masks: see _prepare)
        # work the plan predicts shorter than waking a waiting worker runs on the calling thread
        self._alone = plan_.predicted_time_s < ALONE_S
        self._prepare()

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.path})"

    def describe(self) -> str:
        """What the compiled code runs, beside the plan (`plan`'s register block is the model's
        quantum; the code computes the transposed chain): the micro-kernel and how the chain's
        loops lie on its block, the code-level tiles, and which rows take the row path (blocks
        of at most `row_path_rows` rows of m, judged by the chain's own sizes, and a block's last
        few past whole strips, `rows_past_strips`: dot products and sums, compiled for the
        kernel's ISA)."""
        spec, ext = self.spec, self.chain.extents
        m, l_ = self.chain.contractions[0].output.loops[-2:]
        n = self.chain.contractions[1].output.loops[-1]
        uk, M = spec.kernel, ext[m]
        tiles = f"tiles T_M={spec.T_M} T_L={spec.T_L} T_K={spec.T_K} T_N={spec.T_N}"
        reach = row_path_rows(spec, _bd_bytes(self.chain, self.shape), self._cache_bytes)
        if reach >= M:  # (all of m)
            return (
                f"  code: the row path for all {M} rows of {m} (<= {reach}), no register"
                f" block (built for {uk.name}'s ISA); {tiles}"
            )
        mr, nr = uk.mr, uk.nr
        text = (
            f"  code: micro-kernel {uk.name}; op1's blocks {mr} rows of {l_} by {nr} of {m},"
            f" op2's {mr} of {n} by {nr} of {m} (or {mr} of {m} by {nr} of {n} where it writes"
            f" {spec.tensors[3]} directly); {tiles}"
        )
        if exponentiates_beside_op1(spec):
            k = ",".join(self.chain.contractions[0].reduction)
            text += (
                f"\n  the softmax's exponentials: each block of {mr} rows of {l_} during the next"
                f" block's FMAs (whole strips of {nr} of {m}, {k} in one block)"
            )
        outer = max(self._outer_m, spec.T_M)  # the rows of m a parallel block holds
        tails = {r % spec.T_M for r in (outer, M % outer or outer)} - {0}
        short = sorted(t for t in tails if t <= reach)
        if short:
            text += (
                f"\n  a last row block of {' or '.join(map(str, short))} rows of {m}: the row path"
            )
        # a block's few rows past whole strips of nr (codegen's ROWS_TAIL): the row path too
        blocks = {spec.T_M for r in (outer, M % outer or outer) if r >= spec.T_M} | tails
        few = sorted({rows_past_strips(b, uk) for b in blocks} - {0})
        if few:
            split = "" if spec.epilogue is Epilogue.SOFTMAX else " (unless threads split l)"
            text += (
                f"\n  a row block's last {' or '.join(map(str, few))}"
                f" {'row' if few == [1] else 'rows'} of {m} past whole"
                f" blocks of {nr}: the row path{split}"
            )
        return text

    def _workspace(self, threads: int) -> Any:
        """This thread's argument array for `threads` threads (`codegen.c.PACKED`), its
        workspace (64-byte aligned), sizes and scale filled in: kept between calls, so a call
        allocates nothing and writes only what changed."""
        local = self._local
        if getattr(local, "threads", None) != threads:
            local.threads = threads
            local.buf = np.empty(threads * self._per + 16, dtype=np.float32)
            address = int(local.buf.ctypes.data)
            args = (ctypes.c_long * PACKED["end"])()
            args[PACKED["work"]] = address + 4 * ((-address % 64) // 4)
            args[PACKED["work_per_thread"]] = self._per
            args[PACKED["nthreads"]] = threads
            args[PACKED["outer_m"]] = self._outer_m
            args[PACKED["cache_bytes"]] = self._cache_bytes
            at = PACKED["tiles"]
            args[at : at + 4] = list(self._tiles)
            args[PACKED["scale_bits"]] = int.from_bytes(struct.pack("<f", self._scale), "little")
            at = PACKED["sizes"]
            args[at : at + 6] = list(self._sizes)
            local.args = args
            local.address = ctypes.addressof(args)
            local.strides = None  # what args holds: refilled when a call's strides differ
        return local

    def _mask(
        self,
        mask: Any,
        shapes: Mapping[str, tuple[int, ...]],
        recheck: bool = False,
    ) -> tuple[int, list[int]]:
        """The mask's pointer and its strides along (batch0, batch1, m, l); 0 where it
        broadcasts; checked by `_check`, or by `_recheck` on a replay. The kernels read the mask
        element by element along l, by its stride: any stride there (0: expanded) will do."""
        assert self._mask_index is not None
        name, dtype, _ = self._mask_index
        check = _recheck if recheck else _check
        ptr, strides = check(name, mask, shapes[name], dtype=dtype, inner_contiguous=False)
        return ptr, [strides[i] if i >= 0 else 0 for i in self._mask_dims]

    def _prepare(self) -> None:
        """What every call needs and no call changes: names, shapes, sizes, workspace size."""
        chain = self.chain
        self._names = [t.name for t in chain.inputs]
        self._shapes = {t.name: t.shape for t in chain.tensors}
        self._positions = tuple(self._names.index(n) for n in self.spec.tensors[:3])
        ext = chain.extents
        first, second = chain.contractions
        m, l_ = first.output.loops[-2:]
        K, N = ext[first.reduction[0]], ext[second.output.loops[-1]]
        self._nb = len(self.spec.batch)
        sizes = [1] * (2 - self._nb) + [ext[n] for n in self.spec.batch]
        self._sizes = (*sizes, ext[m], N, K, ext[l_])
        tiles = (ctypes.c_long * 4)(*self._tiles)
        self._per = int(self._workspace_fn(K, N, ctypes.addressof(tiles)))
        # rows of m per parallel block: the plan's outermost m tile, the blocks its model deals
        # to the cores (a run-time argument, so that one compiled object serves every plan)
        outer = self.plan.tiles_at(self.plan.levels[-1]) or {}
        self._outer_m = outer.get(m, ext[m])
        # per tensor, its dims indexed by l alone: a call with another number of keys
        # (`_bind`'s `keys`) expects those dims that long
        self._l_dims = {
            acc.tensor: {d for d, ix in enumerate(acc.index) if ix.terms == ((l_, 1),)}
            for op in chain.ops
            for acc in (*op.reads, op.output)
        }
        self._shapes_at: dict[int, dict[str, tuple[int, ...]]] = {ext[l_]: self._shapes}
        self._mask_loops: list[str | None] = [None] * (2 - self._nb) + [*self.spec.batch, m, l_]
        self._mask_index: tuple[str, str, tuple[Affine, ...]] | None = None
        self._mask_at = -1  # the mask's position among the inputs
        soft = next((op for op in chain.ops if isinstance(op, Softmax)), None)
        if soft is not None and soft.mask is not None:
            dtype = "bool" if soft.mask_kind is MaskKind.BOOL else self._dtype
            self._mask_index = (soft.mask.tensor, dtype, soft.mask.index)
            self._mask_at = self._names.index(soft.mask.tensor)
            # per (batch0, batch1, m, l): the mask's dim indexed by that loop (-1: none, it
            # broadcasts there, stride 0)
            dims = {ix.loops[0]: d for d, ix in enumerate(soft.mask.index) if ix.loops}
            self._mask_dims = [dims.get(lp, -1) if lp is not None else -1
                               for lp in self._mask_loops]  # fmt: skip

    def __call__(self, *inputs: Any, out: Any = None) -> Any:
        out, pointers, strides, mask_strides = self._bind(inputs, out)
        self._launch(pointers, strides, mask_strides, get_num_threads())
        return out

    def _shapes_for(self, keys: int) -> dict[str, tuple[int, ...]]:
        """The tensors' shapes for a call with `keys` of l (the chain's own for its extent)."""
        found = self._shapes_at.get(keys)
        if found is None:
            if len(self._shapes_at) > 256:
                self._shapes_at = {self._sizes[5]: self._shapes}
            found = self._shapes_at[keys] = {
                name: tuple(keys if d in self._l_dims.get(name, ()) else n
                            for d, n in enumerate(shape))
                for name, shape in self._shapes.items()
            }  # fmt: skip
        return found

    def _bind(
        self, inputs: tuple[Any, ...], out: Any, keys: int | None = None
    ) -> tuple[Any, list[int], tuple[int, ...], list[int] | None]:
        """Check a call's operands (`inputs` in `chain.inputs` order) and its output (a new one
        when `out` is None): (out, the pointers of A, B, D, E [, the mask], their strides along
        the batch dims and rows as the kernel takes them, the mask's along (batch0, batch1, m,
        l) or None). What `_launch` takes; the strides depend on the operands' shapes and
        strides only, so `ops` runs a repeat call from them with new pointers. `keys`: the
        call's extent of l when it is not the chain's (sizes and tiles are run-time arguments:
        `ops` runs every key length of a bucket with one kernel, planned for the longest)."""
        if len(inputs) != len(self._names):
            names = ", ".join(self._names)
            raise TypeError(f"{self.chain.name}: expected {len(self._names)} inputs ({names})")
        dt = self._dtype
        shapes = self._shapes if keys is None else self._shapes_for(keys)
        a_name, b_name, d_name, e_name = self.spec.tensors
        a_at, b_at, d_at = self._positions
        a_ptr, a_st = _check(a_name, inputs[a_at], shapes[a_name], dtype=dt)
        b_ptr, b_st = _check(b_name, inputs[b_at], shapes[b_name], dtype=dt)
        d_ptr, d_st = _check(d_name, inputs[d_at], shapes[d_name], dtype=dt)
        out_shape = shapes[e_name]
        if out is None:
            first = inputs[0]
            out = (
                _torch_empty(first, out_shape, dt)
                if _is_torch(first)
                else np.empty(out_shape, dtype=first.dtype)
            )
        e_ptr, e_st = _check("out", out, out_shape, writable=True, dtype=dt)
        nb = self._nb
        pad = (0,) * (2 - nb)
        strides = (
            *pad, *a_st[: nb + 1], *pad, *b_st[: nb + 1],
            *pad, *d_st[: nb + 1], *pad, *e_st[: nb + 1],
        )  # fmt: skip
        pointers = [a_ptr, b_ptr, d_ptr, e_ptr]
        mask_strides = None
        if self._mask_index is not None:
            mask_ptr, mask_strides = self._mask(inputs[self._mask_at], shapes)
            pointers.append(mask_ptr)
        return out, pointers, strides, mask_strides

    def _bind_keys(
        self, strides: tuple[int, ...], inputs: tuple[Any, ...], keys: int | None
    ) -> tuple[list[int], tuple[int, ...], list[int] | None]:
        """`_bind` for a call like one bound before (its `strides`) but for B, D and the mask,
        which it checks again against `keys` of l: their pointers, the strides with theirs in
        place, and the mask's. A decoder's k, v and padding mask grow by a key every step (and
        their strides with them when each step's tensors are new): the rest of the call, A's
        strides and the result's, stays as it was."""
        dt = self._dtype
        shapes = self._shapes if keys is None else self._shapes_for(keys)
        _, b_name, d_name, _ = self.spec.tensors
        _, b_at, d_at = self._positions
        b_ptr, b_st = _recheck(b_name, inputs[b_at], shapes[b_name], dt)
        d_ptr, d_st = _recheck(d_name, inputs[d_at], shapes[d_name], dt)
        nb = self._nb
        pad = (0,) * (2 - nb)
        new = (*strides[:3], *pad, *b_st[: nb + 1], *pad, *d_st[: nb + 1], *strides[9:])
        pointers = [b_ptr, d_ptr]
        mask_strides = None
        if self._mask_index is not None:
            mask_ptr, mask_strides = self._mask(inputs[self._mask_at], shapes, recheck=True)
            pointers.append(mask_ptr)
        return pointers, new, mask_strides

    def _launch(
        self,
        pointers: Sequence[int],
        strides: tuple[int, ...],
        mask_strides: list[int] | None,
        threads: int,
        keys: int | None = None,
    ) -> None:
        """Run on checked operands (`_bind`'s pointers, strides and mask strides; `keys` as
        `_bind` took it)."""
        local = self._workspace(1 if self._alone else threads)
        packed = local.args
        packed[_KEYS] = self._sizes[5] if keys is None else keys
        if strides != local.strides:
            packed[_STRIDES] = strides
            local.strides = strides
        packed[_A] = pointers[0]
        packed[_B] = pointers[1]
        packed[_D] = pointers[2]
        packed[_E] = pointers[3]
        if mask_strides is not None:
            packed[_MASK] = pointers[4]
            packed[_MASK_STRIDES] = mask_strides
        self._fn(local.address)


def _structure(chain: Chain, batch: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The (order, depth) the C backend implements: batch, m, l shared; k | n private."""
    first, second = chain.contractions
    m, l_ = first.output.loops[-2:]
    return (*batch, m, l_, first.reduction[0], second.output.loops[-1]), len(batch) + 2


def _rows_run(extent: int, tile: int, mr: int, part: int) -> int:
    """The micro-kernel rows `extent` rows in blocks of `tile` run: whole mr-row slivers, and a
    block's tail of at most `part` rows (the kernel's `part_rows`) runs `part` rows, a longer one
    mr rows."""
    total = 0
    for start in range(0, extent, tile):
        full, rest = divmod(min(tile, extent - start), mr)
        total += full * mr + (0 if rest == 0 else part if rest <= part else mr)
    return total


WIDE_ROWS = 64  # a causal 16-bit chain's least row block (see `compile`)


def _m_blocks(extent: int, tile: int, outer: int, nr: int, keys: int, causal: bool) -> int:
    """The planner's row-block tile of m (`tile`, in parallel blocks of `outer` rows) as the
    generated code runs a causal chain. A row block of ROWS_MAX rows or fewer takes the row
    path, which runs a score ~3x slower than the micro-kernel's strips at these sizes; where
    the tile leaves such a block (at the end of a parallel block or of m), a tile up to seven
    strips (`nr`) larger replaces it if that costs less: the scores each block computes (up to
    its last row's key, of `keys`), a short block's thrice. Measured on Zen 3, 1 thread, 12
    causal heads of 64, where the model plans blocks of 16 rows (16 + 8 rows for 24 queries):
    new tile's time over 16's, 24 queries 0.76 (32 rows), 40 0.91 (48), 56 0.92 (32), 136 1.01
    (48); 104 queries keep 16 (48 and 64 rows: 1.08x and 1.07x the time). Not an unmasked
    chain's: its tile is the planner's larger one, whose rows fill the caches it was sized for
    (257 queries in blocks of 144 rather than 128 + 1: 1.075x the time). Blocks of 8 rows that
    `row_path_rows` sends to the tiles count as the row path's here too (a narrow strip
    computes 16 columns for their 8 rows: twice their scores, near the row path's thrice)."""

    def cost(t: int) -> int:
        block, total = max(outer, t), 0
        for mo in range(0, extent, block):
            end = min(extent, mo + block)
            for m0 in range(mo, end, t):
                rows = min(t, end - m0)
                total += rows * min(keys, m0 + rows) * (3 if rows <= ROWS_MAX else 1)
        return total

    block = max(outer, tile)
    short = any(0 < r % tile <= ROWS_MAX for r in (min(block, extent), extent % block))
    if not causal or extent <= ROWS_MAX or tile >= extent or not short:
        return tile
    last = -(-extent // nr) * nr
    options = [t for t in range(tile, min(last, tile + 7 * nr) + 1, nr)]
    return min(options, key=lambda t: (cost(t), t))


def _row_blocks(extent: int, tile: int, mr: int, part: int) -> int:
    """A softmax chain's n tile (`tile`, the planner's) as the generated code runs it where no
    wide block holds the value head (`MicroKernel.wide`): op2 computes Eᵀ with n along the
    micro-kernel's mr rows, and a block's tail of at most `part_rows` rows runs the part block
    (6x64: 4 rows), so 80 = 13 x 6 + 2 runs 82 rows. Where the planner's tile is all of n, two
    or three even blocks that run fewer rows take its place (80 as 2 x (6 x 6 + 4): 80 rows);
    the model counts flops, not these rows. Measured on Zen 4 (interleaved A/B, the 6x64
    kernel): vit-huge-14 and -16 (d = 80) 0.8-2 % faster, 8 heads of 512 or 256 x 128 0.5-1 %,
    8 x 256 x 200 1.8 %, 8 x 256 x 7 (4 + 3 rows) 5 %."""
    if tile < extent or part == 0:
        return tile
    best, best_rows = tile, _rows_run(extent, tile, mr, part)
    for parts in (2, 3):
        even = -(-extent // parts)
        rows = _rows_run(extent, even, mr, part)
        if rows < best_rows:
            best, best_rows = even, rows
    return best


def compile(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    tiles: Mapping[str, int] | None = None,
) -> Kernel:
    """Plan `chain` for this machine, generate and build its fused kernel, and load it.

    `threads` is the thread count the plan is made for (default: `get_num_threads()`, what a
    call will use unless told otherwise); any count still runs it. `tiles` overrides the
    planner's tiles of the code level (loop name -> tile; tests and
    tuning use it to reach every path of the generated loops). A convolution chain
    (`conv_chain_spec`) gives a `ConvKernel`: the same as `compile_conv(chain, ...)`, which is
    the typed entry point (and the one with the conv-only options).
    """
    if isinstance(chain, Chain) and _is_conv(chain):
        # the static type stays Kernel for the GEMM chains every caller compiles; conv callers
        # that want ConvKernel's attributes typed call compile_conv
        return compile_conv(chain, hardware, threads, tiles)  # type: ignore[return-value]
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    if chain.dtype not in (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16):
        raise TypeError(
            f"{chain.name}: float32, bfloat16 and float16 chains compile, got {chain.dtype.value}"
        )
    hw = resolve(hardware)
    shape = match_gemm_chain(chain)
    batch = shape.batch
    order, depth = _structure(chain, batch)
    first = chain.contractions[0]
    m, l_ = first.output.loops[-2:]
    k, n = order[len(batch) + 2 :]
    ext = chain.extents
    for loop, t in (tiles or {}).items():  # (checked before planning: a bad tile costs nothing)
        if loop not in (m, l_, k, n):  # (a misspelt tile would be ignored: a silent default)
            raise ValueError(
                f"tiles: unknown loop {loop!r} for {chain.name}; the code's tiles are of"
                f" {m!r}, {l_!r}, {k!r} and {n!r} (T_M, T_L, T_K, T_N)"
            )
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
    # the generated code computes the transposed chain: m runs along the micro-kernel's nr
    # columns, l and n along its mr rows; both GEMMs run with the kernel, weighed by flops
    op1, op2 = (
        Problem(DType.FLOAT32, ext[l_], ext[m], ext[k]),
        Problem(DType.FLOAT32, ext[n], ext[m], ext[l_]),
    )
    kernel = select_weighted(
        [(op1, ext[l_] * ext[m] * ext[k]), (op2, ext[n] * ext[m] * ext[l_])], hw
    )
    quanta = {m: kernel.nr, l_: kernel.mr, n: kernel.mr}
    planned_for = threads if threads is not None else get_num_threads()
    # with fewer row blocks than threads the kernel's threads split l (not a softmax's: its
    # shares would need their maxima merged), in whole mr-row slivers
    split = None if shape.epilogue is Epilogue.SOFTMAX else (l_, kernel.mr)
    chosen = _remembered_plan(chain, hw, planned_for, (order, depth), quanta, split)
    planned = chosen.tiles_at(code_level(hw))
    assert planned is not None
    wide = ext[n] != kernel.nr and holds_head(kernel, ext[n])
    if shape.epilogue is Epilogue.SOFTMAX and chain.dtype is DType.FLOAT32 and wide:
        # op2 writes E's rows with the whole value head in registers (`codegen.c.wide_heads`):
        # one n block, V's rows read in place
        planned = {**planned, n: ext[n]}
    elif shape.epilogue is Epilogue.SOFTMAX:
        planned = {**planned, n: _row_blocks(ext[n], planned[n], kernel.mr, kernel.part_rows)}
    if shape.causal and chain.dtype is not DType.FLOAT32:
        # 16-bit k and v are widened into fp32 as they are packed, for every row block (fp32's
        # k is read in place): a causal plan's blocks of 16 rows pay that more than the masked
        # scores they save. Measured on Zen 3, 1 thread, time with blocks of 64 rows over 16:
        # bf16 12 x 1024 causal 0.72, 12 x 512 0.76, 2 x 2048 0.71 (16: 0.97x SDPA), fp16
        # 12 x 256 0.77, bf16 12 x 100 0.90; fp32 12 x 1024 1.03 (it keeps the plan's)
        planned = {
            **planned,
            m: max(planned[m], min(WIDE_ROWS, -(-ext[m] // kernel.nr) * kernel.nr)),
        }
    outer = chosen.tiles_at(chosen.levels[-1]) or {}
    planned = {**planned, m: _m_blocks(ext[m], planned[m], outer.get(m, ext[m]), kernel.nr,
                                       ext[l_], shape.causal)}  # fmt: skip
    tiles = {**planned, **(tiles or {})}
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
        dtype=chain.dtype,
    )
    header = _header(chain, chosen, spec)
    return Kernel(chain, chosen, spec, shape, header, _last_cache_bytes(hw))


def _last_cache_bytes(hw: Hardware) -> int:
    """The capacity of the last level before memory (0 where the machine lists no cache)."""
    return hw.levels[-2].capacity if len(hw.levels) > 1 else 0


def _bd_bytes(chain: Chain, shape: GemmChainShape) -> float:
    """Bytes of B and D (attention's K and V) over the whole batch, as the chain declares them:
    what the generated code weighs against the last cache level (`row_path_rows`)."""
    tensors = {t.name: t for t in chain.tensors}
    elem = 4 if chain.dtype is DType.FLOAT32 else 2
    return float(
        sum(np.prod(tensors[n].shape, dtype=np.float64) for n in shape.tensors[1:3]) * elem
    )


def _remembered_plan(
    chain: Chain,
    hw: Hardware,
    threads: int | None,
    structure: tuple[tuple[str, ...], int],
    quanta: Mapping[str, int],
    split: tuple[str, int] | None = None,
) -> Plan:
    """`plan(...)` for the backend's structure, kept on disk next to the compiled kernels.

    Planning costs tens of milliseconds; a process that reuses a compiled kernel should not pay
    it again. The key holds everything the plan depends on, the planner's own source included.
    """
    parts = [chain.to_json(), hw.to_json(), threads, structure, sorted(quanta.items()), split]
    parts.append(_planner_fingerprint())
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()
    path = config.cache_dir() / "plans" / key[:2] / f"{key[:32]}.json"
    try:
        return Plan.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        pass
    chosen = plan(chain, hw, threads=threads, fuse=True, structures=[structure], quanta=quanta,
                  split=split)  # fmt: skip
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, chosen.to_json().encode())
    except OSError:
        pass  # an unwritable cache only costs planning again next time
    return chosen


@functools.cache
def _planner_fingerprint() -> str:
    """chainfuse's version and the files of the modules a plan comes from (`files_fingerprint`):
    a changed model must not be answered with plans remembered from the old one (the version
    alone does not move between releases)."""
    from chainfuse import footprint, model, planner

    return files_fingerprint(Path(str(m.__file__)) for m in (footprint, model, planner))[:16]


def _header(chain: Chain, chosen: Plan, spec: GemmChainSpec) -> str:
    """The source's opening comment: the chain's structure only (no sizes, no tiles: those are
    arguments, so the same source, and the same compiled object, serves every size and every
    plan; `Kernel.plan` says which one a kernel runs)."""
    ops = "\n".join(f"  {op}" for op in chain.ops)
    roles = ", ".join(
        f"{t.name} ({t.role.value})" for t in chain.tensors if t.role is not Role.INTERMEDIATE
    )
    return (
        f"chainfuse generated kernel {spec.name}\n"
        f"chain:\n{ops}\n"
        f"tensors: {roles}\n"
        f"order {' > '.join(chosen.order)}, shared {' > '.join(chosen.prefix)}; "
        "tiles T_M, T_L, T_K, T_N: run-time arguments\n"
        f"micro-kernel {spec.kernel.name} ({spec.kernel.mr}x{spec.kernel.nr}); "
        f"epilogue {spec.epilogue.value}; parallel over the batch and m\n"
        f"arithmetic: {arithmetic(spec)}"
    )


def arithmetic(spec: GemmChainSpec) -> str:
    """What the kernel computes in, said plainly (the plan's record of the path taken)."""
    uk = spec.kernel.name
    if spec.dtype is DType.BFLOAT16:
        return (
            f"bf16 inputs and output, widened to fp32 while packing; fp32 micro-kernel {uk}, "
            "fp32 intermediate, output rounded to bf16 once (no AMX / AVX512-BF16 kernel is "
            "registered for this CPU)"
        )
    if spec.dtype is DType.FLOAT16:
        return (
            f"fp16 inputs and output, widened to fp32 while packing; fp32 micro-kernel {uk}, "
            "fp32 intermediate, output rounded to fp16 once (no AVX512-FP16 / AMX-FP16 kernel "
            "is registered)"
        )
    return f"fp32 micro-kernel {uk}, fp32 intermediate"


# -- convolution chains ---------------------------------------------------------------------------


def _is_conv(chain: Chain) -> bool:
    """A chain whose contractions read through windows (`2*p + r - 1`): a convolution chain."""
    return any(len(ix.terms) > 1 for op in chain.contractions for a in op.reads for ix in a.index)


#: the (order, depth) the conv backend implements: per (n, p2, q2) block the producer runs in
#: front of its consumer (the plan's tiles of p2 x q2 become whole-row bands, see `code_tiles`)
_CONV_ORDER = ("n", "p2", "q2", "k2", "k1", "p1", "q1", "c", "r1", "s1", "r2", "s2")


def _dense_strides(name: str, x: Any, shape: tuple[int, ...], writable: bool = False) -> _Arg:
    """A float32 CPU array in NCHW or channels-last (NHWC) memory order, or a contiguous 1-D one.

    The kernel reads and writes through strides, so both orders are zero-copy; any other layout
    (a strided view) is refused rather than silently copied. Called four to six times per call:
    the checks are `_check`'s, and a (shape, strides) pair found dense once is remembered
    (`_DENSE`: layouts only, never data or addresses).
    """
    arg = _check(name, x, shape, writable, "float32", inner_contiguous=False)
    strides = arg[1]
    if (shape, strides) not in _DENSE:
        orders = _ORDERS if len(shape) == 4 else ((0,),)
        if not any(_dense_in(order, shape, strides) for order in orders):
            kinds = "NCHW or channels_last" if len(shape) == 4 else "contiguous"
            raise ValueError(
                f"{name}: expected a {kinds} array, got strides {strides} for shape {shape}; "
                "pass a contiguous copy (x.contiguous() / np.ascontiguousarray(x))"
            )
        if len(_DENSE) < 4096:
            _DENSE.add((shape, strides))
    return arg


#: (shape, element strides) pairs already found dense (NCHW, channels-last or 1-D contiguous)
_DENSE: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()


_ORDERS = ((0, 1, 2, 3), (0, 2, 3, 1))


def _dense_in(order: tuple[int, ...], shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the dims, innermost last in `order`, are packed without gaps (size-1 dims free)."""
    expected = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            return False
        expected *= shape[d]
    return True


class ConvKernel(_Built):
    """A compiled conv -> [relu] -> conv chain: `kernel(x, w1, w2, b1=None, b2=None, out=None)`.

    `x` [N, C, H, W], `w1` [K1, C, R1, S1], `w2` [K2, K1, R2, S2] (PyTorch's layouts), in NCHW
    or channels-last memory order (numpy arrays or torch CPU tensors, float32); biases [K1] /
    [K2] or None. The result has `x`'s kind and memory order. Every argument is passed by
    pointer and strides, in either order: channels-last `x` is read in place, NCHW `x` a band
    of rows at a time into a channels-last buffer per thread. `halo` says whether overlapping
    rows of the intermediate are kept or recomputed, `halo_reason` why, `tiles` the code tiles.
    """

    def __init__(
        self,
        chain: Chain,
        plan_: Plan,
        spec: ConvChainSpec,
        shape: ConvChainShape,
        tiles: ConvTiles,
        halo_reason: str,
        header: str,
    ) -> None:
        self.chain = chain
        self.plan = plan_
        self.spec = spec
        self.shape = shape
        self.tiles = tiles
        self.halo = spec.halo
        self.halo_reason = halo_reason
        self.name = spec.name
        lib = self._build(
            lambda: emit_conv_chain(spec, header), f"{spec.name}\n{header}", spec.name,
            spec.kernel.cflags,
        )  # fmt: skip
        self._fn = getattr(lib, spec.name)
        self._fn.restype = None
        longs = ctypes.POINTER(ctypes.c_long)
        self._fn.argtypes = (
            [ctypes.c_void_p] * 6
            + [longs]
            + [ctypes.c_void_p] * 4
            + [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_long,
                ctypes.c_int,
            ]
        )
        workspace = getattr(lib, f"{spec.name}_workspace")
        workspace.restype = ctypes.c_long
        workspace.argtypes = [longs, longs]
        self._geometry = (ctypes.c_long * len(GEOMETRY))(*geometry(shape, tiles))
        per = ctypes.c_long(0)
        self._shared = int(workspace(self._geometry, ctypes.byref(per)))
        self._per = int(per.value)
        s = shape
        self._shapes = {
            "x": (s.N, s.C, s.H, s.W),
            "w1": (s.K1, s.C, s.R1, s.S1),
            "w2": (s.K2, s.K1, s.R2, s.S2),
            "out": (s.N, s.K2, s.P2, s.Q2),
            "b1": (s.K1,),
            "b2": (s.K2,),
        }
        self._local = threading.local()

    def __repr__(self) -> str:
        return f"ConvKernel({self.name}, halo={self.halo.value}, {self.tiles}, {self.path})"

    def _workspace(self, threads: int) -> tuple[int, Any]:
        """This thread's (64-byte aligned workspace address, strides array) for `threads`
        threads: kept between calls, so a call allocates nothing."""
        local = self._local
        if getattr(local, "threads", None) != threads:
            local.buf = np.empty(self._shared + threads * self._per + 32, dtype=np.float32)
            address = int(local.buf.ctypes.data)
            local.address = address + 4 * ((-address % 64) // 4)
            local.strides = (ctypes.c_long * 16)()
            local.threads = threads
        return local.address, local.strides

    def __call__(
        self, x: Any, w1: Any, w2: Any, b1: Any = None, b2: Any = None, out: Any = None
    ) -> Any:
        out, pointers, strides, _ = self._bind(x, w1, w2, b1, b2, out)
        self._launch(pointers, strides, get_num_threads())
        return out

    def _bind(
        self, x: Any, w1: Any, w2: Any, b1: Any, b2: Any, out: Any
    ) -> tuple[Any, list[int | None], tuple[int, ...], bool | None]:
        """Check a call's operands and its output (a new one when `out` is None): (out, the
        pointers of x, w1, w2, b1, b2 (None: no bias), out, the strides of x, w1, w2, out,
        whether a new out is channels-last (None: the caller's)). What `_launch` takes; the
        strides depend on the operands' shapes and strides only (`ops` replays them)."""
        shapes = self._shapes
        ax = _dense_strides("x", x, shapes["x"])
        a1 = _dense_strides("w1", w1, shapes["w1"])
        a2 = _dense_strides("w2", w2, shapes["w2"])
        bias1 = None if b1 is None else _dense_strides("b1", b1, shapes["b1"])[0]
        bias2 = None if b2 is None else _dense_strides("b2", b2, shapes["b2"])[0]
        channels_last = None
        if out is None:
            # channels-last: C innermost (with C = 1 both orders are dense; strides decide)
            xs = ax[1]
            channels_last = xs[1] == 1 and _dense_in((0, 2, 3, 1), shapes["x"], xs)
            out = _empty_like_input(x, shapes["out"], channels_last)
        ao = _dense_strides("out", out, shapes["out"], writable=True)
        strides = (*ax[1], *a1[1], *a2[1], *ao[1])
        return out, [ax[0], a1[0], a2[0], bias1, bias2, ao[0]], strides, channels_last

    def _launch(
        self, pointers: Sequence[int | None], strides: tuple[int, ...], threads: int
    ) -> None:
        """Run on checked operands (`_bind`'s pointers and strides)."""
        base, packed = self._workspace(threads)
        packed[:] = strides
        at = ctypes.addressof(packed)
        x, w1, w2, b1, b2, out = pointers
        self._fn(
            x, w1, w2, b1, b2, out, self._geometry, at, at + 32, at + 64, at + 96,
            base, base + 4 * self._shared, self._per, threads,
        )  # fmt: skip


def _empty_like_input(x: Any, shape: tuple[int, ...], channels_last: bool) -> Any:
    """A new result of `x`'s kind in `x`'s memory order (numpy: NCHW or an NHWC-ordered view)."""
    if _is_torch(x):
        import torch

        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(shape, dtype=torch.float32, memory_format=fmt)
    if channels_last:
        N, K, P, Q = shape
        return np.empty((N, P, Q, K), dtype=np.float32).transpose(0, 3, 1, 2)
    return np.empty(shape, dtype=np.float32)


def compile_conv(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    tiles: Mapping[str, int] | None = None,
    halo: Halo | str | None = None,
    after: str | None = None,
) -> ConvKernel:
    """Plan a conv -> [relu] -> conv chain and build its one fused kernel (see `codegen.conv`).

    `tiles` overrides code tiles by loop name: `p2` (output rows per band), `c` and `k1` (the
    channel blocks of the two reductions). `halo` forces "keep" or "recompute" (default: the
    cost comparison of `choose_halo`). `after="relu"` adds a relu after the second convolution.
    """
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    if chain.dtype is not DType.FLOAT32:
        raise TypeError(
            f"{chain.name}: only float32 chains compile for now, got {chain.dtype.value}"
        )
    if after not in (None, "relu"):
        raise ValueError(f"after: expected None or 'relu', got {after!r}")
    hw = resolve(hardware)
    shape = match_conv_chain(chain)
    # pixels run along the micro-kernel's mr rows, output channels along its nr columns; both
    # convolutions run with the kernel, weighed by flops (a conv2 of 16 channels idles 3/4 of a
    # 64-wide block)
    px1, px2 = shape.P1 * shape.Q1, shape.P2 * shape.Q2
    red1, red2 = shape.C * shape.R1 * shape.S1, shape.K1 * shape.R2 * shape.S2
    kernel = select_weighted(
        [
            (Problem(DType.FLOAT32, px1, shape.K1, red1), px1 * shape.K1 * red1),
            (Problem(DType.FLOAT32, px2, shape.K2, red2), px2 * shape.K2 * red2),
        ],
        hw,
    )
    n_first = shape.N > 1
    order = _CONV_ORDER if n_first else (*_CONV_ORDER[1:], "n")
    structure = (order, 3 if n_first else 2)
    try:
        chosen = _remembered_plan(chain, hw, threads, structure, {})
    except PlanningError:
        if len(hw.levels) < 3:
            raise
        # the smallest fused block overflows the innermost cache (a wide window over many
        # channels of the intermediate, e.g. 5x5 x 127): the kernel still runs, its micro-kernel
        # streaming from the next level, so plan the levels from there out
        outer = dataclasses.replace(hw, levels=hw.levels[1:])
        chosen = _remembered_plan(chain, outer, threads, structure, {})
    planned = chosen.tiles_at(code_level(hw)) or {}
    code = code_tiles(shape, planned, hw.levels[0].capacity, kernel.nr)
    picks = {"p2": code.band_rows, "c": code.c_block, "k1": code.k1_block}
    for loop, t in (tiles or {}).items():
        if loop not in picks:
            raise ValueError(f"tiles: unknown conv tile {loop!r}; expected p2, c or k1")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
        picks[loop] = t
    code = ConvTiles(picks["p2"], picks["c"], picks["k1"], code.k_steps)
    decided, reason = choose_halo(shape, code.band_rows, chosen.threads)
    if halo is not None:
        forced = Halo(halo)
        if forced is not decided:
            reason = f"forced {forced.value} (the model chose {decided.value}: {reason})"
        decided = forced
    spec = ConvChainSpec(kernel, shape.relu_mid, after == "relu", decided)
    header = _conv_header(spec, after)
    return ConvKernel(chain, chosen, spec, shape, code, reason, header)


def _conv_header(spec: ConvChainSpec, after: str | None) -> str:
    """The conv kernel's opening comment: structure, schedule and how its tiles are chosen (no
    sizes: they, the tiles included, are arguments, so one object serves every shape)."""
    # the chain with its sizes, strides and paddings as symbols: they are arguments
    ops = [
        "  Y1[n,k1,p1,q1] = sum[c,r1,s1] X[n,c,st1*p1+r1-pad1,st1*q1+s1-pad1] * W1[k1,c,r1,s1]",
        "  Y1 += b1[k1] (if given)",
        *(["  Z = relu(Y1)"] if spec.relu_mid else ["  Z = Y1"]),
        "  Y2[n,k2,p2,q2] = sum[k1,r2,s2] Z[n,k1,st2*p2+r2-pad2,st2*q2+s2-pad2] * W2[k2,k1,r2,s2]",
        "  Y2 += b2[k2] (if given)" + ("; Y2 = relu(Y2)" if after == "relu" else ""),
    ]
    keep = spec.halo is Halo.KEEP
    return (
        f"chainfuse generated kernel {spec.name}\n"
        "chain:\n" + "\n".join(ops) + "\n"
        f"plan structure {' > '.join(_CONV_ORDER)} (n last when N = 1), shared n > p2 > q2: "
        "conv1 runs per block of conv2's output pixels; parallel over n x row bands of conv2\n"
        "code tiles (run-time arguments): T_P2 = whole rows holding the plan's p2 x q2 pixels\n"
        "  at its code level; KC = most k steps a call reads (its weight panel fills half of L1),\n"
        "  T_C / T_K1 = channel blocks of one tap when a row of taps exceeds 2 KC steps\n"
        f"halo: {spec.halo.value} ("
        + (
            "overlapping rows of Z stay in each thread's rolling row buffer"
            if keep
            else "every band recomputes the rows of Z it reads"
        )
        + "), chosen by choose_halo's cost comparison (ConvKernel.halo_reason)\n"
        f"micro-kernel {spec.kernel.name} ({spec.kernel.mr}x{spec.kernel.nr}): pixels x output "
        "channels, input slivers read in place; layouts: any NCHW / channels-last strides "
        "(NCHW input copied channels-last a band of rows at a time)"
    )
