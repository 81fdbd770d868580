/* standalone prologue, stripped when loaded: what a generated source defines before this */
#define NR 16
/* ---- end of the standalone prologue ---- */
/* Dp[(s*kc + p)*NR + j] = D[p*ldd + s*NR + j] for the nr-column strips s of a kc x width
   panel, row by row (each row of D read once, contiguously), the tail strip zero-padded */
static void cf_pack_b_panel(int kc, int width, const float* restrict D, long ldd,
                            float* restrict Dp)
{
    for (int p = 0; p < kc; ++p) {
        const float* restrict row = D + p * ldd;
        for (int s = 0; s * NR < width; ++s) {
            float* restrict dst = Dp + ((long)s * kc + p) * NR;
            const int n = width - s * NR < NR ? width - s * NR : NR;
            if (n == NR) {
                for (int j = 0; j < NR; ++j) dst[j] = row[s * NR + j];
            } else {
                for (int j = 0; j < NR; ++j) dst[j] = j < n ? row[s * NR + j] : 0.0f;
            }
        }
    }
}
