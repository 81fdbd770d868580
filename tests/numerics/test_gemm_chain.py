"""Compiled GEMM chains against the float64 reference: paper workloads, awkward sizes, layouts.

Sizes are run-time arguments of a compiled kernel, so the hypothesis tests compile a handful of
tile configurations once and then draw hundreds of shapes through them (every draw still runs
the planner and the content-addressed cache lookup, as a user's call would).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import reference
from chainfuse.bench import workloads
from chainfuse.compiler import compile
from tests.checks import check_against_reference

AWKWARD = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129]), st.integers(1, 140))
BETWEEN = st.sampled_from([None, "relu", "gelu", "softmax"])
# tiles that are not multiples of anything, tiles bigger than the sizes, and the register block
TILES = st.sampled_from(
    [
        None,
        {"m": 16, "l": 6, "k": 7, "n": 6},
        {"m": 7, "l": 17, "k": 1, "n": 5},
        {"m": 48, "l": 30, "k": 64, "n": 12},
        {"m": 200, "l": 200, "k": 200, "n": 200},
    ]
)


def _check(chain: chainfuse.Chain, tiles: dict[str, int] | None = None, seed: int = 0) -> None:
    check_against_reference(compile(chain, tiles=tiles), chain, seed=seed)


FAST = ["bert-small", "vit-huge-16", "mixer-s-32-s", "mixer-s-32-c"]


@pytest.mark.parametrize("between", [None, "relu", "softmax"])
@pytest.mark.parametrize("name", FAST)
def test_paper_workloads_fast_subset(name: str, between: str | None) -> None:
    _check(workloads.chain_of(name, between))


@pytest.mark.slow
@pytest.mark.parametrize("between", [None, "relu", "gelu", "softmax"])
@pytest.mark.parametrize("name", [w.name for w in workloads.GEMM])
def test_every_paper_workload(name: str, between: str | None) -> None:
    _check(workloads.chain_of(name, between))


def _draw_test(examples: int):  # type: ignore[no-untyped-def]
    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        b=st.integers(1, 3),
        M=AWKWARD,
        N=AWKWARD,
        K=AWKWARD,
        L=AWKWARD,
        between=BETWEEN,
        tiles=TILES,
        seed=st.integers(0, 2**16),
    )
    def check(
        b: int, M: int, N: int, K: int, L: int, between: str | None, tiles: dict[str, int] | None,
        seed: int,
    ) -> None:  # fmt: skip
        _check(chainfuse.gemm_chain(b, M, N, K, L, between), tiles, seed)

    return check


test_awkward_shapes = _draw_test(60)
test_awkward_shapes_many = pytest.mark.slow(_draw_test(500))


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 3),
    sq=AWKWARD,
    sk=AWKWARD,
    dqk=st.sampled_from([1, 17, 40, 59, 64, 80]),
    dv=st.sampled_from([1, 23, 64, 96]),
    tiles=TILES,
)
def test_attention_chain_unmasked(
    b: int, h: int, sq: int, sk: int, dqk: int, dv: int, tiles: dict[str, int] | None
) -> None:
    _check(chainfuse.attention_chain(b, h, sq, sk, dqk, dv), tiles)


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_mlp_chain(act: str | None) -> None:
    _check(chainfuse.mlp_chain(65, 63, 129, 17, act))


def test_torch_inputs_give_torch_output() -> None:
    torch = pytest.importorskip("torch")
    chain = chainfuse.gemm_chain(2, 33, 17, 9, 65, "relu")
    inputs = reference.random_inputs(chain)
    kernel = compile(chain)
    out = kernel(*[torch.from_numpy(inputs[n]) for n in "ABD"])
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    reference.assert_close(out.numpy(), reference.run(chain, inputs)["E"], chain)
    into = torch.empty(2, 33, 17)
    assert kernel(*[torch.from_numpy(inputs[n]) for n in "ABD"], out=into) is into
    reference.assert_close(into.numpy(), reference.run(chain, inputs)["E"], chain)


def test_strided_batch_views_are_used_without_copies() -> None:
    chain = chainfuse.gemm_chain(3, 20, 9, 11, 30, "softmax")
    inputs = reference.random_inputs(chain, seed=3)
    rng = np.random.default_rng(0)
    # every other batch of a larger array, and rows with padding after them
    wide = rng.standard_normal((6, 20, 16)).astype(np.float32)
    A = wide[::2, :, :11]
    assert not A.flags.c_contiguous
    inputs["A"] = A
    out = np.zeros((3, 20, 12), dtype=np.float32)[:, :, :9]  # strided output
    compile(chain)(inputs["A"], inputs["B"], inputs["D"], out=out)
    reference.assert_close(out, reference.run(chain, inputs)["E"], chain)


def test_transposed_inner_dimension_is_a_clear_error() -> None:
    chain = chainfuse.gemm_chain(1, 8, 8, 8, 8)
    inputs = reference.random_inputs(chain)
    kernel = compile(chain)
    bad = np.ascontiguousarray(inputs["B"].transpose(0, 2, 1)).transpose(0, 2, 1)
    with pytest.raises(ValueError, match=r"B: its last dimension must be contiguous.*contiguous"):
        kernel(inputs["A"], bad, inputs["D"])


def test_bad_arguments_name_the_tensor() -> None:
    chain = chainfuse.gemm_chain(1, 8, 4, 5, 6)
    inputs = reference.random_inputs(chain)
    kernel = compile(chain)
    with pytest.raises(ValueError, match=r"D: expected shape \(1, 6, 4\)"):
        kernel(inputs["A"], inputs["B"], inputs["D"][:, :5])
    with pytest.raises(TypeError, match="A: expected dtype float32"):
        kernel(inputs["A"].astype(np.float64), inputs["B"], inputs["D"])
    with pytest.raises(TypeError, match="B: expected a numpy array or a torch tensor"):
        kernel(inputs["A"], inputs["B"].tolist(), inputs["D"])
    with pytest.raises(TypeError, match="expected 3 inputs"):
        kernel(inputs["A"], inputs["B"])
    with pytest.raises(ValueError, match="out: the output array is read-only"):
        ro = np.empty((1, 8, 4), dtype=np.float32)
        ro.flags.writeable = False
        kernel(inputs["A"], inputs["B"], inputs["D"], out=ro)
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="A: expected a CPU tensor, got device meta"):
        kernel(torch.empty(1, 8, 5, device="meta"), inputs["B"], inputs["D"])
    with pytest.raises(ValueError, match=r"tiles\['m'\] must be a positive integer"):
        compile(chain, tiles={"m": 0})
    with pytest.raises(ValueError, match=r"tiles: unknown loop 'T_M' for .*'m', 'l', 'k' and 'n'"):
        compile(chain, tiles={"T_M": 128})  # (the code's name for it, not the loop's)
    a, b, d = inputs["A"], inputs["B"], inputs["D"]
    with pytest.raises(TypeError, match="between: expected None or an activation name"):
        chainfuse.ops.gemm_chain(a, b, d, between=["relu"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="between: expected None, 'relu'"):
        chainfuse.ops.gemm_chain(a, b, d, between="tanh")


def test_ops_gemm_chain_numpy_and_2d() -> None:
    rng = np.random.default_rng(1)
    A, B, D = (rng.standard_normal(s).astype(np.float32) for s in [(2, 9, 5), (2, 5, 7), (2, 7, 3)])
    got = chainfuse.ops.gemm_chain(A, B, D, between="relu")
    np.testing.assert_allclose(got, np.maximum(A @ B, 0) @ D, rtol=1e-5, atol=1e-5)
    got2 = chainfuse.ops.gemm_chain(A[0], B[0], D[0])
    assert got2.shape == (9, 3)
    np.testing.assert_allclose(got2, A[0] @ B[0] @ D[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="B: expected 5 rows"):
        chainfuse.ops.gemm_chain(A, B[:, :4], D)
    with pytest.raises(ValueError, match="between"):
        chainfuse.ops.gemm_chain(A, B, D, between="tanh")
    with pytest.raises(TypeError, match=r"A, B, D: expected all float32, .* got list, float32"):
        chainfuse.ops.gemm_chain(A.tolist(), B, D)
    with pytest.raises(TypeError, match="got float32, float64, float32"):
        chainfuse.ops.gemm_chain(A, B.astype(np.float64), D)


def _matmul_chain(A: np.ndarray, B: np.ndarray, D: np.ndarray, between: str | None) -> np.ndarray:
    """between(A @ B) @ D in float64 with numpy's rules for zero-size dimensions."""
    C = A.astype(np.float64) @ B.astype(np.float64)
    if between == "relu":
        C = np.maximum(C, 0.0)
    elif between == "softmax" and C.shape[-1]:
        C = np.exp(C - C.max(-1, keepdims=True))
        C /= C.sum(-1, keepdims=True)
    return C @ D.astype(np.float64)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("between", [None, "relu", "softmax"])
@pytest.mark.parametrize(
    "sizes", [(0, 6, 3, 5, 4), (2, 0, 3, 5, 4), (2, 6, 0, 5, 4), (2, 6, 3, 0, 4), (2, 6, 3, 5, 0)]
)
def test_zero_size_dimensions_match_numpy(
    sizes: tuple[int, int, int, int, int], between: str | None, kind: str
) -> None:
    """(batch, M, N, K, L) with one of them 0: no kernel runs; the result is numpy's (empty, or
    zeros for K = 0 or L = 0, or the mean of D's rows for K = 0 under softmax)."""
    batch, M, N, K, L = sizes
    rng = np.random.default_rng(7)
    A, B, D = (rng.standard_normal(s).astype(np.float32) for s in [(batch, M, K), (batch, K, L),
                                                                    (batch, L, N)])  # fmt: skip
    want = _matmul_chain(A, B, D, between)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        got = chainfuse.ops.gemm_chain(*(torch.from_numpy(x) for x in (A, B, D)), between=between)
        assert isinstance(got, torch.Tensor)
        got = got.numpy()
    else:
        got = chainfuse.ops.gemm_chain(A, B, D, between=between)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if batch:  # 2-D operands, and into a preallocated result
        out = np.full((M, N), np.nan, np.float32)
        assert chainfuse.ops.gemm_chain(A[0], B[0], D[0], between=between, out=out) is out
        np.testing.assert_allclose(out, want[0], rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match=rf"out: expected shape \({M}, {N}\)"):
            chainfuse.ops.gemm_chain(A[0], B[0], D[0], out=np.empty((M + 1, N), np.float32))
    with pytest.raises(ValueError, match="between"):
        chainfuse.ops.gemm_chain(A, B, D, between="tanh")


def test_softmax_is_safe_for_large_scores() -> None:
    # scores of magnitude ~1e4: exp without the running max would overflow to inf/NaN
    chain = chainfuse.gemm_chain(1, 9, 5, 4, 40, "softmax")
    inputs = reference.random_inputs(chain)
    inputs["A"] = inputs["A"] * 100
    inputs["B"] = inputs["B"] * 100
    out = compile(chain, tiles={"l": 6})(inputs["A"], inputs["B"], inputs["D"])
    assert np.isfinite(out).all()
    # large scores make the softmax nearly one-hot, and float32 rounding of the scores moves the
    # weights by |score| * 2^-24: compare with a tolerance of that size (why: DESIGN numerics)
    expected = reference.run(chain, inputs)["E"]
    scores = np.abs(inputs["A"].astype(np.float64) @ inputs["B"]).max()
    np.testing.assert_allclose(out, expected, atol=float(scores) * 2**-24 * 64 * 4)


def test_one_compiled_object_serves_many_sizes() -> None:
    # sizes are run-time arguments: the same tiles and micro-kernel give one object (`select`
    # may pick a narrower micro-kernel for a small m, which is another object)
    tiles = {"m": 16, "l": 12, "k": 8, "n": 12}
    kernels = [compile(chainfuse.gemm_chain(b, M, 9, 10, L), tiles=tiles)
               for b, M, L in [(1, 5, 7), (2, 65, 129), (3, 17, 63), (2, 129, 65), (1, 7, 300)]]  # fmt: skip
    paths: dict[str, set[object]] = {}
    for k in kernels:
        paths.setdefault(k.spec.kernel.name, set()).add(k.path)
    assert all(len(p) == 1 for p in paths.values()), paths
    assert len(kernels) - len(paths) >= 2  # at least two objects reused


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    M=st.integers(1, 70),
    N=AWKWARD,
    K=st.sampled_from([1, 7, 64, 129]),
    L=st.one_of(st.sampled_from([1, 5, 6, 7, 13, 700]), st.integers(1, 300)),
    between=st.sampled_from([None, "relu", "gelu"]),
    tiles=TILES,
    threads=st.integers(2, 5),
)
def test_fewer_blocks_than_threads_split_l(
    b: int, M: int, N: int, K: int, L: int, between: str | None, tiles: dict[str, int] | None,
    threads: int,
) -> None:  # fmt: skip
    # one or two blocks of rows on 2-5 threads: each block's threads take shares of l (some
    # empty when l is short) into their own Eᵀ, summed by a second pass; wrong when a share is
    # missed, counted twice, or an empty share adds stale workspace
    chain = chainfuse.gemm_chain(b, M, N, K, L, between)
    kernel = compile(chain, tiles=tiles, threads=threads)
    kernel._alone = False  # these sizes would run on the calling thread alone (ALONE_S)
    inputs = reference.random_inputs(chain)
    chainfuse.set_num_threads(threads)
    try:
        out = kernel(*[inputs[t.name] for t in chain.inputs])
        again = kernel(*[inputs[t.name] for t in chain.inputs])  # the workspace now holds data
    finally:
        chainfuse.set_num_threads(None)
    expected = reference.run(chain, inputs)[chain.outputs[0].name]
    reference.assert_close(out, expected, chain)
    np.testing.assert_array_equal(out, again)


def test_an_mlp_on_two_threads_is_one_block_with_l_split() -> None:
    """40 tokens on 2 threads: the plan keeps them one block and counts on the kernel's threads
    splitting l (each streams half of the weights once); the kernel does, and is correct."""
    chain = chainfuse.gemm_chain(1, 40, 200, 300, 1000, "relu")
    kernel = compile(chain, threads=2)
    assert kernel.plan.split == ("l", kernel.spec.kernel.mr)
    outer = kernel.plan.tiles_at(kernel.plan.levels[-1])
    assert outer is not None and outer["m"] == 40
    inputs = reference.random_inputs(chain)
    chainfuse.set_num_threads(2)
    try:
        out = kernel(*[inputs[t.name] for t in chain.inputs])
    finally:
        chainfuse.set_num_threads(None)
    reference.assert_close(out, reference.run(chain, inputs)[chain.outputs[0].name], chain)
    # a softmax's shares of l would need their maxima merged: never split
    attention = compile(chainfuse.gemm_chain(1, 40, 200, 300, 1000, "softmax"), threads=2)
    assert attention.plan.split is None


@pytest.mark.parametrize("tiles", [None, {"m": 48, "l": 30, "k": 16, "n": 12}])
def test_few_strips_with_rows_far_apart_are_packed_row_by_row(tiles: dict[str, int] | None) -> None:
    # 37 rows: few enough strips that near slivers are read in place; B's rows (301) and D's
    # (263) are too far apart for that, so their panels are packed row by row, tails included
    _check(chainfuse.gemm_chain(2, 37, 263, 29, 301, between="relu"), tiles)
    _check(chainfuse.gemm_chain(1, 37, 263, 29, 301, between="softmax"), tiles)


# n tiles of whole nr-column strips and row blocks of more than DIRECT_MC rows: op2 adds into E
# directly, m by mr-row blocks inside each of Pᵀ's strips (the last strip's rows cut anywhere);
# row blocks of fewer rows (M = 270 and 300 end in one) take the Eᵀ path in the same call
TO_E_TILES = st.sampled_from(
    [
        {"m": 160, "l": 40, "k": 24, "n": 32},
        {"m": 144, "l": 17, "k": 64, "n": 16},
        {"m": 200, "l": 96, "k": 7, "n": 48},
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    M=st.sampled_from([129, 133, 143, 150, 157, 161, 270, 300, 321]),
    N=st.one_of(st.sampled_from([1, 16, 17, 63, 64, 65, 80]), st.integers(1, 140)),
    K=st.sampled_from([1, 7, 64, 65]),
    L=AWKWARD,
    between=st.sampled_from([None, "relu", "gelu"]),
    tiles=TO_E_TILES,
    pad=st.sampled_from([0, 3]),
)
def test_op2_into_e_directly(
    b: int, M: int, N: int, K: int, L: int, between: str | None, tiles: dict[str, int], pad: int
) -> None:
    chain = chainfuse.gemm_chain(b, M, N, K, L, between)
    kernel = compile(chain, tiles=tiles)
    assert "cf_pack_b_panel(lc, nc" in kernel.source  # the path is compiled in
    inputs = reference.random_inputs(chain)
    # E's rows `pad` floats further apart than N: the kernel adds into E through its strides
    wide = np.full((b, M, N + pad), np.nan, dtype=np.float32)
    out = wide[:, :, :N]
    kernel(*[inputs[t.name] for t in chain.inputs], out=out)
    reference.assert_close(out, reference.run(chain, inputs)[chain.outputs[0].name], chain)
    assert np.isnan(wide[:, :, N:]).all()  # nothing written between the rows


@pytest.mark.parametrize("between", [None, "softmax"])
def test_blocks_claimed_by_threads_give_the_one_thread_result(between: str | None) -> None:
    # 5 x 5 row blocks claimed one at a time by 1, 2 and 3 threads: whichever thread runs a
    # block, it computes it the same way, so the outputs are bit-identical
    chain = chainfuse.gemm_chain(5, 300, 40, 33, 90, between)
    kernel = compile(chain, tiles={"m": 64, "l": 48, "k": 16, "n": 24}, threads=3)
    kernel._alone = False  # (small enough to run on the calling thread alone otherwise)
    inputs = reference.random_inputs(chain)
    args = [inputs[t.name] for t in chain.inputs]
    outs = []
    for threads in (1, 2, 3):
        chainfuse.set_num_threads(threads)
        try:
            outs.append(kernel(*args))
        finally:
            chainfuse.set_num_threads(None)
    reference.assert_close(outs[0], reference.run(chain, inputs)[chain.outputs[0].name], chain)
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.parametrize("between", [None, "relu", "gelu"])
def test_op2_into_e_directly_with_b_stored_transposed(between: str | None) -> None:
    # B given [b, l, k] (read in place as Bᵀ slivers, no prefetch cursor): op2 still adds into E
    chain = chainfuse.from_einsum(
        "bmk,blk->bml", "bml,bln->bmn", sizes=dict(b=2, m=150, k=33, l=70, n=40), between=between
    )
    tiles = {"m": 160, "l": 40, "k": 24, "n": 32}
    kernel = compile(chain, tiles=tiles)
    assert kernel.spec.b_transposed and "cf_pack_b_panel(lc, nc" in kernel.source
    _check(chain, tiles)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 2),
    rows=st.integers(1, 8),
    tail=st.booleans(),
    N=AWKWARD,
    K=st.one_of(st.sampled_from([1, 3, 4, 5, 64, 129]), AWKWARD),
    L=st.one_of(st.sampled_from([1, 3, 255, 256, 257, 700]), AWKWARD),
    between=BETWEEN,
    transposed=st.booleans(),
)
def test_few_rows_take_the_row_path(
    b: int, rows: int, tail: bool, N: int, K: int, L: int, between: str | None, transposed: bool
) -> None:
    # blocks of <= ROWS_MAX rows of m (one token through an MLP, a tail block after 16-row
    # blocks) skip the micro-kernel; B given [k, l] (rows of B added in) or [l, k] (dot products)
    from chainfuse.codegen.rows import ROWS_MAX

    assert rows <= ROWS_MAX
    M = 32 + rows if tail else rows
    sizes = dict(b=b, m=M, k=K, l=L, n=N)
    second = "bml,bln->bmn"
    if transposed:
        chain = chainfuse.from_einsum("bmk,blk->bml", second, sizes=sizes, between=between)
    else:
        chain = chainfuse.from_einsum("bmk,bkl->bml", second, sizes=sizes, between=between)
    _check(chain, {"m": 16} if tail else None)


def test_describe_says_which_code_runs() -> None:
    # the micro-kernel and how the chain's loops lie on it, the code-level tiles, and the row
    # blocks that take the row path (all of them at <= ROWS_MAX rows, or a short last block)
    from chainfuse.codegen.rows import ROWS_MAX, rows_tail

    tiled = compile(chainfuse.attention_chain(1, 2, 136, 50, 16, 16), tiles={"m": 128})
    uk = tiled.spec.kernel
    text = tiled.describe()
    assert f"micro-kernel {uk.name}; op1's blocks {uk.mr} rows of l by {uk.nr} of m," in text
    assert "tiles T_M=128 T_L=" in text
    said = "the softmax's exponentials: each block of"
    assert (said in text) == (uk.scores_exp is not None)  # (whole strips of nr, no mask)
    masked = chainfuse.attention_chain(1, 2, 136, 50, 16, 16, mask="bool")
    assert said not in compile(masked, tiles={"m": 128}).describe()
    # (8 queries past 128 take the tiles where K and V fit in the cache: row_path_rows; 6 not)
    assert "a last row block of" not in text
    text = compile(chainfuse.attention_chain(1, 2, 134, 50, 16, 16), tiles={"m": 128}).describe()
    assert "a last row block of 6 rows of m: the row path" in text
    whole = compile(chainfuse.attention_chain(1, 2, 136, 50, 16, 16), tiles={"m": 136})
    assert "row path" not in whole.describe()
    # a row block's 1..ROWS_TAIL rows past whole strips (and not one more)
    for extra in (1, rows_tail(uk), rows_tail(uk) + 1):
        sq = 2 * uk.nr + extra
        text = compile(chainfuse.attention_chain(1, 2, sq, 50, 16, 16), tiles={"m": sq}).describe()
        said = (
            f"a row block's last {extra} row{'s' * (extra > 1)} of m past whole blocks of {uk.nr}"
        )
        assert (said in text) == (0 < extra <= rows_tail(uk)), text
    rows = compile(chainfuse.gemm_chain(1, ROWS_MAX, 16, 16, 16)).describe()
    assert f"the row path for all {ROWS_MAX} rows of m" in rows and "micro-kernel" not in rows


@pytest.mark.parametrize("between", [None, "relu", "softmax"])
@pytest.mark.parametrize("whole", [True, False])
def test_a_packed_whole_or_block_by_block_over_several_k_and_l_blocks(
    between: str | None, whole: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Aᵀ kept packed for every l block (all of k), or, past AT_WHOLE floats, one k block at a
    # time packed again for each l block: both give the reference's result (tails in m, k, l)
    from chainfuse.kernels import packing

    if not whole:
        monkeypatch.setattr(packing, "AT_WHOLE", 16)
    chain = chainfuse.gemm_chain(2, 37, 13, 45, 29, between)
    kernel = compile(chain, tiles={"m": 20, "l": 7, "k": 8, "n": 6})
    assert kernel.schedule.a_k == (45 if whole else 8)  # all of k, or one block of it
    inputs = reference.random_inputs(chain, seed=3)
    out = kernel(*[inputs[t.name] for t in chain.inputs])
    reference.assert_close(out, reference.run(chain, inputs)["E"], chain)


BROADCAST_SHAPES = st.sampled_from([  # A, B, D shapes: numpy matmul's batch broadcasting
    ((3, 5, 7), (7, 9), (9, 4)),  # an MLP: tokens of a batch, 2-D weights
    ((2, 3, 5, 7), (7, 9), (9, 4)),
    ((5, 7), (2, 7, 9), (2, 9, 4)),  # one A for a batch of weights
    ((2, 5, 7), (1, 7, 9), (2, 9, 4)),
    ((2, 5, 7), (7, 9), (2, 9, 4)),
    ((2, 1, 3, 5, 7), (1, 4, 1, 7, 9), (9, 4)),
    ((0, 5, 7), (7, 9), (9, 4)),  # empty results
    ((3, 0, 7), (7, 9), (9, 4)),
    ((3, 5, 0), (0, 9), (9, 4)),  # a sum over no k: zeros (softmax: D's rows' mean)
])  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=BROADCAST_SHAPES, between=BETWEEN, strided=st.booleans(), kind=st.sampled_from(
    ["numpy", "torch", "out", "strided-out"]))  # fmt: skip
def test_batch_dims_broadcast_as_numpys_matmul(
    shapes: tuple[tuple[int, ...], ...], between: str | None, strided: bool, kind: str
) -> None:
    # against the float64 reference of the same chain on the operands broadcast to the batch
    # shape; A's rows every other row in memory too (`strided`), `out=` contiguous or not
    sa, sb, sd = shapes
    rng = np.random.default_rng(sum(map(sum, shapes)))
    A = rng.standard_normal((*sa[:-2], 2 * sa[-2], sa[-1])).astype(np.float32)
    A = A[..., ::2, :] if strided else A[..., : sa[-2], :]
    B, D = (rng.standard_normal(s).astype(np.float32) for s in (sb, sd))
    shape = chainfuse.ops.gemm_chain_shape(sa, sb, sd)
    lead = shape[:-2]
    batch = int(np.prod(lead))
    chain = chainfuse.gemm_chain(
        *(max(1, n) for n in (batch, sa[-2], sd[-1], sa[-1], sb[-1])), between
    )  # (a chain for the tolerance: sizes of at least 1)
    if 0 in shape:  # (an empty result)
        want = np.zeros(shape)
    elif sa[-1] == 0:  # scores of a sum over no k: 0, each weighing 1/L under a softmax
        scores = np.full((*lead, sa[-2], sb[-1]), 1 / sb[-1] if between == "softmax" else 0.0)
        want = scores @ D.astype(np.float64)
    else:
        a, b, d = (np.broadcast_to(x, (*lead, *x.shape[-2:])).reshape(batch, *x.shape[-2:])
                   for x in (A, B, D))  # fmt: skip
        want = reference.run(chain, {"A": a, "B": b, "D": d})["E"].reshape(shape)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        got = chainfuse.ops.gemm_chain(*(torch.from_numpy(np.ascontiguousarray(x))
                                         for x in (A, B, D)), between=between).numpy()  # fmt: skip
    elif kind in ("out", "strided-out"):
        out = np.full((*shape[:-1], 2 * shape[-1]), np.nan, np.float32)
        out = out[..., ::2] if kind == "strided-out" else out[..., : shape[-1]].copy()
        got = chainfuse.ops.gemm_chain(A, B, D, between=between, out=out)
        assert got is out
    else:
        got = chainfuse.ops.gemm_chain(A, B, D, between=between)
    assert got.shape == shape
    reference.assert_close(got, want, chain)


def test_batch_dims_that_do_not_broadcast_are_named() -> None:
    z = np.zeros
    with pytest.raises(ValueError, match=r"A, B, D: batch dims \(2,\), \(3,\), \(3,\) do not"):
        chainfuse.ops.gemm_chain(z((2, 5, 7), np.float32), z((3, 7, 9), np.float32),
                                 z((3, 9, 4), np.float32))  # fmt: skip
    with pytest.raises(ValueError, match=r"A, B, D: expected \[\.\.\., rows, cols\] each"):
        chainfuse.ops.gemm_chain(z(7, np.float32), z((7, 9), np.float32), z((9, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(3, 5, 4\)"):
        chainfuse.ops.gemm_chain(z((3, 5, 7), np.float32), z((7, 9), np.float32),
                                 z((9, 4), np.float32), out=z((5, 4), np.float32))  # fmt: skip
