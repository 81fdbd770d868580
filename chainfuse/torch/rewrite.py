"""Write a found chain as one chainfuse operator call (`torch.ops.chainfuse.*`) into an FX graph.

    linear(x, W1, b1) -> gelu -> linear(., W2, b2)
    ==>  chainfuse.gemm_chain(x, W1ᵀ, W2ᵀ, "gelu", b1, b2)            (bias on both GEMMs)
    ==>  chainfuse.gemm_chain(x, W1ᵀ, W2ᵀ, "relu") + b2              (a build without biases)

What a call may take depends on the chainfuse build (`Capabilities`): a form the build lacks
is not emitted, and the reason is returned instead, so that the finder's chain shows up in
`explain` as found but not fused. `nn.Linear`'s `[out, in]` weights go in as `W.t()` views
where the build reads them as stored; else, for frozen weights, as `[in, out]` copies made once
here (constants of the graph), never per call.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from chainfuse import ops
from chainfuse.codegen.amx_chain import AMX_MAX_WORKSPACE, amx_workspace_bytes
from chainfuse.ir import ACTIVATION_NAMES, Activation, DType
from chainfuse.kernels.amx import amx_absent, amx_path
from chainfuse.operands import dense_in
from chainfuse.torch.finder import ChainKind, Found, Gemm
from chainfuse.torch.kinds import value_of

__all__ = ["Capabilities", "Emitter", "attribute", "external_inputs"]


@dataclass(frozen=True)
class Capabilities:
    """What this chainfuse build's operators take (read from their signatures)."""

    bias: bool  # gemm_chain's bias1 / bias2
    weight_views: bool  # B and D may be `W.t()` views of nn.Linear weights
    activations: frozenset[str]
    gated_mlp: bool

    @classmethod
    def detect(cls) -> Capabilities:
        params = inspect.signature(ops.gemm_chain).parameters
        op = torch.ops.chainfuse.gemm_chain.default
        schema = {a.name for a in op._schema.arguments}
        bias = "bias1" in params and "bias1" in schema
        known = {a.value for a in Activation} & set(ACTIVATION_NAMES)
        gated = hasattr(ops, "gated_mlp") and hasattr(torch.ops.chainfuse, "gated_mlp")
        return cls(bias, bias, frozenset(known), gated)


def external_inputs(found: Found) -> list[fx.Node]:
    """The nodes a chain reads that are not its own, in first-use order."""
    inside = set(found.nodes)
    seen: dict[fx.Node, None] = {}
    for node in found.nodes:
        fx.node.map_arg((node.args, node.kwargs), lambda a: seen.setdefault(a, None) or a)
    return [n for n in seen if n not in inside]


def _paddings(first: dict[str, Any], second: dict[str, Any], pairs: bool = False) -> Any:
    """A conv chain's padding as the operator takes it, `[first, second]` with the second's
    after each axis appended where it differs; `pairs`: as `ops` takes it, `(first, second)`
    or `(first, (before, after))`."""
    before, after = second["padding"], second.get("pad_after", second["padding"])
    if pairs:
        return (first["padding"], before if after == before else (before, after))
    return [first["padding"], before] + ([after] if after != before else [])


def _dtype(node: Any) -> torch.dtype | None:
    value = value_of(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _dense(
    graph: fx.Graph, env: Callable[[Any], Any], node: fx.Node, transposed: bool = False
) -> fx.Node:
    """`node` (its last two dimensions swapped where `transposed`) in `graph`, with its last
    dimension contiguous, as the kernels read q, k, v and an MLP's x: a contiguous copy where it
    is not (SqueezeBERT's heads come from a conv's `[.., d, s]` layout, LeViT's tokens after a
    subsampling attention are a transposed view). The copy moves s·d elements where the
    attention does s²·d multiply-adds (an MLP: its rows' K where it does K·L); the decision
    times it with the kernel."""
    value = value_of(node)
    dim = -2 if transposed else -1
    out = graph.call_method("transpose", (env(node), -2, -1)) if transposed else env(node)
    if isinstance(value, torch.Tensor) and (value.shape[dim] == 1 or value.stride(dim) == 1):
        return out
    return graph.call_method("contiguous", (out,))


def _dense_image(graph: fx.Graph, env: Callable[[Any], Any], node: fx.Node) -> fx.Node:
    """A conv chain's input `node` in `graph`, NCHW or channels-last as the kernel reads it: a
    copy in the nearer of the two where it is neither (YOLO's C2f convolves one channel half of
    a `chunk`: a channels-last view whose pixels lie twice its channels apart)."""
    value, out = value_of(node), env(node)
    assert isinstance(out, fx.Node)
    if not isinstance(value, torch.Tensor) or value.dim() != 4:
        return out
    shape, strides = tuple(value.shape), tuple(value.stride())
    if any(dense_in(order, shape, strides) for order in ((0, 1, 2, 3), (0, 2, 3, 1))):
        return out
    last = torch.channels_last if strides[1] == 1 else torch.contiguous_format
    return graph.call_method("contiguous", (out,), {"memory_format": last})


def _half_of(g: Gemm) -> slice:
    """The output features of g's half (`Gemm.half`) in its weight."""
    n = value_of(g.end).shape[-1] // 2  # (`finder._halves` checked it is even)
    return slice(n * (g.half or 0), n * ((g.half or 0) + 1))


def _name(g: Gemm) -> str:
    """g's weight as part of a buffer's name (its half's too)."""
    name = str(g.weight.target).replace(".", "_")
    return name if g.half is None else f"{name}_half{g.half}"


class Emitter:
    """Emits chains into `gm`'s graph (or a standalone copy for timing). `frozen`: the weights
    are constants of the graph (get_attr), so they may be packed or folded once here;
    `value(node)` gives a node's recorded example value (folding batch norms needs them)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        caps: Capabilities,
        frozen: bool,
        value: Callable[[fx.Node], Any],
    ) -> None:
        self.gm, self.caps, self.frozen, self.value = gm, caps, frozen, value
        self.added: list[str] = []  # buffers registered on gm (packed or folded weights)
        self._conv_packs: dict[str, ops.PackedConvWeights] = {}  # (by the weights' names)
        self._folds: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (`_linear_folded`'s)
        # a fused chain's result node for the node it replaced: a later chain's parts may
        # still name the old one (a conv chain whose input is the previous chain's result)
        self.replaced: dict[fx.Node, fx.Node] = {}

    def refusal(self, found: Found) -> str | None:
        """Why this build cannot call a chainfuse operator for `found` (None: it can)."""
        try:
            self._check(found)
        except _Refused as exc:
            return str(exc)
        return None

    def emit(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        """The fused call written into `graph` at its insertion point, `env` mapping the
        chain's external input nodes to `graph`'s; returns the node of the chain's result."""
        emit = {
            ChainKind.MLP: self._mlp,
            ChainKind.GATED_MLP: self._gated,
            ChainKind.SDPA: self._sdpa,
            ChainKind.ATTENTION: self._attention,
            ChainKind.CONV: self._conv,
        }[found.kind]
        moved = self.replaced
        return emit(found, graph, lambda a: env(moved.get(a, a) if isinstance(a, fx.Node) else a))

    # -- checks -----------------------------------------------------------------------------

    def _check(self, found: Found) -> None:
        p = found.parts
        if found.kind is ChainKind.MLP:
            g1, g2 = p["first"], p["second"]
            if p["between"] not in self.caps.activations:
                raise _Refused(f"{p['between']} between the GEMMs is not in this chainfuse")
            if g1.bias is not None and not self.caps.bias:
                raise _Refused("a bias on the first GEMM (gemm_chain's bias1) is not in this "
                               "chainfuse")  # fmt: skip
            self._operands(g1.x, g1.weight, g2.weight)
            self._readable(g1, g2)
            if (value_of(g1.x).dim() != value_of(g2.out).dim()) and value_of(g2.out).dim() != 2:
                raise _Refused("views between the GEMMs change the rows' layout")
            for g in (g1, g2):
                if g.bn is not None and not self._constant(g.weight):
                    raise _Refused("batch norms are folded only into frozen weights")
                if g.bn is not None and not self.caps.bias:
                    raise _Refused("a folded batch norm's bias (gemm_chain's biases) is not in "
                                   "this chainfuse")  # fmt: skip
        elif found.kind is ChainKind.GATED_MLP:
            if not self.caps.gated_mlp:
                raise _Refused("the gated MLP (three GEMMs) is not in this chainfuse")
            (g1, g3), g2 = p["up"], p["down"]
            if p["act"] not in self.caps.activations:
                raise _Refused(f"{p['act']} in a gated MLP is not in this chainfuse")
            self._operands(g1.x, g1.weight, g3.weight, g2.weight)
            self._readable(g1, g2, g3)
        elif found.kind in (ChainKind.SDPA, ChainKind.ATTENTION):
            q, v = p["q"], p["v"]
            k = p.get("k", p.get("kt"))
            self._operands(q, k, v)
            for mask in p.get("masks", (p["mask"],)):
                if mask is not None and _dtype(mask) not in (torch.bool, _dtype(q)):
                    raise _Refused(f"a mask of dtype {_dtype(mask)}")
            if isinstance(p.get("scale"), fx.Node):
                raise _Refused("a scale computed at run time")
        elif found.kind is ChainKind.CONV:
            first, second = p["first"], p["second"]
            dtype = _dtype(first["x"])
            if dtype == torch.bfloat16 and amx_path(DType.BFLOAT16) is None:
                raise _Refused(
                    f"a bfloat16 conv chain runs on AMX tiles only: {amx_absent(DType.BFLOAT16)}"
                )
            if dtype not in (torch.float32, torch.bfloat16):
                raise _Refused(
                    f"chainfuse's conv chain is float32 or bfloat16; this one is {dtype}"
                )
            if p["groups"] != 1 and dtype != torch.float32:
                raise _Refused(f"a depthwise second conv runs in float32 only; this one is {dtype}")
            if (p["bn1"] or p["bn2"]) and not self.frozen:
                raise _Refused("batch norms are folded only into frozen weights")
            for c in (first, second):
                if not self._constant(c["w"]) and (p["bn1"] or p["bn2"]):
                    raise _Refused("conv weights are not constants of the graph")

    def _operands(self, *nodes: Any) -> None:
        dtypes = {_dtype(n) for n in nodes}
        if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16, torch.float16}:
            raise _Refused(f"dtypes {sorted(map(str, dtypes))} (one of float32, bfloat16, "
                           "float16 for every operand)")  # fmt: skip

    def _readable(self, *gemms: Gemm) -> None:
        for g in gemms:
            if g.transposed and not (self.caps.weight_views or self._constant(g.weight)):
                raise _Refused("W.t() weights that are not frozen (this chainfuse reads no "
                               "transposed view): compile with freezing")  # fmt: skip

    def _constant(self, node: fx.Node) -> bool:
        return self.frozen and node.op == "get_attr"

    # -- emission ---------------------------------------------------------------------------

    def _buffer(self, graph: fx.Graph, name: str, make: Callable[[], torch.Tensor]) -> fx.Node:
        """A constant of the graph, made once (packed or folded weights)."""
        if not hasattr(self.gm, name):
            self.gm.register_buffer(name, make().contiguous())
            self.added.append(name)
        node = graph.get_attr(name)
        node.meta["example_value"] = getattr(self.gm, name)
        return node

    def _weight(self, g: Gemm, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        """g's weight as the [in, out] operand of a chain (a view: its half where `g.half`; with
        a batch norm, the folded weight, a constant of the graph stored as the weight is)."""
        if g.bn is not None:
            kept = self._buffer(graph, f"_cf_bnlw_{_name(g)}", lambda: self._linear_folded(g)[0])
            return graph.call_method("t", (kept,)) if g.transposed else kept
        if g.transposed and not self.caps.weight_views:
            return self._buffer(graph, f"_cf_t_{_name(g)}", lambda: self._matrix(g))
        if g.view is not None:  # x @ W.t(): the graph's own [in, out] view
            w: fx.Node = env(g.view)
        else:
            w = env(g.weight)
            w = graph.call_method("t", (w,)) if g.transposed else w
        if g.half is not None:
            w = graph.call_function(operator.getitem, (w, (slice(None), _half_of(g))))
        return w

    def packs(self, found: Found) -> bool:
        """Whether `found`'s fused call reads its weights packed once (`_packed`)."""
        p = found.parts
        if found.kind is ChainKind.MLP:
            return self._packable(p["first"], p["second"]) is not None
        if found.kind is ChainKind.GATED_MLP:
            (g1, g3), g2 = p["up"], p["down"]
            return self._packable(g1, g2, g3) is not None
        if found.kind is ChainKind.CONV:  # (`_conv_packed`: frozen constants)
            convs = ((p["first"], p["bn1"]), (p["second"], p["bn2"]))
            return self.frozen and all(
                bn is not None or self._constant(conv["w"]) for conv, bn in convs
            )
        return False

    def _packable(self, g1: Gemm, g2: Gemm, g3: Gemm | None = None) -> list[torch.Tensor] | None:
        """The chain's weights B, D [, B3] as [in, out] matrices where the AMX kernels will read
        them packed once: frozen bf16 constants, on a host that runs those kernels on them;
        else None (the kernels read the weights as stored)."""
        gemms = (g1, g2) if g3 is None else (g1, g2, g3)
        if not all(self._constant(g.weight) for g in gemms) or _dtype(g1.x) != torch.bfloat16:
            return None
        if amx_path(DType.BFLOAT16) is None:
            return None
        mats = [self._matrix(g) for g in gemms]
        K, N = mats[0].shape[0], mats[1].shape[1]
        if amx_workspace_bytes(K, N, g3 is not None) > AMX_MAX_WORKSPACE:
            return None  # (the fp32 path runs it: it reads the weights as stored)
        return mats

    def _packed(self, graph: fx.Graph, g1: Gemm, g2: Gemm, g3: Gemm | None = None) -> Any:
        """The chain's weights packed once for the AMX kernels (`ops.pack_weights`), a constant
        of the graph, where `_packable`; else None."""
        mats = self._packable(g1, g2, g3)
        if mats is None:
            return None
        gemms = (g1, g2) if g3 is None else (g1, g2, g3)
        names = "_".join(_name(g) for g in gemms)
        return self._buffer(graph, f"_cf_pk_{names}", lambda: ops.pack_weights(*mats))

    def _bias(self, g: Gemm, graph: fx.Graph, env: Callable[[Any], Any]) -> Any:
        """g's bias (with a batch norm: the folded one, a constant of the graph), or None."""
        if g.bn is not None:
            return self._buffer(graph, f"_cf_bnlb_{_name(g)}", lambda: self._linear_folded(g)[1])
        return env(g.bias) if g.bias is not None else None

    def _linear_folded(self, g: Gemm) -> tuple[torch.Tensor, torch.Tensor]:
        """g's frozen weight (as stored) and bias with the eval batch norm after it folded in
        (`_norm`: each output feature scaled and shifted); in float32, rounded once to the
        weight's dtype."""
        assert g.bn is not None
        made = self._folds.get(_name(g))  # (read for the weight, the bias and the packing)
        if made is None:
            stored = attribute(self.gm, str(g.weight.target)).detach()
            b = self.value(g.bias).detach().float() if g.bias is not None else 0.0
            scale, shift = self._norm(g.bn)
            folded = stored.float() * (scale[:, None] if g.transposed else scale[None, :])
            made = folded.to(stored.dtype), (b * scale + shift).to(stored.dtype)
            self._folds[_name(g)] = made
        return made

    def _matrix(self, g: Gemm) -> torch.Tensor:
        """g's frozen weight as the [in, out] matrix of a chain (a view; with a batch norm, the
        folded weight)."""
        if g.bn is not None:
            folded = self._linear_folded(g)[0]
            return folded.t() if g.transposed else folded
        w: torch.Tensor = getattr(self.gm, str(g.weight.target)).detach()
        if g.half is not None:
            w = w[_half_of(g)] if g.transposed else w[:, _half_of(g)]
        return w.t() if g.transposed else w

    def _mlp(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        g1, g2, between = found.parts["first"], found.parts["second"], found.parts["between"]
        B, D = self._weight(g1, graph, env), self._weight(g2, graph, env)
        op = torch.ops.chainfuse.gemm_chain.default
        b1, b2 = self._bias(g1, graph, env), self._bias(g2, graph, env)
        if self.caps.bias:
            packed = self._packed(graph, g1, g2)
            args = (_dense(graph, env, g1.x), B, D, between, b1, b2)
            out = graph.call_function(op, args if packed is None else (*args, packed))
        else:
            out = graph.call_function(op, (_dense(graph, env, g1.x), B, D, between))
            if b2 is not None:
                out = graph.call_function(operator.add, (out, b2))
        if value_of(g1.x).dim() != value_of(g2.out).dim():
            out = graph.call_method("reshape", (out, -1, value_of(g2.out).shape[-1]))
        return out

    def _gated(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        (g1, g3), g2 = found.parts["up"], found.parts["down"]
        op = torch.ops.chainfuse.gated_mlp.default
        weights = (self._weight(g, graph, env) for g in (g1, g3, g2))  # each [in, out]
        packed = self._packed(graph, g1, g2, g3)
        args = (_dense(graph, env, g1.x), *weights, found.parts["act"])
        return graph.call_function(op, args if packed is None else (*args, packed))

    def _sdpa(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        p = found.parts
        mask = env(p["mask"]) if p["mask"] is not None else None
        q, k, v = (_dense(graph, env, p[name]) for name in ("q", "k", "v"))
        args = (q, k, v, mask, p["is_causal"], p["scale"], p["gqa"])
        return graph.call_function(torch.ops.chainfuse.attention.default, args)

    def _attention(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        p = found.parts
        q, k, v = (_dense(graph, env, p["q"]), _dense(graph, env, p["kt"], transposed=True),
                   _dense(graph, env, p["v"]))  # fmt: skip
        mask = p["mask"]
        if mask is not None and _dtype(mask) == _dtype(p["q"]):
            mask = env(mask)  # (one mask added, nothing else: the kernel reads it as it is)
        elif p["steps"] or p["bias"] is not None:
            # what the graph adds to the scores, as one tensor in q @ kᵀ's shape written by
            # Inductor's code (one pass), read by the kernel as its mask
            steps = tuple(_step(step, env) for step in p["steps"])
            bias = env(p["bias"]) if p["bias"] is not None else None
            terms = (env(p["q"]), env(p["kt"]), bias, float(p["bias_scale"]), steps)
            mask = graph.call_function(score_terms, terms)
        args: tuple[Any, ...] = (q, k, v, mask, False, float(p["scale"]), False)
        if p["softcap"] is not None:
            args += (float(p["softcap"]),)
        out = graph.call_function(torch.ops.chainfuse.attention.default, args)
        if mask is None:
            return out
        return graph.call_function(nan_rows, (out, mask))

    def _conv(self, found: Found, graph: fx.Graph, env: Callable[[Any], Any]) -> fx.Node:
        p = found.parts
        weights: list[Any] = []
        for conv, bn in ((p["first"], p["bn1"]), (p["second"], p["bn2"])):
            if bn is None:
                weights += [env(conv["w"]), env(conv["b"]) if conv["b"] is not None else None]
                continue
            w, b = self._folded(conv, bn)
            key = str(conv["w"].target).replace(".", "_")
            weights += [self._buffer(graph, f"_cf_bnw_{key}", functools.partial(_same, w)),
                        self._buffer(graph, f"_cf_bnb_{key}", functools.partial(_same, b))]  # fmt: skip
        first, second = p["first"], p["second"]
        x = _dense_image(graph, env, first["x"])
        args: tuple[Any, ...] = (x, weights[0], weights[2], weights[1], weights[3],
                [first["stride"], second["stride"]], _paddings(first, second),
                p["between"], p["after"])  # fmt: skip
        packed = self._conv_packed(found, graph, weights)
        groups = {"groups": p["groups"]} if p["groups"] != 1 else {}  # (depthwise)
        return graph.call_function(torch.ops.chainfuse.conv_chain.default, args + packed, groups)

    def _conv_packed(self, found: Found, graph: fx.Graph, weights: list[Any]) -> tuple[Any, ...]:
        """A conv chain's frozen weights packed once as its kernel reads them (a constant of
        the graph: `ops.pack_conv_weights`), as the operator's (packed, micro, finite); () for
        weights that are not constants (packed in each call)."""
        p = found.parts
        first, second = p["first"], p["second"]
        w1, w2 = weights[0], weights[2]
        if not all(isinstance(w, fx.Node) and w.op == "get_attr" for w in (w1, w2)) or not (
            self.frozen
        ):
            return ()
        x = self.value(first["x"])
        if not isinstance(x, torch.Tensor):
            return ()
        key = "_".join(str(w.target).replace(".", "_") for w in (w1, w2))
        made = self._conv_packs.get(key)  # (emitted for the decision, then for the graph)
        if made is None:
            v1, v2 = (attribute(self.gm, str(w.target)) for w in (w1, w2))
            made = self._conv_packs[key] = ops.pack_conv_weights(
                x.detach(), v1.detach(), v2.detach(), (first["stride"], second["stride"]),
                _paddings(first, second, pairs=True), p["between"], p["after"],
                groups=(1, p["groups"]),
            )  # fmt: skip
        data = self._buffer(graph, f"_cf_cpk_{key}", functools.partial(_same, made.data))
        return (data, made.micro, made.finite)

    def _folded(self, conv: dict[str, Any], bn: fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv's weight and bias with the eval batch norm after it folded in (in float32,
        rounded once to the weight's dtype: bf16 weights too)."""
        w = self.value(conv["w"]).detach()
        b = self.value(conv["b"]).detach().float() if conv["b"] is not None else 0.0
        scale, shift = self._norm(bn)
        folded = w.float() * scale.reshape(-1, 1, 1, 1)
        return folded.to(w.dtype), (b * scale + shift).to(w.dtype)

    def _norm(self, bn: fx.Node) -> tuple[torch.Tensor, torch.Tensor]:
        """An eval batch norm as the (scale, shift) per channel it applies, y = x scale + shift:
        gamma / sqrt(var + eps) and beta - mean scale, in float32. A number the graph takes as
        an input (eps under `dynamic=True`) is read at its traced value, as the weights are."""
        names = ("x", "mean", "var", "weight", "bias", "training", "momentum", "eps")
        bound: dict[str, Any] = dict(zip(names, bn.args, strict=False))
        bound.update({"mean": bn.kwargs.get("running_mean", bound.get("mean")),
                      "var": bn.kwargs.get("running_var", bound.get("var"))})  # fmt: skip
        bound.update({k: v for k, v in bn.kwargs.items() if k in names})

        def f32(name: str) -> Any:
            node = bound.get(name)
            return None if node is None else self.value(node).detach().float()

        gamma, beta = f32("weight"), f32("bias")
        eps = bound.get("eps", 1e-5)
        eps = float(self.value(eps) if isinstance(eps, fx.Node) else eps)
        scale = (1.0 if gamma is None else gamma) * torch.rsqrt(f32("var") + eps)
        return scale, (0.0 if beta is None else beta) - f32("mean") * scale


def _step(step: tuple[Any, ...], env: Callable[[Any], Any]) -> tuple[Any, ...]:
    """A finder's step on the scores' additive terms, as `score_terms` takes it."""
    if step[0] == "add":
        return ("add", env(step[2]))
    if step[0] == "fill":
        return ("fill", env(step[2]), float(step[3]), bool(step[4]))
    if step[0] == "floor":
        return ("floor", float(step[2]))
    view: fx.Node = step[1]  # ("view", node): the shape it asks for (sizes may be nodes)
    sizes: Any = view.kwargs.get("shape", view.args[1:] if view.target != torch.reshape
                                 else view.args[1])  # fmt: skip
    if len(sizes) == 1 and isinstance(sizes[0], tuple | list):
        sizes = sizes[0]
    return ("view", tuple(env(s) for s in sizes))


def score_terms(
    q: torch.Tensor, kt: torch.Tensor, bias: torch.Tensor | None, bias_scale: float,
    steps: tuple[tuple[Any, ...], ...],
) -> torch.Tensor:  # fmt: skip
    """What written-out attention does to `q @ kᵀ` besides scaling it, as one tensor that the
    kernel adds to the scores (broadcast to their shape): `bias_scale * bias` (baddbmm's input),
    then `steps` in the graph's order: ("view", shape) reshapes, ("add", mask) adds, ("fill",
    where, value, fill_where_true) sets value where `where` (or where not), ("floor", value)
    raises what is below value to it. A fill or a floor acts on the terms, not the sum: its
    value is at most `finder.FILL_BELOW`, so score + value rounds to value, and only terms that
    far below every score reach it. The terms stay as small as their broadcast allows (a causal
    mask: one [q, k])."""
    batch: tuple[int, ...] = torch.broadcast_shapes(q.shape[:-2], kt.shape[:-2])  # type: ignore[no-untyped-call]
    shape = torch.Size((*batch, q.shape[-2], kt.shape[-1]))
    full = shape  # the scores' shape at this step (the terms broadcast to it)
    terms = torch.zeros((), dtype=q.dtype, device=q.device)
    if bias is not None:
        terms = bias * bias_scale if bias_scale != 1.0 else bias
    for step in steps:
        if step[0] == "view":
            terms = terms.expand(full).reshape(step[1])
            full = terms.shape
        elif step[0] == "add":
            terms = terms + step[1]
        elif step[0] == "floor":
            terms = torch.clamp(terms, min=step[1])
        else:
            where = step[1].bool() if step[3] else ~step[1].bool()
            terms = torch.where(where, torch.tensor(step[2], dtype=q.dtype), terms)
    if full != shape:  # (reshaped: back to the scores' own shape)
        terms = terms.expand(full).reshape(shape)
    return terms.to(q.dtype)


def nan_rows(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`out` with NaN in the rows whose every score the mask sets to -inf: written-out
    attention's softmax gives NaN there (exp(-inf - -inf)), where the kernel, as SDPA, gives 0."""
    if mask.dtype == torch.bool:
        return out
    return out.masked_fill((mask == float("-inf")).all(-1, keepdim=True), float("nan"))


def attribute(module: torch.nn.Module, target: str) -> Any:
    """`module`'s attribute at a get_attr node's dotted `target`."""
    return functools.reduce(getattr, target.split("."), module)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _Refused(Exception):
    """A chain this build's operators cannot take; the message says why."""
