"""The Triton kernels of the sparse Sinkhorn's CUDA route (see :mod:`s2t2_dist.ot.dykstra_triton`).

Offsets are int64: a slice index times the stride between slices, or an entry's index times the stride along a
slice (v for a row of a column-major plan), passes 2**31 on large plans (v = 256,000 with u >= 8,389).

A module of its own, imported on first use: ``triton.jit`` reads ``TRITON_INTERPRET`` (the tests' CPU switch) when
the kernels are defined, and helpers are found among the module's globals when a kernel is compiled.
"""
import triton
import triton.language as tl



@triton.jit
def _load(z1_ptr, z2_ptr, sl, n, a_s, a_n, b_s, b_n, m, HAS_Z2: tl.constexpr):
    # z = z1 (+ z2) for slices sl (BS,) and entries n (BN,); masked lanes -inf (never in a support)
    z = tl.load(z1_ptr + sl[:, None] * a_s + n[None, :].to(tl.int64) * a_n, mask=m, other=float("-inf"))
    if HAS_Z2:
        z += tl.load(z2_ptr + sl[:, None] * b_s + n[None, :].to(tl.int64) * b_n, mask=m, other=0.0)
    return z


@triton.jit
def _newton(z, t, m):
    sup = (z > t[:, None]) & m
    return tl.sum(sup.to(tl.int32), axis=1), tl.sum(tl.where(sup, z - t[:, None], 0.0), axis=1).to(tl.float64)


@triton.jit
def project(z1_ptr, z2_ptr, add_ptr, pos_ptr, corr_ptr, mask_ptr, scale_ptr, tau_ptr, cnt_ptr,
            S, N, a_s, a_n, b_s, b_n,
            HAS_Z2: tl.constexpr, HAS_ADD: tl.constexpr, APPLY: tl.constexpr,
            BS: tl.constexpr, BN: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """Exact threshold of every slice of z = z1 (+ z2); with APPLY: pos = max(z - t, 0) (+ add), corr =
    min(z, t), mask = z > t (uint8), cnt = |mask|; without: tau = t, cnt = |z > t|."""
    DT = z1_ptr.dtype.element_ty
    sl = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
    sok = sl < S
    s = tl.load(scale_ptr + sl, mask=sok, other=0.0).to(tl.float64)
    # lower bounds: the largest entry alone, and the whole slice
    if ONE_CHUNK:
        n = tl.arange(0, BN)
        m = sok[:, None] & (n[None, :] < N)
        z = _load(z1_ptr, z2_ptr, sl, n, a_s, a_n, b_s, b_n, m, HAS_Z2)
        mx = tl.max(z, axis=1).to(tl.float64)
        sm = tl.sum(tl.where(m, z, 0.0), axis=1).to(tl.float64)
    else:
        mx = tl.full([BS], float("-inf"), tl.float64)
        sm = tl.zeros([BS], tl.float64)
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            m = sok[:, None] & (n[None, :] < N)
            zc = _load(z1_ptr, z2_ptr, sl, n, a_s, a_n, b_s, b_n, m, HAS_Z2)
            mx = tl.maximum(mx, tl.max(zc, axis=1).to(tl.float64))
            sm += tl.sum(tl.where(m, zc, 0.0), axis=1).to(tl.float64)
    tau = tl.where(sok, tl.maximum(mx - s, (sm - s) / N), 0.0)
    prev = tl.full([BS], 2147483647, tl.int32)
    cnt = tl.zeros([BS], tl.int32)  # (loop-carried: after the loop, the support count at the final t)
    act = sok
    go = tl.max(act.to(tl.int32), axis=0) > 0
    while go:
        t = tau.to(DT)
        if ONE_CHUNK:
            cnt, ds = _newton(z, t, m)
        else:
            cnt = tl.zeros([BS], tl.int32)
            ds = tl.zeros([BS], tl.float64)
            for n0 in range(0, N, BN):
                n = n0 + tl.arange(0, BN)
                m = sok[:, None] & (n[None, :] < N)
                c1, d1 = _newton(_load(z1_ptr, z2_ptr, sl, n, a_s, a_n, b_s, b_n, m, HAS_Z2), t, m)
                cnt += c1
                ds += d1
        act = act & (cnt < prev)  # the support shrank: one more step; else t is its own support's threshold
        tau = tl.where(act, tau + (ds - s) / tl.maximum(cnt, 1).to(tl.float64), tau)
        prev = tl.where(act, cnt, prev)
        go = tl.max(act.to(tl.int32), axis=0) > 0
    t = tau.to(DT)
    if APPLY:
        if ONE_CHUNK:
            cnt = _write(z, t, m, sl, n, b_s, b_n, add_ptr, pos_ptr, corr_ptr, mask_ptr, HAS_ADD)
        else:
            cnt = tl.zeros([BS], tl.int32)
            for n0 in range(0, N, BN):
                n = n0 + tl.arange(0, BN)
                m = sok[:, None] & (n[None, :] < N)
                zc = _load(z1_ptr, z2_ptr, sl, n, a_s, a_n, b_s, b_n, m, HAS_Z2)
                cnt += _write(zc, t, m, sl, n, b_s, b_n, add_ptr, pos_ptr, corr_ptr, mask_ptr, HAS_ADD)
    else:
        tl.store(tau_ptr + sl, tau, mask=sok)
    tl.store(cnt_ptr + sl, cnt, mask=sok)


@triton.jit
def _write(z, t, m, sl, n, b_s, b_n, add_ptr, pos_ptr, corr_ptr, mask_ptr, HAS_ADD: tl.constexpr):
    off = sl[:, None] * b_s + n[None, :].to(tl.int64) * b_n
    sup = z > t[:, None]
    y = tl.maximum(z - t[:, None], 0.0)
    if HAS_ADD:
        y += tl.load(add_ptr + off, mask=m, other=0.0)
    tl.store(corr_ptr + off, tl.minimum(z, t[:, None]), mask=m)
    tl.store(pos_ptr + off, y, mask=m)
    tl.store(mask_ptr + off, sup.to(tl.uint8), mask=m)
    return tl.sum((sup & m).to(tl.int32), axis=1)


@triton.jit
def backward(g_ptr, gc_ptr, out_ptr, mask_ptr, cnt_ptr, S, N, g_s, g_n, b_s, b_n,
             HAS_GC: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """out = where(S, g - mean_S(g - gc), gc) per slice (gc absent: 0); out may be gc's buffer."""
    sl = tl.program_id(0).to(tl.int64) * BS + tl.arange(0, BS)
    sok = sl < S
    c = tl.maximum(tl.load(cnt_ptr + sl, mask=sok, other=1), 1).to(tl.float64)
    if ONE_CHUNK:
        n = tl.arange(0, BN)
        m = sok[:, None] & (n[None, :] < N)
        g, gc, sup = _bwd_load(g_ptr, gc_ptr, mask_ptr, sl, n, g_s, g_n, b_s, b_n, m, HAS_GC)
        mean = tl.sum(tl.where(sup, g - gc, 0.0), axis=1).to(tl.float64) / c
        _bwd_write(g, gc, sup, mean, out_ptr, sl, n, b_s, b_n, m)
    else:
        tot = tl.zeros([BS], tl.float64)
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            m = sok[:, None] & (n[None, :] < N)
            g, gc, sup = _bwd_load(g_ptr, gc_ptr, mask_ptr, sl, n, g_s, g_n, b_s, b_n, m, HAS_GC)
            tot += tl.sum(tl.where(sup, g - gc, 0.0), axis=1).to(tl.float64)
        mean = tot / c
        for n0 in range(0, N, BN):
            n = n0 + tl.arange(0, BN)
            m = sok[:, None] & (n[None, :] < N)
            g, gc, sup = _bwd_load(g_ptr, gc_ptr, mask_ptr, sl, n, g_s, g_n, b_s, b_n, m, HAS_GC)
            _bwd_write(g, gc, sup, mean, out_ptr, sl, n, b_s, b_n, m)


@triton.jit
def _bwd_load(g_ptr, gc_ptr, mask_ptr, sl, n, g_s, g_n, b_s, b_n, m, HAS_GC: tl.constexpr):
    off = sl[:, None] * b_s + n[None, :].to(tl.int64) * b_n
    g = tl.load(g_ptr + sl[:, None] * g_s + n[None, :].to(tl.int64) * g_n, mask=m, other=0.0)
    if HAS_GC:
        gc = tl.load(gc_ptr + off, mask=m, other=0.0)
    else:
        gc = tl.zeros_like(g)
    sup = tl.load(mask_ptr + off, mask=m, other=0) != 0
    return g, gc, sup


@triton.jit
def _bwd_write(g, gc, sup, mean, out_ptr, sl, n, b_s, b_n, m):
    tl.store(out_ptr + sl[:, None] * b_s + n[None, :].to(tl.int64) * b_n,
             tl.where(sup, g - mean[:, None].to(g.dtype), gc), mask=m)

