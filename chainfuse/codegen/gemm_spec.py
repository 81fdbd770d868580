"""What a two-GEMM chain's generated code depends on: `GemmChainSpec`, the shape
`match_gemm_chain` recognises, and the choices of op2's path that follow from a spec alone
(into Eᵀ, into E's rows, or a whole value head in registers)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from chainfuse.codegen.common import name_hash
from chainfuse.ir import (
    POINTWISE,
    Activation,
    Chain,
    Contraction,
    DType,
    MaskKind,
    Pointwise,
    Softmax,
)
from chainfuse.kernels import MicroKernel
from chainfuse.kernels.contract import holds_head, named_heads, wide_multiples

__all__ = [
    "ACTIVATIONS",
    "HALF",
    "MAX_BATCH",
    "Epilogue",
    "GemmChainShape",
    "GemmChainSpec",
    "holds_head",
    "match_gemm_chain",
    "named_heads",
    "softmax_writes_e",
    "wide_heads",
    "wide_multiples",
    "wide_test",
    "writes_e",
]


MAX_BATCH = 2  # batch loops the kernel takes (attention: batch and heads)


#: half-precision dtypes and their short names (the C conversions `cf_from_<short>`/`cf_to_<short>`):
#: 16-bit in and out, fp32 arithmetic inside
HALF = {DType.BFLOAT16: "bf16", DType.FLOAT16: "f16"}


class Epilogue(enum.Enum):
    """What happens to the intermediate tile between the two GEMMs."""

    NONE = "none"
    RELU = "relu"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    QUICK_GELU = "quick_gelu"
    SILU = "silu"
    RELU6 = "relu6"
    HARDSWISH = "hardswish"
    MISH = "mish"
    SQUARED_RELU = "squared_relu"
    SOFTMAX = "softmax"


#: the pointwise activations between the GEMMs and the epilogue each one compiles to
ACTIVATIONS = {a: Epilogue(a.value) for a in POINTWISE}


@dataclass(frozen=True)
class GemmChainSpec:
    """What the generated code depends on (and nothing it does not: no sizes). The tiles are
    the plan's, passed at run time: they are not part of `name` or of the source."""

    batch: tuple[str, ...]  # batch loop names, outermost first
    tensors: tuple[str, str, str, str]  # A, B, D, E names in the chain
    b_transposed: bool  # B stored [.., l, k] (Kᵀ of attention) instead of [.., k, l]
    epilogue: Epilogue
    T_M: int
    T_L: int
    T_K: int
    T_N: int
    kernel: MicroKernel
    mask: MaskKind = MaskKind.NONE  # softmax: an additive (float) or boolean (byte) mask input
    causal: bool = False  # softmax: positions with l > m are masked (PyTorch's is_causal)
    safe: bool = True  # softmax: a row with no key gives zeros (SDPA), else NaN (torch.softmax)
    dtype: DType = DType.FLOAT32  # of the inputs and the output (bf16, fp16: fp32 arithmetic)
    d_transposed: bool = False  # D stored [.., n, l] (nn.Linear's weight) instead of [.., l, n]
    bias1: bool = False  # a vector over l added to op1's result before f (softmax: the mask's)
    bias2: bool = False  # a vector over n added to E
    gated: bool = False  # f(A . B) * (A . B3): a gated MLP's second weight of op1 (B3)
    softcap: float | None = None  # softmax: scores soft-capped, cap tanh(s / cap), a constant

    @property
    def name(self) -> str:
        word = "gemm" if self.epilogue is Epilogue.NONE else f"gemm_{self.epilogue.value}"
        word = f"gated_{word}" if self.gated else word
        word += "_causal" if self.causal else ""
        word += "" if self.mask is MaskKind.NONE else f"_{self.mask.value}mask"
        # every field that shapes the code, spelled without sets (their order changes between
        # processes), so the name, the source and the cache key are the same in every process
        key = (
            f"{self.batch}|{self.tensors}|{self.b_transposed}|{self.epilogue.value}|"
            f"{self.kernel.name}|"
            f"{self.mask.value}|{self.causal}|{self.safe}|{self.dtype.value}"
        )
        # (only where set: the kernels without them keep their names and cache keys)
        key += "|dt" if self.d_transposed else ""
        key += "|b1" if self.bias1 else ""
        key += "|b2" if self.bias2 else ""
        key += "|gated" if self.gated else ""
        key += "" if self.softcap is None else f"|cap{self.softcap!r}"
        short = {DType.FLOAT32: "f32", **HALF}[self.dtype]
        return f"{word}_gemm_{short}_{name_hash(key)}"


@dataclass(frozen=True)
class GemmChainShape:
    """What `match_gemm_chain` recognised in a chain."""

    batch: tuple[str, ...]
    tensors: tuple[str, str, str, str]  # A, B, D, E
    b_transposed: bool
    epilogue: Epilogue
    mask: MaskKind = MaskKind.NONE
    mask_tensor: str | None = None
    causal: bool = False
    safe: bool = True
    d_transposed: bool = False
    bias1: str | None = None  # the bias tensors' names (a softmax's bias1 is its mask)
    bias2: str | None = None
    gate: str | None = None  # a gated MLP's second weight of op1 (B3), read as B is
    softcap: float | None = None


def match_gemm_chain(chain: Chain) -> GemmChainShape:
    """Recognise `E = f(A . B) . D` (biases around it allowed) or a gated MLP's
    `E = (f(A . B) * (A . B3)) . D`; raise ValueError saying what does not fit."""
    gated = _match_gated(chain)
    if gated is not None:
        return gated
    ops = chain.ops
    contractions = [op for op in ops if isinstance(op, Contraction)]
    if len(contractions) != 2 or not isinstance(ops[0], Contraction):
        raise ValueError(f"{chain.name}: the C backend takes two GEMMs with one op between")
    first, second = contractions
    at2 = ops.index(second)
    middle = list(ops[1:at2])
    after = ops[at2 + 1 :]
    bias1 = _as_bias(middle[0]) if middle else None
    if bias1 is not None:  # (a bias over l, then f)
        middle.pop(0)
    epilogue = Epilogue.NONE
    if len(middle) > 1:
        raise ValueError(f"{chain.name}: at most one memory-intensive op between the GEMMs")
    if middle:
        op = middle[0]
        if isinstance(op, Softmax):
            epilogue = Epilogue.SOFTMAX
        elif isinstance(op, Pointwise) and op.fn in ACTIVATIONS:
            epilogue = ACTIVATIONS[op.fn]
        else:
            raise ValueError(f"{chain.name}: op '{op}' between the GEMMs is not supported yet")
    bias2 = _as_bias(after[0]) if after else None
    if len(after) > 1 or (after and bias2 is None):
        raise ValueError(f"{chain.name}: after the second GEMM only a bias is supported")
    a, b = first.inputs
    c = first.output
    p, d = second.inputs
    e = second.output if bias2 is None else bias2.output
    steps = [op for op in (bias1, *middle) if isinstance(op, Pointwise | Softmax)]
    for op in steps:
        if op.input.tensor != c.tensor:
            raise ValueError(f"{chain.name}: '{op}' must read the first GEMM's result")
        c = op.output
    if p.tensor != c.tensor:
        raise ValueError(f"{chain.name}: the second GEMM must read the first one's result first")
    if bias2 is not None and bias2.input.tensor != second.output.tensor:
        raise ValueError(f"{chain.name}: '{bias2}' must read the second GEMM's result")
    c = first.output
    for acc in (a, b, c, p, d, e):
        if any(len(ix.terms) != 1 or ix.terms[0][1] != 1 or ix.offset for ix in acc.index):
            raise ValueError(f"{chain.name}: {acc} is not a plain GEMM index (convolution?)")
    cl = c.loops
    if len(cl) < 2 or len(cl) - 2 > MAX_BATCH:
        raise ValueError(f"{chain.name}: expected [batch..., m, l] for {c.tensor}")
    batch, (m, l) = cl[:-2], cl[-2:]
    (k,) = first.reduction
    n = e.loops[-1]
    want = {a.tensor: (*batch, m, k), e.tensor: (*batch, m, n)}
    for acc in (a, e):
        if acc.loops != want[acc.tensor]:
            raise ValueError(f"{chain.name}: {acc} should be indexed {want[acc.tensor]}")
    if b.loops == (*batch, k, l):
        transposed = False
    elif b.loops == (*batch, l, k):
        transposed = True
    else:
        raise ValueError(f"{chain.name}: {b} should be indexed [{batch}, k, l] or [{batch}, l, k]")
    if d.loops not in ((*batch, l, n), (*batch, n, l)):
        raise ValueError(f"{chain.name}: {d} should be indexed [{batch}, l, n] or [{batch}, n, l]")
    for bias, loop in ((bias1, l), (bias2, n)):
        if bias is not None and bias.operand is not None and bias.operand.loops != (loop,):
            raise ValueError(f"{chain.name}: the bias of '{bias}' must be a vector over {loop!r}")
    shape = GemmChainShape(tuple(batch), (a.tensor, b.tensor, d.tensor, e.tensor), transposed,
                           epilogue, d_transposed=d.loops == (*batch, n, l),
                           bias1=None if bias1 is None or bias1.operand is None
                           else bias1.operand.tensor,
                           bias2=None if bias2 is None or bias2.operand is None
                           else bias2.operand.tensor)  # fmt: skip
    soft = middle[0] if middle and isinstance(middle[0], Softmax) else None
    if soft is None:
        return shape
    if soft.axis != l:
        raise ValueError(f"{chain.name}: the softmax must run over {l!r}, the second GEMM's sum")
    if soft.causal and soft.row != m:
        raise ValueError(f"{chain.name}: causal masking must compare {l!r} with {m!r}")
    if soft.mask is not None:
        allowed = (*batch, m, l)
        if any(ix.loops and ix.loops[0] not in allowed for ix in soft.mask.index):
            raise ValueError(f"{chain.name}: mask {soft.mask} uses loops outside {allowed}")
    return replace(
        shape,
        mask=soft.mask_kind,
        mask_tensor=None if soft.mask is None else soft.mask.tensor,
        causal=soft.causal,
        safe=soft.safe,
        softcap=soft.cap,
    )


def _match_gated(chain: Chain) -> GemmChainShape | None:
    """The shape of a gated MLP's chain (`builders.gated_mlp_chain`'s form), else None."""
    ops = chain.ops
    if len(ops) != 5 or [type(op) for op in ops] != [Contraction, Contraction, Pointwise,
                                                     Pointwise, Contraction]:  # fmt: skip
        return None
    gate_op, up, act, mul, last = ops
    assert isinstance(gate_op, Contraction) and isinstance(up, Contraction)
    assert isinstance(act, Pointwise) and isinstance(mul, Pointwise)
    assert isinstance(last, Contraction)
    if mul.fn is not Activation.MUL or act.fn not in ACTIVATIONS or mul.operand is None:
        return None
    pair = (act.input.tensor, mul.operand.tensor)
    if pair != (gate_op.output.tensor, up.output.tensor) or mul.input.tensor != act.output.tensor:
        return None
    if up.inputs[0] != gate_op.inputs[0] or up.inputs[1].index != gate_op.inputs[1].index:
        raise ValueError(f"{chain.name}: the gate's and the up projection's GEMMs must read A"
                         " and their weights alike")  # fmt: skip
    plain = Chain(chain.name, chain.loops,
                  tuple(t for t in chain.tensors if t.name not in (up.inputs[1].tensor,
                        up.output.tensor, act.output.tensor)),
                  (gate_op, Pointwise(act.fn, act.input, mul.output), last))  # fmt: skip
    shape = match_gemm_chain(plain)
    return replace(shape, gate=up.inputs[1].tensor)


def _as_bias(op: object) -> Pointwise | None:
    """`op` if it adds a bias, else None."""
    return op if isinstance(op, Pointwise) and op.fn is Activation.BIAS else None


def writes_e(spec: GemmChainSpec) -> bool:
    """Whether op2 may write E directly (`pack_strips.c`): float32 E (accumulated in place) and no
    softmax (which packs nothing for it: `softmax_writes_e`); the code also asks, at run time,
    for n blocks of whole nr-column strips."""
    return spec.dtype is DType.FLOAT32 and spec.epilogue is not Epilogue.SOFTMAX


def softmax_writes_e(spec: GemmChainSpec) -> bool:
    """Whether a softmax chain's op2 may write E directly, decided at run time (`to_e`): float32
    E and D's rows already the micro-kernel's packed B layout (one dense strip of N = NR
    columns, rows NR apart), read in place. No Eᵀ accumulator and no transposing store: the
    rescales and the division by the sum act on E's rows. (Its tail strip of queries then runs
    whole mr-row blocks in op2, not a narrow block.) Each output element sums over l in the
    same order either way: bit-identical."""
    return (
        spec.dtype is DType.FLOAT32
        and spec.epilogue is Epilogue.SOFTMAX
        and not spec.d_transposed  # (D's rows are then n's: never the packed layout)
    )


def wide_heads(spec: GemmChainSpec) -> tuple[int, ...]:
    """The value-head widths whose op2 writes E's rows with the whole head in registers
    (`MicroKernel.wide`, decided at run time with `to_e`): a softmax chain's, where E's rows
    can take it (`softmax_writes_e`) and the micro-kernel has wide blocks; () otherwise. Like a
    head of `nr` dense columns (the strided block's, read as its packed layout), these skip
    the Eᵀ accumulator and its transposing store, and V's rows are read in place at any
    stride (a head of `nr` too, when its rows are not dense: V a view of a fused QKV array)."""
    kernel = spec.kernel
    if not softmax_writes_e(spec) or kernel.wide is None:
        return ()
    return kernel.wide_cols


def wide_test(spec: GemmChainSpec) -> str:
    """The C that `to_e` adds for the heads a wide block holds (`holds_head`), or ""."""
    if not wide_heads(spec):
        return ""
    tests = "".join(f" || N == {c}" for c in named_heads(spec.kernel))
    return tests + (" || N % NR == 0" if wide_multiples(spec.kernel) else "")
