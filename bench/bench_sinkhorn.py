"""Benchmark of the fused sparse Sinkhorn at OLMo shapes (CPU), against autograd through a sort-based sparsemax.

    PYTHONPATH=. python bench/bench_sinkhorn.py --u 512
    PYTHONPATH=. python bench/bench_sinkhorn.py --u 4096 --naive-rows 6288
    PYTHONPATH=. python bench/bench_sinkhorn.py --fused true --compare-eager   # compiled kernels vs the eager ops
    PYTHONPATH=. python bench/bench_sinkhorn.py --moving 8                   # warm starts along a moving C
    PYTHONPATH=. python bench/bench_sinkhorn.py --device cuda --skip-memory  # on a GPU (#21 item 4's GPU half)

Per state of C ("init": every entry 1/v, the paper's initialisation, all ties; "moved": 1/v + N(0, 1e-3)):

* time of forward and backward (3 Dykstra iterations, float32), best of ``--repeats``: "cold" = a fresh solver each
  call, "warm" = a persistent solver (as the TokenTranslator uses from one training step to the next; its
  thresholds start cold unless ``--warm N`` sets its projectors' ``warm_iters``: then each projection starts
  from its thresholds of the previous call, ``DEFAULT_WARM_ITERS`` Newton passes after one pass there; the pass
  count is fixed, so the time does not depend on how good the start is);
* the naive reference in the same run: autograd through a sort-based scaled sparsemax (torch.sort + cumsum),
  measured once; with ``--naive-rows R`` on the first R rows only and scaled by v/R (its column sorts are then
  shorter, so the scaled figure UNDERestimates the naive time: the speed-up is conservative);
* a memory-traffic floor: the bytes ANY exact fwd + bwd must move, over the copy bandwidth of this box measured in
  the same run. ``t_copy`` = best time of ``B.copy_(C)`` into an existing buffer (STREAM "copy": reads and writes
  C, so ``bandwidth = 2 * bytes(C) / t_copy``). Bytes: each of the 2 * n_iter projections reads its whole input
  once, the forward writes P once, the backward reads the upstream gradient once and writes dC once, i.e.
  ``2 * n_iter + 3`` C-sized transfers (9 for n_iter = 3): ``floor = (2 n_iter + 3) * bytes(C) / bandwidth =
  (2 n_iter + 3) / 2 * t_copy``. (Before issue 21 every transfer was charged a whole copy, a floor 2x higher:
  ``x_copy`` ratios below use that older definition, for comparison with earlier tables.);
* ``--fused``: the solver's pass kernels (``auto``: compiled on CPU for large C, see ``s2t2_dist/ot/fused.py``);
  the first call of the process includes compiling them (reported). ``--compare-eager``: the eager ops (fused
  off, the implementation on main before issue 21 session 5) measured warm in the same run, paired ratio;
* host syncs per fwd + bwd (``s2t2_dist.utils.syncs``, warm solver) and the slices whose threshold the fixed
  Newton passes left unproven (``SparseSinkhorn.unproven``);
* peak extra memory of one forward + backward, in a child process: the kernel's peak RSS (VmHWM, reset through
  /proc/self/clear_refs just before the call) minus the RSS before it, with C and the upstream gradient already
  allocated. It includes the result P and dC (2 x C by themselves) and the solver's reused scratch buffers (resident
  between calls; allocated by a warm-up call).

``--moving K`` instead measures what the warm starts cost in exactness: K training-like steps (every entry of C
moves by ``lr`` in an Adam-like direction, ``lr * v`` = 0.025, the recommended rate, and 2.5, 100 x that) for
several ``warm_iters`` (0: always cold); per step, the slices whose threshold the fixed passes and the fallback
left unproven, and the time of the step's forward + backward.

``--device cuda``: the same on a GPU (every timing between ``torch.cuda.synchronize`` calls; the copy is a
device-to-device copy). It adds what #21 item 4 asks for a GPU: the achieved bandwidth (the 2 n_iter + 3 C-sized
transfers of the floor over the warm fwd + bwd time) against the measured copy bandwidth and the card's datasheet
peak, one warm fwd + bwd under ``torch.cuda.set_sync_debug_mode("error")``, and the peak of
``torch.cuda.max_memory_allocated`` instead of the child process's RSS. ``--fused true`` on a GPU compiles the same
pass kernels to Triton (inductor); ``auto`` keeps the eager ops there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

from s2t2_dist.ot.sinkhorn import SparseSinkhorn, dykstra
from s2t2_dist.utils.syncs import count_host_syncs

#: ``--fused`` -> the solver's ``fused`` argument
FUSED = {"auto": "auto", "true": True, "false": False, "native": "native"}
#: the device measured (``--device``); every timing waits for it
DEV = torch.device("cpu")
#: datasheet memory bandwidth (B/s) by device-name substring, first match wins
PEAK_HBM = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100", 2.0e12), ("L40S", 0.864e12),
            ("L4", 0.3e12), ("A10", 0.6e12), ("V100", 0.9e12)]


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize(DEV)


def peak_bandwidth():
    """(datasheet bytes/s or None, device name)."""
    if DEV.type != "cuda":
        return None, "cpu"
    name = torch.cuda.get_device_name(DEV)
    return next((bw for k, bw in PEAK_HBM if k in name), None), name


def naive_sparsemax(Z: torch.Tensor, scale: torch.Tensor, dim: int) -> torch.Tensor:
    """Scaled sparsemax by a full sort, differentiated by autograd (the reference the targets compare with)."""
    Zm = Z.movedim(dim, -1)
    zs = Zm.sort(-1, descending=True).values
    cs = zs.cumsum(-1)
    j = torch.arange(1, Zm.shape[-1] + 1, dtype=Z.dtype, device=Z.device)
    tau = ((cs - scale.unsqueeze(-1)) / j).amax(-1, keepdim=True)
    return (Zm - tau).clamp(min=0).movedim(-1, dim)


def naive_sinkhorn(C, mu, nu, n_iter):
    return dykstra(C, lambda Z: naive_sparsemax(Z, mu, 1), lambda Z: naive_sparsemax(Z, nu, 0), n_iter)


def make_C(v, u, state, seed=0):
    C = torch.empty(v, u)
    if state == "init":
        C.fill_(1.0 / v)
    else:
        C.normal_(1.0 / v, 1e-3, generator=torch.Generator().manual_seed(seed))
    return C.to(DEV)


def randn(v, u, g):
    """N(0, 1) of shape (v, u) on DEV, drawn on the CPU (the same numbers on every device)."""
    return torch.empty(v, u).normal_(generator=g).to(DEV)


def best(fn, repeats):
    ts = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def fwd_bwd(solver_fn, C, G):
    Cg = C.detach().requires_grad_(True)
    _sync()
    t0 = time.perf_counter()
    P = solver_fn(Cg)
    _sync()
    t1 = time.perf_counter()
    P.backward(G)
    _sync()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, P, Cg.grad


def gpu_memory(solver_fn, C, G):
    """Peak extra device memory of one warm fwd + bwd (CUDA's allocator statistics; C and G already allocated)."""
    fwd_bwd(solver_fn, C, G)
    _sync()
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    fwd_bwd(solver_fn, C, G)
    return {"extra_bytes": torch.cuda.max_memory_allocated(DEV) - base, "scratch_bytes": 0,
            "C_bytes": C.numel() * C.element_size()}


def gpu_sync_debug(solver_fn, C, G):
    """One warm fwd + bwd under ``torch.cuda.set_sync_debug_mode("error")``: "none", or the first sync's error."""
    fwd_bwd(solver_fn, C, G)
    torch.cuda.set_sync_debug_mode("error")
    try:
        fwd_bwd(solver_fn, C, G)
        return "none"
    except RuntimeError as e:
        return f"sync: {str(e).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _status(key):
    return int(re.search(rf"{key}:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024


def memory_child(args):
    v, u = args.v, args.u
    torch.manual_seed(0)
    C = make_C(v, u, args.state)
    G = torch.empty(v, u).normal_(generator=torch.Generator().manual_seed(1))
    mu, nu = torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u)
    if args.impl == "naive":
        rows = args.naive_rows or v
        C, G, mu = C[:rows].clone(), G[:rows].clone(), torch.full((rows,), 1.0 / rows)
        fn = lambda c: naive_sinkhorn(c, mu, nu, args.iters)  # noqa: E731 - a one-line closure
    else:
        solver = SparseSinkhorn(mu, nu, fused=FUSED[args.fused])
        fn = lambda c: solver(c, args.iters)  # noqa: E731 - a one-line closure
        fwd_bwd(fn, C, G)  # warm the solver; the measured call is a steady-state training step
    import gc

    gc.collect()
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fwd_bwd(fn, C, G)
    peak = _status("VmHWM")
    # the solver's reused scratch buffers were allocated by the warm-up call: resident between calls, so counted
    # here as well (a training step sees them on top of the peak above)
    scratch = getattr(locals().get("solver"), "scratch", None)
    sb = sum(b.numel() * b.element_size() for b in scratch._bufs.values()) if scratch is not None else 0
    print(json.dumps({"extra_bytes": peak - base + sb, "scratch_bytes": sb, "C_bytes": C.numel() * 4}))


def run_memory(args, impl, state):
    cmd = [sys.executable, __file__, "--child-memory", "--impl", impl, "--state", state, "--fused", args.fused,
           "--threads", str(args.threads), "--v", str(args.v),
           "--u", str(args.u), "--iters", str(args.iters), "--naive-rows", str(args.naive_rows or 0)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=int, default=50304)
    ap.add_argument("--u", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--states", default="init,moved")
    ap.add_argument("--naive-rows", type=int, default=0, help="naive reference on the first R rows, scaled by v/R")
    ap.add_argument("--skip-naive", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--newton", type=int, default=0, help="Newton passes per projection (0: the default)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--fused", default="auto", choices=["auto", "true", "false", "native"],
                    help="the solver's kernels (auto: the C kernels on CPU, see s2t2_dist/ot/native.py; true: the "
                         "compiled per-pass kernels; false: the eager ops)")
    ap.add_argument("--compare-eager", action="store_true", help="also time the eager ops (fused off), warm")
    ap.add_argument("--compare-compiled", action="store_true",
                    help="also time the compiled per-pass kernels (--fused true), warm, paired")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where C lives (cuda: the first GPU)")
    ap.add_argument("--moving", type=int, default=0, help="K: warm starts along K moving steps (see the docstring)")
    ap.add_argument("--warm-iters", default="0,2,3,4", help="--moving: the columns' warm_iters compared (0: cold)")
    ap.add_argument("--warm", type=int, default=0,
                    help="warm_iters of both projections (0: cold starts, as shipped; 4: the option measured)")
    ap.add_argument("--row-warm-iters", type=int, default=0,
                    help="--moving: the rows' warm_iters (default 0: cold, as shipped)")
    ap.add_argument("--child-memory", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="fused", help=argparse.SUPPRESS)
    ap.add_argument("--state", default="moved", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEV
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_sinkhorn.py: --device cuda: no CUDA device here", file=sys.stderr)
            sys.exit(2)
        DEV = torch.device("cuda", torch.cuda.current_device())
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child_memory:
        return memory_child(args)
    if args.moving:
        return run_moving(args)
    v, u, n = args.v, args.u, args.iters
    peak_bw, dev_name = peak_bandwidth()
    print(f"# sparse Sinkhorn benchmark: C = {v} x {u} float32, {n} Dykstra iterations, torch {torch.__version__}, "
          f"{dev_name}" + (f" (datasheet {peak_bw / 1e12:.2f} TB/s)" if peak_bw else "")
          + ("" if DEV.type == "cuda" else f", {torch.get_num_threads()} threads"))
    mu, nu = torch.full((v,), 1.0 / v, device=DEV), torch.full((u,), 1.0 / u, device=DEV)
    results = {"v": v, "u": u, "iters": n, "threads": torch.get_num_threads(), "device": dev_name,
               "peak_bandwidth": peak_bw, "warm_iters": args.warm, "states": {}}
    passes = 2 * n + 3
    kw = {} if not args.newton else {"iters": args.newton}
    fused = FUSED[args.fused]

    def make_solver(fused=fused):
        s_ = SparseSinkhorn(mu, nu, fused=fused)
        for p in (s_.rows, s_.cols):
            p.iters = kw.get("iters", p.iters)
            p.warm_iters = args.warm
        return s_
    for state in args.states.split(","):
        C = make_C(v, u, state)
        G = randn(v, u, torch.Generator().manual_seed(1))
        B = torch.empty_like(C)

        def paired(fn):
            """fwd, bwd and the copy time measured right before and after (the machine's load drifts)."""
            c1 = best(lambda: B.copy_(C), 3)
            f, b = fwd_bwd(fn, C, G)[:2]
            c2 = best(lambda: B.copy_(C), 3)
            return f, b, min(c1, c2)

        r = {}
        t0 = time.perf_counter()
        fwd_bwd(lambda c: make_solver()(c, n), C, G)  # compiles the kernels once per process (and shape)
        r["first_call"] = time.perf_counter() - t0
        # cold: a fresh solver every call
        cold = [paired(lambda c: make_solver()(c, n)) for _ in range(args.repeats)]
        # warm: one persistent solver, as in training
        solver = make_solver()
        fwd_bwd(lambda c: solver(c, n), C, G)
        warm = [paired(lambda c: solver(c, n)) for _ in range(args.repeats)]
        if args.compare_eager:
            eager = make_solver(False)
            fwd_bwd(lambda c: eager(c, n), C, G)
            f_e, b_e, c_e = paired(lambda c: eager(c, n))
            f_f, b_f, c_f = paired(lambda c: solver(c, n))  # the fused solver right after: a paired ratio
            r["eager_fwd"], r["eager_bwd"], r["pair_fused"] = f_e, b_e, f_f + b_f
            del eager
        if args.compare_compiled:
            comp = make_solver(True)
            fwd_bwd(lambda c: comp(c, n), C, G)
            f_e, b_e, c_e = paired(lambda c: comp(c, n))
            f_f, b_f, c_f = paired(lambda c: solver(c, n))
            r["compiled_fwd"], r["compiled_bwd"], r["pair_fused_c"] = f_e, b_e, f_f + b_f
            r["compiled_ratio"] = (f_e + b_e) / (passes / 2 * c_e)
            del comp
        B = None  # free the copy target (paired() is not called again)
        with count_host_syncs() as syncs:
            _, _, P, dC = fwd_bwd(lambda c: solver(c, n), C, G)
        r["syncs"] = syncs.summary()
        if DEV.type == "cuda":
            r["sync_debug"] = gpu_sync_debug(lambda c: solver(c, n), C, G)
        r["unproven"] = int(solver.unproven())
        r["bandwidth"] = 2 * C.numel() * C.element_size() / min(x[2] for x in cold + warm)
        for name, runs in (("cold", cold), ("warm", warm)):
            r[f"{name}_fwd"], r[f"{name}_bwd"] = min(x[0] for x in runs), min(x[1] for x in runs)
            ratios = sorted((x[0] + x[1]) / (passes / 2 * x[2]) for x in runs)
            r[f"{name}_ratio_best"], r[f"{name}_ratio_median"] = ratios[0], ratios[len(ratios) // 2]
        r["t_copy"] = min(x[2] for x in cold + warm)
        r["kinds"] = [(k, int(nnz)) for k, nnz in getattr(P.grad_fn, "stats", [])]
        r["density"] = float((P.detach() > 0).float().mean())
        r["row_err"] = float((P.detach().double().sum(1) - mu.double()).abs().max())
        r["floor"] = passes / 2 * r["t_copy"]
        # achieved bandwidth: the floor's bytes over the warm step (what the kernel would need at the copy's speed)
        r["achieved_bandwidth"] = passes * C.numel() * C.element_size() / (r["warm_fwd"] + r["warm_bwd"])
        r["peak_bandwidth"] = peak_bw
        if not args.skip_naive:
            rows = args.naive_rows or v
            Cs, Gs = C[:rows].clone(), G[:rows].clone()
            mus = torch.full((rows,), 1.0 / rows, device=DEV)
            f, b, Pn, dCn = fwd_bwd(lambda c: naive_sinkhorn(c, mus, nu, n), Cs, Gs)
            scale = v / rows
            r["naive_fwd"], r["naive_bwd"], r["naive_rows"] = f * scale, b * scale, rows
            if rows == v:  # same problem: check that both agree
                r["naive_max_abs_diff_P"] = float((Pn - P).abs().max())
                r["naive_max_abs_diff_grad"] = float((dCn - dC).abs().max())
            del Pn, dCn, Cs, Gs
        del P, dC
        if not args.skip_memory and DEV.type == "cuda":
            r["mem_fused"] = gpu_memory(lambda c: solver(c, n), C, G)
        elif not args.skip_memory:
            r["mem_fused"] = run_memory(args, "fused", state)
            if not args.skip_naive:
                r["mem_naive"] = run_memory(args, "naive", state)
        results["states"][state] = r
        _report(state, r, passes, v, u)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def run_moving(args):
    """Unproven thresholds and step time of warm-started solvers along a moving C (see the docstring)."""
    v, u, n = args.v, args.u, args.iters
    fused = FUSED[args.fused]
    mu, nu = torch.full((v,), 1.0 / v, device=DEV), torch.full((u,), 1.0 / u, device=DEV)
    wis = [int(x) for x in args.warm_iters.split(",")]
    print(f"# warm starts along a moving C: {v} x {u} float32, {n} Dykstra iterations, {args.moving} steps, "
          f"{torch.get_num_threads()} threads")
    print(f"| C start | lr x v | columns' warm_iters (rows: {args.row_warm_iters or 'cold'}) | unproven slices per step "
          "(all 2 x n projections) | step fwd + bwd s, median |")
    print("|---|---|---|---|---|")
    out = []
    for state in args.states.split(","):
        for lrv in (0.025, 2.5):
            for wi in wis:
                g = torch.Generator().manual_seed(0)
                C = make_C(v, u, state)
                G = randn(v, u, g)
                solver = SparseSinkhorn(mu, nu, fused=fused)
                solver.rows.warm_iters, solver.cols.warm_iters = args.row_warm_iters, wi
                for p in (solver.rows, solver.cols):
                    p.iters = p.iters if not args.newton else args.newton
                fwd_bwd(lambda c: solver(c, n), C, G)  # compile; then a fresh solver state below
                for p in (solver.rows, solver.cols):
                    p.reset_warm()
                    p.unproven = None
                per_step, times, seen = [], [], 0
                for _ in range(args.moving):
                    f, b, _, dC = fwd_bwd(lambda c: solver(c, n), C, G)
                    tot = int(solver.unproven())
                    per_step.append(tot - seen)
                    seen = tot
                    times.append(f + b)
                    # an Adam-like step: every entry by lr, mostly along the gradient
                    C = C - (lrv / v) * torch.sign(randn(v, u, g) + 0.3 * torch.sign(dC))
                    G = randn(v, u, g)
                med = sorted(times[1:] or times)[len(times[1:] or times) // 2]
                print(f"| {state} | {lrv} | {wi or 'cold'} | {per_step} | {med:.3f} |", flush=True)
                out.append({"state": state, "lr_v": lrv, "warm_iters": wi, "unproven": per_step, "step_s": med})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def _report(state, r, passes, v, u):
    tot_w = r["warm_fwd"] + r["warm_bwd"]
    tot_c = r["cold_fwd"] + r["cold_bwd"]
    print(f"\n## C state: {state}  (P density {r['density']:.3f}, max |P1 - mu| after the iterations "
          f"{r['row_err']:.3g} = {r['row_err'] * v:.3g} mu_i)")
    print(f"- copy of C (best in the run): {r['t_copy'] * 1e3:.1f} ms = {r['bandwidth'] / 1e9:.1f} GB/s; floor = "
          f"{passes} C-sized transfers / bandwidth = {r['floor']:.3f} s")
    print(f"- host syncs per fwd + bwd (warm): {r['syncs']}; unproven thresholds: {r['unproven']}"
          + (f"; under set_sync_debug_mode(\"error\"): {r['sync_debug']}" if "sync_debug" in r else ""))
    bw = r["achieved_bandwidth"]
    print(f"- achieved bandwidth (the floor's {passes} C-sized transfers over the warm fwd + bwd): {bw / 1e9:.1f} GB/s = "
          f"{100 * bw / r['bandwidth']:.1f}% of the copy's" + (f", {100 * bw / r['peak_bandwidth']:.1f}% of the "
                                                              f"datasheet peak" if r.get("peak_bandwidth") else ""))
    for name, tot in (("warm", tot_w), ("cold", tot_c)):
        print(f"- fused, {name} solver: forward {r[name + '_fwd']:.3f} s + backward {r[name + '_bwd']:.3f} s = "
              f"{tot:.3f} s ({tot / r['floor']:.2f} x the best floor); each call vs the copy time measured next to "
              f"it: best {r[name + '_ratio_best']:.2f} x floor, median {r[name + '_ratio_median']:.2f} x "
              f"(old {passes}-copy floor: best {r[name + '_ratio_best'] / 2:.2f} x)")
    print(f"- first call of the process (compiling the kernels + one fwd + bwd): {r['first_call']:.1f} s")
    if "eager_fwd" in r:
        te = r["eager_fwd"] + r["eager_bwd"]
        print(f"- eager ops (fused off), warm: forward {r['eager_fwd']:.3f} s + backward {r['eager_bwd']:.3f} s = "
              f"{te:.3f} s; the fused solver right after: {r['pair_fused']:.3f} s: {te / r['pair_fused']:.1f} x faster")
    if "compiled_fwd" in r:
        tc = r["compiled_fwd"] + r["compiled_bwd"]
        print(f"- compiled per-pass kernels (--fused true), warm: forward {r['compiled_fwd']:.3f} s + backward "
              f"{r['compiled_bwd']:.3f} s = {tc:.3f} s ({r['compiled_ratio'] / 2:.2f} x the 9-copy floor); this "
              f"solver right after: {r['pair_fused_c']:.3f} s: {tc / r['pair_fused_c']:.1f} x faster")
    print(f"- supports per projection (kind, nnz): {r['kinds']}")
    if "naive_fwd" in r:
        tn = r["naive_fwd"] + r["naive_bwd"]
        how = "" if r["naive_rows"] == v else f" (measured on {r['naive_rows']} rows, scaled x{v / r['naive_rows']:.2f})"
        print(f"- naive (autograd through sort): forward {r['naive_fwd']:.2f} s + backward {r['naive_bwd']:.2f} s = "
              f"{tn:.2f} s{how}; speed-up {tn / tot_w:.1f} x warm, {tn / tot_c:.1f} x cold")
        if "naive_max_abs_diff_P" in r:
            print(f"  naive vs fused: max |dP| = {r['naive_max_abs_diff_P']:.2g}, "
                  f"max |d grad| = {r['naive_max_abs_diff_grad']:.2g}")
    for k in ("mem_fused", "mem_naive"):
        m = r.get(k)
        if m and "extra_bytes" in m:
            print(f"- peak extra memory, {k[4:]}: {m['extra_bytes'] / 2**20:.0f} MiB = "
                  f"{m['extra_bytes'] / m['C_bytes']:.2f} x size of its C ({m['C_bytes'] / 2**20:.0f} MiB)"
                  + (f", of which {m['scratch_bytes'] / 2**20:.0f} MiB reused scratch resident between calls"
                     if m.get("scratch_bytes") else ""))
        elif m:
            print(f"- {k}: failed: {m.get('error', '')[-300:]}")


if __name__ == "__main__":
    main()
