"""Benchmark of the sparse Sinkhorn (forward + backward, 3 Dykstra iterations) on one device, against the simplest
exact code and the memory floor, measured in the same run.

    PYTHONPATH=. python -m bench.bench_sinkhorn --device cuda            # 50,304 x 512 fp32 on the first GPU
    PYTHONPATH=. python -m bench.bench_sinkhorn --v 4096 --u 512         # CPU (the torch route), a smaller plan
    PYTHONPATH=. python -m bench.bench_sinkhorn --device cuda --start uniform --out sinkhorn.json

What it prints (and writes with ``--out``):

* the route's forward and forward + backward time (the minimum and the median of ``--reps`` after a warm-up;
  on CUDA between synchronize calls): the Triton kernels on CUDA, the torch steps elsewhere
  (``s2t2_dist.ot.routing.steps_for``);
* the reference in the same run: the sort-based scaled sparsemax differentiated by autograd (the 15 lines of
  ``../shared/gpu/ref_sinkhorn.py``), and its largest difference from the route in P and in C's gradient; then
  both gradients against that reference in float64 (on near-tied starts, float32 rounding decides supports);
* the memory floor: the time of one copy of C on the device (9 such transfers: read C, the 3 x 2 projections'
  passes of a perfect kernel, and the gradient);
* the kernels a CUDA forward + backward launches (aten ops on the CUDA route + Triton launches): counted on the
  GPU when there is one, else by running the CUDA route's code on the CPU with its launches recorded and not run
  (``dykstra_triton.dry_run``: the route reads nothing back, so its launches do not depend on the data);
* host reads in a forward + backward (``utils.syncs``; on CUDA also a run under ``set_sync_debug_mode("error")``).

``--start``: ``moved`` (C = 1/v + 1e-3/v noise, as ref_sinkhorn.py), ``uniform`` (the paper's init: every entry tied,
full supports), ``sparse`` (C = 1/v + noise of 1/v: supports of a few entries).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from s2t2_dist.api import dykstra_triton
from s2t2_dist.api import dykstra
from s2t2_dist.api import steps_for
from s2t2_dist.api import TritonSteps, dry_run
from s2t2_dist.api import count_host_syncs


def sort_sparsemax(z, s, dim):
    """The 15-line reference's projection (../shared/gpu/ref_sinkhorn.py): sort, cumsum, support size, threshold."""
    z = z.transpose(dim, -1)
    s = s.reshape(*z.shape[:-1], 1)
    zs, _ = torch.sort(z, dim=-1, descending=True)
    cs = zs.cumsum(-1)
    k = torch.arange(1, z.shape[-1] + 1, dtype=z.dtype, device=z.device)
    kz = (s + k * zs > cs).sum(-1, keepdim=True)
    tau = (cs.gather(-1, kz - 1) - s) / kz
    return torch.clamp(z - tau, min=0).transpose(dim, -1)


def reference(C, mu, nu, n=3):
    X, P, Q = C, torch.zeros_like(C), torch.zeros_like(C)
    for _ in range(n):
        Y = sort_sparsemax(X + P, mu, 1)
        P = X + P - Y
        Xn = sort_sparsemax(Y + Q, nu, 0)
        Q = Y + Q - Xn
        X = Xn
    return X


def start(kind: str, v: int, u: int, dev) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    noise = {"moved": 1e-3, "uniform": 0.0, "sparse": 1.0}[kind]
    return (torch.full((v, u), 1.0 / v) + torch.randn(v, u, generator=g) * noise / v).to(dev)


def timed(fn, dev, reps: int):
    """(min, median) seconds of ``fn()`` over ``reps`` runs after one warm-up."""
    def one():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    one()
    ts = [one() for _ in range(reps)]
    return min(ts), statistics.median(ts)


def kernel_count(v: int, u: int, dev, n_iter: int):
    """(aten ops, Triton launches, host reads) of one CUDA-route forward + backward at v x u."""
    mu, nu = torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u)
    C = torch.full((v, u), 1.0 / v)
    if dev.type == "cuda":
        C, mu, nu = C.to(dev), mu.to(dev), nu.to(dev)
    Cg = C.requires_grad_(True)
    before = dykstra_triton.launches[0]
    with count_host_syncs() as c:
        if dev.type == "cuda":
            dykstra(Cg, TritonSteps(mu, nu), n_iter).backward(torch.ones_like(C))
        else:
            with dry_run():
                dykstra(Cg, TritonSteps(mu, nu), n_iter).backward(torch.ones_like(C))
    return c.ops, dykstra_triton.launches[0] - before, c.total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--v", type=int, default=50304)
    ap.add_argument("--u", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--start", default="moved", choices=["moved", "uniform", "sparse"])
    ap.add_argument("--no-reference", action="store_true", help="skip the sort reference (slow on a CPU)")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_sinkhorn: --device cuda, but torch sees no CUDA device here")
    v, u, n = args.v, args.u, args.iters
    C0 = start(args.start, v, u, dev)
    mu, nu = torch.full((v,), 1.0 / v, device=dev), torch.full((u,), 1.0 / u, device=dev)
    G = torch.randn(v, u, generator=torch.Generator().manual_seed(1)).to(dev)
    from s2t2_dist.api import record, summary

    steps = steps_for(dev, mu, nu, on_route=record)
    name = type(steps).__name__
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"sparse Sinkhorn {v} x {u} fp32, {n} iterations, start {args.start}, {where}; route {name}", flush=True)

    res = {"v": v, "u": u, "iters": n, "start": args.start, "device": where, "route": name, "routes": summary()}

    def route(grad: bool):
        C = C0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            P = dykstra(C, steps, n)
            if grad:
                (P * G).sum().backward()
        return P, C.grad

    res["fwd_s"] = timed(lambda: route(False), dev, args.reps)
    res["fwd_bwd_s"] = timed(lambda: route(True), dev, args.reps)
    P, g = route(True)
    res["density"] = float((P != 0).float().mean())
    res["copy_s"] = timed(lambda: C0.clone(), dev, args.reps)
    print(f"route: forward {1e3 * res['fwd_s'][0]:.2f} ms, forward + backward {1e3 * res['fwd_bwd_s'][0]:.2f} ms "
          f"(median {1e3 * res['fwd_bwd_s'][1]:.2f}); P {100 * res['density']:.2f}% non-zero; one copy of C "
          f"{1e3 * res['copy_s'][0]:.3f} ms, so 9 transfers {9e3 * res['copy_s'][0]:.2f} ms "
          f"({res['fwd_bwd_s'][0] / (9 * res['copy_s'][0]):.1f} x the floor)", flush=True)
    if not args.no_reference:
        def ref(grad: bool):
            C = C0.clone().requires_grad_(grad)
            with torch.set_grad_enabled(grad):
                Pr = reference(C, mu, nu, n)
                if grad:
                    (Pr * G).sum().backward()
            return Pr, C.grad

        res["ref_fwd_bwd_s"] = timed(lambda: ref(True), dev, max(2, args.reps // 2))
        Pr, gr = ref(True)
        res["max_diff_P"] = float((P - Pr).detach().abs().max())
        res["max_diff_grad"] = float((g - gr).abs().max())
        res["max_grad"] = float(gr.abs().max())
        print(f"sort reference (autograd): forward + backward {1e3 * res['ref_fwd_bwd_s'][0]:.2f} ms "
              f"({res['ref_fwd_bwd_s'][0] / res['fwd_bwd_s'][0]:.1f} x the route); largest difference P "
              f"{res['max_diff_P']:.2e}, C's gradient {res['max_diff_grad']:.2e} (of {res['max_grad']:.2e})",
              flush=True)
        # the arbiter: the sort reference in float64. Near-tied entries (--start moved: all within 1e-3 of each
        # other) fall on either side of a threshold by float32 rounding, in the route and the fp32 reference
        # alike, and each flip moves that entry's gradient by O(|g|): the largest difference above says little
        C64 = C0.double().requires_grad_(True)
        (reference(C64, mu.double(), nu.double(), n) * G.double()).sum().backward()
        g64 = C64.grad

        def rel(x):
            return float((x.double() - g64).norm() / g64.norm())

        res["grad_rel_err_fp64"] = {"route": rel(g), "sort_fp32": rel(gr)}
        print(f"against the sort reference in float64, C's gradient off by {100 * rel(g):.3g}% (route) and "
              f"{100 * rel(gr):.3g}% (the sort reference in float32), relative Frobenius norm", flush=True)
    Cs = C0.clone().requires_grad_(True)
    with count_host_syncs() as c:
        dykstra(Cs, steps, n).backward(G)
    res["host_syncs"] = c.total
    if dev.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            route(True)
            res["sync_debug"] = "none"
        except RuntimeError as e:
            res["sync_debug"] = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    ops, launches, syncs = kernel_count(v, u, dev, n)
    res["cuda_kernels"] = {"aten_ops": ops, "triton_launches": launches, "total": ops + launches,
                           "host_syncs": syncs, "how": "on the GPU" if dev.type == "cuda" else
                           "the CUDA route's code on the CPU, launches recorded not run"}
    print(f"host reads in a forward + backward: {res['host_syncs']}"
          + (f" (set_sync_debug_mode: {res['sync_debug']})" if "sync_debug" in res else ""))
    print(f"CUDA route, forward + backward at {v} x {u}: {launches} Triton launches + {ops} aten ops = {ops + launches}"
          f" kernels at most ({res['cuda_kernels']['how']}); host reads {syncs}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
