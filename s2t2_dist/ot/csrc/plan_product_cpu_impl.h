/* The kernels of plan_product_cpu.c for one pair of element types. Included once per pair with T (P's and the
 * result's type), MT (M's storage type), LOADM (MT -> T), SFX (the name suffix) and W (T lanes in 64 bytes)
 * defined; it undefines them at its end, for the next pair.
 *
 * Layout of the work (both kernels): a thread takes a contiguous range of P's rows, in chunks of R rows. A chunk's
 * non-zeros are sorted by column (a counting sort: the chunk in CSC form), and its rows of M are at hand (M itself,
 * or widened once into a buffer). Then, per block of DB = NV * W columns of d and per target column j, the block of
 * the u x d operand's row j (out's accumulator, or G's row) is held in NV vector registers while the column's
 * non-zeros stream their rows of M through it. Measured at 50,280 x 512 x 2,048 with 6% non-zeros (1 thread): the
 * row-wise axpy form (every non-zero loads and stores the accumulator's row) took 1.8x as long. */
#define PCAT_(a, b) a##_##b
#define PCAT(a, b) PCAT_(a, b)
#define PNAME(x) PCAT(x, SFX)

typedef T PNAME(pvec) __attribute__((vector_size(64)));
typedef T PNAME(pvecu) __attribute__((vector_size(64), aligned(sizeof(T)))); /* unaligned loads */
#define PV PNAME(pvec)
#define PVU PNAME(pvecu)

/* NV vectors per block (DB = 8 * W columns: 128 float32, 512 bytes); rows per chunk: R_MAX, fewer for a large u so
 * that a chunk's lists stay under R_ENTRIES entries */
enum { PNAME(NV) = 8, PNAME(R_MAX) = 256, PNAME(R_ENTRIES) = 131072 };

typedef struct {
    const T *P;
    const MT *M;
    const T *G;      /* grad_p: the upstream gradient (u x d) */
    T *out;          /* product: out; grad_p: dP */
    T **acc;         /* product: each thread's (u x d) accumulator (thread 0's is out) */
    int64_t *counts; /* row_nnz: the non-zeros per row */
    int64_t v, u, d, R;
    int failed;      /* a thread that could not allocate its lists */
} PNAME(pctx);

typedef struct {
    int32_t *col;  /* (u + 1) CSC column starts */
    int32_t *pos;  /* (u) fill positions */
    int32_t *row;  /* (R * u) row within the chunk, by column */
    T *val;        /* (R * u) the non-zero */
    T *mbuf;       /* (R * d) the chunk's rows of M widened, when MT is not T */
} PNAME(chunk_t);

static int PNAME(chunk_alloc)(const PNAME(pctx) *c, PNAME(chunk_t) *k) {
    const size_t ents = (size_t)(c->R * c->u);
    k->col = malloc((size_t)(c->u + 1) * sizeof(int32_t));
    k->pos = malloc((size_t)c->u * sizeof(int32_t) + 1);
    k->row = malloc(ents * sizeof(int32_t) + 1);
    k->val = malloc(ents * sizeof(T) + 1);
    k->mbuf = sizeof(MT) == sizeof(T) ? NULL : aligned_alloc(64, ((size_t)(c->R * c->d) * sizeof(T) + 63) / 64 * 64);
    return k->col && k->pos && k->row && k->val && (sizeof(MT) == sizeof(T) || k->mbuf);
}

static void PNAME(chunk_free)(PNAME(chunk_t) *k) {
    free(k->col);
    free(k->pos);
    free(k->row);
    free(k->val);
    free(k->mbuf);
}

/* rows [r0, r1) of P in CSC form; returns the chunk's rows of M as T (row-major, stride d) */
static const T *PNAME(chunk_load)(const PNAME(pctx) *c, PNAME(chunk_t) *k, int64_t r0, int64_t r1) {
    const int64_t u = c->u, d = c->d;
    int32_t *restrict col = k->col;
    memset(col, 0, (size_t)(u + 1) * sizeof(int32_t));
    for (int64_t r = r0; r < r1; r++) {
        const T *restrict p = c->P + r * u;
        for (int64_t j = 0; j < u; j++) col[j + 1] += p[j] != 0;
    }
    for (int64_t j = 0; j < u; j++) col[j + 1] += col[j];
    memcpy(k->pos, col, (size_t)u * sizeof(int32_t));
    for (int64_t r = r0; r < r1; r++) {
        const T *restrict p = c->P + r * u;
        for (int64_t j = 0; j < u; j++)
            if (p[j] != 0) {
                const int32_t q = k->pos[j]++;
                k->row[q] = (int32_t)(r - r0);
                k->val[q] = p[j];
            }
    }
    if (sizeof(MT) == sizeof(T)) return (const T *)(const void *)(c->M + r0 * d);
    const MT *restrict m = c->M + r0 * d;
    for (int64_t t = 0; t < (r1 - r0) * d; t++) k->mbuf[t] = LOADM(m[t]);
    return k->mbuf;
}

static void PNAME(product_rows)(void *c_, int64_t lo, int64_t hi, int tid) {
    PNAME(pctx) *c = (PNAME(pctx) *)c_;
    const int64_t u = c->u, d = c->d, DB = PNAME(NV) * W, dv = d - d % DB;
    T *restrict acc = c->acc[tid];
    memset(acc, 0, (size_t)(u * d) * sizeof(T));
    PNAME(chunk_t) k;
    if (!PNAME(chunk_alloc)(c, &k)) {
        c->failed = 1;
        PNAME(chunk_free)(&k);
        return;
    }
    for (int64_t r0 = lo; r0 < hi; r0 += c->R) {
        const int64_t r1 = r0 + c->R < hi ? r0 + c->R : hi;
        const T *Mc = PNAME(chunk_load)(c, &k, r0, r1);
        for (int64_t b0 = 0; b0 < dv; b0 += DB) {
            for (int64_t j = 0; j < u; j++) {
                const int32_t s = k.col[j], e = k.col[j + 1];
                if (s == e) continue;
                T *a = acc + j * d + b0;
                PV x[PNAME(NV)];
                for (int q = 0; q < PNAME(NV); q++) x[q] = *(PVU *)(a + q * W);
                for (int32_t n = s; n < e; n++) {
                    const T *m = Mc + (int64_t)k.row[n] * d + b0;
                    const PV p = (PV){0} + k.val[n];
                    for (int q = 0; q < PNAME(NV); q++) x[q] += p * *(const PVU *)(m + q * W);
                }
                for (int q = 0; q < PNAME(NV); q++) *(PVU *)(a + q * W) = x[q];
            }
        }
        for (int64_t j = 0; j < u && dv < d; j++) /* the columns of d past the last whole block */
            for (int32_t n = k.col[j]; n < k.col[j + 1]; n++) {
                const T *restrict m = Mc + (int64_t)k.row[n] * d;
                T *restrict a = acc + j * d;
                for (int64_t t = dv; t < d; t++) a[t] += k.val[n] * m[t];
            }
    }
    PNAME(chunk_free)(&k);
}

static void PNAME(reduce_acc)(void *c_, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    PNAME(pctx) *c = (PNAME(pctx) *)c_;
    T *restrict out = c->out;
    for (int k = 1; c->acc[k]; k++) {
        const T *restrict a = c->acc[k];
        for (int64_t t = lo; t < hi; t++) out[t] += a[t];
    }
}

static int64_t PNAME(chunk_rows)(int64_t u) {
    const int64_t r = PNAME(R_ENTRIES) / (u > 0 ? u : 1);
    return r > PNAME(R_MAX) ? PNAME(R_MAX) : (r < 1 ? 1 : r);
}

/* out (u x d) = P^T M over P's non-zeros. 0, or -1 when out of memory. */
int PNAME(s2t2_support_product)(const T *P, const MT *M, T *out, int64_t v, int64_t u, int64_t d, int nthreads) {
    if (v == 0) {
        memset(out, 0, (size_t)(u * d) * sizeof(T));
        return 0;
    }
    if (nthreads > v) nthreads = (int)v;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > 64) nthreads = 64;
    T *acc[65] = {0};
    acc[0] = out;
    int rc = 0;
    for (int k = 1; k < nthreads; k++)
        if (!(acc[k] = aligned_alloc(64, ((size_t)(u * d) * sizeof(T) + 63) / 64 * 64))) rc = -1;
    if (rc == 0) {
        PNAME(pctx) c = {.P = P, .M = M, .out = out, .acc = acc, .v = v, .u = u, .d = d, .R = PNAME(chunk_rows)(u)};
        parallel_for(v, nthreads, PNAME(product_rows), &c);
        if (c.failed) rc = -1;
        else parallel_for(u * d, nthreads, PNAME(reduce_acc), &c);
    }
    for (int k = 1; k < nthreads; k++) free(acc[k]);
    return rc;
}

static void PNAME(count_rows)(void *c_, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    PNAME(pctx) *c = (PNAME(pctx) *)c_;
    const int64_t u = c->u;
    int64_t *restrict counts = c->counts;
    for (int64_t i = lo; i < hi; i++) {
        const T *restrict p = c->P + i * u;
        int64_t n = 0;
        for (int64_t j = 0; j < u; j++) n += p[j] != 0;
        counts[i] = n;
    }
}

/* counts[i] = the non-zeros of row i of P (v x u): what the route is chosen from, in one pass and no v x u
 * temporary (torch's count_nonzero(dim=1) writes one of int64) */
void PNAME(s2t2_row_nnz)(const T *P, int64_t *counts, int64_t v, int64_t u, int nthreads) {
    PNAME(pctx) c = {.P = P, .counts = counts, .v = v, .u = u};
    parallel_for(v, nthreads < 1 ? 1 : nthreads, PNAME(count_rows), &c);
}

static void PNAME(grad_p_rows)(void *c_, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    PNAME(pctx) *c = (PNAME(pctx) *)c_;
    const int64_t u = c->u, d = c->d, DB = PNAME(NV) * W, dv = d - d % DB;
    PNAME(chunk_t) k;
    PV *part = aligned_alloc(64, (size_t)(c->R * u) * sizeof(PV) + 64); /* per non-zero: W partial sums */
    if (!PNAME(chunk_alloc)(c, &k) || !part) {
        c->failed = 1;
        PNAME(chunk_free)(&k);
        free(part);
        return;
    }
    for (int64_t r0 = lo; r0 < hi; r0 += c->R) {
        const int64_t r1 = r0 + c->R < hi ? r0 + c->R : hi;
        const T *Mc = PNAME(chunk_load)(c, &k, r0, r1);
        const int32_t nnz = k.col[u];
        for (int32_t n = 0; n < nnz; n++) part[n] = (PV){0};
        for (int64_t b0 = 0; b0 < dv; b0 += DB) {
            for (int64_t j = 0; j < u; j++) {
                const int32_t s = k.col[j], e = k.col[j + 1];
                if (s == e) continue;
                const T *g = c->G + j * d + b0;
                PV y[PNAME(NV)];
                for (int q = 0; q < PNAME(NV); q++) y[q] = *(const PVU *)(g + q * W);
                for (int32_t n = s; n < e; n++) {
                    const T *m = Mc + (int64_t)k.row[n] * d + b0;
                    PV s0 = part[n], s1 = {0};
                    for (int q = 0; q < PNAME(NV); q += 2) {
                        s0 += y[q] * *(const PVU *)(m + q * W);
                        s1 += y[q + 1] * *(const PVU *)(m + (q + 1) * W);
                    }
                    part[n] = s0 + s1;
                }
            }
        }
        T *restrict out = c->out + r0 * u;
        memset(out, 0, (size_t)((r1 - r0) * u) * sizeof(T));
        for (int64_t j = 0; j < u; j++)
            for (int32_t n = k.col[j]; n < k.col[j + 1]; n++) {
                T s = 0;
                for (int l = 0; l < W; l++) s += part[n][l];
                const T *restrict m = Mc + (int64_t)k.row[n] * d;
                const T *restrict g = c->G + j * d;
                for (int64_t t = dv; t < d; t++) s += m[t] * g[t]; /* the columns past the last whole block */
                out[(int64_t)k.row[n] * u + j] = s;
            }
    }
    PNAME(chunk_free)(&k);
    free(part);
}

/* dP (v x u) = M G^T on P's non-zeros, 0 elsewhere. 0, or -1 when out of memory. */
int PNAME(s2t2_support_grad_p)(const T *P, const MT *M, const T *G, T *dP, int64_t v, int64_t u, int64_t d,
                               int nthreads) {
    PNAME(pctx) c = {.P = P, .M = M, .G = G, .out = dP, .v = v, .u = u, .d = d, .R = PNAME(chunk_rows)(u)};
    parallel_for(v, nthreads < 1 ? 1 : nthreads, PNAME(grad_p_rows), &c);
    return c.failed ? -1 : 0;
}

#undef PV
#undef PVU
#undef PCAT_
#undef PCAT
#undef PNAME
#undef T
#undef MT
#undef LOADM
#undef SFX
#undef W
