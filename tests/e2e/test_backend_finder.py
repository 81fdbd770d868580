"""The chain finder on hand-written modules (each form it knows, and what ends a chain), and the
fuse-or-not decision (the slower call is never kept; the decision is kept on disk)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("chainfuse.torch")

from chainfuse.torch import decide as decide_mod  # noqa: E402
from chainfuse.torch.backend import Backend, Options, Report  # noqa: E402
from chainfuse.torch.finder import ChainKind, find  # noqa: E402

nn, F = torch.nn, torch.nn.functional


def _graph(fn: Any, *inputs: Any) -> Any:
    """The Dynamo FX graph of `fn(*inputs)` (as the backend receives it)."""
    graphs: list[Any] = []

    def keep(gm: Any, example_inputs: Any) -> Any:
        graphs.append(gm.graph)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=keep, fullgraph=True)(*inputs)
    return graphs[0]


W1, W2 = torch.randn(48, 32), torch.randn(32, 48)
B1, B2 = torch.randn(48), torch.randn(32)
X = torch.randn(2, 5, 32)


@pytest.mark.parametrize(
    ("fn", "form"),
    [
        (lambda x: F.linear(F.relu(F.linear(x, W1, B1)), W2, B2),
         "linear+bias -> relu -> linear+bias"),
        (lambda x: F.gelu(x @ W1.t() + B1) @ W2.t() + B2, "x @ W.t() + b -> gelu -> x @ W.t() + b"),
        (lambda x: F.linear(F.gelu(F.linear(x, W1), approximate="tanh"), W2),
         "linear -> gelu_tanh -> linear"),
        (lambda x: (lambda h: h * torch.sigmoid(1.702 * h))(x @ W1.t()) @ W2.t(),
         "x @ W.t() -> quick_gelu -> x @ W.t()"),
        (lambda x: (lambda h: h * torch.sigmoid(h))(F.linear(x, W1)) @ W2.t(),
         "linear -> silu -> x @ W.t()"),
        (lambda x: F.linear(F.dropout(F.silu(F.linear(x, W1)), 0.1, False), W2),
         "linear -> silu -> dropout -> linear"),
        (lambda x: torch.addmm(B2, F.relu(torch.addmm(B1, x[0], W1.t())), W2.t()),
         "addmm -> relu -> addmm"),
    ],
)  # fmt: skip
def test_mlp_forms(fn: Any, form: str) -> None:
    found = find(_graph(fn, X))
    assert [c.form for c in found.chains] == [form]


def test_gated_mlp_and_what_ends_a_chain() -> None:
    W3 = torch.randn(48, 32)

    def fn(x: Any) -> Any:
        gated = F.linear(F.silu(F.linear(x, W1)) * F.linear(x, W3), W2)
        return F.linear(F.layer_norm(F.linear(gated, W1), (48,)), W2)

    found = find(_graph(fn, X))
    assert [c.kind for c in found.chains] == [ChainKind.GATED_MLP]
    assert any("layer_norm" in why for _, why in found.skipped)


def test_written_out_attention_with_a_mask() -> None:
    q, k, v = torch.randn(2, 3, 7, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 8)
    mask = torch.randn(1, 1, 7, 9)

    def fn(q: Any, k: Any, v: Any, m: Any) -> Any:
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(16) + m, dim=-1) @ v

    report = Report()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(fn, backend=Backend(Options(mode="eager", measure=False), report))(
            q, k, v, mask
        )
    (chain,) = report.chains
    assert chain.form == "matmul -> scale -> + mask -> softmax -> matmul" and chain.fused
    torch.testing.assert_close(got, fn(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_decision_keeps_the_faster_and_is_remembered(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHAINFUSE_CACHE_DIR", str(tmp_path))
    t = torch.ones(3)

    def slow() -> Any:
        time.sleep(2e-3)
        return t

    first = decide_mod.decide(["case"], slow, lambda: t, None)
    assert not first.fuse and not first.cached
    assert first.fused_s is not None and first.baseline_s is not None
    again = decide_mod.decide(["case"], slow, lambda: t, None)
    assert again.cached and not again.fuse
    assert decide_mod.decide(["other"], lambda: t, slow, None).fuse
    wrong = decide_mod.decide(["wrong"], lambda: t + 1, lambda: t, None)
    assert not wrong.fuse and "differs" in wrong.why
