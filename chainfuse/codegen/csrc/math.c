#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CF_LOG2E 1.44269504088896341f

/* an additive mask value in the scores' base-2 units, m log2(e), held to the finite floats:
   PyTorch's own masks fill with torch.finfo(float32).min, which times log2(e) would overflow
   to -inf, and a row masked that way throughout would weigh no key, where SDPA's equal scores
   weigh every key alike. -inf (and NaN) stay as they are. */
static inline float cf_mask2(float m)
{
    const float big = 2.3586e38f; /* just under FLT_MAX / log2(e) */
    const float held = m < -big && m > -INFINITY ? -big : m > big && m < INFINITY ? big : m;
    return held * CF_LOG2E;
}

/* exp of x <= 0 (erf's exp(-a^2)): range reduction to
   [-ln2/2, ln2/2] and a degree-7 polynomial (Cephes' expf coefficients, relative error < 1e-7).
   n = round(x / ln2) comes from the 1.5 * 2^23 shifter, whose low mantissa bits then hold
   n + 127: shifted left by 23 they are 2^n. x <= -88 (and -inf) gives 0, NaN stays NaN; x > 88
   is outside its domain. Plain arithmetic and selects that compilers if-convert: the loops
   over it vectorise (about 20 instructions per vector). */
static inline float cf_exp_neg(float x)
{
    const float xc = x < -88.0f ? -88.0f : x; /* a max that lets NaN through */
    const float shifted = xc * CF_LOG2E + 12583039.0f; /* 0x1.8p23 + 127 */
    const float n = shifted - 12583039.0f;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits;
    memcpy(&bits, &shifted, sizeof bits);
    bits <<= 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n; /* NaN in, NaN out: it went through every step */
}

/* 1 / (1 + exp(-z)) from exp(-|z|), which cannot overflow: silu's, quick gelu's and tanh
   gelu's gate (0.5 (1 + tanh(u)) = sigmoid(2u)). Below z = -88 it is 0 (cf_exp_neg holds its
   argument there; the true value is under 1e-38), so x sigmoid(x) of -inf is NaN, as
   PyTorch's silu; NaN stays NaN. Selects only: loops over it vectorise. */
static inline float cf_sigmoid(float z)
{
    const float e = cf_exp_neg(-fabsf(z));
    const float r = 1.0f / (1.0f + e);
    return z >= 0.0f ? r : z < -88.0f ? 0.0f : e * r;
}

/* tanh: x + x^3 P(x^2) for |x| < 0.625 (P of degree 4, fitted for chainfuse: weighted least
   squares on Chebyshev nodes; relative error 8e-8 evaluated in float32), else (1 - e) / (1 + e)
   of e = exp(-2|x|) (no cancellation there: e <= 0.29; relative error below 2e-7). +-inf give
   +-1, NaN stays. Selects only: loops over it vectorise. */
static inline float cf_tanh(float x)
{
    const float ax = fabsf(x);
    const float z = x * x;
    float p = -5.678263492882252e-3f;
    p = p * z + 2.061215043067932e-2f;
    p = p * z - 5.373018607497215e-2f;
    p = p * z + 1.3331305980682373e-1f;
    p = p * z - 3.3333274722099304e-1f;
    const float small = x + x * z * p;
    const float e = cf_exp_neg(-2.0f * ax);
    const float big = (1.0f - e) / (1.0f + e);
    return ax < 0.625f ? small : x < 0.0f ? -big : big;
}

/* tanh(softplus(x)) = tanh(log(1 + e^x)) = n / (n + 2) with n = e^x (e^x + 2), written in
   t = exp(-|x|), which cannot overflow: (1 + 2t) / (1 + 2t + 2t^2) for x >= 0, and
   t (t + 2) / (t (t + 2) + 2) below. mish's gate: +inf gives 1, -inf 0 (so x times it is NaN,
   as PyTorch's mish), NaN stays. Selects only: loops over it vectorise. */
static inline float cf_tanh_softplus(float x)
{
    const float t = cf_exp_neg(-fabsf(x));
    const float up = 1.0f + 2.0f * t;
    const float n = t * (t + 2.0f);
    return x >= 0.0f ? up / (up + 2.0f * t * t) : n / (n + 2.0f);
}

/* soft-capping (Gemma 2's scores): cap tanh(s / cap) times w (w = log2(e) for base-2 scores,
   1 for natural ones; capw = cap w) of u = s / cap. */
static inline float cf_softcap(float u, float capw)
{
    return capw * cf_tanh(u);
}

/* 2^(v - s) for v <= s, with s given as c = 0x1.8p23 + 127 - s and lo = s - 127: the softmax
   works in base 2 (its scale carries log2(e)), which spares the ln2 range reduction. The
   shifter adds c to v, so that t = v + c carries n = round(v - s) in its low bits (s an integer,
   |s| < 2^21: c is then exact, and so are t - c = n + s and f = v - (n + s) in [-1/2, 1/2]);
   2^f by a degree-5 polynomial (coefficients fitted for chainfuse: least squares on Chebyshev
   nodes, reweighted towards the minimax relative error; 1.9e-7 evaluated in float32), in
   Estrin's form: three dependent FMAs instead of Horner's five. A score strip's loop waits on
   this chain: forming v - s first, then adding the shifter, cost one more dependent add (Zen 1,
   interleaved: the integer shift took an attention 0.98 of the time, Estrin 0.98-1.0). v below
   s - 126.5 (and -inf) gives 0, NaN stays NaN. About 13 instructions per vector. */
static inline float cf_exp2_from(float v, float c, float lo)
{
    const float xc = v < lo ? lo : v; /* a max that lets NaN through */
    const float t = xc + c;
    const float f = xc - (t - c);
    const float f2 = f * f;
    const float q0 = 6.9314700365e-1f * f + 1.0f;
    const float q1 = 5.5507339537e-2f * f + 2.4022242427e-1f;
    const float q2 = 1.3264718000e-3f * f + 9.6715129912e-3f;
    const float p = (q2 * f2 + q1) * f2 + q0;
    uint32_t bits;
    memcpy(&bits, &t, sizeof bits);
    bits <<= 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* 2^x for x <= 0 (s = 0; x < -126.5 gives 0) */
static inline float cf_exp2_neg(float x)
{
    return cf_exp2_from(x, 12583039.0f, -127.0f);
}

/* erf by Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7), vectorisable like cf_exp_neg. */
static inline float cf_erf(float x)
{
    const float ax = x < 0.0f ? -x : x;
    const float t = 1.0f / (1.0f + 0.3275911f * ax);
    float y = 1.061405429f;
    y = y * t - 1.453152027f;
    y = y * t + 1.421413741f;
    y = y * t - 0.284496736f;
    y = y * t + 0.254829592f;
    y = 1.0f - y * t * cf_exp_neg(-ax * ax);
    return x < 0.0f ? -y : y;
}
