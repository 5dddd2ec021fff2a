"""The transport plans of the translator: the sparse Sinkhorn (S2T2), its dense softmax baseline, and the
unconstrained plan. Pure math: no torch.distributed, no I/O.

``C`` is (v, u): source tokens x target tokens; ``mu`` (v) and ``nu`` (u) are the row and column marginals
(non-negative, each summing to one).

* :func:`sparse_sinkhorn` / :class:`SparseSinkhorn` -- Algorithm 1 with scaled-sparsemax projections (rows: scale
  ``mu_i``, columns: ``nu_j``; :mod:`s2t2_dist.ot.dykstra`); with many iterations it converges to
  ``argmin ||P - C||_F^2`` s.t. ``P >= 0, P 1 = mu, P^T 1 = nu``. Exact thresholds on every device, nothing read
  back to the host after the marginals' one check.
* :func:`softmax_sinkhorn` -- the paper's dense baseline: scaled softmax in place of sparsemax, i.e. the KL
  (entropic) counterpart of Algorithm 1: classic Sinkhorn scaling of ``exp(C)``, run in the log domain.
* :func:`unconstrained_plan` -- ``P = C * nu`` so that the normalised weights ``P / nu`` equal ``C``.

``n_iter`` counts full (row, column) iterations: ``n_iter=3`` is the paper's "iterating 3 times" (its loop
``for k = 0..n`` runs ``n + 1`` iterations).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .dykstra import check_plan_shape, compute_dtype, dykstra
from .routing import steps_for

__all__ = [
    "SparseSinkhorn",
    "sparse_sinkhorn",
    "softmax_sinkhorn",
    "log_sinkhorn",
    "unconstrained_plan",
    "validate_plan_inputs",
]


def _first_bad(t: Tensor, bad: Tensor) -> str:
    pos = bad.nonzero()[0].tolist()
    return f"{t[tuple(pos)].item()} at index {tuple(pos) if len(pos) > 1 else pos[0]}"


def validate_plan_inputs(
    C: Tensor,
    mu: Tensor,
    nu: Tensor,
    atol: float = 1e-4,
    nu_total: float | None = None,
    check_C: bool = True,
) -> None:
    """Raise ``ValueError`` naming the argument and the offending value/shape if the inputs are not usable.

    ``C`` must be 2-D (v, u) and finite; ``mu`` 1-D of length v, ``nu`` 1-D of length u, both finite and >= 0;
    ``sum(mu)`` and ``sum(nu)`` must be 1 within ``atol`` (at least 4 eps of their dtype; hence equal). ``nu_total``: the sum of the whole ``nu``
    when ``nu`` is only a column shard (checked instead of ``sum(nu)``).
    """
    if not isinstance(C, Tensor) or C.dim() != 2:
        raise ValueError(f"C must be a 2-D tensor (v x u), got shape {tuple(getattr(C, 'shape', ()))}")
    if not C.dtype.is_floating_point:
        raise ValueError(f"C must be a floating point tensor, got dtype {C.dtype}")
    v, u = C.shape
    check_plan_shape(v, u)
    for name, m, n in (("mu", mu, v), ("nu", nu, u)):
        if not isinstance(m, Tensor) or m.dim() != 1 or m.shape[0] != n:
            raise ValueError(
                f"{name} must be a 1-D tensor of length {n} to match C of shape {tuple(C.shape)}, "
                f"got shape {tuple(getattr(m, 'shape', ()))}")
        bad = ~torch.isfinite(m)
        if bool(bad.any()):
            raise ValueError(f"{name} must be finite, got {_first_bad(m, bad)}")
        neg = m < 0
        if bool(neg.any()):
            raise ValueError(f"{name} must be non-negative, got {_first_bad(m, neg)}")
    # low-precision marginals (e.g. a bfloat16 copy of a uniform mu) cannot sum to 1 more exactly than their eps
    atol = max(atol, 4 * torch.finfo(mu.dtype).eps, 4 * torch.finfo(nu.dtype).eps)
    smu = float(mu.double().sum())
    snu = float(nu.double().sum()) if nu_total is None else float(nu_total)
    if abs(smu - 1.0) > atol:
        raise ValueError(f"mu must sum to 1 (within {atol}), got sum(mu) = {smu!r}")
    if abs(snu - 1.0) > atol:
        raise ValueError(f"nu must sum to 1 (within {atol}), got sum(nu) = {snu!r}")
    if check_C and not bool(torch.isfinite(C.detach().sum())):  # one reduction; details only on failure
        bad = ~torch.isfinite(C.detach())
        if bool(bad.any()):
            raise ValueError(f"C must be finite (no NaN/inf), got {_first_bad(C.detach(), bad)}")


def _check_shapes(C: Tensor, mu: Tensor, nu: Tensor) -> None:
    """The checks that read no value (free on every call)."""
    if not isinstance(C, Tensor) or C.dim() != 2:
        raise ValueError(f"C must be a 2-D tensor (v x u), got shape {tuple(getattr(C, 'shape', ()))}")
    for name, m, n in (("mu", mu, C.shape[0]), ("nu", nu, C.shape[1])):
        if not isinstance(m, Tensor) or m.dim() != 1 or m.shape[0] != n:
            raise ValueError(
                f"{name} must be a 1-D tensor of length {n} to match C of shape {tuple(C.shape)}, "
                f"got shape {tuple(getattr(m, 'shape', ()))}")


#: mu -> {nu -> (mu's version, nu's version)} of the marginals already checked (by identity: nothing is kept alive)
_CHECKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _validate_once(C: Tensor, mu: Tensor, nu: Tensor) -> None:
    """:func:`validate_plan_inputs` the first time these marginals are seen (again after either is modified): the
    value checks are host reads, which a training step would pay on every call."""
    _check_shapes(C, mu, nu)
    seen = _CHECKED.get(mu)
    if seen is not None and seen.get(nu) == (mu._version, nu._version):
        return
    validate_plan_inputs(C, mu, nu)
    if seen is None:
        seen = _CHECKED[mu] = WeakIdKeyDictionary()
    seen[nu] = (mu._version, nu._version)


class SparseSinkhorn:
    """The sparse Sinkhorn for fixed marginals: ``P = SparseSinkhorn(mu, nu)(C, n_iter)``, differentiable in C.

    The route follows C's device (:func:`~s2t2_dist.ot.routing.steps_for`: Triton kernels on CUDA, torch ops
    elsewhere), exact on both. ``validate``: check mu, nu and C on the first call (host reads, once); a C that
    turns non-finite later makes P and the loss non-finite, which training's bad-step check catches."""

    def __init__(self, mu: Tensor, nu: Tensor, validate: bool = True, on_route=None):
        self.mu, self.nu = mu, nu
        self.validate = validate
        self.on_route = on_route  # told the route taken (routing.steps_for): the caller records it
        self._steps = None

    def __call__(self, C: Tensor, n_iter: int = 3) -> Tensor:
        if self.validate:
            validate_plan_inputs(C, self.mu, self.nu)
            self.validate = False
        cdt = compute_dtype(C.dtype)
        st = self._steps
        if st is None or st.mu.device != C.device or st.mu.dtype != cdt:
            check_plan_shape(*C.shape)
            st = self._steps = steps_for(C.device, self.mu.detach().to(device=C.device, dtype=cdt).contiguous(),
                                         self.nu.detach().to(device=C.device, dtype=cdt).contiguous(),
                                         (tuple(C.shape),), on_route=self.on_route)
        return dykstra(C, st, n_iter)


def sparse_sinkhorn(C: Tensor, mu: Tensor, nu: Tensor, n_iter: int = 3, *, validate: bool = True) -> Tensor:
    """Sparse Sinkhorn (Algorithm 1 with scaled sparsemax): ``P`` (v, u) with rows ~ ``mu``, columns = ``nu``.

    Differentiable in ``C`` (``mu`` and ``nu`` are constants). After the last (column) projection the column sums
    are exact; the row sums converge as ``n_iter`` grows. ``validate``: the shapes on every call; the values of mu,
    nu and C once per pair of marginals (host reads; see :class:`SparseSinkhorn`)."""
    if validate:
        _validate_once(C, mu, nu)
    return SparseSinkhorn(mu, nu, validate=False)(C, n_iter)


def softmax_sinkhorn(C: Tensor, mu: Tensor, nu: Tensor, n_iter: int = 3, *, validate: bool = True) -> Tensor:
    """The paper's dense baseline: scaled softmax in place of sparsemax, ``P`` (v, u) with columns exactly ``nu``.

    Softmax is the KL (Bregman) projection onto a scaled simplex, as sparsemax is the Euclidean one. For KL
    projections onto the affine sets C1, C2 Dykstra's correction terms vanish and Algorithm 1 becomes the classic
    Sinkhorn scaling of ``K = exp(C)``: ``Z <- log mu_i + log_softmax(Z_i.)``, then ``Z <- log nu_j +
    log_softmax(Z_.j)``, ``P = exp(Z)``. (Plugging softmax literally into the Euclidean correction terms of
    :func:`dykstra` is wrong: the column step then sees ``Y + Q``, which no longer contains ``C``, and the plan is
    ~``mu nu^T`` whatever ``C`` is -- the translator cannot learn.) Every entry is positive; the rows converge to
    ``mu`` as ``n_iter`` grows. ``C = log P`` reproduces a feasible, positive ``P`` exactly. Autograd throughout.
    """
    if validate:
        validate_plan_inputs(C, mu, nu)
    return log_sinkhorn(C, mu, nu, n_iter, lambda Z: torch.log_softmax(Z, 1))


def log_sinkhorn(C: Tensor, mu: Tensor, nu: Tensor, n_iter: int, row_log_softmax: Callable[[Tensor], Tensor]
                 ) -> Tensor:
    """Sinkhorn scaling of ``exp(C)`` in the log domain, generic in the row log-softmax (the sharded translator's
    rows span ranks); the column step is always local. Zero marginals are floored at the dtype's smallest normal
    number (their rows / columns come out ~0, not NaN)."""
    if n_iter < 1:
        raise ValueError(f"n_iter must be >= 1, got {n_iter}")
    tiny = torch.finfo(C.dtype).tiny
    log_mu = mu.detach().to(device=C.device, dtype=C.dtype).clamp_min(tiny).log().unsqueeze(1)
    log_nu = nu.detach().to(device=C.device, dtype=C.dtype).clamp_min(tiny).log().unsqueeze(0)
    Z = C
    for _ in range(n_iter):
        Z = log_mu + row_log_softmax(Z)
        Z = log_nu + torch.log_softmax(Z, 0)
    return Z.exp()


def unconstrained_plan(C: Tensor, nu: Tensor) -> Tensor:
    """The unconstrained baseline ``P = C * nu[None, :]``: its normalised weights ``P / nu`` are ``C`` itself
    (convex combinations only while the columns of ``C`` stay on the simplex, e.g. at the init ``C = 1/v``)."""
    if nu.dim() != 1 or nu.shape[0] != C.shape[-1]:
        raise ValueError(f"nu must be a 1-D tensor of length {C.shape[-1]}, got shape {tuple(nu.shape)}")
    return C * nu.to(device=C.device, dtype=C.dtype).unsqueeze(0)
