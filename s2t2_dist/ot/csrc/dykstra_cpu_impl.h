/* The kernels of dykstra_cpu.c for one element type. Included once per type with T (the type), IT (the integer of
 * T's width: vector comparison results), SFX (the name suffix) and W (lanes in 64 bytes) defined.
 *
 * Two styles, each where it measured faster: a row's threshold search is a reduction along the row, written with
 * GCC/Clang vector extensions (W independent partial sums, so nothing is reassociated); every pass that walks the
 * matrix row by row with one state per column is plain C for the auto-vectoriser (with AVX-512 it keeps the
 * comparisons in mask registers, where the vector extensions spilled them and ran at half speed). */
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define NAME(x) CAT(x, SFX)

typedef T NAME(vec) __attribute__((vector_size(64)));
typedef T NAME(vecu) __attribute__((vector_size(64), aligned(sizeof(T)))); /* unaligned loads */
typedef IT NAME(ivec) __attribute__((vector_size(64)));
#define VEC NAME(vec)
#define IVEC NAME(ivec)

enum { NAME(CH) = 64 }; /* rows per partial column sum in T (then added in float64) */

static inline VEC NAME(ld)(const T *p) { return *(const NAME(vecu) *)p; }
/* where(m, a, b) for a comparison result m (-1 / 0 per lane) */
static inline VEC NAME(sel)(IVEC m, VEC a, VEC b) { return (VEC)((m & (IVEC)a) | (~m & (IVEC)b)); }

/* ---- the exact threshold of one row (in L1): the cold lower bound max((sum z - s) / n, max z - s), then Newton
 * (Michelot) passes until proven (*proven = 1) or max_passes (*proven = 0, a lower bound). Proven: the Newton
 * step from t lands at t' below every element above t, so {z > t'} = {z > t} and t' is the exact threshold of its
 * own support (the fixed passes' proof, a repeated support count, needs one pass more). */
static double NAME(row_search)(const T *restrict p, int64_t u, double s, int max_passes, int *proven) {
    const int64_t uv = u - u % W;
    const VEC zero = {0};
    VEC vs = zero, vm = zero - (T)INFINITY;
    for (int64_t j = 0; j < uv; j += W) {
        VEC z = NAME(ld)(p + j);
        vs += z;
        vm = NAME(sel)(z > vm, z, vm);
    }
    double sum = 0, mx = -INFINITY;
    for (int l = 0; l < W; l++) { sum += vs[l]; mx = vm[l] > mx ? vm[l] : mx; }
    for (int64_t j = uv; j < u; j++) { sum += p[j]; mx = p[j] > mx ? p[j] : mx; }
    double tau = (sum - s) / (double)u;
    if (mx - s > tau) tau = mx - s;
    int64_t prev = -1;
    *proven = 0;
    const VEC inf = zero + (T)INFINITY;
    for (int it = 0; it < max_passes; it++) {
        const T t = (T)tau;
        VEC ds = zero, mn = inf; /* mn: the smallest element above t */
        IVEC cn = {0};           /* minus the counts */
        for (int64_t j = 0; j < uv; j += W) {
            VEC z = NAME(ld)(p + j), d = z - t;
            IVEC m = d > zero;
            ds += NAME(sel)(m, d, zero);
            cn += m;
            mn = NAME(sel)(m & (z < mn), z, mn);
        }
        double dsum = 0;
        int64_t cnt = 0;
        T lo = (T)INFINITY;
        for (int l = 0; l < W; l++) { dsum += ds[l]; cnt -= cn[l]; lo = mn[l] < lo ? mn[l] : lo; }
        for (int64_t j = uv; j < u; j++) {
            T d = p[j] - t;
            if (d > 0) { dsum += d; cnt++; lo = p[j] < lo ? p[j] : lo; }
        }
        tau = newton(tau, (double)t, dsum, cnt, s);
        /* proven: no element in (t, t'], or the support repeated */
        if ((T)tau < lo || cnt == prev) { *proven = 1; break; }
        prev = cnt;
    }
    return tau;
}

/* ---- per-thread column statistics of the rows a thread writes: sums (in T over CH rows, then float64), maxima,
 * support counts */
typedef struct {
    double *sum; /* (u) this thread's slice of the (nthreads, u) arrays */
    T *mx;
    int64_t *cnt;
    T *ps;       /* (u) partial sums and counts of the current CH rows, in a staggered workspace */
    int32_t *pc;
    int64_t rows;
} NAME(colacc);

static inline void NAME(colacc_flush)(NAME(colacc) *a, int64_t u) {
    for (int64_t j = 0; j < u; j++) { a->sum[j] += a->ps[j]; a->cnt[j] += a->pc[j]; a->ps[j] = 0; a->pc[j] = 0; }
    a->rows = 0;
}

/* ================================================================================ the whole Dykstra, forward */
enum { NAME(FIRST) = 0, NAME(FUSED) = 1 };

typedef struct {
    const T *src;          /* FIRST: A = src (C) */
    T *P, *Q;
    uint8_t *mask_r, *mask_c;
    const double *mu;
    const T *tc;           /* FUSED: the column thresholds of Q, in T */
    int64_t u;
    int mode, max_passes;
    T *counts_r;
    double *csum;          /* (nthreads, u): column sums of the new Q (the next column search's bound) */
    T *cmax;               /* (nthreads, u): its column maxima */
    int64_t *ccnt;         /* (nthreads, u): FUSED: the column supports' counts */
    int64_t unproven[64];
    int failed;
} NAME(fwd_ctx);

/* One pass over rows [lo, hi). FIRST: A = C. FUSED: the previous column projection's output from Q first (X =
 * max(Q - tc, 0), Q = min(Q, tc), its mask), then A = P + X. Then the row's exact threshold t (in L1), P = min(A,
 * t), Q = (FIRST: 0, FUSED: Q) + max(A - t, 0), the row's mask, and the new Q's column statistics. X is never
 * written: it is only the next row projection's input. */
static void NAME(fwd_rows)(void *vc, int64_t lo, int64_t hi, int tid) {
    NAME(fwd_ctx) *c = (NAME(fwd_ctx) *)vc;
    const int64_t u = c->u, CH = NAME(CH);
    void *arr[3];
    void *ws = ws_alloc((size_t)u * 8, 3, arr);
    if (!ws) { c->failed = 1; return; }
    NAME(colacc) a = {c->csum + (int64_t)tid * u, c->cmax + (int64_t)tid * u, c->ccnt + (int64_t)tid * u,
                      (T *)arr[0], (int32_t *)arr[1], 0};
    T *restrict mx = (T *)arr[2];
    for (int64_t j = 0; j < u; j++) { a.sum[j] = 0; a.cnt[j] = 0; a.ps[j] = 0; a.pc[j] = 0; mx[j] = -INFINITY; }
    T *restrict ps = a.ps;
    int32_t *restrict pc = a.pc;
    const T *restrict tc = c->tc;
    int64_t left = 0;
    for (int64_t r = lo; r < hi; r++) {
        T *restrict p = c->P + r * u, *restrict q = c->Q + r * u;
        uint8_t *restrict mr = c->mask_r + r * u;
        const T *restrict A;
        if (c->mode == NAME(FIRST)) {
            A = c->src + r * u;
        } else {
            uint8_t *restrict mc = c->mask_c + r * u;
            for (int64_t j = 0; j < u; j++) {
                T b = q[j], d = b - tc[j];
                int32_t m = d > 0;
                q[j] = m ? tc[j] : b;
                p[j] = p[j] + (m ? d : (T)0);
                mc[j] = (uint8_t)m;
                pc[j] += m;
            }
            A = p;
        }
        int proven;
        const T t = (T)NAME(row_search)(A, u, c->mu[r], c->max_passes, &proven);
        left += !proven;
        int64_t n = 0;
        if (c->mode == NAME(FIRST)) {
            for (int64_t j = 0; j < u; j++) {
                T z = A[j], d = z - t;
                int32_t m = d > 0;
                T y = m ? d : (T)0;
                q[j] = y;
                p[j] = m ? t : z;
                mr[j] = (uint8_t)m;
                n += m;
                ps[j] += y;
                mx[j] = y > mx[j] ? y : mx[j];
            }
        } else {
            for (int64_t j = 0; j < u; j++) {
                T z = p[j], d = z - t;
                int32_t m = d > 0;
                T y = q[j] + (m ? d : (T)0);
                q[j] = y;
                p[j] = m ? t : z;
                mr[j] = (uint8_t)m;
                n += m;
                ps[j] += y;
                mx[j] = y > mx[j] ? y : mx[j];
            }
        }
        c->counts_r[r] = (T)n;
        if (++a.rows == CH) NAME(colacc_flush)(&a, u);
    }
    NAME(colacc_flush)(&a, u);
    for (int64_t j = 0; j < u; j++) a.mx[j] = mx[j];
    c->unproven[tid] = left;
    free(ws);
}

/* ---- columns: streaming passes over whole rows (contiguous), every column's state in L1. (Copying blocks of
 * columns out to keep them in cache ran at a third of the copy's bandwidth: one cache line per row and 4 KiB page
 * is what the prefetcher and the TLB handle worst.) */
typedef struct {
    T *Z, *out;
    uint8_t *mask;
    int64_t u;
    const T *t;     /* the thresholds being tried (passes 1, 2) */
    double *dsum;   /* per thread: (nthreads, u) sums */
    int64_t *cnt;   /* per thread: (nthreads, u) counts */
    T *mx;          /* per thread: (nthreads, u) maxima (pass 0) */
    int pass;       /* 0: sums and maxima; 1: a Newton pass at t; 2: the output at t (3: without Z = min(Z, t)) */
    int failed;
} NAME(col_ctx);

static void NAME(col_range)(void *vc, int64_t lo, int64_t hi, int tid) {
    NAME(col_ctx) *c = (NAME(col_ctx) *)vc;
    const int64_t u = c->u, CH = NAME(CH);
    double *restrict ds = c->dsum + (int64_t)tid * u;
    int64_t *restrict cn = c->cnt + (int64_t)tid * u;
    void *arr[3];
    void *ws = ws_alloc((size_t)u * 8, 3, arr);
    if (!ws) { c->failed = 1; return; }
    T *restrict ps = (T *)arr[0], *restrict mx = (T *)arr[2];
    int32_t *restrict pc = (int32_t *)arr[1];
    const T *restrict t = c->t;
    for (int64_t j = 0; j < u; j++) { ds[j] = 0; cn[j] = 0; mx[j] = c->pass == 1 ? (T)INFINITY : -(T)INFINITY; }
    for (int64_t i0 = lo; i0 < hi; i0 += CH) {
        const int64_t i1 = i0 + CH < hi ? i0 + CH : hi;
        for (int64_t j = 0; j < u; j++) { ps[j] = 0; pc[j] = 0; }
        if (c->pass == 0) {
            for (int64_t i = i0; i < i1; i++) {
                const T *restrict z = c->Z + i * u;
                for (int64_t j = 0; j < u; j++) {
                    ps[j] += z[j];
                    mx[j] = z[j] > mx[j] ? z[j] : mx[j];
                }
            }
        } else if (c->pass == 1) { /* (mx: the smallest element above t) */
            for (int64_t i = i0; i < i1; i++) {
                const T *restrict z = c->Z + i * u;
                for (int64_t j = 0; j < u; j++) {
                    T zz = z[j], d = zz - t[j];
                    int32_t m = d > 0;
                    ps[j] += m ? d : (T)0;
                    pc[j] += m;
                    mx[j] = m && zz < mx[j] ? zz : mx[j];
                }
            }
        } else if (c->pass == 2) {
            for (int64_t i = i0; i < i1; i++) {
                T *restrict z = c->Z + i * u, *restrict o = c->out + i * u;
                uint8_t *restrict mk = c->mask + i * u;
                for (int64_t j = 0; j < u; j++) {
                    T zz = z[j], d = zz - t[j];
                    int32_t m = d > 0;
                    o[j] = m ? d : (T)0;
                    z[j] = m ? t[j] : zz;
                    mk[j] = (uint8_t)m;
                    pc[j] += m;
                }
            }
        } else {
            for (int64_t i = i0; i < i1; i++) {
                const T *restrict z = c->Z + i * u;
                T *restrict o = c->out + i * u;
                uint8_t *restrict mk = c->mask + i * u;
                for (int64_t j = 0; j < u; j++) {
                    T d = z[j] - t[j];
                    int32_t m = d > 0;
                    o[j] = m ? d : (T)0;
                    mk[j] = (uint8_t)m;
                    pc[j] += m;
                }
            }
        }
        for (int64_t j = 0; j < u; j++) { ds[j] += ps[j]; cn[j] += pc[j]; }
    }
    if (c->pass <= 1)
        for (int64_t j = 0; j < u; j++) c->mx[(int64_t)tid * u + j] = mx[j];
    free(ws);
}

/* Newton passes over the columns of Z from tau (the lower bounds), each column until proven (as in row_search),
 * all of them until every one is or max_passes. Returns the unproven columns, or -1 (c->failed). tau: in/out. */
static int64_t NAME(col_search)(NAME(col_ctx) *c, int64_t v, int64_t nt, const double *scale, double *tau,
                                T *t, int64_t *prev, char *done, int max_passes) {
    const int64_t u = c->u;
    int all_done = u == 0;
    for (int64_t j = 0; j < u; j++) { prev[j] = -1; done[j] = 0; }
    c->pass = 1;
    c->t = t;
    for (int it = 0; it < max_passes && !all_done; it++) {
        for (int64_t j = 0; j < u; j++) t[j] = (T)tau[j];
        parallel_for(v, (int)nt, NAME(col_range), c);
        if (c->failed) return -1;
        all_done = 1;
        for (int64_t j = 0; j < u; j++) {
            if (done[j]) continue;
            double ds = 0;
            int64_t cn = 0;
            T lo = (T)INFINITY;
            for (int64_t k = 0; k < nt; k++) {
                ds += c->dsum[k * u + j];
                cn += c->cnt[k * u + j];
                lo = c->mx[k * u + j] < lo ? c->mx[k * u + j] : lo;
            }
            tau[j] = newton(tau[j], (double)t[j], ds, cn, scale[j]);
            /* proven: no element in (t, t'], or the support repeated */
            if ((T)tau[j] < lo || cn == prev[j]) done[j] = 1;
            else { prev[j] = cn; all_done = 0; }
        }
    }
    int64_t left = 0;
    for (int64_t j = 0; j < u; j++) { left += !done[j]; t[j] = (T)tau[j]; }
    return left;
}

/* the column lower bounds from per-thread sums and maxima: max((sum - s) / v, max - s) */
static void NAME(col_bounds)(const double *sum, const T *mx, int64_t nt, int64_t v, int64_t u,
                             const double *scale, double *tau) {
    for (int64_t j = 0; j < u; j++) {
        double sm = 0, m = -INFINITY;
        for (int64_t k = 0; k < nt; k++) {
            sm += sum[k * u + j];
            m = mx[k * u + j] > m ? mx[k * u + j] : m;
        }
        tau[j] = v > 0 ? (sm - scale[j]) / (double)v : 0;
        if (m - scale[j] > tau[j]) tau[j] = m - scale[j];
    }
}

static int64_t NAME(threads)(int64_t v, int32_t nthreads) {
    int64_t nt = nthreads < 1 ? 1 : nthreads;
    if (nt > 64) nt = 64;
    if (nt > (v + NAME(CH) - 1) / NAME(CH)) nt = (v + NAME(CH) - 1) / NAME(CH); /* whole chunks per thread */
    return nt < 1 ? 1 : nt;
}

/* All n_iter Dykstra iterations (the Sinkhorn's forward) on row-major (v, u) buffers: C (read only), P and Q
 * (working buffers), X (the result). masks: 2 n_iter pointers to (v, u) 0/1 bytes (row projection of iteration k
 * at 2k, column at 2k + 1); counts_r: (n_iter, v) and counts_c: (n_iter, u) support sizes. unproven[0] / [1]: the
 * rows / columns whose threshold stayed a lower bound after max_passes. Returns 0, or -1 if out of memory. */
int32_t NAME(s2t2_dykstra_fwd)(const T *C, T *P, T *Q, T *X, uint8_t **masks, const double *mu, const double *nu,
                               int64_t v, int64_t u, int32_t n_iter, T *counts_r, T *counts_c, int64_t *unproven,
                               int32_t max_passes, int32_t nthreads) {
    const int64_t nt = NAME(threads)(v, nthreads);
    const size_t U = (size_t)(u > 0 ? u : 1);
    double *csum = (double *)calloc(nt * U, sizeof(double)), *tau = (double *)malloc(U * sizeof(double));
    int64_t *ccnt = (int64_t *)calloc(nt * U, sizeof(int64_t)), *prev = (int64_t *)malloc(U * sizeof(int64_t));
    T *cmax = (T *)malloc(nt * U * sizeof(T)), *t = (T *)malloc(U * sizeof(T));
    char *done = (char *)malloc(U);
    int32_t rc = -1;
    unproven[0] = unproven[1] = 0;
    if (!csum || !tau || !ccnt || !prev || !cmax || !t || !done) goto end;
    NAME(fwd_ctx) f;
    memset(&f, 0, sizeof f);
    f.src = C; f.P = P; f.Q = Q; f.mu = mu; f.tc = t; f.u = u; f.max_passes = max_passes;
    f.csum = csum; f.cmax = cmax; f.ccnt = ccnt;
    NAME(col_ctx) c = {Q, X, NULL, u, t, csum, ccnt, cmax, 1, 0};
    for (int k = 0; k < n_iter; k++) {
        /* the row projection (k = 0: from C; later: fused with the output of column projection k - 1) */
        f.mode = k == 0 ? NAME(FIRST) : NAME(FUSED);
        f.mask_r = masks[2 * k];
        f.mask_c = k > 0 ? masks[2 * k - 1] : NULL;
        f.counts_r = counts_r + (int64_t)k * v;
        memset(f.unproven, 0, sizeof f.unproven);
        parallel_for(v, (int)nt, NAME(fwd_rows), &f);
        if (f.failed) goto end;
        for (int i = 0; i < 64; i++) unproven[0] += f.unproven[i];
        if (k > 0) /* the counts of column projection k - 1, found by the pass above */
            for (int64_t j = 0; j < u; j++) {
                int64_t n = 0;
                for (int64_t i = 0; i < nt; i++) n += ccnt[i * u + j];
                counts_c[(int64_t)(k - 1) * u + j] = (T)n;
            }
        /* the column projection's thresholds, from the bounds the row pass gathered */
        NAME(col_bounds)(csum, cmax, nt, v, u, nu, tau);
        int64_t left = NAME(col_search)(&c, v, nt, nu, tau, t, prev, done, max_passes);
        if (left < 0) goto end;
        unproven[1] += left;
    }
    /* the last column projection's output: X and its mask (its correction Q is not needed) */
    c.pass = 3;
    c.mask = masks[2 * n_iter - 1];
    parallel_for(v, (int)nt, NAME(col_range), &c);
    if (c.failed) goto end;
    for (int64_t j = 0; j < u; j++) {
        int64_t n = 0;
        for (int64_t i = 0; i < nt; i++) n += ccnt[i * u + j];
        counts_c[(int64_t)(n_iter - 1) * u + j] = (T)n;
    }
    rc = 0;
end:
    free(csum); free(tau); free(ccnt); free(prev); free(cmax); free(t); free(done);
    return rc;
}

/* One column projection of Dykstra's iteration alone (the column-sharded solver's, whose rows span ranks), in
 * place: per column the exact threshold t of Z, then out = max(Z - t, 0), Z = min(Z, t), mask = Z > t, counts.
 * Returns the unproven columns, or -1 if out of memory (Z untouched). */
int64_t NAME(s2t2_col_step)(T *Z, T *out, uint8_t *mask, const double *scale, int64_t v, int64_t u, T *counts,
                            int32_t max_passes, int32_t nthreads) {
    const int64_t nt = NAME(threads)(v, nthreads);
    const size_t U = (size_t)(u > 0 ? u : 1);
    double *dsum = (double *)calloc(nt * U, sizeof(double)), *tau = (double *)malloc(U * sizeof(double));
    int64_t *cnt = (int64_t *)calloc(nt * U, sizeof(int64_t)), *prev = (int64_t *)malloc(U * sizeof(int64_t));
    T *mx = (T *)malloc(nt * U * sizeof(T)), *t = (T *)malloc(U * sizeof(T));
    char *done = (char *)malloc(U);
    int64_t left = -1;
    NAME(col_ctx) c = {Z, out, mask, u, t, dsum, cnt, mx, 0, 0};
    if (!dsum || !tau || !cnt || !prev || !mx || !t || !done) goto end;
    parallel_for(v, (int)nt, NAME(col_range), &c); /* pass 0: the lower bounds */
    if (c.failed) goto end;
    NAME(col_bounds)(dsum, mx, nt, v, u, scale, tau);
    left = NAME(col_search)(&c, v, nt, scale, tau, t, prev, done, max_passes);
    if (left < 0) goto end;
    c.pass = 2;
    parallel_for(v, (int)nt, NAME(col_range), &c); /* the output */
    if (c.failed) { left = -1; goto end; }
    for (int64_t j = 0; j < u; j++) {
        int64_t n = 0;
        for (int64_t k = 0; k < nt; k++) n += cnt[k * u + j];
        counts[j] = (T)n;
    }
end:
    free(dsum); free(tau); free(cnt); free(prev); free(mx); free(t); free(done);
    return left;
}

/* ================================================================================ backward */
/* Adjoint of the iterations, from the last: gB = where(S_K, gX - mean_SK(gX - gQ), gQ) (column projection K);
 * gA = where(S_R, gB - mean_SR(gB - gP), gP) (row projection R); gQ = gB, gP = gX = gA; zero corrections at the
 * start. The column means need a whole pass before anything is written; the rest is one pass per iteration: the
 * column update, the row's mean and update (in L1), and the sums of the next column mean. */
typedef struct {
    const T *g;             /* the upstream gradient (gX of the last iteration), or NULL: gX = gP */
    T *gQ, *gP;
    const uint8_t *mask_c, *mask_r, *mask_next; /* mask_next: the previous iteration's column support, or NULL */
    const T *counts_r;
    const T *mean_c;        /* (u) the column means, in T */
    int zero;               /* the corrections gQ, gP are zero (the last iteration) */
    int64_t u;
    double *sum;            /* (nthreads, u): the next column sums (or, pass "sums", this one's) */
    int failed;
} NAME(bwd_ctx);

/* column sums over the support of g - gQ (zero: of g), rows [lo, hi) */
static void NAME(bwd_col_sums)(void *vc, int64_t lo, int64_t hi, int tid) {
    NAME(bwd_ctx) *c = (NAME(bwd_ctx) *)vc;
    const int64_t u = c->u, CH = NAME(CH);
    double *restrict acc = c->sum + (int64_t)tid * u;
    void *arr[1];
    void *ws = ws_alloc((size_t)u * sizeof(T), 1, arr);
    if (!ws) { c->failed = 1; return; }
    T *restrict ps = (T *)arr[0];
    for (int64_t j = 0; j < u; j++) acc[j] = 0;
    for (int64_t i0 = lo; i0 < hi; i0 += CH) {
        const int64_t i1 = i0 + CH < hi ? i0 + CH : hi;
        for (int64_t j = 0; j < u; j++) ps[j] = 0;
        for (int64_t i = i0; i < i1; i++) {
            const T *restrict g = (c->g ? c->g : c->gP) + i * u, *restrict gq = c->gQ + i * u;
            const uint8_t *restrict mk = c->mask_c + i * u;
            if (c->zero)
                for (int64_t j = 0; j < u; j++) ps[j] += mk[j] ? g[j] : (T)0;
            else
                for (int64_t j = 0; j < u; j++) ps[j] += mk[j] ? g[j] - gq[j] : (T)0;
        }
        for (int64_t j = 0; j < u; j++) acc[j] += ps[j];
    }
    free(ws);
}

static void NAME(bwd_rows)(void *vc, int64_t lo, int64_t hi, int tid) {
    NAME(bwd_ctx) *c = (NAME(bwd_ctx) *)vc;
    const int64_t u = c->u, CH = NAME(CH);
    double *restrict acc = c->sum + (int64_t)tid * u;
    void *arr[1];
    void *ws = ws_alloc((size_t)u * sizeof(T), 1, arr);
    if (!ws) { c->failed = 1; return; }
    T *restrict ps = (T *)arr[0];
    const T *restrict mean_c = c->mean_c;
    for (int64_t j = 0; j < u; j++) { acc[j] = 0; ps[j] = 0; }
    int64_t rows = 0;
    for (int64_t r = lo; r < hi; r++) {
        /* gX aliases gP after the last iteration: every read of a row happens before its write */
        const T *gx = (c->g ? c->g : c->gP) + r * u;
        T *restrict gq = c->gQ + r * u, *gp = c->gP + r * u;
        const uint8_t *restrict mc = c->mask_c + r * u, *restrict mr = c->mask_r + r * u;
        double sum = 0;
        if (c->zero) { /* gQ = where(S_K, gX - m_K, 0); the row's sum over S_R of gQ */
            for (int64_t j = 0; j < u; j++) {
                T b = mc[j] ? gx[j] - mean_c[j] : (T)0;
                gq[j] = b;
            }
        } else {
            for (int64_t j = 0; j < u; j++) {
                T b = mc[j] ? gx[j] - mean_c[j] : gq[j];
                gq[j] = b;
            }
        }
        {
            const int64_t uv = u - u % W;
            const VEC zero = {0};
            VEC ls = zero;
            for (int64_t j = 0; j < uv; j += W) {
                VEC h = c->zero ? NAME(ld)(gq + j) : NAME(ld)(gq + j) - NAME(ld)(gp + j);
                IVEC m;
                for (int l = 0; l < W; l++) m[l] = -(IT)mr[j + l];
                ls += NAME(sel)(m, h, zero);
            }
            for (int l = 0; l < W; l++) sum += ls[l];
            for (int64_t j = uv; j < u; j++) sum += mr[j] ? (c->zero ? gq[j] : gq[j] - gp[j]) : (T)0;
        }
        const double cn = c->counts_r[r];
        const T m = (T)(sum / (cn > 1 ? cn : 1));
        if (c->zero)
            for (int64_t j = 0; j < u; j++) gp[j] = mr[j] ? gq[j] - m : (T)0;
        else
            for (int64_t j = 0; j < u; j++) gp[j] = mr[j] ? gq[j] - m : gp[j];
        if (c->mask_next) { /* the next (earlier) column projection's sums over its support of gX' - gQ' */
            const uint8_t *restrict mn = c->mask_next + r * u;
            for (int64_t j = 0; j < u; j++) ps[j] += mn[j] ? gp[j] - gq[j] : (T)0;
            if (++rows == CH) {
                for (int64_t j = 0; j < u; j++) { acc[j] += ps[j]; ps[j] = 0; }
                rows = 0;
            }
        }
    }
    for (int64_t j = 0; j < u; j++) acc[j] += ps[j];
    free(ws);
}

static void NAME(col_means)(const double *sum, int64_t nt, int64_t u, const T *counts, T *mean) {
    for (int64_t j = 0; j < u; j++) {
        double s = 0;
        for (int64_t k = 0; k < nt; k++) s += sum[k * u + j];
        const double cn = counts[j];
        mean[j] = (T)(s / (cn > 1 ? cn : 1));
    }
}

/* The backward of s2t2_dykstra_fwd: g (read only) the upstream gradient; gQ a working buffer; gP the result
 * (the gradient of C). masks, counts_r, counts_c: as the forward wrote them. Returns 0, or -1 if out of memory
 * before anything was written (-2 after). */
int32_t NAME(s2t2_dykstra_bwd)(const T *g, T *gQ, T *gP, const uint8_t **masks, const T *counts_r,
                               const T *counts_c, int64_t v, int64_t u, int32_t n_iter, int32_t nthreads) {
    const int64_t nt = NAME(threads)(v, nthreads);
    const size_t U = (size_t)(u > 0 ? u : 1);
    double *sum = (double *)calloc(nt * U, sizeof(double));
    T *mean = (T *)malloc(U * sizeof(T));
    int32_t rc = -1;
    if (!sum || !mean) goto end;
    NAME(bwd_ctx) c = {g, gQ, gP, masks[2 * n_iter - 1], NULL, NULL, NULL, mean, 1, u, sum, 0};
    parallel_for(v, (int)nt, NAME(bwd_col_sums), &c);
    if (c.failed) goto end;
    NAME(col_means)(sum, nt, u, counts_c + (int64_t)(n_iter - 1) * u, mean);
    rc = -2;
    for (int k = n_iter - 1; k >= 0; k--) {
        c.g = k == n_iter - 1 ? g : NULL;
        c.zero = k == n_iter - 1;
        c.mask_c = masks[2 * k + 1];
        c.mask_r = masks[2 * k];
        c.mask_next = k > 0 ? masks[2 * k - 1] : NULL;
        c.counts_r = counts_r + (int64_t)k * v;
        parallel_for(v, (int)nt, NAME(bwd_rows), &c);
        if (c.failed) goto end;
        if (k > 0) NAME(col_means)(sum, nt, u, counts_c + (int64_t)(k - 1) * u, mean);
    }
    rc = 0;
end:
    free(sum);
    free(mean);
    return rc;
}

/* The backward of s2t2_col_step alone: gc = where(mask, g - m, gc) (zero: where(mask, g - m, 0)), m the mean over
 * each column's support of g - gc (zero: of g). Returns 0, or -1 if out of memory (nothing written). */
static void NAME(col_update)(void *vc, int64_t lo, int64_t hi, int tid) {
    NAME(bwd_ctx) *c = (NAME(bwd_ctx) *)vc;
    const int64_t u = c->u;
    const T *restrict mt = c->mean_c;
    (void)tid;
    for (int64_t i = lo; i < hi; i++) {
        const T *restrict g = c->g + i * u;
        T *restrict gc = c->gQ + i * u;
        const uint8_t *restrict mk = c->mask_c + i * u;
        if (c->zero)
            for (int64_t j = 0; j < u; j++) gc[j] = mk[j] ? g[j] - mt[j] : (T)0;
        else
            for (int64_t j = 0; j < u; j++) gc[j] = mk[j] ? g[j] - mt[j] : gc[j];
    }
}

int32_t NAME(s2t2_col_bwd)(const T *g, T *gc, const uint8_t *mask, const T *counts, int64_t v, int64_t u,
                           int32_t zero, int32_t nthreads) {
    const int64_t nt = NAME(threads)(v, nthreads);
    const size_t U = (size_t)(u > 0 ? u : 1);
    double *sum = (double *)calloc(nt * U, sizeof(double));
    T *mean = (T *)malloc(U * sizeof(T));
    int32_t rc = -1;
    if (!sum || !mean) goto end;
    NAME(bwd_ctx) c = {g, gc, NULL, mask, NULL, NULL, NULL, mean, zero, u, sum, 0};
    parallel_for(v, (int)nt, NAME(bwd_col_sums), &c);
    if (c.failed) goto end;
    NAME(col_means)(sum, nt, u, counts, mean);
    parallel_for(v, (int)nt, NAME(col_update), &c);
    rc = 0;
end:
    free(sum);
    free(mean);
    return rc;
}

#undef VEC
#undef IVEC
#undef NAME
#undef CAT
#undef CAT_
