"""Which launch of the sparse Sinkhorn's Triton kernels disagrees with the torch steps, where, and under which
specialisation: one line per launch, each fed the torch steps' own inputs (so an error does not travel on).

The route's first-use check (``s2t2_dist.ot.kernel_check``) judges each launch on identical inputs and falls back on
a failure; this says on which slices and chunks a launch disagrees, for each way Triton may specialise the launches:

* ``specialised``: as the route launches them (integers of 1 and multiples of 16, and 16-byte aligned pointers,
  specialised by Triton: vectorised loads and stores);
* ``no_alignment``: no divisibility-by-16 or alignment specialisation (scalar loads and stores);
* ``none``: no integer specialisation at all.

    python -m bench.kernel_diag --device cuda --shapes 3200x512,3176x512 --out diag.json
    TRITON_INTERPRET=1 python -m bench.kernel_diag --device cpu --shapes 40x6,70x9   (Triton's interpreter)

A shape is the first-use check's plan (``routing.check_shape``: v = 50,304 is checked at 3,200, v = 50,280 at
3,176). Exit status 0 when every launch of every variant agrees (relative error < 1e-4), else 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from s2t2_dist.api import TorchSteps, newton_thresholds
from s2t2_dist.api import dykstra_triton as DT
from s2t2_dist.api import check_problem, launch_findings, verdict

TOL = 1e-4
INTS = {"project": ["S", "N", "a_s", "a_n", "b_s", "b_n"], "backward": ["S", "N", "g_s", "g_n", "b_s", "b_n"]}
PTRS = {"project": ["z1_ptr", "z2_ptr", "add_ptr", "pos_ptr", "corr_ptr", "mask_ptr", "scale_ptr", "tau_ptr",
                    "cnt_ptr"], "backward": ["g_ptr", "gc_ptr", "out_ptr", "mask_ptr", "cnt_ptr"]}


def variants() -> dict:
    """name -> (project, backward) kernels: the route's own, and the same functions jitted with less
    specialisation (a Triton without an option leaves that variant out)."""
    import triton

    from s2t2_dist.api import triton_kernels as K

    out = {"specialised": (K.project, K.backward)}
    for name, opt in (("no_alignment", "do_not_specialize_on_alignment"), ("none", "do_not_specialize")):
        try:
            out[name] = tuple(triton.jit(getattr(K, k).fn, **{opt: INTS[k] + (PTRS[k] if name == "no_alignment"
                                                                              else [])})
                              for k in ("project", "backward"))
        except TypeError:
            pass
    return out


def colmajor(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def compare(a: torch.Tensor, b: torch.Tensor, slice_dim: int) -> dict:
    """a (kernels) against b (torch steps): the largest error relative to b's largest entry, how many entries are
    off, and where (the first slices off; for a streamed slice, the chunks of BLOCK_N entries that hold them)."""
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()), 1e-30)
    d = (a - b).abs() / scale
    bad = (d > TOL) | (torch.isnan(a) != torch.isnan(b))
    out = {"rel_err": float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0, "n_off": int(bad.sum()),
           "of": int(d.numel())}
    if out["n_off"]:
        idx = bad.nonzero()
        # slices run along slice_dim: a slice is indexed by the other coordinate
        sl = idx[:, 1 - slice_dim] if a.dim() == 2 else idx[:, 0]
        out["slices_off"] = sorted({int(s) for s in sl.unique()[:8]})
        out["n_slices_off"] = int(sl.unique().numel())
        if a.dim() == 2:
            out["chunks_off"] = sorted({int(c) for c in (idx[:, slice_dim] // DT.BLOCK_N).unique()[:8]})
            out["first_off"] = [int(i) for i in idx[0]]
    return out


def diagnose(dev: torch.device, v: int, u: int) -> dict:
    """Each launch of the route at v x u (fp32) against the torch steps on identical inputs."""
    C, mu, nu, G = check_problem(dev, v, u, torch.float32)
    K, T = DT.TritonSteps(mu, nu), TorchSteps(mu, nu)
    res: dict = {}
    Pt, Qt, Xt = T.buffers(C)
    Pk, Qk, Xk = K.buffers(C)
    masks = {}

    def record(step: str, dim: int, kernels, torch_steps, outs) -> None:
        (mk, ck), (mt, ct) = kernels, torch_steps
        masks.setdefault(dim, (mt, ct))  # the first projection's supports: what the backward launches read
        for part, a, b in outs:
            res[f"{step}: {part}"] = compare(a, b, dim)
        res[f"{step}: support"] = compare(mk.float(), mt.float(), dim)
        res[f"{step}: counts"] = compare(ck.long(), ct.long(), 0)

    def row(step: str, first: bool) -> None:
        if not first:  # the torch steps' state in, so an earlier launch's error does not travel on
            Xk.copy_(Xt), Pk.copy_(Pt), Qk.copy_(Qt)
        record(step, 1, K.row(C if first else Xk, Pk, Qk, first), T.row(C if first else Xt, Pt, Qt, first),
               (("projection", Qk, Qt), ("correction", Pk, Pt)))

    def col(step: str) -> None:
        Qk.copy_(Qt)
        record(step, 0, K.col(Qk, Xk), T.col(Qt, Xt), (("projection", Xk, Xt), ("correction", Qk, Qt)))

    row("row projection, first", True)
    col("column projection")
    row("row projection, with corrections", False)
    col("column projection, second")
    g = torch.randn(v, u, generator=torch.Generator().manual_seed(3)).to(dev)
    gc = torch.randn(v, u, generator=torch.Generator().manual_seed(4)).to(dev)
    for name, dim in (("column backward", 0), ("row backward", 1)):
        mt, ct = masks[dim]
        mk = K.mask(mt)
        mk.copy_(mt)
        for with_gc in (False, True):
            gck = colmajor(gc) if with_gc else None
            a = K.col_bwd(g, gck, mk, ct) if dim == 0 else K.row_bwd(g, gck, mk, ct)
            b = T.col_bwd(g, gc if with_gc else None, mt, ct) if dim == 0 else T.row_bwd(g, gc if with_gc else None,
                                                                                         mt, ct)
            res[f"{name}{', with gc' if with_gc else ''}"] = compare(a, b, dim)
    for layout, Z in (("column-major", colmajor(C)), ("row-major", C.contiguous())):
        for dim, s, side in ((0, nu, "columns"), (1, mu, "rows")):
            t1, c1 = K.thresholds(Z, s, dim)
            t2, c2 = newton_thresholds(Z, s, dim)
            res[f"thresholds only, {layout}, {side}: thresholds"] = compare(t1, t2, 0)
            res[f"thresholds only, {layout}, {side}: counts"] = compare(c1.long(), c2, 0)
    findings = launch_findings(DT.TritonSteps, dev, v, u, torch.float32)
    res["first-use check"] = {"verdict": verdict(findings) or "passes",
                              "parts": {part: [value, limit] for part, value, limit, _ in findings}}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="3200x512,3176x512,3200x128,3176x128",
                    help="comma list of v x u plans (the first-use check's shapes)")
    ap.add_argument("--variants", default="", help="comma list (default: all this Triton offers)")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
        assert all(len(s) == 2 and min(s) > 0 for s in shapes)
    except (ValueError, AssertionError):
        print(f"--shapes: a comma list of VxU with positive integers, got {a.shapes!r}", file=sys.stderr)
        return 2
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here (on a CPU: TRITON_INTERPRET=1 ... --device cpu)", file=sys.stderr)
        return 2
    allv = variants()
    names = [n for n in a.variants.split(",") if n] or list(allv)
    if set(names) - set(allv):
        print(f"--variants: one of {', '.join(allv)}, got {a.variants!r}", file=sys.stderr)
        return 2
    out, ok = {}, True
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (Triton's interpreter)"
    for v, u in shapes:  # shape by shape, every variant: the first shape's answer comes first
        for name in names:
            with DT.kernels_as(*allv[name]):
                try:
                    r = diagnose(dev, v, u)
                except Exception as e:  # noqa: BLE001 - a variant that does not compile: say so, go on
                    r = {"error": f"{type(e).__name__}: {e}"}
            out.setdefault(name, {})[f"{v}x{u}"] = r
            bad = {k: x for k, x in r.items() if k != "first-use check" and
                   (isinstance(x, str) or x.get("n_off") or x.get("rel_err", 0) > TOL)}
            check = (r.get("first-use check") or {}).get("verdict", "-")
            ok &= not bad
            print(f"{name:13s} {v} x {u}: {'all launches agree' if not bad else f'{len(bad)} parts off'}; "
                  f"first-use check: {check}", flush=True)
            for k, x in bad.items():
                print(f"    {k}: {x}", flush=True)
            if a.out:  # after each result: a run stopped at its time limit keeps what it found
                Path(a.out).write_text(json.dumps({"device": where, "variants": out}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
