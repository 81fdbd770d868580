"""A full tile for any SIMD ISA: `VectorOps` spells an ISA's handful of vector operations,
`emit_vector_tile` writes the broadcast-FMA register block from them."""

from __future__ import annotations

from dataclasses import dataclass

from chainfuse.kernels.contract import MicroKernel

__all__ = ["PREFETCH_FAR", "VectorOps", "emit_vector_tile"]

#: Floats between A's k steps from which a full tile asks for the next line along each step's
#: row: below it the hardware prefetchers already follow the stream and the prefetch is one
#: more instruction per step (docs/tuning.md)
PREFETCH_FAR = 256


@dataclass(frozen=True)
class VectorOps:
    """How one SIMD ISA spells the handful of operations a broadcast-FMA full tile uses.

    Each op is a C expression template: ``load``/``broadcast`` take ``{ptr}``, ``store`` takes
    ``{ptr}`` and ``{v}``, ``fma`` computes ``{a}*{b} + {c}``, ``add`` ``{a} + {b}``, ``relu``
    ``{v} < 0 ? 0 : {v}`` lane by lane (NaN stays NaN, as torch.relu's).
    ``preamble`` holds the includes and (guarded) typedefs/helpers the templates rely on.
    """

    type: str
    lanes: int
    preamble: str
    zero: str
    load: str
    store: str
    broadcast: str
    fma: str
    add: str
    relu: str


def emit_vector_tile(kernel: MicroKernel, ops: VectorOps) -> str:
    """``<name>_full_s`` and ``<name>_full_g`` as outer-product loops: per k step, ``nr/lanes``
    vector loads of Bp, ``mr`` broadcasts of A (row ``i`` at ``A + i*rs``, step ``p`` at
    ``+ p*ks``), ``mr*nr/lanes`` FMAs into accumulators named ``c<i>_<j>``; ``_full_g`` runs
    ``ng`` groups of ``kc`` steps, group ``g``'s A at ``A + g*gs``, into the same accumulators.
    With ``kernel.part_rows``, also ``<name>_full_p``: ``_full_s`` on the first ``part_rows``
    rows only (a tail block of that many rows or fewer costs that many rows' FMAs)."""
    mr, nr, name = kernel.mr, kernel.nr, kernel.name
    if nr % ops.lanes:
        raise ValueError(f"{name}: nr={nr} is not a multiple of {ops.lanes} lanes")
    nv = nr // ops.lanes
    pad = " " * (len(name) + 27)

    if kernel.part_cols % ops.lanes:
        raise ValueError(f"{name}: part_cols={kernel.part_cols} is not a multiple of {ops.lanes}")

    def body(
        rows: int, nv: int = nv, row: str = "a + {i} * rs", scaled: bool = False
    ) -> tuple[list[str], list[str], list[str]]:
        """(zeroed accumulators, one k step, the store) of a block of `rows` rows and `nv`
        vectors of columns (Bp's steps stay nr floats apart); A's element of row i at this
        step is at `row` (formatted with i). `scaled`: row i times ``scale[i]`` as it is
        stored, where ``scale`` is not NULL (an FMA with zero: the product, rounded once)."""
        acc = [[f"c{i}_{j}" for j in range(nv)] for i in range(rows)]
        step = [
            f"        const float* restrict b = Bp + (long)p * {nr};",
            *(
                f"        const {ops.type} b{j} = {ops.load.format(ptr=f'b + {j * ops.lanes}')};"
                for j in range(nv)
            ),
        ]
        for i in range(rows):
            step.append(
                f"        const {ops.type} a{i} = {ops.broadcast.format(ptr=row.format(i=i))};"
            )
            for j in range(nv):
                step.append(
                    f"        {acc[i][j]} = {ops.fma.format(a=f'a{i}', b=f'b{j}', c=acc[i][j])};"
                )
        finish = ["    if (accumulate & 1) {"]
        for i in range(rows):
            for j in range(nv):
                ptr = f"C + {i} * ldc + {j * ops.lanes}"
                add = ops.add.format(a=acc[i][j], b=ops.load.format(ptr=ptr))
                finish.append(f"        {acc[i][j]} = {add};")
        finish.append("    }")
        finish.append("    if (accumulate & RELU_AT_STORE) {")
        for i in range(rows):
            for j in range(nv):
                finish.append(f"        {acc[i][j]} = {ops.relu.format(v=acc[i][j])};")
        finish.append("    }")
        if scaled:
            finish.append("    if (scale) {")
            for i in range(rows):
                finish.append(
                    f"        const {ops.type} s{i} = {ops.broadcast.format(ptr=f'scale + {i}')};"
                )
                for j in range(nv):
                    product = ops.fma.format(a=acc[i][j], b=f"s{i}", c=ops.zero)
                    finish.append(f"        {acc[i][j]} = {product};")
            finish.append("    }")
        for i in range(rows):
            for j in range(nv):
                ptr = f"C + {i} * ldc + {j * ops.lanes}"
                finish.append(f"    {ops.store.format(ptr=ptr, v=acc[i][j])};")
        finish.append("}")
        zero = [
            f"    {ops.type} " + ", ".join(f"{c} = {ops.zero}" for c in acc[i]) + ";"
            for i in range(rows)
        ]
        return zero, step, finish

    def single(rows: int, suffix: str, what: str, nv: int = nv, scaled: bool = False) -> list[str]:
        # A's rows by pointers set once, each step one offset from them all: a base + index
        # address per broadcast, where a + i * rs took GCC a few integer adds a step
        zero, step, finish = body(rows, nv, "r{i} + o", scaled)
        # (the scaled tile serves one call site, whose calls run hundreds of steps each: out of
        # line, it spares the kernel's big function a second inlined copy, and compile time)
        linkage = "__attribute__((noinline))" if scaled else "inline"
        # A read in place down far-apart rows misses at every step: ask for the next line along
        # each step's row, so those misses overlap this call's FMAs (only past PREFETCH_FAR)
        prefetch = [
            f"        if (ks >= {PREFETCH_FAR}) __builtin_prefetch(a + 64 / sizeof(float), 0, 3);"
        ]
        return [
            f"/* {name}_{suffix}: C[0:{rows}, 0:{nv * ops.lanes}] (+)= A . Bp, {rows * nv} "
            f"accumulators in registers{what} */",
            f"static {linkage} void {name}_{suffix}(int kc, const float* restrict A, long rs,"
            " long ks,",
            f"{pad}const float* restrict Bp, float* restrict C, long ldc,",
            f"{pad}int accumulate{', const float* restrict scale' if scaled else ''})",
            "{",
            *zero,
            *(f"    const float* restrict r{i} = A + {i} * rs;" for i in range(rows)),
            "#pragma GCC unroll 4",
            "    for (int p = 0; p < kc; ++p) {",
            "        const long o = (long)p * ks;",
            "        const float* restrict a = A + o;",
            *prefetch,
            *step,
            "    }",
            *finish,
        ]

    def grouped(suffix: str, what: str, nv: int = nv) -> list[str]:
        zero, step, finish = body(mr, nv)
        return [
            f"/* {name}_{suffix}: {what} over ng groups of kc steps, group g's A at A + g*gs, Bp",
            "   contiguous over all ng*kc steps: one register block for several runs of A */",
            f"static inline void {name}_{suffix}(int kc, int ng, long gs, const float* restrict A,",
            f"{pad}long rs, long ks, const float* restrict Bp, float* restrict C,",
            f"{pad}long ldc, int accumulate)",
            "{",
            *zero,
            "    for (int g = 0; g < ng; ++g, A += gs, Bp += (long)kc * " + str(nr) + ") {",
            "#pragma GCC unroll 4",
            "        for (int p = 0; p < kc; ++p) {",
            "            const float* restrict a = A + (long)p * ks;",
            *("    " + line for line in step),
            "        }",
            "    }",
            *finish,
        ]

    parts = [ops.preamble.rstrip("\n"), "", *single(mr, "full_s", ""), ""]
    what = ", row i times scale[i] as it is stored (none where scale is NULL)"
    parts += [*single(mr, "full_rs", what, scaled=True), ""]
    parts += grouped("full_g", "the same")
    if kernel.part_rows:
        parts += ["", *single(kernel.part_rows, "full_p", ": a tail block's rows")]
    for w in kernel.col_widths:  # narrow blocks: a column tail's (part_cols)
        v = w // ops.lanes
        parts += ["", *single(mr, f"full_c{w}", ": a tail block's columns", v)]
        parts += ["", *grouped(f"full_gc{w}", f"C[0:{mr}, 0:{w}] (+)= A . Bp", v)]
    return "\n".join(parts) + "\n"
