"""`chainfuse.compile(chain) -> Kernel`: plan, choose the code's tiles, emit C, build, load.

    kernel = chainfuse.compile(chainfuse.gemm_chain(12, 512, 64, 64, 512, "relu"))
    E = kernel(A, B, D)            # numpy in, numpy out; torch CPU tensors in, torch out
    print(kernel.plan); print(kernel.source)

`compile_conv` does the same for a conv -> [activation] -> conv chain (`ConvKernel`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from chainfuse import builders
from chainfuse.codegen.amx_chain import (
    amx_header,
    amx_schedule,
    amx_unsupported,
)
from chainfuse.codegen.amx_conv import (
    AmxConvSpec,
    amx_conv_band_rows,
    amx_conv_header,
    amx_conv_unsupported,
)
from chainfuse.codegen.common import chain_lines
from chainfuse.codegen.conv import (
    ConvChainShape,
    ConvChainSpec,
    ConvTiles,
    Halo,
    choose_halo,
    code_tiles,
    conv_activation,
    match_conv_chain,
)
from chainfuse.codegen.gemm_spec import Epilogue, GemmChainSpec, match_gemm_chain
from chainfuse.codegen.schedule import schedule_gemm_chain
from chainfuse.compiled import AmxConvKernel, AmxKernel, ConvKernel, Kernel
from chainfuse.hardware import Hardware, resolve
from chainfuse.ir import Chain, DType
from chainfuse.kernels import MicroKernel, Problem, available, select_weighted
from chainfuse.kernels.amx import AMX_BF16_32X32, ENV_AMX, FP32_FMA, amx_absent, amx_path
from chainfuse.model import code_level
from chainfuse.planner import Plan, PlanningError
from chainfuse.runtime import get_num_threads
from chainfuse.runtime.plans import remembered_plan

__all__ = [
    "AmxConvKernel",
    "AmxKernel",
    "ConvKernel",
    "Kernel",
    "arithmetic",
    "compile",
    "compile_conv",
    "micro_kernel",
    "spread_bands",
]


def _structure(chain: Chain, batch: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """The (order, depth) the C backend implements: batch, m, l shared; k | n private."""
    first, second = chain.contractions[0], chain.contractions[-1]  # (a gated MLP has three)
    m, l_ = first.output.loops[-2:]
    return (*batch, m, l_, first.reduction[0], second.output.loops[-1]), len(batch) + 2


def compile(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    tiles: Mapping[str, int] | None = None,
) -> Kernel:
    """Plan `chain` for this machine, generate and build its fused kernel, and load it.

    `threads` is the thread count the plan is made for (default: `get_num_threads()`, what a
    call will use unless told otherwise); any count still runs it. `tiles` overrides the
    planner's tiles of the code level (loop name -> tile; tests and
    tuning use it to reach every path of the generated loops). A convolution chain
    (`conv_chain_spec`) gives a `ConvKernel`: the same as `compile_conv(chain, ...)`, which is
    the typed entry point (and the one with the conv-only options).
    """
    if isinstance(chain, Chain) and _is_conv(chain):
        # the static type stays Kernel for the GEMM chains every caller compiles; conv callers
        # that want ConvKernel's attributes typed call compile_conv
        return compile_conv(chain, hardware, threads, tiles)  # type: ignore[return-value]
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    if chain.dtype not in (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16):
        raise TypeError(
            f"{chain.name}: float32, bfloat16 and float16 chains compile, got {chain.dtype.value}"
        )
    hw = resolve(hardware)
    shape = match_gemm_chain(chain)
    batch = shape.batch
    order, depth = _structure(chain, batch)
    first = chain.contractions[0]
    m, l_ = first.output.loops[-2:]
    k, n = order[len(batch) + 2 :]
    ext = chain.extents
    for loop, t in (tiles or {}).items():  # (checked before planning: a bad tile costs nothing)
        if loop not in (m, l_, k, n):  # (a misspelt tile would be ignored: a silent default)
            raise ValueError(
                f"tiles: unknown loop {loop!r} for {chain.name}; the code's tiles are of"
                f" {m!r}, {l_!r}, {k!r} and {n!r} (T_M, T_L, T_K, T_N)"
            )
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
    path = amx_path(chain.dtype)
    # what the AMX generator does not take (biases, D stored transposed, the sigmoid-gated
    # activations, a gated MLP, ...) runs on the fp32 path below, and its `arithmetic` says why
    why_not = amx_unsupported(shape, (ext[k], ext[n])) if path is not None else ""
    planned = builders.planned_part(chain)  # (biases are not planned: `planned_part`)
    if path is not None and not why_not:
        uk = AMX_BF16_32X32
        quanta = {m: uk.nr, l_: uk.mr, n: uk.mr}
        planned_for = threads if threads is not None else get_num_threads()
        chosen = remembered_plan(planned, hw, planned_for, (order, depth), quanta, None)
        schedule = amx_schedule(schedule_gemm_chain(chain, shape, chosen, uk, hw, tiles))
        header = amx_header(chain, chosen, schedule.spec, path)
        return AmxKernel(chain, chosen, schedule, shape, header, path)
    kernel = _fma_kernel(chain, (m, l_, k, n), hw)
    quanta = {m: kernel.nr, l_: kernel.mr, n: kernel.mr}
    planned_for = threads if threads is not None else get_num_threads()
    # with fewer row blocks than threads the kernel's threads split l (not a softmax's: its
    # shares would need their maxima merged), in whole mr-row slivers
    split = None if shape.epilogue is Epilogue.SOFTMAX else (l_, kernel.mr)
    # (16-bit operands are widened to fp32: planned at the FMA units' rate, never an engine's)
    fma = hw.fp32_units() if chain.dtype is not DType.FLOAT32 else hw
    chosen = remembered_plan(planned, fma, planned_for, (order, depth), quanta, split)
    schedule = schedule_gemm_chain(chain, shape, chosen, kernel, hw, tiles)
    spec = schedule.spec
    header = _header(chain, chosen, spec, why_not)
    return Kernel(chain, chosen, schedule, shape, header, arithmetic(spec, why_not))


def micro_kernel(chain: Chain, hardware: Hardware | str | None = None) -> str:
    """The name of the micro-kernel `compile` runs the GEMM chain `chain` with on `hardware`:
    the AMX block where the AMX path takes it, else the FMA kernel its two GEMMs' sizes select
    (which the rows decide too: `ops` builds the others a varying length reaches ahead)."""
    hw = resolve(hardware)
    shape = match_gemm_chain(chain)
    m, l_ = chain.contractions[0].output.loops[-2:]
    k, n = _structure(chain, shape.batch)[0][len(shape.batch) + 2 :]
    ext = chain.extents
    if amx_path(chain.dtype) is not None and not amx_unsupported(shape, (ext[k], ext[n])):
        return AMX_BF16_32X32.name
    return _fma_kernel(chain, (m, l_, k, n), hw).name


def _fma_kernel(chain: Chain, loops: tuple[str, str, str, str], hw: Hardware) -> MicroKernel:
    """The FMA micro-kernel for the chain's GEMMs. The generated code computes the transposed
    chain: m runs along the kernel's nr columns, l and n along its mr rows; both GEMMs run
    with it, weighed by their flops."""
    m, l_, k, n = loops
    ext = chain.extents
    op1, op2 = (
        Problem(DType.FLOAT32, ext[l_], ext[m], ext[k]),
        Problem(DType.FLOAT32, ext[n], ext[m], ext[l_]),
    )
    return select_weighted([(op1, ext[l_] * ext[m] * ext[k]), (op2, ext[n] * ext[m] * ext[l_])], hw)


def _header(chain: Chain, chosen: Plan, spec: GemmChainSpec, why_not: str = "") -> str:
    """The source's opening comment: the chain's structure only (no sizes, no tiles: those are
    arguments, so the same source, and the same compiled object, serves every size and every
    plan; `Kernel.plan` says which one a kernel runs)."""
    ops, roles = chain_lines(chain)
    return (
        f"chainfuse generated kernel {spec.name}\n"
        f"chain:\n{ops}\n"
        f"tensors: {roles}\n"
        f"order {' > '.join(chosen.order)}, shared {' > '.join(chosen.prefix)}; "
        "tiles T_M, T_L, T_K, T_N: run-time arguments\n"
        f"micro-kernel {spec.kernel.name} ({spec.kernel.mr}x{spec.kernel.nr}); "
        f"epilogue {spec.epilogue.value}; parallel over the batch and m\n"
        f"arithmetic: {arithmetic(spec, why_not)}"
    )


def arithmetic(spec: GemmChainSpec, why_not: str = "") -> str:
    """What the kernel computes in, said plainly (the plan's record of the path taken): the
    path's name first (`FP32_FMA` here; `AmxPath` for the tile kernels), then how; for bf16,
    why not on AMX (`why_not`: the AMX generator's reason, else `amx_absent`'s)."""
    uk = spec.kernel.name
    if spec.dtype is DType.BFLOAT16:
        return (
            f"{FP32_FMA}: bf16 inputs and output, widened to fp32 while packing; fp32 "
            f"micro-kernel {uk}, fp32 intermediate, output rounded to bf16 once "
            f"({why_not or amx_absent(spec.dtype)})"
        )
    if spec.dtype is DType.FLOAT16:
        return (
            f"{FP32_FMA}: fp16 inputs and output, widened to fp32 while packing; fp32 "
            f"micro-kernel {uk}, fp32 intermediate, output rounded to fp16 once (no AVX512-FP16 "
            "/ AMX-FP16 kernel is registered)"
        )
    return f"{FP32_FMA}: fp32 micro-kernel {uk}, fp32 intermediate"


def _is_conv(chain: Chain) -> bool:
    """A chain whose contractions read through windows (`2*p + r - 1`): a convolution chain."""
    return any(len(ix.terms) > 1 for op in chain.contractions for a in op.reads for ix in a.index)


#: the (order, depth) the conv backend implements: per (n, p2, q2) block the producer runs in
#: front of its consumer (the plan's tiles of p2 x q2 become whole-row bands, see `code_tiles`)
_CONV_ORDER = ("n", "p2", "q2", "k2", "k1", "p1", "q1", "c", "r1", "s1", "r2", "s2")


def compile_conv(
    chain: Chain,
    hardware: Hardware | str | None = None,
    threads: int | None = None,
    tiles: Mapping[str, int] | None = None,
    halo: Halo | str | None = None,
    after: str | None = None,
    micro: str | None = None,
) -> ConvKernel:
    """Plan a conv -> [activation] -> conv chain and build its one fused kernel (see
    `codegen.conv`).

    `tiles` overrides code tiles by loop name: `p2` (output rows per band), `c` and `k1` (the
    channel blocks of the two reductions). `halo` forces "keep" or "recompute" (default: the
    cost comparison of `choose_halo`). `after` (one of `ir.ACTIVATION_NAMES`, or None) is an activation on the second convolution's result. `micro` names the
    fp32 micro-kernel to run on (weights packed for it: `ConvKernel.pack`), else the best one
    for the chain's sizes.
    """
    if not isinstance(chain, Chain):
        raise TypeError(f"chain: expected a chainfuse Chain, got {type(chain).__name__}")
    if chain.dtype not in (DType.FLOAT32, DType.BFLOAT16):
        raise TypeError(
            f"{chain.name}: float32 and bfloat16 (AMX) conv chains compile, got {chain.dtype.value}"
        )
    conv_activation(after, "after")  # (checked before anything is planned)
    hw = resolve(hardware)
    shape = match_conv_chain(chain)
    if chain.dtype is DType.BFLOAT16:
        return _compile_amx_conv(chain, shape, hw, threads, tiles, halo, after)
    # pixels run along the micro-kernel's mr rows, output channels along its nr columns; both
    # convolutions run with the kernel, weighed by flops (a conv2 of 16 channels idles 3/4 of a
    # 64-wide block)
    px1, px2 = shape.P1 * shape.Q1, shape.P2 * shape.Q2
    red1, red2 = shape.C * shape.R1 * shape.S1, shape.K1 * shape.R2 * shape.S2
    problems = [(Problem(DType.FLOAT32, px1, shape.K1, red1), px1 * shape.K1 * red1)]
    if not shape.depthwise:  # (a depthwise conv runs on plain vector loops, `cf_dw_rows`)
        problems.append((Problem(DType.FLOAT32, px2, shape.K2, red2), px2 * shape.K2 * red2))
    kernel = select_weighted(problems, hw)
    if micro is not None and micro != kernel.name:
        named = [k for k in available() if k.name == micro and k.applies(problems[0][0], hw)]
        if not named:
            raise ValueError(f"micro: no fp32 micro-kernel {micro!r} runs on {hw.name!r}")
        kernel = named[0]
    chosen = _conv_plan(chain, shape, hw, threads)
    planned = chosen.tiles_at(code_level(hw)) or {}
    code = code_tiles(shape, planned, hw.levels[0].capacity, kernel.nr)
    picks = {"p2": code.band_rows, "c": code.c_block, "k1": code.k1_block}
    for loop, t in (tiles or {}).items():
        if loop not in picks:
            raise ValueError(f"tiles: unknown conv tile {loop!r}; expected p2, c or k1")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
        picks[loop] = t
    if "p2" not in (tiles or {}):
        picks["p2"] = spread_bands(shape, picks["p2"], chosen.threads)
    code = ConvTiles(picks["p2"], picks["c"], picks["k1"], code.k_steps)
    decided, reason = choose_halo(shape, code.band_rows, chosen.threads)
    if halo is not None:
        forced = Halo(halo)
        if forced is not decided:
            reason = f"forced {forced.value} (the model chose {decided.value}: {reason})"
        decided = forced
    spec = ConvChainSpec(
        kernel, shape.between, conv_activation(after, "after"), decided, shape.depthwise
    )
    header = _conv_header(spec)
    return ConvKernel(chain, chosen, spec, shape, code, reason, header)


def spread_bands(shape: ConvChainShape, band_rows: int, threads: int) -> int:
    """Rows per band with a block for every thread where the images are fewer than the
    threads (blocks are (image, band) pairs): one 7x7 image in one band of 7 rows ran on one
    thread of two. Smaller bands recompute or carry more rows of the intermediate
    (`choose_halo`), which costs less than an idle thread."""
    per_image = -(-threads // shape.N)
    if per_image <= 1 or -(-shape.P2 // band_rows) >= per_image:
        return band_rows
    return max(1, -(-shape.P2 // per_image))


def _conv_plan(chain: Chain, shape: ConvChainShape, hw: Hardware, threads: int | None) -> Plan:
    """The plan of a conv chain in the structure the conv backends implement (`_CONV_ORDER`)."""
    n_first = shape.N > 1
    order: tuple[str, ...] = _CONV_ORDER if n_first else (*_CONV_ORDER[1:], "n")
    if shape.depthwise:  # (no k2: the channel loop k1 runs through both convolutions)
        order = tuple(loop for loop in order if loop != "k2")
    structure = (order, 3 if n_first else 2)
    try:
        return remembered_plan(chain, hw, threads, structure, {})
    except PlanningError:
        if len(hw.levels) < 3:
            raise
        # the smallest fused block overflows the innermost cache (a wide window over many
        # channels of the intermediate, e.g. 5x5 x 127): the kernel still runs, its micro-kernel
        # streaming from the next level, so plan the levels from there out
        outer = dataclasses.replace(hw, levels=hw.levels[1:])
        return remembered_plan(chain, outer, threads, structure, {})


def _compile_amx_conv(
    chain: Chain,
    shape: ConvChainShape,
    hw: Hardware,
    threads: int | None,
    tiles: Mapping[str, int] | None,
    halo: Halo | str | None,
    after: str | None,
) -> AmxConvKernel:
    """A bf16 conv chain: on AMX tiles (or their emulation), or a clear error saying why not
    (there is no fp32-arithmetic bf16 conv kernel to fall back to)."""
    path = amx_path(chain.dtype)
    if path is None:
        raise TypeError(
            f"{chain.name}: bfloat16 conv chains run on AMX tiles only, and not here: "
            f"{amx_absent(chain.dtype)}; pass float32 tensors, or set {ENV_AMX}=emulate"
        )
    why = amx_conv_unsupported(shape)
    if why:
        raise ValueError(f"{chain.name}: {why}")
    if halo is not None and Halo(halo) is not Halo.RECOMPUTE:
        raise ValueError(f"halo: the AMX conv kernel recomputes its halo, got {halo!r}")
    band_rows = amx_conv_band_rows(shape, threads if threads is not None else get_num_threads())
    for loop, t in (tiles or {}).items():
        if loop != "p2":
            raise ValueError(f"tiles: the AMX conv kernel takes a tile of p2 only, got {loop!r}")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tiles[{loop!r}] must be a positive integer, got {t!r}")
        band_rows = min(t, shape.P2)
    chosen = _conv_plan(chain, shape, hw, threads)
    spec = AmxConvSpec(shape.between, conv_activation(after, "after"))
    return AmxConvKernel(chain, chosen, spec, shape, band_rows,
                         amx_conv_header(spec, path), path)  # fmt: skip


def _conv_header(spec: ConvChainSpec) -> str:
    """The conv kernel's opening comment: structure, schedule and how its tiles are chosen (no
    sizes: they, the tiles included, are arguments, so one object serves every shape)."""
    # the chain with its sizes, strides and paddings as symbols: they are arguments
    ops = [
        "  Y1[n,k1,p1,q1] = sum[c,r1,s1] X[n,c,st1*p1+r1-pad1,st1*q1+s1-pad1] * W1[k1,c,r1,s1]",
        "  Y1 += b1[k1] (if given)",
        f"  Z = {spec.between.value}(Y1)" if spec.between is not Epilogue.NONE else "  Z = Y1",
        "  Y2[n,k2,p2,q2] = sum[k1,r2,s2] Z[n,k1,st2*p2+r2-pad2,st2*q2+s2-pad2] * W2[k2,k1,r2,s2]",
        "  Y2 += b2[k2] (if given)"
        + (f"; Y2 = {spec.after.value}(Y2)" if spec.after is not Epilogue.NONE else ""),
    ]
    keep = spec.halo is Halo.KEEP
    return (
        f"chainfuse generated kernel {spec.name}\n"
        "chain:\n" + "\n".join(ops) + "\n"
        f"plan structure {' > '.join(_CONV_ORDER)} (n last when N = 1), shared n > p2 > q2: "
        "conv1 runs per block of conv2's output pixels; parallel over n x row bands of conv2\n"
        "code tiles (run-time arguments): T_P2 = whole rows holding the plan's p2 x q2 pixels\n"
        "  at its code level; KC = most k steps a call reads (its weight panel fills half of L1),\n"
        "  T_C / T_K1 = channel blocks of one tap when a row of taps exceeds 2 KC steps\n"
        f"halo: {spec.halo.value} ("
        + (
            "overlapping rows of Z stay in each thread's rolling row buffer"
            if keep
            else "every band recomputes the rows of Z it reads"
        )
        + "), chosen by choose_halo's cost comparison (ConvKernel.halo_reason)\n"
        f"micro-kernel {spec.kernel.name} ({spec.kernel.mr}x{spec.kernel.nr}): pixels x output "
        "channels, input slivers read in place; layouts: any NCHW / channels-last strides "
        "(NCHW input copied channels-last a band of rows at a time)"
    )
