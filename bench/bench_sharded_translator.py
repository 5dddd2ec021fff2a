"""Per-rank memory and communication of the column-sharded TokenTranslator (gloo, CPU).

    PYTHONPATH=. python -m bench.bench_sharded_translator --ranks 1,2,4 --u 4096

Each rank runs two AdamW training steps of the translator alone (C moved to 1/v + N(0, 1e-3); loss = sum(E'^2)
with a frozen E of width ``--d`` (tied: L = E); the real LM is left out). Measured on the second step:

* peak translator memory per rank: kernel peak RSS (VmHWM, reset through /proc/self/clear_refs right before the
  step) minus the RSS before the translator was built (E already allocated). It covers C, its gradient, the two
  AdamW moments, P, the Sinkhorn workspace and E'/L'. Also the persistent part after the step (C + AdamW state).
* bytes SENT per rank (ring model, see s2t2_dist/distributed/sharded_sinkhorn.py): by the Sinkhorn per Dykstra iteration
  (forward and backward separately), and by the gathers of E'/L' (+ their backward), vs ``v*u*4`` (all of C);
* step time (only meaningful while ranks <= cores; this machine has 2).
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.helpers.distributed import run_distributed
def _status(key):
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def worker(v, u, d, n_iter):
    from s2t2_dist.api import TokenTranslator

    R = dist.get_world_size()
    rank = dist.get_rank()
    import gc

    def build(vv, uu, EE):
        tr = TokenTranslator(vv, uu, group=dist.group.WORLD if R > 1 else None)
        with torch.no_grad():
            tr.C.add_(torch.empty_like(tr.C).normal_(0, 1e-3, generator=torch.Generator().manual_seed(1 + rank)))
        opt = torch.optim.AdamW(tr.parameters(), lr=1e-3, weight_decay=0.0)

        def step():
            Ep, Lp = tr.embed_and_head(EE, EE)
            loss = Ep.square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return tr, opt, step

    # warm-up on a small problem first: the code pages of every operator used are loaded then, not counted below
    small = build(2000, 64 * R, torch.randn(2000, d))
    small[2]()
    small[2]()
    del small
    E = torch.empty(v, d).normal_(generator=torch.Generator().manual_seed(0))
    gc.collect()
    dist.barrier()
    base = _status("VmRSS")
    tr, opt, step = build(v, u, E)
    step()
    gc.collect()
    solver = tr.plan_kind.solver()
    if R == 1:  # single process: nothing is sent
        from s2t2_dist.api import CommStats

        solver.stats = CommStats()
    solver.stats.reset()
    tr.comm().stats.reset()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    # forward and backward bytes of the Sinkhorn separately
    Ep, Lp = tr.embed_and_head(E, E)
    fwd_bytes = solver.stats.bytes_sent  # the gathers of E'/L' are counted by tr.comm(), not here
    Ep.square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    del Ep, Lp
    peak = _status("VmHWM") - base
    gc.collect()
    persistent = _status("VmRSS") - base
    return {
        "rank": rank, "cols": tr.C.shape[1], "peak": peak, "persistent": persistent,
        "C_local_bytes": tr.C.numel() * 4, "sinkhorn_fwd_bytes": fwd_bytes,
        "sinkhorn_bwd_bytes": solver.stats.bytes_sent - fwd_bytes, "gather_bytes": tr.comm().stats.bytes_sent,
        "step_s": dt, "n_iter": n_iter, "row_stats": dict(getattr(solver.rows, "stats", {})),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=int, default=50304)
    ap.add_argument("--u", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    v, u = args.v, args.u
    full = v * u * 4
    print(f"# sharded TokenTranslator: v={v} u={u} d={args.d} float32, {args.iters} Dykstra iterations, gloo on CPU; "
          f"all of C = {full / 2**20:.0f} MiB")
    out = []
    for R in [int(r) for r in args.ranks.split(",")]:
        for method in ("transpose",):  # (the sharded rows' one method: all_to_all, local thresholds, all_gather)
            res = run_distributed(worker, R, v, u, args.d, args.iters, timeout=1800, num_threads=max(1, 2 // R))
            r0 = max(res, key=lambda r: r["peak"])
            it = args.iters
            line = (f"- R={R} {method:9s}: peak translator memory per rank (max over ranks) "
                    f"{r0['peak'] / 2**20:.0f} MiB = {r0['peak'] / full:.2f} x all of C "
                    f"({r0['peak'] / r0['C_local_bytes']:.2f} x its shard); persistent (C + AdamW) "
                    f"{r0['persistent'] / 2**20:.0f} MiB; Sinkhorn bytes sent per iteration per rank: fwd "
                    f"{res[0]['sinkhorn_fwd_bytes'] / it / 2**20:.2f} MiB, bwd {res[0]['sinkhorn_bwd_bytes'] / it / 2**20:.2f}"
                    f" MiB ({(res[0]['sinkhorn_fwd_bytes'] + res[0]['sinkhorn_bwd_bytes']) / it / full:.4f} x v*u*4); "
                    f"E'/L' gather fwd+bwd {res[0]['gather_bytes'] / 2**20:.2f} MiB; step {max(r['step_s'] for r in res):.1f} s")
            print(line, flush=True)
            out.append({"R": R, "method": method, "ranks": res})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
