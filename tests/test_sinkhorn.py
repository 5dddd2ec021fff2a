"""Dykstra / sparse Sinkhorn: fused vs autograd, gradcheck, convergence to the true projection (KKT), baselines,
validation, warm-start invariance, memory discipline."""
import pytest
import torch

from s2t2_dist.ot.entropy import entropy
from s2t2_dist.ot.sinkhorn import (
    SparseSinkhorn,
    dykstra,
    softmax_sinkhorn,
    sparse_sinkhorn,
    unconstrained_plan,
    validate_plan_inputs,
)
from s2t2_dist.ot.simplex import sparsemax


def _problem(v, u, noise, seed=0, dtype=torch.float64, nonuniform=False):
    g = torch.Generator().manual_seed(seed)
    C = (torch.full((v, u), 1.0 / v, dtype=torch.float64) + noise * torch.randn(v, u, generator=g, dtype=torch.float64))
    if nonuniform:
        mu = torch.rand(v, generator=g, dtype=torch.float64) + 0.1
        nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.1
    else:
        mu = torch.ones(v, dtype=torch.float64)
        nu = torch.ones(u, dtype=torch.float64)
    return C.to(dtype), (mu / mu.sum()).to(dtype), (nu / nu.sum()).to(dtype)


def _sort_sparsemax(Z, scale, dim):
    """Independent reference projection (plain sort, autograd through torch ops)."""
    Zm = Z.movedim(dim, -1)
    s = scale.reshape(-1, 1) if scale.dim() else scale
    zs = Zm.sort(-1, descending=True).values
    cs = zs.cumsum(-1)
    j = torch.arange(1, Zm.shape[-1] + 1, dtype=Z.dtype)
    tau = ((cs - s) / j).max(-1, keepdim=True).values
    return (Zm - tau).clamp(min=0).movedim(-1, dim)


def _assert_equals_sort_reference(solver, C, mu, nu, up):
    """P and dC of ``solver`` (3 iterations) equal autograd through the sort-based reference, float64 1e-12."""
    Cf = C.clone().requires_grad_(True)
    P = solver(Cf, 3)
    (P * up).sum().backward()
    Cr = C.clone().requires_grad_(True)
    Pr = dykstra(Cr, lambda Z: _sort_sparsemax(Z, mu, 1), lambda Z: _sort_sparsemax(Z, nu, 0), 3)
    (Pr * up).sum().backward()
    assert torch.allclose(P, Pr, atol=1e-12, rtol=0), float((P - Pr).abs().max())
    assert torch.allclose(Cf.grad, Cr.grad, atol=1e-12, rtol=0), float((Cf.grad - Cr.grad).abs().max())


CASES = [(30, 7, 1e-2, False), (200, 40, 1e-2, True), (120, 33, 0.0, False), (500, 64, 1e-3, False),
         (50, 300, 1.0, True), (64, 9, 1e-4, True),
         # moved plans with large supports (a third of the entries): the fixed Newton passes + fallback left
         # 285-770 slices unproven here (gradients off by 0.03-2); the exact sorted thresholds do not
         (300, 512, 1e-3, False), (512, 512, 1e-3, False)]


@pytest.mark.parametrize("v,u,noise,nonuni", CASES)
def test_fused_equals_autograd_and_sort_reference(v, u, noise, nonuni):
    C, mu, nu = _problem(v, u, noise, seed=v + u, nonuniform=nonuni)
    up = torch.randn(v, u, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads, outs = [], []
    for impl in ("fused", "autograd", "sort"):
        Cg = C.clone().requires_grad_(True)
        if impl == "sort":
            P = dykstra(Cg, lambda Z: _sort_sparsemax(Z, mu, 1), lambda Z: _sort_sparsemax(Z, nu, 0), 3)
        else:
            P = sparse_sinkhorn(Cg, mu, nu, 3, implementation=impl)
        (P * up).sum().backward()
        outs.append(P.detach())
        grads.append(Cg.grad)
    for o, g_ in zip(outs[1:], grads[1:]):
        assert torch.allclose(outs[0], o, atol=1e-14, rtol=0)
        assert torch.allclose(grads[0], g_, atol=1e-12, rtol=0)
    P = outs[0]
    assert (P >= 0).all()
    assert torch.allclose(P.sum(0), nu, atol=1e-14)  # the last projection is the column one: exact


def test_gradcheck_sparse_sinkhorn():
    for v, u, noise, seed in ((9, 5, 0.05, 0), (6, 8, 0.3, 1), (7, 4, 0.0, 2)):
        C, mu, nu = _problem(v, u, noise, seed=seed, nonuniform=True)
        C = C.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda c: sparse_sinkhorn(c, mu, nu, 3), (C,))
        assert torch.autograd.gradcheck(lambda c: sparse_sinkhorn(c, mu, nu, 2, implementation="autograd"), (C,))


def _kkt_residuals(C, P, mu, nu):
    """P = max(C - a_i - b_j, 0) for some duals (a, b): fit a, b on the support, check the complementarity."""
    v, u = C.shape
    S = P > 1e-12
    ii, jj = S.nonzero(as_tuple=True)
    A = torch.zeros(ii.numel(), v + u, dtype=torch.float64)
    A[torch.arange(ii.numel()), ii] = 1
    A[torch.arange(ii.numel()), v + jj] = 1
    rhs = (C - P)[ii, jj]
    sol = torch.linalg.lstsq(A, rhs.unsqueeze(1)).solution.squeeze(1)
    a, b = sol[:v], sol[v:]
    D = C - a[:, None] - b[None, :]
    on = (D - P)[S].abs().max()
    off = D[~S].max() if (~S).any() else torch.tensor(-1.0)
    return float(on), float(off), float((P.sum(1) - mu).abs().max()), float((P.sum(0) - nu).abs().max())


@pytest.mark.parametrize("v,u,noise,seed", [(12, 7, 0.05, 0), (20, 10, 0.2, 1), (8, 8, 0.01, 2)])
def test_converges_to_true_projection(v, u, noise, seed):
    C, mu, nu = _problem(v, u, noise, seed=seed, nonuniform=True)
    with torch.no_grad():
        P = sparse_sinkhorn(C, mu, nu, 1000)
    on, off, row_err, col_err = _kkt_residuals(C, P, mu, nu)
    assert row_err < 1e-9 and col_err < 1e-12, (row_err, col_err)
    assert on < 1e-8, on  # P = C - a - b on the support
    assert off < 1e-8, off  # C - a - b <= 0 off the support
    # and it is the minimiser: no feasible perturbation along the KKT directions improves ||P - C||
    with torch.no_grad():
        P3 = sparse_sinkhorn(C, mu, nu, 3)
    assert (P - C).norm() <= (P3 - C).norm() + 1e-12 or float((P3.sum(1) - mu).abs().max()) > 1e-9


def test_report_feasibility_of_three_iterations():
    print()
    for v, u, noise in ((2000, 64, 1e-3), (2000, 64, 1e-2), (2000, 256, 1e-3)):
        C, mu, nu = _problem(v, u, noise, seed=3, dtype=torch.float32)
        for n in (1, 3, 10):
            with torch.no_grad():
                P = sparse_sinkhorn(C, mu, nu, n)
            re = float((P.double().sum(1) - mu.double()).abs().max())
            ce = float((P.double().sum(0) - nu.double()).abs().max())
            print(f"v={v} u={u} noise={noise} n_iter={n}: max|P1-mu| = {re:.3g} ({re / float(mu[0]):.3g} x mu_i), "
                  f"max|P^T1-nu| = {ce:.3g}, density {float((P > 0).float().mean()):.3f}")
            assert ce < 1e-6
            if n == 10:
                assert re < float(mu[0])  # rows within one mu_i after 10 iterations


def test_paper_init_is_exact_and_uniform():
    v, u = 300, 20
    C = torch.full((v, u), 1.0 / v)
    mu, nu = torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u)
    P = sparse_sinkhorn(C, mu, nu, 3)
    assert torch.allclose(P, torch.full_like(P, 1.0 / (u * v)), rtol=1e-6, atol=0)
    Ps = softmax_sinkhorn(C, mu, nu, 3)
    assert torch.allclose(Ps, torch.full_like(P, 1.0 / (u * v)), rtol=1e-6, atol=0)


def _scaling_sinkhorn(C, mu, nu, n_iter):
    """Independent reference: textbook Sinkhorn, P = diag(a) exp(C) diag(b), rows then columns, float64."""
    K = C.double().exp()
    b = torch.ones(K.shape[1], dtype=torch.float64)
    for _ in range(n_iter):
        a = mu.double() / (K @ b)
        b = nu.double() / (K.T @ a)
    return a[:, None] * K * b[None, :]


@pytest.mark.parametrize("n_iter", [1, 3, 10])
def test_softmax_sinkhorn_is_sinkhorn_scaling_of_exp_C(n_iter):
    C, mu, nu = _problem(50, 17, 2.0, seed=11, nonuniform=True)
    P = softmax_sinkhorn(C, mu, nu, n_iter)
    torch.testing.assert_close(P, _scaling_sinkhorn(C, mu, nu, n_iter), rtol=1e-10, atol=1e-16)


def test_softmax_sinkhorn_learns_from_C():
    """Regression: the plan must depend on C. (Softmax plugged into Dykstra's Euclidean correction terms gave
    ~mu nu^T for any C: the dense baseline's translate loss stayed at ln u for every learning rate.)"""
    C, mu, nu = _problem(80, 20, 1.0, seed=3, nonuniform=True)
    P = softmax_sinkhorn(C, mu, nu, 3)
    outer = mu[:, None] * nu[None, :]
    assert (P - outer).abs().max() > 0.5 * outer.max()
    # a feasible positive plan is its own image from C = log P; rows converge to mu with iterations
    Pc = softmax_sinkhorn(C, mu, nu, 200)  # converged: feasible
    torch.testing.assert_close(softmax_sinkhorn(Pc.log(), mu, nu, 3), Pc, rtol=1e-9, atol=1e-18)
    errs = [float((softmax_sinkhorn(C, mu, nu, n).sum(1) - mu).abs().max()) for n in (1, 5, 50)]
    assert errs[2] < errs[1] < errs[0] and errs[2] < 1e-8
    # the gradient at the paper's uniform init is not zero (a learnable start)
    C0 = torch.full_like(C, 1.0 / C.shape[0]).requires_grad_(True)
    (softmax_sinkhorn(C0, mu, nu, 3) * torch.randn_like(C)).sum().backward()
    assert C0.grad.abs().max() > 1e-6 * outer.max()


def test_softmax_sinkhorn_zero_marginals_stay_finite():
    C, mu, nu = _problem(30, 8, 0.5, seed=2, nonuniform=True)
    mu, nu = mu.clone(), nu.clone()
    mu[3], nu[5] = 0, 0
    mu, nu = mu / mu.sum(), nu / nu.sum()
    P = softmax_sinkhorn(C, mu, nu, 3)
    assert torch.isfinite(P).all() and float(P[3].abs().max()) < 1e-300 and float(P[:, 5].abs().max()) < 1e-300
    torch.testing.assert_close(P.sum(0), nu, rtol=0, atol=1e-14)


def test_softmax_and_unconstrained_baselines():
    C, mu, nu = _problem(40, 9, 0.5, seed=4, nonuniform=True)
    C.requires_grad_(True)
    P = softmax_sinkhorn(C, mu, nu, 3)
    assert (P > 0).all()  # dense
    assert torch.allclose(P.sum(0), nu, atol=1e-14)
    P.square().sum().backward()
    assert torch.isfinite(C.grad).all()
    U = unconstrained_plan(C.detach(), nu)
    assert torch.allclose(U / nu, C.detach())


def test_float32_bf16_dtypes_and_warm_start_bit_identical():
    C, mu, nu = _problem(700, 48, 1e-3, seed=5, dtype=torch.float32)
    solver = SparseSinkhorn(mu, nu)
    up = torch.randn(700, 48, generator=torch.Generator().manual_seed(2))
    res = []
    for call in range(3):
        Cg = (C + call * 1e-4 * up).requires_grad_(True)
        Pw = solver(Cg, 3)  # warm after the first call
        (Pw * up).sum().backward()
        Cc = Cg.detach().clone().requires_grad_(True)
        Pc = sparse_sinkhorn(Cc, mu, nu, 3)  # cold
        (Pc * up).sum().backward()
        assert torch.equal(Pw, Pc) and torch.equal(Cg.grad, Cc.grad)
        res.append(int(solver.unproven()))
    assert res == [0, 0, 0]  # every threshold proven exact
    Pb = sparse_sinkhorn(C.bfloat16(), mu, nu, 3)
    assert Pb.dtype == torch.bfloat16 and torch.isfinite(Pb.float()).all()


def test_saved_for_backward_is_only_supports():
    """The fused Function keeps no float tensor of C's size for backward (peak-memory discipline)."""
    C, mu, nu = _problem(600, 50, 1e-3, seed=6, dtype=torch.float32)
    C0 = torch.full_like(C, 1.0 / 600)
    for Cx in (C, C0):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
            sparse_sinkhorn(Cx.clone().requires_grad_(True), mu, nu, 3)
        assert not [s for s in saved if s[0].is_floating_point and s[1] >= C.numel()], saved


def test_validation_messages():
    C, mu, nu = _problem(10, 4, 0.1, seed=7)
    bad = C.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"C must be finite.*nan.*\(3, 2\)"):
        sparse_sinkhorn(bad, mu, nu)
    bad[3, 2] = float("inf")
    with pytest.raises(ValueError, match="C must be finite"):
        softmax_sinkhorn(bad, mu, nu)
    m2 = mu.clone()
    m2[1] = -0.1
    with pytest.raises(ValueError, match=r"mu must be non-negative.*-0.1.*index 1"):
        sparse_sinkhorn(C, m2, nu)
    with pytest.raises(ValueError, match=r"nu must sum to 1.*2\.0"):
        sparse_sinkhorn(C, mu, nu * 2)
    with pytest.raises(ValueError, match=r"mu must be a 1-D tensor of length 10.*\(9,\)"):
        sparse_sinkhorn(C, mu[:9], nu)
    with pytest.raises(ValueError, match=r"nu must be a 1-D tensor of length 4"):
        sparse_sinkhorn(C, mu, torch.ones(5, dtype=torch.float64) / 5)
    with pytest.raises(ValueError, match="C must be a 2-D"):
        validate_plan_inputs(C[0], mu, nu)
    with pytest.raises(ValueError, match="n_iter"):
        sparse_sinkhorn(C, mu, nu, 0)


def test_entropy_finite_gradient_at_zeros():
    C, mu, nu = _problem(80, 10, 1e-2, seed=8)
    C.requires_grad_(True)
    P = sparse_sinkhorn(C, mu, nu, 3)
    assert (P == 0).any()
    H = entropy(P)
    Pd = P.detach()
    ref = -(Pd[Pd > 0] * Pd[Pd > 0].log()).sum()
    assert torch.allclose(H, ref)
    H.backward()
    assert torch.isfinite(C.grad).all()
    Z = torch.zeros(3, 3, requires_grad=True)
    entropy(Z).backward()
    assert torch.equal(Z.grad, torch.zeros(3, 3))
    # gradient matches finite differences where P > 0
    X = torch.rand(4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(entropy, (X,))
    # sparsemax output: zeros exactly where off-support
    assert (sparsemax(torch.randn(4, 30), 1.0, 1) == 0).any()


def _edge_problem():
    """Ties, an all-equal block, one-hot and very negative rows/columns, zero marginals (a row and a column)."""
    v, u = 60, 24
    g = torch.Generator().manual_seed(11)
    C = torch.randn(v, u, generator=g, dtype=torch.float64) * 1e-2
    C[:10] = torch.randint(0, 3, (10, u), generator=g).double() * 1e-2  # groups of ties
    C[10:20, :8] = 1.0 / v  # all equal
    C[20] = 0.0
    C[20, 3] = 1.0  # one-hot row
    C[:, 5] = 0.0
    C[7, 5] = 1.0  # one-hot column
    C[30] = C[30] - 1e3  # a very negative row
    C[:, 9] = C[:, 9] - 1e3  # and column
    mu = torch.rand(v, generator=g, dtype=torch.float64) + 0.2
    nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.2
    mu[40], nu[11] = 0.0, 0.0  # zero marginals
    return C, mu / mu.sum(), nu / nu.sum()


@pytest.mark.parametrize("case", ["edge", "init", "moved"])
def test_exact_against_sort_reference_on_edge_cases(case):
    """P and dC of the fused (sync-free) Sinkhorn equal autograd through the sort-based reference, float64 1e-12."""
    if case == "edge":
        C, mu, nu = _edge_problem()
    else:
        C, mu, nu = _problem(200, 40, 0.0 if case == "init" else 3e-3, seed=12, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    solver = SparseSinkhorn(mu, nu)
    for call in range(2):
        _assert_equals_sort_reference(solver, C, mu, nu, up)
    assert int(solver.unproven()) == 0


@pytest.mark.parametrize("v,u,dtype", [(4000, 64, torch.float32), (300, 512, torch.float32), (300, 512, torch.float64)])
def test_no_host_syncs_forward_backward(v, u, dtype):
    """Forward + backward of the sparse Sinkhorn (3 iterations) reads nothing back to the host (was 66-70)."""
    from s2t2_dist.utils.syncs import count_host_syncs

    C, mu, nu = _problem(v, u, 1e-3, seed=13, dtype=dtype)
    up = torch.randn(v, u, generator=torch.Generator().manual_seed(4), dtype=dtype)
    solver = SparseSinkhorn(mu, nu)
    solver(C, 1)  # the first call validates mu, nu and C (host reads, once)
    for _ in range(2):  # the functional form and the persistent solver
        for fn in (lambda c: solver(c, 3), lambda c: sparse_sinkhorn(c, mu, nu, 3, validate=False)):
            Cg = C.clone().requires_grad_(True)
            with count_host_syncs() as cnt:
                fn(Cg).backward(up)
            assert cnt.total == 0, cnt.summary()
        C = C + 1e-3 * up


def test_fused_kernels_exact_and_sync_free():
    """The compiled pass kernels (inductor CPU) give the sort reference's P and dC (float64, 1e-12), warm and cold,
    the eager path's supports, and no host syncs (under the counter the kernels' eager references run: torch.compile
    cannot run under a dispatch mode, and fullgraph=True makes any host read inside a kernel a compile error)."""
    from s2t2_dist.ot.fused import FusedKernels, fused_available
    from s2t2_dist.utils.syncs import count_host_syncs

    assert fused_available()  # CI has a C++ compiler: the compiled path must be the one tested
    C, mu, nu = _edge_problem()
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    kern = FusedKernels()
    solver = SparseSinkhorn(mu, nu, fused=kern)
    for call in range(2):  # cold, then warm
        _assert_equals_sort_reference(solver, C, mu, nu, up)
    assert int(solver.unproven()) == 0 and kern.calls > 0
    calls = kern.calls
    Cg = C.clone().requires_grad_(True)
    with count_host_syncs() as cnt:
        solver(Cg, 3).backward(up)
    assert cnt.total == 0, cnt.summary()
    assert kern.calls == calls  # the counted run was the eager reference of the same kernels
    # float32: the same supports as the eager ops (sums in another order: thresholds equal to rounding)
    C32, mu32, nu32 = _problem(300, 40, 1e-3, seed=14, dtype=torch.float32)
    Pf = sparse_sinkhorn(C32, mu32, nu32, 3, fused=kern)
    Pe = sparse_sinkhorn(C32, mu32, nu32, 3, fused=False)
    assert torch.equal(Pf > 0, Pe > 0)
    torch.testing.assert_close(Pf, Pe, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("fused", [False, True, "native"])
def test_reused_scratch_never_leaks_between_interleaved_calls(fused):
    """A persistent solver reuses its scratch buffers (CPU), yet two calls whose forwards and backwards interleave
    give each its own P and dC, equal to fresh solvers'; no result is a working buffer or shares another's
    storage."""
    C1, mu, nu = _problem(300, 40, 3e-3, seed=21, nonuniform=True)
    C2 = _problem(300, 40, 3e-3, seed=22)[0]
    up = torch.randn(C1.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    solver = SparseSinkhorn(mu, nu, fused=fused)
    a, b = C1.clone().requires_grad_(True), C2.clone().requires_grad_(True)
    Pa = solver(a, 3)
    Pb = solver(b, 3)  # the second forward reuses the first one's buffers
    Pb.backward(up)
    Pa.backward(2 * up)
    assert solver.scratch is not None
    work = {t.data_ptr() for name, t in solver.scratch._bufs.items() if name in ("a", "b")}
    results = [Pa.data_ptr(), Pb.data_ptr(), a.grad.data_ptr(), b.grad.data_ptr()]
    assert len(set(results)) == 4 and not work & set(results)
    for C, P, grad, scale in ((C1, Pa, a.grad, 2), (C2, Pb, b.grad, 1)):
        ref_in = C.clone().requires_grad_(True)
        ref = SparseSinkhorn(mu, nu, fused=fused)(ref_in, 3)
        (ref * (scale * up)).sum().backward()
        torch.testing.assert_close(P, ref, rtol=0, atol=1e-15)
        torch.testing.assert_close(grad, ref_in.grad, rtol=0, atol=1e-13)


def test_drop_below_equals_a_where_after_the_solver():
    """``drop_below`` (the translator's noise filter, inside the solver's Function) equals ``where(P > t, P, 0)``
    after it, in value and gradient."""
    C, mu, nu = _problem(200, 30, 3e-3, seed=23, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    P0 = SparseSinkhorn(mu, nu)(C, 3)
    t = torch.quantile(P0[P0 > 0], 0.3) * torch.linspace(0.5, 1.5, 30, dtype=torch.float64)  # drops some entries
    a, b = C.clone().requires_grad_(True), C.clone().requires_grad_(True)
    Pa = SparseSinkhorn(mu, nu)(a, 3, drop_below=t)
    Pb = SparseSinkhorn(mu, nu)(b, 3)
    Pb = torch.where(Pb > t, Pb, 0)
    assert 0 < int((Pa == 0).sum() - (P0 == 0).sum())  # something was dropped
    torch.testing.assert_close(Pa, Pb, rtol=0, atol=0)
    Pa.backward(up)
    Pb.backward(up)
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-14)


@pytest.mark.parametrize("fused", [False, True])
def test_warm_starts_stay_exact_over_a_moving_sequence(fused):
    """Opted in (``warm_iters``, off by default), a persistent solver starts each of its 2 x 3 projections from that
    projection's thresholds of the previous call (fewer Newton passes). Over a training-like sequence (tiny moves, a
    large one, an unrelated C) P and dC stay the sort reference's (float64, 1e-12), every threshold proven."""
    from s2t2_dist.ot.simplex import DEFAULT_WARM_ITERS

    C, mu, nu = _problem(400, 48, 1e-3, seed=31, nonuniform=True)
    g = torch.Generator().manual_seed(8)
    up = torch.randn(C.shape, dtype=torch.float64, generator=g)
    solver = SparseSinkhorn(mu, nu, fused=fused)
    for p in (solver.rows, solver.cols):
        p.sort_max = 0  # the threshold search at any size (small plans are otherwise sorted whole)
        p.warm_iters = DEFAULT_WARM_ITERS
    for step, move in enumerate([0.0, 1e-6, 1e-6, 1e-4, None]):
        if move is None:
            C = _problem(400, 48, 5e-3, seed=32)[0]
        else:
            C = C + move * torch.randn(C.shape, dtype=torch.float64, generator=g)
        _assert_equals_sort_reference(solver, C, mu, nu, up)
        assert set(solver.rows._warm) == set(solver.cols._warm) == {0, 1, 2}, step  # kept for the next call
    assert int(solver.unproven()) == 0


def test_first_step_from_an_exactly_sparse_start_stays_exact():
    """The shipped FVT start: C = P0 with exact zeros, then one optimiser step moves every entry by ~lr. The rows'
    supports change wholesale; with rows warm-started (4 passes from the previous thresholds) a hundred rows stayed
    unproven here (the full-size rehearsal: 49,943 of 50,280), so the solver starts cold and the plan stays exact."""
    g = torch.Generator().manual_seed(0)
    v, u = 3000, 64
    mu = torch.rand(v, generator=g, dtype=torch.float64) ** 4 + 1e-3
    nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.1
    mu, nu = mu / mu.sum(), nu / nu.sum()
    C = torch.zeros(v, u, dtype=torch.float64)
    for j in range(u):  # FVT-like columns: a few source rows each, exact zeros elsewhere
        rows = torch.randint(0, v, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        C[rows, j] = nu[j] / len(rows)
    step = (0.025 / v) * torch.sign(torch.randn(v, u, generator=g, dtype=torch.float64))

    def unproven(row_warm):
        s = SparseSinkhorn(mu, nu, fused=False)
        for p in (s.rows, s.cols):
            p.sort_max = 0  # the threshold search (the size of a real C)
        s.rows.warm_iters = row_warm
        s(C, 3)
        s(C - step, 3)
        return int(s.rows.unproven), int(s.cols.unproven), s

    assert unproven(4)[0] > 50  # the fixture does defeat warm-started rows (else this test checks nothing)
    rows, cols, solver = unproven(SparseSinkhorn(mu, nu).rows.warm_iters)  # the shipped defaults
    assert rows == 0 and cols == 0 and not solver.rows._warm and not solver.cols._warm
    up = torch.randn(v, u, generator=g, dtype=torch.float64)
    _assert_equals_sort_reference(solver, C - step, mu, nu, up)
