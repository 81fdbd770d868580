"""Lower a two-convolution chain into one C function: implicit GEMM, fused through a row buffer.

The chain (`ir.conv_chain_spec`, optionally with biases and a relu after the second conv, which
the call supplies)::

    Y1 = conv(X, W1, stride st1, padding pad1) [+ b1]   Z = relu(Y1) or Y1
    Y2 = conv(Z, W2, stride st2, padding pad2) [+ b2]   [relu]

Both convolutions run as implicit GEMMs on the micro-kernel of the registry, computed transposed
(output channels on the micro-kernel's `mr` rows, output pixels on its `nr` columns)::

    Y1ᵀ[k1, pix] = W1p[k1, (r1, s1, c)] . im2colᵀ(X)[(r1, s1, c), pix]

so the packed weights (the broadcast operand) are packed once per call and shared by the
threads, and each `nr`-pixel strip of the window is gathered per block into the vector operand.
Pixels of a block are flattened over its rows, so a strip crosses row ends (no tail strip per
row). The block order, per thread, over a contiguous range of (n, band) blocks::

    for (n, band of T_P2 output rows of conv2) in this thread's range:    # parallel
        Z rows the band needs: [p2a*st2 - pad2, (p2b-1)*st2 - pad2 + R2)   # clipped to [0, P1)
        keep:      slide the rows the previous band already made to the front of Z
        recompute: forget them
        for nr-pixel strip of the rows still missing:                     # conv1
            for c block: gather X windows (zeros outside: no padded copy)
                         for mr rows of k1: Z[k1, strip] (+)= W1p . window   (micro-kernel)
            Z[:, strip] = relu(Z + b1)                                     # while in cache
        for nr-pixel strip of the band's output:                          # conv2
            for k1 block: gather Z windows;  for mr rows of k2: T (+)= W2p . window
            Y2[n, :, strip] = [relu](T + b2)        (any strides: NCHW or channels-last)

`Z` ([k1][rows x Q1], flat) lives in the thread's workspace: the intermediate never reaches
memory. Every size, stride, padding and tile is a run-time argument, so one compiled object
serves every shape; what is compiled in is the micro-kernel, the relus and the halo policy.

Halo: when R2 > st2 consecutive bands share R2 - st2 rows of Z. `keep` carries them over inside a
thread's range (each thread recomputes them once, at its first band); `recompute` makes every
band from scratch (independent blocks, redundant conv1 rows). `choose_halo` compares the two with
the cost of the busiest thread; the choice is a compile-time constant, so it is in the header.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from chainfuse.codegen.writer import Writer
from chainfuse.ir import Activation, Affine, Chain, Contraction, Pointwise
from chainfuse.kernels import MicroKernel, emit_with_packing

__all__ = [
    "GEOMETRY",
    "ConvChainShape",
    "ConvChainSpec",
    "ConvTiles",
    "Halo",
    "choose_halo",
    "code_tiles",
    "emit_conv_chain",
    "geometry",
    "match_conv_chain",
    "useful_flops",
]

#: The run-time geometry the generated function takes, in this order (one `long` each).
GEOMETRY = (
    "N", "C", "H", "W", "K1", "R1", "S1", "P1", "Q1", "st1", "pad1",
    "K2", "R2", "S2", "P2", "Q2", "st2", "pad2", "TP2", "CB1", "CB2",
)  # fmt: skip

#: Most k steps per gathered window block: `nr` floats each, a block of 256 x 16 floats is 16 KiB,
#: half of a 32 KiB L1, next to the micro-kernel's weight panel.
_L1_SHARE = 2

#: Pixel strips gathered per chunk (8 x 16 pixels on AVX2): the weight panel each micro-kernel
#: call reads is loaded once per chunk instead of once per strip, and the chunk's windows
#: (JB x 16 KiB at most) stay in L2.
_CHUNK = 8

#: Fewest `nr`-pixel strips of conv2's output per band (see `code_tiles`).
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
    relu_mid: bool
    tensors: tuple[str, str, str, str]  # X, W1, W2, Y2

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
    c_block: int  # channels of X per gathered window block (conv1's reduction block)
    k1_block: int  # channels of Z per gathered window block (conv2's reduction block)

    def __str__(self) -> str:
        return f"T_P2={self.band_rows} T_C={self.c_block} T_K1={self.k1_block}"


@dataclass(frozen=True)
class ConvChainSpec:
    """What the generated code depends on (no sizes: those are arguments)."""

    kernel: MicroKernel
    relu_mid: bool
    relu_out: bool
    halo: Halo

    @property
    def name(self) -> str:
        word = "conv" + ("_relu" if self.relu_mid else "") + "_conv"
        word += "_relu" if self.relu_out else ""
        key = f"{self.kernel.name}|{self.relu_mid}|{self.relu_out}|{self.halo.value}".encode()
        return f"{word}_f32_{self.halo.value}_{hashlib.sha256(key).hexdigest()[:8]}"


def match_conv_chain(chain: Chain) -> ConvChainShape:
    """Recognise `Y2 = conv(f(conv(X, W1)), W2)` built by `conv_chain_spec`; else ValueError."""
    ops = chain.ops
    convs = [op for op in ops if isinstance(op, Contraction)]
    if len(convs) != 2 or len(ops) not in (2, 3) or not isinstance(ops[0], Contraction):
        raise ValueError(f"{chain.name}: expected conv -> [relu] -> conv")
    relu_mid = False
    if len(ops) == 3:
        mid = ops[1]
        if not (isinstance(mid, Pointwise) and mid.fn is Activation.RELU):
            raise ValueError(f"{chain.name}: only relu may sit between the convolutions: {mid}")
        relu_mid = True
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
    return ConvChainShape(
        N=N, C=C, H=H, W=W, K1=chain.tensor(W1).shape[0], R1=ext[r1], S1=ext[s1],
        P1=ext[p1], Q1=ext[q1], st1=st1, pad1=pad1, K2=chain.tensor(W2).shape[0],
        R2=ext[r2], S2=ext[s2], P2=ext[p2], Q2=ext[q2], st2=st2, pad2=pad2,
        relu_mid=relu_mid, tensors=(X, W1, W2, Y2),
    )  # fmt: skip


def code_tiles(shape: ConvChainShape, planned: dict[str, int], l1_bytes: int, nr: int) -> ConvTiles:
    """Code-level tiles from the plan's tiles at the code level (normally L2).

    The plan tiles conv2's output pixels as T_p2 x T_q2; the code keeps whole rows (so the row
    buffer is a plain sliding window), with as many pixels per band as the plan's tile:
    `T_P2 = round(T_p2 * T_q2 / Q2)`, at least 1 (and 6 strips). The channel blocks of the two reductions are
    the largest that keep one gathered window block (`R*S*T_C` k steps of `nr` floats) within
    half of L1, split evenly (no small last block).
    """
    pixels = planned.get("p2", 1) * planned.get("q2", 1)
    # and at least _MIN_STRIPS strips of pixels: a band ends in one partial strip, whose padding
    # lanes are computed for nothing (a 56-pixel band would waste 8 of 64)
    pixels = max(pixels, _MIN_STRIPS * nr)
    band = max(1, min(shape.P2, round(pixels / shape.Q2)))
    steps = max(1, l1_bytes // _L1_SHARE // (4 * nr))

    def block(channels: int, taps: int) -> int:
        most = max(1, steps // taps)
        parts = -(-channels // most)
        return -(-channels // parts)

    return ConvTiles(
        band, block(shape.C, shape.R1 * shape.S1), block(shape.K1, shape.R2 * shape.S2)
    )


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


_RUNTIME = r"""
#include <stddef.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define ALIGN16(x) (((x) + 15) & ~15L)
#define CF_MIN(a, b) ((a) < (b) ? (a) : (b))
#define CF_MAX(a, b) ((a) > (b) ? (a) : (b))

/* the run-time geometry (GEOMETRY in chainfuse/codegen/conv.py), strides and derived sizes */
typedef struct {
    long N, C, H, W, K1, R1, S1, P1, Q1, st1, pad1, K2, R2, S2, P2, Q2, st2, pad2, TP2, CB1, CB2;
    long K1p, K2p;       /* output channels rounded up to whole MR rows */
    long KC1, KC2;       /* reduction lengths R1*S1*C and R2*S2*K1 */
    long ZROWS, LDZ;     /* rows of Z a band holds at most; floats between two k1 rows of Z */
    long CBM;            /* the larger channel block (the zero row of the gathers) */
} cf_geo;

static void cf_geo_init(cf_geo* G, const long* g)
{
    G->N = g[0]; G->C = g[1]; G->H = g[2]; G->W = g[3]; G->K1 = g[4]; G->R1 = g[5];
    G->S1 = g[6]; G->P1 = g[7]; G->Q1 = g[8]; G->st1 = g[9]; G->pad1 = g[10]; G->K2 = g[11];
    G->R2 = g[12]; G->S2 = g[13]; G->P2 = g[14]; G->Q2 = g[15]; G->st2 = g[16];
    G->pad2 = g[17]; G->TP2 = g[18]; G->CB1 = g[19]; G->CB2 = g[20];
    G->K1p = (G->K1 + MR - 1) / MR * MR;
    G->K2p = (G->K2 + MR - 1) / MR * MR;
    G->KC1 = G->R1 * G->S1 * G->C;
    G->KC2 = G->R2 * G->S2 * G->K1;
    G->ZROWS = CF_MIN(G->P1, (G->TP2 - 1) * G->st2 + G->R2);
    /* + NR: a strip's padding lanes write past the last row; + 16: rows of Z not 4 KiB apart */
    G->LDZ = ALIGN16(G->ZROWS * G->Q1 + NR) + 16;
    G->CBM = CF_MAX(G->CB1, G->CB2);
}

#ifdef __AVX2__
/* r[i] (8 floats) := column i of the 8x8 matrix whose rows are r[0..7] */
static inline void cf_transpose8(__m256 r[8])
{
    __m256 t[8], s[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        s[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
}
#endif

/* The vector operand of one tap: dst[c*NR + j] = src[j][c*sc] for c < cw, 0 where src[j] is
   NULL (padding, or a lane past the last pixel). `zeros` holds at least cw zeros. */
static void cf_gather(const float* const* src, long sc, long cw, float* restrict dst,
                      const float* zeros)
{
    int valid = 0, run = 1;
    const float* base = NULL;
    for (int j = 0; j < NR; ++j) {
        if (!src[j]) continue;
        if (!base) base = src[j] - j;
        else if (src[j] != base + j) run = 0;
        ++valid;
    }
    if (valid == 0) {
        memset(dst, 0, sizeof(float) * (size_t)(cw * NR));
        return;
    }
    if (run && valid == NR) { /* NR adjacent pixels (planar data, stride 1): row copies */
        for (long c = 0; c < cw; ++c) {
            const float* restrict s = base + c * sc;
            float* restrict d = dst + c * NR;
            for (int j = 0; j < NR; ++j) d[j] = s[j];
        }
        return;
    }
#ifdef __AVX2__
    if (run && NR % 8 == 0) { /* adjacent pixels with holes (padding): masked row copies */
        __m256i mask[NR / 8];
        for (int g = 0; g < NR / 8; ++g) {
            int m[8];
            for (int j = 0; j < 8; ++j) m[j] = src[8 * g + j] ? -1 : 0;
            mask[g] = _mm256_setr_epi32(m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]);
        }
        for (long c = 0; c < cw; ++c) {
            for (int g = 0; g < NR / 8; ++g) {
                _mm256_storeu_ps(dst + c * NR + 8 * g,
                                 _mm256_maskload_ps(base + c * sc + 8 * g, mask[g]));
            }
        }
        return;
    }
    if (sc == 1 && NR % 8 == 0) { /* channels-last pixels: 8x8 transposes */
        for (int g = 0; g < NR; g += 8) {
            const float* p[8];
            for (int j = 0; j < 8; ++j) p[j] = src[g + j] ? src[g + j] : zeros;
            long c = 0;
            for (; c + 8 <= cw; c += 8) {
                __m256 r[8];
                for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(p[j] + c);
                cf_transpose8(r);
                for (int i = 0; i < 8; ++i) _mm256_storeu_ps(dst + (c + i) * NR + g, r[i]);
            }
            for (; c < cw; ++c) {
                for (int j = 0; j < 8; ++j) dst[c * NR + g + j] = p[j][c];
            }
        }
        return;
    }
#endif
    (void)zeros;
    for (long c = 0; c < cw; ++c) {
        for (int j = 0; j < NR; ++j) dst[c * NR + j] = src[j] ? src[j][c * sc] : 0.0f;
    }
}

/* The result strip: dst[j][k*sc] = f(T[k*NR + j] + bias[k]) for j < nj, k < K. */
static void cf_scatter(float* const* dst, long sc, long K, const float* restrict T,
                       const float* bias, int nj)
{
    int run = 1;
    for (int j = 1; j < nj; ++j) {
        if (dst[j] != dst[0] + j) run = 0;
    }
    if (run) { /* adjacent pixels (NCHW rows): row copies */
        for (long k = 0; k < K; ++k) {
            const float b = bias ? bias[k] : 0.0f;
            float* restrict d = dst[0] + k * sc;
            const float* restrict t = T + k * NR;
            for (int j = 0; j < nj; ++j) {
                float v = t[j] + b;
                d[j] = RELU_OUT ? (v > 0.0f ? v : 0.0f) : v;
            }
        }
        return;
    }
    long k0 = 0;
#ifdef __AVX2__
    if (sc == 1 && NR % 8 == 0) { /* channels-last: 8x8 transposes of whole groups */
        for (int g = 0; g + 8 <= nj; g += 8) {
            for (long k = 0; k + 8 <= K; k += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(T + (k + i) * NR + g);
                cf_transpose8(r);
                const __m256 b = bias ? _mm256_loadu_ps(bias + k) : _mm256_setzero_ps();
                for (int j = 0; j < 8; ++j) {
                    __m256 v = _mm256_add_ps(r[j], b);
                    if (RELU_OUT) v = _mm256_max_ps(v, _mm256_setzero_ps());
                    _mm256_storeu_ps(dst[g + j] + k, v);
                }
            }
        }
        k0 = K / 8 * 8;
        for (int j = 0; j < nj; ++j) {
            const long kfrom = j < nj / 8 * 8 ? k0 : 0;
            for (long k = kfrom; k < K; ++k) {
                float v = T[k * NR + j] + (bias ? bias[k] : 0.0f);
                dst[j][k] = RELU_OUT ? (v > 0.0f ? v : 0.0f) : v;
            }
        }
        return;
    }
#endif
    (void)k0;
    for (int j = 0; j < nj; ++j) {
        for (long k = 0; k < K; ++k) {
            float v = T[k * NR + j] + (bias ? bias[k] : 0.0f);
            dst[j][k * sc] = RELU_OUT ? (v > 0.0f ? v : 0.0f) : v;
        }
    }
}

/* Wp for output rows [strip*MR, +MR): per channel block [c0, c0+cw), [(r*S + s)*cw + c][MR],
   so the panel of block c0 starts at strip*MR*R*S*C + c0*R*S*MR; rows past K are zeros. */
static void cf_pack_weights(const float* W, const long* ws, long K, long C, long R, long S,
                            long CB, long strip, float* restrict Wp)
{
    float* restrict out = Wp + strip * MR * R * S * C;
    for (int i = 0; i < MR; ++i) { /* row by row: W is read in its own order */
        const long k = strip * MR + i;
        for (long c0 = 0; c0 < C; c0 += CB) {
            const long cw = CF_MIN(CB, C - c0);
            float* restrict panel = out + c0 * R * S * MR;
            for (long c = 0; c < cw; ++c) {
                for (long r = 0; r < R; ++r) {
                    for (long s = 0; s < S; ++s) {
                        panel[((r * S + s) * cw + c) * MR + i] =
                            k < K ? W[k * ws[0] + (c0 + c) * ws[1] + r * ws[2] + s * ws[3]] : 0.0f;
                    }
                }
            }
        }
    }
}
"""


def emit_conv_chain(spec: ConvChainSpec, header: str = "") -> str:
    """C source of `void <name>(...)` and `long <name>_workspace(...)` for `spec`."""
    ker = spec.kernel
    uk = ker.name
    name = spec.name
    w = Writer()
    w.line("/*")
    for text in header.strip().split("\n"):
        w.line(f" * {text}".rstrip())
    w.line(" */")
    w.lines(emit_with_packing(ker))
    w.line(f"#define MR {ker.mr}")
    w.line(f"#define NR {ker.nr}")
    w.line(f"#define HALO_KEEP {int(spec.halo is Halo.KEEP)}")
    w.line(f"#define RELU_MID {int(spec.relu_mid)}")
    w.line(f"#define RELU_OUT {int(spec.relu_out)}")
    w.line(f"#define JB {_CHUNK} /* NR-pixel strips per chunk: one weight panel serves them all */")
    w.lines(_RUNTIME)
    w.line("")
    _emit_conv1(w, uk)
    w.line("")
    _emit_conv2(w, uk)
    w.line("")
    w.line("/* floats of workspace: returns the shared part (packed W1, W2), and writes one")
    w.line("   thread's part (window blocks, Z, the result strip, a zero row) to *per_thread */")
    with w.block(f"long {name}_workspace(const long* g, long* per_thread)"):
        w.line("cf_geo G;")
        w.line("cf_geo_init(&G, g);")
        w.line(
            "*per_thread = ALIGN16(JB * G.R1 * G.S1 * G.CB1 * NR) + ALIGN16(G.K1p * G.LDZ)"
            " + ALIGN16(JB * G.R2 * G.S2 * G.CB2 * NR) + ALIGN16(JB * G.K2p * NR)"
            " + ALIGN16(G.CBM + 8);"
        )
        w.line("return ALIGN16(G.K1p * G.KC1) + ALIGN16(G.K2p * G.KC2);")
    w.line("")
    w.line("/* g: GEOMETRY; xs, w1s, w2s, ys: strides (elements) of X, W1, W2, Y along their")
    w.line("   four dims (N, C, H, W / K, C, R, S); b1, b2 may be NULL (no bias) */")
    with w.block(
        f"void {name}(const float* X, const float* W1, const float* W2,\n"
        f"    const float* b1, const float* b2, float* Y, const long* g, const long* xs,\n"
        f"    const long* w1s, const long* w2s, const long* ys, float* shared,\n"
        f"    float* work, long work_per_thread, int nthreads)"
    ):
        w.line("cf_geo G;")
        w.line("cf_geo_init(&G, g);")
        w.line("float* restrict W1p = shared;")
        w.line("float* restrict W2p = shared + ALIGN16(G.K1p * G.KC1);")
        w.line("const long strips1 = G.K1p / MR, strips = strips1 + G.K2p / MR;")
        w.line("/* the weights, packed once per call, shared by the threads */")
        w.line("#pragma omp parallel for schedule(static) num_threads(nthreads)")
        with w.block("for (long s = 0; s < strips; ++s)"):
            with w.block("if (s < strips1)"):
                w.line("cf_pack_weights(W1, w1s, G.K1, G.C, G.R1, G.S1, G.CB1, s, W1p);")
            with w.block("else"):
                w.line("cf_pack_weights(W2, w2s, G.K2, G.K1, G.R2, G.S2, G.CB2, s - strips1, W2p);")
        w.line("const long bands = (G.P2 + G.TP2 - 1) / G.TP2;")
        w.line("const long blocks = G.N * bands;")
        w.line("const long share = (blocks + nthreads - 1) / nthreads;")
        w.line("/* one iteration per thread, so its index names its workspace: no omp.h needed */")
        w.line("#pragma omp parallel for schedule(static, 1) num_threads(nthreads)")
        with w.block("for (int t = 0; t < nthreads; ++t)"):
            w.line("float* restrict Bp1 = work + (long)t * work_per_thread;")
            w.line("float* restrict Z = Bp1 + ALIGN16(JB * G.R1 * G.S1 * G.CB1 * NR);")
            w.line("float* restrict Bp2 = Z + ALIGN16(G.K1p * G.LDZ);")
            w.line("float* restrict T = Bp2 + ALIGN16(JB * G.R2 * G.S2 * G.CB2 * NR);")
            w.line("float* restrict zeros = T + ALIGN16(JB * G.K2p * NR);")
            w.line("memset(zeros, 0, sizeof(float) * (size_t)(G.CBM + 8));")
            w.line("const long first = (long)t * share;")
            w.line("const long last = CF_MIN(first + share, blocks);")
            w.line("long zn = -1, zbase = 0, zhi = 0; /* Z holds rows [zbase, zhi) of image zn */")
            with w.block("for (long blk = first; blk < last; ++blk)"):
                _emit_band(w)
    return w.text()


def _emit_band(w: Writer) -> None:
    w.line("const long n = blk / bands, p2a = (blk % bands) * G.TP2;")
    w.line("const long p2b = CF_MIN(G.P2, p2a + G.TP2);")
    w.line("/* rows of Z the band reads, clipped to the rows that exist (the rest is padding) */")
    w.line("const long lo = CF_MIN(G.P1, CF_MAX(0, p2a * G.st2 - G.pad2));")
    w.line("const long hi = CF_MAX(lo, CF_MIN(G.P1, (p2b - 1) * G.st2 - G.pad2 + G.R2));")
    w.line("long from = lo;")
    with w.block("if (HALO_KEEP && zn == n && lo >= zbase && lo <= zhi)"):
        w.line("/* keep: rows [lo, zhi) are already made; slide them to the front of Z */")
        with w.block("if (lo > zbase && zhi > lo)"):
            with w.block("for (long k = 0; k < G.K1; ++k)"):
                w.line("float* zk = Z + k * G.LDZ;")
                w.line(
                    "memmove(zk, zk + (lo - zbase) * G.Q1, sizeof(float) * (size_t)((zhi - lo) * G.Q1));"
                )
        w.line("from = CF_MAX(lo, zhi);")
    w.line("zbase = lo;")
    w.line("zn = n;")
    with w.block("if (hi > from)"):
        w.line("cf_conv1(&G, X, xs, W1p, b1, n, from, hi, zbase, Z, Bp1, zeros);")
    w.line("zhi = CF_MAX(hi, from);")
    w.line("cf_conv2(&G, W2p, b2, Y, ys, n, p2a, p2b, zbase, Z, Bp2, T, zeros);")


def _emit_conv1(w: Writer, uk: str) -> None:
    w.line("/* conv1 into Z: rows [from, hi) of image n, flat over the rows in NR-pixel strips,")
    w.line(
        "   JB strips at a time: a weight panel (MR x kc, L1) serves every strip of the chunk */"
    )
    with w.block(
        "static void cf_conv1(const cf_geo* G, const float* X, const long* xs,\n"
        "    const float* restrict W1p, const float* b1, long n, long from, long hi, long zbase,\n"
        "    float* restrict Z, float* restrict Bp, const float* zeros)"
    ):
        w.line("const long npx = (hi - from) * G->Q1;")
        w.line("float* restrict Zb = Z + (from - zbase) * G->Q1;")
        w.line("const float* Xn = X + n * xs[0];")
        w.line("const long panel = G->R1 * G->S1 * G->CB1 * NR; /* floats of one strip's window */")
        with w.block("for (long c0j = 0; c0j < npx; c0j += JB * NR)"):
            w.line("const long chunk = CF_MIN(JB * NR, npx - c0j);")
            with w.block("for (long c0 = 0; c0 < G->C; c0 += G->CB1)"):
                w.line("const long cw = CF_MIN(G->CB1, G->C - c0);")
                with w.block("for (long j0 = 0; j0 < chunk; j0 += NR)"):
                    w.line("const int nj = (int)CF_MIN(NR, chunk - j0);")
                    w.line("float* restrict Bs = Bp + (j0 / NR) * panel;")
                    w.line("long hh[NR], ww[NR];")
                    with w.block("for (int j = 0; j < NR; ++j)"):
                        w.line("const long idx = c0j + j0 + (j < nj ? j : 0);")
                        w.line("hh[j] = (from + idx / G->Q1) * G->st1 - G->pad1;")
                        w.line("ww[j] = (idx % G->Q1) * G->st1 - G->pad1;")
                    with w.block("for (long r = 0; r < G->R1; ++r)"):
                        with w.block("for (long s = 0; s < G->S1; ++s)"):
                            w.line("const float* src[NR];")
                            with w.block("for (int j = 0; j < NR; ++j)"):
                                w.line("const long h = hh[j] + r, x = ww[j] + s;")
                                w.line(
                                    "src[j] = j < nj && h >= 0 && h < G->H && x >= 0 && x < G->W"
                                    " ? Xn + h * xs[2] + x * xs[3] + c0 * xs[1] : NULL;"
                                )
                            w.line(
                                "cf_gather(src, xs[1], cw, Bs + (r * G->S1 + s) * cw * NR, zeros);"
                            )
                w.line("const int kc = (int)(G->R1 * G->S1 * cw);")
                with w.block("for (long k = 0; k < G->K1; k += MR)"):
                    w.line("const float* restrict a = W1p + k * G->KC1 + c0 * G->R1 * G->S1 * MR;")
                    with w.block("for (long j0 = 0; j0 < chunk; j0 += NR)"):
                        w.line(
                            f"{uk}(kc, a, Bp + (j0 / NR) * panel, Zb + k * G->LDZ + c0j + j0,"
                            " G->LDZ, MR, NR, c0 > 0);"
                        )
            w.line("/* bias and relu on the chunk while it is in cache */")
            with w.block("for (long k = 0; k < G->K1; ++k)"):
                w.line("float* restrict z = Zb + k * G->LDZ + c0j;")
                w.line("const float b = b1 ? b1[k] : 0.0f;")
                with w.block("for (long j = 0; j < (chunk + NR - 1) / NR * NR; ++j)"):
                    w.line("const float v = z[j] + b;")
                    w.line("z[j] = RELU_MID ? (v > 0.0f ? v : 0.0f) : v;")


def _emit_conv2(w: Writer, uk: str) -> None:
    w.line("/* conv2 of output rows [p2a, p2b) of image n from Z (rows from zbase) into Y, JB")
    w.line("   strips at a time like conv1; T holds the chunk's result strips */")
    with w.block(
        "static void cf_conv2(const cf_geo* G, const float* restrict W2p, const float* b2,\n"
        "    float* Y, const long* ys, long n, long p2a, long p2b, long zbase,\n"
        "    const float* restrict Z, float* restrict Bp, float* restrict T, const float* zeros)"
    ):
        w.line("const long npx = (p2b - p2a) * G->Q2;")
        w.line("const long panel = G->R2 * G->S2 * G->CB2 * NR;")
        with w.block("for (long c0j = 0; c0j < npx; c0j += JB * NR)"):
            w.line("const long chunk = CF_MIN(JB * NR, npx - c0j);")
            with w.block("for (long k0 = 0; k0 < G->K1; k0 += G->CB2)"):
                w.line("const long kw = CF_MIN(G->CB2, G->K1 - k0);")
                with w.block("for (long j0 = 0; j0 < chunk; j0 += NR)"):
                    w.line("const int nj = (int)CF_MIN(NR, chunk - j0);")
                    w.line("float* restrict Bs = Bp + (j0 / NR) * panel;")
                    w.line("long hh[NR], ww[NR];")
                    with w.block("for (int j = 0; j < NR; ++j)"):
                        w.line("const long idx = c0j + j0 + (j < nj ? j : 0);")
                        w.line("hh[j] = (p2a + idx / G->Q2) * G->st2 - G->pad2;")
                        w.line("ww[j] = (idx % G->Q2) * G->st2 - G->pad2;")
                    with w.block("for (long r = 0; r < G->R2; ++r)"):
                        with w.block("for (long s = 0; s < G->S2; ++s)"):
                            w.line("const float* src[NR];")
                            with w.block("for (int j = 0; j < NR; ++j)"):
                                w.line("const long h = hh[j] + r, x = ww[j] + s;")
                                w.line(
                                    "src[j] = j < nj && h >= 0 && h < G->P1 && x >= 0"
                                    " && x < G->Q1 ? Z + k0 * G->LDZ + (h - zbase) * G->Q1 + x"
                                    " : NULL;"
                                )
                            w.line(
                                "cf_gather(src, G->LDZ, kw, Bs + (r * G->S2 + s) * kw * NR, zeros);"
                            )
                w.line("const int kc = (int)(G->R2 * G->S2 * kw);")
                with w.block("for (long k = 0; k < G->K2; k += MR)"):
                    w.line("const float* restrict a = W2p + k * G->KC2 + k0 * G->R2 * G->S2 * MR;")
                    with w.block("for (long j0 = 0; j0 < chunk; j0 += NR)"):
                        w.line(
                            f"{uk}(kc, a, Bp + (j0 / NR) * panel, T + (j0 / NR) * G->K2p * NR"
                            " + k * NR, NR, MR, NR, k0 > 0);"
                        )
            with w.block("for (long j0 = 0; j0 < chunk; j0 += NR)"):
                w.line("const int nj = (int)CF_MIN(NR, chunk - j0);")
                w.line("float* dst[NR];")
                with w.block("for (int j = 0; j < nj; ++j)"):
                    w.line("const long idx = c0j + j0 + j;")
                    w.line("const long p2 = p2a + idx / G->Q2, q2 = idx % G->Q2;")
                    w.line("dst[j] = Y + n * ys[0] + p2 * ys[2] + q2 * ys[3];")
                w.line("cf_scatter(dst, ys[1], G->K2, T + (j0 / NR) * G->K2p * NR, b2, nj);")


def geometry(shape: ConvChainShape, tiles: ConvTiles) -> tuple[int, ...]:
    """The `GEOMETRY` values of one call."""
    values = {**shape.__dict__, "TP2": tiles.band_rows, "CB1": tiles.c_block,
              "CB2": tiles.k1_block}  # fmt: skip
    return tuple(int(values[k]) for k in GEOMETRY)


def useful_flops(shape: ConvChainShape) -> int:
    """Multiply-adds x 2 of both convolutions (no recompute)."""
    first = shape.P1 * shape.Q1 * shape.K1 * shape.C * shape.R1 * shape.S1
    second = shape.P2 * shape.Q2 * shape.K2 * shape.K1 * shape.R2 * shape.S2
    return 2 * shape.N * (first + second)
