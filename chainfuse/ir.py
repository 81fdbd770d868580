"""The chain IR: loops, tensors indexed by affine expressions of loops, and ops.

A `Chain` is everything the planner and the code generators know about a computation. It is a
frozen, hashable value that round-trips through JSON. `chainfuse.builders` makes the paper's
chains from sizes; each runs `verify()`.

The batched GEMM chain in this IR (the paper's convention)::

    loops   b:8 m:512 n:64 k:64 l:512
    C[b,m,l]  = sum_k A[b,m,k] * B[b,k,l]        Contraction
    P[b,m,l]  = relu(C[b,m,l])                   Pointwise
    E[b,m,n]  = sum_l P[b,m,l] * D[b,l,n]        Contraction

A convolution reads its input through affine indices (`h = 2*p + r - 1`); reads outside the tensor
are zeros (padding), which `Access.zero_pad` allows explicitly.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = [
    "ACTIVATION_NAMES",
    "POINTWISE",
    "Access",
    "Activation",
    "Affine",
    "Chain",
    "Contraction",
    "DType",
    "Loop",
    "MaskKind",
    "Op",
    "Pointwise",
    "Role",
    "Softmax",
    "Tensor",
    "check_size",
]


class DType(enum.Enum):
    """Element types a chain can hold."""

    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    BOOL = "bool"  # a boolean mask's elements only (one byte each, as the kernels read them)

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "bool": 1}[self.value]

    @classmethod
    def parse(cls, value: DType | str, what: str = "dtype") -> DType:
        """A chain's element type by name (or alias); `BOOL` is a mask's, never a chain's."""
        aliases = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16"}
        text = aliases.get(str(value), str(value))
        found = (
            value if isinstance(value, DType) else next((d for d in cls if d.value == text), None)
        )
        if found is None or found is cls.BOOL:
            known = ", ".join(d.value for d in cls if d is not cls.BOOL)
            raise ValueError(f"{what}: unknown dtype {value!r}; expected one of {known}")
        return found


class Role(enum.Enum):
    """How a tensor takes part in a chain."""

    INPUT = "input"
    OUTPUT = "output"
    INTERMEDIATE = "intermediate"


class Activation(enum.Enum):
    """Memory-intensive pointwise functions that may sit between two compute ops."""

    IDENTITY = "identity"
    RELU = "relu"
    GELU = "gelu"  # exact, with erf (PyTorch's default)
    GELU_TANH = "gelu_tanh"  # PyTorch's approximate="tanh" (GPT-2)
    QUICK_GELU = "quick_gelu"  # x * sigmoid(1.702 x) (CLIP)
    SILU = "silu"  # x * sigmoid(x)
    RELU6 = "relu6"  # min(max(x, 0), 6) (MobileNet)
    HARDSWISH = "hardswish"  # x * relu6(x + 3) / 6 (MobileNet-V3, LeViT)
    MISH = "mish"  # x * tanh(softplus(x)) (YOLOv4)
    SQUARED_RELU = "squared_relu"  # relu(x)^2 (Primer, Nemotron)
    SCALE = "scale"
    BIAS = "bias"
    MUL = "mul"  # x * operand: a gated MLP's gate times its up projection


#: the activations of x alone that a chain may apply between its ops or after them: the one
#: list every layer (kernels, reference, torch finder, fuzzers, CLI) reads its choices from
POINTWISE = (Activation.RELU, Activation.GELU, Activation.GELU_TANH, Activation.QUICK_GELU,
             Activation.SILU, Activation.RELU6, Activation.HARDSWISH, Activation.MISH,
             Activation.SQUARED_RELU)  # fmt: skip
ACTIVATION_NAMES = tuple(a.value for a in POINTWISE)


class MaskKind(enum.Enum):
    """The kind of mask tensor a softmax adds to its scores."""

    NONE = "none"
    BOOL = "bool"
    ADDITIVE = "additive"


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{what} name {name!r} must be an identifier")


def check_size(value: object, what: str) -> int:
    """`value` if it is a positive int (not a bool), else a ValueError naming `what`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be a positive integer, got {value}")
    return value


@dataclass(frozen=True)
class Loop:
    """A loop of the iteration space with its extent (trip count)."""

    name: str
    extent: int

    def __post_init__(self) -> None:
        _check_name(self.name, "loop")
        check_size(self.extent, f"loop {self.name!r} extent")


@dataclass(frozen=True)
class Affine:
    """`sum(coeff * loop) + offset`: one tensor dimension's index. No terms = a constant."""

    terms: tuple[tuple[str, int], ...] = ()
    offset: int = 0

    @classmethod
    def of(cls, loop: str) -> Affine:
        return cls(((loop, 1),))

    @cached_property
    def loops(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.terms)

    def coeff(self, loop: str) -> int:
        return sum(c for name, c in self.terms if name == loop)

    def span(self, ranges: dict[str, int]) -> int:
        """Number of index values touched when each loop runs over `ranges[loop]` values."""
        return sum(abs(c) * (ranges[name] - 1) for name, c in self.terms) + 1

    def bounds(self, lo: dict[str, int], hi: dict[str, int]) -> tuple[int, int]:
        """Inclusive [min, max] of the index when each loop runs over [lo, hi] (inclusive)."""
        low = high = self.offset
        for name, c in self.terms:
            a, b = c * lo[name], c * hi[name]
            low += min(a, b)
            high += max(a, b)
        return low, high

    def __str__(self) -> str:
        parts = [name if c == 1 else f"{c}*{name}" for name, c in self.terms]
        if self.offset or not parts:
            parts.append(str(self.offset))
        return "+".join(parts).replace("+-", "-")


@dataclass(frozen=True)
class Tensor:
    """A named, typed, dense tensor. Layout is row-major over `shape` unless a backend says so."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    role: Role

    def __post_init__(self) -> None:
        _check_name(self.name, "tensor")
        for i, size in enumerate(self.shape):
            check_size(size, f"tensor {self.name!r} dim {i}")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


@dataclass(frozen=True)
class Access:
    """A tensor read or written at affine indices, one per dimension."""

    tensor: str
    index: tuple[Affine, ...]
    zero_pad: bool = False

    @cached_property
    def loops(self) -> tuple[str, ...]:
        seen: dict[str, None] = {}
        for ix in self.index:
            for name in ix.loops:
                seen[name] = None
        return tuple(seen)

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(str(i) for i in self.index)}]"


@dataclass(frozen=True)
class Contraction:
    """`output[...] = sum over loops not in output of inputs[0][...] * inputs[1][...]`."""

    output: Access
    inputs: tuple[Access, Access]

    @property
    def reads(self) -> tuple[Access, ...]:
        return self.inputs

    @cached_property
    def loops(self) -> tuple[str, ...]:
        seen: dict[str, None] = dict.fromkeys(self.output.loops)
        for acc in self.inputs:
            seen.update(dict.fromkeys(acc.loops))
        return tuple(seen)

    @cached_property
    def reduction(self) -> tuple[str, ...]:
        out = set(self.output.loops)
        return tuple(name for name in self.loops if name not in out)

    def __str__(self) -> str:
        red = ",".join(self.reduction)
        return f"{self.output} = sum[{red}] {self.inputs[0]} * {self.inputs[1]}"


@dataclass(frozen=True)
class Pointwise:
    """`output = fn(input)`; BIAS adds `operand` (broadcast), MUL multiplies by it, SCALE
    multiplies by `alpha`."""

    fn: Activation
    input: Access
    output: Access
    operand: Access | None = None
    alpha: float = 1.0

    @property
    def reads(self) -> tuple[Access, ...]:
        return (self.input,) if self.operand is None else (self.input, self.operand)

    @property
    def loops(self) -> tuple[str, ...]:
        return self.output.loops

    @property
    def reduction(self) -> tuple[str, ...]:
        return ()

    def __str__(self) -> str:
        extra = f", {self.operand}" if self.operand is not None else ""
        extra += f", alpha={self.alpha}" if self.fn is Activation.SCALE else ""
        return f"{self.output} = {self.fn.value}({self.input}{extra})"


@dataclass(frozen=True)
class Softmax:
    """Row softmax over loop `axis` of `scale * input (+ additive mask | masked where False)`.

    `causal` masks positions whose `axis` index exceeds the `row` index (PyTorch's `is_causal`,
    top-left aligned). A bool mask is added as 0 / -inf (as SDPA converts it: a NaN or +inf score
    stays NaN where masked). `safe`: a row with no position above -inf gives zeros (PyTorch's
    CPU SDPA); unsafe, NaN (`torch.softmax`, the unfused chain). `cap` (soft-capping, as
    Gemma 2's attention and FlashAttention's `softcap`): the scaled input becomes
    `cap * tanh(x / cap)` before the mask is added.
    """

    input: Access
    output: Access
    axis: str
    scale: float = 1.0
    mask: Access | None = None
    mask_kind: MaskKind = MaskKind.NONE
    causal: bool = False
    row: str | None = None
    safe: bool = True
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.cap is not None and not (math.isfinite(self.cap) and self.cap > 0.0):
            raise ValueError(f"softmax: cap must be a finite number > 0 or None, got {self.cap!r}")

    @property
    def reads(self) -> tuple[Access, ...]:
        return (self.input,) if self.mask is None else (self.input, self.mask)

    @property
    def loops(self) -> tuple[str, ...]:
        return self.output.loops

    @property
    def reduction(self) -> tuple[str, ...]:
        return ()

    def __str__(self) -> str:
        extra = f", scale={self.scale:g}" if self.scale != 1.0 else ""
        if self.cap is not None:
            extra += f", cap={self.cap:g}"
        if self.mask is not None:
            extra += f", {self.mask_kind.value} mask {self.mask}"
        if self.causal:
            extra += ", causal"
        if not self.safe:
            extra += ", unsafe"
        return f"{self.output} = softmax[{self.axis}]({self.input}{extra})"


Op = Contraction | Pointwise | Softmax


@dataclass(frozen=True)
class Chain:
    """A verified chain of ops over named loops and tensors. Hashable; JSON round-trips."""

    name: str
    loops: tuple[Loop, ...]
    tensors: tuple[Tensor, ...]
    ops: tuple[Op, ...]
    _by_name: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_name.update({lp.name: lp for lp in self.loops})
        self._by_name.update({"$" + t.name: t for t in self.tensors})

    def __hash__(self) -> int:
        return hash((self.name, self.loops, self.tensors, self.ops))

    # -- lookup ---------------------------------------------------------------------------------
    def loop(self, name: str) -> Loop:
        found = self._by_name.get(name)
        if not isinstance(found, Loop):
            raise KeyError(f"chain {self.name!r} has no loop {name!r}")
        return found

    def tensor(self, name: str) -> Tensor:
        found = self._by_name.get("$" + name)
        if found is None:
            raise KeyError(f"chain {self.name!r} has no tensor {name!r}")
        assert isinstance(found, Tensor)
        return found

    @property
    def extents(self) -> dict[str, int]:
        return {lp.name: lp.extent for lp in self.loops}

    @property
    def inputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role is Role.INPUT)

    @property
    def outputs(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role is Role.OUTPUT)

    @property
    def intermediates(self) -> tuple[Tensor, ...]:
        return tuple(t for t in self.tensors if t.role is Role.INTERMEDIATE)

    @property
    def contractions(self) -> tuple[Contraction, ...]:
        return tuple(op for op in self.ops if isinstance(op, Contraction))

    @property
    def dtype(self) -> DType:
        return self.tensors[0].dtype

    def producer(self, tensor: str) -> Op | None:
        for op in self.ops:
            if op.output.tensor == tensor:
                return op
        return None

    def consumers(self, tensor: str) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if any(a.tensor == tensor for a in op.reads))

    def flops(self) -> int:
        """Multiply-adds count 2; memory-intensive ops count one flop per output element."""
        ext = self.extents
        total = 0
        for op in self.ops:
            n = math.prod(ext[name] for name in op.loops)
            total += 2 * n if isinstance(op, Contraction) else n
        return total

    # -- checks ---------------------------------------------------------------------------------
    def verify(self) -> Chain:
        """Raise ValueError naming the tensor, loop or op that is inconsistent; return self."""
        names = [lp.name for lp in self.loops]
        if len(set(names)) != len(names):
            raise ValueError(f"chain {self.name!r}: duplicate loop names in {names}")
        tnames = [t.name for t in self.tensors]
        if len(set(tnames)) != len(tnames):
            raise ValueError(f"chain {self.name!r}: duplicate tensor names in {tnames}")
        if not self.ops:
            raise ValueError(f"chain {self.name!r} has no ops")
        ext = self.extents
        written: set[str] = set()
        for op in self.ops:
            for acc in (*op.reads, op.output):
                self._verify_access(acc, ext, is_output=acc is op.output)
            for acc in op.reads:
                t = self.tensor(acc.tensor)
                if t.role is not Role.INPUT and acc.tensor not in written:
                    raise ValueError(f"op '{op}' reads {acc.tensor!r} before any op writes it")
            out = self.tensor(op.output.tensor)
            if out.role is Role.INPUT:
                raise ValueError(f"op '{op}' writes {out.name!r}, which is a chain input")
            if out.name in written:
                raise ValueError(f"tensor {out.name!r} is written by more than one op")
            written.add(out.name)
            self._verify_op(op)
        for t in self.tensors:
            if t.role is Role.INPUT and not self.consumers(t.name):
                raise ValueError(f"input tensor {t.name!r} is never read")
            if t.role is Role.INTERMEDIATE and not self.consumers(t.name):
                raise ValueError(f"intermediate tensor {t.name!r} is never read; make it an output")
            if t.role is not Role.INPUT and t.name not in written:
                raise ValueError(f"tensor {t.name!r} ({t.role.value}) is never written")
        used = {name for op in self.ops for name in op.loops}
        for name in names:
            if name not in used:
                raise ValueError(f"loop {name!r} is not used by any op")
        return self

    def _verify_access(self, acc: Access, ext: dict[str, int], is_output: bool) -> None:
        try:
            t = self.tensor(acc.tensor)
        except KeyError:
            raise ValueError(
                f"chain {self.name!r}: access to unknown tensor {acc.tensor!r}"
            ) from None
        if len(acc.index) != len(t.shape):
            raise ValueError(
                f"tensor {t.name!r} has {len(t.shape)} dims {t.shape} but is indexed with "
                f"{len(acc.index)}: {acc}"
            )
        for d, (ix, size) in enumerate(zip(acc.index, t.shape, strict=True)):
            for name in ix.loops:
                if name not in ext:
                    raise ValueError(f"tensor {t.name!r} dim {d} uses unknown loop {name!r}")
            if is_output:
                if len(ix.terms) != 1 or ix.terms[0][1] != 1 or ix.offset != 0:
                    raise ValueError(f"output {t.name!r} dim {d} must be indexed by one loop: {ix}")
                loop = ix.terms[0][0]
                if ext[loop] != size:
                    raise ValueError(
                        f"tensor {t.name!r} dim {d} has size {size} but loop {loop!r} has "
                        f"extent {ext[loop]}"
                    )
                continue
            low, high = ix.bounds(dict.fromkeys(ix.loops, 0), {n: ext[n] - 1 for n in ix.loops})
            if not ix.terms and size != 1 and ix.offset == 0:
                continue  # a constant index into a larger dim reads element 0: allowed
            if len(ix.terms) == 1 and ix.terms[0][1] == 1 and ix.offset == 0:
                loop = ix.terms[0][0]
                if ext[loop] != size:
                    raise ValueError(
                        f"tensor {t.name!r} dim {d} has size {size} but loop {loop!r} has "
                        f"extent {ext[loop]}"
                    )
            elif acc.zero_pad:
                if high < 0 or low > size - 1:
                    raise ValueError(
                        f"tensor {t.name!r} dim {d}: index {ix} never hits [0, {size})"
                    )
            elif low < 0 or high > size - 1:
                raise ValueError(
                    f"tensor {t.name!r} dim {d}: index {ix} ranges over [{low}, {high}], "
                    f"outside [0, {size - 1}]"
                )

    def _verify_op(self, op: Op) -> None:
        if isinstance(op, Contraction):
            for name in op.output.loops:
                if not any(name in acc.loops for acc in op.inputs):
                    raise ValueError(f"op '{op}': output loop {name!r} is read by no input")
            return
        if set(op.input.loops) != set(op.output.loops):
            raise ValueError(f"op '{op}': input and output must be indexed by the same loops")
        if isinstance(op, Softmax):
            if op.axis not in op.output.loops:
                raise ValueError(f"softmax '{op}': axis loop {op.axis!r} does not index its output")
            if (op.mask is None) != (op.mask_kind is MaskKind.NONE):
                raise ValueError(f"softmax '{op}': mask tensor and mask_kind must come together")
            if op.causal and (op.row is None or op.row not in op.output.loops):
                raise ValueError(f"softmax '{op}': causal needs a row loop that indexes the output")
            for extra in (op.mask,) if op.mask is not None else ():
                if not set(extra.loops).issubset(set(op.loops)):
                    raise ValueError(f"softmax '{op}': mask uses loops the scores do not have")
        elif op.fn in (Activation.BIAS, Activation.MUL):
            if op.operand is None:
                raise ValueError(f"op '{op}': {op.fn.value} needs an operand tensor")
            if not set(op.operand.loops).issubset(set(op.loops)):
                raise ValueError(f"op '{op}': {op.fn.value} uses loops the input does not have")
        elif op.operand is not None:
            raise ValueError(f"op '{op}': {op.fn.value} takes no operand")

    # -- text -----------------------------------------------------------------------------------
    def __str__(self) -> str:
        loops = " ".join(f"{lp.name}:{lp.extent}" for lp in self.loops)
        lines = [f"chain {self.name}  loops {loops}  dtype {self.dtype.value}"]
        lines += [f"  {op}" for op in self.ops]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(_to_data(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Chain:
        data = json.loads(text)
        return _chain_from_data(data).verify()


# -- JSON ---------------------------------------------------------------------------------------


def _access_data(acc: Access | None) -> Any:
    if acc is None:
        return None
    return {
        "tensor": acc.tensor,
        "index": [[list(map(list, ix.terms)), ix.offset] for ix in acc.index],
        "zero_pad": acc.zero_pad,
    }


def _access_from(data: Any) -> Access | None:
    if data is None:
        return None
    index = tuple(
        Affine(tuple((str(n), int(c)) for n, c in terms), int(off)) for terms, off in data["index"]
    )
    return Access(data["tensor"], index, bool(data["zero_pad"]))


def _op_data(op: Op) -> dict[str, Any]:
    if isinstance(op, Contraction):
        return {"op": "contraction", "output": _access_data(op.output),
                "inputs": [_access_data(a) for a in op.inputs]}  # fmt: skip
    if isinstance(op, Pointwise):
        return {"op": "pointwise", "fn": op.fn.value, "input": _access_data(op.input),
                "output": _access_data(op.output), "operand": _access_data(op.operand),
                "alpha": op.alpha}  # fmt: skip
    return {"op": "softmax", "input": _access_data(op.input), "output": _access_data(op.output),
            "axis": op.axis, "scale": op.scale, "mask": _access_data(op.mask),
            "mask_kind": op.mask_kind.value, "causal": op.causal, "row": op.row,
            "safe": op.safe, **({} if op.cap is None else {"cap": op.cap})}  # fmt: skip


def _need(acc: Access | None) -> Access:
    assert acc is not None
    return acc


def _op_from(data: dict[str, Any]) -> Op:
    if data["op"] == "contraction":
        a, b = (_need(_access_from(x)) for x in data["inputs"])
        return Contraction(_need(_access_from(data["output"])), (a, b))
    if data["op"] == "pointwise":
        return Pointwise(Activation(data["fn"]), _need(_access_from(data["input"])),
                         _need(_access_from(data["output"])), _access_from(data["operand"]),
                         float(data["alpha"]))  # fmt: skip
    return Softmax(_need(_access_from(data["input"])), _need(_access_from(data["output"])),
                   data["axis"], float(data["scale"]), _access_from(data["mask"]),
                   MaskKind(data["mask_kind"]), bool(data["causal"]), data["row"],
                   bool(data.get("safe", True)),
                   None if data.get("cap") is None else float(data["cap"]))  # fmt: skip


def _to_data(chain: Chain) -> dict[str, Any]:
    return {
        "name": chain.name,
        "loops": [[lp.name, lp.extent] for lp in chain.loops],
        "tensors": [[t.name, list(t.shape), t.dtype.value, t.role.value] for t in chain.tensors],
        "ops": [_op_data(op) for op in chain.ops],
    }


def _chain_from_data(data: dict[str, Any]) -> Chain:
    return Chain(
        name=data["name"],
        loops=tuple(Loop(n, int(e)) for n, e in data["loops"]),
        tensors=tuple(
            Tensor(n, tuple(int(s) for s in shape), DType(dt), Role(role))
            for n, shape, dt, role in data["tensors"]
        ),
        ops=tuple(_op_from(op) for op in data["ops"]),
    )
