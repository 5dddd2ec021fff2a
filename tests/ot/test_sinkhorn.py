"""The sparse Sinkhorn on its CPU route (torch ops, exact Newton thresholds): equal to autograd through a sort,
gradcheck, convergence to the true projection (KKT), baselines, validation once per marginals, no host reads,
memory discipline. The CUDA route's kernels: tests/helpers/scripts/sinkhorn_triton_interpreted.py (run by
tests/ot/test_gpu_kernels.py)."""
import os

import pytest
import torch

from s2t2_dist.ot.dykstra import SUM_BLOCK, TorchSteps, dykstra, newton_thresholds, sum64
from s2t2_dist.ot.entropy import entropy
from s2t2_dist.ot.sinkhorn import (
    SparseSinkhorn,
    softmax_sinkhorn,
    sparse_sinkhorn,
    unconstrained_plan,
    validate_plan_inputs,
)
from s2t2_dist.utils.syncs import count_host_syncs
from tests.helpers.sinkhorn_reference import assert_equals_reference, edge_problem, problem as _problem, sort_sparsemax, \
    sort_thresholds

CASES = [(30, 7, 1e-2, False), (200, 40, 1e-2, True), (120, 33, 0.0, False), (500, 64, 1e-3, False),
         (50, 300, 1.0, True), (64, 9, 1e-4, True), (300, 512, 1e-3, False), (512, 512, 1e-3, False)]


@pytest.mark.parametrize("v,u,noise,nonuni", CASES)
def test_equals_the_sort_reference(v, u, noise, nonuni):
    """P and dC equal autograd through the sort-based reference, float64 1e-12; columns sum to nu exactly."""
    C, mu, nu = _problem(v, u, noise, seed=v + u, nonuniform=nonuni)
    up = torch.randn(v, u, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    P = assert_equals_reference(lambda c: sparse_sinkhorn(c, mu, nu, 3), C, mu, nu, up)
    assert (P >= 0).all()
    assert torch.allclose(P.sum(0), nu, atol=1e-14)  # the last projection is the column one: exact


@pytest.mark.parametrize("case", ["edge", "init", "moved"])
def test_exact_on_edge_cases(case):
    """Ties, all-equal blocks, one-hot and very negative rows and columns, zero marginals; the paper's init (every
    entry tied); a moved plan: the sort reference's P and dC, float64 1e-12, call after call."""
    if case == "edge":
        C, mu, nu = edge_problem()
    else:
        C, mu, nu = _problem(200, 40, 0.0 if case == "init" else 3e-3, seed=12, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    solver = SparseSinkhorn(mu, nu)
    for _ in range(2):
        assert_equals_reference(lambda c: solver(c, 3), C, mu, nu, up)


def test_newton_thresholds_are_the_projection_thresholds():
    """The CPU route's thresholds: the sort's, sum max(z - t, 0) = s for every slice, along either dim, with ties and
    all-equal slices; scale 0 gives t = max (an all-zero slice); the counts are the supports' sizes."""
    g = torch.Generator().manual_seed(0)
    Z = torch.randn(40, 7, generator=g, dtype=torch.float64)
    Z[:4] = 0.5
    Z[5, :3] = Z[5, 3]
    for dim in (0, 1):
        s = torch.rand(Z.shape[1 - dim], generator=g, dtype=torch.float64)
        s[0] = 0.0
        t, cnt = newton_thresholds(Z, s, dim)
        torch.testing.assert_close(t, sort_thresholds(Z, s, dim), rtol=0, atol=1e-14)
        torch.testing.assert_close((Z - t.unsqueeze(dim)).clamp(min=0).sum(dim), s, rtol=0, atol=1e-13)
        assert float(t[0]) == float(Z.amax(dim)[0]) and torch.equal(cnt, (Z > t.unsqueeze(dim)).sum(dim))


def test_float32_thresholds_and_counts_through_block_sums():
    """float32 slices longer than SUM_BLOCK (block sums plus a tail): sum64 is the float64 sum to float32 rounding
    (float64 input: the plain sum, bitwise), the thresholds are the sort's to float32 rounding, and the counts,
    summed as float32 0/1 values, are exactly the supports' sizes."""
    g = torch.Generator().manual_seed(1)
    Z = torch.randn(5 * SUM_BLOCK + 7, 3 * SUM_BLOCK + 5, generator=g)
    Z[:20] = 0.25  # ties
    for dim in (0, 1):
        ref = Z.double().sum(dim)
        torch.testing.assert_close(sum64(Z, dim), ref, rtol=0, atol=1e-6 * float(Z.abs().sum(dim).max()))
        assert torch.equal(sum64(Z.double(), dim), ref)
        s = torch.rand(Z.shape[1 - dim], generator=g, dtype=torch.float64) * 3
        t, cnt = newton_thresholds(Z, s, dim)
        torch.testing.assert_close(t, sort_thresholds(Z.double(), s, dim), rtol=1e-6, atol=1e-6)
        assert torch.equal(cnt, (Z > t.float().unsqueeze(dim)).sum(dim))


def test_gradcheck_sparse_sinkhorn():
    for v, u, noise, seed in ((9, 5, 0.05, 0), (6, 8, 0.3, 1), (7, 4, 0.0, 2)):
        C, mu, nu = _problem(v, u, noise, seed=seed, nonuniform=True)
        C = C.requires_grad_(True)
        assert torch.autograd.gradcheck(lambda c: sparse_sinkhorn(c, mu, nu, 3), (C,))


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


def test_float32_and_bf16_inputs():
    """float32 is computed in float32 (the reference's supports, thresholds equal to rounding), bf16 in float32 with
    a bf16 result; the gradient comes back in C's dtype."""
    C, mu, nu = _problem(700, 48, 1e-3, seed=5, dtype=torch.float32)
    up = torch.randn(700, 48, generator=torch.Generator().manual_seed(2))
    P = assert_equals_reference(lambda c: sparse_sinkhorn(c, mu, nu, 3), C, mu, nu, up, atol=1e-9, atol_grad=1e-5)
    assert P.dtype == torch.float32
    Cb = C.bfloat16().requires_grad_(True)
    Pb = sparse_sinkhorn(Cb, mu, nu, 3)
    Pb.float().sum().backward()
    assert Pb.dtype == torch.bfloat16 and Cb.grad.dtype == torch.bfloat16 and torch.isfinite(Pb.float()).all()


def test_saved_for_backward_is_only_supports():
    """The Function keeps no float tensor of C's size for backward (peak-memory discipline): bool masks only."""
    C, mu, nu = _problem(600, 50, 1e-3, seed=6, dtype=torch.float32)
    C0 = torch.full_like(C, 1.0 / 600)
    for Cx in (C, C0):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
            sparse_sinkhorn(Cx.clone().requires_grad_(True), mu, nu, 3)
        assert not [s for s in saved if s[0].is_floating_point and s[1] >= C.numel()], saved
        assert sum(1 for s in saved if s[0] == torch.bool and s[1] == C.numel()) == 6  # 3 iterations x 2


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
    assert (sort_sparsemax(torch.randn(4, 30), torch.tensor(1.0), 1) == 0).any()


@pytest.mark.parametrize("v,u,dtype", [(4000, 64, torch.float32), (300, 512, torch.float32), (300, 512, torch.float64)])
def test_no_host_syncs_forward_backward(v, u, dtype):
    """Forward + backward of the sparse Sinkhorn (3 iterations) reads nothing back to the host, and the functional
    form validates its marginals once: a second call with the same ones reads nothing either."""
    C, mu, nu = _problem(v, u, 1e-3, seed=13, dtype=dtype)
    up = torch.randn(v, u, generator=torch.Generator().manual_seed(4), dtype=dtype)
    solver = SparseSinkhorn(mu, nu)
    solver(C, 1)  # the first call validates mu, nu and C (host reads, once)
    sparse_sinkhorn(C, mu, nu, 1)  # (the functional form's first call with these marginals: the same)
    for _ in range(2):
        for fn in (lambda c: solver(c, 3), lambda c: sparse_sinkhorn(c, mu, nu, 3)):
            Cg = C.clone().requires_grad_(True)
            with count_host_syncs() as cnt:
                fn(Cg).backward(up)
            assert cnt.total == 0, cnt.summary()
        C = C + 1e-3 * up
    mu2 = mu.clone()  # other marginals (or the same ones modified in place) are checked again
    with count_host_syncs() as cnt:
        sparse_sinkhorn(C, mu2, nu, 1)
    assert cnt.total > 0
    mu2.mul_(2)
    with pytest.raises(ValueError, match="mu must sum to 1"):
        sparse_sinkhorn(C, mu2, nu, 1)


def test_torch_steps_exact_at_every_layout():
    """The torch route takes C in any layout (the Triton route's column-major buffers included)."""
    C, mu, nu = _problem(90, 13, 2e-2, seed=8, nonuniform=True)
    up = torch.randn(C.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    Ct = C.t().contiguous().t()  # column-major
    assert_equals_reference(lambda c: dykstra(c, TorchSteps(mu, nu), 3), Ct, mu, nu, up)


def test_safe_inv_zero_marginals():
    """1/x for positive marginals (down to the smallest subnormal), 0 for zero ones: no inf, no NaN."""
    from s2t2_dist.ot.marginals import safe_inv

    for dt in (torch.float32, torch.float64):
        tiny = torch.finfo(dt).tiny
        x = torch.tensor([0.0, 0.25, 1e-30 if dt == torch.float32 else 1e-300, tiny / 4, 2.0], dtype=dt)
        y = safe_inv(x)
        assert torch.isfinite(y).all() and y[0] == 0 and y[1] == 4 and y[4] == 0.5
        assert y[3] == 1 / tiny  # a subnormal marginal is clamped to the smallest normal, not inverted to inf


def test_kernels_that_cannot_run_fail_their_first_use_check_with_one_warning(caplog):
    """Without a GPU and without Triton's interpreter the kernels cannot launch: the route's check says so once (the
    CUDA route would then take the torch steps instead of stopping the run)."""
    from s2t2_dist.ot.routing import kernels_ok

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("(the interpreter runs them: tests/helpers/scripts/sinkhorn_triton_interpreted.py)")
    kernels_ok.cache_clear()
    with caplog.at_level("WARNING"):
        assert not kernels_ok(torch.device("cpu")) and not kernels_ok(torch.device("cpu"))
    assert sum("failed their first-use check" in r.message for r in caplog.records) == 1
    kernels_ok.cache_clear()


@pytest.mark.parametrize("n", [4, 96, 512, 4095, 4096, 8192, 8193, 32000, 50280, 50304, 151936, 256000])
def test_the_first_use_check_tiles_as_the_route(n):
    """The check's plan side has the tiling of the real side (block sizes, streamed or whole, the last chunk's
    remainder, divisibility by 16: what Triton specialises on) and is at most two column chunks long."""
    import s2t2_dist.ot.dykstra_triton as dt
    from s2t2_dist.ot.routing import check_shape

    m = check_shape(n)
    assert m <= 2 * dt.BLOCK_N and m % 16 == n % 16 and m % dt.BLOCK_N == n % dt.BLOCK_N
    for other in (7, 512, 5000):  # as the long and as the short side
        assert dt._shape(other, m) == dt._shape(other, n) and dt._shape(m, other)[:1] <= dt._shape(n, other)[:1]


def test_a_plan_beyond_the_routes_is_refused_in_one_line():
    from s2t2_dist.ot.dykstra import MAX_SIDE, check_plan_shape

    check_plan_shape(MAX_SIDE, 512)
    with pytest.raises(ValueError, match=r"^the sparse Sinkhorn supports at most 16,777,215 tokens a side, got u "):
        check_plan_shape(50280, MAX_SIDE + 1)
    C = torch.zeros(1, 3).expand(MAX_SIDE + 1, 3)  # (no memory: a view)
    with pytest.raises(ValueError, match="tokens a side, got v"):
        SparseSinkhorn(torch.zeros(1).expand(MAX_SIDE + 1), torch.ones(3), validate=False)(C)


def test_the_route_taken_is_recorded_with_why(monkeypatch, caplog):
    """On a CPU: the torch steps, not a fallback. On a kernel device whose kernels cannot run (here: no GPU and no
    interpreter): the torch steps as a fallback, with the first-use check's reason."""
    import s2t2_dist.ot.routing as dy
    from s2t2_dist.utils import routes

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("(the interpreter runs the kernels: tests/helpers/scripts/sinkhorn_triton_interpreted.py)")
    monkeypatch.setattr(routes, "ROUTES", {})
    mu, nu = torch.full((20,), 1 / 20), torch.full((4,), 1 / 4)
    assert isinstance(dy.steps_for(torch.device("cpu"), mu, nu, on_route=routes.record), dy.TorchSteps)
    assert routes.summary()["sinkhorn"] == {"route": "torch steps", "why": "a CPU device (the kernels are CUDA's)",
                                            "fallback": False, "device": "cpu"}
    assert routes.fallbacks(routes.summary()) == []
    monkeypatch.setattr(dy, "kernel_device", lambda device: True)
    dy.kernels_ok.cache_clear()
    with caplog.at_level("WARNING"):
        assert isinstance(dy.steps_for(torch.device("cpu"), mu, nu, ((20, 4),), on_route=routes.record), dy.TorchSteps)
    s = routes.summary()
    assert s["sinkhorn"]["fallback"] and s["sinkhorn"]["why"].startswith("the Triton kernels failed their first-use "
                                                                         "check at 20 x 4 float32: "), s
    assert routes.fallbacks(s) == [f"sinkhorn: torch steps ({s['sinkhorn']['why']})"]
    assert "FALLBACK" in routes.text(s)
    dy.kernels_ok.cache_clear()


def test_routes_of_ranks_merge_with_a_fallback_first():
    from s2t2_dist.utils.routes import merged

    ok = {"sinkhorn": {"route": "kernels", "why": "w", "fallback": False, "device": "cuda:0"}}
    bad = {"sinkhorn": {"route": "torch steps", "why": "x", "fallback": True, "device": "cuda:1"}}
    assert merged([ok, {"sinkhorn": dict(ok["sinkhorn"], device="cuda:1")}]) == ok
    m = merged([ok, bad])
    assert m["sinkhorn"]["route"] == "torch steps" and set(m["sinkhorn"]["ranks"]) == {"0", "1"}
