/* the next block index from a counter the threads share: blocks are claimed in order as threads
   come free, not dealt out in fixed shares, so a thread slowed by another process on its core
   runs fewer and the others do not wait for it (an OpenMP pragma, no omp.h) */
static inline long cf_claim(long* next)
{
    long v;
    #pragma omp atomic capture
    v = (*next)++;
    return v;
}
