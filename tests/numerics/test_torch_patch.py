"""`chainfuse.torch.patch_sdpa`: a model's own calls of
`torch.nn.functional.scaled_dot_product_attention` run chainfuse's attention, unchanged code."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import chainfuse
from chainfuse import reference

torch = pytest.importorskip("torch")
F = torch.nn.functional
cft = pytest.importorskip("chainfuse.torch")
ORIGINAL = F.scaled_dot_product_attention


class Attend(torch.nn.Module):
    """Self-attention as Hugging Face models write it: SDPA looked up on the module at each call,
    dropout_p by training mode, a mask or is_causal."""

    def __init__(self, dim: int = 48, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x: Any, mask: Any = None, causal: bool = False) -> Any:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.1 if self.training else 0.0, is_causal=causal
        )
        return y.transpose(1, 2).reshape(b, n, d)


def _model(dtype: Any = None) -> Any:
    torch.manual_seed(0)
    model = Attend().eval()
    return model.to(dtype) if dtype is not None else model


def _x(n: int = 37, dtype: Any = None) -> Any:
    x = torch.randn(2, n, 48, generator=torch.Generator().manual_seed(n))
    return x.to(dtype) if dtype is not None else x


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "additive", "bool-causal"])
def test_a_models_sdpa_calls_run_chainfuse(kind: str) -> None:
    # (a mask with is_causal: PyTorch's fused CPU kernel applies both, and so does chainfuse)
    model, x = _model(), _x()
    mask = None
    causal = kind.endswith("causal")
    if kind.startswith("bool"):
        mask = torch.rand(37, 37, generator=torch.Generator().manual_seed(1)) > 0.3
    elif kind == "additive":
        mask = torch.randn(2, 1, 37, 37, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.double()(x.double(), None if mask is None else
                              (mask if mask.dtype == torch.bool else mask.double()), causal)  # fmt: skip
        model.float()
        with cft.patch_sdpa(strict=True) as patch:
            assert F.scaled_dot_product_attention is not ORIGINAL
            got = model(x, mask, causal)
            got2 = model(x, mask, causal)
    assert F.scaled_dot_product_attention is ORIGINAL
    assert patch.calls == 2 and not patch.fallbacks
    chain = chainfuse.attention_chain(2, 4, 37, 37, 12, 12)
    reference.assert_close(got.double().numpy(), want.numpy(), chain)
    assert torch.equal(got, got2)


def test_calls_chainfuse_cannot_run_go_to_pytorch_counted_and_warned_once() -> None:
    x = _x()
    with cft.patch_sdpa() as patch:
        with torch.no_grad(), pytest.warns(RuntimeWarning, match="dtype torch.float64") as seen:
            model = _model(torch.float64)
            want = model(x.double())
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a second call with the same reason: no warning
                again = model(x.double())
        assert len(seen) == 1
        model = _model().train()
        with pytest.warns(RuntimeWarning, match="dropout_p > 0"):
            model(x).sum().backward()  # training: dropout, grad, PyTorch's SDPA
    assert patch.fallbacks == {"dtype torch.float64": 2, "dropout_p > 0": 1}
    assert patch.calls == 0
    assert torch.equal(want, again)
    assert model.qkv.weight.grad is not None


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (lambda q: (q.double(), q.double(), q.double()), "dtype torch.float64"),
        (lambda q: (q, q, q.double()), "mixed dtypes"),
        (lambda q: (q[0, 0, 0], q[0, 0], q[0, 0]), "1-D inputs"),
    ],
)  # fmt: skip
def test_strict_patch_names_what_chainfuse_cannot_run(args: Any, reason: str) -> None:
    q = torch.randn(2, 3, 9, 8)
    with cft.patch_sdpa(strict=True), torch.no_grad():
        with pytest.raises(ValueError, match=f"chainfuse cannot run calls with {reason}"):
            F.scaled_dot_product_attention(*args(q))


def test_strided_rows_run_chainfuse_from_a_copy() -> None:
    # q, k, v whose last dimension is not contiguous (heads from a conv's [.., d, s] layout)
    q = torch.randn(2, 3, 8, 9).transpose(-1, -2)
    k, v = torch.randn(2, 3, 8, 9).transpose(-1, -2), torch.randn(2, 3, 9, 8)
    with cft.patch_sdpa(strict=True) as patch, torch.no_grad():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert patch.calls == 1 and not patch.fallbacks
    torch.testing.assert_close(got, ORIGINAL(q, k, v, is_causal=True))


def test_errors_of_the_call_itself_are_raised_not_passed_on() -> None:
    q = torch.randn(1, 2, 5, 8)
    with cft.patch_sdpa() as patch, torch.no_grad():
        with pytest.raises(ValueError, match="k: expected head dim 8"):
            F.scaled_dot_product_attention(q, q[..., :4], q)
        with pytest.raises(ValueError, match="v: expected 5 keys"):
            F.scaled_dot_product_attention(q, q, q[..., :3, :])
    assert not patch.fallbacks


def test_broadcast_5d_2d_and_mixed_rank_calls_run_chainfuse() -> None:
    # what SDPA takes beyond 4-D operands of equal batch and heads: run here, not passed on
    q = torch.randn(2, 3, 4, 9, 8)
    with cft.patch_sdpa(strict=True) as patch, torch.no_grad():
        five = F.scaled_dot_product_attention(q, q[:1], q[:1])
        one_kv = F.scaled_dot_product_attention(q[0], q[:1, 0], q[:1, 0, :1])
        ranks = F.scaled_dot_product_attention(q[0, 0, 0], q[0, 0], q[0])
    torch.testing.assert_close(five, ORIGINAL(q, q[:1], q[:1]))
    torch.testing.assert_close(one_kv, ORIGINAL(q[0], q[:1, 0], q[:1, 0, :1]))
    torch.testing.assert_close(ranks, ORIGINAL(q[0, 0, 0], q[0, 0], q[0]))
    assert patch.calls == 3 and not patch.fallbacks


def test_patches_nest_and_restore_on_error() -> None:
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(KeyError), cft.patch_sdpa() as outer:
        with cft.patch_sdpa() as inner:
            with torch.no_grad():
                F.scaled_dot_product_attention(q, q, q)
        assert F.scaled_dot_product_attention is not ORIGINAL
        raise KeyError("in the block")
    assert F.scaled_dot_product_attention is ORIGINAL
    assert (inner.calls, outer.calls) == (1, 0)
    with pytest.raises(RuntimeError, match="already active"), outer, outer:
        pass
    assert F.scaled_dot_product_attention is ORIGINAL


def test_a_model_compiled_inside_the_patch_keeps_chainfuses_operator() -> None:
    model, x = _model(), _x(29)
    targets: list[Any] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    with torch.no_grad():
        want = model(x, causal=True)
        with cft.patch_sdpa(strict=True):
            got = torch.compile(model, backend=backend, fullgraph=True)(x, causal=True)
    assert torch.ops.chainfuse.attention.default in targets
    reference.assert_close(got.double().numpy(), want.double().numpy(),
                           chainfuse.attention_chain(2, 4, 29, 29, 12, 12))  # fmt: skip


def test_chainfuse_torch_runs_on_torchs_threads_unless_chainfuse_set_a_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a model's calls follow torch.set_num_threads as PyTorch's own ops do (a server that runs
    # each worker on one thread is not oversubscribed by the patch); chainfuse's own setting wins
    # (the threads each kernel is launched on: a repeat call skips ops.attention's checks)
    from chainfuse import compiled

    seen: list[tuple[str, int]] = []
    real = compiled.Kernel.launch

    def spy(self: Any, pointers: Any, strides: Any, mask: Any, threads: int, *a: Any) -> None:
        seen.append(("attention" if "softmax" in self.spec.name else "gemm_chain", threads))
        real(self, pointers, strides, mask, threads, *a)

    monkeypatch.setattr(compiled.Kernel, "launch", spy)
    q, w = torch.randn(1, 2, 9, 8), torch.randn(8, 8)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cft.attention(q, q, q)
            cft.gemm_chain(q[0, 0], w, w, "relu")
            with cft.patch_sdpa(strict=True), torch.no_grad():
                F.scaled_dot_product_attention(q, q, q)
        torch.set_num_threads(1)
        cft.attention(q, q, q)  # a repeat call (replayed, unchecked) follows torch too
        chainfuse.set_num_threads(2)
        cft.attention(q, q, q)
    finally:
        chainfuse.set_num_threads(None)
        torch.set_num_threads(before)
    assert [n for _, n in seen] == [1, 1, 1, 2, 2, 2, 1, 2]
    assert [name for name, _ in seen][:3] == ["attention", "gemm_chain", "attention"]
