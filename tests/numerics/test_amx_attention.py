"""bf16 attention on AMX tiles with every mask kind, causal, GQA, decode and the head dims of
real models, run through the bit-exact emulation on every host (``CHAINFUSE_AMX=emulate``) and
checked against the float64 reference with the one tolerance rule at bf16's unit roundoff.

The rule is held without its input-dependent softmax part (scores of O(1), kept in fp32 by these
kernels); `test_a_dropped_key_block_fails_the_check` shows it then fails a kernel that loses one
block of 32 keys, or reads a mask one block off. Sizes stay small: the emulation is scalar C."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.compiler import AmxKernel, compile
from chainfuse.ir import MaskKind
from chainfuse.kernels.amx import ENV_AMX, AmxPath, amx_status
from tests.checks import check_against_reference

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_AMX, "emulate")


@pytest.fixture
def fresh_calls() -> Iterator[None]:
    """`ops`' kernel caches empty before and after: they are kept by sizes, not by the AMX
    path, so a kernel of another test's path would be reused, and this test's left behind."""
    chainfuse.ops.calls.clear()
    yield
    chainfuse.ops.calls.clear()


def _torch(x: np.ndarray) -> Any:
    t = torch.from_numpy(np.ascontiguousarray(x))
    return t if x.dtype == np.bool_ else t.to(torch.bfloat16)  # exact: bf16 values already


def _amx(chain: chainfuse.Chain, tiles: dict[str, int] | None = None) -> AmxKernel:
    kernel = compile(chain, tiles=tiles)
    assert isinstance(kernel, AmxKernel) and kernel.amx_path is AmxPath.EMULATED
    return kernel


def _attention(
    b: int, h: int, M: int, L: int, dk: int, dv: int, mask: str | None, causal: bool,
    mask_shape: tuple[int, ...] | None = None,
) -> chainfuse.Chain:  # fmt: skip
    return chainfuse.attention_chain(b, h, M, L, dk, dv, causal=causal, mask=mask,
                                     mask_shape=mask_shape, dtype="bfloat16")  # fmt: skip


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("b", "h", "M", "L", "dk", "dv", "tiles"),
    [
        (1, 2, 19, 45, 40, 24, None),  # tails of every tile: 16 rows, 32 keys, 32 k, 16 n
        (1, 1, 1, 37, 64, 64, None),  # decode: one query
        (2, 1, 70, 67, 17, 9, {"m": 32, "l": 32}),  # 3 row blocks x 3 key blocks: causal skips
        (1, 1, 13, 1, 7, 3, None),  # one key
    ],
)  # fmt: skip
def test_amx_attention_matches_reference(
    mask: str | None, causal: bool, b: int, h: int, M: int, L: int, dk: int, dv: int,
    tiles: dict[str, int] | None,
) -> None:  # fmt: skip
    chain = _attention(b, h, M, L, dk, dv, mask, causal)
    kernel = _amx(chain, tiles)
    out, _ = check_against_reference(kernel, chain, seed=M + L, convert=_torch)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (b, h, M, dv)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.sampled_from([1, 2, 15, 16, 17, 31, 33, 47]), L=st.sampled_from([1, 7, 31, 32, 33, 63, 65]),
    dk=st.sampled_from([1, 17, 31, 32, 33, 64]), dv=st.sampled_from([1, 5, 16, 17, 33]),
    mask=st.sampled_from([None, "bool", "additive"]), causal=st.booleans(),
    tile_l=st.sampled_from([32, 64]),
)  # fmt: skip
def test_amx_attention_of_drawn_sizes(
    M: int, L: int, dk: int, dv: int, mask: str | None, causal: bool, tile_l: int
) -> None:
    chain = _attention(2, 1, M, L, dk, dv, mask, causal)
    kernel = _amx(chain, {"m": 32, "l": tile_l})
    check_against_reference(kernel, chain, seed=M * L, convert=_torch)


def _at_threads(threads: int, kernel: AmxKernel, chain: chainfuse.Chain) -> Any:
    chainfuse.set_num_threads(threads)
    try:
        out, _ = check_against_reference(kernel, chain, seed=7, convert=_torch)
    finally:
        chainfuse.set_num_threads(None)
    return out


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_amx_heads_packed_once_give_what_blocks_packing_their_own_give(
    mask: str | None, causal: bool
) -> None:
    """Five row blocks a head: one thread (or each of two) packs a head's k and v once and
    reads every l block from there; eight threads each run too few of a head's blocks and
    pack per block. Bit for bit the same, for each of 2 x 3 heads."""
    chain = _attention(2, 3, 150, 141, 40, 24, mask, causal)
    kernel = _amx(chain, {"m": 32, "l": 64})
    per_block = _at_threads(8, kernel, chain)
    assert torch.equal(_at_threads(1, kernel, chain), per_block)
    assert torch.equal(_at_threads(2, kernel, chain), per_block)


@pytest.mark.parametrize("fill", ["-inf", "min", "bool"])
def test_amx_heads_packed_once_with_keys_a_mask_leaves_out(fill: str) -> None:
    """A sliding window: each row block's keys narrowed, then widened back to whole 32s where
    the head's tiles are sliced (the keys added weigh 0)."""
    b, h, M, L, d = 1, 2, 200, 203, 32
    i, j = np.arange(M)[:, None] + (L - M), np.arange(L)[None, :]
    keep = (j <= i) & (j > i - 45)
    mask = keep if fill == "bool" else np.where(keep, 0.0, -np.inf if fill == "-inf" else -3e38)
    kind = "bool" if fill == "bool" else "additive"
    chain = _attention(b, h, M, L, d, d, kind, False, mask_shape=(1, 1, M, L))
    kernel = _amx(chain, {"m": 32, "l": 64})
    inputs = reference.random_inputs(chain, seed=3)
    inputs["mask"] = mask.reshape(1, 1, M, L).astype(inputs["mask"].dtype)
    want = reference.run(chain, inputs)["O"]
    for threads in (1, 2):
        chainfuse.set_num_threads(threads)
        try:
            got = kernel(*[_torch(inputs[t.name]) for t in chain.inputs])
        finally:
            chainfuse.set_num_threads(None)
        reference.assert_close(got.float().numpy(), want, chain)


@pytest.mark.parametrize("d", [64, 80, 96, 128])
def test_amx_attention_head_dims_of_models(d: int) -> None:
    chain = _attention(1, 2, 17, 33, d, d, "bool", True)
    check_against_reference(_amx(chain), chain, seed=d, convert=_torch)


@pytest.mark.parametrize(("dk", "dv"), [(96, 40), (33, 128), (1, 1), (80, 65)])
def test_amx_attention_head_dims_of_q_and_v_differ(dk: int, dv: int) -> None:
    chain = _attention(1, 1, 23, 41, dk, dv, "additive", False)
    check_against_reference(_amx(chain), chain, seed=dk + dv, convert=_torch)


@pytest.mark.parametrize("mask", ["bool", "additive"])
@pytest.mark.parametrize(
    "mask_shape", [(1, 1, 1, 53), (31, 53), (2, 1, 31, 53), (1, 3, 1, 53), (2, 3, 31, 1)]
)
def test_amx_attention_masks_broadcast_as_pytorch(mask: str, mask_shape: tuple[int, ...]) -> None:
    # a key-padding mask (stride 0 along queries), one per query, per batch, per head, per row
    chain = _attention(2, 3, 31, 53, 16, 16, mask, False, mask_shape)
    check_against_reference(_amx(chain), chain, seed=len(mask_shape), convert=_torch)


def test_amx_attention_mask_read_through_strides() -> None:
    # a transposed mask view (keys not contiguous) and an expanded one (stride 0)
    chain = _attention(1, 2, 21, 34, 16, 8, "bool", False)
    x = reference.random_inputs(chain, seed=6)
    q, k, v = (_torch(x[n]) for n in ("Q", "K", "V"))
    mask_t = torch.from_numpy(np.ascontiguousarray(x["mask"].transpose(0, 1, 3, 2))).transpose(2, 3)
    want = reference.run(chain, x)["O"]
    reference.assert_close(_amx(chain)(q, k, v, mask_t).float().numpy(), want, chain)
    row = x["mask"][:, :, :1]  # one row for every query
    x["mask"] = np.broadcast_to(row, x["mask"].shape)
    expanded = torch.from_numpy(row.copy()).expand(1, 2, 21, 34)
    want = reference.run(chain, x)["O"]
    reference.assert_close(_amx(chain)(q, k, v, expanded).float().numpy(), want, chain)


@pytest.mark.parametrize(("M", "L"), [(40, 7), (7, 40), (33, 97)])
def test_amx_causal_attention_of_unequal_lengths(M: int, L: int) -> None:
    # top-left aligned: queries past the last key see every key; keys past the last query none
    chain = _attention(1, 1, M, L, 24, 24, None, True)
    check_against_reference(_amx(chain, {"m": 32, "l": 32}), chain, seed=M, convert=_torch)


def test_amx_attention_rows_with_every_key_masked_are_zeros() -> None:
    chain = _attention(1, 1, 20, 40, 16, 16, "bool", False)
    x = reference.random_inputs(chain, seed=3)
    x["mask"][0, 0, 4] = False
    x["mask"][0, 0, 17] = False
    out = _amx(chain)(*(_torch(x[t.name]) for t in chain.inputs)).float().numpy()
    assert (out[0, 0, [4, 17]] == 0).all()
    reference.assert_close(out, reference.run(chain, x)["O"], chain)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_amx_grouped_query_attention(
    mask: str | None, monkeypatch: pytest.MonkeyPatch, fresh_calls: None
) -> None:
    # 6 query heads over 2 kv heads: the functional op runs the AMX kernel on views of k and v
    built: list[Any] = []

    def compiled(*args: Any, **kwargs: Any) -> Any:
        built.append(compile(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(importlib.import_module("chainfuse.ops.calls"), "compile", compiled)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 6, 11, 40, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, 37, 40, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 37, 24, generator=g).to(torch.bfloat16)
    m = torch.rand(2, 1, 11, 37, generator=g) < 0.8 if mask else None
    if m is not None:
        m[..., 0] = True
    out = chainfuse.ops.attention(q, k, v, attn_mask=m, is_causal=mask is None, enable_gqa=True)
    chain = _attention(2, 6, 11, 37, 40, 24, mask, mask is None, (2, 1, 11, 37) if mask else None)
    x = {"Q": q.float().numpy(), "K": k.float().repeat_interleave(3, 1).numpy(),
         "V": v.float().repeat_interleave(3, 1).numpy()}  # fmt: skip
    if m is not None:
        x["mask"] = m.numpy()
    reference.assert_close(out.float().numpy(), reference.run(chain, x)["O"], chain)
    assert built and all(isinstance(kernel, AmxKernel) for kernel in built), built


def _unfused_bf16(x: dict[str, np.ndarray], chain: chainfuse.Chain, causal: bool) -> np.ndarray:
    """PyTorch's unfused bf16 attention: bf16 scores, the mask added (a boolean one as 0 /
    -inf, as SDPA converts it), the causal mask selected, bf16 softmax, bf16 P.V."""
    q, k, v = (_torch(x[n]) for n in ("Q", "K", "V"))
    soft = next(op for op in chain.ops if isinstance(op, chainfuse.ir.Softmax))
    s = torch.matmul(q, k.transpose(-1, -2)) * soft.scale
    if soft.mask_kind is MaskKind.BOOL:
        keep = torch.from_numpy(x["mask"])
        s = s + torch.zeros(keep.shape, dtype=s.dtype).masked_fill(~keep, float("-inf"))
    elif soft.mask_kind is MaskKind.ADDITIVE:
        s = s + _torch(x["mask"])
    if causal:
        M, L = s.shape[-2:]
        s = s.masked_fill(torch.ones(M, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1), v).float().numpy()


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # (the reference's inf - inf)
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_amx_attention_nan_and_inf_propagate_as_pytorch(
    mask: str | None, causal: bool, bad: float
) -> None:
    chain = _attention(1, 1, 35, 50, 20, 18, mask, causal)
    x = reference.random_inputs(chain, seed=12)
    x["Q"][0, 0, 3, 5] = bad  # one row of scores non-finite
    x["K"][0, 0, 40, 2] = bad  # one key's scores, for the rows that see it
    x["V"][0, 0, 0, 7] = bad  # the first key: every row takes it
    ours = _amx(chain)(*(_torch(x[t.name]) for t in chain.inputs)).float().numpy()
    theirs = _unfused_bf16(x, chain, causal)
    for test in (np.isnan, np.isposinf, np.isneginf):
        assert np.array_equal(test(ours), test(theirs)), test.__name__
    assert not np.isfinite(ours).all()
    reference.assert_close(ours, reference.run(chain, x)["O"], chain, inputs=x)


@pytest.mark.parametrize("fault", ["dropped keys", "mask one block off", "one tile"])
def test_a_dropped_key_block_fails_the_check(fault: str) -> None:
    # the check's tolerance is tight enough to fail a kernel that loses one block of 32 keys,
    # reads its mask a block off, or leaves one 16x16 tile of its output wrong
    chain = _attention(1, 1, 40, 90, 32, 32, "bool", False)
    x = reference.random_inputs(chain, seed=1)
    want = reference.run(chain, x)["O"]
    given = {n: a.copy() for n, a in x.items()}
    if fault == "dropped keys":
        given["mask"][..., 32:64] = False
    elif fault == "mask one block off":
        given["mask"] = np.roll(given["mask"], 32, axis=-1)
    out = _amx(chain)(*(_torch(given[t.name]) for t in chain.inputs)).float().numpy()
    if fault == "one tile":
        out[0, 0, 16:32, 16:32] = 0.0
    else:  # (the kernel itself is right: it matches the reference of what it was given)
        reference.assert_close(out, reference.run(chain, given)["O"], chain)
    with pytest.raises(AssertionError):
        reference.assert_close(out, want, chain)


def test_amx_attention_says_what_it_computes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    chain = _attention(1, 1, 8, 8, 8, 8, "additive", True)
    kernel = _amx(chain)
    assert kernel.arithmetic.startswith("amx-bf16 (emulated):")
    assert kernel.arithmetic in kernel.source and "causal" in kernel.describe()
    monkeypatch.setenv(ENV_AMX, "off")
    fp32 = compile(chain)
    assert not isinstance(fp32, AmxKernel) and fp32.arithmetic.startswith("fp32-fma:")
    assert fp32.arithmetic in fp32.source


@pytest.mark.skipif(not amx_status()[0], reason=f"no AMX here: {amx_status()[1]}")
@pytest.mark.parametrize(("mask", "causal"), [(None, True), ("bool", False), ("additive", True)])
def test_amx_unit_matches_the_emulation_bit_for_bit_in_attention(
    mask: str | None, causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = _attention(2, 2, 70, 90, 80, 64, mask, causal)
    x = reference.random_inputs(chain, seed=13)
    args = [_torch(x[t.name]) for t in chain.inputs]
    emulated = _amx(chain, {"m": 32, "l": 64})(*args)
    monkeypatch.setenv(ENV_AMX, "auto")
    real = compile(chain, tiles={"m": 32, "l": 64})
    assert isinstance(real, AmxKernel) and real.amx_path is AmxPath.REAL
    assert torch.equal(real(*args).view(torch.int16), emulated.view(torch.int16))
