"""Benchmark: training-loader batches/s (the stages' GlobalTrainLoader, rank 0 of 1 or more ranks) against the time
a training step takes to consume one batch. (The per-rank-layout TrainLoader of earlier records
was retired.)

Assumed step (the paper's setting): OLMo-1B, batch 16 x 512 tokens on one H100.
    tokens/step          16 * 512                      = 8,192
    FLOP/step            6 * 1.18e9 params * 8,192     = 5.8e13   (forward + backward, 6 N per token)
    sustained bf16       ~40% of ~989e12 FLOP/s (dense) = ~4.0e14 FLOP/s
    step time            5.8e13 / 4.0e14               = ~0.146 s  -> the model consumes ~6.8 batches/s
The loader must deliver >= 20x that: >= ~137 batches/s per rank.

Uses shards written by bench_prepare.py (--shards DIR/train), or builds small ones from the real protein files.

    PYTHONPATH=. python -m bench.bench_loader --shards /tmp/s2t2_bench_prepare/shards/train --workers 0 1 2
    PYTHONPATH=. python -m bench.bench_loader --workers 0 2 --world 1 8 --batches 300
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from s2t2_dist.api import GlobalTrainLoader
STEP_S = 6 * 1.18e9 * 16 * 512 / (0.40 * 989e12)


def build_small(work: Path, protein_dir: Path) -> Path:
    from s2t2_dist.api import train_tokenizer
    from s2t2_dist.api import RecordPolicy
    from s2t2_dist.api import write_shards
    from s2t2_dist.api import split_dataset

    aa = "ACDEFGHIKLMNPQRSTVWY"
    files = [str(protein_dir / f) for f in ("mmseqs2_QUERY_uniprotkb.fasta", "bio_embeddings_disprot_disordercdhit.fasta",
                                            "derived_esm_a3m_unaligned_uniprot.fasta")]
    split_dataset(inputs=files, output_dir=work / "splits", policy=RecordPolicy(alphabet=aa, extra_residues="UXBZO"),
                  eval_fraction=0.01, progress=False)
    train_tokenizer(split_dir=work / "splits", output_dir=work / "tok", alphabet=aa + "UXBZO", progress=False)
    write_shards(split_dir=work / "splits", split="train", tokenizer=work / "tok", output_dir=work / "train",
                 context_len=512, shard_size=256, num_workers=0, progress=False)
    return work / "train"


def measure(shards: Path, workers: int, batch_size: int, n_batches: int, world: int = 1) -> dict:
    """Rank 0 of `world` ranks (it reads every shard and decodes only its 1/world of the samples)."""
    L = GlobalTrainLoader(shards, global_batch_size=batch_size * world, micro_batch_size=batch_size,
                          world_size=world, num_workers=workers, seed=0, shuffle_window=4096)
    t0 = time.perf_counter()
    it = iter(L)
    next(it)
    first = time.perf_counter() - t0
    got, t1 = 0, time.perf_counter()
    while got < n_batches:
        try:
            b = next(it)
        except StopIteration:  # next epoch
            it = iter(L)
            continue
        assert b["input_ids"].shape[1] == 512
        got += 1
    dt = time.perf_counter() - t1
    return {"loader": "global", "world": world, "workers": workers, "first_batch_s": first, "batches_per_s": got / dt,
            "tokens_per_s": got * batch_size * 512 / dt, "vs_step": got / dt * STEP_S}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", default=None)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--workdir", default="/tmp/s2t2_bench_loader")
    ap.add_argument("--protein-dir", default=os.environ.get("S2T2_SHARED_DATA", "/work/shared/data") + "/protein")
    ap.add_argument("--json", default=None)
    ap.add_argument("--world", type=int, nargs="+", default=[1], help="measure rank 0 of these numbers of ranks")
    a = ap.parse_args()
    shards = Path(a.shards) if a.shards else build_small(Path(a.workdir), Path(a.protein_dir))
    m = json.loads((shards / "manifest.json").read_text())
    print(f"shards: {shards} ({len(m['shards'])} shards, {m['totals']['n_samples']:,} blocks of 512)")
    print(f"assumed step: {STEP_S:.3f} s -> {1 / STEP_S:.1f} batches/s consumed; 20x = {20 / STEP_S:.0f} batches/s\n")
    print("| ranks | DataLoader workers | first batch s | batches/s | tokens/s | x faster than a step |")
    print("|---:|---:|---:|---:|---:|---:|")
    rows = []
    for world in a.world:
        for w in a.workers:
            r = measure(shards, w, a.batch_size, a.batches, world)
            rows.append(r)
            print(f"| {world} | {w} | {r['first_batch_s']:.2f} | {r['batches_per_s']:.0f} | "
                  f"{r['tokens_per_s'] / 1e6:.2f} M | {r['vs_step']:.0f}x |", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"step_s": STEP_S, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
