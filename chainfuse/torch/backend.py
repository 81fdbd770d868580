"""The `torch.compile` backend "chainfuse": find the chains of a model's graph, fuse each one
where the fused kernel is measured faster, and compile the rest with Inductor.

    model = torch.compile(model, backend="chainfuse")         # the entry point: no import needed
    model = chainfuse.torch.compile(model, mode="eager")      # options: see `Options`

Per graph Dynamo hands over (torch-level ops, parameters as inputs):
  1. a graph that needs a backward (grad mode on and an input that requires grad) goes to
     Inductor unchanged: chainfuse's kernels are for inference;
  2. the parameters become constants of the graph (freezing), so that weights can be packed once
     and Inductor freezes them too (its `freezing` option alone, set after Dynamo traced, does
     not: Dynamo has already made the parameters inputs);
  3. PyTorch's attention modules, one node each (`nn.MultiheadAttention`, the encoder layer's
     fast path), are written out as the ops they run (`unfold`); where no chain ends up fused,
     the graph is compiled as Dynamo gave it;
  4. the graph runs once on the example inputs (every node's value recorded), `finder.find`
     lists the chains, `rewrite.Emitter` writes each as one chainfuse operator, `decide` times it
     against the unfused nodes (compiled by Inductor as the graph will be, in mode "inductor";
     run by PyTorch in mode "eager") and keeps the faster;
  5. the rewritten graph goes to Inductor (`compile_fx`, freezing on) or runs as it is (eager);
     in mode "inductor", where a chain was fused, the whole-graph check (`guard.check_graph`)
     times it against Inductor's code for the plain graph and returns the faster.
The chainfuse operators have shape functions over symbolic sizes: a graph compiled with dynamic
shapes serves every sequence length without building another kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from chainfuse.ops.calls import rows_vary
from chainfuse.torch.decide import Decision, decide, predicted_time
from chainfuse.torch.finder import ChainKind, Found, find
from chainfuse.torch.guard import GraphCheck, check_graph, compile_graph, describe, plain_copy
from chainfuse.torch.kinds import NUMBER, Kind, kind_of, value_of
from chainfuse.torch.rewrite import (
    Capabilities,
    Emitter,
    attribute,
    external_inputs,
    nan_rows,
    score_terms,
)
from chainfuse.torch.unfold import unfold, unfoldable

__all__ = ["Backend", "ChainReport", "Options", "Report", "backend", "compile"]


@dataclass(frozen=True)
class Options:
    """`mode`: "inductor" (compile the rewritten graph with Inductor) or "eager" (run it as
    is); `freeze`: treat the parameters as constants (inference; weights changed after the
    compile are not seen, as with Inductor's freezing); `measure`: time each chain against its
    unfused ops, compiled by Inductor in mode "inductor" (False: fuse every chain the build can
    run, no timing); `fuse`: False finds and reports only; `check_graph`: in mode "inductor"
    with `measure`, time the rewritten graph against the plain one (both compiled by Inductor)
    and keep the faster."""

    mode: str = "inductor"
    freeze: bool = True
    measure: bool = True
    fuse: bool = True
    check_graph: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("inductor", "eager"):
            raise ValueError(f"mode: expected 'inductor' or 'eager', got {self.mode!r}")


@dataclass
class ChainReport:
    name: str
    form: str
    fused: bool
    why: str
    decision: Decision | None = None


@dataclass
class Report:
    """What the backend did with every graph it compiled (filled as graphs are compiled)."""

    graphs: int = 0
    chains: list[ChainReport] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    graph_checks: list[GraphCheck] = field(default_factory=list)


class Backend:
    """A Dynamo backend: `backend(gm, example_inputs) -> callable`."""

    def __init__(self, options: Options | None = None, report: Report | None = None) -> None:
        self.options = options or Options()
        self.report = report if report is not None else Report()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        self.report.graphs += 1
        training = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs
        )
        if training:
            self.report.notes.append(
                f"graph {self.report.graphs}: needs a backward (grad mode on, inputs that "
                "require grad): compiled unchanged (chainfuse's kernels are for inference)"
            )
            return self._compile(gm, list(example_inputs), freeze=False)
        keep = (
            _freeze(gm, example_inputs) if self.options.freeze else list(range(len(example_inputs)))
        )
        inputs = [example_inputs[i] for i in keep]
        plain = self._plain(gm)
        # (where no chain ends up fused, the graph runs as Dynamo gave it: PyTorch's own
        # attention ops, not the ops `unfold` writes them as)
        given = plain if plain is not None or not unfoldable(gm.graph) else _copy(gm)
        before = len(self.report.chains)
        # (sizes that vary: every row count's micro-kernel is built now, not at a later length)
        dynamic = _symbolic(gm, example_inputs)
        with rows_vary() if dynamic else contextlib.nullcontext():
            self._rewrite(gm, inputs)
        fused = any(c.fused for c in self.report.chains[before:])
        if plain is not None and fused:
            compiled = self._check(gm, plain, inputs, self.report.chains[before:])
        else:
            kept = gm if fused or given is None else given
            compiled = self._compile(kept, inputs, freeze=self.options.freeze)
        if dynamic and fused:
            compiled = _in_rows_vary(compiled)
        if len(keep) == len(example_inputs):
            return compiled

        def run(*args: Any) -> Any:
            # (Dynamo passes only the inputs the graph still has placeholders for; a caller
            # passing them all gets them picked)
            if len(args) == len(keep):
                return compiled(*args)
            return compiled(*[args[i] for i in keep])

        return run

    def _plain(self, gm: fx.GraphModule) -> fx.GraphModule | None:
        """A copy of `gm` before the rewrite, for the whole-graph check (None: no check, and
        where the options ask for one, the reason noted)."""
        checked = self.options.mode == "inductor" and self.options.measure
        if not (checked and self.options.check_graph and self.options.fuse):
            return None
        number = self.report.graphs
        if _writes_state(gm.graph):
            self.report.notes.append(f"graph {number}: no whole-graph check: the graph writes "
                                     "to an input or a buffer (timing would repeat the writes)")  # fmt: skip
            return None
        try:
            return plain_copy(gm)
        except Exception as exc:  # (a graph holding what cannot be copied: reported)
            self.report.notes.append(f"graph {number}: no whole-graph check: the graph could "
                                     f"not be copied ({exc!r:.200})")  # fmt: skip
            return None

    def _compile(self, gm: fx.GraphModule, inputs: list[Any], freeze: bool) -> Callable[..., Any]:
        if self.options.mode == "eager":
            return gm.forward
        return compile_graph(gm, inputs, freeze)

    def _check(
        self, gm: fx.GraphModule, plain: fx.GraphModule, inputs: list[Any],
        chains: list[ChainReport],
    ) -> Callable[..., Any]:  # fmt: skip
        """The whole-graph check: the faster of `gm` (rewritten) and `plain` under Inductor
        (where `plain` is kept, the graph's `chains` are reported unfused)."""
        # (a symbolic size is timed at the value it was traced with)
        concrete = [a.node.hint if isinstance(a, torch.SymInt) else a for a in inputs]
        constants = [describe(attribute(plain, str(n.target)))
                     for n in plain.graph.nodes if n.op == "get_attr"]  # fmt: skip
        key = [plain.code, gm.code, torch.get_num_threads(), constants,
               *[describe(a) for a in concrete]]  # fmt: skip
        freeze = self.options.freeze
        compiled, check = check_graph(
            self.report.graphs, key, lambda: self._compile(gm, inputs, freeze),
            lambda: self._compile(plain, inputs, freeze), concrete,
        )  # fmt: skip
        self.report.graph_checks.append(check)
        for chain in chains if not check.kept_rewritten else []:
            if chain.fused:
                chain.fused = False
                chain.why += f" (unfused: graph {check.graph}'s whole-graph check kept it plain)"
        return compiled

    def _rewrite(self, gm: fx.GraphModule, inputs: list[Any]) -> None:
        written, kept_whole = unfold(gm.graph)
        if written:
            self.report.notes.append(f"graph {self.report.graphs}: PyTorch's modules written out "
                                     f"as the ops they run: {', '.join(written)}")  # fmt: skip
        gm.recompile()
        interp = fx.Interpreter(gm, garbage_collect_values=False)
        # (a symbolic size runs at the value it was traced with, read without a guard)
        concrete = [a.node.hint if isinstance(a, torch.SymInt) else a for a in inputs]
        with torch.no_grad():
            interp.run(*concrete)
        values = interp.env
        for node, value in values.items():  # (the unfolded nodes have no traced values)
            node.meta.setdefault("example_value", value)
            if isinstance(value, int | float) and not isinstance(value, bool):
                node.meta[NUMBER] = float(value)
        finding = find(gm.graph)
        self.report.skipped += kept_whole + finding.skipped
        emitter = Emitter(gm, Capabilities.detect(), self.options.freeze, values.__getitem__)
        for found in finding.chains:
            refusal = emitter.refusal(found)
            if refusal is not None:
                self.report.chains.append(ChainReport(found.name, found.form, False, refusal))
                continue
            if not self.options.fuse:
                self.report.chains.append(
                    ChainReport(found.name, found.form, False, "found (fuse=False)")
                )
                continue
            decision = self._decide(gm, found, emitter, values)
            why = decision.why
            if decision.fuse:
                new = _replace(gm, found, emitter)
                # (a later chain may read this one's result: its value, for that decision)
                values[new], emitter.replaced[found.output] = values[found.output], new
                if emitter.packs(found):
                    amx = "" if found.kind is ChainKind.CONV else " for the AMX kernels"
                    why += f"; weights packed once{amx}"
            self.report.chains.append(
                ChainReport(found.name, found.form, decision.fuse, why, decision)
            )
        used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        sources: Any = getattr(gm, "_param_name_to_source", None)
        for name in emitter.added:
            if name not in used:
                delattr(gm, name)
            elif sources is not None:
                from torch._dynamo.source import ConstantSource

                sources[name] = ConstantSource(name)
        gm.graph.lint()
        gm.recompile()

    def _decide(
        self, gm: fx.GraphModule, found: Found, emitter: Emitter, values: dict[fx.Node, Any]
    ) -> Decision:
        ext = external_inputs(found)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        nodes = sorted(found.nodes, key=order.__getitem__)

        def unfused(graph: fx.Graph, env: dict[fx.Node, Any]) -> Any:
            for n in nodes:
                env[n] = graph.node_copy(n, env.__getitem__)
            return env[found.output]

        def fused(graph: fx.Graph, env: dict[fx.Node, Any]) -> Any:
            return emitter.emit(found, graph, lambda a: env[a] if isinstance(a, fx.Node) else a)

        inductor_mode = self.options.mode == "inductor"
        # a conv chain's images as Inductor's graph will hold them: channels-last where its
        # layout optimization runs the model's convolutions so (as the rewritten graph passes
        # them to the operator, whose layout is flexible); timed so on both sides
        channels_last = (
            found.kind is ChainKind.CONV and inductor_mode and _layout_optimized(gm.graph)
        )
        runs, modules = [], []
        for write in (fused, unfused):
            graph, env, args = fx.Graph(), {}, []
            for n in ext:
                if n.op == "get_attr":
                    env[n] = graph.get_attr(str(n.target))
                else:
                    env[n] = graph.placeholder(n.name)
                    args.append(_channels_last(values[n]) if channels_last else values[n])
            graph.output(write(graph, env))
            module = fx.GraphModule(gm, graph)
            runs.append(functools.partial(_no_grad_call, module, args))
            modules.append((module, args))
        eager = runs[1]

        def compiled(i: int) -> Callable[[], Any]:
            """modules[i] compiled by Inductor as the final graph is, called once (a failure at
            the first call is Inductor's too)."""
            module, args = modules[i]
            graph = compile_graph(module, args, self.options.freeze, isolated=True)
            call = functools.partial(_no_grad_call, graph, args)
            call()
            return call

        def inductor() -> tuple[Callable[[], Any], str]:
            """The unfused nodes compiled by Inductor (else, where it fails, run eagerly, with
            the reason in the decision)."""
            try:
                call = compiled(1)
            except Exception as exc:  # (any failure of Inductor's: reported in the decision)
                reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                return eager, (f"the unfused ops run eagerly (Inductor failed on them: "
                               f"{type(exc).__name__}: {reason})")  # fmt: skip
            return call, "Inductor's code for the unfused ops"

        def fused_as_run() -> Callable[[], Any]:
            """The fused call as the model will run it: with ops of its own beside the kernel
            (the masks made one), compiled by Inductor, which fuses them with each other (else,
            where Inductor fails on them, as they run eagerly)."""
            if not _has_torch_ops(modules[0][0].graph):
                return runs[0]
            try:
                return compiled(0)
            except Exception:  # (Inductor failed on them: timed as they run eagerly)
                return runs[0]

        timed = inductor if inductor_mode else None
        key = [found.kind.value, found.form, torch.get_num_threads(), _constants(found.parts),
               self.options.mode, self.options.freeze, *[describe(values[n]) for n in ext],
               channels_last]  # fmt: skip
        return decide(key, runs[0], eager, _predicted(found, values), self.options.measure,
                      timed, fused_as_run if inductor_mode else None)  # fmt: skip


def _layout_optimized(graph: fx.Graph) -> bool:
    """Whether Inductor will run `graph`'s convolutions channels-last: its layout optimization
    is on and the graph convolves (its own test, `decide_layout_opt`, also weighs their sizes;
    where it keeps NCHW, the whole-graph check still measures the graph as it runs)."""
    import torch._inductor.config as inductor_config

    return bool(inductor_config.layout_optimization) and any(
        kind_of(n) is Kind.CONV for n in graph.nodes
    )


def _channels_last(value: Any) -> Any:
    """A 4-D image batch in channels-last memory order (the same values); anything else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 4 and value.is_floating_point():
        return value.contiguous(memory_format=torch.channels_last)
    return value


def _copy(gm: fx.GraphModule) -> fx.GraphModule | None:
    """`plain_copy(gm)`, or None where the graph holds what cannot be copied."""
    try:
        return plain_copy(gm)
    except Exception:  # (then the unfolded graph runs: the same numbers)
        return None


def _has_torch_ops(graph: fx.Graph) -> bool:
    """Whether a fused chain's graph computes anything besides chainfuse's call and views of
    its operands (`rewrite.score_terms`, `rewrite.nan_rows`)."""
    return any(n.target in (score_terms, nan_rows) for n in graph.nodes)


def _writes_state(graph: fx.Graph) -> bool:
    """Whether a node of `graph` writes in place to an input or a constant (`x.add_(...)`,
    `x[i] = ...`, `out=`)."""
    import operator

    state = {n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        in_place = node.target is operator.setitem or (name.endswith("_") and
                                                       not name.startswith("_"))  # fmt: skip
        written = [node.args[0]] if in_place and node.args else []
        written += [node.kwargs["out"]] if "out" in node.kwargs else []
        if any(w in state for w in written):
            return True
    return False


def _no_grad_call(module: Callable[..., Any], args: list[Any]) -> Any:
    with torch.no_grad():
        return module(*args)


def _constants(parts: dict[str, Any]) -> list[str]:
    """The plain settings of a chain (is_causal, scale, strides, ...), for its decision's key."""
    plain = (bool, int, float, str, type(None))
    found = []
    for name, value in sorted(parts.items()):
        if isinstance(value, dict):
            found += [f"{name}.{k}={v!r}" for k, v in sorted(value.items()) if isinstance(v, plain)]
        elif isinstance(value, plain):
            found.append(f"{name}={value!r}")
    return found


def _predicted(found: Found, values: dict[fx.Node, Any]) -> float | None:
    p = found.parts
    if found.kind in (ChainKind.MLP, ChainKind.GATED_MLP):
        gated = found.kind is ChainKind.GATED_MLP
        first, second = (p["up"][0], p["down"]) if gated else (p["first"], p["second"])
        x, w1, w2 = values[first.x], values[first.weight], values[second.weight]
        hidden = w1.shape[0] if first.transposed else w1.shape[1]
        hidden //= 1 if first.half is None else 2  # (W1 and W3 one weight: its half)
        out = w2.shape[0] if second.transposed else w2.shape[1]
        dims = {"M": math.prod(x.shape[:-1]), "K": x.shape[-1], "L": hidden, "N": out,
                "between": p["act"] if gated else p["between"]}  # fmt: skip
        return predicted_time("gated_mlp" if gated else "mlp", dims, x.dtype)
    if found.kind in (ChainKind.SDPA, ChainKind.ATTENTION):
        q, v = values[p["q"]], values[p["v"]]
        seq_k = v.shape[-2]
        if q.dim() not in (3, 4):
            return None
        batch, heads = (q.shape[0], q.shape[1]) if q.dim() == 4 else (1, q.shape[0])
        dims = {"batch": batch, "heads": heads, "seq_q": q.shape[-2], "seq_k": seq_k,
                "d": q.shape[-1], "dv": v.shape[-1], "causal": bool(p.get("is_causal", False))}  # fmt: skip
        return predicted_time("attention", dims, q.dtype)
    return None


def _replace(gm: fx.GraphModule, found: Found, emitter: Emitter) -> fx.Node:
    """`found`'s nodes replaced by its fused call, written just before its last node; returns
    the call's node."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    last = max(found.nodes, key=order.__getitem__)
    with graph.inserting_before(last):
        new = emitter.emit(found, graph, lambda a: a)
    new.meta["example_value"] = value_of(found.output)
    found.output.replace_all_uses_with(new)
    for node in sorted(found.nodes, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
    return new


def _freeze(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[int]:
    """Make the graph's parameter inputs constants (get_attr) of `gm`; returns the indices of
    the inputs that stay inputs. The source of each is kept where Dynamo keeps it, for AOT
    autograd's bookkeeping of lifted constants."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = getattr(gm, "_param_name_to_source", None)
    keep = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        grapharg = node.meta.get("grapharg")
        if not isinstance(value, torch.nn.Parameter) or grapharg is None or sources is None:
            keep.append(i)
            continue
        name = f"_cf_param_{i}"
        gm.register_parameter(name, value)
        sources[name] = grapharg.source
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.recompile()
    return keep


#: the backend `torch.compile(model, backend="chainfuse")` uses (default options)
backend = Backend()


def _symbolic(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph's sizes vary: a symbolic size among its inputs or its placeholders'
    traced shapes."""
    if any(isinstance(a, torch.SymInt) for a in example_inputs):
        return True
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in value.shape
        ):
            return True
    return False


def _in_rows_vary(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled`, each call under `ops.calls.rows_vary` (a length whose rows select another
    micro-kernel builds that chain's whole set at once; found kernels cost a set lookup)."""

    def run(*args: Any) -> Any:
        with rows_vary():
            return compiled(*args)

    return run


def compile(model: Any, *, dynamic: bool | None = None, fullgraph: bool = False,
            **options: Any) -> Any:  # fmt: skip
    """`torch.compile(model, backend="chainfuse")` with `Options` (mode, freeze, measure, fuse):
    `chainfuse.torch.compile(model, mode="eager")`. `dynamic` and `fullgraph` go to
    `torch.compile`. With `freeze` (the default), Inductor's freezing is on while Dynamo
    traces, as Inductor with freezing runs: Dynamo then installs the parameters as constants
    itself and leaves them out of the graph's inputs and guards."""
    settings = Options(**options)
    compiled: Any = torch.compile(model, backend=Backend(settings), dynamic=dynamic,
                             fullgraph=fullgraph)  # fmt: skip
    if not settings.freeze:
        return compiled

    @functools.wraps(model.forward if isinstance(model, torch.nn.Module) else model)
    def frozen(*args: Any, **kwargs: Any) -> Any:
        with torch._inductor.config.patch(freezing=True):
            return compiled(*args, **kwargs)

    return frozen
