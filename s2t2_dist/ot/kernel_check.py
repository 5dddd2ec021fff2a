"""The first-use check of a route's Dykstra steps: every launch of a candidate (the Triton kernels) judged against
the torch steps on identical inputs.

Pure math: no torch.distributed, no I/O. Comparing two whole runs is not a test of a kernel: float32 sums in
another order put an entry that lies within a float32 step of its slice's threshold on the other side of it, one
flipped support entry moves one slice's backward mean, and two correct implementations then differ in C's
gradient by ~0.07 (3,200 x 512: the torch steps against themselves with another summation order). So each launch
is fed the reference's own inputs:

* every forward projection (rows, with and without Dykstra's corrections, and columns) on the reference's input:
  its support may differ only at entries within :data:`TIE_STEPS` float32 steps (of the slice's largest entry: the
  grain of a threshold that is a sum of them) of the slice's threshold, its outputs (projection and correction)
  only by as many steps, its counts are its mask's;
* every backward launch on the reference's gradients, masks and counts: its output agrees to :data:`VALUE_TOL`;
* the thresholds-only launch (the sharded rows') along both sides of a column-major, a row-major and an
  unaligned row-major copy (a rank's slice: its pointers not 16-byte aligned, another Triton specialisation): the
  thresholds agree to :data:`TIE_STEPS` steps, a count may differ only by entries within the tie band;
* and the whole forward plan of two Dykstra iterations (tie-insensitive: a flipped entry carries < one step of mass).

A kernel that is wrong (a mask one entry off, a threshold off by more than a few steps, a correction dropped, a
backward mean over the wrong entries) fails by orders of magnitude; a near-tie never does.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .dykstra import TorchSteps, dykstra, newton_thresholds

__all__ = ["TIE_STEPS", "VALUE_TOL", "check_problem", "launch_findings", "verdict"]

#: float32 steps (of the slice's largest entry) within which a support entry may land on either side of the
#: slice's threshold, and by which a launch's outputs and thresholds may differ
TIE_STEPS = 8.0
#: largest difference of a backward launch's output, relative to the reference's largest (fed the same masks, it
#: differs only by the rounding of its means)
VALUE_TOL = 1e-5
#: largest difference of the whole two-iteration plan, times v (a plan's entries are ~1/v)
PLAN_TOL = 1e-3


def check_problem(device: torch.device, v: int, u: int, dtype: torch.dtype):
    """The check's plan: C near 1/v with a random spread, uniform marginals, and an upstream gradient (seeded)."""
    g = torch.Generator().manual_seed(0)
    C = (1.0 / v + torch.rand(v, u, generator=g, dtype=torch.float64) / v).to(device=device, dtype=dtype)
    mu = torch.full((v,), 1.0 / v, device=device, dtype=dtype)
    nu = torch.full((u,), 1.0 / u, device=device, dtype=dtype)
    return C, mu, nu, torch.randn(v, u, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)


def _spacing(x: Tensor) -> Tensor:
    """One step of x's dtype at |x|, per entry."""
    a = x.abs()
    return (torch.nextafter(a, torch.full_like(a, float("inf"))) - a).clamp(min=torch.finfo(x.dtype).tiny)


def _grain(z: Tensor, dim: int) -> Tensor:
    """One float32 step of each slice's largest entry, broadcast over the slice: the grain of its threshold (a sum
    of the slice's entries, so another order of the same sums moves it by about one such step, however small the
    threshold itself)."""
    return _spacing(z.abs().amax(dim, keepdim=True)).expand_as(z)


def _steps_from_threshold(z: Tensor, tau: Tensor, dim: int) -> Tensor:
    """|z - t| in grains of the slice (:func:`_grain`), per entry (t: each slice's threshold along ``dim``)."""
    return (z - tau.to(z.dtype).unsqueeze(dim)).abs() / _grain(z, dim)


def _steps_apart(a: Tensor, b: Tensor, z: Tensor, dim: int) -> float:
    """The largest |a - b| of two launches' outputs in grains of the input's slice plus steps at b (a projection
    writes z - t and min(z, t), plus a correction term)."""
    return float(((a - b).abs() / (_grain(z, dim) + _spacing(b))).max()) if b.numel() else 0.0


def _like(t: Tensor | None, proto: Tensor) -> Tensor | None:
    """A copy of ``t`` in ``proto``'s layout (the candidate's buffers: the kernels index masks as their outputs)."""
    if t is None:
        return None
    return torch.empty_strided(t.shape, proto.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _unaligned(t: Tensor) -> Tensor:
    """A contiguous copy of ``t`` whose storage starts one element past an allocation's start (4 bytes for
    float32): what a rank's slice of mu or of the rows is at most shard offsets, a pointer Triton does not
    specialise as 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


def _rel(a: Tensor, b: Tensor) -> float:
    d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return d / max(float(b.double().abs().max()) if b.numel() else 0.0, 1e-30)


class _Findings(list):
    """(part, value, limit, what is measured) per comparison; a value above its limit fails the check."""

    def add(self, part: str, value: float, limit: float, what: str) -> None:
        self.append((part, value if value == value else float("inf"), limit, what))  # a NaN fails


def _projection(f: _Findings, part: str, z: Tensor, scale: Tensor, dim: int, ref_out: tuple, cand_out: tuple
                ) -> None:
    """One forward launch: (mask, count, projection, correction) of reference and candidate on the same ``z``."""
    (mr, _, pr, qr), (mc, cc, pc, qc) = ref_out, cand_out
    tau, _ = newton_thresholds(z.cpu(), scale.cpu(), dim)
    off = (mc.cpu() != mr.cpu())
    far = float(_steps_from_threshold(z.cpu(), tau, dim)[off].max()) if bool(off.any()) else 0.0
    f.add(f"the support of {part}", far, TIE_STEPS,
          f"{int(off.sum())} entries on the other side of the threshold, the farthest {far:.3g} float32 steps of "
          "its slice from it")
    own = (mc.sum(dim, dtype=torch.int64).cpu() != cc.cpu().to(torch.int64)).sum()
    f.add(f"the counts of {part}", float(own), 0.0, f"{int(own)} counts that are not the launch's own mask's")
    for what, a, b in (("projection", pc, pr), ("correction", qc, qr)):
        d = _steps_apart(a.cpu(), b.cpu(), z.cpu(), dim)
        f.add(f"the {what} of {part}", d, TIE_STEPS, f"entries {d:.3g} float32 steps of their slice apart")


def launch_findings(candidate: Callable[[Tensor, Tensor], object], device: torch.device, v: int, u: int,
                    dtype: torch.dtype = torch.float32, n_iter: int = 2,
                    reference: Callable[[Tensor, Tensor], object] = TorchSteps) -> list[tuple]:
    """Every comparison of the candidate's launches with the reference's on identical inputs, on the check's v x u
    plan: ``(part, value, limit, what)``. ``candidate`` / ``reference``: step classes ``(mu, nu) -> steps``."""
    C, mu, nu, G = check_problem(device, v, u, dtype)
    f = _Findings()
    ref, cand = reference(mu, nu), candidate(mu, nu)
    Pr, Qr, Xr = ref.buffers(C)
    Pk, Qk, Xk = cand.buffers(C)
    saved = []
    with torch.no_grad():
        for k in range(n_iter):
            first, it = k == 0, f" (iteration {k + 1})"
            src = C if first else Xr
            z = src if first else src + Pr
            Pk.copy_(Pr), Qk.copy_(Qr), Xk.copy_(Xr)
            mk, ck = cand.row(C if first else Xk, Pk, Qk, first)
            mr, cr = ref.row(src, Pr, Qr, first)
            _projection(f, "the row projection" + (" with corrections" if not first else "") + it, z, mu, 1,
                        (mr, cr, Qr, Pr), (mk, ck, Qk, Pk))
            saved += [mr, cr]
            z = Qr.clone()
            Qk.copy_(Qr)
            mk, ck = cand.col(Qk, Xk)
            mr, cr = ref.col(Qr, Xr)
            _projection(f, "the column projection" + it, z, nu, 0, (mr, cr, Xr, Qr), (mk, ck, Xk, Qk))
            saved += [mr, cr]
        gX, gP, gQ = G, None, None  # the backward's recursion (dykstra._Dykstra.backward), launch by launch
        for k in reversed(range(n_iter)):
            it = f" (iteration {k + 1})"
            for side, i in (("column", 4 * k + 2), ("row", 4 * k)):
                g, gc = (gX, gQ) if side == "column" else (gQ, gP)
                mask, cnt = saved[i], saved[i + 1]
                out_c = getattr(cand, f"{side[:3]}_bwd")(g.clone(), _like(gc, Pk), _like(mask, Pk),
                                                         cnt.to(torch.int32))
                out_r = getattr(ref, f"{side[:3]}_bwd")(g, gc, mask, cnt)
                f.add(f"the {side} backward{' with corrections' if gc is not None else ''}{it}", _rel(out_c, out_r),
                      VALUE_TOL, "relative difference")
                gQ, gP = (out_r, gP) if side == "column" else (gQ, out_r)
            gX = gP
        for layout, Z in (("column-major", C.t().contiguous().t()), ("row-major", C.contiguous()),
                          ("row-major, unaligned", _unaligned(C))):
            for dim, s, side in ((0, nu, "columns"), (1, mu, "rows")):
                if layout.endswith("unaligned"):  # a rank's slice of the rows and of mu: no 16-byte alignment
                    s = _unaligned(s)
                t1, c1 = cand.thresholds(Z, s, dim)
                t2, c2 = ref.thresholds(Z, s, dim)
                Zc, t2c = Z.cpu(), t2.cpu()
                d = float(((t1.cpu() - t2c).abs() / _grain(Zc, dim).amax(dim).double()).max())
                f.add(f"the thresholds of a {layout} plan's {side}", d, TIE_STEPS,
                      f"thresholds {d:.3g} float32 steps of their slice apart")
                band = (_steps_from_threshold(Zc, t2c, dim) <= TIE_STEPS).sum(dim)
                extra = (c1.cpu().long() - c2.cpu().long()).abs() - band
                f.add(f"the counts of a {layout} plan's {side}", float(extra.clamp(min=0).sum()), 0.0,
                      "count differences beyond the entries within the tie band")
    P1 = dykstra(C, cand, n_iter)
    P2 = dykstra(C, reference(mu, nu), n_iter)
    f.add("the plan (forward, whole run)", float((P1.double() - P2.double()).abs().max()) * v, PLAN_TOL,
          "largest difference times v")
    return f


def verdict(findings: list[tuple]) -> str:
    """'' when every comparison is within its limit, else the worst one (by how far past its limit), in words."""
    bad = [x for x in findings if not x[1] <= x[2]]
    if not bad:
        return ""
    part, value, limit, what = max(bad, key=lambda x: x[1] / x[2] if x[2] else float("inf"))
    return f"{part} differs from the torch steps' on the same inputs ({what}; limit {limit:g})"
