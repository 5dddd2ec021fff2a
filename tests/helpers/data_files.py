"""Real data for the data tests.

The protein sample, the OLMo tokenizer and the English sample are shipped in `s2t2_dist/assets` (with their
licences), so the tests that use them run on any machine. A few tests use larger real files that exist only in this
workplace's shared data directory (``S2T2_SHARED_DATA``, default /work/shared/data); they skip elsewhere.
"""

import os
from pathlib import Path

import pytest

from s2t2_dist.data.bpe import train_tokenizer
from s2t2_dist.data.records import RecordPolicy
from s2t2_dist.data.split import split_dataset
from s2t2_dist.models.hf import asset_path

AA = "ACDEFGHIKLMNPQRSTVWY"
EXTRA = "UXBZO"

MMSEQS = asset_path("protein", "mmseqs2_QUERY_uniprotkb.fasta")  # 500 UniProtKB sequences, ">tr|A7TBS3|..." headers
ESM = asset_path("protein", "esm_some_proteins_uniref50.fasta")  # 15 UniRef50 representatives, bare-id headers
OLMO_TOKENIZER = asset_path("olmo", "allenai_gpt-neox-olmo-dolma-v1_5.json")  # the tokenizer of allenai/OLMo-1B-hf
SHAKESPEARE = asset_path("english", "tinyshakespeare_head.txt")  # 100 KB, speeches separated by blank lines

SHARED = Path(os.environ.get("S2T2_SHARED_DATA", "/work/shared/data"))
DISPROT = SHARED / "protein" / "bio_embeddings_disprot_disordercdhit.fasta"  # 1,162 sequences, U and X, one 34,350 long
C4_FILES = sorted((SHARED / "english").glob("olmo_c4-sample.0*.json.gz"))  # 30 C4 documents (ODC-BY, not shipped)
needs_disprot = pytest.mark.skipif(not DISPROT.is_file(), reason=f"{DISPROT} is not present (not shipped)")
needs_c4 = pytest.mark.skipif(not C4_FILES, reason=f"C4 samples not present under {SHARED / 'english'} (not shipped)")


def split_and_train(root: Path, inputs, *, eval_fraction: float = 0.1, vocab_size: int = 512,
                    max_records: int | None = None, compare_with: dict | None = None,
                    chunk_records: int = 1_000_000) -> dict:
    """Step 1 (into root/splits) and step 2 (a residue-level BPE into root/tok) on real FASTA files."""
    split_dataset(inputs=[str(p) for p in inputs], output_dir=root / "splits",
                  policy=RecordPolicy(alphabet=AA, extra_residues=EXTRA), eval_fraction=eval_fraction,
                  chunk_records=chunk_records, progress=False)
    return train_tokenizer(split_dir=root / "splits", output_dir=root / "tok", vocab_size=vocab_size, kind="char",
                           alphabet=AA + EXTRA, max_records=max_records, compare_with=compare_with, progress=False)
