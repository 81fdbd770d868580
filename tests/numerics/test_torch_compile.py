"""`chainfuse.torch.attention` inside `torch.compile` and `torch.export`: one operator in the
graph (`torch.ops.chainfuse.attention`), no graph break, the same numbers as SDPA in float64."""

from __future__ import annotations

from typing import Any

import pytest

import chainfuse
from chainfuse import reference

torch = pytest.importorskip("torch")
F = torch.nn.functional
cft = pytest.importorskip("chainfuse.torch")

OP = torch.ops.chainfuse.attention.default


def _inputs(b: int, h: int, hk: int, sq: int, sk: int, e: int, ev: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, sq, e, generator=g), torch.randn(b, hk, sk, e, generator=g),
            torch.randn(b, hk, sk, ev, generator=g))  # fmt: skip


class _Graphs:
    """A torch.compile backend that keeps each graph it is given and runs it as traced."""

    def __init__(self) -> None:
        self.graphs: list[Any] = []

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs.append(gm.graph)
        return gm.forward

    def targets(self) -> list[Any]:
        return [n.target for g in self.graphs for n in g.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "kind",
    [
        "none",
        "causal",
        "bool",
        "additive",
        "scale",
        "gqa",
        "gqa-apart",
        "mask-causal",
        "3d",
        "broadcast",
        "3d-broadcast",
        "5d",
        "ranks",
    ],
)
def test_compiled_attention_is_one_operator_and_matches_sdpa(kind: str) -> None:
    torch._dynamo.reset()  # (every case compiles the same `model` code: more than the 8 recompiles)
    hk = 1 if kind == "gqa" else 3
    q, k, v = _inputs(2, 3, hk, 65, 47, 40, 59, seed=3)
    kw: dict[str, Any] = {}
    if kind == "causal":
        kw["is_causal"] = True
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(65, 47) > 0.3
    elif kind == "additive":
        kw["attn_mask"] = torch.randn(2, 1, 65, 47)
    elif kind == "scale":
        kw["scale"] = 0.3
    elif kind == "gqa":
        kw["enable_gqa"] = True
    elif kind == "mask-causal":  # both applied (SDPA's math path refuses them for d_v != d_qk)
        kw["attn_mask"], kw["is_causal"], v = torch.randn(2, 1, 65, 47), True, v[..., :40]
    elif kind == "gqa-apart":  # q's 6 heads, k's 3 and v's 2: each grouped on its own
        q, v = torch.cat([q, q], 1), v[:, :2]
        kw["enable_gqa"] = True
    elif kind == "3d":
        q, k, v = q[:, 0], k[:, 0], v[:, 0]
    elif kind == "broadcast":  # one batch of k, one head of v: stretched as SDPA stretches them
        k, v = k[:1], v[:1, :1]
    elif kind == "3d-broadcast":
        q, k, v = q[:, 0], k[:1, 0], v[:1, 0]
    elif kind == "5d":  # two batch dims, k's and v's first stretched
        q, k, v = q[None].expand(2, -1, -1, -1, -1), k[None], v[None]
    elif kind == "ranks":  # k 2-D, v 3-D beside a 4-D q: aligned from the right
        k, v = k[0, 0], v[0]
    backend = _Graphs()

    def model(q: Any, k: Any, v: Any) -> Any:
        return cft.attention(q, k, v, **kw) * 2.0

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.no_grad():
        ours = compiled(q, k, v)
    assert len(backend.graphs) == 1
    assert backend.targets().count(OP) == 1
    kw64 = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
            for n, x in kw.items()}  # fmt: skip
    theirs = 2.0 * F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw64)
    chain = chainfuse.attention_chain(2, 3, 65, 47, 40, 59)
    reference.assert_close(ours.double().numpy(), theirs.numpy(), chain)


def test_compiled_attention_takes_new_sequence_lengths_without_retracing() -> None:
    backend = _Graphs()
    compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v), backend=backend,
                             fullgraph=True, dynamic=True)  # fmt: skip
    for sq, sk in ((17, 33), (63, 129), (7, 5)):
        q, k, v = _inputs(1, 2, 2, sq, sk, 16, 24, seed=sq)
        ours = compiled(q, k, v)
        assert ours.shape == (1, 2, sq, 24)
        theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
        chain = chainfuse.attention_chain(1, 2, sq, sk, 16, 24)
        reference.assert_close(ours.double().numpy(), theirs.numpy(), chain)
    assert len(backend.graphs) == 1  # one symbolic-shape graph for all three (none of size 1)


def test_exported_attention_keeps_the_operator() -> None:
    class Attend(torch.nn.Module):
        def forward(self, q: Any, k: Any, v: Any) -> Any:
            return cft.attention(q, k, v, is_causal=True)

    q, k, v = _inputs(2, 2, 2, 31, 31, 24, 24, seed=5)
    exported = torch.export.export(Attend(), (q, k, v))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets == [OP]
    ours = exported.module()(q, k, v)
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    reference.assert_close(ours.double().numpy(), theirs.numpy(),
                           chainfuse.attention_chain(2, 2, 31, 31, 24, 24))  # fmt: skip


def test_compiled_attention_names_a_wrong_shape_while_tracing() -> None:
    q, k, v = _inputs(1, 2, 2, 9, 11, 16, 8, seed=7)
    for wrong, message in ((dict(k=k[..., :5]), "k: expected head dim 16 \\(q's\\)"),
                           (dict(v=v[..., :10, :]), "v: expected 11 keys \\(k's\\)")):  # fmt: skip
        args = {"q": q, "k": k, "v": v, **wrong}
        compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v), backend="eager",
                                 fullgraph=True)  # fmt: skip
        with pytest.raises(Exception, match=message):
            compiled(**args)


def test_compiled_attention_refuses_inputs_that_require_grad() -> None:
    q, k, v = _inputs(1, 2, 2, 9, 11, 16, 8, seed=7)
    compiled = torch.compile(lambda q, k, v: cft.attention(q, k, v), backend="eager")
    with pytest.raises(RuntimeError, match=r"q: requires grad.*no backward"):
        compiled(q.requires_grad_(), k, v)
    with torch.no_grad():
        assert compiled(q, k, v).shape == (1, 2, 9, 8)


def test_eager_calls_do_not_go_through_the_dispatcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside torch.compile the kernel is called directly (the operator's dispatch would add
    its cost to every short call): with the operator's entry broken, eager calls still run."""

    def broken(*args: Any) -> Any:
        raise AssertionError("the operator was called outside torch.compile")

    monkeypatch.setattr(cft, "_attention_op", broken)
    q, k, v = _inputs(1, 1, 1, 5, 6, 8, 8, seed=1)
    ours = cft.attention(q, k, v)
    theirs = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    reference.assert_close(ours.double().numpy(), theirs.numpy(),
                           chainfuse.attention_chain(1, 1, 5, 6, 8, 8))  # fmt: skip


@pytest.mark.slow
def test_inductor_compiles_a_model_around_the_operator() -> None:
    """The default backend (inductor, which generates and compiles C++ for the rest of the
    graph: tens of seconds) keeps the operator as an external call: the same result as the
    block run eagerly (its own matmuls aside, the same kernel)."""

    def block(x: Any, w: Any) -> Any:
        q, k, v = (x @ w).unflatten(-1, (3, 2, 16)).permute(2, 0, 3, 1, 4)
        return cft.attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 37, 32, generator=g), torch.randn(32, 96, generator=g)
    with torch.no_grad():
        ours = torch.compile(block, fullgraph=True)(x, w)
        eager = block(x, w)
    assert ours.shape == (2, 37, 32)
    reference.assert_close(ours.numpy(), eager.double().numpy(),
                           chainfuse.attention_chain(2, 2, 37, 37, 16, 16))  # fmt: skip


GEMM = torch.ops.chainfuse.gemm_chain.default
CONV = torch.ops.chainfuse.conv_chain.default


@pytest.mark.parametrize("between", [None, "relu", "gelu", "softmax"])
@pytest.mark.parametrize("batched", [True, False])
def test_compiled_gemm_chain_is_one_operator_and_matches_reference(
    between: str | None, batched: bool
) -> None:
    chain = chainfuse.gemm_chain(2 if batched else 1, 17, 7, 65, 63, between)
    x = reference.random_inputs(chain, seed=3)
    A, B, D = (torch.from_numpy(x[n]) for n in ("A", "B", "D"))
    if not batched:
        A, B, D = A[0], B[0], D[0]
    backend = _Graphs()
    compiled = torch.compile(lambda a, b, d: cft.gemm_chain(a, b, d, between) - 1.0,
                             backend=backend, fullgraph=True)  # fmt: skip
    ours = compiled(A, B, D) + 1.0
    assert backend.targets().count(GEMM) == 1
    want = reference.run(chain, x)["E"]
    reference.assert_close(ours.numpy(), want if batched else want[0], chain, inputs=x)


def test_compiled_mlp_on_3d_tokens_with_2d_weights_is_one_operator() -> None:
    # x [batch, tokens, dim] with 2-D weights: the operator's shape function broadcasts as
    # ops.gemm_chain does (one call over batch x tokens rows)
    g = torch.Generator().manual_seed(5)
    x, w1, w2 = torch.randn(3, 17, 24, generator=g), torch.randn(24, 40, generator=g), \
        torch.randn(40, 24, generator=g)  # fmt: skip
    backend = _Graphs()
    compiled = torch.compile(lambda a, b, d: cft.gemm_chain(a, b, d, "gelu") + a,
                             backend=backend, fullgraph=True)  # fmt: skip
    ours = compiled(x, w1, w2)
    assert backend.targets().count(GEMM) == 1 and ours.shape == (3, 17, 24)
    want = torch.nn.functional.gelu(x.double() @ w1.double()) @ w2.double() + x.double()
    reference.assert_close(ours.double().numpy(), want.numpy(),
                           chainfuse.gemm_chain(1, 51, 24, 24, 40, "gelu"))  # fmt: skip


@pytest.mark.parametrize("channels_last", [False, True, "unbatched"])
def test_compiled_conv_chain_matches_the_eager_kernel_in_its_layout(
    channels_last: bool | str,
) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 13, 11, generator=g)
    if channels_last is True:
        x = x.to(memory_format=torch.channels_last)
    w1, w2 = torch.randn(16, 8, 3, 3, generator=g) / 8, torch.randn(12, 16, 1, 1, generator=g) / 4
    b1, b2 = torch.randn(16, generator=g), torch.randn(12, generator=g)
    kw: dict[str, Any] = {"stride": (2, 1), "padding": (1, 0), "between": "relu", "after": "relu"}
    backend = _Graphs()
    compiled = torch.compile(lambda *a: cft.conv_chain(*a, **kw), backend=backend,
                             fullgraph=True)  # fmt: skip
    if channels_last == "unbatched":  # [C, H, W]: one image, [K2, P, Q] out
        ours, eager = compiled(x[1], w1, w2, b1, b2), cft.conv_chain(x[1], w1, w2, b1, b2, **kw)
        assert ours.shape == (12, 7, 6) and torch.equal(ours, eager)
        ours, eager = ours[None], eager[None]
        x = x[1:]
    else:
        ours = compiled(x, w1, w2, b1, b2)
        eager = cft.conv_chain(x, w1, w2, b1, b2, **kw)
        assert ours.shape == (2, 12, 7, 6) and ours.stride() == eager.stride()
        assert ours.is_contiguous(memory_format=torch.channels_last) is channels_last
    assert backend.targets().count(CONV) == 1
    assert torch.equal(ours, eager)  # the same kernel on the same numbers
    theirs = F.relu(F.conv2d(F.relu(F.conv2d(x.double(), w1.double(), b1.double(), 2, 1)),
                             w2.double(), b2.double()))  # fmt: skip
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)


def test_compiled_chains_name_wrong_arguments_while_tracing() -> None:
    A, B, D = torch.randn(3, 5), torch.randn(4, 6), torch.randn(6, 2)
    compiled = torch.compile(lambda a, b, d: cft.gemm_chain(a, b, d), backend="eager",
                             fullgraph=True)  # fmt: skip
    with pytest.raises(Exception, match=r"B: expected 5 rows \(A's K\)"):
        compiled(A, B, D)
    x, w = torch.randn(1, 2, 5, 5), torch.randn(2, 2, 1, 1)
    compiled = torch.compile(lambda x, w: cft.conv_chain(x, w, w, stride=(1, 1, 1)),
                             backend="eager", fullgraph=True)  # fmt: skip
    with pytest.raises(
        Exception, match=r"stride: expected two integers \(first conv, second conv\) or one"
    ):
        compiled(x, w)
    compiled = torch.compile(lambda x, w1, w2: cft.conv_chain(x, w1, w2), backend="eager",
                             fullgraph=True)  # fmt: skip
    with pytest.raises(Exception, match=r"w1: kernel 7x7 is larger than its padded input 5x5"):
        compiled(x, torch.randn(2, 2, 7, 7), w)
