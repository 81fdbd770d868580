"""`chainfuse.torch.explain(model, *inputs)`: what the backend does with a model, and what it is
worth.

Compiles `model` with the chainfuse backend (a fresh compile, recorded), runs it on `inputs`
(without grad), and prints every chain found, whether it was fused and why (the fused call's
time against its baseline's, named: Inductor's code for the unfused ops in mode "inductor"),
its predicted and measured times, the whole-graph check (the rewritten graph against the plain
one, both compiled by Inductor), every compute op left out of a chain with the reason, and the
share of the compiled model's time spent in fused chains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chainfuse.torch.backend import Backend, Options, Report
from chainfuse.torch.decide import time_call

__all__ = ["Explanation", "explain"]


def _us(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


@dataclass
class Explanation:
    model: str
    report: Report
    eager_s: float
    compiled_s: float

    @property
    def fused_s(self) -> float:
        return sum(c.decision.fused_s or 0.0 for c in self.report.chains
                   if c.fused and c.decision is not None)  # fmt: skip

    @property
    def share(self) -> float:
        return self.fused_s / self.compiled_s if self.compiled_s > 0 else 0.0

    def __str__(self) -> str:
        r = self.report
        fused = [c for c in r.chains if c.fused]
        lines = [
            f"chainfuse.torch.explain: {self.model}, {r.graphs} graph(s), "
            f"{torch.get_num_threads()} thread(s)",
            f"chains found: {len(r.chains)}, fused: {len(fused)}",
            f"  {'':9} {'chain':28} {'form':44} {'predicted':>10} {'fused':>10} {'baseline':>10}",
        ]
        for c in r.chains:
            d = c.decision
            tag = "[fused]" if c.fused else "[kept]"
            times = (_us(d.predicted_s), _us(d.fused_s), _us(d.baseline_s)) if d else ("-",) * 3
            cached = " (decision cached)" if d is not None and d.cached else ""
            lines.append(f"  {tag:9} {c.name:28} {c.form:44} {times[0]:>10} {times[1]:>10} "
                         f"{times[2]:>10}  {c.why}{cached}")  # fmt: skip
        if r.graph_checks:
            lines.append("whole-graph check (Inductor's code, rewritten graph against plain):")
        for g in r.graph_checks:
            tag = "[rewritten]" if g.kept_rewritten else "[plain]"
            cached = " (decision cached)" if g.cached else ""
            lines.append(f"  {tag:11} graph {g.graph}: rewritten {_us(g.rewritten_s)}, plain "
                         f"{_us(g.plain_s)}  {g.why}{cached}")  # fmt: skip
        if r.skipped:
            lines.append("compute ops in no chain:")
            lines += [f"  {name:28} {why}" for name, why in r.skipped]
        lines += [f"note: {n}" for n in r.notes]
        lines.append(
            f"time: eager {_us(self.eager_s)}, chainfuse {_us(self.compiled_s)} "
            f"({self.eager_s / self.compiled_s:.2f}x eager); fused chains {_us(self.fused_s)} = "
            f"{100 * self.share:.1f} % of the compiled model's time"
        )
        return "\n".join(lines)


def explain(
    model: Any, *inputs: Any, show: bool = True, rounds: int = 3, **options: Any
) -> Explanation:
    """Compile `model` with the chainfuse backend (`Options` from `options`), run it on
    `inputs`, time it against eager (`rounds` interleaved rounds, the best of each), print the
    explanation (unless `show=False`) and return it. Timings on a busy machine are noisy; the
    decisions are the backend's own."""
    report = Report()
    settings = Options(**options)
    traced: Any = torch.compile(model, backend=Backend(settings, report))

    def compiled(*args: Any) -> Any:  # (as chainfuse.torch.compile: freezing while tracing)
        with torch._inductor.config.patch(freezing=settings.freeze):
            return traced(*args)

    with torch.no_grad():
        compiled(*inputs)
        eager_s = compiled_s = float("inf")
        for _ in range(rounds):  # interleaved: a busy machine slows both alike
            eager_s = min(eager_s, time_call(lambda: model(*inputs), budget_s=0.05))
            compiled_s = min(compiled_s, time_call(lambda: compiled(*inputs), budget_s=0.05))
    result = Explanation(type(model).__name__, report, eager_s, compiled_s)
    if show:
        print(result)
    return result
