"""The sparse Sinkhorn's references for the tests: autograd through a sort-based scaled sparsemax inside the generic
Dykstra recursion (Algorithm 1 with both correction terms), and the problems the tests share."""
import torch


def problem(v, u, noise, seed=0, dtype=torch.float64, nonuniform=False):
    """C = 1/v + noise (v x u) and marginals (uniform, or random positive), in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    C = torch.full((v, u), 1.0 / v, dtype=torch.float64) + noise * torch.randn(v, u, generator=g, dtype=torch.float64)
    if nonuniform:
        mu = torch.rand(v, generator=g, dtype=torch.float64) + 0.1
        nu = torch.rand(u, generator=g, dtype=torch.float64) + 0.1
    else:
        mu = torch.ones(v, dtype=torch.float64)
        nu = torch.ones(u, dtype=torch.float64)
    return C.to(dtype), (mu / mu.sum()).to(dtype), (nu / nu.sum()).to(dtype)


def edge_problem(v=60, u=24, seed=11):
    """Ties, an all-equal block, one-hot and very negative rows/columns, zero marginals (a row and a column)."""
    g = torch.Generator().manual_seed(seed)
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
    mu[v * 2 // 3], nu[11] = 0.0, 0.0  # zero marginals
    return C, mu / mu.sum(), nu / nu.sum()


def sort_thresholds(Z, scale, dim):
    """The exact threshold of every slice of Z (2-D) along ``dim`` by a sort: ``max_j (z_(1) + ... + z_(j) - s) / j``
    (float64)."""
    zs = (Z if dim == 1 else Z.t()).sort(dim=1, descending=True).values
    cs = zs.cumsum(1, dtype=torch.float64)
    j = torch.arange(1, zs.shape[1] + 1, dtype=torch.float64)
    return ((cs - scale.to(torch.float64).unsqueeze(1)) / j).amax(1)


def sort_sparsemax(Z, scale, dim):
    """Scaled sparsemax of every slice along ``dim`` by a plain sort (autograd through torch ops)."""
    Zm = Z.movedim(dim, -1)
    s = scale.reshape(-1, 1) if scale.dim() else scale
    zs = Zm.sort(-1, descending=True).values
    cs = zs.cumsum(-1)
    j = torch.arange(1, Zm.shape[-1] + 1, dtype=Z.dtype)
    tau = ((cs - s) / j).max(-1, keepdim=True).values
    return (Zm - tau).clamp(min=0).movedim(-1, dim)


def autograd_dykstra(C, row_proj, col_proj, n_iter=3):
    """Algorithm 1 with both correction terms, differentiated by autograd through the given projections."""
    X, P, Q = C, None, None
    for _ in range(n_iter):
        A = X if P is None else X + P
        Y = row_proj(A)
        P = A - Y
        B = Y if Q is None else Y + Q
        X = col_proj(B)
        Q = B - X
    return X


def reference_sinkhorn(C, mu, nu, n_iter=3):
    """The sparse Sinkhorn by the sort reference (float64 in, autograd)."""
    return autograd_dykstra(C, lambda Z: sort_sparsemax(Z, mu, 1), lambda Z: sort_sparsemax(Z, nu, 0), n_iter)


def assert_equals_reference(solve, C, mu, nu, up, atol=1e-12, atol_grad=1e-12, n_iter=3):
    """P and dC of ``solve(C_leaf)`` equal the sort reference's (float64), within ``atol`` and ``atol_grad``."""
    Cf = C.clone().requires_grad_(True)
    P = solve(Cf)
    (P * up).sum().backward()
    Cr = C.double().clone().requires_grad_(True)
    Pr = reference_sinkhorn(Cr, mu.double(), nu.double(), n_iter)
    (Pr * up.double()).sum().backward()
    dp, dg = float((P.detach().double() - Pr.detach()).abs().max()), float((Cf.grad.double() - Cr.grad).abs().max())
    assert dp <= atol and dg <= atol_grad, (dp, dg)
    return P.detach()
