"""Fuzz cases of GEMM chains: `ops.gemm_chain`, `chainfuse.torch.gemm_chain` and kernels of
`chainfuse.compile(gemm_chain(...))` called directly (`chainfuse.bench.fuzz`)."""

from __future__ import annotations

import math
import tempfile
from typing import Any

import numpy as np

import chainfuse
from chainfuse import builders, ops
from chainfuse.bench.fuzz_cases import (
    Case,
    describe_operand,
    flat,
    gemm_flops_ok,
    layout_for,
    lead_of,
    oracle_torch,
    pick,
    reference_of,
    special,
)
from chainfuse.bench.fuzz_values import (
    Kind,
    Layout,
    Operand,
    inject,
    place,
    rounded,
    size,
    torch_or_none,
)
from chainfuse.ir import ACTIVATION_NAMES

__all__ = ["gemm_case", "subclassed"]

_NAMES = frozenset({"A", "B", "D", "E", "between", "out", "bias1", "bias2"})
#: the activations between the GEMMs, the model forms (every activation past relu and gelu)
#: drawn less often
_BETWEEN = [None, "relu", "gelu", "softmax", *ACTIVATION_NAMES[2:]]


class _Subclass(np.ndarray):
    """An ndarray subclass as a library might pass one (no behaviour of its own)."""


_SCRATCH: list[tempfile.TemporaryDirectory[str]] = []


def subclassed(rng: np.random.Generator, array: np.ndarray, features: list[str]) -> np.ndarray:
    """`array` as a np.memmap (a file in a scratch folder, removed at exit) or an ndarray
    subclass view: numpy arrays that are not exactly `np.ndarray`."""
    if rng.random() < 0.5:
        features.append("subclass")
        return array.view(_Subclass)
    features.append("memmap")
    if not _SCRATCH:
        _SCRATCH.append(tempfile.TemporaryDirectory(prefix="chainfuse-fuzz-"))
    path = f"{_SCRATCH[0].name}/{rng.integers(1 << 62):x}.bin"
    mm = np.memmap(path, dtype=array.dtype, mode="w+", shape=array.shape)
    mm[...] = array
    return mm


def _sizes(rng: np.random.Generator, cap: int) -> tuple[int, int, int, int, int]:
    while True:
        b = int(pick(rng, [1, 1, 2, 3, 4, 5, 7]))
        M, N, K, L = (size(rng, cap) for _ in range(4))
        if gemm_flops_ok(b, M, N, K, L):
            return b, M, N, K, L


def gemm_case(
    rng: np.random.Generator, dtype: str, entries: list[str], compact: bool = False
) -> Case:
    """A random GEMM chain call: sizes, ranks and broadcast batch dims, layouts, out=, NaN/inf
    or large values, numpy or torch, one of the entry points in `entries`."""
    torch = torch_or_none()
    features: list[str] = []
    between = pick(rng, _BETWEEN, [3, 3, 3, 3] + [1] * (len(_BETWEEN) - 4))
    features.append(between or "none")
    entry = str(pick(rng, entries, [{"ops": 6, "torch": 2, "compile": 2}[e] for e in entries]))
    features.append(entry)
    if entry == "torch" or dtype == "bfloat16":
        kind = Kind.TORCH
    else:
        kind = Kind(pick(rng, ["numpy", "torch"] if torch is not None else ["numpy"]))
    features.append(kind.value)
    b, M, N, K, L = _sizes(rng, 129)
    form = "3d" if entry == "compile" else pick(rng, ["3d", "2d", "mlp", "bcast", "4d"],
                                                 [5, 2, 1.5, 1.5, 1])  # fmt: skip
    out_mode = None
    if entry == "ops":
        out_mode = pick(rng, [None, "out", "out-strided", "out-alias", "out-overlap"],
                        [12, 2, 1, 1.5, 1])  # fmt: skip
    alias = None
    if out_mode == "out-alias":
        form = pick(rng, ["3d", "2d"])
        alias = pick(rng, ["D", "B"])
        if alias == "D":  # E [.., M, N] is D's shape [.., L, N] when L = M
            L = M
        else:  # ... and B's [.., K, L] when K = M and L = N
            K, L = M, N
        if not gemm_flops_ok(b, M, N, K, L):
            b, M = 1, min(M, 33)
            K, L = (K, M) if alias == "D" else (M, N)
    if out_mode == "out-overlap":
        form, b = "3d", max(b, 2)
        if not gemm_flops_ok(b, M, N, K, L):
            M = N = K = L = min(M, 17)
    features += [f for f in (form, out_mode) if f is not None and f != "3d"]
    # nn.Linear's terms through the functional entries: biases, and weights read as `W.T`
    model = entry != "compile" and out_mode not in ("out-alias", "out-overlap")
    biases = (
        pick(rng, [(), ("bias1",), ("bias2",), ("bias1", "bias2")], [9, 1, 1, 1]) if model else ()
    )
    linear = {x for x in "BD" if model and form in ("2d", "mlp") and rng.random() < 0.3}
    features += [*biases, *sorted(f"{x}.T" for x in linear)]
    leads: dict[str, tuple[int, ...]]
    if form == "3d":
        leads = {"A": (b,), "B": (b,), "D": (b,)}
    elif form == "2d":
        leads = {"A": (), "B": (), "D": ()}
    elif form == "mlp":
        leads = {"A": pick(rng, [(b,), (b, 2), (2, b)]), "B": (), "D": ()}
    elif form == "bcast":
        one = pick(rng, ["A", "B", "D"])
        leads = {x: (1,) if x == one or rng.random() < 0.3 else (b,) for x in "ABD"}
        if rng.random() < 0.3:
            leads[one] = ()
    else:
        b2 = int(pick(rng, [1, 2, 3]))
        leads = {x: (pick(rng, [b, 1], [3, 1]), pick(rng, [b2, 1], [3, 1])) for x in "ABD"}
    tails = {"A": (M, K), "B": (K, L), "D": (L, N)}
    what = special(rng, features, dtype)
    scales = {"A": 1.0, "B": 1.0 / math.sqrt(K), "D": 1.0 if between == "softmax" else 1.0 / math.sqrt(L)}  # fmt: skip
    if what == "large":  # 16-bit: A @ B stays well inside float16, the result may overflow
        lo_hi = (1.0, 2.5) if dtype == "float16" else (2.0, 8.0)
        scales["A"] *= 10 ** rng.uniform(*lo_hi)
        scales["D"] *= 10 ** rng.uniform(*lo_hi)
    values = {x: scales[x] * rng.standard_normal((*leads[x], *tails[x])) for x in "ABD"}
    if what in ("nan", "inf"):
        inject(rng, values[pick(rng, ["A", "B", "D"])], what)
    values.update({n: 0.5 * rng.standard_normal(L if n == "bias1" else N) for n in biases})
    values = {x: rounded(v, dtype) for x, v in values.items()}
    plain = out_mode is not None or (entry == "compile" and rng.random() < 0.5)
    operands: list[Operand] = []
    for x in "ABD":
        v = values[x]
        layout = layout_for(rng, kind, v.ndim, plain or (alias == x))
        expand = None
        if form == "3d" and b > 1 and alias != x and rng.random() < 0.1:  # a stride-0 batch
            v = values[x] = np.broadcast_to(v[:1], v.shape).copy()
            expand = v.shape
            v_small = v[:1]
            array = place(v_small, dtype, kind, layout, rng, expand)
            features.append("bcast_view")
        elif x in linear:  # the transpose of a contiguous [out, in] weight, as nn.Linear's
            stored = place(np.ascontiguousarray(v.T), dtype, kind, Layout.CONTIGUOUS, rng)
            array = stored.T
        else:
            array = place(v, dtype, kind, layout, rng)
        if layout is not Layout.CONTIGUOUS:
            features.append(layout.value)
        operands.append(Operand(x, array, v))
    for n in biases:
        operands.append(
            Operand(n, place(values[n], dtype, kind, Layout.CONTIGUOUS, rng), values[n])
        )
    may_refuse = "negstride" in features or out_mode in ("out-alias", "out-overlap")
    if kind is Kind.NUMPY and entry == "ops" and out_mode is None and rng.random() < 0.05:
        at = int(rng.integers(3))
        operands[at].array = subclassed(rng, np.ascontiguousarray(operands[at].array), features)
        may_refuse = True
    lead = lead_of(*leads.values())
    full = {x: flat(np.broadcast_to(values[x], (*lead, *tails[x])), 2) for x in "ABD"}
    full.update({n: values[n] for n in biases})
    chain = builders.gemm_chain(full["A"].shape[0], M, N, K, L, between, dtype,
                                bias1="bias1" in biases, bias2="bias2" in biases)  # fmt: skip
    expected = reference_of(chain, full, "E").reshape(*lead, M, N)
    A, B, D = (o.array for o in operands[:3])
    terms = {o.name: o.array for o in operands[3:]}
    given = "".join(f", {n}=..." for n in terms)
    out: Any = None
    store: Any = getattr(torch, dtype, None) if kind is Kind.TORCH else np.dtype(dtype)
    shape = (*lead, M, N)
    if out_mode == "out":
        out = np.empty(shape, store) if kind is Kind.NUMPY else torch.empty(shape, dtype=store)
    elif out_mode == "out-strided":
        out = place(np.zeros(shape), dtype, kind, Layout.STRIDED, rng)
    elif out_mode == "out-alias":
        out = D if alias == "D" else B
    elif out_mode == "out-overlap":
        zeros = np.zeros((1, M, N))
        out = place(zeros, dtype, kind, Layout.CONTIGUOUS, rng, expand=shape)
    call: Any
    if entry == "ops":
        desc = f"ops.gemm_chain(A, B, D, between={between!r}{given}" + (
            ", out=...)" if out_mode else ")"
        )

        def call() -> Any:
            return ops.gemm_chain(A, B, D, between=between, out=out, **terms)

    elif entry == "torch":
        desc = f"chainfuse.torch.gemm_chain(A, B, D, between={between!r}{given})"

        def call() -> Any:
            import chainfuse.torch

            return chainfuse.torch.gemm_chain(A, B, D, between=between, **terms)

    else:
        tiles = None
        if rng.random() < 0.5:
            tiles = {lp: size(rng, 64) for lp in "mlkn" if rng.random() < 0.5}
            features.append("tiles")
        desc = f"chainfuse.compile({chain.name}, tiles={tiles})(A, B, D)"

        def call() -> Any:
            return chainfuse.compile(chain, tiles=tiles)(A, B, D)

    oracle = None
    if what in ("nan", "inf") or (what == "large" and dtype == "float16"):
        oracle = oracle_torch(lambda t: _unfused(t, full, between, dtype).reshape(*lead, M, N))
    return Case("gemm_chain", dtype, tuple(features), operands, call, expected, chain,
                _NAMES, desc + "  " + "; ".join(describe_operand(o) for o in operands),
                full, oracle, may_refuse, out)  # fmt: skip


def _unfused(torch: Any, full: dict[str, np.ndarray], between: str | None, dtype: str) -> Any:
    """PyTorch's unfused ops on the same values, in the same dtype:
    between(A @ B + bias1) @ D + bias2."""
    dt = getattr(torch, dtype)
    A, B, D = (torch.from_numpy(full[x]).to(dt) for x in "ABD")
    from chainfuse.ops.activations import torch_activations

    C = A @ B
    if "bias1" in full:
        C = C + torch.from_numpy(full["bias1"]).to(dt)
    if between == "softmax":
        C = torch.softmax(C, dim=-1)
    elif between is not None:
        C = torch_activations()[between](C)
    E = C @ D
    if "bias2" in full:
        E = E + torch.from_numpy(full["bias2"]).to(dt)
    return E
