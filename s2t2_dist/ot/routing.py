"""The sparse Sinkhorn's route per device: the Triton kernels on CUDA once they pass their first-use check
(:mod:`s2t2_dist.ot.kernel_check`, once per tiling), else the torch steps of :mod:`s2t2_dist.ot.dykstra`.

The layers of ``ot/``, bottom up: the projection primitives and the algorithm (``dykstra``), the check of a
candidate's launches against them (``kernel_check``), then this choice of steps per device. Nothing here imports
the rest of the package: the choice is told to the caller (``on_route``), which records it.
"""
from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

from .dykstra import TorchSteps, compute_dtype
from .kernel_check import launch_findings, verdict

log = logging.getLogger(__name__)

__all__ = ["check_shape", "kernel_device", "kernels_ok", "kernels_why_not", "steps_for"]


def check_shape(n: int) -> int:
    """A side of the first-use check's plan that the kernels tile as they tile a side of ``n``: ``n`` itself up to
    two column chunks, else one chunk plus ``n``'s last partial chunk (the same streamed path, the same remainder
    and divisibility by 16, which Triton specialises on)."""
    from .dykstra_triton import BLOCK_N

    if n <= 2 * BLOCK_N:
        return n
    return BLOCK_N + (n % BLOCK_N or BLOCK_N)


@functools.cache
def _first_use_check(device: torch.device, v: int, u: int, dtype: torch.dtype) -> str:
    """'' when the kernels pass on a v x u plan of ``dtype`` on ``device``, else why not (and one warning)."""
    try:
        # whatever the caller's mode: stage 1's first plan is taken under no_grad, and the check runs a backward
        from .dykstra_triton import TritonSteps

        with torch.inference_mode(False), torch.no_grad():
            reason = verdict(launch_findings(TritonSteps, device, v, u, dtype))
        if not reason:
            return ""
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile on this device: the torch steps instead
        reason = f"{type(e).__name__}: {e}"
    reason = f"failed their first-use check at {v} x {u} {str(dtype).removeprefix('torch.')}: {reason}"
    log.warning("sparse Sinkhorn: the Triton kernels %s on %s; the torch steps are used there instead (exact, "
                "slower: a host read per Newton step)", reason, device)
    return reason


def kernels_why_not(device: torch.device, shape: tuple[int, int] = (5000, 4), dtype: torch.dtype = torch.float32
                    ) -> str:
    """'' when the kernels serve a ``shape`` plan (v, u) of ``dtype`` on ``device``, else why not. Checked once per
    tiling (:func:`check_shape`): each launch of the kernels against the torch steps' on identical inputs
    (:mod:`s2t2_dist.ot.kernel_check`: a near-tie of float32 sums is accepted, a wrong kernel is not), on a plan of
    at most two column chunks a side that takes every launch the route makes at ``shape`` (the same block sizes and
    specialisations), forward and backward, whatever the caller's grad or inference mode. On failure (one warning)
    the route falls back to the torch steps rather than stopping a run."""
    v, u = shape
    return _first_use_check(torch.device(device), check_shape(v), check_shape(u), dtype)


def kernels_ok(device: torch.device, shape: tuple[int, int] = (5000, 4), dtype: torch.dtype = torch.float32) -> bool:
    """Whether the kernels passed their first-use check for this shape (:func:`kernels_why_not`)."""
    return not kernels_why_not(device, shape, dtype)


kernels_ok.cache_clear = _first_use_check.cache_clear  # (tests: a fresh check)


def kernel_device(device: torch.device) -> bool:
    """Whether ``device`` takes the Triton kernels: CUDA (the tests also route a CPU through Triton's interpreter)."""
    return device.type == "cuda"


def steps_for(device: torch.device, mu: Tensor, nu: Tensor, shapes: tuple[tuple[int, int], ...] = (),
              on_route=None):
    """The route of ``device``: the Triton kernels on CUDA, the torch steps on a CPU. ``shapes``: every (v, u)
    whose slices the steps will project (a plan's, and the sharded rows'); the kernels serve them only when each
    passed the first-use check (:func:`kernels_why_not`), else one warning and the torch steps (exact too, with a
    host read per Newton step). ``on_route(op, device, route, why, fallback=...)``: told the choice (the caller
    records it: ``s2t2_dist.utils.routes.record``)."""
    def said(route: str, why: str, fallback: bool = False) -> None:
        if on_route is not None:
            on_route("sinkhorn", device, route, why, fallback=fallback)

    if kernel_device(device):
        from .dykstra_triton import TritonSteps

        shapes = shapes or ((mu.numel(), nu.numel()),)
        why = next((w for w in (kernels_why_not(device, s, compute_dtype(mu.dtype)) for s in shapes) if w), "")
        if why:
            said("torch steps", f"the Triton kernels {why}", fallback=True)
            return TorchSteps(mu, nu)
        said("kernels", "Triton; passed the first-use check for " + ", ".join(f"{v} x {u}" for v, u in shapes))
        return TritonSteps(mu, nu)
    if device.type != "cpu":
        raise ValueError(f"the sparse Sinkhorn runs on a CPU or a CUDA device, not on {device.type!r}")
    said("torch steps", "a CPU device (the kernels are CUDA's)")
    return TorchSteps(mu, nu)
