"""The real-LM reproduction's protein corpus: every diverse protein sequence shipped, deduplicated, with a held-out
split decided by a hash of the sequence itself.

Sources (s2t2_dist/assets/protein, licences beside them): 500 UniProtKB/TrEMBL sequences (MMseqs2's example
query set), 1,162 DisProt/UniProt sequences (bio_embeddings' DisProt example) and 15 UniRef50 representatives
(ESM's example). The three-family alignments are not used: thousands of near-copies of three proteins would let
a model score well by memorising them.

Deduplication is by the upper-cased sequence (the same protein under two ids counts once; the first id is kept).
A sequence is held out iff `split_of(sequence, eval_fraction=heldout_fraction, seed=HELDOUT_SEED)` says eval, so no
sequence is in both splits and the split does not depend on file order. The training split is written to
`trainval.fasta` (its validation part is carved later by `prepare`, from another hash seed), the held-out one to
`heldout.fasta`; `corpus.json` records the counts and checksums. Written atomically; a rerun with the same inputs
returns the recorded summary without rewriting.
"""

from __future__ import annotations

import json
from pathlib import Path

from s2t2_dist.api import read_fasta
from s2t2_dist.api import split_of
from s2t2_dist.api import atomic_open, atomic_write_json, sha256_file

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "protein"
#: file -> what it is (the FASTA files the corpus reads, in this order)
SOURCES = {
    "mmseqs2_QUERY_uniprotkb.fasta": "UniProtKB/TrEMBL (MMseqs2 example, MIT)",
    "bio_embeddings_disprot_disordercdhit.fasta": "DisProt/UniProt (bio_embeddings example, MIT)",
    "esm_some_proteins_uniref50.fasta": "UniRef50 representatives (ESM example, MIT)",
}
#: the held-out split's hash seed (the validation split inside the training split uses another: see reproduce)
HELDOUT_SEED = 7
FORMAT = "s2t2-protein-corpus-1"


def source_files() -> list[Path]:
    files = [ASSETS / name for name in SOURCES]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shipped protein files missing: {', '.join(missing)}")
    return files


def unique_sequences(files: list[Path]) -> tuple[list[tuple[str, str]], dict]:
    """(id, sequence) of every distinct upper-cased sequence, first occurrence kept, and the counts per file."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    counts: dict[str, dict[str, int]] = {}
    for f in files:
        c = counts.setdefault(f.name, {"records": 0, "duplicates": 0, "bad": 0})
        for rec in read_fasta(f):
            c["records"] += 1
            if rec.text is None:
                c["bad"] += 1
                continue
            seq = rec.text.upper()
            if seq in seen:
                c["duplicates"] += 1
                continue
            seen.add(seq)
            out.append((rec.id, seq))
    return out, counts


def _write_fasta(path: Path, records: list[tuple[str, str]], width: int = 80) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        for rid, seq in records:
            f.write(f">{rid}\n")
            for i in range(0, len(seq), width):
                f.write(seq[i:i + width] + "\n")


def build_corpus(out: Path, *, heldout_fraction: float = 0.1) -> dict:
    """Write OUT/trainval.fasta, OUT/heldout.fasta and OUT/corpus.json (once); return the summary."""
    out = Path(out)
    files = source_files()
    inputs = {f.name: sha256_file(f) for f in files}
    summary_path = out / "corpus.json"
    if summary_path.is_file():
        old = json.loads(summary_path.read_text())
        if old.get("inputs") == inputs and old.get("heldout_fraction") == heldout_fraction \
                and all((out / n).is_file() for n in ("trainval.fasta", "heldout.fasta")):
            return old
    records, counts = unique_sequences(files)
    held = [r for r in records if split_of(r[1], eval_fraction=heldout_fraction, seed=HELDOUT_SEED) == "eval"]
    held_set = {r[1] for r in held}
    train = [r for r in records if r[1] not in held_set]
    out.mkdir(parents=True, exist_ok=True)
    _write_fasta(out / "trainval.fasta", train)
    _write_fasta(out / "heldout.fasta", held)

    def stats(rs):
        lens = sorted(len(s) for _, s in rs)
        return {"sequences": len(rs), "residues": sum(lens), "longest": lens[-1] if lens else 0,
                "median": lens[len(lens) // 2] if lens else 0}

    summary = {"format": FORMAT, "inputs": inputs, "per_file": counts, "heldout_fraction": heldout_fraction,
               "heldout_seed": HELDOUT_SEED, "unique": len(records), "trainval": stats(train),
               "heldout": stats(held)}
    atomic_write_json(summary_path, summary)
    return summary
