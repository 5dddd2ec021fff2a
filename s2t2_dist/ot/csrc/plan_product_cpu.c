/* CPU kernels of the translator's product over P's SUPPORT (s2t2_dist/translator/product.py loads this file through
 * s2t2_dist/ot/cbuild.py; the dense GEMMs stay the reference):
 *
 *   product: out (u x d) = P^T M, summed over P's non-zeros only;
 *   grad_p:  dP (v x u)  = M G^T on P's non-zeros, 0 elsewhere (the sparse kind's backward reads dP on P's
 *            support only, see product.py).
 *
 * Why: a plan with every source row live (the paper's uniform source marginal) is still ~6% non-zero at v = 50,280,
 * u = 512, so the dense GEMMs do ~16x the work of these loops (105 GFLOP each at d = 2,048), and the live-row GEMMs
 * save nothing. Both kernels take P in chunks of rows, each thread a contiguous range (the layout:
 * plan_product_cpu_impl.h); M and P are read from memory once.
 *
 * P and out in T; M in MT (a bf16 model's rows are widened as read: no v x d copy). Row-major, contiguous. Sums run
 * in T, in another order than a GEMM's (rounding-level differences); each thread sums its rows, then the threads'
 * accumulators are added in thread order: deterministic for a given thread count. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"

/* a * b + c as one fused multiply-add (-std=c11 turns contraction off): these are sums of products whose order
 * already differs from a GEMM's, and FMA is both faster and closer to exact */
#pragma GCC optimize("fp-contract=fast")

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = {(uint32_t)h << 16};
    return x.f;
}

#define T float
#define MT float
#define LOADM(x) (x)
#define SFX f32_f32
#define W 16
#include "plan_product_cpu_impl.h"

#define T float
#define MT uint16_t
#define LOADM(x) bf16_to_f32(x)
#define SFX f32_bf16
#define W 16
#include "plan_product_cpu_impl.h"

#define T double
#define MT double
#define LOADM(x) (x)
#define SFX f64_f64
#define W 8
#include "plan_product_cpu_impl.h"
