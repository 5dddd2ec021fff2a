"""Registers, spills and resident programs per SM of every Triton kernel the GPU routes launch, compiled offline.

    PYTHONPATH=. python -m bench.kernel_resources [--archs 80,90] [--v 32000,50280,50304,151936] [--u 512,4096]
        [--out bench/kernel_resources.json]

No GPU needed: Triton's compiler and the ptxas inside the triton wheel build for a target given by name. The
launches are captured as the routes make them at each plan size (v x u, on meta tensors: nothing computed): the
sparse Sinkhorn's forward and backward (3 iterations: rows without and with the correction terms, columns, both
backwards), its thresholds-only launch (the column-sharded rows: whole rows, row-major), and the plan product's two
kernels (d = 2,048, OLMo-1B's width). Each is specialised by Triton's own binder, as a launch would be (pointer
alignment, integer arguments equal to 1 or divisible by 16, every constexpr), compiled once per distinct
specialisation and target, and ptxas's report read (registers, spill stores and loads, stack frame). Programs per SM
follow from the registers, threads and shared memory against the SM's limits (below). A benchmark reference, not a
timing: tests/bench/test_kernel_resources.py compiles a subset and asserts the counts.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: per-SM limits (CUDA occupancy calculator): registers, threads, programs, shared memory usable by programs (bytes)
#: and the shared memory the driver reserves per program
SM_LIMITS = {80: dict(regs=65536, threads=2048, programs=32, shared=167936, reserved=1024),
             90: dict(regs=65536, threads=2048, programs=32, shared=233472, reserved=1024)}
#: registers are allocated per warp in units of 256
REG_UNIT = 256
D_MODEL = 2048


@dataclass
class Launch:
    """One launch as the route makes it: which kernel, on what, with which specialisation."""
    kernel: str  # project / backward / live_product / live_grad_p
    role: str  # e.g. "row projection (first)"
    fn: object
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, name, fn, out, role):
        self.name, self.fn, self.out, self.role = name, fn, out, role

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append(Launch(self.name, self.role(args, kwargs), self.fn, args, kwargs))
        return launch


def _sinkhorn_role(v):
    def role(args, kw):
        if kw.get("APPLY") is False:
            return "thresholds only (sharded rows)"
        if args[9] != v:  # (S: the number of slices)
            return "column projection"
        return "row projection " + ("(with corrections)" if kw["HAS_Z2"] else "(first, C row-major)")
    return role


def _bwd_role(v):
    def role(args, kw):
        return ("row backward" if args[5] == v else "column backward") + (" (with gc)" if kw["HAS_GC"] else
                                                                          " (first)")
    return role


def capture(v: int, u: int) -> list[Launch]:
    """Every launch the routes make for a v x u plan (meta tensors: shapes and strides only)."""
    import torch

    from s2t2_dist.api import dykstra_triton as dt
    from s2t2_dist.api import product_triton as pt
    from s2t2_dist.api import triton_kernels as k
    from s2t2_dist.api import dykstra

    out: list[Launch] = []
    fwd, grad_p = pt.kernels()
    with dt.kernels_as(_Recorder("project", k.project, out, _sinkhorn_role(v)),
                       _Recorder("backward", k.backward, out, _bwd_role(v))), \
            pt.kernels_as(_Recorder("live_product", fwd, out, lambda a, kw: "product forward"),
                          _Recorder("live_grad_p", grad_p, out, lambda a, kw: "product dP")):
        meta = torch.device("meta")
        C = torch.empty(v, u, device=meta, requires_grad=True)
        mu, nu = torch.empty(v, device=meta), torch.empty(u, device=meta)
        P = dykstra(C, dt.TritonSteps(mu, nu), 3)
        P.backward(torch.empty(v, u, device=meta))
        dt.TritonSteps(None, None).thresholds(torch.empty(max(v // 8, 1), u, device=meta), mu, 1)
        Pc = torch.empty_strided((v, u), (1, v), device=meta)
        M, G = torch.empty(v, D_MODEL, device=meta), torch.empty(u, D_MODEL, device=meta)
        pt.live_product(Pc, M)
        pt.live_grad_p(Pc, M, G)
    return out


def specialise(launch: Launch, target):
    """(key, ASTSource, options) of a launch as Triton's binder specialises it for ``target``."""
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(target)
    fn = launch.fn
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound, spec, options)
    key = (launch.kernel, target.arch, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
           repr(sorted((k, v) for k, v in attrs.items() if v)), options.num_warps, options.num_stages)
    return key, ASTSource(fn, signature, constexprs, attrs), options


@dataclass
class Resources:
    kernel: str
    arch: int
    num_warps: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    programs_per_sm: int
    compile_s: float


def programs_per_sm(arch: int, regs: int, num_warps: int, shared: int) -> int:
    lim = SM_LIMITS[arch]
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    by_regs = lim["regs"] // (per_warp * num_warps)
    by_threads = lim["threads"] // (32 * num_warps)
    by_shared = lim["shared"] // (shared + lim["reserved"])
    return min(by_regs, by_threads, by_shared, lim["programs"])


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) "
                    r"registers", re.S)


def compile_one(name: str, src, options, target) -> Resources:
    import triton
    from triton import knobs

    t0 = time.time()
    log = io.StringIO()
    # (always compiled: a kernel from Triton's cache has no ptxas report)
    knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = True
    try:
        with contextlib.redirect_stdout(log):
            cc = triton.compile(src, target=target, options=options.__dict__)
    finally:
        knobs.nvidia.dump_ptxas_log = knobs.compilation.always_compile = False
    m = _PTXAS.search(log.getvalue())
    if not m:
        raise RuntimeError(f"no ptxas report for {name}: {log.getvalue()[-500:]}")
    stack, st, ld, regs = (int(x) for x in m.groups())
    nw = options.num_warps
    shared = int(cc.metadata.shared)
    return Resources(name, target.arch, nw, regs, st, ld, stack, shared, programs_per_sm(target.arch, regs, nw, shared),
                     round(time.time() - t0, 1))


def measure(vs, us, archs, only=None, log=print) -> list[dict]:
    """One row per (v, u, arch, launch): the launch's role and its kernel's resources (compiled once per distinct
    specialisation). ``only``: a predicate on the role, to compile a subset."""
    import warnings

    from triton.backends.compiler import GPUTarget

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    done: dict = {}
    rows = []
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for v in vs:
            for u in us:
                seen = set()
                for la in capture(v, u):
                    role = la.role
                    if (only and not only(role)) or role in seen:
                        continue
                    seen.add(role)
                    key, src, options = specialise(la, target)
                    if key not in done:
                        done[key] = compile_one(la.kernel, src, options, target)
                        r = done[key]
                        log(f"  sm_{arch} {v} x {u} {role:34s} {r.registers:3d} regs, spills {r.spill_stores}/"
                            f"{r.spill_loads} B, {r.programs_per_sm} programs/SM ({r.compile_s} s)")
                    rows.append({"v": v, "u": u, "role": role, "launch": {k: val for k, val in la.kwargs.items()},
                                 **asdict(done[key])})
    return rows


def summary(rows: list[dict]) -> dict:
    bad = [r for r in rows if r["spill_stores"] or r["spill_loads"] or r["programs_per_sm"] < 2]
    return {"variants": len(rows), "spilling_or_one_program": len(bad),
            "max_registers": max(r["registers"] for r in rows), "min_programs_per_sm": min(r["programs_per_sm"]
                                                                                          for r in rows)}


def markdown(rows: list[dict], when: str) -> str:
    s = summary(rows)
    lines = [f"# Triton kernels' resources, compiled offline ({when})", "",
             "`PYTHONPATH=. python -m bench.kernel_resources` (Triton's compiler and the wheel's ptxas, no GPU; each",
             "launch specialised as the routes make it). Per SM: 64K registers, 2,048 threads; a program is",
             "`num_warps` x 32 threads. Targets: 0 bytes spilled and >= 2 programs per SM for every variant.", "",
             f"{s['variants']} variants, {s['spilling_or_one_program']} spill or fit one program per SM; at most "
             f"{s['max_registers']} registers, at least {s['min_programs_per_sm']} programs per SM.", "",
             "| arch | v | u | launch | warps | registers | spill st/ld (B) | programs/SM |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| sm_{r['arch']} | {r['v']:,} | {r['u']:,} | {r['role']} | {r['num_warps']} | {r['registers']} "
                     f"| {r['spill_stores']}/{r['spill_loads']} | {r['programs_per_sm']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default="80,90")
    ap.add_argument("--v", default="32000,50280,50304,151936")
    ap.add_argument("--u", default="512,4096")
    ap.add_argument("--out", default=str(REPO / "bench" / "kernel_resources.json"),
                    help="JSON; a markdown table beside it (.md)")
    a = ap.parse_args(argv)
    try:
        ints = [[int(x) for x in s.split(",")] for s in (a.archs, a.v, a.u)]
    except ValueError:
        print("kernel_resources: --archs, --v and --u take comma lists of integers", file=sys.stderr)
        return 2
    archs, vs, us = ints
    if any(x not in SM_LIMITS for x in archs):
        print(f"kernel_resources: --archs among {sorted(SM_LIMITS)}", file=sys.stderr)
        return 2
    rows = measure(vs, us, archs)
    when = time.strftime("%Y-%m-%d")
    out = Path(a.out)
    out.write_text(json.dumps({"date": when, "summary": summary(rows), "rows": rows}, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(rows, when))
    print(json.dumps(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
