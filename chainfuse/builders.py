"""Builders of the paper's chains from sizes: GEMM chains, attention, MLPs, conv chains, einsum.

Each returns a verified `Chain`; the names encode what the chain computes and its sizes.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

from chainfuse.ir import (
    ACTIVATION_NAMES,
    POINTWISE,
    Access,
    Activation,
    Affine,
    Chain,
    Contraction,
    DType,
    Loop,
    MaskKind,
    Op,
    Pointwise,
    Role,
    Softmax,
    Tensor,
    check_size,
)

__all__ = [
    "attention_chain",
    "broadcasts",
    "check_softcap",
    "conv_chain_spec",
    "conv_out_size",
    "from_einsum",
    "gated_mlp_chain",
    "gemm_chain",
    "mlp_chain",
    "planned_part",
]


def _plain(tensor: str, *loops: str) -> Access:
    return Access(tensor, tuple(Affine.of(name) for name in loops))


def _between_op(
    between: Activation | str | None, src: str, dst: str, loops: tuple[str, ...], axis: str
) -> Op | None:
    if between is None:
        return None
    if between == "softmax":
        # unsafe: a row of all -inf scores is NaN, as the unfused torch.softmax gives
        return Softmax(_plain(src, *loops), _plain(dst, *loops), axis=axis, safe=False)
    try:
        fn = Activation(between)
    except ValueError:
        names = ", ".join(repr(n) for n in ACTIVATION_NAMES)
        raise ValueError(f"between: expected None, {names} or 'softmax', got {between!r}") from None
    if fn in (Activation.BIAS, Activation.SCALE, Activation.MUL):
        raise ValueError(
            f"between: {fn.value!r} needs an operand; build the chain with from_einsum"
        )
    if fn is Activation.IDENTITY:
        return None
    return Pointwise(fn, _plain(src, *loops), _plain(dst, *loops))


def _two_gemm_chain(
    name: str,
    loops: tuple[Loop, ...],
    first: tuple[Access, Access, Access],
    second: tuple[Access, Access],
    shapes: Mapping[str, tuple[int, ...]],
    between_op: Op | None,
    dtype: DType,
) -> Chain:
    """Assemble `C = A*B; [P = f(C)]; E = P*D` from accesses and shapes."""
    a, b, c = first
    d, e = second
    ops: list[Op] = [Contraction(c, (a, b))]
    mid = c
    if between_op is not None:
        ops.append(between_op)
        mid = between_op.output
    ops.append(Contraction(e, (mid, d)))
    roles = {
        a.tensor: Role.INPUT,
        b.tensor: Role.INPUT,
        d.tensor: Role.INPUT,
        e.tensor: Role.OUTPUT,
    }
    tensors = [
        Tensor(n, shapes[n], dtype, roles.get(n, Role.INTERMEDIATE))
        for n in (a.tensor, b.tensor, c.tensor, mid.tensor, d.tensor, e.tensor)
        if n in shapes
    ]
    unique = list({t.name: t for t in tensors}.values())
    extra = []
    if isinstance(between_op, Softmax) and between_op.mask is not None:
        # (a boolean mask's elements are bytes: what the model and simulator count)
        kind = DType.BOOL if between_op.mask_kind is MaskKind.BOOL else dtype
        extra.append(
            Tensor(between_op.mask.tensor, shapes[between_op.mask.tensor], kind, Role.INPUT)
        )
    return Chain(name, loops, tuple(unique + extra), tuple(ops)).verify()


def gemm_chain(
    batch: int,
    M: int,
    N: int,
    K: int,
    L: int,
    between: Activation | str | None = None,
    dtype: DType | str = "float32",
    *,
    b_transposed: bool = False,
    d_transposed: bool = False,
    bias1: bool = False,
    bias2: bool = False,
) -> Chain:
    """`E[b,M,N] = between(A[b,M,K] @ B[b,K,L] + bias1[L]) @ D[b,L,N] + bias2[N]`, the paper's
    batched GEMM chain, with the optional terms of an `nn.Linear` MLP.

    `b_transposed` / `d_transposed`: B stored as `[b, L, K]` and D as `[b, N, L]` (nn.Linear's
    `[out, in]` weights, read as stored). `bias1` (added before `between`; with a softmax it is
    an additive term of the scores, broadcast over the rows) and `bias2` add 1-D inputs named
    `bias1` and `bias2` after A, B and D. The planner plans the chain without the biases
    (`planned_part`): L + N elements move next to the weights' K L + L N.
    """
    for value, what in ((batch, "batch"), (M, "M"), (N, "N"), (K, "K"), (L, "L")):
        check_size(value, what)
    dt = DType.parse(dtype)
    loops = (Loop("b", batch), Loop("m", M), Loop("n", N), Loop("k", K), Loop("l", L))
    b_idx = ("b", "l", "k") if b_transposed else ("b", "k", "l")
    d_idx = ("b", "n", "l") if d_transposed else ("b", "l", "n")
    size = {"b": batch, "m": M, "n": N, "k": K, "l": L}
    shapes = {"A": (batch, M, K), "B": tuple(size[x] for x in b_idx), "C": (batch, M, L),
              "D": tuple(size[x] for x in d_idx), "E": (batch, M, N)}  # fmt: skip
    rows = ("b", "m", "l")
    soft_bias = bias1 and between == "softmax"
    src = "C"
    ops: list[Op] = [Contraction(_plain("C", *rows), (_plain("A", "b", "m", "k"),
                                                      _plain("B", *b_idx)))]  # fmt: skip
    if bias1 and not soft_bias:
        ops.append(Pointwise(Activation.BIAS, _plain("C", *rows), _plain("C1", *rows),
                             _plain("bias1", "l")))  # fmt: skip
        shapes["C1"], src = (batch, M, L), "C1"
    op = _between_op(between, src, "P", rows, "l")
    if op is not None and soft_bias:
        assert isinstance(op, Softmax)
        op = dataclasses.replace(op, mask=_plain("bias1", "l"), mask_kind=MaskKind.ADDITIVE)
    mid = src
    if op is not None:
        ops.append(op)
        shapes["P"], mid = (batch, M, L), "P"
    e2 = "E0" if bias2 else "E"
    ops.append(Contraction(_plain(e2, "b", "m", "n"), (_plain(mid, *rows), _plain("D", *d_idx))))
    if bias2:
        ops.append(Pointwise(Activation.BIAS, _plain("E0", "b", "m", "n"), _plain("E", "b", "m", "n"),
                             _plain("bias2", "n")))  # fmt: skip
        shapes["E0"] = (batch, M, N)
    if bias1:
        shapes["bias1"] = (L,)
    if bias2:
        shapes["bias2"] = (N,)
    roles = {"A": Role.INPUT, "B": Role.INPUT, "D": Role.INPUT, "E": Role.OUTPUT,
             "bias1": Role.INPUT, "bias2": Role.INPUT}  # fmt: skip
    order = ("A", "B", "C", "C1", "P", "D", "E0", "E", "bias1", "bias2")
    tensors = tuple(
        Tensor(n, shapes[n], dt, roles.get(n, Role.INTERMEDIATE)) for n in order if n in shapes
    )
    kind = "gemm" if op is None else f"gemm_{_op_word(op)}"
    flags = (("_bt", b_transposed), ("_dt", d_transposed), ("_b1", bias1), ("_b2", bias2))
    tags = "".join(tag for tag, on in flags if on)
    name = f"{kind}_gemm{tags}_{dt.value}_b{batch}m{M}n{N}k{K}l{L}"
    return Chain(name, loops, tensors, tuple(ops)).verify()


#: the activations a gated MLP's gate takes: every one (SwiGLU's silu, GeGLU's gelus, ReGLU's
#: relu, ...)
GATES = POINTWISE


def gated_mlp_chain(
    batch: int,
    M: int,
    N: int,
    K: int,
    L: int,
    act: Activation | str = "silu",
    dtype: DType | str = "float32",
    *,
    b_transposed: bool = False,
    d_transposed: bool = False,
) -> Chain:
    """Llama's SwiGLU MLP, `E = (act(A @ B) * (A @ B3)) @ D`: A [b, M, K], the gate's and the
    up projection's weights B, B3 [b, K, L] (or [b, L, K] with `b_transposed`, both alike), D
    [b, L, N] (or [b, N, L]); `act` is one of `ir.ACTIVATION_NAMES`. Three GEMMs; the fused
    kernel computes both score tiles of an l block, combines them and runs the last GEMM on
    the product (`planned_part` says how it is planned)."""
    for value, what in ((batch, "batch"), (M, "M"), (N, "N"), (K, "K"), (L, "L")):
        check_size(value, what)
    dt = DType.parse(dtype)
    try:
        fn = Activation(act)
    except ValueError:
        fn = None
    if fn not in GATES:
        raise ValueError(f"act: expected one of {list(ACTIVATION_NAMES)}, got {act!r}")
    assert fn is not None
    loops = (Loop("b", batch), Loop("m", M), Loop("n", N), Loop("k", K), Loop("l", L))
    b_idx = ("b", "l", "k") if b_transposed else ("b", "k", "l")
    d_idx = ("b", "n", "l") if d_transposed else ("b", "l", "n")
    size = {"b": batch, "m": M, "n": N, "k": K, "l": L}
    rows = ("b", "m", "l")
    a = _plain("A", "b", "m", "k")
    ops: tuple[Op, ...] = (
        Contraction(_plain("C", *rows), (a, _plain("B", *b_idx))),
        Contraction(_plain("C3", *rows), (a, _plain("B3", *b_idx))),
        Pointwise(fn, _plain("C", *rows), _plain("G", *rows)),
        Pointwise(Activation.MUL, _plain("G", *rows), _plain("P", *rows), _plain("C3", *rows)),
        Contraction(_plain("E", "b", "m", "n"), (_plain("P", *rows), _plain("D", *d_idx))),
    )
    mid = Role.INTERMEDIATE
    tensors = (
        Tensor("A", (batch, M, K), dt, Role.INPUT),
        Tensor("B", tuple(size[x] for x in b_idx), dt, Role.INPUT),
        Tensor("B3", tuple(size[x] for x in b_idx), dt, Role.INPUT),
        *(Tensor(n, (batch, M, L), dt, mid) for n in ("C", "C3", "G", "P")),
        Tensor("D", tuple(size[x] for x in d_idx), dt, Role.INPUT),
        Tensor("E", (batch, M, N), dt, Role.OUTPUT),
    )
    tags = ("_bt" if b_transposed else "") + ("_dt" if d_transposed else "")
    name = f"gated_{fn.value}_mlp{tags}_{dt.value}_b{batch}m{M}n{N}k{K}l{L}"
    return Chain(name, loops, tensors, ops).verify()


def planned_part(chain: Chain) -> Chain:
    """What the planner plans of a GEMM chain the C backend runs: the chain without its bias
    additions (`Pointwise` BIAS ops and their operands): a bias moves one vector next to a
    weight matrix, and the fused kernel adds it to a tile already in cache (the C generator
    applies it; the oracle runs the whole chain). Each bias's result is read as its input::

        C = A.B; C1 = bias(C, bias1); P = gelu(C1); E0 = P.D; E = bias(E0, bias2)
        ->  C = A.B; P = gelu(C); E = P.D      (E keeps the chain's output name)

    A gated MLP (`gated_mlp_chain`) is planned as the two-GEMM chain whose first GEMM sums
    over 2K: the kernel's first GEMM is two of K over the same rows of A, so its flops and
    the bytes of its weights (B and B3, packed side by side) count twice, as they should; A's
    bytes count twice too (an overestimate of M K per l block, small next to the weights'),
    and the second score tile of an l block is not in the working set the tiles must fit.
    """
    gated = _gated(chain)
    if gated is not None:
        return gated
    drop = [op for op in chain.ops if isinstance(op, Pointwise) and op.fn is Activation.BIAS]
    if not drop:
        return chain
    final = {op.input.tensor: op.output.tensor for op in drop}
    gone = set(final) | {op.operand.tensor for op in drop if op.operand is not None}
    ops = tuple(_renamed(op, final) for op in chain.ops if op not in drop)
    tensors = tuple(t for t in chain.tensors if t.name not in gone)
    return Chain(chain.name, chain.loops, tensors, ops).verify()


def _gated(chain: Chain) -> Chain | None:
    """The planned two-GEMM chain of a chain `gated_mlp_chain` built (`planned_part`), or
    None for another chain."""
    ops = chain.ops
    if len(chain.contractions) != 3 or len(ops) != 5:
        return None
    gate, mul = ops[2], ops[3]
    if not (isinstance(gate, Pointwise) and gate.fn in GATES and isinstance(mul, Pointwise)
            and mul.fn is Activation.MUL):  # fmt: skip
        return None
    ext = chain.extents
    if not {"b", "m", "n", "k", "l"} <= set(ext):
        return None
    first, last = chain.contractions[0], chain.contractions[-1]
    b_t = first.inputs[1].loops[-1] == "k"
    d_t = last.inputs[1].loops[-1] == "l"
    view = gemm_chain(ext["b"], ext["m"], ext["n"], 2 * ext["k"], ext["l"], gate.fn,
                      chain.dtype, b_transposed=b_t, d_transposed=d_t)  # fmt: skip
    return Chain(chain.name, view.loops, view.tensors, view.ops).verify()


def _renamed(op: Op, names: Mapping[str, str]) -> Op:
    """`op` with the tensors of its accesses renamed by `names`."""

    def acc(a: Access) -> Access:
        return Access(names.get(a.tensor, a.tensor), a.index, a.zero_pad)

    if isinstance(op, Contraction):
        return Contraction(acc(op.output), (acc(op.inputs[0]), acc(op.inputs[1])))
    if isinstance(op, Pointwise):
        operand = None if op.operand is None else acc(op.operand)
        return Pointwise(op.fn, acc(op.input), acc(op.output), operand, op.alpha)
    mask = None if op.mask is None else acc(op.mask)
    return dataclasses.replace(op, input=acc(op.input), output=acc(op.output), mask=mask)


def _op_word(op: Op) -> str:
    if isinstance(op, Softmax):
        return "softmax"
    if isinstance(op, Pointwise):
        return op.fn.value
    return "gemm"


def broadcasts(shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """True when `shape` broadcasts to `full` as PyTorch and numpy broadcast: at most as many
    dims, each aligned from the right either 1 or equal."""
    return len(shape) <= len(full) and all(
        s in (1, f) for s, f in zip(reversed(shape), reversed(full), strict=False)
    )


def check_softcap(softcap: Any) -> float | None:
    """`softcap` as a float (None stays None), or a clear error: a finite number > 0."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number > 0 or None, got {softcap!r}")
    cap = float(softcap)
    if not (math.isfinite(cap) and cap > 0.0):
        raise ValueError(f"softcap: expected a finite number > 0 or None, got {softcap!r}")
    return cap


def attention_chain(
    batch: int,
    heads: int,
    seq_q: int,
    seq_k: int,
    head_dim_qk: int,
    head_dim_v: int,
    causal: bool = False,
    mask: MaskKind | str | None = None,
    scale: float | None = None,
    mask_shape: tuple[int, ...] | None = None,
    dtype: DType | str = "float32",
    softcap: float | None = None,
) -> Chain:
    """`O = softmax(scale * Q Kᵀ + mask) V` over [batch, heads, seq, dim] tensors.

    `mask_shape` (default [batch, heads, seq_q, seq_k]) broadcasts like PyTorch: any leading
    dims may be missing or 1. `softcap` (Gemma 2's attention): the scaled scores s become
    `softcap * tanh(s / softcap)` before the mask is added.
    """
    for value, what in ((batch, "batch"), (heads, "heads"), (seq_q, "seq_q"), (seq_k, "seq_k"),
                        (head_dim_qk, "head_dim_qk"), (head_dim_v, "head_dim_v")):  # fmt: skip
        check_size(value, what)
    dt = DType.parse(dtype)
    kind = MaskKind.NONE if mask is None else MaskKind(mask)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim_qk)
    cap = check_softcap(softcap)
    loops = (Loop("b", batch), Loop("h", heads), Loop("m", seq_q), Loop("n", head_dim_v),
             Loop("k", head_dim_qk), Loop("l", seq_k))  # fmt: skip
    full: tuple[int, ...] = (batch, heads, seq_q, seq_k)
    mask_acc = None
    shapes = {"Q": (batch, heads, seq_q, head_dim_qk), "K": (batch, heads, seq_k, head_dim_qk),
              "S": full, "P": full, "V": (batch, heads, seq_k, head_dim_v),
              "O": (batch, heads, seq_q, head_dim_v)}  # fmt: skip
    if kind is not MaskKind.NONE:
        mshape = full if mask_shape is None else tuple(mask_shape)
        if not broadcasts(mshape, full):
            raise ValueError(f"mask_shape {mshape} does not broadcast to {full}")
        names = ("b", "h", "m", "l")[4 - len(mshape) :]
        mask_acc = Access(
            "mask",
            tuple(Affine.of(n) if s != 1 else Affine() for n, s in zip(names, mshape, strict=True)),
        )
        shapes["mask"] = mshape
    soft = Softmax(_plain("S", "b", "h", "m", "l"), _plain("P", "b", "h", "m", "l"), axis="l",
                   scale=float(scale), mask=mask_acc, mask_kind=kind, causal=causal,
                   row="m" if causal else None, cap=cap)  # fmt: skip
    tag = "_causal" if causal else ""
    tag += "" if cap is None else f"_cap{cap:g}"
    tag += "" if kind is MaskKind.NONE else f"_{kind.value}mask"
    name = (f"attention{tag}_{dt.value}_b{batch}h{heads}m{seq_q}l{seq_k}k{head_dim_qk}"
            f"n{head_dim_v}")  # fmt: skip
    return _two_gemm_chain(
        name,
        loops,
        (
            _plain("Q", "b", "h", "m", "k"),
            _plain("K", "b", "h", "l", "k"),
            _plain("S", "b", "h", "m", "l"),
        ),
        (_plain("V", "b", "h", "l", "n"), _plain("O", "b", "h", "m", "n")),
        shapes,
        soft,
        dt,
    )


def mlp_chain(
    tokens: int,
    d_in: int,
    d_hidden: int,
    d_out: int,
    act: Activation | str | None = "gelu",
    dtype: DType | str = "float32",
) -> Chain:
    """`Y[m,n] = act(X[m,k] @ W1[k,l]) @ W2[l,n]`: a transformer/Mixer MLP (weights in x@W form)."""
    for value, what in ((tokens, "tokens"), (d_in, "d_in"), (d_hidden, "d_hidden"),
                        (d_out, "d_out")):  # fmt: skip
        check_size(value, what)
    dt = DType.parse(dtype)
    if act == "softmax":
        raise ValueError("act: expected None, 'relu' or 'gelu', got 'softmax'")
    op = _between_op(act, "H", "G", ("m", "l"), "l")
    loops = (Loop("m", tokens), Loop("n", d_out), Loop("k", d_in), Loop("l", d_hidden))
    shapes = {"X": (tokens, d_in), "W1": (d_in, d_hidden), "H": (tokens, d_hidden),
              "G": (tokens, d_hidden), "W2": (d_hidden, d_out), "Y": (tokens, d_out)}  # fmt: skip
    if op is None:
        del shapes["G"]
    word = "linear" if op is None else _op_word(op)
    name = f"mlp_{word}_{dt.value}_m{tokens}k{d_in}l{d_hidden}n{d_out}"
    return _two_gemm_chain(
        name,
        loops,
        (_plain("X", "m", "k"), _plain("W1", "k", "l"), _plain("H", "m", "l")),
        (_plain("W2", "l", "n"), _plain("Y", "m", "n")),
        shapes,
        op,
        dt,
    )


def conv_out_size(size: int, kernel: int, stride: int, pad: int, after: int | None = None) -> int:
    """Output length of a convolution along one axis (PyTorch's formula, dilation 1); `after`:
    the zeros after the axis where they differ from the `pad` before it."""
    return (size + pad + (pad if after is None else after) - kernel) // stride + 1


def conv_chain_spec(
    N: int,
    C: int,
    H: int,
    W: int,
    K1: int,
    R1: int,
    S1: int,
    K2: int,
    R2: int,
    S2: int,
    stride: tuple[int, int] = (1, 1),
    padding: tuple[int, int] = (0, 0),
    between: Activation | str | None = None,
    dtype: DType | str = "float32",
    depthwise: bool = False,
    pad_after: int | None = None,
) -> Chain:
    """Two convolutions, logical NCHW, weights [K, C, R, S] as in PyTorch::

    Y1[n,k1,p,q]  = sum_{c,r,s}    X[n,c,st1*p+r-pad1,st1*q+s-pad1] * W1[k1,c,r,s]
    Z[n,k1,p,q]   = between(Y1)
    Y2[n,k2,p2,q2] = sum_{k1,r2,s2} Z[n,k1,st2*p2+r2-pad2,st2*q2+s2-pad2] * W2[k2,k1,r2,s2]

    `depthwise`: the second convolution filters each channel on its own (PyTorch's
    `groups=K1`, W2 [K1, 1, R2, S2], K2 = K1), as in MobileNet's expansion -> depthwise::

    Y2[n,k1,p2,q2] = sum_{r2,s2} Z[n,k1,st2*p2+r2-pad2,st2*q2+s2-pad2] * W2[k1,0,r2,s2]

    `pad_after`: the second convolution's zeros after each axis (bottom, right) where they
    differ from the `padding[1]` before it (top, left): TF's "SAME" at stride 2, `(0, 1)`.
    """
    sizes = ((N, "N"), (C, "C"), (H, "H"), (W, "W"), (K1, "K1"), (R1, "R1"), (S1, "S1"),
             (K2, "K2"), (R2, "R2"), (S2, "S2"))  # fmt: skip
    for value, what in sizes:
        check_size(value, what)
    st1, st2 = (check_size(s, "stride") for s in stride)
    pad1, pad2 = padding
    for p in padding:
        if isinstance(p, bool) or not isinstance(p, int) or p < 0:
            raise ValueError(f"padding must be non-negative integers, got {padding!r}")
    after = pad2 if pad_after is None else pad_after
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise ValueError(f"pad_after must be None or a non-negative integer, got {pad_after!r}")
    dt = DType.parse(dtype)
    if not isinstance(depthwise, bool):
        raise TypeError(f"depthwise: expected a bool, got {type(depthwise).__name__}")
    if depthwise and K2 != K1:
        raise ValueError(
            f"K2: a depthwise second convolution has K1 = {K1} output channels, got {K2}"
        )
    P1, Q1 = conv_out_size(H, R1, st1, pad1), conv_out_size(W, S1, st1, pad1)
    if P1 <= 0 or Q1 <= 0:
        raise ValueError(f"first conv kernel {R1}x{S1} is larger than the padded input {H}x{W}")
    P2, Q2 = conv_out_size(P1, R2, st2, pad2, after), conv_out_size(Q1, S2, st2, pad2, after)
    if P2 <= 0 or Q2 <= 0:
        raise ValueError(f"second conv kernel {R2}x{S2} is larger than its padded input {P1}x{Q1}")
    loops: tuple[Loop, ...]
    loops = (Loop("n", N), Loop("k2", K2), Loop("p2", P2), Loop("q2", Q2), Loop("k1", K1),
             Loop("p1", P1), Loop("q1", Q1), Loop("c", C), Loop("r1", R1), Loop("s1", S1),
             Loop("r2", R2), Loop("s2", S2))  # fmt: skip
    if depthwise:  # one channel loop: k1 runs through Z, W2 and Y2
        loops = tuple(loop for loop in loops if loop.name != "k2")

    def window(out: str, tap: str, st: int, pad: int) -> Affine:
        return Affine(((out, st), (tap, 1)), -pad)

    x = Access("X", (Affine.of("n"), Affine.of("c"), window("p1", "r1", st1, pad1),
                     window("q1", "s1", st1, pad1)), zero_pad=pad1 > 0)  # fmt: skip
    op = _between_op(between, "Y1", "Z", ("n", "k1", "p1", "q1"), "k1")
    if isinstance(op, Softmax):
        raise ValueError("between: softmax is not supported between convolutions")
    mid = "Y1" if op is None else "Z"
    z = Access(mid, (Affine.of("n"), Affine.of("k1"), window("p2", "r2", st2, pad2),
                     window("q2", "s2", st2, pad2)), zero_pad=pad2 + after > 0)  # fmt: skip
    ops: list[Op] = [Contraction(_plain("Y1", "n", "k1", "p1", "q1"),
                                 (x, _plain("W1", "k1", "c", "r1", "s1")))]  # fmt: skip
    if op is not None:
        ops.append(op)
    if depthwise:
        w2 = Access("W2", (Affine.of("k1"), Affine(), Affine.of("r2"), Affine.of("s2")))
        ops.append(Contraction(_plain("Y2", "n", "k1", "p2", "q2"), (z, w2)))
    else:
        ops.append(Contraction(_plain("Y2", "n", "k2", "p2", "q2"),
                               (z, _plain("W2", "k2", "k1", "r2", "s2"))))  # fmt: skip
    tensors = [
        Tensor("X", (N, C, H, W), dt, Role.INPUT),
        Tensor("W1", (K1, C, R1, S1), dt, Role.INPUT),
        Tensor("Y1", (N, K1, P1, Q1), dt, Role.INTERMEDIATE),
    ]
    if op is not None:
        tensors.append(Tensor("Z", (N, K1, P1, Q1), dt, Role.INTERMEDIATE))
    tensors += [Tensor("W2", (K2, 1 if depthwise else K1, R2, S2), dt, Role.INPUT),
                Tensor("Y2", (N, K2, P2, Q2), dt, Role.OUTPUT)]  # fmt: skip
    word = "" if op is None else f"_{_op_word(op)}"
    dw = "dw" if depthwise else ""
    name = (f"conv{R1}x{S1}{word}_{dw}conv{R2}x{S2}_{dt.value}_n{N}c{C}h{H}w{W}k{K1}k{K2}"
            f"s{st1}{st2}p{pad1}{pad2}" + (f"a{after}" if after != pad2 else ""))  # fmt: skip
    return Chain(name, loops, tuple(tensors), tuple(ops)).verify()


_EINSUM = re.compile(r"^\s*([a-z]+)\s*,\s*([a-z]+)\s*->\s*([a-z]+)\s*$")


def from_einsum(
    *equations: str,
    sizes: dict[str, int],
    between: Activation | str | tuple[Activation | str | None, ...] | None = None,
    dtype: DType | str = "float32",
    name: str | None = None,
) -> Chain:
    """A chain of 2 to 4 contractions from einsum equations, each consuming the previous result.

    Each equation is `"lhs,rhs->out"` over single-letter loops; the first operand of every
    equation after the first is the previous result. `between` is one activation applied after
    every contraction but the last, or a tuple with one entry per gap::

        from_einsum("bmk,bkl->bml", "bml,bln->bmn", sizes=dict(b=8, m=512, k=64, l=512, n=64))
    """
    if not 2 <= len(equations) <= 4:
        raise ValueError(f"from_einsum takes 2 to 4 equations, got {len(equations)}")
    gaps = len(equations) - 1
    betweens = between if isinstance(between, tuple) else (between,) * gaps
    if len(betweens) != gaps:
        raise ValueError(f"between: expected {gaps} entries (one per gap), got {len(betweens)}")
    dt = DType.parse(dtype)
    parsed: list[tuple[str, str, str]] = []
    for i, eq in enumerate(equations):
        m = _EINSUM.match(eq)
        if m is None:
            raise ValueError(f"equation {i} {eq!r}: expected 'ab,bc->ac' over lowercase letters")
        lhs, rhs, out = m.groups()
        for part in (lhs, rhs, out):
            if len(set(part)) != len(part):
                raise ValueError(f"equation {i} {eq!r}: repeated index in {part!r}")
        missing = set(out) - set(lhs) - set(rhs)
        if missing:
            raise ValueError(f"equation {i} {eq!r}: output index {sorted(missing)} not in inputs")
        if i > 0 and lhs != parsed[-1][2]:
            raise ValueError(
                f"equation {i} {eq!r}: first operand {lhs!r} must be the previous result "
                f"{parsed[-1][2]!r}"
            )
        parsed.append((lhs, rhs, out))
    letters = sorted({ch for eq in parsed for part in eq for ch in part})
    for ch in letters:
        if ch not in sizes:
            raise ValueError(f"sizes: no size given for index {ch!r}")
        check_size(sizes[ch], f"sizes[{ch!r}]")
    for ch in sizes:
        if ch not in letters:
            raise ValueError(f"sizes: index {ch!r} appears in no equation")
    loops = tuple(Loop(ch, sizes[ch]) for ch in letters)
    tensors: list[Tensor] = []
    ops: list[Op] = []

    def add(tname: str, idx: str, role: Role) -> Access:
        tensors.append(Tensor(tname, tuple(sizes[c] for c in idx), dt, role))
        return _plain(tname, *idx)

    prev: Access | None = None
    for i, (lhs, rhs, out) in enumerate(parsed):
        first = add("X0", lhs, Role.INPUT) if prev is None else prev
        second = add(f"W{i}", rhs, Role.INPUT)
        last = i == gaps
        result = add("Y" if last else f"T{i}", out, Role.OUTPUT if last else Role.INTERMEDIATE)
        ops.append(Contraction(result, (first, second)))
        prev = result
        if not last:
            act = _between_op(betweens[i], f"T{i}", f"F{i}", tuple(out), out[-1])
            if act is not None:
                ops.append(act)
                prev = add(f"F{i}", out, Role.INTERMEDIATE)
    label = name or "einsum_" + "_".join(f"{a}{b}{c}" for a, b, c in parsed) + f"_{dt.value}"
    return Chain(label, loops, tuple(tensors), tuple(ops)).verify()
