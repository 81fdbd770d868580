/* standalone prologue, stripped when loaded: what a generated source defines before this */
#define MR 6
#define PART_MR 4
#define SLIVER(kc) ((long)(kc) * MR)
typedef float cf_elem;
#define CF_LOAD(x) (x)
void cf_pack_at(int kc, int m, const cf_elem* restrict At, long ldat, float* restrict Ap);
#define PACK_AT cf_pack_at
/* ---- end of the standalone prologue ---- */
/* Ap[(s/MR)*SLIVER(kc) + p*MR + i] = At[p*ldat + s + i] for every whole sliver (column s, a
   multiple of MR) when `whole`, and the tail sliver zero-padded: in the same pass over the rows
   when `whole` (each row is in L1 then; a pass of its own down the tail's columns was 1.8 % of
   an attention over 208 keys), else by PACK_AT, unless it has PART_MR rows (read in place) */
#define PANEL_AHEAD 8 /* rows prefetched ahead */
static void cf_pack_at_panel(int kc, int width, const cf_elem* restrict At, long ldat,
                             float* restrict Ap, int whole)
{
    const int full = width / MR * MR, rest = width - full;
    float* restrict tail = Ap + (long)(full / MR) * SLIVER(kc);
    if (whole) {
        for (int p = 0; p < kc; ++p) {
            const cf_elem* restrict row = At + p * ldat;
            /* a row is a few cache lines of a page the hardware prefetcher has not seen:
               ask for the rows ahead, so that several rows' misses overlap */
            for (int c = 0; c < width; c += 64 / (int)sizeof(cf_elem))
                __builtin_prefetch(row + PANEL_AHEAD * ldat + c);
            float* restrict dst = Ap + (long)p * MR; /* row p of sliver 0, then of the next */
            for (int s = 0; s < full; s += MR, dst += SLIVER(kc))
                for (int i = 0; i < MR; ++i) dst[i] = CF_LOAD(row[s + i]);
            if (rest)
                for (int i = 0; i < MR; ++i) tail[(long)p * MR + i] = i < rest ? CF_LOAD(row[full + i]) : 0.0f;
        }
    } else if (rest && rest != PART_MR) { /* (a tail of PART_MR rows is read in place) */
        PACK_AT(kc, rest, At + full, ldat, tail);
    }
}
