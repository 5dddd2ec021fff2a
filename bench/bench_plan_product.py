"""The translator's product P^T E (translator/product.py): its kernel for the device (CPU: P's live rows gathered;
CUDA: the Triton live-row kernels) against the dense GEMMs, at OLMo-1B's shapes (v = 50,280, u = 512, d = 2,048), in
interleaved pairs. Prints each plan's row as soon as it is measured.

    PYTHONPATH=. python -m bench.bench_plan_product                       # CPU, 2 threads
    PYTHONPATH=. python -m bench.bench_plan_product --d 256 --reps 2      # a quick check
    PYTHONPATH=. python -m bench.bench_plan_product --device cuda         # the Triton kernels on a GPU (< 60 s)

Plans (each C moved off its start, see bench/rehearsal.py), built on the bench's device:

* ``shipped``: the shipped recipe's start (configs/translate_olmo1b.yaml: FVT at weight 0.5 from OLMo's tokenizer
  and a protein BPE of 512 tokens, the FVT plan's own source marginal, floor 1), after two AdamW steps at its lr;
* ``moved``: the uniform source marginal and a moved uniform C (C = 1/v + U(0, 1/v)), floor 1: every row live.

Per plan: the product alone (forward + backward into P, E frozen) and the whole translator (sparse Sinkhorn, floor,
product, forward + backward with random cotangents), each with ``plan_product`` and with the dense GEMMs
(``P.t() @ E``), alternating; the minimum of ``--reps``; and C's gradient from both (their largest difference).
``--dtype bfloat16``: E in bf16, as a bf16 model's rows (widened as read). On CUDA every timing is between
synchronize calls, and the product's forward + backward runs once under ``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.rehearsal import shipped_translator, target_tokenizer

from s2t2_dist.api import source_token_ids
from s2t2_dist.api import save_olmo_tokenizer
from s2t2_dist.api import TokenTranslator, TranslatorConfig
from s2t2_dist.api import product as product
from s2t2_dist.api import translated_rows
from s2t2_dist.api import plan_product

#: the shipped recipe's weight floor (sparse kind, FVT start; translator.floor: null)
DEFAULT_FLOOR = TranslatorConfig().resolve(None, None).floor


def dense(P, M, sparse=False):
    return P.t() @ M.to(P.dtype)


def kernel_of(P: torch.Tensor) -> str:
    """The kernel plan_product takes for the sparse kind's P on its device."""
    if P.is_cuda:
        return "triton live rows" if product.uses_live_rows(P, True) else "dense"
    return "dense" if product.live_rows(P) is None else "live rows"


def recorded_plans(files: list[str], dev: torch.device, trs: dict) -> dict:
    """--plan FILE: each P file's plan as recorded (returned by name) and a translator started from it (into trs)."""
    from s2t2_dist.api import PFileError
    from s2t2_dist.api import load_p

    recorded = {}
    for f in files:
        try:
            p = load_p(f)
        except PFileError as e:
            raise SystemExit(f"--plan: {e}") from None
        tr = TokenTranslator(p.shape[0], p.shape[1], floor=DEFAULT_FLOOR, device=dev)
        tr.init_from_dense(p.dense())
        trs[f"file {Path(f).name}"] = tr
        recorded[f"file {Path(f).name}"] = p.dense().to(dev)
    return recorded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=2048, help="model width (OLMo-1B: 2,048)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plans", default="shipped,moved")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the source rows' dtype")
    ap.add_argument("--plan", action="append", default=[], metavar="FILE",
                    help="also time a P file written by a stage-1 run (e.g. a CPU run with the real SmolLM2): its "
                         "plan as recorded for the product, a translator started from it (its kind's C for that "
                         "plan) for the translator")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from s2t2_dist.api import load_hf_tokenizer

    t_setup = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        save_olmo_tokenizer(tmp)  # OLMo's tokenizer, from the copy shipped in the package
        src_tok = load_hf_tokenizer(tmp)
        src = source_token_ids(src_tok, "all", num_embeddings=50304)
        tok_dir = target_tokenizer(Path(tmp))  # (a protein BPE of 512 tokens, trained here)
        trs = {}
        for name in args.plans.split(","):
            if name == "shipped":
                trs[name] = shipped_translator(tmp, src_tok, src, tok_dir, DEFAULT_FLOOR, device=dev)
            elif name == "moved":
                tr = TokenTranslator(src.numel(), 512, floor=DEFAULT_FLOOR, device=dev)
                with torch.no_grad():
                    tr.C.add_(torch.rand_like(tr.C) / src.numel())
                trs[name] = tr
            else:
                raise SystemExit(f"--plans: unknown plan {name!r} (shipped, moved)")
    recorded = recorded_plans(args.plan, dev, trs)
    v = src.numel()
    cuda = dev.type == "cuda"
    print(f"plans built in {time.perf_counter() - t_setup:.1f} s", flush=True)
    E = torch.randn(v, args.d, device=dev).to(getattr(torch, args.dtype))
    E_by_v = {v: E}  # a recorded plan of another source vocabulary gets source rows of its own v
    where = torch.cuda.get_device_name(dev) if cuda else f"{torch.get_num_threads()} threads"
    print(f"v = {v}, d = {args.d}, E {args.dtype}, {where}; min of {args.reps}, interleaved")
    print("| plan | P non-zeros | live rows | product fwd + bwd: plan_product / dense s | translator fwd + bwd: "
          "plan_product / dense s | C's gradient, largest difference | kernel |")
    print("|---|---|---|---|---|---|---|", flush=True)
    sync_debug = {}
    for name, tr in trs.items():
        tr = tr.to(dev)
        with torch.no_grad():
            P = recorded.get(name, tr.P()).clone()
        n_live = int(P.any(1).sum())
        G = torch.randn(tr.u, args.d, device=dev)
        E = E_by_v.setdefault(tr.v, torch.randn(tr.v, args.d, device=dev).to(getattr(torch, args.dtype)))

        def product(fn):
            Pg = P.clone().requires_grad_()
            fn(Pg, E, True).backward(G)

        def translator(fn):
            # the translator's own forward (its plan from C, then E'), with `fn` as the product
            E_new, _ = translated_rows(tr.P(), E, E, tr.mu, tr.nu_local, tr.normalization,
                                       sparse=tr.plan_kind.sparse_product, product=fn)
            E_new.backward(G)
            g = tr.C.grad.clone()
            tr.zero_grad(set_to_none=True)
            tr.invalidate()
            return g

        def timed(f, *a):
            if cuda:
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            f(*a)
            if cuda:
                torch.cuda.synchronize(dev)
            return time.perf_counter() - t0

        g_live, g_dense = translator(plan_product), translator(dense)  # (also the warm-up)
        t = {k: [] for k in ("pl", "pd", "tl", "td")}
        for _ in range(args.reps):
            t["pl"].append(timed(product, plan_product))
            t["pd"].append(timed(product, dense))
            t["tl"].append(timed(translator, plan_product))
            t["td"].append(timed(translator, dense))
        if cuda:  # the live kernels' forward + backward with any device -> host read an error
            torch.cuda.set_sync_debug_mode("error")
            try:
                product(plan_product)
                sync_debug[name] = "none"
            except RuntimeError as e:
                sync_debug[name] = f"sync: {str(e).splitlines()[0]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        m = {k: min(x) for k, x in t.items()}
        nz = float((P != 0).double().mean())
        print(f"| {name} | {100 * nz:.2f}% | {n_live} | {m['pl']:.3f} / {m['pd']:.3f} ({m['pd'] / m['pl']:.1f} x) | "
              f"{m['tl']:.3f} / {m['td']:.3f} ({m['td'] / m['tl']:.1f} x) | "
              f"{float((g_live - g_dense).abs().max()):.2e} (of {float(g_dense.abs().max()):.2e}) | "
              f"{kernel_of(P)} |", flush=True)
    for name, r in sync_debug.items():
        print(f"{name}: host syncs under set_sync_debug_mode(\"error\"): {r}")


if __name__ == "__main__":
    main()
