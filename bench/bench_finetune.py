"""Benchmarks of what stage 2 adds on top of the engines (BENCHMARKS.md):

1. the translated initialisation at OLMo shapes: E' = W^T E[src], L' = W^T L[src] with v = 50,280 source tokens,
   u = 512 target tokens, d = 2048 (OLMo-1B, tied) and 4096 (OLMo-7B, untied), for a sparse P (north-west-corner
   plan, v + u - 1 entries) and a dense one (softmax / unconstrained translators: v x u entries): P file size, load
   time, time and peak memory of `translated_embeddings`;
2. batched lock-step scoring (eval/scoring.py) against the one-window-per-call reference scorer (eval/bpb.py) on a
   tiny OLMo-config model: windows per second by batch size.

    PYTHONPATH=. python -m bench.bench_finetune [--out bench/out_finetune]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class FakeLM(torch.nn.Module):
    """Only what translated_embeddings touches: an embedding and a head of OLMo's 50,304 rows."""

    def __init__(self, d: int, tied: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(50304, d)
        self.head = torch.nn.Linear(d, 50304, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def get_input_embeddings(self):
        return self.emb

    def get_output_embeddings(self):
        return self.head


def bench_init(out: Path) -> list[dict]:
    from tests.helpers.finetune_fixtures import random_p
    from s2t2_dist.api import load_p, save_p
    from s2t2_dist.api import translated_embeddings

    v, u = 50280, 512
    src = torch.arange(v)
    rows = []
    for kind in ("sparse", "softmax"):
        t0 = time.perf_counter()
        p = random_p(v, u, src, "s" * 64, "t" * 64, kind=kind, seed=0) if kind == "sparse" else None
        if p is None:  # a dense positive plan with the right marginals, built cheaply (no Sinkhorn loop)
            from s2t2_dist.api import SparseP

            g = torch.Generator().manual_seed(0)
            r = torch.rand(v, generator=g) + 0.5
            c = torch.rand(u, generator=g) + 0.5
            P = (r / r.sum())[:, None] * (c / c.sum())[None, :]  # rank one: rows/cols sum to its own marginals
            ii, jj = torch.meshgrid(torch.arange(v), torch.arange(u), indexing="ij")
            p = SparseP(torch.stack([ii.reshape(-1), jj.reshape(-1)]), P.reshape(-1), P.sum(1), P.sum(0), src,
                        "s" * 64, "t" * 64, kind="softmax")
            del P, ii, jj
        path = out / f"P_{kind}.safetensors"
        save_p(path, p)
        t_make = time.perf_counter() - t0
        del p
        t0 = time.perf_counter()
        p = load_p(path)
        t_load = time.perf_counter() - t0
        for d, tied in ((2048, True), (4096, False)):
            model = FakeLM(d, tied)
            base = rss_mib()
            t0 = time.perf_counter()
            E_new, L_new = translated_embeddings(model, p)
            dt = time.perf_counter() - t0
            rows.append({"P": kind, "nnz": int(p.values.numel()), "file_mib": round(path.stat().st_size / 2**20, 1),
                         "make_save_s": round(t_make, 2), "load_s": round(t_load, 2), "d": d, "tied": tied,
                         "translate_s": round(dt, 2), "rss_after_minus_before_mib": round(rss_mib() - base),
                         "E_shape": list(E_new.shape)})
            print(rows[-1], flush=True)
            del model, E_new, L_new
        path.unlink()
    return rows


def bench_scoring() -> list[dict]:
    from s2t2_dist.api import score_documents
    from s2t2_dist.api import hf_logits_fn, score_documents_batched
    from s2t2_dist.api import tiny_from_config

    model = tiny_from_config("olmo-1b", n_layers=2, d_model=64, n_heads=4, vocab=512, seed=0)
    fn = hf_logits_fn(model, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    docs = [{"input_ids": torch.randint(0, 512, (int(n),), generator=g), "n_bytes": int(n) * 2}
            for n in torch.randint(50, 600, (64,), generator=g)]
    ctx = 128
    rows = []
    t0 = time.perf_counter()
    ref = score_documents(fn, docs, ctx)
    t_ref = time.perf_counter() - t0
    n_windows = sum(len(range(1, len(d["input_ids"]), ctx)) for d in docs)
    rows.append({"scorer": "bpb.score_documents (1 window/call)", "batch": 1, "s": round(t_ref, 3),
                 "windows_per_s": round(n_windows / t_ref, 1), "rel_diff_nll": 0.0})
    for bs in (1, 8, 32):
        t0 = time.perf_counter()
        got = score_documents_batched(fn, docs, ctx, batch_size=bs)
        dt = time.perf_counter() - t0
        rows.append({"scorer": "scoring.score_documents_batched", "batch": bs, "s": round(dt, 3),
                     "windows_per_s": round(n_windows / dt, 1),
                     "rel_diff_nll": abs(got.nll_nats - ref.nll_nats) / ref.nll_nats})
        print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out_finetune")
    ap.add_argument("--skip-init", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)
    res = {"torch_threads": torch.get_num_threads()}
    res["scoring"] = bench_scoring()
    if not args.skip_init:
        res["init"] = bench_init(out)
    res["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / "results_finetune.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
