/* CPU kernels of the threshold Dykstra (s2t2_dist/ot/native.py builds and loads this file; it is the pure-math
 * twin of the eager passes in ot/simplex.py and ot/sinkhorn.py, which stay the reference).
 *
 * Why hand-written: each projection is a threshold search (Michelot / Newton passes) plus one output pass. The
 * compiled (inductor) path runs a FIXED number of passes and streams the whole matrix from memory for each column
 * pass. Here every slice stops as soon as its support count repeats (the proof of exactness the fixed passes also
 * use), a row is searched in L1, and a block of columns is copied once into a contiguous buffer that stays in cache
 * for all its passes and its output. Nothing here reads a device: the whole file is CPU-only.
 *
 * Matrices are row-major (v, u), contiguous. A row projection's slices are rows (length u, scale[i]); a column
 * projection's are columns (length v, scale[j]). Masks are 0/1 bytes (a bool tensor's storage). Thresholds are
 * searched in float64 and applied in the matrix's dtype T, as in the reference: t = (T) tau; support = {z > t}.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

/* n arrays of `bytes` each in one allocation, each starting 64 bytes further into its 4 KiB page than the last:
 * a load whose address differs from a pending store's by a multiple of 4 KiB waits for it ("4K aliasing"); two
 * per-column arrays 16 KiB apart made a column pass 2x slower. Free the returned base. */
static void *ws_alloc(size_t bytes, int n, void **arr) {
    const size_t stride = (bytes + 4095) / 4096 * 4096 + 64;
    char *base = (char *)aligned_alloc(64, stride * (size_t)n + 64);
    if (!base) return NULL;
    for (int k = 0; k < n; k++) arr[k] = base + (size_t)k * stride;
    return base;
}

/* ------------------------------------------------------------------------------------------------ kernels */
/* Newton (Michelot) update from t (the search point in T): t + (sum_S (z - t) - s) / |S|, float64; an empty support
 * (scale 0: the root is max z) keeps tau. From a lower bound tau rises monotonically to the exact root. */
static inline double newton(double tau, double t, double dsum, int64_t cnt, double s) {
    return cnt > 0 ? t + (dsum - s) / (double)cnt : tau;
}

#define T float
#define IT int32_t
#define SFX f32
#define W 16
#include "dykstra_cpu_impl.h"
#undef T
#undef IT
#undef SFX
#undef W

#define T double
#define IT int64_t
#define SFX f64
#define W 8
#include "dykstra_cpu_impl.h"
