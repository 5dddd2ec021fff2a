"""GPU kernels of the translator's product (translator/product.py): ``P^T M`` and ``M G^T`` on P's live rows only,
without reading anything back to the host, P in any layout
(the Sinkhorn's CUDA route gives it column-major).

The live rows are found on the device: a stable sort of the rows' "has a non-zero" flags puts the live rows first
(``idx``, length v) and their count ``n`` is a device scalar. The Triton kernels read ``n`` themselves: the forward
loops over ``idx[:n]`` in blocks (a loop bounded by a loaded value), the backward launches v / BLOCK_K programs of
which those past ``n`` do nothing. So the work follows the live rows (~320 of 50,280 for the shipped plan) and
the host never waits. fp32 throughout (``input_precision="ieee"``: no TF32, as the translator's fp32 products).

Tested on a CPU by Triton's interpreter (``TRITON_INTERPRET=1``, tests/translator/test_plan_product.py) against the
dense product; the kernels are built on first use, so that the interpreter switch, read when a kernel is defined, can be
set by then. On a GPU: bench/bench_plan_product.py --device cuda (BENCHMARKS.md, "GPU").
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch import Tensor

__all__ = ["available", "live_index", "live_product", "live_grad_p"]

BLOCK_K, BLOCK_U, BLOCK_D = 32, 64, 64
#: 8 warps: with 4, the fp32 (ieee) dots took 249-255 registers on sm_80 and dP spilled 104 bytes; with 8 both fit in
#: at most 117 without spilling, at least 2 programs per SM on sm_80 and sm_90 (bench/kernel_resources.md)
NUM_WARPS = 8


@functools.cache
def available() -> bool:
    """Whether Triton can be imported (it comes with torch's CUDA wheels)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def live_index(P: Tensor) -> tuple[Tensor, Tensor]:
    """(idx, n): P's rows with a non-zero first, in order (int32, length v), and their number (int32, 0-d), on
    P's device, by ops that read nothing back (a stable sort of v flags, a sum)."""
    live = P.any(1)
    idx = torch.sort(live.to(torch.uint8), descending=True, stable=True).indices.to(torch.int32)
    return idx, live.sum(dtype=torch.int32)


@functools.cache
def _kernels(interpret: bool):
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(p_ptr, m_ptr, idx_ptr, n_ptr, out_ptr, U, D, sp_r, sp_c, stride_m, stride_o,
            BK: tl.constexpr, BU: tl.constexpr, BD: tl.constexpr):
        # out[j, c] = sum over live rows r of P[r, j] * M[r, c]: one (BU x BD) tile of out per program
        j = (tl.program_id(0) * BU + tl.arange(0, BU)).to(tl.int64)  # (j * v: column-major P past 2**31)
        c = tl.program_id(1) * BD + tl.arange(0, BD)
        n = tl.load(n_ptr)
        acc = tl.zeros((BU, BD), dtype=tl.float32)
        for k0 in range(0, n, BK):
            kk = k0 + tl.arange(0, BK)
            rows = tl.load(idx_ptr + kk, mask=kk < n, other=0).to(tl.int64)
            ok = kk < n
            p = tl.load(p_ptr + rows[:, None] * sp_r + j[None, :] * sp_c, mask=ok[:, None] & (j[None, :] < U),
                        other=0.0)
            m = tl.load(m_ptr + rows[:, None] * stride_m + c[None, :], mask=ok[:, None] & (c[None, :] < D), other=0.0)
            acc += tl.dot(tl.trans(p.to(tl.float32)), m.to(tl.float32), input_precision="ieee")
        tl.store(out_ptr + j[:, None] * stride_o + c[None, :], acc, mask=(j[:, None] < U) & (c[None, :] < D))

    @triton.jit
    def grad_p(m_ptr, g_ptr, idx_ptr, n_ptr, dp_ptr, U, D, stride_m, stride_g, sd_r, sd_c,
               BK: tl.constexpr, BU: tl.constexpr, BD: tl.constexpr):
        # dP[r, j] = sum_c M[r, c] * G[j, c] for the live rows r of this program's block (the rest return at once)
        k0 = tl.program_id(0) * BK
        n = tl.load(n_ptr)
        if k0 < n:  # (a program past the live rows does nothing)
            kk = k0 + tl.arange(0, BK)
            ok = kk < n
            rows = tl.load(idx_ptr + kk, mask=ok, other=0).to(tl.int64)
            j = (tl.program_id(1) * BU + tl.arange(0, BU)).to(tl.int64)
            acc = tl.zeros((BK, BU), dtype=tl.float32)
            for c0 in range(0, D, BD):
                c = c0 + tl.arange(0, BD)
                m = tl.load(m_ptr + rows[:, None] * stride_m + c[None, :], mask=ok[:, None] & (c[None, :] < D),
                            other=0.0)
                g = tl.load(g_ptr + j[:, None] * stride_g + c[None, :], mask=(j[:, None] < U) & (c[None, :] < D),
                            other=0.0)
                acc += tl.dot(m.to(tl.float32), tl.trans(g.to(tl.float32)), input_precision="ieee")
            tl.store(dp_ptr + rows[:, None] * sd_r + j[None, :] * sd_c, acc, mask=ok[:, None] & (j[None, :] < U))

    return fwd, grad_p


def kernels():
    """The product's two kernels (forward, dP) as built for this process (Triton's interpreter or not)."""
    import os

    return _kernels(os.environ.get("TRITON_INTERPRET", "0") == "1")


#: the kernels launched within kernels_as() (None: the module's own)
_replaced: list = [None]


def _get():
    return _replaced[0] if _replaced[0] is not None else kernels()


@contextlib.contextmanager
def kernels_as(fwd, grad_p):
    """Within: live_product and live_grad_p launch ``fwd`` and ``grad_p`` in place of the kernels, with the same
    grids and arguments (bench/kernel_resources.py records every launch this way)."""
    _replaced[0] = (fwd, grad_p)
    try:
        yield
    finally:
        _replaced[0] = None


def live_product(P: Tensor, M: Tensor) -> Tensor:
    """``P.t() @ M`` over P's live rows (u x d, float32; P float32 in any layout, M any float dtype)."""
    import triton

    M = M.contiguous()
    v, u = P.shape
    d = M.shape[1]
    idx, n = live_index(P)
    out = torch.empty((u, d), dtype=torch.float32, device=P.device)
    fwd, _ = _get()
    fwd[(triton.cdiv(u, BLOCK_U), triton.cdiv(d, BLOCK_D))](
        P, M, idx, n, out, u, d, P.stride(0), P.stride(1), M.stride(0), out.stride(0),
        BK=BLOCK_K, BU=BLOCK_U, BD=BLOCK_D, num_warps=NUM_WARPS)
    return out


def live_grad_p(P: Tensor, M: Tensor, G: Tensor) -> Tensor:
    """dP (v x u, float32, P's layout): ``M G^T`` on P's live rows, 0 on the others."""
    import triton

    M, G = M.contiguous(), G.contiguous()
    v, u = P.shape
    d = M.shape[1]
    idx, n = live_index(P)
    dP = torch.zeros_like(P, dtype=torch.float32)  # (P's strides: the Sinkhorn's backward reads them)
    _, grad_p = _get()
    grad_p[(triton.cdiv(v, BLOCK_K), triton.cdiv(u, BLOCK_U))](
        M, G, idx, n, dP, u, d, M.stride(0), G.stride(0), dP.stride(0), dP.stride(1),
        BK=BLOCK_K, BU=BLOCK_U, BD=BLOCK_D, num_warps=NUM_WARPS)
    return dP
