/* AMX tile operations for generated kernels: one source, two builds.
 *
 * Kernels call CF_TILE_* macros with literal tile numbers. Built with CF_AMX_EMULATE defined,
 * they run the plain-C emulation below on any host; without it, the AMX intrinsics
 * (-mamx-tile -mamx-bf16). The emulation follows TDPBF16PS bit for bit: per output element two
 * fp32 accumulators (even and odd k) each take one fma a pair, rounded once to nearest even,
 * then C += (even + odd); denormal inputs read as signed zero, tiny results (tininess after
 * rounding) flush to signed zero, NaNs propagate as the first NaN operand quieted, and an
 * invalid operation without a NaN operand gives 0xFFC00000 (docs/design.md, "AMX").
 */
#include <stdint.h>
#include <string.h>

/* the 64-byte tile configuration (palette 1): bytes per row and rows of each of 8 tiles */
typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) cf_tilecfg;

#ifdef CF_AMX_EMULATE
#include <math.h>

typedef struct {
    uint8_t data[8][16][64];
    uint16_t colsb[8];
    uint8_t rows[8];
} cf_tile_state;

static __thread cf_tile_state cf_tiles;

static inline uint32_t cf_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static inline float cf_float(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* denormals are zero: a denormal input reads as zero of its sign */
static inline float cf_daz(float x)
{
    const uint32_t u = cf_bits(x);
    return (u & 0x7f800000u) == 0 ? cf_float(u & 0x80000000u) : x;
}

static inline float cf_bf16(uint16_t h)
{
    return cf_daz(cf_float((uint32_t)h << 16));
}

static inline float cf_quiet(float x)
{
    return cf_float(cf_bits(x) | 0x00400000u);
}

#define CF_TINY 0x1p-126f
#define CF_TINY_EXACT (0x1p-126 - 0x1p-151) /* rounds up to 2^-126 with an unbounded exponent */

/* flush a rounded result `r` whose exact value is `exact` (in double) to signed zero when it is
   tiny after rounding: below 2^-126, or rounded up to 2^-126 from below the midpoint */
static inline float cf_flush(float r, double exact)
{
    const float a = fabsf(r);
    if (a < CF_TINY || (a == CF_TINY && fabs(exact) < CF_TINY_EXACT))
        return cf_float(cf_bits(r) & 0x80000000u);
    return r;
}

/* fma(a, b, c) as one TDPBF16PS step: rounded once, tiny results flushed, AMX's NaN rules */
static float cf_amx_fma(float a, float b, float c)
{
    if (isnan(a)) return cf_quiet(a);
    if (isnan(b)) return cf_quiet(b);
    if (isnan(c)) return cf_quiet(c);
    const int inf_prod = isinf(a) || isinf(b);
    if (inf_prod && (a == 0.0f || b == 0.0f)) return cf_float(0xffc00000u);
    if (inf_prod && isinf(c) && (signbit(a) != signbit(b)) != (signbit(c) != 0))
        return cf_float(0xffc00000u);
    const float r = fmaf(a, b, c);
    /* (a, b are bf16: their product is exact in double, and so is the sum where it matters) */
    return cf_flush(r, (double)a * (double)b + (double)c);
}

/* a + b as TDPBF16PS adds: tiny results flushed, AMX's NaN rules */
static float cf_amx_add(float a, float b)
{
    if (isnan(a)) return cf_quiet(a);
    if (isnan(b)) return cf_quiet(b);
    if (isinf(a) && isinf(b) && signbit(a) != signbit(b)) return cf_float(0xffc00000u);
    return cf_flush(a + b, (double)a + (double)b);
}

static void cf_emu_loadconfig(const void* config)
{
    const cf_tilecfg* cfg = (const cf_tilecfg*)config;
    for (int t = 0; t < 8; ++t) {
        cf_tiles.colsb[t] = cfg->colsb[t];
        cf_tiles.rows[t] = cfg->rows[t];
    }
}

static void cf_emu_release(void)
{
    memset(&cf_tiles, 0, sizeof cf_tiles);
}

static void cf_emu_zero(int t)
{
    memset(cf_tiles.data[t], 0, sizeof cf_tiles.data[t]);
}

static void cf_emu_loadd(int t, const void* base, long stride)
{
    const char* p = (const char*)base;
    for (int r = 0; r < cf_tiles.rows[t]; ++r)
        memcpy(cf_tiles.data[t][r], p + (long)r * stride, cf_tiles.colsb[t]);
}

static void cf_emu_stored(int t, void* base, long stride)
{
    char* p = (char*)base;
    for (int r = 0; r < cf_tiles.rows[t]; ++r)
        memcpy(p + (long)r * stride, cf_tiles.data[t][r], cf_tiles.colsb[t]);
}

/* dst (fp32, rows x N) += a (bf16, rows x 2 KP) . b (bf16 in VNNI pairs, KP rows x 2N) */
static void cf_emu_dpbf16ps(int dst, int a, int b)
{
    const int M = cf_tiles.rows[dst], N = cf_tiles.colsb[dst] / 4, KP = cf_tiles.colsb[a] / 4;
    for (int m = 0; m < M; ++m) {
        const uint16_t* arow = (const uint16_t*)cf_tiles.data[a][m];
        float* crow = (float*)cf_tiles.data[dst][m];
        for (int n = 0; n < N; ++n) {
            float even = 0.0f, odd = 0.0f;
            for (int k = 0; k < KP; ++k) {
                const uint16_t* brow = (const uint16_t*)cf_tiles.data[b][k];
                even = cf_amx_fma(cf_bf16(arow[2 * k]), cf_bf16(brow[2 * n]), even);
                odd = cf_amx_fma(cf_bf16(arow[2 * k + 1]), cf_bf16(brow[2 * n + 1]), odd);
            }
            crow[n] = cf_amx_add(cf_daz(crow[n]), cf_amx_add(even, odd));
        }
    }
}

#define CF_TILE_LOADCONFIG(cfg) cf_emu_loadconfig(cfg)
#define CF_TILE_RELEASE() cf_emu_release()
#define CF_TILE_ZERO(t) cf_emu_zero(t)
#define CF_TILE_LOADD(t, base, stride) cf_emu_loadd(t, base, stride)
#define CF_TILE_STORED(t, base, stride) cf_emu_stored(t, base, stride)
#define CF_TILE_DPBF16PS(dst, a, b) cf_emu_dpbf16ps(dst, a, b)
#define CF_AMX_PATH "amx-bf16 (emulated)"

#else
#include <immintrin.h>

/* gcc 12's _tile_loadconfig declares too small a memory operand: a barrier keeps the
   configuration's stores before it, and buffers just written before a tile load */
#define CF_TILE_LOADCONFIG(cfg) do { __asm__ volatile("" ::: "memory"); _tile_loadconfig(cfg); } while (0)
#define CF_TILE_RELEASE() _tile_release()
#define CF_TILE_ZERO(t) _tile_zero(t)
#define CF_TILE_LOADD(t, base, stride) do { __asm__ volatile("" ::: "memory"); _tile_loadd(t, base, stride); } while (0)
#define CF_TILE_STORED(t, base, stride) _tile_stored(t, base, stride)
#define CF_TILE_DPBF16PS(dst, a, b) _tile_dpbf16ps(dst, a, b)
#define CF_AMX_PATH "amx-bf16"
#endif
