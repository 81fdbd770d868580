typedef float cf_v8 __attribute__((vector_size(32)));
typedef float cf_v8u __attribute__((vector_size(32), aligned(4), may_alias)); /* float rows */
typedef int cf_v8i __attribute__((vector_size(32)));
#if defined(__clang__)
#define CF_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define CF_SHUF(a, b, ...) __builtin_shuffle(a, b, (cf_v8i){__VA_ARGS__})
#endif

/* out[j] = sum over k < K of q[k] * kj[k], j < 4; inlined where it is called (gcc left it a
   call from the -O2 row path: 0.83-0.94 of that path's time inlined, 1-6 queries) */
static inline __attribute__((always_inline)) void cf_dot4(long K, const float* restrict q,
                                                          const float* restrict k0,
                                                          const float* restrict k1,
                                                          const float* restrict k2,
                                                          const float* restrict k3,
                                                          float* restrict out)
{
    cf_v8 v0 = {0}, v1 = {0}, v2 = {0}, v3 = {0};
    cf_v8 w0 = {0}, w1 = {0}, w2 = {0}, w3 = {0};
    long k = 0;
    for (; k + 16 <= K; k += 16) {
        const cf_v8 x = *(const cf_v8u*)(q + k), y = *(const cf_v8u*)(q + k + 8);
        v0 += x * *(const cf_v8u*)(k0 + k);
        v1 += x * *(const cf_v8u*)(k1 + k);
        v2 += x * *(const cf_v8u*)(k2 + k);
        v3 += x * *(const cf_v8u*)(k3 + k);
        w0 += y * *(const cf_v8u*)(k0 + k + 8);
        w1 += y * *(const cf_v8u*)(k1 + k + 8);
        w2 += y * *(const cf_v8u*)(k2 + k + 8);
        w3 += y * *(const cf_v8u*)(k3 + k + 8);
    }
    for (; k + 8 <= K; k += 8) {
        const cf_v8 x = *(const cf_v8u*)(q + k);
        v0 += x * *(const cf_v8u*)(k0 + k);
        v1 += x * *(const cf_v8u*)(k1 + k);
        v2 += x * *(const cf_v8u*)(k2 + k);
        v3 += x * *(const cf_v8u*)(k3 + k);
    }
    v0 += w0;
    v1 += w1;
    v2 += w2;
    v3 += w3;
    const cf_v8 a = CF_SHUF(v0, v1, 0, 8, 2, 10, 4, 12, 6, 14)
        + CF_SHUF(v0, v1, 1, 9, 3, 11, 5, 13, 7, 15);
    const cf_v8 b = CF_SHUF(v2, v3, 0, 8, 2, 10, 4, 12, 6, 14)
        + CF_SHUF(v2, v3, 1, 9, 3, 11, 5, 13, 7, 15);
    const cf_v8 c = CF_SHUF(a, b, 0, 1, 8, 9, 4, 5, 12, 13)
        + CF_SHUF(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    float s0 = c[0] + c[4], s1 = c[1] + c[5], s2 = c[2] + c[6], s3 = c[3] + c[7];
    for (; k < K; ++k) {
        s0 += q[k] * k0[k];
        s1 += q[k] * k1[k];
        s2 += q[k] * k2[k];
        s3 += q[k] * k3[k];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}
