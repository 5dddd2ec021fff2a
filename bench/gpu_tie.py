"""The first-use check's float32 near-ties, on a GPU: for each plan, C's gradient over two whole 2-iteration Dykstra
runs (what the check once compared, tie-sensitive) for kernels vs torch steps on the GPU, kernels vs torch steps on
the CPU, and torch steps on the GPU vs on the CPU (no kernel: a nonzero figure there is a tie, not a bug); then the
check's own verdict, each launch judged on identical inputs (s2t2_dist/ot/kernel_check.py), and the route the
product takes at that plan.

    python -m bench.gpu_tie --device cuda --out tie.json
    TRITON_INTERPRET=1 python -m bench.gpu_tie --device cpu --shapes 300x40 --out tie.json   (kernels interpreted)

Plans: the check's plans of v = 50,304 (3,200 x 512), of v = 50,280 (3,176 x 512), of v = 151,936 (2,432 x 512)
and 3,200 x 128. On a CPU without TRITON_INTERPRET=1 the kernels are skipped (said in the JSON). Exit 0 when the
check passes at every plan (or the kernels were skipped), else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from s2t2_dist.api import TorchSteps, dykstra
from s2t2_dist.api import check_problem, launch_findings, verdict

SHAPES = "3200x512,3176x512,2432x512,3200x128"


def whole_run(steps_cls, device: torch.device, v: int, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P and C's gradient of the check's 2-iteration run on ``device`` (returned on the CPU, float64)."""
    C, mu, nu, G = check_problem(device, v, u, torch.float32)
    Cg = C.clone().requires_grad_(True)
    P = dykstra(Cg, steps_cls(mu, nu), 2)
    (P * G).sum().backward()
    return P.detach().double().cpu(), Cg.grad.double().cpu()


def rel(a: tuple, b: tuple) -> dict:
    g = float((a[1] - b[1]).abs().max() / b[1].abs().max())
    off = int(((a[1] - b[1]).abs() > 1e-3 * b[1].abs().max()).sum())
    return {"grad_rel": g, "grad_entries_off": off, "plan_x_v": float((a[0] - b[0]).abs().max()) * a[0].shape[0]}


def one(device: torch.device, v: int, u: int, kernels: bool) -> dict:
    t0 = time.time()
    cpu = torch.device("cpu")
    tc = whole_run(TorchSteps, cpu, v, u)
    out: dict = {"shape": f"{v} x {u}"}
    if device.type == "cuda":
        tg = whole_run(TorchSteps, device, v, u)
        out["torch_gpu_vs_torch_cpu"] = rel(tg, tc)
    if kernels:
        from s2t2_dist.api import TritonSteps
        from s2t2_dist.api import kernels_why_not

        k = whole_run(TritonSteps, device, v, u)
        out["kernels_vs_torch_cpu"] = rel(k, tc)
        if device.type == "cuda":
            out["kernels_vs_torch_gpu"] = rel(k, tg)
        findings = launch_findings(TritonSteps, device, v, u)
        out["check"] = {"verdict": verdict(findings) or "passes",
                        "worst": sorted(([p, val / lim if lim else (0.0 if val == 0 else float("inf"))]
                                         for p, val, lim, _ in findings), key=lambda x: -x[1])[:5]}
        out["route"] = kernels_why_not(device, (v, u)) or "kernels"
    else:
        out["kernels"] = "skipped: no CUDA device and no TRITON_INTERPRET=1"
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default=SHAPES, help="comma list of v x u plans (default: %(default)s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device(args.device)
    kernels = dev.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "plans": []}
    for s in args.shapes.split(","):
        v, u = (int(x) for x in s.lower().split("x"))
        r = one(dev, v, u, kernels)
        res["plans"].append(r)
        print(json.dumps(r), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if all(p.get("check", {}).get("verdict", "passes") == "passes" for p in res["plans"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
