"""Lower a bf16 conv -> [activation] -> conv chain onto AMX tiles: implicit GEMM, fused through a row
buffer of the intermediate in bf16.

One source, two builds, as `amx_chain`: the C calls the `CF_TILE_*` macros of
`csrc/amx_tiles.c` (the instructions, or with `-DCF_AMX_EMULATE` their bit-exact emulation).
Both convolutions are GEMMs of output pixels (tile rows: 16 or 32 consecutive pixels of one
output row) by output channels (tile columns, 16 a tile), summed tap by tap over blocks of 32
input channels::

    Y1[pix, k1] = sum over taps (r, s), blocks of 32 c:  Xpad[pix @ (r, s), c] . W1v[(r, s, c), k1]

The weights are packed as VNNI tiles (zeros past C and K), shared by the threads: by each call,
or once by `<name>_pack` (frozen weights: `ops.pack_conv_weights`), read in their place.
The pixels are never gathered: the input rows a band reads are copied once, from any layout
(NCHW or channels-last, through its strides), into a zero-padded channels-last bf16 buffer
`Xpad` (channels to whole 32s, the padding columns and rows as zeros), so a tile of pixels of
one tap is 16 rows `st * CP` elements apart. Per thread, blocks of (n, band of TP2 output rows
of conv2) claimed from a shared counter::

    for (n, band [pa, pb)) claimed:
        Xpad = X's rows the band's conv1 rows read (zeros for the padding)
        for each row z of Z the band reads (recomputed per band: halo "recompute"):
            Zpad[z] = bf16([f](conv1 + b1))          # fp32 tiles, rounded once as PyTorch's
        for each output row p of the band:           # unfused bf16 conv rounds Y1
            Y[n, :, p, :] = bf16([g](conv2(Zpad) + b2))      # through Y's strides

What is compiled in: the two activations (`conv.ConvChainSpec`'s); every size, stride, padding and the band's rows are
run-time arguments (`conv.GEOMETRY`, whose channel-block slots this kernel does not read).
"""

from __future__ import annotations

from dataclasses import dataclass

from chainfuse.codegen.amx_chain import amx_prelude, emit_tile_config
from chainfuse.codegen.common import (
    define_lines,
    name_hash,
    per_thread,
)
from chainfuse.codegen.conv import ConvChainShape, conv_word
from chainfuse.codegen.gemm_spec import Epilogue
from chainfuse.codegen.softmax import activation_c
from chainfuse.codegen.writer import Writer
from chainfuse.kernels.amx import AMX_BF16_32X32, AmxPath, emit_tap_block

__all__ = [
    "AMX_CONV_BUFFER",
    "AMX_CONV_LIMIT",
    "AMX_PACKED",
    "AmxConvSpec",
    "amx_conv_arithmetic",
    "amx_conv_band_rows",
    "amx_conv_header",
    "amx_conv_unsupported",
    "emit_amx_conv_chain",
]

#: the `micro` of weights packed for this kernel (`ConvKernel.pack`): its VNNI tiles depend on
#: the weights' shapes alone
AMX_PACKED = "amx"

#: Bytes a thread's padded input and intermediate rows take at most where a band has more than
#: one output row: the band's rows are chosen to fit
AMX_CONV_BUFFER = 1 << 20
#: ... and at most for a band of one row: a wider chain is refused, naming the size
AMX_CONV_LIMIT = 256 << 20


@dataclass(frozen=True)
class AmxConvSpec:
    """What the generated AMX conv code depends on (no sizes: those are arguments)."""

    between: Epilogue  # between the convolutions (NONE: none)
    after: Epilogue  # on the second convolution's result (NONE: none)

    @property
    def name(self) -> str:
        key = f"{AMX_BF16_32X32.name}|{self.between.value}|{self.after.value}"
        return f"{conv_word(self.between, self.after)}_bf16_amx_{name_hash(key)}"


def amx_conv_unsupported(shape: ConvChainShape) -> str:
    """Why the AMX conv generator does not take a chain of `shape` ("" when it does): it takes
    every conv -> [activation] -> conv `match_conv_chain` recognises (any kernel size, stride and
    padding; dilation 1 and no groups are all the IR describes), unless a band of one output
    row would need row buffers past `AMX_CONV_LIMIT`, or the second conv is depthwise (a
    filter per channel has no dot products for the tiles: the fp32 kernels run it)."""
    if shape.depthwise:
        return "a depthwise second convolution runs on the float32 conv kernels only"
    if shape.pad2_after > shape.pad2:
        return "the second convolution's padding differs before and after (float32 kernels only)"
    need = _band_bytes(shape, 1)
    if need > AMX_CONV_LIMIT:
        return (
            f"one output row's padded input and intermediate rows take {need} bytes, past the "
            f"AMX conv kernel's {AMX_CONV_LIMIT} per thread"
        )
    return ""


def _r32(x: int) -> int:
    return -(-x // 32) * 32


def _band_bytes(s: ConvChainShape, rows: int) -> int:
    """Bytes of a thread's `Xpad` and `Zpad` for bands of `rows` output rows (`CF_AMX_GEO`)."""
    xw = max(s.W + 2 * s.pad1, s.st1 * _r32(s.Q1) + s.S1)
    zw = max(s.Q1 + 2 * s.pad2, s.st2 * _r32(s.Q2) + s.S2)
    zrows = (rows - 1) * s.st2 + s.R2
    xrows = (zrows - 1) * s.st1 + s.R1
    return 2 * (xrows * xw * _r32(s.C) + zrows * zw * _r32(s.K1))


def amx_conv_band_rows(shape: ConvChainShape, threads: int) -> int:
    """Rows of conv2's output per band: enough bands for every thread where the images alone
    are fewer, each band's row buffers within `AMX_CONV_BUFFER` (at least one row)."""
    bands = -(-threads // shape.N) if threads > shape.N else 1
    rows = max(1, -(-shape.P2 // bands))
    while rows > 1 and _band_bytes(shape, rows) > AMX_CONV_BUFFER:
        rows = (rows + 1) // 2
    return rows


def amx_conv_arithmetic(path: AmxPath) -> str:
    """`ConvKernel.arithmetic` of an AMX conv kernel."""
    return (
        f"{path.value}: bf16 inputs, fp32 accumulation in AMX tiles (TDPBF16PS) over taps and "
        "32-channel blocks, bias and activations in fp32, the intermediate rounded to bf16 before the "
        "second convolution, output rounded to bf16 once"
    )


def amx_conv_header(spec: AmxConvSpec, path: AmxPath) -> str:
    """The source's opening comment: the chain with its sizes as symbols, the path."""
    mid, after = spec.between, spec.after
    ops = [
        "  Y1[n,k1,p1,q1] = sum[c,r1,s1] X[n,c,st1*p1+r1-pad1,st1*q1+s1-pad1] * W1[k1,c,r1,s1]",
        "  Y1 += b1[k1] (if given)",
        f"  Z = bf16({mid.value}(Y1))" if mid is not Epilogue.NONE else "  Z = bf16(Y1)",
        "  Y2[n,k2,p2,q2] = sum[k1,r2,s2] Z[n,k1,st2*p2+r2-pad2,st2*q2+s2-pad2] * W2[k2,k1,r2,s2]",
        "  Y2 += b2[k2] (if given)"
        + (f"; Y2 = {after.value}(Y2)" if after is not Epilogue.NONE else ""),
    ]
    return (
        f"chainfuse generated kernel {spec.name} ({path.value})\n"
        "chain:\n" + "\n".join(ops) + "\n"
        "parallel over n x bands of TP2 rows of conv2's output (a run-time argument); halo: "
        "recompute (every band makes the rows of Z it reads)\n"
        f"micro-kernel {AMX_BF16_32X32.name}: 16 or 32 pixels of one output row x 16 or 32 "
        "output channels in fp32 tiles, 32 input channels of one tap per step\n"
        f"arithmetic: {amx_conv_arithmetic(path)}"
    )


def emit_amx_conv_chain(spec: AmxConvSpec, header: str, path: AmxPath) -> str:
    """C source of `void <name>(...)` and `long <name>_workspace(g, per_thread)` with the
    signatures of `conv.emit_conv_chain`'s (so `compiled.ConvKernel` launches either), on AMX
    tiles; built with `path.cflags`."""
    name = spec.name
    w = amx_prelude(header, path)
    w.line("#define CF_MAX(a, b) ((a) > (b) ? (a) : (b))")
    w.line("#define CF_MIN(a, b) ((a) < (b) ? (a) : (b))")
    w.lines("".join(emit_tap_block(rt, ct) for rt in (1, 2) for ct in (1, 2)))
    w.line("")
    emit_tile_config(w)
    w.line("")
    _emit_pack_weights(w)
    _emit_geometry(w)
    _emit_conv_row(w)
    with w.block(f"long {name}_workspace(const long* g, long* per_thread)"):
        w.line("CF_AMX_GEO(g)")
        w.line("*per_thread = XPAD + ZPAD + ACC + TOFF;")
        w.line("return W1V + W2V;")
    w.line("")
    w.line("/* W1 and W2 as VNNI tiles into `shared` (W1V + W2V floats: the workspace's shared")
    w.line("   part), for a caller that packs them once (frozen weights); they depend on the")
    w.line("   weights' shapes alone */")
    with w.block(
        f"void {name}_pack(const uint16_t* W1, const uint16_t* W2, const long* g,\n"
        "    const long* w1s, const long* w2s, float* shared, int nthreads)"
    ):
        w.line("CF_AMX_GEO(g)")
        w.line("uint16_t* restrict W1v = (uint16_t*)shared;")
        w.line("uint16_t* restrict W2v = (uint16_t*)(shared + W1V);")
        w.line("#pragma omp parallel for schedule(static) num_threads(nthreads)")
        with w.block("for (long ct = 0; ct < K1T + K2T; ++ct)"):
            with w.block("if (ct < K1T)"):
                w.line("cf_amx_pack_conv_weights(W1, w1s, K1, C, R1, S1, ct, W1v);")
            with w.block("else"):
                w.line("cf_amx_pack_conv_weights(W2, w2s, K2, K1, R2, S2, ct - K1T, W2v);")
    w.line("")
    w.line("/* g: conv.GEOMETRY; xs, w1s, w2s, ys: strides (elements) of X, W1, W2, Y along their")
    w.line("   four dims (N, C, H, W / K, C, R, S); b1, b2 may be NULL (no bias). Every array is")
    w.line("   bf16; shared and work are float workspaces (64-byte aligned); packed: the weights")
    w.line("   as `_pack` leaves them (read only), or NULL: packed here, into shared */")
    with w.block(
        f"void {name}(const uint16_t* X, const uint16_t* W1, const uint16_t* W2,\n"
        "    const uint16_t* b1, const uint16_t* b2, uint16_t* Y, const long* g, const long* xs,\n"
        "    const long* w1s, const long* w2s, const long* ys, float* shared,\n"
        "    float* work, long work_per_thread, int nthreads, const float* packed)"
    ):
        w.line("CF_AMX_GEO(g)")
        with w.block("if (!packed) /* the weights as VNNI tiles, shared by the threads */"):
            w.line(f"{name}_pack(W1, W2, g, w1s, w2s, shared, nthreads);")
            w.line("packed = shared;")
        w.line("const uint16_t* restrict W1v = (const uint16_t*)packed;")
        w.line("const uint16_t* restrict W2v = (const uint16_t*)(packed + W1V);")
        w.line("const long bands = (P2 + TP2 - 1) / TP2, blocks = N * bands;")
        w.line("long next_blk = 0; /* the next block to claim: see cf_claim */")
        with per_thread(w):
            w.line("float* restrict base = work + (long)t * work_per_thread;")
            w.line("uint16_t* restrict Xpad = (uint16_t*)base;")
            w.line("uint16_t* restrict Zpad = (uint16_t*)(base + XPAD);")
            w.line("float* restrict acc = base + XPAD + ZPAD; /* 32 pixels x the channels */")
            w.line("long* restrict toff = (long*)(acc + ACC); /* tap offsets of a chunk */")
            w.line("cf_amx_config();")
            with w.block(
                "for (long blk = cf_claim(&next_blk); blk < blocks; blk = cf_claim(&next_blk))"
            ):
                _emit_band(w, spec)
            w.line("CF_TILE_RELEASE();")
    return w.text()


def _emit_pack_weights(w: Writer) -> None:
    """`cf_amx_pack_conv_weights`: output-channel tile `ct` of W [K, C, R, S] (strides `ws`) as
    VNNI tiles: for each tap (r, s), blocks of 32 channels; zeros past C and K."""
    w.line("/* column tile ct (output channels 16 ct ..) of W as R*S*CB VNNI tiles, tap-major:")
    w.line("   tile (t, cb) at out + ((ct * R*S + t) * CB + cb) * 512, its row q holding channels")
    w.line("   32 cb + 2q and + 1 of each output channel j at 2j and 2j + 1 */")
    with w.block(
        "static void cf_amx_pack_conv_weights(const uint16_t* W, const long* ws, long K, long C,\n"
        "    long R, long S, long ct, uint16_t* restrict out)"
    ):
        w.line("const long CB = CF_R32(C) / 32, taps = R * S;")
        with w.block("for (long t = 0; t < taps; ++t)"):
            w.line("const long r = t / S, s = t % S;")
            with w.block("for (long cb = 0; cb < CB; ++cb)"):
                w.line("uint16_t* restrict tile = out + ((ct * taps + t) * CB + cb) * 512;")
                with w.block("for (long q = 0; q < 16; ++q)"):
                    with w.block("for (long j = 0; j < 16; ++j)"):
                        w.line("const long k = 16 * ct + j, c = 32 * cb + 2 * q;")
                        w.line("const long at = k * ws[0] + c * ws[1] + r * ws[2] + s * ws[3];")
                        w.line("tile[32 * q + 2 * j] = k < K && c < C ? W[at] : 0;")
                        w.line("tile[32 * q + 2 * j + 1] = k < K && c + 1 < C ? W[at + ws[1]] : 0;")
    w.line("")


def _emit_geometry(w: Writer) -> None:
    """`CF_AMX_GEO(g)`: the geometry's values and what follows: padded channels and widths,
    the band's row counts, the workspace's regions (floats)."""
    w.line("/* the geometry (conv.GEOMETRY) and what follows from it: channels padded to whole")
    w.line("   32s (CP, K1P), output-channel tiles (K1T, K2T), padded row widths (XW, ZW: the row,")
    w.line("   its padding, and what a 32-pixel tile of the last whole 32 reads past it), rows a")
    w.line("   band holds (ZR of Z, XR of X), the workspace's regions in floats */")
    lines = [
        "const long N = (g)[0], C = (g)[1], H = (g)[2], W = (g)[3], K1 = (g)[4];",
        "const long R1 = (g)[5], S1 = (g)[6], P1 = (g)[7], Q1 = (g)[8], st1 = (g)[9];",
        "const long pad1 = (g)[10], K2 = (g)[11], R2 = (g)[12], S2 = (g)[13], P2 = (g)[14];",
        "const long Q2 = (g)[15], st2 = (g)[16], pad2 = (g)[17], TP2 = (g)[18];",
        "const long CP = CF_R32(C), K1P = CF_R32(K1), K1T = (K1 + 15) / 16, K2T = (K2 + 15) / 16;",
        "const long XW = CF_MAX(W + 2 * pad1, st1 * CF_R32(Q1) + S1);",
        "const long ZW = CF_MAX(Q1 + 2 * pad2, st2 * CF_R32(Q2) + S2);",
        "const long ZR = (TP2 - 1) * st2 + R2, XR = (ZR - 1) * st1 + R1;",
        "const long W1V = ALIGN16(K1T * R1 * S1 * CP * 8), W2V = ALIGN16(K2T * R2 * S2 * K1P * 8);",
        "const long XPAD = ALIGN16(XR * XW * CP / 2), ZPAD = ALIGN16(ZR * ZW * K1P / 2);",
        "const long ACC = ALIGN16(32 * 16 * CF_MAX(K1T, K2T));",
        "const long TOFF = ALIGN16(2 * CF_MAX(R1 * S1, R2 * S2)); /* longs as floats */",
        "(void)N; (void)H; (void)P1; (void)W1V; (void)XPAD; (void)ZPAD; (void)ACC; (void)TOFF;",
    ]
    define_lines(w, "CF_AMX_GEO(g)", lines)
    w.line("")


def _emit_conv_row(w: Writer) -> None:
    """`cf_amx_conv_chunk`: up to 32 pixels of one output row of a convolution from a padded
    channels-last buffer into fp32 `acc`, every tap summed in tiles."""
    w.line("/* up to 32 pixels from q0 of one output row: pixel q's tap (r, s) at")
    w.line(
        "   in + (r * IW + q * st + s) * CI (a padded channels-last buffer, CI channels a pixel,"
    )
    w.line("   whole 32s); KT tiles of 16 output channels from VNNI weights wv (R*S*CI/32 tiles")
    w.line("   per column tile) into acc (fp32, 16 KT a row, the row length returned); toff holds")
    w.line("   R*S longs */")
    with w.block(
        "static long cf_amx_conv_chunk(const uint16_t* in, long IW, long CI, long st, long R,\n"
        "    long S, long q0, long rows, const uint16_t* wv, long KT, float* restrict acc,\n"
        "    long* restrict toff)"
    ):
        w.line("const long CB = CI / 32, taps = R * S, lda = 2 * st * CI, ldc = 4 * 16 * KT;")
        w.line("for (long t = 0; t < taps; ++t) toff[t] = ((t / S) * IW + t % S) * CI;")
        w.line("const uint16_t* a = in + q0 * st * CI;")
        with w.block("for (long c0 = 0; c0 < KT; c0 += 2)"):
            w.line("float* restrict c = acc + 16 * c0;")
            w.line("const uint16_t* b = wv + c0 * taps * CB * 512;")
            w.line("const long bs = taps * CB; /* tiles between column tiles */")
            with w.block("if (rows > 16)"):
                w.line("if (c0 + 1 < KT) cf_amx_taps_r2c2(taps, toff, CB, a, lda, b, bs, c, ldc);")
                w.line("else cf_amx_taps_r2c1(taps, toff, CB, a, lda, b, bs, c, ldc);")
            with w.block("else"):
                w.line("if (c0 + 1 < KT) cf_amx_taps_r1c2(taps, toff, CB, a, lda, b, bs, c, ldc);")
                w.line("else cf_amx_taps_r1c1(taps, toff, CB, a, lda, b, bs, c, ldc);")
        w.line("return 16 * KT;")
    w.line("")


def _emit_band(w: Writer, spec: AmxConvSpec) -> None:
    """One block: conv1 rows the band reads into Zpad, then the band's rows of Y."""
    w.line("const long n = blk / bands, pa = (blk % bands) * TP2, pb = CF_MIN(P2, pa + TP2);")
    w.line("/* Zpad row i is Z row z_first + i (rows outside [0, P1) stay zero: padding) */")
    w.line("const long z_first = pa * st2 - pad2, zrows = (pb - pa - 1) * st2 + R2;")
    w.line("const long za = CF_MAX(0, z_first), zb = CF_MIN(P1, z_first + zrows);")
    w.line("memset(Zpad, 0, sizeof(uint16_t) * (size_t)(zrows * ZW * K1P));")
    with w.block("if (zb > za)"):
        w.line("/* Xpad row i is X row x_first + i: the rows conv1's rows [za, zb) read */")
        w.line("const long x_first = za * st1 - pad1, xrows = (zb - za - 1) * st1 + R1;")
        w.line("memset(Xpad, 0, sizeof(uint16_t) * (size_t)(xrows * XW * CP));")
        w.line("const uint16_t* Xn = X + n * xs[0];")
        with w.block("for (long i = 0; i < xrows; ++i)"):
            w.line("const long h = x_first + i;")
            w.line("if (h < 0 || h >= H) continue;")
            with w.block("for (long x = 0; x < W; ++x)"):
                w.line("uint16_t* restrict px = Xpad + (i * XW + pad1 + x) * CP;")
                w.line("const uint16_t* src = Xn + h * xs[2] + x * xs[3];")
                w.line("for (long c = 0; c < C; ++c) px[c] = src[c * xs[1]];")
        with w.block("for (long z = za; z < zb; ++z)"):
            w.line("const uint16_t* in = Xpad + (z - za) * st1 * XW * CP;")
            w.line("uint16_t* zrow = Zpad + ((z - z_first) * ZW + pad2) * K1P;")
            with w.block("for (long q0 = 0; q0 < Q1; q0 += 32)"):
                w.line("const long rows = CF_MIN(32, Q1 - q0);")
                w.line("const long ld = cf_amx_conv_chunk(in, XW, CP, st1, R1, S1, q0, rows, W1v,")
                w.line("                                  K1T, acc, toff);")
                with w.block("for (long i = 0; i < rows; ++i)"):
                    w.line("uint16_t* restrict zq = zrow + (q0 + i) * K1P;")
                    with w.block("for (long k = 0; k < K1; ++k)"):
                        w.line("float v = acc[i * ld + k] + (b1 ? cf_from_bf16(b1[k]) : 0.0f);")
                        if spec.between is not Epilogue.NONE:
                            w.line(f"v = {activation_c(spec.between, 'v')}; /* NaN stays NaN */")
                        w.line("zq[k] = cf_to_bf16(v);")
    with w.block("for (long p = pa; p < pb; ++p)"):
        w.line("const uint16_t* in = Zpad + (p - pa) * st2 * ZW * K1P;")
        w.line("uint16_t* Yr = Y + n * ys[0] + p * ys[2];")
        with w.block("for (long q0 = 0; q0 < Q2; q0 += 32)"):
            w.line("const long rows = CF_MIN(32, Q2 - q0);")
            w.line("const long ld = cf_amx_conv_chunk(in, ZW, K1P, st2, R2, S2, q0, rows, W2v,")
            w.line("                                  K2T, acc, toff);")
            with w.block("for (long i = 0; i < rows; ++i)"):
                with w.block("for (long k = 0; k < K2; ++k)"):
                    w.line("float v = acc[i * ld + k] + (b2 ? cf_from_bf16(b2[k]) : 0.0f);")
                    if spec.after is not Epilogue.NONE:
                        w.line(f"v = {activation_c(spec.after, 'v')};")
                    w.line("Yr[k * ys[1] + (q0 + i) * ys[3]] = cf_to_bf16(v);")
