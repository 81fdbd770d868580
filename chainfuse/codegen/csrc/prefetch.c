/* standalone prologue, stripped when loaded: what a generated source defines before this */
typedef float cf_elem;
/* ---- end of the standalone prologue ---- */
typedef struct {
    const char* base; /* first byte of the panel's first row */
    long ld;          /* bytes from one row to the next */
    int rows, lines, row;
    const char* base2; /* a second panel after the first (rows2 = 0: none) */
    long ld2;
    int rows2, lines2;
} cf_pf;

/* the next panel: `rows` rows of `width` elements, `ld` elements apart */
static inline void cf_pf_set(cf_pf* c, const cf_elem* base, long ld, int rows, long width)
{
    c->base = (const char*)base;
    c->ld = ld * (long)sizeof(cf_elem);
    c->rows = rows;
    c->lines = (int)((width * (long)sizeof(cf_elem) + 63) / 64);
    c->row = 0;
    c->rows2 = 0;
}

/* a second panel, asked for after the first: the rows count both */
static inline void cf_pf_then(cf_pf* c, const cf_elem* base, long ld, int rows, long width)
{
    c->base2 = (const char*)base;
    c->ld2 = ld * (long)sizeof(cf_elem);
    c->rows2 = rows;
    c->lines2 = (int)((width * (long)sizeof(cf_elem) + 63) / 64);
}

/* rows per call when `calls` micro-kernel calls share the panel */
static inline int cf_pf_share(const cf_pf* c, int calls)
{
    const int rows = c->rows + c->rows2;
    return calls > 0 ? (rows + calls - 1) / calls : rows;
}

/* ask for the lines of the next `rows` rows, into L2 */
static inline void cf_pf_step(cf_pf* c, int rows)
{
    for (int r = 0; r < rows && c->row < c->rows + c->rows2; ++r, ++c->row) {
        const int second = c->row >= c->rows;
        const char* line = second ? c->base2 + (c->row - c->rows) * c->ld2 : c->base + c->row * c->ld;
        const int lines = second ? c->lines2 : c->lines;
        for (int i = 0; i < lines; ++i) __builtin_prefetch(line + i * 64, 0, 2);
    }
}
