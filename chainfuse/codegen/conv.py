"""Lower a two-convolution chain into one C function: implicit GEMM, fused through a row buffer.

The chain (`ir.conv_chain_spec`, optionally with biases and an activation after the second
conv, which the call supplies)::

    Y1 = conv(X, W1, stride st1, padding pad1) [+ b1]   Z = f(Y1) or Y1
    Y2 = conv(Z, W2, stride st2, padding pad2) [+ b2]   [g(Y2)]

f and g are any of the pointwise activations of the GEMM chains (`gemm_spec.ACTIVATIONS`).

Both convolutions run as implicit GEMMs on the micro-kernel of the registry, output pixels on
its `mr` rows and output channels on its `nr` columns::

    Y1[pix, k1] = im2col(X)[pix, (r1, s1, c)] . W1p[(r1, s1, c), k1]

The weights (the vector operand) are packed into `nr`-channel panels shared by the threads:
once per call, or once for all calls by the caller (`<name>_pack`: frozen weights). The pixel operand is never gathered: a sliver of `mr` pixels of one output row
whose windows lie inside the input is read in place by the strided micro-kernel,
`A(i, p) = X[first pixel's tap + i*st*ws + p*ks]`; on channels-last data a whole row of taps
is `S*C` consecutive floats per pixel, and one grouped call runs every row of taps whose input
row exists (`R` runs of `S*C` steps, a row of X apart) into one register block. Only the
slivers that touch the padding (and the pixels left over at the end of a row) are packed,
several rows' worth together into full slivers. Input that is not channels-last (NCHW) is
first copied, the rows each band reads, into a channels-last row buffer of the thread (through
the micro-kernel's register transposes), so that every layout takes the same path. Results are
channels-last rows, so Z is `[pixel][k1]` and a channels-last Y2 is written in place (NCHW goes
through a buffer of the band's rows and transposing copies). Per thread, over a contiguous range
of (n, band) blocks::

    for (n, band of T_P2 output rows of conv2) in this thread's range:    # parallel
        Z rows the band needs: [p2a*st2 - pad2, (p2b-1)*st2 - pad2 + R2)   # clipped to [0, P1)
        keep:      slide the rows the previous band already made to the front of Z
        recompute: forget them
        (NCHW X: the rows of X they read -> Xc, channels-last)
        conv1 rows still missing -> Z, then Z = f(Z + b1) while in cache      (cf_conv_rows)
        conv2 of the band from Z  -> Y2, then [g](Y2 + b2)                    (cf_conv_rows)

    cf_conv_rows, per chunk of whole output rows (FLAT_PIXELS pixels; a 1x1 stride-1 conv
    without padding runs its pixels across rows):
        pack the chunk's edge slivers (all taps, zeros for the padding)
        channels-last (S*C <= 2*KC):
            for row, sliver of the chunk, block of nr output channels:
                C[sliver, block] = A . W1p over every row of taps inside X   (one grouped call)
        else:
            for blocks of nr output channels (as many as fit L1 with one group of taps):
                for tap (r, s), block of T_C channels, sliver of the chunk:
                    C[sliver, block] (+)= A . W1p                              (micro-kernel)

`Z` lives in the thread's workspace: the intermediate never reaches memory. Every size, stride,
padding and tile is a run-time argument, so one compiled object serves every shape; what is
compiled in is the micro-kernel, the activations and the halo policy.

Halo: when R2 > st2 consecutive bands share R2 - st2 rows of Z. `keep` carries them over inside a
thread's range (each thread recomputes them once, at its first band); `recompute` makes every
band from scratch (independent blocks, redundant conv1 rows). `choose_halo` compares the two with
the cost of the busiest thread; the choice is a compile-time constant, so it is in the header.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from chainfuse.codegen.common import ALIGN16, c_source, header_comment, name_hash, per_thread
from chainfuse.codegen.gemm_spec import ACTIVATIONS, Epilogue
from chainfuse.codegen.softmax import activation_c
from chainfuse.codegen.writer import Writer
from chainfuse.ir import Affine, Chain, Contraction, Pointwise
from chainfuse.kernels import MicroKernel, emit_with_packing

__all__ = [
    "GEOMETRY",
    "ConvChainShape",
    "ConvChainSpec",
    "ConvTiles",
    "Halo",
    "choose_halo",
    "code_tiles",
    "conv_activation",
    "conv_word",
    "emit_conv_chain",
    "geometry",
    "match_conv_chain",
    "useful_flops",
]

#: The run-time geometry the generated function takes, in this order (one `long` each).
GEOMETRY = (
    "N", "C", "H", "W", "K1", "R1", "S1", "P1", "Q1", "st1", "pad1",
    "K2", "R2", "S2", "P2", "Q2", "st2", "pad2", "TP2", "CB1", "CB2", "KC",
)  # fmt: skip

#: Most k steps per micro-kernel call: its weight panel (`nr` floats a step, 256 x 16 floats =
#: 16 KiB) takes half of a 32 KiB L1, next to the slivers of input it is applied to.
_L1_SHARE = 2

#: `MR`-pixel slivers per chunk of a plain 1x1 convolution (its pixels run across rows): each
#: call's weight panel is loaded once per chunk and serves them all (docs/tuning.md)
_FLAT_SLIVERS = 64

#: Fewest pixels of conv2's output per band, in `nr` multiples (see `code_tiles`)
#: (docs/tuning.md)
_MIN_STRIPS = 6


class Halo(enum.Enum):
    """What happens to the rows of the intermediate that two bands of conv2 both read."""

    KEEP = "keep"  # carried over in the thread's rolling row buffer
    RECOMPUTE = "recompute"  # every band computes all the rows it reads


@dataclass(frozen=True)
class ConvChainShape:
    """What `match_conv_chain` read from a chain: sizes of the two convolutions."""

    N: int
    C: int
    H: int
    W: int
    K1: int
    R1: int
    S1: int
    P1: int
    Q1: int
    st1: int
    pad1: int
    K2: int
    R2: int
    S2: int
    P2: int
    Q2: int
    st2: int
    pad2: int
    between: Epilogue  # the activation between the convolutions (NONE: none)
    tensors: tuple[str, str, str, str]  # X, W1, W2, Y2
    depthwise: bool = False  # the second conv filters each channel alone (W2 [K1, 1, R2, S2])

    @property
    def pad2_after(self) -> int:
        """The second conv's zeros after each axis its last window reads (`pad2` is before:
        more where the padding is TF's "SAME" at stride 2; at most pad2 where symmetric)."""
        rows = (self.P2 - 1) * self.st2 - self.pad2 + self.R2 - self.P1
        cols = (self.Q2 - 1) * self.st2 - self.pad2 + self.S2 - self.Q1
        return max(0, rows, cols)

    @property
    def overlap_rows(self) -> int:
        """Rows of Z two consecutive output rows of conv2 both read."""
        return max(0, self.R2 - self.st2)

    def conv1_flops_per_row(self) -> int:
        return 2 * self.Q1 * self.K1 * self.C * self.R1 * self.S1


@dataclass(frozen=True)
class ConvTiles:
    """Code-level tiles (run-time arguments): output rows per band, channel blocks."""

    band_rows: int  # T_P2: rows of conv2's output per block
    c_block: int  # channels of X per micro-kernel call, one tap at a time (conv1's reduction)
    k1_block: int  # channels of Z per micro-kernel call, one tap at a time (conv2's reduction)
    k_steps: int = 256  # most k steps of a call over a whole row of taps (channels-last input)

    def __str__(self) -> str:
        return f"T_P2={self.band_rows} T_C={self.c_block} T_K1={self.k1_block} KC={self.k_steps}"


@dataclass(frozen=True)
class ConvChainSpec:
    """What the generated code depends on (no sizes: those are arguments)."""

    kernel: MicroKernel
    between: Epilogue  # between the convolutions (NONE: none)
    after: Epilogue  # on the second convolution's result (NONE: none)
    halo: Halo
    depthwise: bool = False  # the second conv is depthwise (`cf_dw_rows`, not the micro-kernel)

    @property
    def name(self) -> str:
        word = conv_word(self.between, self.after, self.depthwise)
        key = f"{self.kernel.name}|{self.between.value}|{self.after.value}|{self.halo.value}"
        if self.depthwise:
            key += "|dw"
        return f"{word}_f32_{self.halo.value}_{name_hash(key)}"


def conv_word(between: Epilogue, after: Epilogue, depthwise: bool = False) -> str:
    """`conv_silu_conv_relu`, `conv_relu6_dwconv` and such: a conv kernel's structure in its
    name."""
    mid = "" if between is Epilogue.NONE else f"_{between.value}"
    second = "_dwconv" if depthwise else "_conv"
    return f"conv{mid}{second}" + ("" if after is Epilogue.NONE else f"_{after.value}")


def conv_activation(name: str | None, what: str) -> Epilogue:
    """The activation a conv chain applies for `name` (None: none); else ValueError naming
    `what` (the argument) and the choices."""
    if name is None:
        return Epilogue.NONE
    names = [a.value for a in ACTIVATIONS]
    if name not in names:
        raise ValueError(f"{what}: expected None or one of {names}, got {name!r}")
    return Epilogue(name)


def match_conv_chain(chain: Chain) -> ConvChainShape:
    """Recognise `Y2 = conv(f(conv(X, W1)), W2)` built by `conv_chain_spec` (the second conv
    dense or depthwise); else ValueError."""
    ops = chain.ops
    convs = [op for op in ops if isinstance(op, Contraction)]
    if len(convs) != 2 or len(ops) not in (2, 3) or not isinstance(ops[0], Contraction):
        raise ValueError(f"{chain.name}: expected conv -> [activation] -> conv")
    between = Epilogue.NONE
    if len(ops) == 3:
        mid = ops[1]
        if not (isinstance(mid, Pointwise) and mid.fn in ACTIVATIONS and mid.operand is None):
            names = [a.value for a in ACTIVATIONS]
            raise ValueError(
                f"{chain.name}: only one of {names} may sit between the convolutions: {mid}"
            )
        between = ACTIVATIONS[mid.fn]
    first, second = convs
    x, w1 = first.inputs
    z, w2 = second.inputs
    if len(x.index) != 4 or len(z.index) != 4:
        raise ValueError(f"{chain.name}: expected 4-D (NCHW) convolution inputs")
    ext = chain.extents

    def window(index: tuple[Affine, ...], d: int) -> tuple[str, int, str, int]:
        ix = index[d]
        if len(ix.terms) != 2 or ix.terms[1][1] != 1:
            raise ValueError(f"{chain.name}: dim {d} is not a convolution window: {ix}")
        (out, st), (tap, _) = ix.terms
        return out, st, tap, -ix.offset

    p1, st1, r1, pad1 = window(x.index, 2)
    q1, st1w, s1, pad1w = window(x.index, 3)
    p2, st2, r2, pad2 = window(z.index, 2)
    q2, st2w, s2, pad2w = window(z.index, 3)
    if (st1, pad1) != (st1w, pad1w) or (st2, pad2) != (st2w, pad2w):
        raise ValueError(f"{chain.name}: stride and padding must be equal along H and W")
    X, W1, W2, Y2 = x.tensor, w1.tensor, w2.tensor, second.output.tensor
    N, C, H, W = chain.tensor(X).shape
    # depthwise: W2's input-channel dim is the constant 0, its output channel Z's channel loop
    depthwise = len(w2.index) == 4 and not w2.index[1].terms
    if depthwise and (w2.index[0] != z.index[1] or second.output.index[1] != z.index[1]):
        raise ValueError(f"{chain.name}: a depthwise conv reads and writes Z's channels: {second}")
    return ConvChainShape(
        N=N, C=C, H=H, W=W, K1=chain.tensor(W1).shape[0], R1=ext[r1], S1=ext[s1],
        P1=ext[p1], Q1=ext[q1], st1=st1, pad1=pad1, K2=chain.tensor(W2).shape[0],
        R2=ext[r2], S2=ext[s2], P2=ext[p2], Q2=ext[q2], st2=st2, pad2=pad2,
        between=between, tensors=(X, W1, W2, Y2), depthwise=depthwise,
    )  # fmt: skip


def code_tiles(shape: ConvChainShape, planned: dict[str, int], l1_bytes: int, nr: int) -> ConvTiles:
    """Code-level tiles from the plan's tiles at the code level (normally L2).

    The plan tiles conv2's output pixels as T_p2 x T_q2; the code keeps whole rows (so the row
    buffer is a plain sliding window), with as many pixels per band as the plan's tile:
    `T_P2 = round(T_p2 * T_q2 / Q2)`, at least 1 (and 6 x nr pixels). `KC` is the number of k
    steps whose weight panel (`nr` floats each) fills half of L1. On channels-last input a call
    reads whole rows of taps (S x C steps each) when a row has at most `2 KC` steps (a sliver of
    them stays in L1 while it meets every block of output channels); else each call reads one
    tap with the channels split evenly into blocks of at most `KC` (no small last block).
    """
    pixels = planned.get("p2", 1) * planned.get("q2", 1)
    pixels = max(pixels, _MIN_STRIPS * nr)
    band = max(1, min(shape.P2, round(pixels / shape.Q2)))
    steps = max(1, l1_bytes // _L1_SHARE // (4 * nr))

    def block(channels: int) -> int:
        parts = -(-channels // steps)
        return -(-channels // parts)

    return ConvTiles(band, block(shape.C), block(shape.K1), steps)


def choose_halo(shape: ConvChainShape, band_rows: int, threads: int) -> tuple[Halo, str]:
    """Keep or recompute the overlapping rows, by the conv1 rows of the busiest thread.

    Both run the same (n, band) blocks split into contiguous ranges, one per thread. Recompute
    makes `min(P1, (T_P2-1)*st2 + R2)` rows of Z per band; keep makes a band's new rows only,
    plus the overlap once at the start of each range (and of each image in it), at the price of
    a sequential dependence between a thread's bands (its rolling buffer): blocks cannot be
    handed out one at a time. Equal costs choose keep (less work on a busy machine too).
    """
    P1, P2, st2, R2 = shape.P1, shape.P2, shape.st2, shape.R2
    bands = -(-P2 // band_rows)
    blocks = shape.N * bands
    share = -(-blocks // max(1, threads))
    per_band = min(P1, (band_rows - 1) * st2 + R2)
    recompute = share * per_band
    # keep: the busiest range covers `share` bands; new rows per band `band_rows*st2` (capped by
    # what exists), and the overlap once per image start in the range (at most 1 + share//bands)
    starts = 1 + (share - 1) // bands
    keep = min(recompute, share * min(P1, band_rows * st2) + starts * shape.overlap_rows)
    row = shape.conv1_flops_per_row()
    if shape.overlap_rows == 0:
        return Halo.KEEP, "no halo: consecutive bands of conv2 share no rows of the intermediate"
    text = (
        f"busiest thread: recompute {recompute} conv1 rows ({recompute * row / 1e6:.1f} MFLOP), "
        f"keep {keep} ({keep * row / 1e6:.1f} MFLOP); overlap {shape.overlap_rows} rows/band, "
        f"{blocks} blocks of {band_rows} rows on {threads} thread(s)"
    )
    return (Halo.KEEP if keep <= recompute else Halo.RECOMPUTE), text


def emit_conv_chain(spec: ConvChainSpec, header: str = "") -> str:
    """C source of `void <name>(...)` and `long <name>_workspace(...)` for `spec`."""
    ker = spec.kernel
    uk = ker.name
    name = spec.name
    w = Writer()
    header_comment(w, header)
    w.lines(emit_with_packing(ker))
    w.line(f"#define MR {ker.mr}")
    w.line(f"#define NR {ker.nr}")
    w.line(f"#define UK {uk}")
    w.line(f"#define UK_STRIDED {uk}_strided")
    w.line(f"#define UK_GROUPED {uk}_grouped")
    tb = ker.transpose_block
    w.line(f"#define TB {tb} /* the micro-kernel's register transpose: {tb} floats a side */")
    if tb:
        w.line(f"#define UK_TRANSPOSE {uk}_transpose")
    w.line(f"#define HALO_KEEP {int(spec.halo is Halo.KEEP)}")
    w.line(f"#define DEPTHWISE {int(spec.depthwise)}")
    for word, act in (("MID", spec.between), ("OUT", spec.after)):
        w.line(f"#define ACT_{word} {int(act is not Epilogue.NONE)}")
        w.line(f"#define CF_ACT_{word}(v) ({activation_c(act, 'v')})")
    w.line(
        f"#define FLAT_PIXELS {_FLAT_SLIVERS} * MR"
        " /* pixels per chunk of a plain 1x1 conv: one weight panel serves them all */"
    )
    w.line("#include <stddef.h>")
    w.line("#include <string.h>")
    w.line("")
    w.line(ALIGN16)
    if {spec.between, spec.after} - {Epilogue.NONE, Epilogue.RELU}:
        w.lines(c_source("math.c"))  # (cf_sigmoid, cf_erf)
    w.lines(c_source("conv_runtime.c"))
    w.line("")
    w.line("/* floats of workspace: returns the shared part (packed W1, W2), and writes one")
    w.line(
        "   thread's part (Z, the band's result T, packed edge slivers, channels-last rows of X)"
    )
    w.line("   to *per_thread */")
    with w.block(f"long {name}_workspace(const long* g, long* per_thread)"):
        w.line("cf_geo G;")
        w.line("cf_geo_init(&G, g);")
        w.line(
            "*per_thread = ALIGN16((G.ZROWS * G.Q1 + MR) * G.LDK1)"
            " + ALIGN16((G.TP2 * G.Q2 + MR) * G.LDK2)"
            " + ALIGN16(G.TMP) + ALIGN16(G.XROWS * G.W * G.C);"
        )
        w.line("return ALIGN16(G.LDK1 * G.R1 * G.S1 * G.C) + ALIGN16(CF_W2P(G));")
    w.line("")
    w.line("/* the weights packed as the kernel reads them (NR-channel panels: W1p, then W2p, the")
    w.line(
        "   shared part of the workspace), for a caller that packs them once (frozen weights) */"
    )
    with w.block(
        f"void {name}_pack(const float* W1, const float* W2, const long* g, const long* w1s,\n"
        f"    const long* w2s, float* shared, int nthreads)"
    ):
        w.line("cf_geo G;")
        w.line("cf_geo_init(&G, g);")
        w.line("float* restrict W1p = shared;")
        w.line("float* restrict W2p = shared + ALIGN16(G.LDK1 * G.R1 * G.S1 * G.C);")
        w.line("/* depthwise: W2 in one block, [R2*S2][LDK1] (cf_pack_depthwise) */")
        w.line(
            "const long blocks1 = G.LDK1 / NR, wblocks = blocks1 + (DEPTHWISE ? 1 : G.LDK2 / NR);"
        )
        w.line("#pragma omp parallel for schedule(static) num_threads(nthreads)")
        with w.block("for (long b = 0; b < wblocks; ++b)"):
            with w.block("if (b < blocks1)"):
                w.line("cf_pack_weights(W1, w1s, G.K1, G.C, G.R1, G.S1, b * NR, W1p);")
            with w.block("else if (DEPTHWISE)"):
                w.line("cf_pack_depthwise(W2, w2s, &G, W2p);")
            with w.block("else"):
                w.line("cf_pack_weights(W2, w2s, G.K2, G.K1, G.R2, G.S2, (b - blocks1) * NR, W2p);")
    w.line("")
    w.line("/* g: GEOMETRY; xs, w1s, w2s, ys: strides (elements) of X, W1, W2, Y along their")
    w.line("   four dims (N, C, H, W / K, C, R, S); b1, b2 may be NULL (no bias); packed: the")
    w.line("   weights as `_pack` leaves them in shared (read only), or NULL: packed here, into")
    w.line("   shared, once per call */")
    with w.block(
        f"void {name}(const float* X, const float* W1, const float* W2,\n"
        f"    const float* b1, const float* b2, float* Y, const long* g, const long* xs,\n"
        f"    const long* w1s, const long* w2s, const long* ys, float* shared,\n"
        f"    float* work, long work_per_thread, int nthreads, const float* packed)"
    ):
        w.line("cf_geo G;")
        w.line("cf_geo_init(&G, g);")
        with w.block("if (!packed)"):
            w.line(f"{name}_pack(W1, W2, g, w1s, w2s, shared, nthreads);")
            w.line("packed = shared;")
        w.line("const float* restrict W1p = packed;")
        w.line("const float* restrict W2p = packed + ALIGN16(G.LDK1 * G.R1 * G.S1 * G.C);")
        w.line("/* the result is written in place when its pixels are rows of K2 floats")
        w.line("   (channels-last), else through T and a transposing copy (NCHW) */")
        w.line("const int direct = (ys[1] == 1 || G.K2 == 1) && ys[2] == G.Q2 * ys[3];")
        w.line(
            "/* X is read in place when channels-last (a row of taps is S1*C consecutive floats),"
        )
        w.line("   else the rows each band needs are first copied channels-last into Xc */")
        w.line("const int x_direct = xs[3] == G.C && (xs[1] == 1 || G.C == 1);")
        w.line("const long bands = (G.P2 + G.TP2 - 1) / G.TP2;")
        w.line("const long blocks = G.N * bands;")
        w.line("const long share = (blocks + nthreads - 1) / nthreads;")
        with per_thread(w):
            w.line("float* restrict Z = work + (long)t * work_per_thread;")
            w.line("float* restrict T = Z + ALIGN16((G.ZROWS * G.Q1 + MR) * G.LDK1);")
            w.line("float* restrict tmp = T + ALIGN16((G.TP2 * G.Q2 + MR) * G.LDK2);")
            w.line("float* restrict Xc = tmp + ALIGN16(G.TMP);")
            w.line("cf_conv c1 = {NULL, 0, xs[2], xs[3], xs[1], G.H, G.W, G.C, G.R1, G.S1,")
            w.line("              G.st1, G.pad1, G.K1, G.CB1, G.KC, W1p, b1, 1};")
            with w.block("if (!x_direct)"):
                w.line("c1.hs = G.W * G.C;")
                w.line("c1.ws = G.C;")
                w.line("c1.cs = 1;")
            w.line("cf_conv c2 = {Z, 0, G.Q1 * G.LDK1, G.LDK1, 1, G.P1, G.Q1, G.K1, G.R2, G.S2,")
            w.line("              G.st2, G.pad2, G.K2, G.CB2, G.KC, W2p, b2, 0};")
            w.line("const long first = (long)t * share;")
            w.line("const long last = CF_MIN(first + share, blocks);")
            w.line("long zn = -1, zbase = 0, zhi = 0; /* Z holds rows [zbase, zhi) of image zn */")
            with w.block("for (long blk = first; blk < last; ++blk)"):
                _emit_band(w)
    return w.text()


def _emit_band(w: Writer) -> None:
    w.line("/* conv2 of the band into rows of pixels `ldc` floats apart */")
    w.line("#if DEPTHWISE")
    w.line("/* (b2 and the activation after applied as the results are made: depthwise, as its")
    w.line("   sums leave the registers; else to each chunk of cf_conv_rows) */")
    w.line("#define CONV2_ROWS(out, ldc) cf_dw_rows(&G, Z, zbase, W2p, b2, p2a, p2b, out, ldc)")
    w.line("#else")
    w.line("#define CONV2_ROWS(out, ldc) cf_conv_rows(&c2, p2a, p2b, G.Q2, out, ldc, tmp)")
    w.line("#endif")
    w.line("const long n = blk / bands, p2a = (blk % bands) * G.TP2;")
    w.line("const long p2b = CF_MIN(G.P2, p2a + G.TP2);")
    w.line("/* rows of Z the band reads, clipped to the rows that exist (the rest is padding) */")
    w.line("const long lo = CF_MIN(G.P1, CF_MAX(0, p2a * G.st2 - G.pad2));")
    w.line("const long hi = CF_MAX(lo, CF_MIN(G.P1, (p2b - 1) * G.st2 - G.pad2 + G.R2));")
    w.line("long from = lo;")
    w.line("const long row = G.Q1 * G.LDK1; /* floats of one row of Z */")
    with w.block("if (HALO_KEEP && zn == n && lo >= zbase && lo <= zhi)"):
        w.line("/* keep: rows [lo, zhi) are already made; slide them to the front of Z */")
        with w.block("if (lo > zbase && zhi > lo)"):
            w.line(
                "memmove(Z, Z + (lo - zbase) * row, sizeof(float) * (size_t)((zhi - lo) * row));"
            )
        w.line("from = CF_MAX(lo, zhi);")
    w.line("zbase = lo;")
    w.line("zn = n;")
    with w.block("if (hi > from)"):
        w.line("/* conv1: Z rows [from, hi) of image n, then b1 and f while in cache */")
        with w.block("if (x_direct)"):
            w.line("c1.in = X + n * xs[0];")
        with w.block("else"):
            w.line("/* the rows of X these conv1 rows read, channels-last */")
            w.line("const long ha = CF_MAX(0, from * G.st1 - G.pad1);")
            w.line("const long hb = CF_MAX(ha, CF_MIN(G.H, (hi - 1) * G.st1 - G.pad1 + G.R1));")
            w.line("cf_rows_to_channels_last(X + n * xs[0], xs[1], xs[2], xs[3], G.C, G.W, G.R1,")
            w.line("                         G.st1, G.pad1, ha, hb, Xc);")
            w.line("c1.in = Xc;")
            w.line("c1.h0 = ha;")
        w.line("float* Zf = Z + (from - zbase) * row;")
        w.line("cf_conv_rows(&c1, from, hi, G.Q1, Zf, G.LDK1, tmp); /* (b1, f applied) */")
    w.line("zhi = CF_MAX(hi, from);")
    w.line("c2.h0 = zbase;")
    with w.block("if (direct)"):
        w.line("float* Yb = Y + n * ys[0] + p2a * ys[2];")
        w.line("CONV2_ROWS(Yb, ys[3]);")
    with w.block("else"):
        w.line("/* the band into T (channels-last rows, as above), then row by row into Y */")
        w.line("CONV2_ROWS(T, G.LDK2);")
        with w.block("for (long p2 = p2a; p2 < p2b; ++p2)"):
            w.line("const float* Tr = T + (p2 - p2a) * G.Q2 * G.LDK2;")
            w.line("float* Yr = Y + n * ys[0] + p2 * ys[2];")
            with w.block("if (ys[3] == 1)"):
                w.line("/* NCHW: a row of pixels per channel */")
                w.line("cf_transpose(Tr, G.LDK2, Yr, ys[1], G.Q2, G.K2);")
            with w.block("else"):
                with w.block("for (long k = 0; k < G.K2; ++k)"):
                    w.line("float* restrict y = Yr + k * ys[1];")
                    w.line("for (long q = 0; q < G.Q2; ++q) y[q * ys[3]] = Tr[q * G.LDK2 + k];")


def geometry(shape: ConvChainShape, tiles: ConvTiles) -> tuple[int, ...]:
    """The `GEOMETRY` values of one call."""
    values = {**shape.__dict__, "TP2": tiles.band_rows, "CB1": tiles.c_block,
              "CB2": tiles.k1_block, "KC": tiles.k_steps}  # fmt: skip
    return tuple(int(values[k]) for k in GEOMETRY)


def useful_flops(shape: ConvChainShape) -> int:
    """Multiply-adds x 2 of both convolutions (no recompute)."""
    first = shape.P1 * shape.Q1 * shape.K1 * shape.C * shape.R1 * shape.S1
    second = shape.P2 * shape.Q2 * shape.K2 * shape.R2 * shape.S2
    second *= 1 if shape.depthwise else shape.K1
    return 2 * shape.N * (first + second)
