"""The translated rows' product ``P^T M`` (u x d from a v x u plan and v source rows), per-device kernels.

Pure math: no torch.distributed, no I/O. :func:`plan_product` is what :func:`~s2t2_dist.translator.module.
translated_rows` multiplies with. It is one dispatcher op (``torch.library.custom_op``) with two kernels:

* CPU, by what P is (:func:`cpu_route`, from one pass counting each row's non-zeros):

  - ``"live"``: only the LIVE rows of P (any non-zero) are read: ``P[live]^T M[live]`` forward, ``M[live] G^T``
    into those rows of dP backward. The shipped sparse recipe's plan at v = 50,280 (the FVT start with its own
    source marginal) has ~320 live rows: the two GEMMs of v x u x d (211 GFLOP per step at OLMo-1B's d) shrink to
    ~1/150 of that (BENCHMARKS.md "#21 (session 9)").
  - ``"support"``: every row may be live but P is still sparse (the paper's uniform source marginal: ~6% non-zero
    at v = 50,280): the C kernels of ``ot/csrc/plan_product_cpu.c`` walk P's non-zeros only, forward and (for
    ``sparse``) into dP on P's support, 0 elsewhere. Taken when their measured cost model (:func:`support_cost`)
    says they beat both the GEMMs and gathering the live rows: at d = 2,048 up to ~20% non-zeros.
  - ``"dense"``: the GEMMs.

  Counting reads P on the host, which on a CPU is no sync. ``S2T2_PRODUCT_KERNEL=dense`` forces the GEMMs,
  ``=live`` leaves the support kernels out (the live rows or the GEMMs, as before them).
* every other device (CUDA): for a sparse plan (``sparse``, the sparse kind) the Triton kernels of
  :mod:`~s2t2_dist.translator.product_triton`, which find and count the live rows on the device and read nothing
  back; otherwise, or without Triton, or with ``S2T2_PRODUCT_KERNEL=dense``, the dense GEMMs.

The kernels agree up to rounding (the same terms summed in another order) in the forward and in ``dM``. ``dP``
differs only where it is never read: with ``sparse`` the live-row kernels leave the dead rows of dP at 0, and the
support kernel every entry off P's support, where the dense product has ``M_i . G_j``. That is exact for the sparse
kind: P comes out of a sparsemax projection and, for ``translator.floor``, the floor Function, and both backwards
read the incoming gradient only on P's support (``J h = S * (h - mean_S h)``; the floor's ``dP_kj`` on kept
entries). The other kinds' P can have zero rows whose gradient matters (the unconstrained kind's ``C = 0`` rows):
they pass ``sparse=False`` and get dP on every row.

A :class:`~s2t2_dist.utils.syncs.SyncCounter` sees this op as one op (a kernel, like any aten op that reads its
own data on the CPU), not the CPU kernel's ``nonzero``; the GPU kernels have no host read (their device-side part
is counted by the tests with the counter on).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from s2t2_dist.ot import cbuild
from s2t2_dist.translator import product_triton as _triton

log = logging.getLogger(__name__)

__all__ = ["DENSE_FRACTION", "cpu_route", "live_rows", "plan_product", "support_available", "support_cost"]

#: the CPU kernel uses the dense GEMMs when more than this fraction of P's rows are live: gathering the rows then
#: saves little (at 50,280 x 512 x 2,048 on 2 threads, forward + backward: 0.5 live 1.49 s against 1.91 s dense,
#: 0.7 live 1.85 against 1.79 s)
DENSE_FRACTION = 0.5


def support_cost(density: float, d: int) -> float:
    """The support kernels' time over the dense GEMMs' (forward + dP) for a plan with ``density`` non-zeros and
    source rows of width ``d``. Fitted to ``bench/bench_plan_product.py --sweep`` at v = 50,280, u = 512, every row
    live, 1 or 2 threads (BENCHMARKS.md "#21 (session 11)"): 0.38-0.39 at 6% and 0.85 at 20% non-zeros with
    d = 2,048 (the model: 0.46, 0.94); 0.61 and 1.17 with d = 512 (0.64, 1.18); 0.88-1.84 with d = 128; above 1
    with d = 32. Reading P, sorting its non-zeros and writing dP cost the same at any d, the GEMMs grow with d. The
    model errs towards the GEMMs."""
    return 0.2 + 100 / d + density * (3.3 + 300 / d)


def live_rows(P: Tensor) -> Optional[Tensor]:
    """The indices of P's rows with a non-zero (a host read: the CPU kernel's), or None when the dense GEMMs are
    cheaper (more than :data:`DENSE_FRACTION` of the rows live)."""
    idx = P.any(1).nonzero().squeeze(1)
    return None if idx.numel() > DENSE_FRACTION * P.shape[0] else idx


@functools.lru_cache(maxsize=None)
def _support_lib() -> Optional[ctypes.CDLL]:
    lib = cbuild.load("plan_product_cpu.c", ["plan_product_cpu_impl.h", "parallel.h"],
                      "the translator's product uses the GEMMs instead")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        for sfx in _SUPPORT_SFX.values():
            f = getattr(lib, f"s2t2_support_product_{sfx}")
            f.argtypes, f.restype = [p, p, p, i64, i64, i64, i32], i32
            f = getattr(lib, f"s2t2_support_grad_p_{sfx}")
            f.argtypes, f.restype = [p, p, p, p, i64, i64, i64, i32], i32
            f = getattr(lib, f"s2t2_row_nnz_{sfx}")
            f.argtypes, f.restype = [p, p, i64, i64, i32], None
    return lib


#: (P's dtype, M's dtype) the support kernels take: a float32 plan with a float32 or bf16 model, float64 for tests
_SUPPORT_SFX = {(torch.float32, torch.float32): "f32_f32", (torch.float32, torch.bfloat16): "f32_bf16",
                (torch.float64, torch.float64): "f64_f64"}


def support_available() -> bool:
    """True when the support kernels are built (or can be) here."""
    return _support_lib() is not None


def _row_nnz(P: Tensor) -> Optional[Tensor]:
    """The non-zeros of each row of P, by the C kernels (one pass, no v x u temporary), or None without them."""
    sfx = _SUPPORT_SFX.get((P.dtype, P.dtype))
    if sfx is None or not P.is_contiguous() or not support_available():
        return None
    counts = torch.empty(P.shape[0], dtype=torch.int64)
    getattr(_support_lib(), f"s2t2_row_nnz_{sfx}")(ctypes.c_void_p(P.data_ptr()), ctypes.c_void_p(counts.data_ptr()),
                                                  P.shape[0], P.shape[1], torch.get_num_threads())
    return counts


def cpu_route(P: Tensor, M: Tensor) -> Tuple[str, Optional[Tensor]]:
    """The CPU kernel for P^T M: ``("live", rows)``, ``("support", None)`` or ``("dense", None)`` (module
    docstring), from P's non-zeros per row (one pass over P)."""
    kernel = _kernel_setting()
    if kernel == "dense" or P.numel() == 0 or M.shape[1] == 0:
        return "dense", None
    counts = _row_nnz(P) if kernel == "auto" else None
    if counts is None:  # no support kernels: the live rows (P.any: no v x u temporary either) or the GEMMs
        idx = live_rows(P)
        return ("dense", None) if idx is None else ("live", idx)
    v, u = P.shape
    idx = counts.nonzero().squeeze(1)
    nnz = int(counts.sum())
    live_cost = idx.numel() * u if idx.numel() <= DENSE_FRACTION * v else v * u  # (entries of P the GEMMs multiply)
    if (P.dtype, M.dtype) in _SUPPORT_SFX and support_cost(nnz / (v * u), M.shape[1]) * v * u < live_cost:
        return "support", None
    return ("live", idx) if live_cost < v * u else ("dense", None)


def _support_call(name: str, P: Tensor, M: Tensor, *rest: Tensor) -> None:
    fn = getattr(_support_lib(), f"s2t2_support_{name}_{_SUPPORT_SFX[(P.dtype, M.dtype)]}")
    v, u = P.shape
    if fn(*[ctypes.c_void_p(t.data_ptr()) for t in (P, M, *rest)], v, u, M.shape[1], torch.get_num_threads()):
        raise MemoryError(f"translator product: support {name} kernel out of memory")


def _support_product(P: Tensor, M: Tensor) -> Tensor:
    P, M = P.contiguous(), M.contiguous()
    out = P.new_empty((P.shape[1], M.shape[1]))
    _support_call("product", P, M, out)
    return out


def _support_grad_p(P: Tensor, M: Tensor, G: Tensor) -> Tensor:
    P, M, G = P.contiguous(), M.contiguous(), G.to(P.dtype).contiguous()
    dP = torch.empty_like(P)
    _support_call("grad_p", P, M, G, dP)
    return dP


# M may be in another dtype than P (a bf16 model's rows): the kernels cast what they read, so the CPU kernel casts
# only the live rows, not a v x d copy per step

_warned: list = []


def _kernel_setting() -> str:
    """``S2T2_PRODUCT_KERNEL``: "auto" (the module docstring), "dense" (the GEMMs on every device), "live" (on a
    GPU the Triton kernels for every kind; on a CPU the live rows or the GEMMs, never the support kernels)."""
    kernel = os.environ.get("S2T2_PRODUCT_KERNEL", "auto")
    if kernel not in ("auto", "dense", "live"):
        raise ValueError(f"S2T2_PRODUCT_KERNEL: 'auto', 'dense' or 'live', got {kernel!r}")
    return kernel


def _gpu_live(P: Tensor, sparse: bool) -> bool:
    """Whether a non-CPU call takes the Triton live-row kernels."""
    kernel = _kernel_setting()
    return (kernel == "live" or (kernel == "auto" and sparse)) and P.dtype == torch.float32 and _triton.available()


def _gpu_call(live_fn, dense_fn):
    """The Triton kernel, or the dense GEMMs (with one warning) if it cannot be compiled on this device."""
    if not _warned:
        try:
            return live_fn()
        except Exception as e:  # noqa: BLE001 - a Triton compile error on an untested device: the dense form
            _warned.append(e)
            log.warning("translator product: the Triton live-row kernel failed (%s: %s); the dense GEMMs are used "
                        "from now on (S2T2_PRODUCT_KERNEL=dense silences this)", type(e).__name__, e)
    return dense_fn()


def _product_gpu(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    if _gpu_live(P, sparse):
        return _gpu_call(lambda: _triton.live_product(P, M), lambda: P.t() @ M.to(P.dtype))
    return P.t() @ M.to(P.dtype)


def _grad_p_gpu(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    if _gpu_live(P, sparse):
        return _gpu_call(lambda: _triton.live_grad_p(P, M, G), lambda: M.to(P.dtype) @ G.t())
    return M.to(P.dtype) @ G.t()


@torch.library.custom_op("s2t2::plan_product", mutates_args=())
def _product(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    return _product_gpu(P, M, sparse)


@_product.register_kernel("cpu")
def _product_cpu(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    route, idx = cpu_route(P, M)
    if route == "support":  # exact for any kind: the terms it skips are 0
        return _support_product(P, M)
    if route == "live":
        return P.index_select(0, idx).t() @ M.index_select(0, idx).to(P.dtype)
    return P.t() @ M.to(P.dtype)


@_product.register_fake
def _(P: Tensor, M: Tensor, sparse: bool) -> Tensor:
    return P.new_empty((P.shape[1], M.shape[1]))


@torch.library.custom_op("s2t2::plan_product_dp", mutates_args=())
def _grad_p(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    return _grad_p_gpu(P, M, G, sparse)


@_grad_p.register_kernel("cpu")
def _grad_p_cpu(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    route, idx = cpu_route(P, M) if sparse else ("dense", None)
    if route == "support":
        return _support_grad_p(P, M, G)
    if route == "dense":
        return M.to(P.dtype) @ G.t()
    dP = P.new_zeros(P.shape)
    dP.index_copy_(0, idx, M.index_select(0, idx).to(P.dtype) @ G.t())
    return dP


@_grad_p.register_fake
def _(P: Tensor, M: Tensor, G: Tensor, sparse: bool) -> Tensor:
    return P.new_empty(P.shape)


@torch.library.custom_op("s2t2::plan_product_dm", mutates_args=())
def _grad_m(P: Tensor, G: Tensor) -> Tensor:
    return P @ G


@_grad_m.register_kernel("cpu")
def _grad_m_cpu(P: Tensor, G: Tensor) -> Tensor:
    idx = live_rows(P)
    if idx is None:
        return P @ G
    dM = G.new_zeros((P.shape[0], G.shape[1]))  # a dead row of P gives its source row no gradient, exactly
    dM.index_copy_(0, idx, P.index_select(0, idx) @ G)
    return dM


@_grad_m.register_fake
def _(P: Tensor, G: Tensor) -> Tensor:
    return G.new_empty((P.shape[0], G.shape[1]))


class _PlanProduct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, P: Tensor, M: Tensor, sparse: bool) -> Tensor:
        ctx.save_for_backward(P, M)
        ctx.sparse = sparse
        return _product(P, M, sparse)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, G: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], None]:
        P, M = ctx.saved_tensors
        G = G.contiguous()
        dP = _grad_p(P, M, G, ctx.sparse) if ctx.needs_input_grad[0] else None
        dM = _grad_m(P, G).to(M.dtype) if ctx.needs_input_grad[1] else None
        return dP, dM, None


def plan_product(P: Tensor, M: Tensor, sparse: bool = False) -> Tensor:
    """``P.t() @ M`` in P's dtype (P: v x u, M: v x d, cast as read), differentiable in both, by the kernels of the
    module docstring. ``sparse``: P is the sparse kind's plan, mostly dead rows, and its consumer reads dP only on
    P's support, so the live-row kernels may leave the rows of dP where P is all zero at 0."""
    if P.dim() != 2 or M.dim() != 2 or P.shape[0] != M.shape[0]:
        raise ValueError(f"plan_product: need P (v x u) and M (v x d), got {tuple(P.shape)} and {tuple(M.shape)}")
    if P.requires_grad or M.requires_grad:
        return _PlanProduct.apply(P, M, bool(sparse))
    return _product(P, M, bool(sparse))
