"""Benchmark: what the cache of `s2t2 evaluate data.files=[...]` saves, cold tokenization vs a cached re-run.

Times, in one run, on real files (the full tinyshakespeare text, paragraphs as documents, and the DisProt FASTA) with
the real OLMo tokenizer:

  cold     data.raw_eval.tokenize_files into an empty cache: split step + tokenize + write eval shards
  warm     the same call again: hash the files, find the finished split and shards, count nothing again
  hash     sha256 of the files alone (the part of a warm call that grows with the data)

    PYTHONPATH=. python -m bench.bench_score_files [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from s2t2_dist.api import format_records, tokenize_files
from s2t2_dist.api import asset_path
from s2t2_dist.api import sha256_file
SHARED = Path(os.environ.get("S2T2_SHARED_DATA", "/work/shared/data"))
FILES = [SHARED / "english" / "tinyshakespeare_input.txt",
         SHARED / "protein" / "bio_embeddings_disprot_disordercdhit.fasta"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    tok = str(asset_path("olmo", "allenai_gpt-neox-olmo-dolma-v1_5.json"))
    files = [str(f) for f in FILES]
    size = sum(os.path.getsize(f) for f in files)
    cold, warm, hashing = [], [], []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            r = tokenize_files(files, tok, cache_dir=d, text_mode="paragraph", progress=False)
            cold.append(time.perf_counter() - t)
            t = time.perf_counter()
            tokenize_files(files, tok, cache_dir=d, text_mode="paragraph", progress=False)
            warm.append(time.perf_counter() - t)
            t = time.perf_counter()
            for f in files:
                sha256_file(f)
            hashing.append(time.perf_counter() - t)
    c, w, h = min(cold), min(warm), min(hashing)
    print(f"{len(files)} files, {size / 1e6:.2f} MB; {format_records(r['records'])}")
    print(f"cold {c:.2f} s, warm {w:.2f} s (hashing {h:.3f} s): a cached re-run takes {w / c:.3f}x the cold time "
          f"(best of {args.reps})")


if __name__ == "__main__":
    main()
