"""Peak memory of BPE training per record sampled: the protein BPE of `s2t2 prepare` trained on N
records from /work/shared/data/protein (or any FASTA files), each size in its own process, peak RSS from
getrusage. Records are reused cyclically with a rotation so every text is distinct (the trainer keeps one entry per
distinct text, so duplicates would understate the cost).

    nice -n 5 python -m bench.bench_bpe_memory --sizes 0 5000 20000 50000 [FASTA ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import subprocess
import sys


def texts(files: list[str], n: int):
    from s2t2_dist.api import read_fasta

    base = [r.text for f in files for r in read_fasta(f, uppercase=True) if not r.bad]
    base = [s for s in base if s]
    for i in range(n):
        s = base[i % len(base)]
        k = (i // len(base)) % len(s)
        yield s[k:] + s[:k]


def one(files: list[str], n: int) -> dict:
    from s2t2_dist.api import build_bpe_tokenizer

    chars = [0]

    def it():
        for t in texts(files, n):
            chars[0] += len(t)
            yield t

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if n:
        build_bpe_tokenizer(it(), vocab_size=512, kind="char", alphabet="ACDEFGHIKLMNPQRSTVWYUXBZO")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"records": n, "chars": chars[0], "peak_rss_mb": peak / 1024, "baseline_mb": before / 1024}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[0, 5000, 20000, 50000])
    p.add_argument("--one", type=int, default=None)
    p.add_argument("files", nargs="*")
    a = p.parse_args()
    files = a.files or sorted(glob.glob("/work/shared/data/protein/*.fasta"))
    if a.one is not None:
        print(json.dumps(one(files, a.one)))
        return
    rows = []
    for n in a.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), *files], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["peak_rss_mb"] if rows[0]["records"] == 0 else 0.0
    print("| records | residues | peak RSS (MB) | above baseline (MB) | bytes per residue | KB per record |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        extra = r["peak_rss_mb"] - base
        per_char = extra * 2**20 / r["chars"] if r["chars"] else 0
        per_rec = extra * 1024 / r["records"] if r["records"] else 0
        print(f"| {r['records']:,} | {r['chars']:,} | {r['peak_rss_mb']:.0f} | {extra:.0f} | {per_char:.0f} | "
              f"{per_rec:.1f} |")


if __name__ == "__main__":
    main()
