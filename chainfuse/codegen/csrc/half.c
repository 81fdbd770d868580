/* standalone prologue, stripped when loaded: what a generated source defines before this */
#define MR 6
#define NR 16
#define CF_LOAD(x) cf_from_f16(x)
#define CF_F16 1
/* ---- end of the standalone prologue ---- */
#include <stdint.h>

/* bf16 <-> fp32: a bf16 is the high half of an fp32, so widening is a shift; narrowing rounds
   to nearest, ties to even (NaN kept quiet). */
static inline float cf_from_bf16(uint16_t h)
{
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t cf_to_bf16(float f)
{
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* IEEE fp16 <-> fp32. With F16C (x86 since Ivy Bridge / Piledriver), one instruction each;
   elsewhere exact plain C: widening rebiases the exponent (subnormals: mantissa times 2^-24,
   exact in fp32; inf and NaN keep their payload); narrowing rounds to nearest, ties to even:
   |f| >= 65520 gives inf, |f| < 2^-14 a subnormal rounded by one fp32 addition (the magic 0.5
   puts fp16's last subnormal bit at fp32's last mantissa bit), NaN stays a quiet NaN. Both are
   checked on every fp16 bit pattern and every rounding edge (tests/numerics/test_cmath.py). */
#if defined(__F16C__) && !defined(CF_NO_F16C)
#include <immintrin.h>
static inline float cf_from_f16(uint16_t h)
{
    return _cvtsh_ss(h);
}

static inline uint16_t cf_to_f16(float f)
{
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}
#else
static inline float cf_from_f16(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) {
        v.f = (float)m * 5.9604644775390625e-8f; /* 2^-24 */
        v.u |= sign;
    } else {
        v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    }
    return v.f;
}

static inline uint16_t cf_to_f16(float f)
{
    union { uint32_t u; float f; } v, magic;
    v.f = f;
    const uint32_t sign = (v.u >> 16) & 0x8000u;
    v.u &= 0x7fffffffu;
    uint32_t o;
    if (v.u >= 0x47800000u) { /* 65536 and up: inf, or NaN */
        o = v.u > 0x7f800000u ? 0x7e00u | ((v.u >> 13) & 0x3ffu) : 0x7c00u;
    } else if (v.u < 0x38800000u) { /* below 2^-14: fp16 subnormal or zero */
        magic.u = 0x3f000000u; /* 0.5f */
        v.f += magic.f;
        o = v.u - magic.u;
    } else {
        const uint32_t odd = (v.u >> 13) & 1u;
        v.u += 0xc8000fffu + odd; /* exponent rebiased (-112 << 23), half an ulp minus one */
        o = v.u >> 13;
    }
    return (uint16_t)(o | sign);
}
#endif

/* n elements widened into fp32 (the row path's rows of K, V, B and D, once for all its rows):
   with F16C eight fp16 at a time, else element by element (bf16's shift vectorises) */
static inline void cf_widen(const uint16_t* restrict src, float* restrict dst, long n)
{
    long i = 0;
#if defined(__F16C__) && !defined(CF_NO_F16C) && defined(CF_F16)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
#endif
    for (; i < n; ++i) dst[i] = CF_LOAD(src[i]);
}

/* packing from half-precision sources (CF_LOAD widens) into the micro-kernel's fp32 panels (the
   same layouts as the fp32 routines: zeros beyond m / n) */
static inline void cf_half_pack_a(int kc, int m, const uint16_t* restrict A, long lda,
                                  float* restrict Ap)
{
    for (int i = 0; i < MR; ++i) {
        const uint16_t* restrict row = A + i * lda;
        for (int p = 0; p < kc; ++p) Ap[(long)p * MR + i] = i < m ? CF_LOAD(row[p]) : 0.0f;
    }
}

static inline void cf_half_pack_at(int kc, int m, const uint16_t* restrict At, long ldat,
                                   float* restrict Ap)
{
    for (int p = 0; p < kc; ++p) {
        for (int i = 0; i < MR; ++i) {
            Ap[(long)p * MR + i] = i < m ? CF_LOAD(At[p * ldat + i]) : 0.0f;
        }
    }
}

static inline void cf_half_pack_bt(int kc, int n, const uint16_t* restrict Bt, long ldbt,
                                   float* restrict Bp, float scale)
{
    for (int j = 0; j < NR; ++j) {
        const uint16_t* restrict col = Bt + j * ldbt;
        for (int p = 0; p < kc; ++p)
            Bp[(long)p * NR + j] = j < n ? CF_LOAD(col[p]) * scale : 0.0f;
    }
}
