"""The chain IR: builders make verified chains, JSON round-trips, bad input names the problem."""

from __future__ import annotations

import math
import re

import pytest

from chainfuse.builders import attention_chain, conv_chain_spec, from_einsum, gemm_chain, mlp_chain
from chainfuse.ir import (
    Access,
    Activation,
    Affine,
    Chain,
    Contraction,
    DType,
    Loop,
    MaskKind,
    Pointwise,
    Role,
    Softmax,
    Tensor,
)

F32 = DType.FLOAT32


def _plain(tensor: str, *loops: str) -> Access:
    return Access(tensor, tuple(Affine.of(n) for n in loops))


def _shapes(chain: Chain) -> dict[str, tuple[int, ...]]:
    return {t.name: t.shape for t in chain.tensors}


def _roles(chain: Chain) -> dict[str, Role]:
    return {t.name: t.role for t in chain.tensors}


def _round_trips(chain: Chain) -> None:
    again = Chain.from_json(chain.to_json())
    assert again == chain
    assert hash(again) == hash(chain)
    assert again.to_json() == chain.to_json()
    assert again.extents == chain.extents
    assert str(again) == str(chain)


# -- builders: shapes, loops, round trip ----------------------------------------------------------

BETWEENS = (None, "relu", "gelu", "softmax")


@pytest.mark.parametrize("between", BETWEENS)
def test_gemm_chain_shapes_loops_and_round_trip(between: str | None) -> None:
    b, M, N, K, L = 3, 17, 7, 5, 11
    chain = gemm_chain(b, M, N, K, L, between)
    assert chain.verify() is chain
    assert chain.extents == {"b": b, "m": M, "n": N, "k": K, "l": L}
    shapes = _shapes(chain)
    assert shapes["A"] == (b, M, K)
    assert shapes["B"] == (b, K, L)
    assert shapes["C"] == (b, M, L)
    assert shapes["D"] == (b, L, N)
    assert shapes["E"] == (b, M, N)
    roles = _roles(chain)
    assert [n for n, r in roles.items() if r is Role.INPUT] == ["A", "B", "D"]
    assert [n for n, r in roles.items() if r is Role.OUTPUT] == ["E"]
    if between is None:
        assert "P" not in shapes
        assert len(chain.ops) == 2
    else:
        assert shapes["P"] == (b, M, L) and roles["P"] is Role.INTERMEDIATE
        assert len(chain.ops) == 3
        mid = chain.ops[1]
        if between == "softmax":
            assert isinstance(mid, Softmax) and mid.axis == "l"
        else:
            assert isinstance(mid, Pointwise) and mid.fn is Activation(between)
    assert [op.reduction for op in chain.contractions] == [("k",), ("l",)]
    assert chain.dtype is F32
    _round_trips(chain)


def test_gemm_chain_identity_between_is_no_op_and_dtype_alias() -> None:
    assert gemm_chain(1, 2, 3, 4, 5, "identity") == gemm_chain(1, 2, 3, 4, 5)
    chain = gemm_chain(1, 2, 3, 4, 5, dtype="bf16")
    assert chain.dtype is DType.BFLOAT16
    assert all(t.dtype is DType.BFLOAT16 for t in chain.tensors)
    _round_trips(chain)


@pytest.mark.parametrize("between", BETWEENS)
def test_gemm_chain_flops(between: str | None) -> None:
    b, M, N, K, L = 2, 9, 4, 6, 13
    chain = gemm_chain(b, M, N, K, L, between)
    pointwise = 0 if between is None else b * M * L
    assert chain.flops() == 2 * b * M * L * (K + N) + pointwise


def test_names_differ_between_builds() -> None:
    names = {gemm_chain(1, 2, 3, 4, 5, bt).name for bt in BETWEENS}
    assert len(names) == len(BETWEENS)
    assert gemm_chain(1, 2, 3, 4, 5) != gemm_chain(1, 2, 3, 4, 6)


MASKS = (None, "bool", "additive")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_attention_chain(causal: bool, mask: str | None) -> None:
    b, h, sq, sk, dk, dv = 2, 3, 5, 7, 4, 6
    chain = attention_chain(b, h, sq, sk, dk, dv, causal=causal, mask=mask)
    assert chain.extents == {"b": b, "h": h, "m": sq, "n": dv, "k": dk, "l": sk}
    shapes = _shapes(chain)
    assert shapes["Q"] == (b, h, sq, dk)
    assert shapes["K"] == (b, h, sk, dk)
    assert shapes["V"] == (b, h, sk, dv)
    assert shapes["O"] == (b, h, sq, dv)
    assert shapes["S"] == shapes["P"] == (b, h, sq, sk)
    soft = chain.ops[1]
    assert isinstance(soft, Softmax)
    assert soft.causal is causal
    assert soft.row == ("m" if causal else None)
    assert soft.scale == pytest.approx(1 / math.sqrt(dk))
    if mask is None:
        assert soft.mask is None and soft.mask_kind is MaskKind.NONE and "mask" not in shapes
    else:
        assert soft.mask_kind is MaskKind(mask)
        assert shapes["mask"] == (b, h, sq, sk)
        assert _roles(chain)["mask"] is Role.INPUT
    _round_trips(chain)


@pytest.mark.parametrize(
    ("mask_shape", "index"),
    [
        ((7,), ("l",)),
        ((5, 7), ("m", "l")),
        ((1, 5, 7), ("", "m", "l")),
        ((2, 1, 1, 7), ("b", "", "", "l")),
        ((1, 1, 5, 7), ("", "", "m", "l")),
    ],
)
def test_attention_broadcast_mask(mask_shape: tuple[int, ...], index: tuple[str, ...]) -> None:
    chain = attention_chain(2, 3, 5, 7, 4, 6, mask="additive", mask_shape=mask_shape, scale=0.25)
    assert _shapes(chain)["mask"] == mask_shape
    soft = chain.ops[1]
    assert isinstance(soft, Softmax) and soft.mask is not None
    assert tuple(ix.loops[0] if ix.terms else "" for ix in soft.mask.index) == index
    assert soft.scale == 0.25
    _round_trips(chain)


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_mlp_chain(act: str | None) -> None:
    chain = mlp_chain(9, 5, 12, 7, act)
    assert chain.extents == {"m": 9, "n": 7, "k": 5, "l": 12}
    shapes = _shapes(chain)
    assert shapes["X"] == (9, 5)
    assert shapes["W1"] == (5, 12)
    assert shapes["W2"] == (12, 7)
    assert shapes["Y"] == (9, 7)
    assert ("G" in shapes) is (act is not None)
    assert chain.flops() == 2 * 9 * 12 * (5 + 7) + (0 if act is None else 9 * 12)
    _round_trips(chain)


@pytest.mark.parametrize(
    ("stride", "padding", "between"),
    [
        ((1, 1), (0, 0), None),
        ((2, 1), (1, 1), "relu"),
        ((1, 2), (1, 0), None),
        ((3, 2), (2, 1), "relu"),
    ],
)
def test_conv_chain(stride: tuple[int, int], padding: tuple[int, int], between: str | None) -> None:
    N, C, H, W, K1, K2 = 2, 3, 11, 9, 4, 5
    chain = conv_chain_spec(N, C, H, W, K1, 3, 3, K2, 3, 3, stride=stride, padding=padding,
                            between=between)  # fmt: skip
    ext = chain.extents
    P1 = (H + 2 * padding[0] - 3) // stride[0] + 1
    Q1 = (W + 2 * padding[0] - 3) // stride[0] + 1
    P2 = (P1 + 2 * padding[1] - 3) // stride[1] + 1
    Q2 = (Q1 + 2 * padding[1] - 3) // stride[1] + 1
    assert (ext["p1"], ext["q1"], ext["p2"], ext["q2"]) == (P1, Q1, P2, Q2)
    assert (ext["n"], ext["c"], ext["k1"], ext["k2"]) == (N, C, K1, K2)
    assert all(ext[t] == 3 for t in ("r1", "s1", "r2", "s2"))
    shapes = _shapes(chain)
    assert shapes["X"] == (N, C, H, W)
    assert shapes["W1"] == (K1, C, 3, 3)
    assert shapes["Y1"] == (N, K1, P1, Q1)
    assert shapes["W2"] == (K2, K1, 3, 3)
    assert shapes["Y2"] == (N, K2, P2, Q2)
    assert ("Z" in shapes) is (between is not None)
    x = chain.ops[0].reads[0]
    assert x.tensor == "X"
    assert x.zero_pad is (padding[0] > 0)
    assert x.index[2] == Affine((("p1", stride[0]), ("r1", 1)), -padding[0])
    consumer = chain.ops[-1].reads[0]
    assert consumer.zero_pad is (padding[1] > 0)
    assert consumer.index[3] == Affine((("q2", stride[1]), ("s2", 1)), -padding[1])
    _round_trips(chain)


@pytest.mark.parametrize("between", [None, "relu", ("relu", None, "gelu")])
@pytest.mark.parametrize("count", [2, 3, 4])
def test_from_einsum(count: int, between: object) -> None:
    equations = ("bmk,bkl->bml", "bml,bln->bmn", "bmn,bnp->bmp", "bmp,bpq->bmq")[:count]
    letters = "bmklnpq"[: 4 + count - 1]
    sizes = dict(zip(letters, (2, 3, 4, 5, 6, 7, 8), strict=False))
    if isinstance(between, tuple):
        between = between[: count - 1]
    chain = from_einsum(*equations, sizes=sizes, between=between)
    assert chain.extents == {k: sizes[k] for k in sorted(sizes)}
    assert len(chain.contractions) == count
    shapes = _shapes(chain)
    assert shapes["X0"] == (2, 3, 4)
    last = letters[-1]
    assert shapes["Y"] == (2, 3, sizes[last])
    assert _roles(chain)["Y"] is Role.OUTPUT
    assert [t.name for t in chain.inputs] == ["X0", *(f"W{i}" for i in range(count))]
    gaps = between if isinstance(between, tuple) else (between,) * (count - 1)
    assert len(chain.ops) == count + sum(g is not None for g in gaps)
    for i in range(1, count):  # every contraction after the first reads the previous result
        op = chain.contractions[i]
        producer = chain.producer(op.inputs[0].tensor)
        assert producer is not None and producer.output.tensor == op.inputs[0].tensor
    _round_trips(chain)


def test_from_einsum_matches_gemm_chain_flops() -> None:
    sizes = dict(b=2, m=9, k=4, l=13, n=6)
    chain = from_einsum("bmk,bkl->bml", "bml,bln->bmn", sizes=sizes, name="custom")
    assert chain.name == "custom"
    assert chain.flops() == gemm_chain(2, 9, 6, 4, 13).flops()


# -- builders: bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 2.0, "4", True, None])
@pytest.mark.parametrize("position", range(5))
def test_gemm_chain_bad_sizes_name_the_argument(position: int, bad: object) -> None:
    args: list[object] = [2, 3, 4, 5, 6]
    args[position] = bad
    what = ("batch", "M", "N", "K", "L")[position]
    with pytest.raises(ValueError, match=rf"^{what} must be a positive integer"):
        gemm_chain(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("batch", 0),
        ("heads", -1),
        ("seq_q", 0),
        ("seq_k", 1.5),
        ("head_dim_qk", 0),
        ("head_dim_v", -2),
    ],
)
def test_attention_bad_sizes_name_the_argument(name: str, bad: object) -> None:
    args = dict(batch=1, heads=2, seq_q=3, seq_k=4, head_dim_qk=5, head_dim_v=6)
    args[name] = bad  # type: ignore[assignment]
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer"):
        attention_chain(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["tokens", "d_in", "d_hidden", "d_out"])
def test_mlp_bad_sizes_name_the_argument(name: str) -> None:
    args = dict(tokens=1, d_in=2, d_hidden=3, d_out=4)
    args[name] = 0
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer"):
        mlp_chain(**args)


@pytest.mark.parametrize("name", ["N", "C", "H", "W", "K1", "R1", "S1", "K2", "R2", "S2"])
def test_conv_bad_sizes_name_the_argument(name: str) -> None:
    args = dict(N=1, C=2, H=8, W=8, K1=3, R1=3, S1=3, K2=4, R2=1, S2=1)
    args[name] = -1
    with pytest.raises(ValueError, match=rf"^{name} must be a positive integer"):
        conv_chain_spec(**args)


@pytest.mark.parametrize("between", ["tanh", "softmax2", Activation.BIAS, "scale"])
def test_unknown_between(between: object) -> None:
    with pytest.raises(ValueError, match="between"):
        gemm_chain(1, 2, 3, 4, 5, between)  # type: ignore[arg-type]


def test_mlp_rejects_softmax_and_conv_rejects_softmax() -> None:
    with pytest.raises(ValueError, match="softmax"):
        mlp_chain(2, 3, 4, 5, "softmax")
    with pytest.raises(ValueError, match="softmax"):
        conv_chain_spec(1, 2, 6, 6, 3, 3, 3, 4, 1, 1, between="softmax")


def test_unknown_dtype_lists_known() -> None:
    with pytest.raises(ValueError, match="float32"):
        gemm_chain(1, 2, 3, 4, 5, dtype="int7")
    # bool is a mask's element type, never a chain's (nor listed as one)
    with pytest.raises(ValueError, match=r"unknown dtype 'bool'; expected one of [a-z0-9, ]+$"):
        gemm_chain(1, 2, 3, 4, 5, dtype="bool")


def test_a_boolean_masks_elements_are_bytes() -> None:
    # the kernels read a boolean mask a byte an element: the model and simulator count that
    chain = attention_chain(1, 2, 8, 8, 4, 4, dtype="bfloat16", mask="bool", mask_shape=(8, 8))
    assert chain.tensor("mask").dtype is DType.BOOL and chain.tensor("mask").nbytes == 64
    assert chain.dtype is DType.BFLOAT16
    additive = attention_chain(1, 2, 8, 8, 4, 4, mask="additive", mask_shape=(8, 8))
    assert additive.tensor("mask").nbytes == 256
    assert Chain.from_json(chain.to_json()) == chain


def test_conv_kernel_larger_than_padded_input() -> None:
    with pytest.raises(ValueError, match="first conv kernel 5x5 is larger than the padded input"):
        conv_chain_spec(1, 1, 3, 3, 1, 5, 5, 1, 1, 1)
    conv_chain_spec(1, 1, 3, 3, 1, 5, 5, 1, 1, 1, padding=(1, 0))  # padding makes it fit
    with pytest.raises(ValueError, match="second conv kernel 3x3 is larger than its padded input"):
        conv_chain_spec(1, 1, 4, 4, 1, 3, 3, 1, 3, 3)  # first output 2x2
    with pytest.raises(ValueError, match="stride"):
        conv_chain_spec(1, 1, 4, 4, 1, 1, 1, 1, 1, 1, stride=(0, 1))
    with pytest.raises(ValueError, match="padding"):
        conv_chain_spec(1, 1, 4, 4, 1, 1, 1, 1, 1, 1, padding=(-1, 0))


@pytest.mark.parametrize(
    "mask_shape", [(5, 6), (3, 3, 5, 7), (2, 7), (1, 1, 1, 1, 7), (2, 3, 4, 7)]
)
def test_wrong_mask_shape(mask_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"mask_shape {mask_shape} does not broadcast")):
        attention_chain(2, 3, 5, 7, 4, 6, mask="bool", mask_shape=mask_shape)


def test_unknown_mask_kind() -> None:
    with pytest.raises(ValueError):
        attention_chain(1, 1, 2, 2, 2, 2, mask="float")


SIZES = dict(b=2, m=3, k=4, l=5, n=6)


@pytest.mark.parametrize(
    ("equations", "sizes", "message"),
    [
        (
            ("bmk,bkl->bml", "bmk,bkn->bmn"),
            SIZES,
            "first operand 'bmk' must be the previous result",
        ),
        (("bmk,bkl->bml", "bml,bln->bmq"), SIZES, r"output index \['q'\] not in inputs"),
        (("bmk,bkl->bmx", "bmx,bxn->bmn"), SIZES, r"output index \['x'\] not in inputs"),
        (
            ("bmk,bkl->bml", "bml,bln->bmn"),
            {k: v for k, v in SIZES.items() if k != "n"},
            "no size given for index 'n'",
        ),
        (("bmk,bkl->bml", "bml,bln->bmn"), {**SIZES, "z": 3}, "index 'z' appears in no equation"),
        (("bmk,bkl->bml", "bml,bln->bmn"), {**SIZES, "k": 0}, r"sizes\['k'\] must be a positive"),
        (("bmk,bkl->bml",), SIZES, "2 to 4 equations, got 1"),
        (("bmk,bkl->bml",) + ("bml,bln->bml",) * 4, SIZES, "2 to 4 equations, got 5"),
        (("bmk,bkl->bml", "bml*bln->bmn"), SIZES, "equation 1"),
        (("bmk,bkl->bml", "bml,bbn->bmn"), SIZES, "repeated index"),
    ],
)
def test_from_einsum_errors(
    equations: tuple[str, ...], sizes: dict[str, int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        from_einsum(*equations, sizes=sizes)


def test_from_einsum_between_count() -> None:
    with pytest.raises(ValueError, match="between: expected 1 entries"):
        from_einsum("bmk,bkl->bml", "bml,bln->bmn", sizes=SIZES, between=("relu", "gelu"))


# -- Chain.verify on hand-made chains -------------------------------------------------------------


def _hand_chain(**changes: object) -> Chain:
    """C[m,l] = A[m,k] B[k,l]; E[m,n] = C[m,l] D[l,n], with pieces replaced by `changes`."""
    loops = (Loop("m", 4), Loop("n", 3), Loop("k", 5), Loop("l", 6))
    tensors = {
        "A": Tensor("A", (4, 5), F32, Role.INPUT),
        "B": Tensor("B", (5, 6), F32, Role.INPUT),
        "C": Tensor("C", (4, 6), F32, Role.INTERMEDIATE),
        "D": Tensor("D", (6, 3), F32, Role.INPUT),
        "E": Tensor("E", (4, 3), F32, Role.OUTPUT),
    }
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k"), _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    loops = changes.pop("loops", loops)  # type: ignore[assignment]
    tensors.update(changes.pop("tensors", {}))  # type: ignore[arg-type]
    ops = changes.pop("ops", ops)  # type: ignore[assignment]
    assert not changes
    return Chain("hand", tuple(loops), tuple(t for t in tensors.values() if t is not None),
                 tuple(ops))  # fmt: skip


def test_hand_chain_verifies() -> None:
    chain = _hand_chain()
    assert chain.verify() is chain
    _round_trips(chain)


def test_verify_wrong_access_rank() -> None:
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k", "l"), _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    with pytest.raises(ValueError, match=r"tensor 'A' has 2 dims \(4, 5\) but is indexed with 3"):
        _hand_chain(ops=ops).verify()


def test_verify_extent_mismatch() -> None:
    bad = {"B": Tensor("B", (5, 7), F32, Role.INPUT)}
    with pytest.raises(ValueError, match="tensor 'B' dim 1 has size 7 but loop 'l' has extent 6"):
        _hand_chain(tensors=bad).verify()
    bad_out = {"E": Tensor("E", (4, 2), F32, Role.OUTPUT)}
    with pytest.raises(ValueError, match="tensor 'E' dim 1 has size 2 but loop 'n' has extent 3"):
        _hand_chain(tensors=bad_out).verify()


def test_verify_unknown_loop() -> None:
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "z"), _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    with pytest.raises(ValueError, match="tensor 'A' dim 1 uses unknown loop 'z'"):
        _hand_chain(ops=ops).verify()


def test_verify_unknown_tensor() -> None:
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("Q", "m", "k"), _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    with pytest.raises(ValueError, match="unknown tensor 'Q'"):
        _hand_chain(ops=ops).verify()


def test_verify_read_before_write() -> None:
    first = Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k"), _plain("B", "k", "l")))
    second = Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n")))
    with pytest.raises(ValueError, match="reads 'C' before any op writes it"):
        _hand_chain(ops=[second, first]).verify()


def test_verify_unused_input() -> None:
    extra = {"U": Tensor("U", (4,), F32, Role.INPUT)}
    with pytest.raises(ValueError, match="input tensor 'U' is never read"):
        _hand_chain(tensors=extra).verify()


def test_verify_unused_loop() -> None:
    loops = (Loop("m", 4), Loop("n", 3), Loop("k", 5), Loop("l", 6), Loop("z", 2))
    with pytest.raises(ValueError, match="loop 'z' is not used by any op"):
        _hand_chain(loops=loops).verify()


def test_verify_writes_input_and_double_write() -> None:
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k"), _plain("B", "k", "l"))),
        Contraction(_plain("D", "l", "n"), (_plain("C", "m", "l"), _plain("E", "m", "n"))),
    ]
    swapped = {"E": Tensor("E", (4, 3), F32, Role.INPUT)}
    with pytest.raises(ValueError, match="writes 'D', which is a chain input"):
        _hand_chain(ops=ops, tensors=swapped).verify()
    ops = [
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k"), _plain("B", "k", "l"))),
        Contraction(_plain("C", "m", "l"), (_plain("A", "m", "k"), _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    with pytest.raises(ValueError, match="tensor 'C' is written by more than one op"):
        _hand_chain(ops=ops).verify()


def test_verify_intermediate_never_read() -> None:
    tensors = {"E": Tensor("E", (4, 3), F32, Role.INTERMEDIATE)}
    with pytest.raises(ValueError, match="intermediate tensor 'E' is never read"):
        _hand_chain(tensors=tensors).verify()


def test_verify_index_out_of_range() -> None:
    shifted = Access("A", (Affine.of("m"), Affine((("k", 1),), 1)))
    ops = [
        Contraction(_plain("C", "m", "l"), (shifted, _plain("B", "k", "l"))),
        Contraction(_plain("E", "m", "n"), (_plain("C", "m", "l"), _plain("D", "l", "n"))),
    ]
    with pytest.raises(ValueError, match=r"tensor 'A' dim 1: index k\+1 ranges over \[1, 5\]"):
        _hand_chain(ops=ops).verify()


def test_verify_duplicates_and_empty() -> None:
    loops = (Loop("m", 4), Loop("m", 4), Loop("n", 3), Loop("k", 5), Loop("l", 6))
    with pytest.raises(ValueError, match="duplicate loop names"):
        _hand_chain(loops=loops).verify()
    with pytest.raises(ValueError, match="has no ops"):
        _hand_chain(ops=[]).verify()


def test_bad_names_and_extents() -> None:
    with pytest.raises(ValueError, match="loop name '1x' must be an identifier"):
        Loop("1x", 3)
    with pytest.raises(ValueError, match="loop 'x' extent must be a positive integer"):
        Loop("x", 0)
    with pytest.raises(ValueError, match="tensor 'T' dim 1 must be a positive integer"):
        Tensor("T", (2, 0), F32, Role.INPUT)


def test_from_json_verifies() -> None:
    text = gemm_chain(1, 2, 3, 4, 5).to_json().replace('["l", 5]', '["l", 6]')
    with pytest.raises(ValueError, match="loop 'l' has extent 6"):
        Chain.from_json(text)
