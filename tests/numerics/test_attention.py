"""Fused attention against the float64 reference and against PyTorch's SDPA in float64."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import compiler, reference
from chainfuse.bench import workloads
from chainfuse.codegen import schedule
from chainfuse.codegen.rows import rows_tail
from chainfuse.compiler import compile
from chainfuse.hardware import Hardware
from chainfuse.ir import DType
from chainfuse.kernels import MicroKernel, available
from tests.checks import check_against_reference

try:
    import torch as _TORCH
except ImportError:  # the float64 reference alone then
    _TORCH = None

SEQ = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129, 131, 257, 509, 599, 600]),
                st.integers(1, 600))  # fmt: skip
HEAD = st.one_of(st.sampled_from([1, 16, 40, 59, 64, 80, 96, 111, 160, 256]), st.integers(1, 256))
# input magnitudes: O(1), the range where rounded scores move the softmax (10-100), and huge
MAGNITUDE = st.sampled_from([1.0, 1.0, 3.0, 10.0, 31.6, 100.0, 1e3, 1e4])
TILES = st.sampled_from([None, {"m": 16, "l": 6, "k": 7, "n": 6}, {"m": 48, "l": 30}])
MASK = st.sampled_from([None, "bool", "additive"])


def _draw_test(examples: int):  # type: ignore[no-untyped-def]
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        b=st.integers(1, 2),
        h=st.integers(1, 2),
        sq=SEQ,
        sk=SEQ,
        dqk=HEAD,
        dv=HEAD,
        causal=st.booleans(),
        mask=MASK,
        broadcast=st.booleans(),
        tiles=TILES,
        magnitude=MAGNITUDE,
    )
    def check(
        b: int, h: int, sq: int, sk: int, dqk: int, dv: int, causal: bool, mask: str | None,
        broadcast: bool, tiles: dict[str, int] | None, magnitude: float,
    ) -> None:  # fmt: skip
        """Against the float64 reference and, where torch is installed, SDPA in float64; inputs
        up to 1e4 in magnitude (the tolerance's softmax term accounts for the rounded scores)."""
        _check_attention(b, h, sq, sk, dqk, dv, causal, mask, broadcast, tiles, magnitude)

    return check


test_attention_matches_reference = _draw_test(40)
test_attention_matches_reference_many = pytest.mark.slow(_draw_test(300))


def _check_attention(
    b: int, h: int, sq: int, sk: int, dqk: int, dv: int, causal: bool, mask: str | None,
    broadcast: bool, tiles: dict[str, int] | None, magnitude: float,
) -> None:  # fmt: skip
    shape = (1, sq, sk) if broadcast else None
    chain = chainfuse.attention_chain(b, h, sq, sk, dqk, dv, causal=causal, mask=mask,
                                      mask_shape=shape if mask else None)  # fmt: skip
    out, inputs = check_against_reference(compile(chain, tiles=tiles), chain, seed=sq * 7 + sk,
                                          scale=magnitude, softmax_term=True)  # fmt: skip
    assert np.isfinite(out).all()
    if _TORCH is None or (causal and mask is not None):  # SDPA takes one or the other
        return
    q, k, v = (_TORCH.from_numpy(inputs[n]).double() for n in ("Q", "K", "V"))
    m = None
    if mask is not None:
        m = _TORCH.from_numpy(inputs["mask"])
        m = m if mask == "bool" else m.double()
    theirs = _TORCH.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                               is_causal=causal)  # fmt: skip
    reference.assert_close(out, theirs.numpy(), chain, inputs=inputs)


ATTENTION_SHAPED = [w.name for w in workloads.GEMM if w.attention_shaped]


@pytest.mark.parametrize(
    "name",
    [n if n in ("bert-small", "vit-base-16") else pytest.param(n, marks=pytest.mark.slow)
     for n in ATTENTION_SHAPED],
)  # fmt: skip
def test_paper_workloads_as_attention(name: str) -> None:
    w = workloads.find(name)
    assert isinstance(w, workloads.GemmWorkload)
    chain = chainfuse.attention_chain(1, w.batch, w.M, w.L, w.K, w.N)
    check_against_reference(compile(chain), chain)


def test_fully_masked_rows_give_zeros_like_pytorch() -> None:
    torch = pytest.importorskip("torch")
    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool)
    mask[4] = False  # query 4 sees no key
    ours = cft.attention(q, k, v, attn_mask=mask)
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours[:, :, 4], torch.zeros_like(ours[:, :, 4]))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("queries", [3, 40])  # the row path, the tiled path
def test_masks_filled_with_the_lowest_float_behave_as_in_sdpa(queries: int) -> None:
    # PyTorch's own padding masks fill with torch.finfo(float32).min: a row masked that way
    # throughout has equal scores in SDPA, which weighs its keys alike (the mean of v), and a
    # row masked in part drops the masked keys; -1e9 and -inf fills as well (-inf throughout:
    # zeros, `test_fully_masked_rows_give_zeros_like_pytorch`)
    torch = pytest.importorskip("torch")
    import chainfuse.torch as cft

    F = torch.nn.functional
    g = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(2, 2, n, 24, generator=g) for n in (queries, 70, 70))
    low = torch.finfo(torch.float32).min
    mask = torch.randn(2, 1, queries, 70, generator=g)
    mask[0, :, 0] = low  # throughout
    mask[1, :, 0, 30:] = low  # in part
    mask[0, :, 1, ::2] = -1e9
    mask[1, :, 1, :60] = -torch.inf
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                          attn_mask=mask.double())  # fmt: skip
    got = cft.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0, :, 0], v[0].mean(-2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive", "scale", "3d"])
def test_torch_attention_matches_sdpa_in_float64(kind: str) -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(1)
    B, H, L, S, E, Ev = 2, 3, 65, 47, 40, 59
    q, k, v = torch.randn(B, H, L, E, generator=g), torch.randn(B, H, S, E, generator=g), \
        torch.randn(B, H, S, Ev, generator=g)  # fmt: skip
    kw: dict[str, object] = {}
    if kind == "causal":
        kw["is_causal"] = True
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(L, S, generator=g) > 0.3
    elif kind == "additive":
        kw["attn_mask"] = torch.randn(B, 1, L, S, generator=g)
    elif kind == "scale":
        kw["scale"] = 0.3
    elif kind == "3d":
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    ours = cft.attention(q, k, v, **kw)  # type: ignore[arg-type]
    kw64 = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in kw.items()}  # fmt: skip
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw64)  # type: ignore[arg-type]
    chain = chainfuse.attention_chain(B, H, L, S, E, Ev)
    reference.assert_close(ours.double().numpy(), theirs.numpy(), chain)


def test_no_keys_give_zeros_and_no_queries_an_empty_result_like_pytorch() -> None:
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 5, 8, generator=g)
    k, v = torch.randn(2, 3, 0, 8, generator=g), torch.randn(2, 3, 0, 6, generator=g)
    for kw in ({}, {"is_causal": True}, {"attn_mask": torch.ones(5, 0, dtype=torch.bool)}):
        ours = cft.attention(q, k, v, **kw)  # type: ignore[arg-type]
        theirs = F.scaled_dot_product_attention(q, k, v, **kw)  # type: ignore[arg-type]
        assert ours.shape == theirs.shape == (2, 3, 5, 6) and not ours.any()
    for shape_q, shape_kv in (((0, 3, 5, 8), (0, 3, 4, 8)), ((2, 3, 0, 8), (2, 3, 4, 8)),
                              ((2, 0, 5, 8), (2, 0, 4, 8))):  # fmt: skip
        q0, kv = torch.randn(shape_q, generator=g), torch.randn(shape_kv, generator=g)
        ours = cft.attention(q0, kv, kv)
        assert ours.shape == F.scaled_dot_product_attention(q0, kv, kv).shape
    flat = chainfuse.ops.attention(np.zeros((2, 5, 8), np.float32), np.zeros((2, 0, 8), np.float32),
                                   np.zeros((2, 0, 6), np.float32))  # fmt: skip
    assert isinstance(flat, np.ndarray) and flat.shape == (2, 5, 6) and not flat.any()
    with pytest.raises(ValueError, match=r"attn_mask: shape \(5, 3\) does not broadcast"):
        cft.attention(q, k, v, attn_mask=torch.ones(5, 3, dtype=torch.bool))
    empty = torch.zeros(1, 2, 0, 8, device="meta")
    with pytest.raises(ValueError, match="q: expected a CPU tensor, got device meta"):
        cft.attention(empty, empty, empty)


def test_large_magnitudes_stay_finite() -> None:
    chain = chainfuse.attention_chain(1, 1, 33, 65, 16, 8)
    inputs = reference.random_inputs(chain, scale=1e4)
    out = compile(chain)(inputs["Q"], inputs["K"], inputs["V"])
    assert np.isfinite(out).all()
    # with scores ~1e8 the softmax is one-hot: each output row is a row of V
    v_rows = inputs["V"][0, 0]
    for row in out[0, 0]:
        assert np.min(np.abs(v_rows - row).max(axis=1)) < 1e-3 * np.abs(v_rows).max()


def test_integer_shifts_give_way_to_exact_maxima_for_huge_scores() -> None:
    # the tiled softmax shifts a strip by its maxima rounded up to integers (cf_exp2_from) while
    # they stay below 2^21, else by the maxima themselves: one strip here starts with integer
    # shifts and switches when a tile of keys ~2e6 along u arrives (queries 0-9 point along u,
    # 10-19 against it, whose maxima stay small and exact through the switch); the other strip
    # (queries 16-19) keeps integer shifts and sees those keys only as huge negative scores
    rng = np.random.default_rng(23)
    chain = chainfuse.attention_chain(1, 1, 20, 64, 8, 8)
    u = np.zeros(8, np.float32)
    u[0] = 1.0
    q = rng.standard_normal((20, 8)).astype(np.float32) * 0.3
    q[:10, 0], q[10:, 0] = 1.0, -1.0
    k = rng.standard_normal((64, 8)).astype(np.float32)
    k[16:32] = (3e8 + 1e6 * np.arange(16, dtype=np.float32))[:, None] * u  # tile 1 of 4
    v = rng.standard_normal((64, 8)).astype(np.float32)
    inputs = {"Q": q[None, None], "K": k[None, None], "V": v[None, None]}
    want = reference.run(chain, inputs)["O"][0, 0]
    kernel = compile(chain, tiles={"m": 16, "l": 16})
    got = kernel(inputs["Q"], inputs["K"], inputs["V"])[0, 0]
    np.testing.assert_allclose(got[:10], np.broadcast_to(v[31], (10, 8)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[10:], want[10:], rtol=1e-5, atol=1e-6)
    # the same with the keys' order reversed: the huge tile first, then exact maxima throughout
    flip = {
        "Q": inputs["Q"],
        "K": inputs["K"][:, :, ::-1].copy(),
        "V": inputs["V"][:, :, ::-1].copy(),
    }
    got = kernel(flip["Q"], flip["K"], flip["V"])[0, 0]
    np.testing.assert_allclose(got[:10], np.broadcast_to(v[31], (10, 8)), rtol=0, atol=1e-6)
    np.testing.assert_allclose(got[10:], want[10:], rtol=1e-5, atol=1e-6)


def test_shifts_kept_while_maxima_rise_a_little_and_moved_when_they_rise_more() -> None:
    # the tiled softmax keeps a column's shift while its maximum stays within LAZY_SHIFT of it
    # (exponentials up to 2^8) and rescales Eᵀ only when some column's shift moves: scores
    # rising along the keys, per tile of 16 keys by ~0.1-50 in base 2 depending on the query,
    # keep the shift of some columns for several tiles and move others' every tile
    from chainfuse.codegen.softmax import LAZY_SHIFT

    rng = np.random.default_rng(5)
    chain = chainfuse.attention_chain(1, 1, 40, 96, 8, 8)
    q = (rng.standard_normal((40, 8)) * 0.05).astype(np.float32)
    q[:, 0] = np.geomspace(0.01, 4.0, 40, dtype=np.float32)
    k = (rng.standard_normal((96, 8)) * 0.05).astype(np.float32)
    k[:, 0] += np.arange(96, dtype=np.float32) * 1.5
    v = rng.standard_normal((96, 8)).astype(np.float32)
    rise = q[:, 0] * 1.5 * 16 * math.log2(math.e) / math.sqrt(8)  # per tile, base 2
    assert rise.min() < LAZY_SHIFT / 8 and rise.max() > 4 * LAZY_SHIFT
    inputs = {"Q": q[None, None], "K": k[None, None], "V": v[None, None]}
    want = reference.run(chain, inputs)["O"]
    for tiles in ({"m": 16, "l": 16}, {"m": 32, "l": 24}, None):
        got = compile(chain, tiles=tiles)(inputs["Q"], inputs["K"], inputs["V"])
        reference.assert_close(got, want, chain)
    # and the keys' order reversed: the largest scores first, no shift moves after the first
    flip = {
        "Q": inputs["Q"],
        "K": inputs["K"][:, :, ::-1].copy(),
        "V": inputs["V"][:, :, ::-1].copy(),
    }
    got = compile(chain, tiles={"m": 16, "l": 16})(flip["Q"], flip["K"], flip["V"])
    reference.assert_close(got, reference.run(chain, flip)["O"], chain)


def test_attention_argument_errors() -> None:
    torch = pytest.importorskip("torch")
    import chainfuse.torch as cft

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"attn_mask: expected dtype bool or torch.float32"):
        cft.attention(q, q, q, attn_mask=torch.ones(5, 5, dtype=torch.int32), is_causal=True)
    with pytest.raises(ValueError, match="k: expected head dim 8"):
        chainfuse.ops.attention(q, torch.randn(1, 2, 5, 7), q)
    with pytest.raises(ValueError, match="does not broadcast"):
        chainfuse.ops.attention(q, q, q, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(
        TypeError, match="q, k, v: expected all float32, all bfloat16 or all float16"
    ):
        chainfuse.ops.attention(q.double(), q, q)
    with pytest.raises(TypeError, match="scale: expected a real number or None"):
        chainfuse.ops.attention(q, q, q, scale=[0.5])


def test_ops_find_their_kernel_by_sizes_without_rebuilding_the_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # building and verifying a chain costs more than a short call's kernel: a second call with
    # the same sizes must not pay it (and must still compute the right thing)
    from chainfuse import builders, ops

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 9, 8), dtype=np.float32) for _ in range(3))
    A, B, D = (rng.standard_normal(s, dtype=np.float32) for s in ((2, 5, 7), (2, 7, 6), (2, 6, 3)))
    first = ops.attention(q, k, v, scale=0.25), ops.gemm_chain(A, B, D, "relu")
    built: list[str] = []
    for name in ("attention_chain", "gemm_chain"):
        real = getattr(builders, name)
        monkeypatch.setattr(
            builders, name, lambda *a, _r=real, _n=name, **kw: built.append(_n) or _r(*a, **kw)
        )
    again = ops.attention(q, k, v, scale=0.25), ops.gemm_chain(A, B, D, "relu")
    assert built == []
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, y)
    ops.attention(q, k, v, scale=0.5)  # other arguments: a chain of their own
    assert built == ["attention_chain"]  # (for 16 keys: 9's bucket, see `key_bucket`)


def test_a_repeat_call_rechecks_what_its_key_does_not_fix() -> None:
    # a call with an earlier call's operand kinds, shapes, strides and dtypes (and its other
    # arguments and thread count) runs from what the earlier checks found (`ops.calls.replays`): new
    # data at new addresses must be read, and whatever the key leaves out must still be refused
    torch = pytest.importorskip("torch")
    from chainfuse import ops

    g = torch.Generator().manual_seed(11)

    def sdpa(q: object, k: object, v: object, attn_mask: object = None, **kw: object) -> object:
        d = [x.double() for x in (q, k, v)]  # type: ignore[attr-defined]
        if attn_mask is not None and attn_mask.dtype != torch.bool:  # type: ignore[attr-defined]
            attn_mask = attn_mask.double()  # type: ignore[attr-defined]
        out = torch.nn.functional.scaled_dot_product_attention(*d, attn_mask=attn_mask, **kw)
        return out.float()

    def new(*shape: int) -> object:
        return torch.randn(*shape, generator=g)

    k, v = new(2, 3, 9, 8), new(2, 3, 9, 8)
    for q in (new(2, 3, 9, 8), new(2, 3, 9, 8), new(2, 9, 3, 8).transpose(1, 2),
              new(2, 3, 11, 8)[:, :, 2:], new(2, 3, 9, 8)):  # fmt: skip
        for causal in (False, True):
            torch.testing.assert_close(ops.attention(q, k, v, is_causal=causal),
                                       sdpa(q, k, v, is_causal=causal))  # fmt: skip
    assert len({key for key in ops.calls.replays if key[0] == "attention"}) >= 6
    # masks: a bool then a float mask of one shape, then a broadcast one with other strides
    q = new(2, 3, 9, 8)
    for mask in (new(9, 9) > 0, new(9, 9), new(2, 1, 9, 9), new(2, 1, 9, 9)[:, :, :, :]):
        for _ in range(2):
            torch.testing.assert_close(ops.attention(q, k, v, mask), sdpa(q, k, v, attn_mask=mask))
    # grad, device, kind: what a repeat call must still check
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="q: requires grad"):
        ops.attention(q, k, v)
    q.requires_grad_(False)
    with pytest.raises(ValueError, match="q: expected a CPU tensor, got device meta"):
        ops.attention(q.to("meta"), k, v)
    for _ in range(2):  # kinds mixed: the checked path each time
        torch.testing.assert_close(ops.attention(q, k.numpy(), v), sdpa(q, k, v))
    numpy_out = ops.attention(q.numpy(), k.numpy(), v.numpy())
    assert isinstance(numpy_out, np.ndarray)
    np.testing.assert_array_equal(numpy_out, ops.attention(q, k, v).numpy())
    # another thread count is another key, and the kernel runs with it
    chainfuse.set_num_threads(1)
    try:
        torch.testing.assert_close(ops.attention(q, k, v), sdpa(q, k, v))
        assert any(key[4] == 1 for key in ops.calls.replays if key[0] == "attention")
    finally:
        chainfuse.set_num_threads(None)
    # an output array: written in place again, and refused once it is read-only
    rng = np.random.default_rng(2)
    A, B, D = (rng.standard_normal(s, dtype=np.float32) for s in ((2, 5, 7), (2, 7, 6), (2, 6, 3)))
    E = np.empty((2, 5, 3), np.float32)
    want = np.maximum(A @ B, 0) @ D
    for _ in range(2):
        E[...] = np.nan
        assert ops.gemm_chain(A, B, D, "relu", out=E) is E
        np.testing.assert_allclose(E, want, rtol=1e-5, atol=1e-5)
    E.flags.writeable = False
    with pytest.raises(ValueError, match="out: the output array is read-only"):
        ops.gemm_chain(A, B, D, "relu", out=E)
    B2 = rng.standard_normal((2, 7, 6), dtype=np.float32)  # new data, same key: read anew
    np.testing.assert_allclose(ops.gemm_chain(A, B2, D, "relu"), np.maximum(A @ B2, 0) @ D,
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    ops.calls.clear()  # and a cleared memory is only slower
    np.testing.assert_allclose(ops.gemm_chain(A, B2, D, "relu"), np.maximum(A @ B2, 0) @ D,
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_key_lengths_share_a_kernel_per_bucket_and_stay_right() -> None:
    # a decoder's key length is new every step: ops plans a bucket of lengths once
    # (`key_bucket`) and runs each length with the bucket's kernel (`bind`'s keys)
    torch = pytest.importorskip("torch")
    from chainfuse import ops
    from chainfuse.ops.calls import bucketed, key_bucket

    assert [key_bucket(n) for n in (1, 8, 9, 17, 64, 65, 600, 640, 641, 1025)] == [
        8, 8, 16, 24, 64, 72, 640, 640, 704, 1152,
    ]  # fmt: skip
    assert all(key_bucket(key_bucket(n)) == key_bucket(n) for n in range(1, 5000))
    assert all(n <= key_bucket(n) <= max(n + 7, n * 1.125) for n in range(1, 5000))
    g = torch.Generator().manual_seed(13)
    F = torch.nn.functional
    keys = torch.randn(2, 3, 300, 24, generator=g)
    values = torch.randn(2, 3, 300, 40, generator=g)
    ops.calls.clear()
    lengths = (*range(57, 75), 128, 129, 299, 300)  # buckets 64, 72, 80, 128, 144, 304
    for sq in (1, 3, 40):
        q = torch.randn(2, 3, sq, 24, generator=g)
        for sk in lengths:
            k, v = keys[:, :, :sk], values[:, :, :sk]
            mask = torch.randn(2, 1, sq, sk, generator=g)
            for kw in ({}, {"is_causal": True}, {"attn_mask": mask}, {"attn_mask": mask > 0}):
                want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **{
                    n: (x.double() if x.is_floating_point() else x) if n == "attn_mask" else x
                    for n, x in kw.items()
                })  # fmt: skip
                for _ in range(2):  # the checked call, then its replay
                    got = ops.attention(q, k, v, **kw)  # type: ignore[arg-type]
                    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    # one kernel per (queries, kind, bucket): 3 x 4 x 6, not one per length (3 x 4 x 22)
    assert ops.calls.info()["attention_kernels"].size == 3 * 4 * 6
    # the kernel of a bucket still runs its own length, and checks a call's against it
    kernel, keys_of = bucketed((2, 3, 40, 70, 24, 40), False, None, None, None, "float32", 1)
    assert kernel.chain.extents["l"] == 72 and keys_of == 70
    q = torch.randn(2, 3, 40, 24, generator=g)
    with pytest.raises(ValueError, match=r"K: expected shape \(2, 3, 70, 24\)"):
        kernel.bind((q, keys[:, :, :71], values[:, :, :70]), None, 70)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_a_new_key_length_in_a_known_bucket_skips_all_but_the_key_checks(kind: str) -> None:
    # a decoding step has one key more than the last, in views of a cache (strides that stay)
    # or in new tensors (strides that grow): after the first length of a bucket, the others
    # run from `ops.calls.by_keys`, with k, v and the mask checked and their strides read anew;
    # each is then remembered whole (`ops.calls.replays`), so that the same step's call in the next
    # layer (other data, the same shapes and strides) checks nothing
    torch = pytest.importorskip("torch")
    from chainfuse import ops

    F = torch.nn.functional
    g = torch.Generator().manual_seed(17)
    calls = ops.calls
    lift = (lambda t: t.numpy()) if kind == "numpy" else (lambda t: t)
    cache_k = torch.randn(2, 4, 90, 16, generator=g)
    cache_v = torch.randn(2, 4, 90, 24, generator=g)
    other_k, other_v = torch.randn_like(cache_k), torch.randn_like(cache_v)  # same strides
    pad = torch.randn(2, 1, 1, 90, generator=g)
    for sq, heads_kv, gqa in ((1, 4, False), (3, 4, False), (1, 2, True)):
        q = torch.randn(2, 4, sq, 16, generator=g)
        for fresh in (False, True):
            for mask_kind in (None, "additive", "bool", "causal"):
                calls.clear()
                # one bucket (72), then a length of it again on other data (same strides)
                for n, (ck, cv) in [*((n, (cache_k, cache_v)) for n in range(65, 73)),
                                    (71, (other_k, other_v))]:  # fmt: skip
                    ck, cv = ck[:, :heads_kv], cv[:, :heads_kv]
                    k, v = ck[:, :, :n], cv[:, :, :n]
                    if fresh:
                        k, v = k.contiguous(), v.contiguous()
                    kw: dict[str, object] = {}
                    want_kw: dict[str, object] = {}
                    if mask_kind in ("additive", "bool"):
                        m = pad[..., :n].contiguous()
                        m = m > 0 if mask_kind == "bool" else m
                        kw["attn_mask"] = lift(m)
                        want_kw["attn_mask"] = m if mask_kind == "bool" else m.double()
                    if mask_kind == "causal":
                        kw["is_causal"] = want_kw["is_causal"] = True
                    if gqa and mask_kind == "causal":
                        continue  # (per-group calls: no key is kept for them)
                    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                          enable_gqa=gqa, **want_kw)  # type: ignore[arg-type]  # fmt: skip
                    got = ops.attention(lift(q), lift(k), lift(v), enable_gqa=gqa, **kw)  # type: ignore[arg-type]
                    torch.testing.assert_close(torch.as_tensor(got).double(), want,
                                               rtol=1e-4, atol=1e-5)  # fmt: skip
                if not (gqa and mask_kind == "causal"):
                    # checked whole: the first length only (no bucket known); k, v and the mask
                    # rechecked: each new length, not the repeat on new data (a replay)
                    by_keys, replays = calls.info()["by_keys"], calls.info()["replays"]
                    assert by_keys.misses == 1, (sq, gqa, fresh, mask_kind)
                    assert by_keys.hits == 7 and replays.hits == 1
                    assert replays.size == 8 and by_keys.size == 1
                    # that length once more, k with other strides: checked again
                    wide = torch.randn(2, heads_kv, 71, 40, generator=g)[..., :16]
                    want = F.scaled_dot_product_attention(q.double(), wide.double(), v.double(),
                                                          enable_gqa=gqa, **want_kw)  # type: ignore[arg-type]  # fmt: skip
                    got = ops.attention(lift(q), lift(wide), lift(v), enable_gqa=gqa, **kw)  # type: ignore[arg-type]
                    torch.testing.assert_close(torch.as_tensor(got).double(), want,
                                               rtol=1e-4, atol=1e-5)  # fmt: skip
                    by_keys, replays = calls.info()["by_keys"], calls.info()["replays"]
                    assert by_keys.hits == 8 and by_keys.misses == 1
                    assert replays.size == 9 and by_keys.size == 1
    # what the key leaves out is still checked, and refused by the caller's names
    q = lift(torch.randn(2, 4, 1, 16, generator=g))
    ops.attention(q, lift(cache_k[:, :, :70]), lift(cache_v[:, :, :70]))
    with pytest.raises(ValueError, match=r"v: expected 71 keys \(k's\), got 70"):
        ops.attention(q, lift(cache_k[:, :, :71]), lift(cache_v[:, :, :70]))
    m = lift(pad[..., :70].contiguous())
    ops.attention(q, lift(cache_k[:, :, :70]), lift(cache_v[:, :, :70]), m)
    with pytest.raises(ValueError, match=r"attn_mask: shape \(2, 1, 1, 70\) does not broadcast"):
        ops.attention(q, lift(cache_k[:, :, :71]), lift(cache_v[:, :, :71]), m)
    inner = torch.randn(2, 4, 16, 90, generator=g).transpose(2, 3)  # the head dim not contiguous
    with pytest.raises(ValueError, match="last dimension must be contiguous"):
        ops.attention(q, lift(inner[:, :, :71]), lift(cache_v[:, :, :71]))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "dv-differs", "requires-grad"])
def test_torch_outputs_are_new_contiguous_tensors(layout: str) -> None:
    # the output is allocated like q when q has its shape and layout, else from scratch: either
    # way a new, contiguous float32 tensor that does not require grad
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(5)
    B, H, L, E = 2, 3, 19, 8
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
    if layout == "transposed":  # [B, L, H, E] memory seen as [B, H, L, E], as attention layers do
        q, k, v = (torch.randn(B, L, H, E, generator=g).transpose(1, 2) for _ in range(3))
    elif layout == "dv-differs":
        v = torch.randn(B, H, L, E + 3, generator=g)
    elif layout == "requires-grad":
        q.requires_grad_(True)
    with torch.no_grad():
        ours = chainfuse.ops.attention(q, k, v)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float32
    assert ours.shape == (B, H, L, v.shape[-1]) and ours.is_contiguous()
    assert not ours.requires_grad and ours.data_ptr() not in {x.data_ptr() for x in (q, k, v)}
    chain = chainfuse.attention_chain(B, H, L, L, E, v.shape[-1])
    want = reference.run(chain, {"Q": q.detach().numpy(), "K": k.numpy(), "V": v.numpy()})
    reference.assert_close(ours.numpy(), want["O"], chain)


@pytest.mark.parametrize(("M", "threads"), [(768, 2), (1024, 2), (300, 3)])
def test_row_blocks_keep_every_core_busy(M: int, threads: int) -> None:
    # one head of M queries: the cores share the kernel's blocks of rows (the plan's outermost
    # m tile), and a tail block holds fewer rows. Blocks of 512 of 768 rows on 2 cores leave one core a third idle
    # (Mixer-B's token mixing: 0.81 ms at 2 threads that way, 0.48 ms predicted); the model
    # weighs blocks by their rows, so the plan must not pick such a split
    chain = chainfuse.attention_chain(1, 1, M, 384, 64, 64)
    kernel = compile(chain, threads=threads)
    outer = kernel.plan.tiles_at(kernel.plan.levels[-1])  # the kernel's parallel blocks
    assert outer is not None
    tm = max(outer["m"], kernel.spec.T_M)
    rows = [min(tm, M - i) for i in range(0, M, tm)]  # dealt as the kernel deals them
    share = -(-len(rows) // threads)
    busiest = max(sum(rows[w * share : (w + 1) * share]) for w in range(threads))
    # m comes in multiples of the micro-kernel's nr columns: 300 rows on 3 cores cannot beat
    # 112 + 112 + 76 in columns of 16, nor 128 + 128 + 44 in columns of 64
    nr = kernel.spec.kernel.nr
    strips = math.ceil(M / nr)
    best = math.ceil(strips / threads) * nr
    assert busiest * threads / M <= max(1.15, best * threads / M), (kernel.spec, rows)
    x = reference.random_inputs(chain)
    chainfuse.set_num_threads(threads)
    try:
        out = kernel(x["Q"], x["K"], x["V"])
    finally:
        chainfuse.set_num_threads(None)
    reference.assert_close(out, reference.run(chain, x)["O"], chain)


GQA_KINDS = ["none", "causal", "bool", "per-head", "heads-broadcast", "transposed", "numpy", "3d",
             "one-query", "one-query-padding", "one-query-additive", "one-query-per-head"]  # fmt: skip


@pytest.mark.parametrize("kind", GQA_KINDS)
def test_grouped_query_attention_matches_sdpa_in_float64(kind: str) -> None:
    # k and v with 2 heads serve q's 6 (groups of 3): one merged call without a mask, one call
    # per group member on strided views otherwise; PyTorch's enable_gqa is the reference
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(7)
    B, H, Hkv, L, S, E, Ev = 2, 6, 2, 33, 29, 17, 24
    if kind.startswith("one-query"):
        L = 1
    q = torch.randn(B, H, L, E, generator=g)
    k, v = torch.randn(B, Hkv, S, E, generator=g), torch.randn(B, Hkv, S, Ev, generator=g)
    kw: dict[str, object] = {}
    if kind == "causal":
        kw["is_causal"] = True
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(L, S, generator=g) > 0.3
    elif kind == "per-head":  # a different mask for each of q's heads
        kw["attn_mask"] = torch.randn(B, H, L, S, generator=g)
    elif kind == "heads-broadcast":
        kw["attn_mask"] = torch.randn(H, 1, S, generator=g)
    elif kind == "transposed":  # q's heads not one after the other: the per-member calls
        q = torch.randn(B, L, H, E, generator=g).transpose(1, 2)
    elif kind == "3d":  # dim -3 is the batch, grouped as PyTorch groups it
        q, k, v = q[0], k[0], v[0]
    elif kind == "one-query-padding":  # a decoding step's padding mask: one merged call
        kw["attn_mask"] = (
            torch.arange(S)[None, None, None, :] < torch.tensor([S - 5, S])[:, None, None, None]
        )
    elif kind == "one-query-additive":
        kw["attn_mask"] = torch.randn(1, S, generator=g)
    elif kind == "one-query-per-head":  # a mask per q head: one call per group member
        kw["attn_mask"] = torch.randn(1, H, 1, S, generator=g)
    kw64 = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in kw.items()}  # fmt: skip
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True,
                                            **kw64)  # type: ignore[arg-type]  # fmt: skip
    if kind == "numpy":
        ours = chainfuse.ops.attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=True)
        assert isinstance(ours, np.ndarray)
    else:
        ours = cft.attention(q, k, v, enable_gqa=True, **kw).numpy()  # type: ignore[arg-type]
    assert ours.shape == tuple(theirs.shape)
    chain = chainfuse.attention_chain(B, H, L, S, E, Ev)
    reference.assert_close(ours.astype(np.float64), theirs.numpy(), chain)


@pytest.mark.parametrize("mask", [None, "causal", "per-head", "shared", "causal+padding"])
def test_one_prefill_of_grouped_query_attention_is_one_remembered_call(mask: str | None) -> None:
    """A batch of one (a prefill) with GQA, q's heads strided as a model's transpose leaves
    them: one kernel call for all groups, remembered, so a second call on new data of the same
    layout is a replay; then more keys than queries (a chunk of a prompt against a longer
    cache), key lengths of one bucket; each within the tolerance of SDPA in float64."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    from chainfuse import ops

    g = torch.Generator().manual_seed(3)
    H, Hkv, L, E = 6, 2, 37, 24

    def check(keys: int) -> None:
        q = torch.randn(1, L, H, E, generator=g).transpose(1, 2)
        k, v = (torch.randn(1, keys, Hkv, E, generator=g).transpose(1, 2) for _ in range(2))
        kw: dict[str, object] = {"is_causal": mask is not None and mask.startswith("causal")}
        if mask == "per-head":
            kw["attn_mask"] = torch.randn(1, H, L, keys, generator=g)
        elif mask in ("shared", "causal+padding"):
            kw["attn_mask"] = torch.rand(L, keys, generator=g) > 0.2
        ours = ops.attention(q, k, v, enable_gqa=True, **kw)  # type: ignore[arg-type]
        kw64 = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
                for n, x in kw.items()}  # fmt: skip
        theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                enable_gqa=True, **kw64)  # type: ignore[arg-type]  # fmt: skip
        chain = chainfuse.attention_chain(1, H, L, keys, E, E)
        reference.assert_close(ours.double().numpy(), theirs.numpy(), chain)

    ops.calls.clear()
    check(L)
    check(L)
    assert ops.calls.info()["replays"].hits == 1
    for keys in range(L + 1, L + 4):
        check(keys)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kv_heads=st.integers(1, 3), group=st.integers(1, 4), sq=SEQ, sk=SEQ,
    dqk=st.sampled_from([1, 7, 40, 59, 65]), dv=st.sampled_from([1, 16, 111]),
    causal=st.booleans(), mask=MASK, per_head=st.booleans(),
)  # fmt: skip
def test_grouped_query_attention_matches_reference(
    kv_heads: int, group: int, sq: int, sk: int, dqk: int, dv: int, causal: bool,
    mask: str | None, per_head: bool,
) -> None:  # fmt: skip
    # numpy operands against the float64 reference with k and v repeated per group, as the
    # grouping means: query head h reads key head h // group
    heads = kv_heads * group
    mask_shape = (1, heads if per_head else 1, sq, sk)
    chain = chainfuse.attention_chain(1, heads, sq, sk, dqk, dv, causal=causal, mask=mask,
                                      mask_shape=mask_shape if mask else None)  # fmt: skip
    inputs = reference.random_inputs(chain, seed=sq * 31 + sk + heads, scale=3.0)
    k, v = inputs["K"][:, ::group], inputs["V"][:, ::group]
    inputs["K"], inputs["V"] = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    ours = chainfuse.ops.attention(inputs["Q"], k, v, attn_mask=inputs.get("mask"),
                                   is_causal=causal, enable_gqa=True)  # fmt: skip
    reference.assert_close(ours, reference.run(chain, inputs)["O"], chain, inputs=inputs)


def _ours_and_sdpa64(q: Any, k: Any, v: Any, kw: dict[str, object], numpy: bool) -> Any:
    """chainfuse's attention on torch tensors q, k, v (on their numpy arrays when `numpy`, of kw
    then only enable_gqa), and PyTorch's SDPA on them and kw's float tensors in float64: both
    float64 arrays of one shape."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    kw64 = {n: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for n, x in kw.items()}  # fmt: skip
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                            **kw64)  # type: ignore[arg-type]  # fmt: skip
    gqa = bool(kw.get("enable_gqa", False))
    if numpy:
        ours = chainfuse.ops.attention(q.numpy(), k.numpy(), v.numpy(), enable_gqa=gqa)
        assert isinstance(ours, np.ndarray)
    else:
        ours = cft.attention(q, k, v, **kw).numpy()  # type: ignore[arg-type]
    assert ours.shape == tuple(theirs.shape)  # (and the shape a compiler is given: the same)
    assert chainfuse.ops.attention_shape(q.shape, k.shape, v.shape, gqa) == ours.shape
    return ours.astype(np.float64), theirs.numpy()


BROADCASTS = {  # q, k, v shapes (batch and heads of 1 stretch, as PyTorch broadcasts them)
    "kv-batch": ((3, 4, 33, 17), (1, 4, 29, 17), (1, 4, 29, 24)),
    "q-batch": ((1, 4, 33, 17), (3, 4, 29, 17), (3, 4, 29, 24)),
    "k-batch-only": ((3, 4, 33, 17), (1, 4, 29, 17), (3, 4, 29, 24)),
    "kv-heads": ((2, 4, 33, 17), (2, 1, 29, 17), (2, 1, 29, 24)),
    "q-heads": ((2, 1, 33, 17), (2, 4, 29, 17), (2, 4, 29, 24)),
    "k-heads-only": ((2, 4, 33, 17), (2, 1, 29, 17), (2, 4, 29, 24)),
    "both": ((1, 4, 33, 17), (3, 1, 29, 17), (1, 1, 29, 24)),
    "decoding": ((3, 4, 1, 17), (1, 4, 29, 17), (1, 4, 29, 24)),
    "3d": ((3, 33, 17), (1, 29, 17), (1, 29, 24)),
}


@pytest.mark.parametrize("kind", [*BROADCASTS, "mask", "causal", "gqa", "numpy"])
def test_batch_and_heads_broadcast_as_sdpa_broadcasts_them(kind: str) -> None:
    # q, k and v whose batch or heads are 1 where the others' are not: PyTorch's SDPA
    # broadcasts them (a model may pass one k, v for a batch of queries); read in place
    # (stride 0), checked against SDPA in float64, a repeat call (its replay) too
    torch = pytest.importorskip("torch")

    g = torch.Generator().manual_seed(11)
    sq, sk, sv = BROADCASTS.get(kind, BROADCASTS["kv-batch"])
    kw: dict[str, object] = {}
    if kind == "mask":
        kw["attn_mask"] = torch.randn(3, 1, 33, 29, generator=g)
    elif kind == "causal":
        kw["is_causal"] = True
    elif kind == "gqa":  # k and v: one batch, 2 heads grouping q's 4
        sk, sv = (1, 2, 29, 17), (1, 2, 29, 24)
        kw["enable_gqa"] = True
    for _ in range(2):
        q, k, v = (torch.randn(*s, generator=g) for s in (sq, sk, sv))
        ours, theirs = _ours_and_sdpa64(q, k, v, kw, kind == "numpy")
        dims = theirs.shape if theirs.ndim == 4 else (theirs.shape[0], 1, *theirs.shape[1:])
        chain = chainfuse.attention_chain(dims[0], dims[1], dims[2], k.shape[-2], q.shape[-1],
                                          dims[3])  # fmt: skip
        reference.assert_close(ours, theirs, chain)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batches=st.tuples(*[st.sampled_from([1, 2, 3])] * 3),
    heads=st.tuples(*[st.sampled_from([1, 2, 4])] * 3), gqa=st.booleans(),
)  # fmt: skip
def test_every_broadcast_sdpa_runs_runs_here_alike(
    batches: tuple[int, int, int], heads: tuple[int, int, int], gqa: bool
) -> None:
    # batch sizes and head counts of q, k, v drawn from 1, 2, 3 / 1, 2, 4: where SDPA (float64)
    # gives a result, ours is the same; where it refuses, so do we, by a ValueError (GQA with
    # k and v of different head counts included: each grouped on its own, as PyTorch does)
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(sum(batches) * 7 + sum(heads))
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64)
               for b, h, n, d in zip(batches, heads, (5, 7, 7), (8, 8, 6), strict=True))  # fmt: skip
    try:
        theirs = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    except RuntimeError:
        theirs = None
    if theirs is None:
        with pytest.raises(ValueError):
            cft.attention(q.float(), k.float(), v.float(), enable_gqa=gqa)
        return
    ours = cft.attention(q.float(), k.float(), v.float(), enable_gqa=gqa)
    assert ours.shape == theirs.shape
    assert chainfuse.ops.attention_shape(q.shape, k.shape, v.shape, gqa) == tuple(ours.shape)
    b, h = theirs.shape[:2]
    reference.assert_close(ours.double().numpy(), theirs.numpy(),
                           chainfuse.attention_chain(b, h, 5, 7, 8, 6))  # fmt: skip


@pytest.mark.parametrize("mask", ["additive", "bool", "first-key-masked", "numpy"])
@pytest.mark.parametrize("seqs", [(33, 29), (29, 33), (1, 29)])
def test_a_mask_and_is_causal_together_apply_both_as_sdpa_does(
    mask: str, seqs: tuple[int, int]
) -> None:
    # PyTorch's fused CPU SDPA takes both and applies both (a query whose keys both leave out
    # gets zeros, as with either alone; its math path, taken when v's head dim differs from
    # q's, refuses the pair, so v's is 17 here too); chainfuse.torch refused the pair before
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(23)
    sq, sk = seqs
    if mask in ("additive", "numpy"):
        m = torch.randn(2, 1, sq, sk, generator=g)
    elif mask == "bool":
        m = torch.rand(sq, sk, generator=g) > 0.3
    else:  # every query's first key masked: the first query has no key left
        m = torch.ones(sq, sk, dtype=torch.bool)
        m[:, 0] = False
    q, k, v = (torch.randn(2, 3, n, 17, generator=g) for n in (sq, sk, sk))
    if mask == "numpy":
        import torch.nn.functional as F

        theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                attn_mask=m.double(), is_causal=True).numpy()  # fmt: skip
        ours = chainfuse.ops.attention(q.numpy(), k.numpy(), v.numpy(), m.numpy(), True)
    else:
        ours, theirs = _ours_and_sdpa64(q, k, v, {"attn_mask": m, "is_causal": True}, False)
    reference.assert_close(ours, theirs, chainfuse.attention_chain(2, 3, sq, sk, 17, 17))


@pytest.mark.parametrize("kind", ["expanded-keys", "every-other", "numpy-broadcast", "bool-expanded",
                                  "scalar", "scalar-bool", "keys-1d", "patch"])  # fmt: skip
def test_masks_of_any_strides_and_fewer_dims_broadcast(kind: str) -> None:
    # a mask is read element by element, by its strides: one expanded along the keys (stride 0)
    # or sliced runs in place (it was "its last dimension must be contiguous"); a 0-D or 1-D
    # mask broadcasts as [1, 1] / [1, seq_k] (SDPA refuses both: compared with its 2-D form;
    # a 0-D one was an IndexError)
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(29)
    q, k, v = (torch.randn(2, 3, n, 16, generator=g) for n in (21, 19, 19))
    base = torch.randn(21, 38, generator=g)
    mask = {
        "expanded-keys": base[:, :1].expand(21, 19), "every-other": base[:, ::2],
        "bool-expanded": (base[:1, :19] > 0).expand(21, 19), "scalar": torch.tensor(0.7),
        "scalar-bool": torch.tensor(True), "keys-1d": base[0, :19], "patch": base[:, ::2],
    }.get(kind)  # fmt: skip
    if kind == "numpy-broadcast":
        m = np.broadcast_to(base[:1, :19].numpy(), (2, 3, 21, 19))
        ours = chainfuse.ops.attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=m)
        full = torch.from_numpy(np.ascontiguousarray(m))
    else:
        assert mask is not None
        if kind == "patch":
            with cft.patch_sdpa(strict=True) as patch, torch.no_grad():
                ours = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).numpy()
            assert patch.calls == 1
        else:
            ours = cft.attention(q, k, v, attn_mask=mask).numpy()
        full = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape)).expand(21, 19) \
            if mask.dim() < 2 else mask  # fmt: skip
    full = full if full.dtype == torch.bool else full.double()
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=full)
    reference.assert_close(ours, theirs.numpy(), chainfuse.attention_chain(2, 3, 21, 19, 16, 16))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["additive", "bool", "bool-all-masked-key"])
@pytest.mark.parametrize("shape", [(2, 1, 1, 29), (1, 29), (2, 3, 1, 29)])
def test_key_padding_masks_the_same_for_every_query(
    shape: tuple[int, ...], kind: str, causal: bool
) -> None:
    # a mask that does not vary over the queries (stride 0 along them) is read once a row of
    # keys: against SDPA in float64, alone and with is_causal (queries 1..33 > keys' block)
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(2, 3, n, 17, generator=g) for n in (33, 29, 29))
    mask = torch.randn(*shape, generator=g)
    if kind != "additive":
        mask = mask > 0.2
        if kind == "bool-all-masked-key":
            mask[..., :5] = False
    kw: dict[str, object] = {"attn_mask": mask, "is_causal": causal}
    ours, theirs = _ours_and_sdpa64(q, k, v, kw, False)
    reference.assert_close(ours, theirs, chainfuse.attention_chain(2, 3, 33, 29, 17, 17))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize("shape", [(37, 29), (2, 3, 37, 29), (1, 3, 37, 29)])
@pytest.mark.parametrize("sizes", [(37, 29), (70, 150)])
def test_masks_over_queries_and_keys_applied_block_by_block(
    shape: tuple[int, ...], sizes: tuple[int, int], kind: str, causal: bool
) -> None:
    # a mask along contiguous keys is applied to a whole strip of scores 8x8 blocks at a time,
    # transposed in registers (a boolean one as 0 / -inf; a tail strip of queries and tail rows
    # of keys one by one): against SDPA in float64, with is_causal too, float masks of large
    # magnitude and boolean ones masking every key of some queries included
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(37)
    sq, sk = sizes
    q, k, v = (torch.randn(2, 3, n, 17, generator=g) for n in (sq, sk, sk))
    mask = torch.randn(*shape[:-2], sq, sk, generator=g) * 4
    mask[..., ::7] = -1e30
    if kind == "bool":
        mask = mask > -1.0
        mask[..., 3, :] = False
    kw: dict[str, object] = {"attn_mask": mask, "is_causal": causal}
    ours, theirs = _ours_and_sdpa64(q, k, v, kw, False)
    reference.assert_close(ours, theirs, chainfuse.attention_chain(2, 3, sq, sk, 17, 17))


GQA_APART = {  # q, k, v shapes with enable_gqa: k and v of different head counts
    "k-fewer": ((2, 8, 33, 17), (2, 2, 29, 17), (2, 4, 29, 24)),
    "v-fewer": ((2, 8, 33, 17), (2, 4, 29, 17), (2, 2, 29, 24)),
    "coprime": ((2, 6, 33, 17), (2, 2, 29, 17), (2, 3, 29, 24)),
    "stretched-batch": ((3, 8, 33, 17), (1, 2, 29, 17), (3, 4, 29, 24)),
    "decode": ((2, 8, 1, 17), (2, 2, 29, 17), (2, 4, 29, 24)),
    "3d": ((8, 33, 17), (8, 29, 17), (4, 29, 24)),
    "3d-both": ((8, 33, 17), (2, 29, 17), (4, 29, 24)),
    "5d": ((2, 1, 8, 33, 17), (2, 1, 2, 29, 17), (1, 1, 4, 29, 24)),
}


@pytest.mark.parametrize("kind", [*GQA_APART, "mask", "bool-mask", "causal", "numpy"])
def test_gqa_with_k_and_v_heads_apart_as_sdpa_groups_them(kind: str) -> None:
    # PyTorch repeats k's heads and v's each to q's on its own: the same results, a repeat
    # call (no replay of the repeated copies is recorded) and the shape function's answer too
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(19)
    sq, sk, sv = GQA_APART.get(kind, GQA_APART["k-fewer"])
    kw: dict[str, object] = {"enable_gqa": True}
    if kind == "mask":
        kw["attn_mask"] = torch.randn(2, 8, 33, 29, generator=g)
    elif kind == "bool-mask":
        kw["attn_mask"] = torch.rand(1, 8, 1, 29, generator=g) > 0.3
    elif kind == "causal":
        kw["is_causal"] = True
    for _ in range(2):
        q, k, v = (torch.randn(*s, generator=g) for s in (sq, sk, sv))
        ours, theirs = _ours_and_sdpa64(q, k, v, kw, kind == "numpy")
        batch = int(np.prod(theirs.shape[:-3]))  # (1 for 3-D)
        chain = chainfuse.attention_chain(batch, theirs.shape[-3], theirs.shape[-2], 29, 17, 24)
        reference.assert_close(ours, theirs, chain)


def test_gqa_heads_that_do_not_divide_qs_are_named() -> None:
    q = np.zeros((1, 6, 5, 8), np.float32)
    k, v = np.zeros((1, 2, 7, 8), np.float32), np.zeros((1, 4, 7, 8), np.float32)
    with pytest.raises(
        ValueError, match=r"k, v: expected head counts that divide q's 6, got 2 and 4"
    ):
        chainfuse.ops.attention(q, k, v, enable_gqa=True)
    with pytest.raises(ValueError, match=r"k, v: expected head counts that divide q's 6"):
        chainfuse.ops.attention_shape(q.shape, k.shape, v.shape, True)
    with pytest.raises(ValueError, match=r"k, v: head counts 2 and 4 differ"):  # (no GQA)
        chainfuse.ops.attention(np.zeros((1, 8, 5, 8), np.float32), k, v)


MORE_DIMS = {  # q, k, v shapes of 5-D and up: [*batch, heads, seq, dim]
    "5d": ((2, 3, 4, 33, 17), (2, 3, 4, 29, 17), (2, 3, 4, 29, 24)),
    "6d": ((2, 1, 3, 2, 33, 17), (2, 1, 3, 2, 29, 17), (2, 1, 3, 2, 29, 24)),
    "merged-stretch": ((2, 3, 4, 33, 17), (1, 1, 4, 29, 17), (1, 1, 4, 29, 24)),
    "per-index": ((2, 3, 4, 33, 17), (1, 3, 4, 29, 17), (1, 3, 4, 29, 24)),
}


@pytest.mark.parametrize("kind", [*MORE_DIMS, "mask", "causal", "gqa", "permuted", "numpy"])
def test_more_batch_dims_as_sdpa_takes_them(kind: str) -> None:
    # SDPA's (N, ..., H, L, E): the batch dims broadcast and merge into one where the strides
    # allow (one call), else one call per index of all but the last ("per-index": k's first
    # dim stretched ahead of a real one); against SDPA in float64
    torch = pytest.importorskip("torch")

    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(13)
    sq, sk, sv = MORE_DIMS.get(kind, MORE_DIMS["per-index"])
    kw: dict[str, object] = {}
    if kind == "mask":  # over the second batch dim, broadcast over the first and the heads
        kw["attn_mask"] = torch.rand(3, 1, 33, 29, generator=g) > 0.2
    elif kind == "causal":
        kw["is_causal"] = True
    elif kind == "gqa":
        sk, sv = (2, 3, 2, 29, 17), (2, 3, 2, 29, 24)
        kw["enable_gqa"] = True
    q, k, v = (torch.randn(*s, generator=g) for s in (sq, sk, sv))
    if kind == "permuted":  # q's batch dims not in memory order: not mergeable, a call each
        q = torch.randn(3, 2, 4, 33, 17, generator=g).transpose(0, 1)
    ours, theirs = _ours_and_sdpa64(q, k, v, kw, kind == "numpy")
    chain = chainfuse.attention_chain(1, 1, 33, 29, 17, 24)
    reference.assert_close(ours, theirs, chain)
    empty = cft.attention(q[:0], k[:0], v[:0])
    assert tuple(empty.shape) == (0, *theirs.shape[1:])


RANKS = {  # q, k, v shapes of different ranks, or 2-D: aligned from the right, as PyTorch does
    "2d": ((33, 17), (29, 17), (29, 24)),
    "kv-3d": ((2, 4, 33, 17), (4, 29, 17), (4, 29, 24)),
    "kv-2d": ((2, 4, 33, 17), (29, 17), (29, 24)),
    "q-3d": ((4, 33, 17), (2, 4, 29, 17), (2, 4, 29, 24)),
    "k-2d-v-3d": ((2, 4, 33, 17), (29, 17), (4, 29, 24)),
    "q-5d-kv-3d": ((2, 3, 4, 33, 17), (4, 29, 17), (4, 29, 24)),
}


@pytest.mark.parametrize("kind", [*RANKS, "2d-mask", "2d-causal", "numpy"])
def test_2d_and_mixed_ranks_as_sdpa_takes_them(kind: str) -> None:
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(17)
    sq, sk, sv = RANKS.get(kind, RANKS["2d"] if kind.startswith("2d") else RANKS["kv-2d"])
    kw: dict[str, object] = {}
    if kind == "2d-mask":
        kw["attn_mask"] = torch.randn(33, 29, generator=g)
    elif kind == "2d-causal":
        kw["is_causal"] = True
    q, k, v = (torch.randn(*s, generator=g) for s in (sq, sk, sv))
    ours, theirs = _ours_and_sdpa64(q, k, v, kw, kind == "numpy")
    reference.assert_close(ours, theirs, chainfuse.attention_chain(1, 1, 33, 29, 17, 24))


def test_sizes_that_do_not_broadcast_and_strided_rows_are_named() -> None:
    q = np.zeros((2, 4, 5, 8), np.float32)
    with pytest.raises(ValueError, match=r"q, k, v: batch sizes 2, 3, 3 do not broadcast"):
        chainfuse.ops.attention(q, np.zeros((3, 4, 5, 8), np.float32),
                                np.zeros((3, 4, 5, 8), np.float32))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"q, k, v: batch dims \(2, 4\), \(3, 4\), \(3, 4\) do not"
    ):
        chainfuse.ops.attention(np.zeros((2, 4, 2, 5, 8), np.float32),
                                np.zeros((3, 4, 2, 5, 8), np.float32),
                                np.zeros((3, 4, 2, 5, 8), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"attn_mask: shape \(5, 1, 5, 5\) does not broadcast"):
        chainfuse.ops.attention(q[None], q[None], q[None],
                                attn_mask=np.zeros((5, 1, 5, 5), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"k, v: head counts 2 and 3 differ"):
        chainfuse.ops.attention(q, np.zeros((2, 2, 5, 8), np.float32),
                                np.zeros((2, 3, 5, 8), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"k, v: expected q's heads \(or pass enable_gqa"):
        chainfuse.ops.attention(q, np.zeros((2, 2, 5, 8), np.float32),
                                np.zeros((2, 2, 5, 8), np.float32))  # fmt: skip
    # a last dim that is not contiguous: named as the caller named it (the kernel says Q, K, V)
    step = np.zeros((2, 4, 8, 5), np.float32).swapaxes(-1, -2)
    for i, name in enumerate("qkv"):
        args = [q, q, q]
        args[i] = step
        with pytest.raises(ValueError, match=rf"^{name}: its last dimension must be contiguous"):
            chainfuse.ops.attention(*args)


def test_sdpa_only_arguments_and_autograd_are_explicit() -> None:
    torch = pytest.importorskip("torch")
    import chainfuse.torch as cft

    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"k, v: expected q's heads \(or pass enable_gqa=True\)"):
        cft.attention(q, kv, kv)
    with pytest.raises(ValueError, match="k, v: expected a divisor of q's heads, got 3 heads"):
        cft.attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), enable_gqa=True)
    with pytest.raises(ValueError, match=r"attn_mask: shape \(3, 5, 5\) does not broadcast"):
        cft.attention(q, kv, kv, attn_mask=torch.ones(3, 5, 5, dtype=torch.bool), enable_gqa=True)
    with pytest.raises(ValueError, match=r"dropout_p: expected 0\.0, got 0\.1"):
        cft.attention(q, q, q, dropout_p=0.1)
    torch.testing.assert_close(cft.attention(q, q, q, dropout_p=0.0), cft.attention(q, q, q))
    # SDPA's fifth positional argument is dropout_p: here it lands on is_causal, and is refused
    with pytest.raises(TypeError, match=r"is_causal: expected a bool, got 0\.0"):
        cft.attention(q, q, q, None, 0.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enable_gqa: expected a bool"):
        cft.attention(q, q, q, enable_gqa=1)  # type: ignore[arg-type]
    # no backward: refused while grad mode is on, fine without it
    grad_q = q.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"q: requires grad.*torch.no_grad\(\)"):
        cft.attention(grad_q, q, q)
    bias = torch.zeros(5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask: requires grad"):
        cft.attention(q, q, q, attn_mask=bias)
    with torch.inference_mode():
        torch.testing.assert_close(cft.attention(grad_q, q, q), cft.attention(q, q, q))
    a = torch.randn(2, 5, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="A: requires grad"):
        chainfuse.ops.gemm_chain(a, torch.randn(2, 3, 4), torch.randn(2, 4, 6))
    w2 = torch.randn(4, 3, 1, 1, requires_grad=True)
    with pytest.raises(RuntimeError, match="w2: requires grad"):
        chainfuse.ops.conv_chain(torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), w2)


def test_every_sequence_length_and_plan_shares_one_compiled_object() -> None:
    # tiles and sizes are run-time arguments: decoding (one query, a growing number of keys),
    # prefill lengths and plans forced to other tiles all load the same object per micro-kernel
    # (`select` weighs the tails: on AVX-512 a short or odd seq_q takes 12x32, others 6x64),
    # and each result is the reference's; a different structure (causal) is another object
    paths: dict[str, set[object]] = {}
    shapes = [(1, 1), (1, 7), (1, 65), (1, 600), (17, 17), (129, 300), (600, 599)]
    for i, (sq, sk) in enumerate(shapes):
        chain = chainfuse.attention_chain(1, 2, sq, sk, 40, 24)
        tiles = [None, {"m": 16, "l": 6, "k": 7, "n": 6}, {"m": 48, "l": 30}][i % 3]
        kernel = compile(chain, tiles=tiles)
        inputs = reference.random_inputs(chain, seed=i)
        out = kernel(*[inputs[t.name] for t in chain.inputs])
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain)
        paths.setdefault(kernel.spec.kernel.name, set()).add(kernel.path)
    assert all(len(p) == 1 for p in paths.values()), paths
    assert len(shapes) - len(paths) >= 4  # at least four loads of an object built before
    causal = compile(chainfuse.attention_chain(1, 2, 9, 9, 40, 24, causal=True))
    assert all(causal.path not in p for p in paths.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sq=st.integers(1, 8), sk=st.one_of(st.sampled_from([1, 5, 255, 256, 257, 513]), SEQ),
    dqk=st.sampled_from([1, 3, 40, 59, 64, 111]), dv=st.sampled_from([1, 7, 64, 160]),
    causal=st.booleans(), mask=MASK, broadcast=st.booleans(), magnitude=MAGNITUDE,
    tail=st.booleans(), beyond_cache=st.booleans(),
)  # fmt: skip
def test_few_queries_take_the_row_path_and_match_the_reference(
    sq: int, sk: int, dqk: int, dv: int, causal: bool, mask: str | None, broadcast: bool,
    magnitude: float, tail: bool, beyond_cache: bool,
) -> None:  # fmt: skip
    # row blocks of <= ROWS_FIT queries (decoding) skip the micro-kernel, and of <= ROWS_MAX
    # where K and V take more than a quarter of the last cache level (`beyond_cache`: none);
    # with `tail`, the last of several 16-query blocks is one, so both paths write parts of one
    # output
    from chainfuse.codegen.rows import ROWS_MAX

    assert sq <= ROWS_MAX
    rows = 32 + sq if tail else sq
    tiles = {"m": 16} if tail else None
    with pytest.MonkeyPatch.context() as mp:
        if beyond_cache:
            mp.setattr(schedule, "last_cache_bytes", lambda hw: 0)
        _check_attention(1, 2, rows, sk, dqk, dv, causal, mask, broadcast, tiles, magnitude)


def test_the_row_path_reaches_further_where_k_and_v_leave_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # blocks of ROWS_FIT + 1 .. ROWS_MAX queries take the tiles while all of K and V fit in a
    # quarter of the last cache level (a narrow strip costs less than their dot products), the
    # row path where they do not (`row_path_rows`): describe() says so, and the generated code agrees (the two paths round
    # differently: their outputs differ, each the reference's).
    from chainfuse.codegen.rows import ROWS_FIT, ROWS_MAX

    def run(sq: int, tail: bool) -> tuple[str, np.ndarray]:
        chain = chainfuse.attention_chain(1, 3, 32 + sq if tail else sq, 70, 24, 24)
        kernel = compile(chain, tiles={"m": 16} if tail else None)
        inputs = reference.random_inputs(chain, seed=sq)
        out = kernel(*[inputs[t.name] for t in chain.inputs])
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain)
        return kernel.describe(), out

    cases = [(sq, tail) for sq in (ROWS_FIT, ROWS_FIT + 1, ROWS_MAX) for tail in (False, True)]
    fits = {case: run(*case) for case in cases}
    monkeypatch.setattr(schedule, "last_cache_bytes", lambda hw: 0)
    beyond = {case: run(*case) for case in cases}
    for (sq, tail), (said, out) in fits.items():
        rows = f"a last row block of {sq} rows" if tail else f"the row path for all {sq} rows"
        assert (rows in said) == (sq <= ROWS_FIT), said
        assert rows in beyond[sq, tail][0], beyond[sq, tail][0]
        assert np.array_equal(out, beyond[sq, tail][1]) == (sq <= ROWS_FIT), (sq, tail)
    # an MLP's rows, and 16-bit K and V (which the tiles widen as they pack them): the row
    # path through ROWS_MAX rows either way
    mlp = compile(chainfuse.mlp_chain(ROWS_MAX, 24, 70, 24))
    half = compile(chainfuse.attention_chain(1, 3, ROWS_MAX, 70, 24, 24, dtype="bfloat16"))
    for kernel in (mlp, half):
        assert f"the row path for all {ROWS_MAX} rows of m" in kernel.describe()
        assert kernel.schedule.row_path_rows(0.0) == ROWS_MAX  # however small K and V are
    fp32 = compile(chainfuse.attention_chain(1, 3, 2, 70, 24, 24))
    assert fp32.schedule.row_path_rows(0.0) == ROWS_FIT


@pytest.mark.parametrize("dqk", [1, 7, 8, 15, 16, 17, 24, 31])
def test_row_path_dot_products_of_every_length_past_whole_vectors(dqk: int) -> None:
    # the row path's four dot products at a time (`cf_dot4`): head dims through two vectors a
    # step, one vector, and single floats past them; 13 keys (a last group of one re-read)
    _check_attention(1, 2, 3, 13, dqk, 5, False, None, False, None, 100.0)


def test_row_path_rows_without_keys_and_huge_scores() -> None:
    # a fully masked query gives zeros, a huge score range stays finite, NaN in a key reaches
    # exactly the queries whose scores read it, as in the tiled path
    torch = pytest.importorskip("torch")
    import chainfuse.torch as cft

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for n in (3, 300, 300))
    mask = torch.ones(3, 300, dtype=torch.bool)
    mask[1] = False
    ours = cft.attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours[:, :, 1], torch.zeros_like(ours[:, :, 1]))
    theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours[:, :, [0, 2]], theirs[:, :, [0, 2]], rtol=1e-5, atol=1e-5)
    big = cft.attention(q * 1e4, k * 1e4, v)
    assert torch.isfinite(big).all()
    k[0, 1, 290, 5] = float("nan")
    nan = cft.attention(q, k, v)
    assert torch.isnan(nan[0, 1]).all() and torch.isfinite(nan[0, 0]).all()


_FP32_HERE = [
    k for k in available() if k.isa <= Hardware.detect().isa and DType.FLOAT32 in k.dtypes
]  # fmt: skip
_NARROW_HERE = [k for k in _FP32_HERE if k.col_widths]
_PART_HERE = [k for k in _FP32_HERE if k.part_rows]
_TAIL_ROWS_HERE = [k for k in _FP32_HERE if rows_tail(k)]  # (a 4-column kernel: none)
_SCORES_EXP_HERE = [k for k in _FP32_HERE if k.scores_exp is not None]
_WIDE_HERE = [k for k in _FP32_HERE if k.wide is not None]


def _force(monkeypatch: pytest.MonkeyPatch, kernel: MicroKernel) -> None:
    """Every chain compiled from here on runs `kernel` (not only the one `select` picks)."""
    monkeypatch.setattr(compiler, "select_weighted", lambda problems, hw: kernel)


def _check_gemm_chain(chain: chainfuse.Chain, kernel: MicroKernel, seed: int, **how: Any) -> None:
    """`chain` compiled (`how`: compile's tiles, threads) runs `kernel` and matches the
    reference on random inputs of `seed`."""
    k = compile(chain, **how)
    assert k.spec.kernel is kernel
    check_against_reference(k, chain, seed=seed)


@pytest.mark.parametrize("kernel", _NARROW_HERE, ids=lambda k: k.name)
def test_tail_strips_of_every_narrow_width_with_each_kernel(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each micro-kernel this CPU runs, forced: query
    # counts whose last strip of nr columns is each narrow width (`<uk>_cols`), one column
    # short of it or over it, in attention (masked and causal) and in a relu GEMM chain
    _force(monkeypatch, kernel)
    nr, pc = kernel.nr, kernel.part_cols
    counts = sorted({nr + w + d for w in kernel.col_widths for d in (-1, 0, 1)} | {nr + 1})
    for i, sq in enumerate(counts):
        causal, mask = [(False, None), (True, None), (False, "additive"), (False, "bool")][i % 4]
        _check_attention(1, 2, sq, 37 + i, 40, 24, causal, mask, i % 2 == 1, None, 10.0)
        chain = chainfuse.gemm_chain(2, sq, 24, 40, 37 + i, "relu")
        _check_gemm_chain(chain, kernel, i, tiles={"m": nr * 2, "l": 18, "k": 16})  # (acc)
    assert pc and len(counts) == 3 * len(kernel.col_widths) + 1


@pytest.mark.parametrize("kernel", _TAIL_ROWS_HERE, ids=lambda k: k.name)
def test_a_few_rows_past_whole_strips_take_the_row_path_and_the_rest_the_tiles(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # row blocks of 1..ROWS_TAIL rows past whole strips (and one more, which stays tiled):
    # those rows run `_rows` with the block's other rows tiled, in attention (causal: their
    # keys end at their own queries; masks over queries, broadcast; several l tiles), in
    # row blocks after the first (T_M), and in a gelu GEMM chain on 1 and 2 threads
    _force(monkeypatch, kernel)
    nr, tail = kernel.nr, rows_tail(kernel)
    kinds = [(False, None), (True, None), (False, "additive"), (True, "bool")]
    for i, extra in enumerate(range(1, tail + 2)):
        causal, mask = kinds[i % len(kinds)]
        _check_attention(1, 2, nr + extra, 41 + extra, 24, 40, causal, mask, i % 2 == 1,
                         None, 10.0)  # fmt: skip
        _check_attention(2, 1, 3 * nr + extra, 2 * nr + 3, 24, 40, causal, mask, False,
                         {"m": 2 * nr, "l": nr + 5}, 1e3)  # fmt: skip
        chain = chainfuse.gemm_chain(2, nr + extra, 24, 40, 33, "gelu")
        for threads in (1, 2):
            _check_gemm_chain(chain, kernel, extra, threads=threads)


@pytest.mark.parametrize("kernel", _NARROW_HERE, ids=lambda k: k.name)
def test_a_tail_strips_softmax_runs_on_its_columns_alone_over_several_l_tiles(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the softmax of a tail strip of each narrow width (and one column short of it) runs on
    # its nw columns only: over several l tiles whose maxima rise (large scores: shifts move and
    # what op2 accumulated is rescaled, through Eᵀ and, with dv = nr, straight in E), masked,
    # causal and both, with the transposed mask path of whole strips in the same call
    _force(monkeypatch, kernel)
    nr = kernel.nr
    kinds = [(False, None), (True, None), (False, "additive"), (False, "bool"), (True, "bool")]
    for i, sq in enumerate(sorted({nr + w + d for w in kernel.col_widths for d in (-1, 0)})):
        causal, mask = kinds[i % len(kinds)]
        for dv in (24, nr):
            _check_attention(1, 2, sq, 3 * kernel.mr + 5 + i, 40, dv, causal, mask, False,
                             {"l": kernel.mr + 1}, 1e3)  # fmt: skip


def _check_e_rows(chain: chainfuse.Chain, dv: int, seed: int) -> compiler.Kernel:
    """`chain` (a value head of `dv` dims, l tiles of 12) against the reference on inputs up to
    [1, 100, 1e4][seed % 3] and, bit for bit, against the Eᵀ accumulator (an n tile below dv),
    with V as a view of a wider array (rows further apart) and into an `out` whose rows lie
    further apart (nothing written past the rows' ends). Returns the kernel it compiled (n in
    one tile: a head of several nr blocks may run faster split, `calibration.split_multiple`)."""
    k = compile(chain, tiles={"l": 12, "n": dv})
    inputs = reference.random_inputs(chain, seed=seed, scale=[1.0, 100.0, 1e4][seed % 3])
    names = [t.name for t in chain.inputs]
    dense = k(*[inputs[n] for n in names])
    reference.assert_close(dense, reference.run(chain, inputs)["O"], chain, inputs=inputs)
    et = compile(chain, tiles={"l": 12, "n": dv // 2})  # the Eᵀ accumulator
    np.testing.assert_array_equal(et(*[inputs[n] for n in names]), dense)
    wide = np.zeros((*inputs["V"].shape[:-1], dv + 3), np.float32)
    wide[..., :dv] = inputs["V"]
    strided = k(*[wide[..., :dv] if n == "V" else inputs[n] for n in names])
    np.testing.assert_array_equal(strided, dense)
    out = np.full((*dense.shape[:-1], dv + 5), np.nan, np.float32)
    k(*[inputs[n] for n in names], out=out[..., :dv])
    np.testing.assert_array_equal(out[..., :dv], dense)
    assert np.isnan(out[..., dv:]).all()
    return k


@pytest.mark.parametrize("kernel", _FP32_HERE, ids=lambda k: k.name)
def test_op2_into_e_agrees_bit_for_bit_with_the_transposed_accumulator(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a value head of exactly nr dims with dense rows: op2 adds into E's rows directly (`to_e`,
    # also into an `out` whose rows lie further apart); the same V as a view of a wider array
    # takes a wide block where the kernel has one of nr columns (into E's rows too), else the
    # Eᵀ accumulator and its transposing store, as an n tile below nr does. All are the
    # reference's and equal bit for bit: over several l tiles (the rescales act on E's rows),
    # a tail strip of queries, masks, causal, scores up to 1e4
    from chainfuse.codegen.rows import ROWS_MAX

    _force(monkeypatch, kernel)
    nr = kernel.nr
    cases = [(ROWS_MAX + 1, 7, False, None), (nr + 5, 130, True, None),
             (2 * nr + 3, 61, False, "bool"), (nr, 200, False, "additive")]  # fmt: skip
    for i, (sq, sk, causal, mask) in enumerate(cases):
        chain = chainfuse.attention_chain(1, 2, sq, sk, 24, nr, causal=causal, mask=mask)
        k = _check_e_rows(chain, nr, i)
        assert k.spec.kernel is kernel and k.spec.T_L == 12


@pytest.mark.parametrize("kernel", _WIDE_HERE, ids=lambda k: k.name)
def test_a_wide_value_head_goes_into_e_bit_for_bit_with_the_transposed_accumulator(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a value head of a wide block's width (`MicroKernel.wide`), or a multiple of nr where nr is
    # one (nr columns at a time): n whole, op2 writes E's rows with the head
    # in registers, V's rows in place; against the reference and the Eᵀ accumulator bit for
    # bit (`_check_e_rows`): over several l tiles (the rescales act on E's rows), last strips
    # whose last block keeps 1..wide_mr rows, masks, causal, scores up to 1e4, strided V and out
    from chainfuse.codegen.gemm_spec import wide_multiples
    from chainfuse.codegen.rows import ROWS_MAX

    _force(monkeypatch, kernel)
    nr, rows = kernel.nr, kernel.wide_mr
    assert rows_tail(kernel) < rows + 1 < nr
    cases = [(max(ROWS_MAX + 1, nr + rows + 1), 7, False, None), (nr + rows + 2, 130, True, None),
             (2 * nr + rows + 3, 61, False, "bool"), (nr + 4 * rows, 200, False, "additive")]  # fmt: skip
    heads = [*kernel.wide_cols, *([2 * nr, 3 * nr] if wide_multiples(kernel) else [])]
    for dv in heads:
        for i, (sq, sk, causal, mask) in enumerate(cases):
            chain = chainfuse.attention_chain(1, 2, sq, sk, 24, dv, causal=causal, mask=mask)
            k = _check_e_rows(chain, dv, i)
            block = dv if dv in kernel.wide_cols else nr  # (a multiple of nr: nr at a time)
            assert dv == k.spec.T_N and f"{kernel.name}_wide{block}(lc, " in k.source


def _guarded(a: np.ndarray) -> tuple[np.ndarray, object]:
    """A copy of `a` whose last element ends where an inaccessible page begins (reading one float
    past it faults), and the mapping that keeps it alive."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    pages = -(-a.nbytes // page) + 1
    buf = mmap.mmap(-1, pages * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mprotect(ctypes.c_void_p(base + (pages - 1) * page), ctypes.c_size_t(page), 0) != 0:
        pytest.skip("mprotect is not available here")
    start = (pages - 1) * page - a.nbytes
    out = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=start).reshape(a.shape)
    out[...] = a
    return out, buf


@pytest.mark.parametrize("kernel", _FP32_HERE, ids=lambda k: k.name)
def test_a_packed_tail_sliver_of_every_length_runs_its_block_straight_into_the_strip(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # op1's last sliver of keys in a tile, of each length 1..mr-1 (packed, zeros below its
    # rows), runs the part block or the whole one into the strip of scores, whose rows past the
    # tile's keys nothing reads: at the end of the keys and inside them (l tiles whose length is
    # not a multiple of mr: the online softmax over several), over k blocks (accumulated), in
    # attention, causal and masked, and in a relu GEMM chain (its strip of intermediates)
    _force(monkeypatch, kernel)
    mr = kernel.mr
    for t in range(1, mr):
        sk = 2 * mr + t
        causal, mask = [(False, None), (True, None), (False, "bool")][t % 3]
        _check_attention(1, 2, kernel.nr + 3, sk, 37, 24, causal, mask, False, None, 100.0)
        _check_attention(1, 2, 2 * kernel.nr + 1, 3 * sk + 1, 37, 24, causal, mask, t % 2 == 0,
                         {"l": mr + t, "k": 16}, 1e4)  # fmt: skip
        chain = chainfuse.gemm_chain(2, kernel.nr + 3, 24, 37, sk, "relu")
        _check_gemm_chain(chain, kernel, t, tiles={"l": mr + t, "k": 16})


@pytest.mark.parametrize("kernel", _PART_HERE, ids=lambda k: k.name)
def test_short_slivers_of_part_rows_are_read_in_place_within_the_tensor(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # keys and value dims one short sliver of exactly `part_rows` past whole slivers: the last
    # sliver of K (op1) and of V's columns (op2, through Eᵀ) is read in place, and it is the end
    # of the tensor; a float read past it would fault (a guard page follows each operand)
    _force(monkeypatch, kernel)
    mr, part = kernel.mr, kernel.part_rows
    for i, (sq, sk, dv) in enumerate([(kernel.nr + 3, 2 * mr + part, mr + part),
                                      (20, mr + part, 3 * mr + part)]):  # fmt: skip
        chain = chainfuse.attention_chain(1, 2, sq, sk, 2 * mr + part, dv, causal=i == 1)
        k = compile(chain)
        assert k.spec.kernel is kernel
        inputs = reference.random_inputs(chain, seed=i)
        keep = [_guarded(inputs[t.name]) for t in chain.inputs]
        out = k(*[a for a, _ in keep])
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain)


@pytest.mark.parametrize("kernel", _FP32_HERE, ids=lambda k: k.name)
def test_a_packed_value_head_serves_the_row_blocks_of_its_head_only(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # V packed once per head for the row blocks that follow (reuse_d): several row blocks per
    # head, V in one n block, in two or three (T_N < N, each packed block kept), in more than
    # DT_PANELS (packed per row block), heads that share one V (stride 0: one packing serves
    # them all), causal (packed per row block); then the same arrays with new values: a new
    # call packs them again
    from chainfuse.codegen.schedule import DT_PANELS

    _force(monkeypatch, kernel)
    mr = kernel.mr
    cases = [(3 * kernel.nr + 5, 70, 37, {"m": kernel.nr}, False),
             (2 * kernel.nr + 1, 41, 2 * mr + 3, {"m": kernel.nr, "n": mr + 1}, False),
             (2 * kernel.nr + 1, 41, 3 * mr, {"m": kernel.nr, "n": mr}, False),
             (2 * kernel.nr, 33, (DT_PANELS + 1) * mr, {"m": kernel.nr, "n": mr}, False),
             (3 * kernel.nr, 90, 21, {"m": kernel.nr}, True)]  # fmt: skip
    for i, (sq, sk, dv, tiles, causal) in enumerate(cases):
        chain = chainfuse.attention_chain(2, 3, sq, sk, 19, dv, causal=causal)
        k = compile(chain, tiles=tiles)
        assert k.spec.kernel is kernel and sq > k.spec.T_M
        inputs = reference.random_inputs(chain, seed=40 + i, scale=3.0)
        names = [t.name for t in chain.inputs]
        out = k(*[inputs[n] for n in names])
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain, inputs=inputs)
        shared = np.broadcast_to(inputs["V"][:1, :1], inputs["V"].shape)  # one head's V for all
        got = k(*[shared if n == "V" else inputs[n] for n in names])
        want = reference.run(chain, {**inputs, "V": np.ascontiguousarray(shared)})["O"]
        reference.assert_close(got, want, chain, inputs=inputs)
        inputs["V"][...] = np.flip(inputs["V"], axis=-2) * 2.0  # same array, new values
        out = k(*[inputs[n] for n in names])
        reference.assert_close(out, reference.run(chain, inputs)["O"], chain, inputs=inputs)


@pytest.mark.parametrize("kernel", _SCORES_EXP_HERE, ids=lambda k: k.name)
def test_scores_exponentiated_beside_op1_rescale_or_fall_back(
    kernel: MicroKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # whole strips of nr queries take cf_scores_strip (the kernel's scores_exp: each block of mr
    # keys exponentiated during the next block's FMAs against the shifts the first block set,
    # no maxima after it). Scores rising along the keys by ~0-9 per block (base 2) depending on
    # the query leave some columns' sums far past 2^SUM_CAP (their rows and sums rescaled at
    # the end of the strip, which keeps op2's sums of V's rows from overflowing: values ~1e30
    # here), falling scores keep the first block's shifts; a key ~3e6 along the rise overflows some sums (the strip's own pass
    # then computes it), as does one ~300 along past whole blocks (up to 2^450 unshifted).
    # One l tile or several (E or Eᵀ rescaled after op2 ran, l tiles of fewer than mr keys on
    # the strip's own pass), 0..mr-1 keys past whole blocks, K read in place or packed (a row
    # block of more than DIRECT_ROW_STRIPS strips), E written directly or through Eᵀ
    from chainfuse.codegen.gemm_chain import DIRECT_ROW_STRIPS

    _force(monkeypatch, kernel)
    nr, mr = kernel.nr, kernel.mr
    rng = np.random.default_rng(11)
    masked = chainfuse.attention_chain(1, 1, nr, 2 * mr, 8, nr, mask="bool")
    assert "cf_scores_strip(" not in compile(masked).source  # (the strip's own pass applies it)
    packed_m = (DIRECT_ROW_STRIPS + 1) * nr
    cases = [(nr + 3, 5 * mr + t, nr, None) for t in range(mr)]
    cases += [(nr + 3, 7 * mr + 2, nr + 16, {"l": 2 * mr + 1}), (2 * nr, 40, nr, {"l": 3 * mr})]
    cases += [(packed_m + 5, 4 * mr + 3, nr, {"m": packed_m + 8}), (nr, 9 * mr, 24, None)]
    for sq, sk, dv, tiles in cases:
        chain = chainfuse.attention_chain(1, 1, sq, sk, 8, dv)
        k = compile(chain, tiles=tiles)
        assert k.spec.kernel is kernel and "cf_scores_strip(" in k.source
        q = (rng.standard_normal((sq, 8)) * 0.05).astype(np.float32)
        q[:, 0] = np.linspace(-2.0, 3.0, sq, dtype=np.float32)
        key = (rng.standard_normal((sk, 8)) * 0.05).astype(np.float32)
        key[:, 0] += np.arange(sk, dtype=np.float32)
        v = (rng.standard_normal((sk, dv)) * 1e30).astype(np.float32)
        inputs = {"Q": q[None, None], "K": key[None, None], "V": v[None, None]}
        got = k(inputs["Q"], inputs["K"], inputs["V"])
        reference.assert_close(got, reference.run(chain, inputs)["O"], chain, inputs=inputs)
        # a key far along the rise: in the middle, ~3e6 (one-hot where q[:, 0] > 0), then the
        # last (past whole blocks where sk % mr > 0) ~300 ahead: up to 2^450 without its shift
        for far, at in ((sk // 2, 3e6), (sk - 1, sk + 300.0)):
            moved = key.copy()
            moved[far, 0] = at
            inputs["K"] = moved[None, None]
            got = k(inputs["Q"], inputs["K"], inputs["V"])
            reference.assert_close(got, reference.run(chain, inputs)["O"], chain, inputs=inputs)
