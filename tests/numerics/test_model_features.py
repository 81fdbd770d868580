"""What real models' MLPs need from a GEMM chain, against the float64 reference and PyTorch:
biases on either GEMM, tanh-GELU / quick-GELU / SiLU, nn.Linear's `[out, in]` weights read as
stored (B = W1.T, D = W2.T), and the gated (SwiGLU) MLP; fp32, bf16 and fp16.

Each structure (activation, biases, layouts, dtype) is one compiled object, and a compile costs
seconds, so the structures below cover every activation, every bias and layout choice and
every dtype without taking their product; hypothesis then draws sizes and tiles through them
(sizes and tiles are run-time arguments: no compile per draw).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import chainfuse
from chainfuse import builders, ops, reference
from chainfuse.compiler import compile
from chainfuse.ir import ACTIVATION_NAMES
from tests.checks import check_against_reference, huge_in_float64, torch_activation

torch = pytest.importorskip("torch")
F = torch.nn.functional

AWKWARD = st.one_of(st.sampled_from([1, 7, 17, 63, 65, 129]), st.integers(1, 140))
TILES = st.sampled_from(
    [None, {"m": 16, "l": 6, "k": 7, "n": 6}, {"m": 7, "l": 17, "k": 1, "n": 5}]
)

#: (between, B transposed, D transposed, bias1, bias2, dtype): every activation with both
#: biases and both weights as nn.Linear stores them; each layout and bias alone; each dtype
STRUCTURES = [
    (None, True, True, True, True, "float32"),
    ("relu", True, True, True, True, "float32"),
    ("gelu", True, True, True, True, "float32"),
    ("gelu_tanh", True, True, True, True, "float32"),
    ("quick_gelu", True, True, True, True, "float32"),
    ("silu", True, True, True, True, "float32"),
    ("relu6", True, True, True, True, "float32"),
    ("hardswish", True, True, True, True, "float32"),
    ("mish", True, True, True, True, "float32"),
    ("squared_relu", True, True, True, True, "float32"),
    ("softmax", True, True, True, True, "float32"),
    ("relu", True, False, True, False, "float32"),
    ("gelu_tanh", False, True, False, True, "float32"),
    ("silu", True, True, True, True, "bfloat16"),
    ("gelu_tanh", False, True, True, False, "float16"),
    ("mish", True, True, True, True, "bfloat16"),
    ("softmax", False, True, True, True, "bfloat16"),
]
#: (act, weights transposed, dtype) of the gated MLPs
#: (relu: the one activation the micro-kernel applies as it stores, which a gated MLP's up
#: projection must not take)
GATED = [("silu", True, "float32"), ("gelu_tanh", False, "bfloat16"), ("gelu", True, "float16"),
         ("relu", True, "float32"), ("relu", False, "float32"), ("hardswish", True, "float32")]  # fmt: skip

ACTS = {name: torch_activation(name) for name in (None, *ACTIVATION_NAMES, "softmax")}


def _tensor(x: np.ndarray, dtype: str) -> object:
    # exact: random_inputs gives values of the dtype already (bf16 ones as float32 arrays)
    return torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, dtype))


def _chain(
    structure: tuple[object, ...], b: int, M: int, N: int, K: int, L: int
) -> chainfuse.Chain:
    between, b_t, d_t, bias1, bias2, dtype = structure
    return builders.gemm_chain(b, M, N, K, L, between, dtype, b_transposed=b_t,  # type: ignore[arg-type]
                               d_transposed=d_t, bias1=bias1, bias2=bias2)  # type: ignore[arg-type]  # fmt: skip


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    structure=st.sampled_from(STRUCTURES), b=st.integers(1, 2), M=AWKWARD, N=AWKWARD, K=AWKWARD,
    L=AWKWARD, tiles=TILES, seed=st.integers(0, 2**16),
)  # fmt: skip
def test_chains_match_reference(
    structure: tuple[object, ...], b: int, M: int, N: int, K: int, L: int,
    tiles: dict[str, int] | None, seed: int,
) -> None:  # fmt: skip
    """The kernel of each structure, called with the chain's own inputs (B as [L, K] and D as
    [N, L] where transposed), against the float64 reference."""
    chain = _chain(structure, b, M, N, K, L)
    dtype = str(structure[-1])
    convert = None if dtype == "float32" else (lambda a: _tensor(a, dtype))
    kernel = compile(chain, tiles=tiles)
    check_against_reference(kernel, chain, seed=seed, softmax_term=True, convert=convert)


@pytest.mark.parametrize("past", [-5, 3])
@pytest.mark.parametrize("between", ["gelu", "softmax"])
def test_weights_stored_transposed_in_place_or_packed(past: int, between: str) -> None:
    """Row blocks just under and just over the strips up to which B and D stored transposed
    are read in place (`DIRECT_ROW_STRIPS`): the same sums either way, tails included."""
    from chainfuse.codegen.gemm_chain import DIRECT_ROW_STRIPS

    chain = builders.gemm_chain(1, 8, 5, 6, 7, between, b_transposed=True, d_transposed=True)
    nr = compile(chain).spec.kernel.nr
    rows = DIRECT_ROW_STRIPS * nr + past
    chain = builders.gemm_chain(1, 2 * rows + 7, 29, 37, 23, between, b_transposed=True,
                                d_transposed=True, bias1=True, bias2=True)  # fmt: skip
    kernel = compile(chain, tiles={"m": rows, "l": 18, "k": 16, "n": 13})
    check_against_reference(kernel, chain, seed=rows)


def _linear_mlp(
    x: object, w1: object, w2: object, between: str | None, b1: object, b2: object
) -> object:
    """PyTorch's composition in float64: what an nn.Linear MLP computes."""
    h = F.linear(x.double(), w1.double(), None if b1 is None else b1.double())  # type: ignore[attr-defined]
    return F.linear(ACTS[between](h), w2.double(), None if b2 is None else b2.double())  # type: ignore[attr-defined]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    structure=st.sampled_from(STRUCTURES), tokens=AWKWARD, K=AWKWARD, L=AWKWARD, N=AWKWARD,
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_ops_match_pytorch_linears(
    structure: tuple[object, ...], tokens: int, K: int, L: int, N: int, seed: int
) -> None:
    """`ops.gemm_chain` on x [2, tokens, dim] and nn.Linear weights [out, in] (passed as `.T`
    views where the structure reads them transposed, else as contiguous copies) against
    F.linear / F.gelu / F.silu in float64, within the shared tolerance."""
    between, b_t, d_t, bias1, bias2, dtype = structure
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, str(dtype))
    x = torch.randn(2, tokens, K, generator=gen).to(dt)
    w1 = (torch.randn(L, K, generator=gen) / math.sqrt(K)).to(dt)
    w2 = (torch.randn(N, L, generator=gen) / math.sqrt(L)).to(dt)
    b1 = torch.randn(L, generator=gen).to(dt) if bias1 else None
    b2 = torch.randn(N, generator=gen).to(dt) if bias2 else None
    B = w1.T if b_t else w1.T.contiguous()
    D = w2.T if d_t else w2.T.contiguous()
    got = ops.gemm_chain(x, B, D, between, bias1=b1, bias2=b2)
    assert got.dtype == dt and tuple(got.shape) == (2, tokens, N)
    want = _linear_mlp(x, w1, w2, between, b1, b2)  # type: ignore[arg-type]
    chain = _chain(structure, 1, 2 * tokens, N, K, L)
    reference.assert_close(got.float().numpy(), want.numpy(), chain)  # type: ignore[attr-defined]
    assert ops.calls.gemm_kernels.cache_info().currsize >= 1


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gated=st.sampled_from(GATED), b=st.integers(1, 2), M=AWKWARD, N=AWKWARD, K=AWKWARD,
    L=AWKWARD, tiles=TILES, seed=st.integers(0, 2**16),
)  # fmt: skip
def test_gated_mlp_matches_reference(
    gated: tuple[str, bool, str], b: int, M: int, N: int, K: int, L: int,
    tiles: dict[str, int] | None, seed: int,
) -> None:  # fmt: skip
    act, transposed, dtype = gated
    chain = builders.gated_mlp_chain(b, M, N, K, L, act, dtype, b_transposed=transposed,
                                     d_transposed=transposed)  # fmt: skip
    convert = None if dtype == "float32" else (lambda a: _tensor(a, dtype))
    kernel = compile(chain, tiles=tiles)
    assert kernel.spec.gated  # one fused kernel (on AMX too, where the host runs it)
    check_against_reference(kernel, chain, seed=seed, convert=convert)


@pytest.mark.parametrize("gated", GATED)
@pytest.mark.parametrize("tokens", [1, 17, 130])
def test_gated_mlp_matches_pytorch(gated: tuple[str, bool, str], tokens: int) -> None:
    """`ops.gated_mlp` on Llama-style nn.Linear weights (`.T` views, or contiguous copies)
    against PyTorch's `down(act(gate(x)) * up(x))` in float64."""
    act, transposed, dtype = gated
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(tokens)
    K, L, N = 48, 97, 40
    x = torch.randn(3, tokens, K, generator=gen).to(dt)
    wg, wu = ((torch.randn(L, K, generator=gen) / math.sqrt(K)).to(dt) for _ in range(2))
    wd = (torch.randn(N, L, generator=gen) / math.sqrt(L)).to(dt)
    views = [w.T if transposed else w.T.contiguous() for w in (wg, wu, wd)]
    got = ops.gated_mlp(x, *views, act=act)
    xd = x.double()
    want = F.linear(ACTS[act](F.linear(xd, wg.double())) * F.linear(xd, wu.double()), wd.double())
    chain = builders.gated_mlp_chain(1, 3 * tokens, N, K, L, act, dtype)
    reference.assert_close(got.float().numpy(), want.numpy(), chain)
    out = torch.empty_like(got)
    assert ops.gated_mlp(x, *views, act=act, out=out) is out
    assert torch.equal(out, got)


@pytest.mark.parametrize("structure", STRUCTURES[:7], ids=lambda s: str(s[0]))
def test_nan_and_inf_propagate_as_in_pytorch(structure: tuple[object, ...]) -> None:
    """Scores of -inf, inf and NaN, and a NaN bias element: NaN and inf where PyTorch's fp32
    composition has them (silu, quick gelu and tanh gelu of -inf are NaN; relu of NaN is NaN)."""
    between = structure[0]
    x = torch.tensor([[-math.inf], [math.inf], [math.nan], [1.0], [-2.0]])
    w1 = torch.ones(5, 1)  # every score of a row is its x
    w2 = torch.full((3, 5), 0.5)
    b1, b2 = torch.zeros(5), torch.zeros(3)
    got = ops.gemm_chain(x, w1.T, w2.T, between, bias1=b1, bias2=b2)
    want = F.linear(huge_in_float64(ACTS[between], F.linear(x, w1, b1)), w2, b2)
    assert torch.equal(got.isnan(), want.isnan()), (got, want)
    assert torch.equal(got.isinf(), want.isinf()), (got, want)
    fine = ~(want.isnan() | want.isinf())
    torch.testing.assert_close(got[fine], want[fine])
    b1[2] = math.nan
    got = ops.gemm_chain(x[3:], w1.T, w2.T, between, bias1=b1, bias2=b2)
    assert got.isnan().all()  # (every row's scores include the NaN)


def test_custom_ops_trace_without_graph_breaks() -> None:
    """An nn.Linear MLP and a SwiGLU MLP calling `chainfuse.torch` under torch.compile with
    dynamic sequence lengths: one graph each (fullgraph), the operators in it, eager's
    results."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import chainfuse.torch as cft

    gen = torch.Generator().manual_seed(0)
    fc1, fc2 = torch.nn.Linear(24, 70), torch.nn.Linear(70, 24)
    gate, up, down = (torch.nn.Linear(24, 70, bias=False), torch.nn.Linear(24, 70, bias=False),
                      torch.nn.Linear(70, 24, bias=False))  # fmt: skip

    def mlp(x: object) -> object:
        return cft.gemm_chain(x, fc1.weight.T, fc2.weight.T, "gelu_tanh", fc1.bias, fc2.bias)

    def swiglu(x: object) -> object:
        return cft.gated_mlp(x, gate.weight.T, up.weight.T, down.weight.T)

    cases = [
        (mlp, lambda x: fc2(F.gelu(fc1(x), approximate="tanh")), "gemm_chain"),
        (swiglu, lambda x: down(F.silu(gate(x)) * up(x)), "gated_mlp"),
    ]
    for fn, eager, op in cases:
        for backend in ("eager", "aot_eager"):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend(backend)
            compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
            with torch.no_grad():
                for tokens in (3, 17, 40):
                    x = torch.randn(2, tokens, 24, generator=gen)
                    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
            assert counter.frame_count == 1
            graph = counter.graphs[0]
            assert any(f"chainfuse.{op}" in str(n.target) for n in graph.graph.nodes)


def test_bias_and_weight_errors_name_the_argument() -> None:
    x, w1, w2 = torch.randn(4, 8), torch.randn(16, 8), torch.randn(5, 16)
    with pytest.raises(ValueError, match=r"bias1: expected shape \(16,\) \(B's L\)"):
        ops.gemm_chain(x, w1.T, w2.T, "silu", bias1=torch.randn(8))
    with pytest.raises(ValueError, match="bias2: expected a 1-D vector"):
        ops.gemm_chain(x, w1.T, w2.T, "silu", bias2=torch.randn(1, 5))
    with pytest.raises(TypeError, match="bias2: expected dtype float32"):
        ops.gemm_chain(x, w1.T, w2.T, "silu", bias2=torch.randn(5, dtype=torch.float64))
    with pytest.raises(
        ValueError, match=r"between: expected None, 'relu', 'gelu', .*'squared_relu'"
    ):
        ops.gemm_chain(x, w1.T, w2.T, "swish")
    with pytest.raises(ValueError, match="W3: expected the layout of W1"):
        ops.gated_mlp(x, w1.T, w1.T.contiguous(), w2.T)
    with pytest.raises(ValueError, match="W3: expected W1's shape"):
        ops.gated_mlp(x, w1.T, w1.T[:, :3], w2.T)
    with pytest.raises(ValueError, match=r"act: expected one of \['relu', 'gelu'"):
        ops.gated_mlp(x, w1.T, w1.T, w2.T, act="swish")
    import chainfuse.torch as cft

    def bad(t: object) -> object:
        return cft.gemm_chain(t, w1.T, w2.T, "relu", torch.randn(3))

    with pytest.raises(Exception, match="bias1: expected shape"):
        torch.compile(bad, backend="eager", fullgraph=True)(x)


def test_empty_sums_keep_the_biases() -> None:
    """K = 0: the scores are bias1 alone; L = 0: the result is bias2 (as F.linear's)."""
    x, w1, w2 = torch.randn(3, 0), torch.randn(6, 0), torch.randn(4, 6)
    b1, b2 = torch.randn(6), torch.randn(4)
    got = ops.gemm_chain(x, w1.T, w2.T, "silu", bias1=b1, bias2=b2)
    torch.testing.assert_close(got, F.linear(F.silu(F.linear(x, w1, b1)), w2, b2))
    got = ops.gemm_chain(torch.randn(3, 5), torch.randn(5, 0), torch.randn(0, 4), bias2=b2)
    torch.testing.assert_close(got, b2.expand(3, 4))


def test_planned_part_leaves_biases_out_and_doubles_a_gate() -> None:
    chain = builders.gemm_chain(1, 8, 5, 6, 7, "silu", b_transposed=True, bias1=True, bias2=True)
    planned = builders.planned_part(chain)
    plain = builders.gemm_chain(1, 8, 5, 6, 7, "silu", b_transposed=True)
    assert [str(op) for op in planned.ops] == [str(op).replace("C[", "C1[", 1) if i == 0 else
                                               str(op).replace("(C[", "(C1[") for i, op in
                                               enumerate(plain.ops)]  # fmt: skip
    assert {t.name for t in planned.inputs} == {"A", "B", "D"}
    assert planned.outputs[0].name == "E"
    gated = builders.planned_part(builders.gated_mlp_chain(2, 8, 5, 6, 7))
    assert gated.extents["k"] == 12 and len(gated.contractions) == 2


def test_repeat_calls_replay_with_new_operands() -> None:
    """A second call with operands like the first's (same shapes, strides, dtypes) runs from
    what the first call's checks found, with the new operands' pointers: biases and W3
    included."""
    gen = torch.Generator().manual_seed(5)
    plain = builders.gemm_chain(1, 18, 7, 16, 33, "silu", bias1=True, bias2=True)
    gated = builders.gated_mlp_chain(1, 18, 7, 16, 33)
    hits = ops.calls.replays.hits
    for _ in range(3):
        x = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
        w1, w3 = (torch.randn(33, 16, generator=gen, dtype=torch.float64) / 4 for _ in range(2))
        w2 = torch.randn(7, 33, generator=gen, dtype=torch.float64) / math.sqrt(33)
        b1, b2 = torch.randn(33, generator=gen), torch.randn(7, generator=gen)
        x32, w1_32, w3_32, w2_32 = (t.float() for t in (x, w1, w3, w2))
        got = ops.gemm_chain(x32, w1_32.T, w2_32.T, "silu", bias1=b1, bias2=b2)
        want = F.linear(F.silu(F.linear(x, w1, b1.double())), w2, b2.double())
        reference.assert_close(got.numpy(), want.numpy(), plain)
        got = ops.gated_mlp(x32, w1_32.T, w3_32.T, w2_32.T)
        want = F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)
        reference.assert_close(got.numpy(), want.numpy(), gated)
    assert ops.calls.replays.hits >= hits + 4


def test_a_models_parameters_replay_without_grad_and_are_refused_with_it() -> None:
    """nn.Linear's weights (nn.Parameter, requires_grad) under no_grad: the second call is a
    replay, right; the same weights with grad mode on are still refused by name."""
    gen = torch.Generator().manual_seed(6)
    fc1, fc2 = torch.nn.Linear(16, 40), torch.nn.Linear(40, 7)
    chain = builders.gemm_chain(1, 9, 7, 16, 40, "gelu", bias1=True, bias2=True)
    ops.calls.clear()
    for _ in range(2):
        x = torch.randn(9, 16, generator=gen)
        with torch.no_grad():
            got = ops.gemm_chain(x, fc1.weight.T, fc2.weight.T, "gelu", bias1=fc1.bias,
                                 bias2=fc2.bias)  # fmt: skip
            w1, b1, w2, b2 = (p.double() for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
            want = F.linear(F.gelu(F.linear(x.double(), w1, b1)), w2, b2)
        reference.assert_close(got.numpy(), want.numpy(), chain)
    assert ops.calls.replays.hits == 1
    with pytest.raises(RuntimeError, match="B: requires grad"):
        ops.gemm_chain(x, fc1.weight.T, fc2.weight.T, "gelu", bias1=fc1.bias, bias2=fc2.bias)


@pytest.mark.parametrize("between", list(ACTS))
def test_handoff_to_pytorch_computes_the_same_chain(between: str | None) -> None:
    """A 16-bit call handed to PyTorch (`chainfuse.torch.handoff`, where the model predicts
    PyTorch's ops faster) computes the chain with its biases and activation, weights as
    `W.T` views; the decision itself takes such calls."""
    from chainfuse.torch import handoff

    gen = torch.Generator().manual_seed(3)
    x, w1, w2 = (torch.randn(*s, generator=gen) for s in ((2, 5, 12), (20, 12), (6, 20)))
    b1, b2 = torch.randn(20, generator=gen), torch.randn(6, generator=gen)
    got = handoff.torch_gemm_chain(x, w1.T, w2.T, between, b1, b2)  # (fp32: one rounding order)
    torch.testing.assert_close(got, F.linear(ACTS[between](F.linear(x, w1, b1)), w2, b2))
    half = [t.bfloat16() for t in (x, w1, w2, b1, b2)]
    why = handoff.gemm_chain_reason(half[0], half[1].T, half[2].T, between, half[3], half[4])
    assert why is None or "bfloat16" in why


def test_rows_vary_builds_every_row_counts_kernel_on_the_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A gelu MLP first called with 8 rows under `ops.rows_vary()` compiles it for every
    micro-kernel a row count selects (on an AVX-512 host three); later calls of 40 and 100 rows
    run kernels of those, and every result is right."""
    import sys

    from chainfuse.compiler import micro_kernel

    calls = sys.modules["chainfuse.ops.calls"]
    ops.calls.clear()
    names: list[str] = []
    real = calls.compile

    def named(chain: Any, **kw: Any) -> Any:
        kernel = real(chain, **kw)
        names.append(kernel.spec.kernel.name)
        return kernel

    monkeypatch.setattr(calls, "compile", named)
    gen = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(24, 96, generator=gen), torch.randn(96, 40, generator=gen) / 10

    def check(rows: int) -> None:
        x = torch.randn(rows, 24, generator=gen)
        torch.testing.assert_close(ops.gemm_chain(x, w1, w2, "gelu"), F.gelu(x @ w1) @ w2)

    with ops.rows_vary():
        check(8)
    built = set(names)
    chains = (builders.gemm_chain(1, rows, 40, 24, 96, "gelu") for rows in calls.ROW_PROBES)
    assert built == {micro_kernel(c) for c in chains}
    for rows in (40, 100):
        check(rows)
    assert set(names) == built
