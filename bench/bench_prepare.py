"""Benchmark: prepare throughput (residues/s and residues per CPU-second) vs only reading the same FASTA.gz.

Generates a UniRef50-like FASTA.gz by resampling the real sequences in shared/data/protein with 5% point mutations
(every record unique; UniRef50 headers; 60-column lines), then times, in one run:

  decompress   gzip decompression only (read the .gz in 1 MiB blocks)
  read         decompression + FASTA parsing + alphabet check (read_fasta: the reading half of step 1)
  split        step 1 whole: read, filter, hash split, write JSON-lines parts
  shards       step 3: tokenize (new 512-token BPE) + pack + write webdataset shards, train and eval
  prepare      split + shards (the tokenizer is trained once beforehand on a sample and not timed here)

"per core" figures divide by CPU seconds (user+sys of this process and its children), which is what a dedicated
core would deliver; wall-clock figures depend on what else runs on the machine.

``--baseline-tree DIR`` (a checkout of another commit, e.g. ``git worktree add /tmp/base HEAD~1``) also times the
shards step (0 workers) with that checkout's ``s2t2_dist`` and with this one, alternately, ``--ab-reps`` times each,
in fresh processes on the same splits and tokenizer: before/after figures for a change taken in the same run. It also
reports the share of the step's CPU time spent inside the shard writer (``ShardFile``: open, write, commit), from
one more run of each under the profiler, which observes the package and replaces nothing of it.

    PYTHONPATH=. python -m bench.bench_prepare --residues 20000000 --workers 0 1 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

from s2t2_dist.api import train_tokenizer
from s2t2_dist.api import read_fasta
from s2t2_dist.api import RecordPolicy
from s2t2_dist.api import write_shards
from s2t2_dist.api import split_dataset
AA = "ACDEFGHIKLMNPQRSTVWY"
EXTRA = "UXBZO"


def cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Timer:
    def __enter__(self):
        self.w0, self.c0 = time.perf_counter(), cpu()
        return self

    def __exit__(self, *a):
        self.wall, self.cpu = time.perf_counter() - self.w0, cpu() - self.c0


def real_sequences(protein_dir: Path) -> list[str]:
    seqs = []
    for f in ("mmseqs2_QUERY_uniprotkb.fasta", "bio_embeddings_disprot_disordercdhit.fasta",
              "esm_some_proteins_uniref50.fasta"):
        if (protein_dir / f).is_file():  # the shipped sample (s2t2_dist/assets/protein) has the first and the last
            seqs += [r.text for r in read_fasta(protein_dir / f) if r.text]
    return seqs


_AB_CODE = """
import cProfile, json, os, pstats, time
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
import webdataset  # loaded beforehand, as in `s2t2 prepare` (which has torch loaded): its import is not counted
from s2t2_dist.data import shards
assert shards.__file__.startswith({tree!r}), shards.__file__
prof = cProfile.Profile(time.process_time) if {profile!r} else None
c0, w0, n, sha = time.process_time(), time.perf_counter(), 0, []
if prof:
    prof.enable()
for split in ("train", "eval"):
    m = shards.write_shards(split_dir={splits!r}, split=split, tokenizer={tok!r},
                            output_dir=os.path.join({out!r}, split), context_len={T}, shard_size={S}, num_workers=0,
                            progress=False)
    n += m["totals"]["n_samples"]
    sha += [s["sha256"] for s in m["shards"]]
cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - w0
writer = None
if prof:
    prof.disable()
    # the shard writer's share, observed by the profiler (nothing of the package replaced): its methods' cumulative
    # time over the profiled step's, so the profiler's own overhead cancels out to first order
    st = pstats.Stats(prof).stats
    keys = {{(f.__code__.co_filename, f.__code__.co_firstlineno, f.__code__.co_name)
             for f in (shards.ShardFile.__init__, shards.ShardFile.write, shards.ShardFile.commit)}}
    writer = sum(v[3] for k, v in st.items() if k in keys) / max(cpu_s, 1e-9)
print(json.dumps({{"wall_s": wall_s, "cpu_s": cpu_s, "writer_share": writer, "samples": n, "sha256": sha}}))
"""


def _env_importing(tree: Path) -> dict:
    """The environment of a child process that imports the package from ``tree`` (put first on PYTHONPATH)."""
    old = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=str(tree) + (os.pathsep + old if old else ""))


def ab_shards(trees: dict[str, Path], work: Path, reps: int, context_len: int, shard_size: int) -> dict:
    """The shards step (train + eval, 0 workers) with each checkout's package, alternating, ``reps`` times each,
    then once more each under the profiler (the writer's share of the step; its times are not the A/B's)."""
    import subprocess

    runs: dict[str, list[dict]] = {name: [] for name in trees}
    work = work.resolve()  # each child runs in its checkout (a child imports from its cwd first)
    for rep in range(reps + 1):
        for name, tree in trees.items():
            out, tree = work / f"ab_{name}", tree.resolve()
            shutil.rmtree(out, ignore_errors=True)
            code = _AB_CODE.format(tree=str(tree), splits=str(work / "splits"), tok=str(work / "tok"),
                                   out=str(out), T=context_len, S=shard_size, profile=rep == reps)
            stdout = subprocess.check_output([sys.executable, "-c", code], env=_env_importing(tree), cwd=tree)
            runs[name].append(json.loads(stdout.decode()))
    return runs


def ab_rows(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per checkout: the timed runs' walls and CPU seconds, and the profiled run's writer share."""
    rows = {}
    for name, rs in runs.items():
        timed, profiled = [r for r in rs if r["writer_share"] is None], [r for r in rs if r["writer_share"] is not None]
        rows[name] = {"wall_s": [r["wall_s"] for r in timed], "cpu_s": [r["cpu_s"] for r in timed],
                      "writer_share": profiled[-1]["writer_share"] if profiled else None,
                      "samples": rs[0]["samples"], "sha256": rs[0]["sha256"]}
    return rows


def make_fasta(path: Path, seqs: list[str], residues: int, seed: int = 0, mutation_rate: float = 0.05):
    """Resample real sequences with ~5% point mutations (drawn from the real residue frequencies), so that every
    record is unique as in UniRef50 (a verbatim resample would hit the BPE word cache and flatter tokenization)."""
    rng = random.Random(seed)
    pool = "".join(seqs)
    n = total = 0
    with gzip.open(path, "wt", compresslevel=6) as f:
        while total < residues:
            s = list(rng.choice(seqs))
            for i in rng.sample(range(len(s)), max(1, int(len(s) * mutation_rate))):
                s[i] = pool[rng.randrange(len(pool))]
            s = "".join(s)
            n += 1
            total += len(s)
            f.write(f">UniRef50_BENCH{n:09d} Resampled protein n=1 Tax=Bench TaxID=0 RepID=BENCH{n}_X\n")
            for i in range(0, len(s), 60):
                f.write(s[i:i + 60] + "\n")
    return n, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--residues", type=float, default=20e6)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--shard-size", type=int, default=8192)
    ap.add_argument("--workdir", default="/tmp/s2t2_bench_prepare")
    shared = Path(os.environ.get("S2T2_SHARED_DATA", "/work/shared/data")) / "protein"
    ap.add_argument("--protein-dir", default=str(shared if shared.is_dir() else
                                                 Path(__file__).resolve().parents[1] / "s2t2_dist/assets/protein"))
    ap.add_argument("--baseline-tree", default=None, help="a checkout to compare the shards step with (see above)")
    ap.add_argument("--ab-reps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    fasta = work / f"bench_{int(a.residues)}.fasta.gz"
    if not fasta.exists():
        n, total = make_fasta(fasta, real_sequences(Path(a.protein_dir)), int(a.residues))
    res: dict = {"cpus_visible": os.cpu_count(), "fasta": str(fasta), "fasta_gz_bytes": fasta.stat().st_size}

    with Timer() as t:
        nbytes = 0
        with gzip.open(fasta, "rb") as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    break
                nbytes += len(b)
    res["decompress"] = {"wall_s": t.wall, "cpu_s": t.cpu, "uncompressed_bytes": nbytes}

    with Timer() as t:
        n_rec = n_res = 0
        for r in read_fasta(fasta, allowed=AA + EXTRA):
            n_rec += 1
            n_res += len(r.text)
    res["records"], res["residues"] = n_rec, n_res
    res["read"] = {"wall_s": t.wall, "cpu_s": t.cpu}

    policy = RecordPolicy(alphabet=AA, extra_residues=EXTRA)
    shutil.rmtree(work / "splits", ignore_errors=True)
    with Timer() as t:
        split_dataset(inputs=[str(fasta)], output_dir=work / "splits", policy=policy, eval_fraction=0.01,
                      chunk_records=200_000, progress=False)
    res["split"] = {"wall_s": t.wall, "cpu_s": t.cpu}

    shutil.rmtree(work / "tok", ignore_errors=True)
    with Timer() as t:
        train_tokenizer(split_dir=work / "splits", output_dir=work / "tok", vocab_size=512, kind="char",
                        alphabet=AA + EXTRA, max_records=20_000, progress=False)
    res["bpe_train_20k_records"] = {"wall_s": t.wall, "cpu_s": t.cpu}

    for nw in a.workers:
        shutil.rmtree(work / "shards", ignore_errors=True)
        with Timer() as t:
            for split in ("train", "eval"):
                write_shards(split_dir=work / "splits", split=split, tokenizer=work / "tok",
                             output_dir=work / "shards" / split, context_len=a.context_len,
                             shard_size=a.shard_size, num_workers=nw, progress=False)
        res[f"shards_workers{nw}"] = {"wall_s": t.wall, "cpu_s": t.cpu}

    # tokenization alone, one thread, same texts (what the shard step cannot go below)
    import subprocess

    code = (
        "import os,time,resource;os.environ['TOKENIZERS_PARALLELISM']='false';"
        "from s2t2_dist.api import load_tokenizer, iter_split_texts;"
        f"t=list(iter_split_texts({str(work / 'splits')!r},'train'));i=load_tokenizer({str(work / 'tok')!r}).tokenizer;"
        "c0=time.process_time();[i.encode_batch_fast(t[k:k+2000],add_special_tokens=False) for k in range(0,len(t),2000)];"
        "print(time.process_time()-c0)")
    env = _env_importing(Path(__file__).resolve().parents[1])
    res["tokenize_only_1thread_train_cpu_s"] = float(subprocess.check_output([sys.executable, "-c", code],
                                                                             env=env).decode())

    R = res["residues"]
    rows = [("decompress only", res["decompress"]), ("read (decompress + parse + check)", res["read"]),
            ("split (step 1)", res["split"])]
    for nw in a.workers:
        rows.append((f"shards, {nw} workers (step 3)", res[f"shards_workers{nw}"]))
        rows.append((f"prepare = split + shards ({nw} workers)",
                     {k: res["split"][k] + res[f"shards_workers{nw}"][k] for k in ("wall_s", "cpu_s")}))
    print(f"\n{R / 1e6:.1f} M residues, {res['records']:,} records, {res['fasta_gz_bytes'] / 1e6:.1f} MB gz, "
          f"{os.cpu_count()} CPUs visible\n")
    print("| stage | wall s | CPU s | M residues/s (wall) | M residues per CPU-s |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {R / r['wall_s'] / 1e6:.2f} | {R / r['cpu_s'] / 1e6:.2f} |")
    tok_cpu = res["tokenize_only_1thread_train_cpu_s"]
    print(f"| tokenize only (encode_batch_fast, 1 thread, train split) | - | {tok_cpu:.2f} | - | "
          f"{R * 0.99 / tok_cpu / 1e6:.2f} |")
    best = min(a.workers, key=lambda w: res["split"]["cpu_s"] + res[f"shards_workers{w}"]["cpu_s"])
    prep_cpu = res["split"]["cpu_s"] + res[f"shards_workers{best}"]["cpu_s"]
    res["ratio_prepare_vs_read_per_core"] = prep_cpu / res["read"]["cpu_s"]
    res["ratio_prepare_vs_decompress_per_core"] = prep_cpu / res["decompress"]["cpu_s"]
    print(f"\nper core, prepare is {res['ratio_prepare_vs_read_per_core']:.1f}x slower than reading the FASTA "
          f"and {res['ratio_prepare_vs_decompress_per_core']:.1f}x slower than decompressing it (target: 3x)")
    if a.baseline_tree:
        trees = {"baseline": Path(a.baseline_tree), "this": Path(__file__).resolve().parents[1]}
        runs = ab_shards(trees, work, a.ab_reps, a.context_len, a.shard_size)
        res["ab_shards_workers0"] = runs
        print(f"\nshards step (train + eval, 0 workers), {a.ab_reps} alternating runs each, fresh processes:\n")
        print("| checkout | wall s (each run) | CPU s (each run) | shard writer share of the step (profiled run) |")
        print("|---|---|---|---:|")
        rows = ab_rows(runs)
        for name, r in rows.items():
            walls = " / ".join(f"{x:.2f}" for x in r["wall_s"])
            cpus = " / ".join(f"{x:.2f}" for x in r["cpu_s"])
            print(f"| {name} ({trees[name]}) | {walls} | {cpus} | {r['writer_share']:.1%} |")
        same = rows["baseline"]["sha256"] == rows["this"]["sha256"]
        print(f"\n{rows['this']['samples']:,} samples; all shards byte-identical between the two: {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
