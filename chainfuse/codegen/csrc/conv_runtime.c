/* standalone prologue, stripped when loaded: what a generated source defines before this */
#include <stddef.h>
#include <string.h>

#define ALIGN16(x) (((x) + 15) & ~15L)
#define MR 6
#define NR 16
#define FLAT_PIXELS 64 * MR
#define TB 8
void uk(int kc, const float* Ap, const float* Bp, float* C, long ldc, int m, int n, int acc);
void uk_strided(int kc, const float* A, long rs, long ks, const float* Bp, float* C, long ldc,
                int n, int acc);
void uk_grouped(int kc, int ng, long gs, const float* A, long rs, long ks, const float* Bp,
                float* C, long ldc, int n, int acc);
void uk_transpose(const float* src, long lds, float* dst, long ldd);
#define UK uk
#define UK_STRIDED uk_strided
#define UK_GROUPED uk_grouped
#define UK_TRANSPOSE uk_transpose
#define ACT_MID 1
#define DEPTHWISE 1
#define ACT_OUT 1
#define CF_ACT_MID(v) ((v) < 0.0f ? 0.0f : (v))
#define CF_ACT_OUT(v) ((v) < 0.0f ? 0.0f : (v))
/* ---- end of the standalone prologue ---- */
#define CF_MIN(a, b) ((a) < (b) ? (a) : (b))
#define CF_MAX(a, b) ((a) > (b) ? (a) : (b))

/* the run-time geometry (GEOMETRY in chainfuse/codegen/conv.py) and derived sizes */
typedef struct {
    long N, C, H, W, K1, R1, S1, P1, Q1, st1, pad1, K2, R2, S2, P2, Q2, st2, pad2, TP2, CB1, CB2;
    long KC;             /* k steps of a weight panel filling half of L1 (code_tiles) */
    long LDK1, LDK2;     /* floats per pixel of Z and of the band's result T: K rounded to NR */
    long ZROWS;          /* rows of Z a band holds at most */
    long TMP;            /* floats of a chunk's packed edge slivers and their results */
    long XROWS;          /* rows of X the conv1 rows of a band read at most */
} cf_geo;

/* floats of the packed W2: [K2 panels][R2*S2*K1][NR], or [R2*S2][LDK1] (depthwise) */
#define CF_W2P(G) (DEPTHWISE ? (G).R2 * (G).S2 * (G).LDK1 : (G).LDK2 * (G).R2 * (G).S2 * (G).K1)

/* The clean slivers of an output row of Q pixels, [*lo, *hi) in steps of MR from the first
   pixel whose window (S taps, stride st, padding pad) lies inside the W columns of the input */
static void cf_clean(long Q, long S, long st, long pad, long W, long* lo, long* hi)
{
    long first = (pad + st - 1) / st, end = Q; /* clean pixels: [first, end) */
    while (end > first && (end - 1) * st + S - 1 - pad >= W) --end;
    first = CF_MIN(first, end);
    *lo = first;
    *hi = first + (end - first) / MR * MR;
}

/* most edge pixels (the others) of a chunk of cf_conv_rows: its rows times a row's (a flat
   chunk has fewer than MR) */
static long cf_edge_pixels(long Q, long S, long st, long pad, long W)
{
    long lo, hi;
    cf_clean(Q, S, st, pad, W, &lo, &hi);
    return CF_MAX(MR, CF_MAX(1, (FLAT_PIXELS + Q - 1) / Q) * (Q - (hi - lo)));
}

static void cf_geo_init(cf_geo* G, const long* g)
{
    G->N = g[0]; G->C = g[1]; G->H = g[2]; G->W = g[3]; G->K1 = g[4]; G->R1 = g[5];
    G->S1 = g[6]; G->P1 = g[7]; G->Q1 = g[8]; G->st1 = g[9]; G->pad1 = g[10]; G->K2 = g[11];
    G->R2 = g[12]; G->S2 = g[13]; G->P2 = g[14]; G->Q2 = g[15]; G->st2 = g[16];
    G->pad2 = g[17]; G->TP2 = g[18]; G->CB1 = g[19]; G->CB2 = g[20]; G->KC = g[21];
    G->LDK1 = (G->K1 + NR - 1) / NR * NR;
    G->LDK2 = (G->K2 + NR - 1) / NR * NR;
    G->ZROWS = CF_MIN(G->P1, (G->TP2 - 1) * G->st2 + G->R2);
    const long e1 = cf_edge_pixels(G->Q1, G->S1, G->st1, G->pad1, G->W) + MR;
    const long e2 = cf_edge_pixels(G->Q2, G->S2, G->st2, G->pad2, G->Q1) + MR;
    G->TMP = CF_MAX(e1 * (G->R1 * G->S1 * G->C + G->LDK1), e2 * (G->R2 * G->S2 * G->K1 + G->LDK2));
    G->XROWS = CF_MIN(G->H, (G->ZROWS - 1) * G->st1 + G->R1);
}

/* dst[j*ldd + i] = src[i*lds + j] for i < rows, j < cols: TB x TB blocks through registers */
static void cf_transpose(const float* restrict src, long lds, float* restrict dst, long ldd,
                         long rows, long cols)
{
    long i = 0;
#if TB
    for (; i + TB <= rows; i += TB) {
        long j = 0;
        for (; j + TB <= cols; j += TB) {
            UK_TRANSPOSE(src + i * lds + j, lds, dst + j * ldd + i, ldd);
        }
        for (; j < cols; ++j) {
            for (long ii = i; ii < i + TB; ++ii) dst[j * ldd + ii] = src[ii * lds + j];
        }
    }
#endif
    for (; i < rows; ++i) {
        for (long j = 0; j < cols; ++j) dst[j * ldd + i] = src[i * lds + j];
    }
}

/* Rows [ha, hb) of one image of X, channel c of pixel (h, w) at x[c*cs + h*hs + w*ws] (NCHW or
   any other order), as channels-last rows: out[((h - ha)*W + w)*C + c]; a row no window of R
   rows at stride st (padding pad) reads is skipped */
static void cf_rows_to_channels_last(const float* x, long cs, long hs, long ws, long C, long W,
                                     long R, long st, long pad, long ha, long hb,
                                     float* restrict out)
{
    for (long h = ha; h < hb; ++h) {
        if ((h + pad) % st >= R) continue;
        float* restrict o = out + (h - ha) * W * C;
        if (ws == 1) { /* rows of pixels per channel (NCHW): transposed in blocks */
            cf_transpose(x + h * hs, cs, o, C, C, W);
            continue;
        }
        for (long w = 0; w < W; ++w) {
            for (long c = 0; c < C; ++c) o[w * C + c] = x[c * cs + h * hs + w * ws];
        }
    }
}

/* One convolution as read by cf_conv_rows: input pixel (h, w), channel c at
   in[(h - h0)*hs + w*ws + c*cs] for rows 0 <= h < H (h0: the first row stored), 0 <= w < W;
   weights packed by cf_pack_weights; bias (or NULL) and the activation (mid: the one between
   the convolutions, else the one after) applied to each chunk of results while it is in
   cache (cf_epilogue). */
typedef struct {
    const float* in;
    long h0, hs, ws, cs, H, W, C, R, S, st, pad, K, CB, KC;
    const float* Wp;
    const float* bias;
    int mid;
} cf_conv;

/* Wp for output channels [jb, jb + NR): [(r*S + s)*C + c][NR], rows past K zeros; the panel of
   block jb starts at jb*R*S*C. A row of taps (r, all s, all c) is one contiguous panel. */
static void cf_pack_weights(const float* W, const long* ws, long K, long C, long R, long S,
                            long jb, float* restrict Wp)
{
    float* restrict out = Wp + jb * R * S * C;
    const long nj = CF_MIN(NR, K - jb), k0 = ws[0];
    /* in the panel's order: NR contiguous writes from NR rows of W, each read in its order */
    for (long c = 0; c < C; ++c) {
        for (long r = 0; r < R; ++r) {
            for (long s = 0; s < S; ++s) {
                const float* restrict src = W + jb * k0 + c * ws[1] + r * ws[2] + s * ws[3];
                float* restrict d = out + ((r * S + s) * C + c) * NR;
                for (long j = 0; j < nj; ++j) d[j] = src[j * k0];
                for (long j = nj; j < NR; ++j) d[j] = 0.0f;
            }
        }
    }
}

/* out[pix*ldo + k] = f(out[pix*ldo + k] + bias[k]) for pix < npx, k < K; f is the chain's
   activation between the convolutions (mid) or after the second (!mid), which the generated
   code defines: ACT_MID / ACT_OUT (whether there is one), CF_ACT_MID(v) / CF_ACT_OUT(v) (its
   expression of the float v). NaN stays NaN through each, as through PyTorch's. One pass over
   each pixel's channels: the bias added and the activation applied together. */
#define CF_EPILOGUE_PASS(ACT)                                                                  \
    do {                                                                                       \
        if (bias) {                                                                            \
            _Pragma("omp simd") for (long k = 0; k < K; ++k) {                                 \
                const float v = o[k] + bias[k];                                                \
                o[k] = ACT(v);                                                                 \
            }                                                                                  \
        } else {                                                                               \
            _Pragma("omp simd") for (long k = 0; k < K; ++k) {                                 \
                const float v = o[k];                                                          \
                o[k] = ACT(v);                                                                 \
            }                                                                                  \
        }                                                                                      \
    } while (0)

static void cf_epilogue(float* out, long ldo, long npx, long K, const float* bias, int mid)
{
    const int act = mid ? ACT_MID : ACT_OUT;
    if (!bias && !act) return;
    for (long i = 0; i < npx; ++i) {
        float* restrict o = out + i * ldo;
        if (!act) {
            for (long k = 0; k < K; ++k) o[k] += bias[k];
        } else if (mid) {
            CF_EPILOGUE_PASS(CF_ACT_MID);
        } else {
            CF_EPILOGUE_PASS(CF_ACT_OUT);
        }
    }
}

#if DEPTHWISE
/* Wd[(r*S2 + s)*LDK1 + k] = W2[k, 0, r, s] (zeros for k past K1): a tap's weights for every
   channel contiguous, as cf_dw_rows reads them along Z's pixels */
static void cf_pack_depthwise(const float* W2, const long* ws, const cf_geo* G, float* restrict Wd)
{
    for (long r = 0; r < G->R2; ++r) {
        for (long s = 0; s < G->S2; ++s) {
            float* restrict d = Wd + (r * G->S2 + s) * G->LDK1;
            const float* restrict src = W2 + r * ws[2] + s * ws[3];
            for (long k = 0; k < G->K1; ++k) d[k] = src[k * ws[0]];
            for (long k = G->K1; k < G->LDK1; ++k) d[k] = 0.0f;
        }
    }
}

/* channels of one depthwise pass: their sums stay in registers over every tap (8 AVX2 or 4
   AVX-512 vectors) */
#define DW_CHUNK 64

/* The sums of one output pixel over the taps [r0, r1) x [s0, s1) for WIDTH channels (a
   constant, so the compiler keeps them in registers), Z's pixel (h, w) at z[h*zs + w*L], Wd at
   w[(r*S2 + s)*L]; the first n (<= WIDTH) stored to o with the bias and the activation after.
   Lanes past K1 read Z's and Wd's padding to a whole NR (never stored). */
#define CF_DW_SUMS(WIDTH, n)                                                                   \
    do {                                                                                       \
        float acc[WIDTH];                                                                      \
        for (long k = 0; k < (WIDTH); ++k) acc[k] = 0.0f;                                      \
        for (long r = r0; r < r1; ++r) {                                                       \
            for (long s = s0; s < s1; ++s) {                                                   \
                const float* restrict zp = z + (r - r0) * zs + (s - s0) * L;                   \
                const float* restrict wp = w + (r * S2 + s) * L;                               \
                for (long k = 0; k < (WIDTH); ++k) acc[k] += zp[k] * wp[k];                    \
            }                                                                                  \
        }                                                                                      \
        if (bias) {                                                                            \
            for (long k = 0; k < (n); ++k) {                                                   \
                const float v = acc[k] + bias[k];                                              \
                o[k] = CF_ACT_OUT(v);                                                          \
            }                                                                                  \
        } else {                                                                               \
            for (long k = 0; k < (n); ++k) {                                                   \
                const float v = acc[k];                                                        \
                o[k] = CF_ACT_OUT(v);                                                          \
            }                                                                                  \
        }                                                                                      \
    } while (0)

/* Output rows [pa, pb) of the depthwise second convolution from the rows of Z a band holds (row
   h of the image at Z[(h - z0)*Q1*LDK1]), its bias b2 (or NULL) added and the activation after
   it applied as each sum leaves the registers: pixel (p, q) to out[((p - pa)*Q2 + q)*ldo + k],
   k < K1. Taps in the padding are skipped (zeros). */
static void cf_dw_rows(const cf_geo* G, const float* restrict Z, long z0, const float* restrict Wd,
                       const float* restrict b2, long pa, long pb, float* restrict out, long ldo)
{
    const long L = G->LDK1, K = G->K1, S2 = G->S2, zs = G->Q1 * L;
    for (long p = pa; p < pb; ++p) {
        const long h = p * G->st2 - G->pad2;
        const long r0 = CF_MAX(0, -h), r1 = CF_MIN(G->R2, G->P1 - h);
        for (long q = 0; q < G->Q2; ++q) {
            const long c = q * G->st2 - G->pad2;
            const long s0 = CF_MAX(0, -c), s1 = CF_MIN(S2, G->Q1 - c);
            float* restrict ob = out + ((p - pa) * G->Q2 + q) * ldo;
            const float* zb = Z + (h + r0 - z0) * zs + (c + s0) * L;
            for (long k0 = 0; k0 < K; k0 += DW_CHUNK) {
                const float* z = zb + k0;
                const float* w = Wd + k0;
                const float* bias = b2 ? b2 + k0 : NULL;
                float* restrict o = ob + k0;
                const long n = CF_MIN(DW_CHUNK, K - k0);
                /* the last chunk as wide as its channels rounded to 16 (NR's multiple) */
                switch ((n + 15) / 16) {
                case 1: CF_DW_SUMS(16, n); break;
                case 2: CF_DW_SUMS(32, n); break;
                case 3: CF_DW_SUMS(48, n); break;
                default: CF_DW_SUMS(DW_CHUNK, n); break;
                }
            }
        }
    }
}
#endif

/* Output rows [pa, pb) of one convolution, all K channels, before bias: output pixel (p, q)
   goes to out[((p - pa)*Q + q)*ldo + k]. Pixels on the micro-kernel's MR rows (slivers of MR
   pixels of one output row, or of consecutive pixels when the conv is a plain 1x1), output
   channels on its NR columns. A sliver whose windows lie inside the input is read in place by
   the strided micro-kernel (no gather, no copy): A(i, p) = first pixel's tap + i*st*ws + p*ks.
   When the input is channels-last (ws == C, cs == 1) a row of taps (s, c) is S*C consecutive
   floats, and one grouped call runs all the rows of taps that fall inside the input; else
   one call per tap and channel block. A sliver touching the padding, or short, is packed once
   with zeros (tmp, all taps) and runs one call of every tap per NR channels (same rule). */
static void cf_conv_rows(const cf_conv* cv, long pa, long pb, long Q, float* restrict out,
                         long ldo, float* restrict tmp)
{
    const long R = cv->R, S = cv->S, C = cv->C, K = cv->K, st = cv->st, pad = cv->pad;
    const long RSC = R * S * C;
    const int flat = R == 1 && S == 1 && st == 1 && pad == 0 && Q == cv->W
                     && cv->hs == cv->W * cv->ws;
    const int rowmode = cv->cs == 1 && cv->ws == C && S * C <= 2 * cv->KC;
    const long rs = flat ? cv->ws : st * cv->ws;
    const long total = (pb - pa) * Q;
    /* a chunk: FLAT_PIXELS consecutive pixels (flat), else the whole rows that hold as many */
    const long step = flat ? FLAT_PIXELS : CF_MAX(1, (FLAT_PIXELS + Q - 1) / Q) * Q;
    /* the clean slivers of a row are [clean_lo, clean_hi): windows inside the input */
    long clean_lo, clean_hi;
    cf_clean(Q, S, st, pad, cv->W, &clean_lo, &clean_hi);
    const long LDK = (K + NR - 1) / NR * NR;
    for (long c0 = 0; c0 < total; c0 += step) {
        const long npx = CF_MIN(step, total - c0);
        const long p0 = pa + c0 / Q;              /* the chunk's first output row */
        const long rows = flat ? 1 : npx / Q;     /* and its rows (one run of npx if flat) */
        const long len = flat ? npx : Q;          /* pixels of a row */
        const long lo_e = flat ? 0 : clean_lo, hi_f = flat ? npx / MR * MR : clean_hi;
        /* the chunk's edge pixels ([0, lo_e) and [hi_f, len) of each row), MR to a sliver
           whatever their rows, packed with zeros for every tap: tmp[e][(r*S + s)*C + c][MR];
           their results go to Ce[e][MR][LDK], then to out */
        long e_at[cf_edge_pixels(Q, S, st, pad, cv->W) + MR];
        long ne = 0;
        for (long rr = 0; rr < rows; ++rr) {
            for (long i = 0; i < lo_e; ++i) e_at[ne++] = c0 + rr * len + i;
            for (long i = hi_f; i < len; ++i) e_at[ne++] = c0 + rr * len + i;
        }
        const long edges = (ne + MR - 1) / MR;
        float* restrict Ce = tmp + edges * MR * RSC;
        for (long e = 0; e < edges; ++e) {
            float* restrict d0 = tmp + e * MR * RSC;
            for (int i = 0; i < MR; ++i) {
                const int used = e * MR + i < ne;
                const long idx = used ? e_at[e * MR + i] : 0; /* output pixel, flat from (pa, 0) */
                const long pp = pa + idx / Q, q = idx % Q;
                for (long r = 0; r < R; ++r) {
                    const long h = pp * st + r - pad;
                    for (long s = 0; s < S; ++s) {
                        const long w = q * st + s - pad;
                        float* restrict d = d0 + (r * S + s) * C * MR + i;
                        if (used && h >= 0 && h < cv->H && w >= 0 && w < cv->W) {
                            const float* x = cv->in + (h - cv->h0) * cv->hs + w * cv->ws;
                            for (long c = 0; c < C; ++c) d[c * MR] = x[c * cv->cs];
                        } else {
                            for (long c = 0; c < C; ++c) d[c * MR] = 0.0f;
                        }
                    }
                }
            }
        }
        if (rowmode) {
            /* a sliver meets every block of output channels while it is in L1 (the weights
               stream from L2); one call runs all the rows of taps whose input rows exist */
            for (long rr = 0; rr < rows; ++rr) {
                const long p = p0 + rr;
                const long r_lo = flat ? 0 : CF_MAX(0, pad - p * st);
                const long r_hi = flat ? 1 : CF_MIN(R, cv->H + pad - p * st);
                if (r_hi <= r_lo) continue;
                const long h = flat ? pa : p * st + r_lo - pad;
                const float* row = cv->in + (h - cv->h0) * cv->hs;
                const float* wr = cv->Wp + r_lo * S * C * NR;
                float* o = out + (c0 + rr * len) * ldo;
                for (long i0 = lo_e; i0 < hi_f; i0 += MR) {
                    const float* a = row + (flat ? c0 + i0 : i0 * st - pad) * cv->ws;
                    for (long jb = 0; jb < K; jb += NR) {
                        UK_GROUPED((int)(S * C), (int)(r_hi - r_lo), cv->hs, a, rs, 1,
                                   wr + jb * RSC, o + i0 * ldo + jb, ldo, (int)CF_MIN(NR, K - jb),
                                   0);
                    }
                    /* the sliver's results, every channel, while they are in L1 */
                    cf_epilogue(o + i0 * ldo, ldo, MR, K, cv->bias, cv->mid);
                }
            }
            for (long e = 0; e < edges; ++e) { /* every tap, padding included */
                for (long jb = 0; jb < K; jb += NR) {
                    UK((int)RSC, tmp + e * RSC * MR, cv->Wp + jb * RSC, Ce + e * MR * LDK + jb,
                       LDK, MR, NR, 0);
                }
            }
        } else {
            /* one tap and block of CB channels per call, as many NR-channel blocks of weights
               at a time as fit L1 (2*KC steps): each sliver serves them all while in L1 */
            const long jstep = NR * CF_MAX(1, 2 * cv->KC / CF_MIN(cv->CB, C));
            for (long jo = 0; jo < K; jo += jstep) {
                const long jend = CF_MIN(K, jo + jstep);
                for (long r = 0; r < R; ++r) {
                    for (long s = 0; s < S; ++s) {
                        for (long cc = 0; cc < C; cc += cv->CB) {
                            const int kc = (int)CF_MIN(cv->CB, C - cc);
                            const long g = (r * S + s) * C + cc; /* the group's first k step */
                            const int later = s > 0 || cc > 0;
                            for (long rr = 0; rr < rows; ++rr) {
                                const long p = p0 + rr;
                                const long h = flat ? pa : p * st + r - pad;
                                if (h < 0 || h >= cv->H) continue;
                                const int acc = later || r > CF_MAX(0, pad - p * st);
                                const float* row = cv->in + (h - cv->h0) * cv->hs + cc * cv->cs;
                                float* o = out + (c0 + rr * len) * ldo;
                                for (long i0 = lo_e; i0 < hi_f; i0 += MR) {
                                    const long w = flat ? c0 + i0 : i0 * st + s - pad;
                                    for (long jb = jo; jb < jend; jb += NR) {
                                        UK_STRIDED(kc, row + w * cv->ws, rs, cv->cs,
                                                   cv->Wp + jb * RSC + g * NR, o + i0 * ldo + jb,
                                                   ldo, (int)CF_MIN(NR, K - jb), acc);
                                    }
                                }
                            }
                            for (long e = 0; e < edges; ++e) { /* every tap, padding included */
                                for (long jb = jo; jb < jend; jb += NR) {
                                    UK(kc, tmp + (e * RSC + g) * MR, cv->Wp + jb * RSC + g * NR,
                                       Ce + e * MR * LDK + jb, LDK, MR, NR, later || r > 0);
                                }
                            }
                        }
                    }
                }
            }
        }
        for (long i = 0; i < ne; ++i) {
            memcpy(out + e_at[i] * ldo, Ce + i * LDK, sizeof(float) * (size_t)K);
            if (rowmode) cf_epilogue(out + e_at[i] * ldo, ldo, 1, K, cv->bias, cv->mid);
        }
        for (long rr = 0; rr < rows; ++rr) { /* a row whose taps all read padding: zeros */
            const long p = p0 + rr;
            if (flat || (p * st + R - 1 - pad >= 0 && p * st - pad < cv->H)) continue;
            for (long i = lo_e; i < hi_f; ++i) {
                for (long k = 0; k < K; ++k) out[(c0 + rr * Q + i) * ldo + k] = 0.0f;
                if (rowmode) cf_epilogue(out + (c0 + rr * Q + i) * ldo, ldo, 1, K, cv->bias, cv->mid);
            }
        }
        if (!rowmode) { /* (rowmode: applied to each sliver and edge pixel as it was made) */
            cf_epilogue(out + c0 * ldo, ldo, npx, K, cv->bias, cv->mid);
        }
    }
}
