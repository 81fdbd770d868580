"""Compiled kernels: `Kernel` (a GEMM chain) and `ConvKernel` (a conv chain), built and loaded.

    E = kernel(A, B, D)            # numpy in, numpy out; torch CPU tensors in, torch out
    kernel(A, B, D, out=E)         # into a preallocated output

A call is `bind` (check the operands: pointers and strides) then `launch` (run on them); `ops`
keeps what `bind` found and launches a repeat call with new pointers only.
"""

from __future__ import annotations

import ctypes
import math
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from chainfuse.codegen.amx_chain import amx_arithmetic, amx_describe, emit_amx_chain
from chainfuse.codegen.amx_conv import (
    AMX_PACKED,
    AmxConvSpec,
    amx_conv_arithmetic,
    emit_amx_conv_chain,
)
from chainfuse.codegen.conv import (
    GEOMETRY,
    ConvChainShape,
    ConvChainSpec,
    ConvTiles,
    Halo,
    emit_conv_chain,
    geometry,
)
from chainfuse.codegen.gemm_chain import PACKED, emit_gemm_chain
from chainfuse.codegen.gemm_spec import GemmChainShape
from chainfuse.codegen.schedule import CodeSchedule
from chainfuse.ir import Affine, Chain, MaskKind, Softmax
from chainfuse.kernels.amx import FP32_FMA, AmxPath
from chainfuse.operands import (
    Layout,
    apart,
    check,
    dense_in,
    dense_strides,
    empty_like_input,
    is_torch,
    layout_of,
    recheck,
    torch_empty,
)
from chainfuse.planner import Plan
from chainfuse.runtime import build_recipe, get_num_threads, load

__all__ = ["ALONE_S", "AmxConvKernel", "AmxKernel", "ConvKernel", "Kernel", "finite"]

_A, _B, _D, _E = PACKED["A"], PACKED["B"], PACKED["D"], PACKED["E"]
_STRIDES = slice(PACKED["strides"], PACKED["strides"] + 12)
#: below this predicted time a call runs on one thread: waking a passively waiting OpenMP
#: worker and joining it costs more (docs/tuning.md)
ALONE_S = 40e-6
_MASK, _MASK_STRIDES = PACKED["mask"], slice(PACKED["mask_strides"], PACKED["mask_strides"] + 4)
_ROWS_MAX = PACKED["schedule"]  # the row path's reach: the one decision a call may change
_KEYS = PACKED["sizes"] + 5  # L: what a call with another number of keys changes
_EXTRAS = (PACKED["B3"], PACKED["bias1"], PACKED["bias2"])
_PACKED = PACKED["packed"]


class _Built:
    """Build (or find in the cache) and load a generated source; what both kernels record.

    The source is generated (from the spec, `recipe` its name) only when the cache does
    not already hold its object (`build_recipe`), or when `source` is read."""

    compile_seconds: float
    cached: bool
    path: Path
    _source: str | None = None
    _make_source: Callable[[], str]

    def _build(
        self, make_source: Callable[[], str], recipe: str, name: str, cflags: tuple[str, ...]
    ) -> ctypes.CDLL:
        """`recipe` is the spec's name, every field that shapes the code; not the header
        comment, so kernels that differ only there (sizes, scale) share one object."""
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
        schedule: CodeSchedule,
        shape: GemmChainShape,
        header: str,
        arithmetic: str,
    ) -> None:
        self.chain = chain
        self.shape = shape
        self.plan = plan_
        self.schedule = schedule  # what the code runs: tiles and every path choice
        self.spec = spec = schedule.spec
        self.arithmetic = arithmetic  # what it computes in, said plainly
        lib = self._build(
            lambda: emit_gemm_chain(spec, header), spec.name, spec.name,
            spec.kernel.cflags,
        )  # fmt: skip
        # one pointer argument: ctypes converts each argument of a call, at a cost apiece
        self._fn = getattr(lib, f"{spec.name}_packed")
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p]
        self._workspace_fn = getattr(lib, f"{spec.name}_workspace")
        self._workspace_fn.restype = ctypes.c_long
        self._workspace_fn.argtypes = [
            ctypes.c_long,
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        # the plan's tiles: run-time arguments of the object, which every plan shares
        self._tiles = (spec.T_M, spec.T_L, spec.T_K, spec.T_N)
        self._local = threading.local()
        # the row path's reach follows a call's keys and B's and D's batch strides (`launch`)
        self._reach_varies = schedule.reach_varies
        soft = [op for op in chain.ops if isinstance(op, Softmax)]
        self._scale = soft[0].scale if soft else 1.0
        self._dtype = chain.dtype.value  # of every input and the output (masks: see _prepare)
        # work the plan predicts shorter than waking a waiting worker runs on the calling thread
        self._alone = plan_.predicted_time_s < ALONE_S
        self._prepare()

    def __repr__(self) -> str:
        return f"Kernel({self.spec.name}, {self.path})"

    @property
    def positions(self) -> tuple[int, ...]:
        """Where A, B and D (`spec.tensors`) are among the inputs of a call."""
        return self._at

    @property
    def mask_at(self) -> int:
        """Where the mask is among the inputs of a call (-1: the chain has none)."""
        return self._mask_at

    @property
    def extra_positions(self) -> tuple[int, ...]:
        """Where the inputs past A, B, D and the mask are among the inputs of a call: a gated
        MLP's second weight B3, then the biases the kernel adds (bias1, bias2; a softmax's
        bias1 is its mask), those the chain has."""
        return self._extra_at

    @property
    def planned_keys(self) -> int:
        """The chain's extent of l (its keys): what a call with `keys=None` runs."""
        return self._sizes[5]

    def describe(self) -> str:
        """What the compiled code runs, beside the plan: its code schedule (`schedule`), the
        micro-kernel and how the chain's loops lie on its block, the code-level tiles and why
        they differ from the plan's, and which rows take the row path."""
        return self.schedule.describe(get_num_threads())

    def _workspace(self, threads: int) -> Any:
        """This thread's argument array for `threads` threads (`codegen.gemm_chain.PACKED`), its
        workspace (64-byte aligned), sizes and scale filled in: kept between calls, so a call
        allocates nothing and writes only what changed."""
        local = self._local
        if getattr(local, "threads", None) != threads:
            local.threads = threads
            local.buf = np.empty(threads * self._per + 16, dtype=np.float32)
            address = int(local.buf.ctypes.data)
            args = (ctypes.c_long * PACKED["end"])()
            args[PACKED["work"]] = address + 4 * _to_64(address)
            args[PACKED["work_per_thread"]] = self._per
            args[PACKED["nthreads"]] = threads
            args[PACKED["outer_m"]] = self._outer_m
            at = PACKED["schedule"]
            args[at : at + 4] = list(self.schedule.arguments(threads))
            at = PACKED["tiles"]
            args[at : at + 4] = list(self._tiles)
            args[PACKED["scale_bits"]] = int.from_bytes(struct.pack("<f", self._scale), "little")
            at = PACKED["sizes"]
            args[at : at + 6] = list(self._sizes)
            local.args = args
            local.address = ctypes.addressof(args)
            local.strides = None  # what args holds: refilled when a call's strides differ
            local.keys = -1  # the keys the row path's reach in args was decided for
        return local

    def _mask(
        self,
        mask: Any,
        shapes: Mapping[str, tuple[int, ...]],
        replay: bool = False,
    ) -> tuple[int, list[int]]:
        """The mask's pointer and its strides along (batch0, batch1, m, l); 0 where it
        broadcasts; checked by `check`, or by `recheck` on a replay. The kernels read the mask
        element by element along l, by its stride: any stride there (0: expanded) will do."""
        assert self._mask_index is not None
        name, dtype, _ = self._mask_index
        checked = recheck if replay else check
        ptr, strides = checked(name, mask, shapes[name], dtype=dtype, inner_contiguous=False)
        return ptr, [strides[i] if i >= 0 else 0 for i in self._mask_dims]

    def _prepare(self) -> None:
        """What every call needs and no call changes: names, shapes, sizes, workspace size."""
        chain = self.chain
        self._names = [t.name for t in chain.inputs]
        self._shapes = {t.name: t.shape for t in chain.tensors}
        self._at = tuple(self._names.index(n) for n in self.spec.tensors[:3])
        ext = chain.extents
        first, second = chain.contractions[0], chain.contractions[-1]  # (gated MLPs: three)
        m, l_ = first.output.loops[-2:]
        K, N = ext[first.reduction[0]], ext[second.output.loops[-1]]
        self._nb = len(self.spec.batch)
        sizes = [1] * (2 - self._nb) + [ext[n] for n in self.spec.batch]
        self._sizes = (*sizes, ext[m], N, K, ext[l_])
        tiles = (ctypes.c_long * 4)(*self._tiles)
        decided = (ctypes.c_long * 4)(*self.schedule.arguments(1))
        self._per = int(
            self._workspace_fn(K, N, ctypes.addressof(tiles), ctypes.addressof(decided))
        )
        # rows of m per parallel block: the plan's outermost m tile, the blocks its model deals
        # to the cores (a run-time argument, so that one compiled object serves every plan)
        outer = self.plan.tiles_at(self.plan.levels[-1]) or {}
        self._outer_m = outer.get(m, ext[m])
        # per tensor, its dims indexed by l alone: a call with another number of keys
        # (`bind`'s `keys`) expects those dims that long
        self._l_dims = {
            acc.tensor: {d for d, ix in enumerate(acc.index) if ix.terms == ((l_, 1),)}
            for op in chain.ops
            for acc in (*op.reads, op.output)
        }
        self._shapes_at: dict[int, dict[str, tuple[int, ...]]] = {ext[l_]: self._shapes}
        self._mask_loops: list[str | None] = [None] * (2 - self._nb) + [*self.spec.batch, m, l_]
        self._mask_index: tuple[str, str, tuple[Affine, ...]] | None = None
        self._mask_at = -1  # the mask's position among the inputs
        # B3 and the biases: (name, position among the inputs, PACKED slot)
        shape = self.shape
        self._extras = [
            (name, self._names.index(name), slot)
            for name, slot in zip((shape.gate, shape.bias1, shape.bias2), _EXTRAS, strict=True)
            if name is not None
        ]
        self._extra_at = tuple(at for _, at, _ in self._extras)
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
        out, pointers, strides, mask_strides = self.bind(inputs, out)
        self.launch(pointers, strides, mask_strides, get_num_threads())
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

    def bind(
        self, inputs: tuple[Any, ...], out: Any, keys: int | None = None
    ) -> tuple[Any, list[int], tuple[int, ...], list[int] | None]:
        """Check a call's operands (`inputs` in `chain.inputs` order) and its output (a new one
        when `out` is None): (out, the pointers of A, B, D, E [, the mask], their strides along
        the batch dims and rows as the kernel takes them, the mask's along (batch0, batch1, m,
        l) or None). What `launch` takes; the strides depend on the operands' shapes and
        strides only, so `ops` runs a repeat call from them with new pointers. `keys`: the
        call's extent of l when it is not the chain's (sizes and tiles are run-time arguments:
        `ops` runs every key length of a bucket with one kernel, planned for the longest)."""
        if len(inputs) != len(self._names):
            names = ", ".join(self._names)
            raise TypeError(f"{self.chain.name}: expected {len(self._names)} inputs ({names})")
        dt = self._dtype
        shapes = self._shapes if keys is None else self._shapes_for(keys)
        a_name, b_name, d_name, e_name = self.spec.tensors
        a_at, b_at, d_at = self._at
        a_ptr, a_st = check(a_name, inputs[a_at], shapes[a_name], dtype=dt)
        b_ptr, b_st = check(b_name, inputs[b_at], shapes[b_name], dtype=dt)
        d_ptr, d_st = check(d_name, inputs[d_at], shapes[d_name], dtype=dt)
        out_shape = shapes[e_name]
        given = out is not None
        if out is None:
            first = inputs[0]
            out = (
                torch_empty(first, out_shape, dt)
                if is_torch(first)
                else np.empty(out_shape, dtype=first.dtype)
            )
        e_ptr, e_st = check("out", out, out_shape, writable=True, dtype=dt)
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
        for name, at, _ in self._extras:
            ptr, steps = check(name, inputs[at], shapes[name], dtype=dt)
            if name == self.shape.gate and steps != b_st:  # (B3 is read with B's strides)
                raise ValueError(f"{name}: expected the strides of {b_name} {b_st}, got {steps}")
            pointers.append(ptr)
        if given:  # (a new out shares memory with nothing)
            found = self.layouts(inputs, out, keys)
            ins = [p for i, p in enumerate(pointers) if i != 3]  # (A, B, D [, the mask])
            apart(
                (e_ptr, found[-1][1]), [(n, p, at) for (n, at), p in zip(found, ins, strict=False)]
            )
        return out, pointers, strides, mask_strides

    def layouts(
        self, inputs: tuple[Any, ...], out: Any, keys: int | None = None
    ) -> list[tuple[str, Layout]]:
        """The names and `Layout`s of A, B, D [and the mask] among checked `inputs`, then the
        result's (named "out"): what `bind` checks an `out=` against, and `ops` on a replay."""
        shapes = self._shapes if keys is None else self._shapes_for(keys)
        names = [*self.spec.tensors[:3]]
        at = [*self._at]
        if self._mask_index is not None:
            names.append(self._mask_index[0])
            at.append(self._mask_at)
        names += [name for name, _, _ in self._extras]
        at += [*self._extra_at]
        found = [(n, layout_of(inputs[i], shapes[n])) for n, i in zip(names, at, strict=True)]
        found.append(("out", layout_of(out, shapes[self.spec.tensors[3]])))
        return found

    def bind_keys(
        self, strides: tuple[int, ...], inputs: tuple[Any, ...], keys: int | None
    ) -> tuple[list[int], tuple[int, ...], list[int] | None]:
        """`bind` for a call like one bound before (its `strides`) but for B, D and the mask,
        which it checks again against `keys` of l: their pointers, the strides with theirs in
        place, and the mask's. A decoder's k, v and padding mask grow by a key every step (and
        their strides with them when each step's tensors are new): the rest of the call, A's
        strides and the result's, stays as it was."""
        dt = self._dtype
        shapes = self._shapes if keys is None else self._shapes_for(keys)
        _, b_name, d_name, _ = self.spec.tensors
        _, b_at, d_at = self._at
        b_ptr, b_st = recheck(b_name, inputs[b_at], shapes[b_name], dt)
        d_ptr, d_st = recheck(d_name, inputs[d_at], shapes[d_name], dt)
        nb = self._nb
        pad = (0,) * (2 - nb)
        new = (*strides[:3], *pad, *b_st[: nb + 1], *pad, *d_st[: nb + 1], *strides[9:])
        pointers = [b_ptr, d_ptr]
        mask_strides = None
        if self._mask_index is not None:
            mask_ptr, mask_strides = self._mask(inputs[self._mask_at], shapes, replay=True)
            pointers.append(mask_ptr)
        return pointers, new, mask_strides

    def launch(
        self,
        pointers: Sequence[int],
        strides: tuple[int, ...],
        mask_strides: list[int] | None,
        threads: int,
        keys: int | None = None,
        packed_at: int = 0,
    ) -> None:
        """Run on checked operands (`bind`'s pointers, strides and mask strides; `keys` as
        `bind` took it; `packed_at`: the address of the weights packed once, checked by
        `ops.packed.packed_pointer`, or 0; only the AMX kernels read it)."""
        local = self._workspace(1 if self._alone else threads)
        packed = local.args
        keys = self._sizes[5] if keys is None else keys
        packed[_KEYS] = keys
        if strides != local.strides:
            packed[_STRIDES] = strides
            local.strides = strides
            local.keys = -1
        if self._reach_varies and keys != local.keys:
            schedule = self.schedule
            packed[_ROWS_MAX] = schedule.row_path_rows(schedule.bd_bytes(keys, strides))
            local.keys = keys
        packed[_A] = pointers[0]
        packed[_B] = pointers[1]
        packed[_D] = pointers[2]
        packed[_E] = pointers[3]
        packed[_PACKED] = packed_at
        if mask_strides is not None:
            packed[_MASK] = pointers[4]
            packed[_MASK_STRIDES] = mask_strides
        if self._extras:
            first = 4 if mask_strides is None else 5
            for (_, _, slot), ptr in zip(self._extras, pointers[first:], strict=True):
                packed[slot] = ptr
        self._fn(local.address)


class AmxKernel(Kernel):
    """A bf16 GEMM chain on AMX tiles (`codegen.amx_chain`): `Kernel`'s calling convention and
    caches, its own source and build flags (`path`: the tile unit, or its emulation)."""

    def __init__(
        self,
        chain: Chain,
        plan_: Plan,
        schedule: CodeSchedule,
        shape: GemmChainShape,
        header: str,
        path: AmxPath,
    ) -> None:
        self.amx_path = path
        self._amx_header = header
        super().__init__(chain, plan_, schedule, shape, header, amx_arithmetic(path))

    def _build(
        self, make_source: Callable[[], str], recipe: str, name: str, cflags: tuple[str, ...]
    ) -> ctypes.CDLL:
        spec, header, path = self.spec, self._amx_header, self.amx_path
        return super()._build(
            lambda: emit_amx_chain(spec, header, path), f"{path.value}\n{recipe}", name,
            path.cflags,
        )  # fmt: skip

    def describe(self) -> str:
        return amx_describe(self.schedule, self.amx_path)


class ConvKernel(_Built):
    """A compiled conv -> [activation] -> conv chain: `kernel(x, w1, w2, b1=None, b2=None, out=None)`.

    `x` [N, C, H, W], `w1` [K1, C, R1, S1], `w2` [K2, K1, R2, S2] (depthwise: [K1, 1, R2,
    S2]) (PyTorch's layouts), in NCHW
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
        self.arithmetic = f"{FP32_FMA}: fp32 micro-kernel {spec.kernel.name}, fp32 intermediate"
        lib = self._build(
            lambda: emit_conv_chain(spec, header), spec.name, spec.name,
            spec.kernel.cflags,
        )  # fmt: skip
        self._load(lib, shape, geometry(shape, tiles))

    def _load(self, lib: ctypes.CDLL, shape: ConvChainShape, values: tuple[int, ...]) -> None:
        """The entry points of a loaded conv object (`emit_conv_chain`'s signatures, which the
        AMX conv kernel shares), its geometry and workspace sizes, the operands' shapes."""
        name = self.name
        self._fn = getattr(lib, name)
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
                ctypes.c_void_p,
            ]
        )
        self._pack = getattr(lib, f"{name}_pack")
        self._pack.restype = None
        self._pack.argtypes = [ctypes.c_void_p] * 2 + [longs] + [ctypes.c_void_p] * 3 + [
            ctypes.c_int]  # fmt: skip
        workspace = getattr(lib, f"{name}_workspace")
        workspace.restype = ctypes.c_long
        workspace.argtypes = [longs, longs]
        self._geometry = (ctypes.c_long * len(GEOMETRY))(*values)
        per = ctypes.c_long(0)
        self._shared = int(workspace(self._geometry, ctypes.byref(per)))
        self._per = int(per.value)
        s = shape
        self._shapes = {
            "x": (s.N, s.C, s.H, s.W),
            "w1": (s.K1, s.C, s.R1, s.S1),
            "w2": (s.K2, 1 if s.depthwise else s.K1, s.R2, s.S2),
            "out": (s.N, s.K2, s.P2, s.Q2),
            "b1": (s.K1,),
            "b2": (s.K2,),
        }
        self._local = threading.local()

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The result's shape, [N, K2, P2, Q2]."""
        return self._shapes["out"]

    @property
    def dtype(self) -> str:
        """The operands' and the result's dtype: "float32", or "bfloat16" (AMX)."""
        return self._dtype

    #: the dtype of every operand and the result
    _dtype = "float32"

    def __repr__(self) -> str:
        return f"ConvKernel({self.name}, halo={self.halo.value}, {self.tiles}, {self.path})"

    def _workspace(self, threads: int) -> tuple[int, Any]:
        """This thread's (64-byte aligned workspace address, strides array) for `threads`
        threads: kept between calls, so a call allocates nothing."""
        local = self._local
        if getattr(local, "threads", None) != threads:
            local.buf = np.empty(self._shared + threads * self._per + 32, dtype=np.float32)
            address = int(local.buf.ctypes.data)
            local.address = address + 4 * _to_64(address)
            local.strides = (ctypes.c_long * 16)()
            local.threads = threads
        return local.address, local.strides

    def __call__(
        self, x: Any, w1: Any, w2: Any, b1: Any = None, b2: Any = None, out: Any = None
    ) -> Any:
        out, pointers, strides, _ = self.bind(x, w1, w2, b1, b2, out)
        self.launch(pointers, strides, get_num_threads())
        return self.padded_taps(out, w1, w2)

    def padded_taps(self, out: Any, w1: Any, w2: Any, known: bool = False) -> Any:
        """`out` with NaN where the arithmetic puts one and the kernel, skipping padded taps,
        did not: a non-finite weight times a padding zero is NaN (0 * inf, 0 * NaN). Such a
        weight makes its output channel NaN wherever its tap reads the padding, and a NaN in
        the first conv's output reaches every position of the second's that reads it. Weights
        and sizes alone decide where (the same positions in every image); finite weights, or
        no padding, cost one finiteness check (none where `known`: the caller knows them
        finite)."""
        s = self.shape
        bad1 = s.pad1 > 0 and not known and not finite(w1)
        bad2 = s.pad2 > 0 and not known and not finite(w2)
        if not (bad1 or bad2):
            return out
        nan = np.zeros((s.K2, s.P2, s.Q2), dtype=bool)
        if bad1:  # the first conv's NaN positions, then each second-conv position reading one
            # (of any channel; a depthwise second conv reads its own channel alone)
            first = _nan_taps(w1, (s.H, s.W), (s.P1, s.Q1), s.st1, s.pad1)
            if not s.depthwise:
                first = np.asarray(first.any(axis=0, keepdims=True), dtype=bool)
            # rows and columns -1, P1 / Q1: padding, never NaN
            inside = np.pad(first, ((0, 0), (1, 1), (1, 1)))
            r = np.arange(s.P2)[:, None] * s.st2 - s.pad2 + np.arange(s.R2)[None, :]
            c = np.arange(s.Q2)[:, None] * s.st2 - s.pad2 + np.arange(s.S2)[None, :]
            r, c = np.clip(r, -1, s.P1) + 1, np.clip(c, -1, s.Q1) + 1
            reads = np.asarray(inside[:, r[:, None, :, None], c[None, :, None, :]], dtype=bool)
            nan |= reads.any(axis=(3, 4))
        if bad2:
            nan |= _nan_taps(w2, (s.P1, s.Q1), (s.P2, s.Q2), s.st2, s.pad2)
        if not nan.any():
            return out
        if isinstance(out, np.ndarray):
            out[:, nan] = np.nan
        else:
            import torch

            out[:, torch.from_numpy(nan)] = float("nan")
        return out

    def bind(
        self, x: Any, w1: Any, w2: Any, b1: Any, b2: Any, out: Any
    ) -> tuple[Any, list[int | None], tuple[int, ...], bool | None]:
        """Check a call's operands and its output (a new one when `out` is None): (out, the
        pointers of x, w1, w2, b1, b2 (None: no bias), out, the strides of x, w1, w2, out,
        whether a new out is channels-last (None: the caller's)). What `launch` takes; the
        strides depend on the operands' shapes and strides only (`ops` replays them)."""
        shapes, dt = self._shapes, self._dtype
        ax = dense_strides("x", x, shapes["x"], dtype=dt)
        a1 = dense_strides("w1", w1, shapes["w1"], dtype=dt)
        a2 = dense_strides("w2", w2, shapes["w2"], dtype=dt)
        bias1 = None if b1 is None else dense_strides("b1", b1, shapes["b1"], dtype=dt)[0]
        bias2 = None if b2 is None else dense_strides("b2", b2, shapes["b2"], dtype=dt)[0]
        channels_last = None
        given = out is not None
        if out is None:
            # channels-last: C innermost (with C = 1 both orders are dense; strides decide)
            xs = ax[1]
            channels_last = xs[1] == 1 and dense_in((0, 2, 3, 1), shapes["x"], xs)
            out = empty_like_input(x, shapes["out"], channels_last, dt)
        ao = dense_strides("out", out, shapes["out"], writable=True, dtype=dt)
        strides = (*ax[1], *a1[1], *a2[1], *ao[1])
        pointers = [ax[0], a1[0], a2[0], bias1, bias2, ao[0]]
        if given:  # (a new out shares memory with nothing)
            found = self.layouts((x, w1, w2, b1, b2, out))
            apart((ao[0], found[-1][1]),
                  [(n, p, at) for (n, at), p in zip(found[:-1], pointers, strict=False) if p is not None])  # fmt: skip
        return out, pointers, strides, channels_last

    def layouts(self, operands: tuple[Any, ...]) -> list[tuple[str, Layout]]:
        """The names and `Layout`s of checked x, w1, w2, b1, b2 (an absent bias: empty) and
        out: what `bind` checks an `out=` against, and `ops` on a replay."""
        names = ("x", "w1", "w2", "b1", "b2", "out")
        shapes = self._shapes
        return [(n, (0, 0, (), ()) if x is None else layout_of(x, shapes[n]))
                for n, x in zip(names, operands, strict=True)]  # fmt: skip

    def launch(
        self, pointers: Sequence[int | None], strides: tuple[int, ...], threads: int,
        packed: int | None = None,
    ) -> None:  # fmt: skip
        """Run on checked operands (`bind`'s pointers and strides); `packed`: the address of
        the weights as `pack` left them (`check_packed`), else they are packed by this call."""
        base, held = self._workspace(threads)
        held[:] = strides
        at = ctypes.addressof(held)
        x, w1, w2, b1, b2, out = pointers
        self._fn(
            x, w1, w2, b1, b2, out, self._geometry, at, at + 32, at + 64, at + 96,
            base, base + 4 * self._shared, self._per, threads, packed,
        )  # fmt: skip

    @property
    def micro(self) -> str:
        """The micro-kernel's name: weights `pack`ed for one kernel are read by the kernels
        of the same micro-kernel (its register block's width sets the panels)."""
        return self.spec.kernel.name

    def pack(self, w1: Any, w2: Any) -> Any:
        """w1 and w2 packed as this kernel reads them (`nr`-channel panels; the AMX kernel's:
        VNNI tiles, bf16 pairs in each float), once: a float32 tensor (torch weights) or array,
        64-byte aligned, that `launch` reads in place of packing them per call. The panels
        depend on the weights' shapes and the micro-kernel (`micro`), not on the images'
        sizes."""
        shapes, dt = self._shapes, self._dtype
        a1 = dense_strides("w1", w1, shapes["w1"], dtype=dt)
        a2 = dense_strides("w2", w2, shapes["w2"], dtype=dt)
        if is_torch(w1):
            import torch

            out: Any = torch.empty(self._shared + 16, dtype=torch.float32)
            address = int(out.data_ptr())
        else:
            out = np.empty(self._shared + 16, dtype=np.float32)
            address = int(out.ctypes.data)
        skip = _to_64(address)
        out = out[skip : skip + self._shared]
        strides = (ctypes.c_long * 8)(*a1[1], *a2[1])
        at = ctypes.addressof(strides)
        self._pack(a1[0], a2[0], self._geometry, at, at + 32, address + 4 * skip,
                   get_num_threads())  # fmt: skip
        return out

    def check_packed(self, packed: Any) -> int:
        """The address of weights `pack` made for a kernel of this micro-kernel and these
        weight shapes; else ValueError naming `packed`."""
        shape = tuple(getattr(packed, "shape", ()))
        dtype = str(getattr(packed, "dtype", "")).removeprefix("torch.")
        if shape != (self._shared,) or dtype != "float32":
            raise ValueError(
                f"packed: expected {self._shared} float32 values (weights `pack`ed for "
                f"w1 {self._shapes['w1']}, w2 {self._shapes['w2']} by micro-kernel "
                f"{self.micro}), got {getattr(packed, 'dtype', type(packed).__name__)} "
                f"of shape {shape}"
            )
        address = int(packed.data_ptr() if is_torch(packed) else packed.ctypes.data)
        if address % 64:
            raise ValueError("packed: expected 64-byte aligned values (as `pack` returns them)")
        return address


class AmxConvKernel(ConvKernel):
    """A bf16 conv -> [activation] -> conv chain on AMX tiles (`codegen.amx_conv`): `ConvKernel`'s
    calling convention (bf16 operands and result), its own source and build flags (`path`:
    the tile unit, or its emulation). Every band recomputes the rows of Z it reads."""

    _dtype = "bfloat16"

    def __init__(
        self,
        chain: Chain,
        plan_: Plan,
        spec: AmxConvSpec,
        shape: ConvChainShape,
        band_rows: int,
        header: str,
        path: AmxPath,
    ) -> None:
        self.chain = chain
        self.plan = plan_
        self.amx_spec = spec
        self.amx_path = path
        self.shape = shape
        self.tiles = ConvTiles(band_rows, 0, 0, 0)
        self.halo = Halo.RECOMPUTE
        self.halo_reason = "the AMX conv kernel recomputes the rows of Z each band reads"
        self.name = spec.name
        self.arithmetic = amx_conv_arithmetic(path)
        lib = self._build(
            lambda: emit_amx_conv_chain(spec, header, path), f"{path.value}\n{spec.name}",
            spec.name, path.cflags,
        )  # fmt: skip
        values = {**shape.__dict__, "TP2": band_rows, "CB1": 0, "CB2": 0, "KC": 0}
        self._load(lib, shape, tuple(int(values[k]) for k in GEOMETRY))

    def __repr__(self) -> str:
        return f"AmxConvKernel({self.name}, {self.amx_path.value}, T_P2={self.tiles.band_rows})"

    @property
    def micro(self) -> str:
        """ "amx": the VNNI tiles `pack` makes are the same for every AMX path and image size."""
        return AMX_PACKED

    def padded_taps(self, out: Any, w1: Any, w2: Any, known: bool = False) -> Any:
        """`out` as it is: the tiles multiply the padding's zeros too (0 * inf is NaN there)."""
        return out


def _to_64(address: int) -> int:
    """Floats from a float buffer's `address` to the next 64-byte boundary."""
    return (-address % 64) // 4


def finite(w: Any) -> bool:
    """Whether every element of `w` is finite. A tensor's sum first (NaN and inf reach it, in
    one pass without a temporary: `isfinite(w).all()` of a ResNet's 3x3 weights took 6 ms, the
    sum 0.16), the elementwise check only where the sum is not finite (or overflowed)."""
    if isinstance(w, np.ndarray):
        return bool(np.isfinite(w).all())
    import torch

    return math.isfinite(float(w.sum())) or bool(torch.isfinite(w).all())


def _nan_taps(
    w: Any, size: tuple[int, int], out: tuple[int, int], stride: int, pad: int
) -> NDArray[np.bool_]:
    """[K, P, Q]: where output channel k at (p, q) reads the padding through a non-finite
    weight of `w` [K, C, R, S] (input `size`, output `out`)."""
    bad = ~np.isfinite(np.asarray(w.float() if hasattr(w, "float") else w, np.float32))
    taps = bad.any(axis=1).reshape(bad.shape[0], -1).astype(np.float32)  # [K, R*S]

    def outside(n: int, length: int, span: int) -> NDArray[np.bool_]:  # [out, taps]
        at = np.arange(length)[:, None] * stride - pad + np.arange(span)[None, :]
        found: NDArray[np.bool_] = (at < 0) | (at >= n)
        return found

    rows, cols = outside(size[0], out[0], w.shape[2]), outside(size[1], out[1], w.shape[3])
    padded = (rows[:, None, :, None] | cols[None, :, None, :]).reshape(out[0] * out[1], -1)
    found: NDArray[np.bool_] = (taps @ padded.T.astype(np.float32)).reshape(-1, *out) > 0
    return found
