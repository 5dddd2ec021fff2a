"""Data I/O: read inputs (FASTA, jsonl, parquet, HF datasets, text), split, train the BPE, write shards, load them.

Steps (each a plain function; `pipeline.prepare(DataConfig)` runs them all):

1. `split_dataset`   stream the input once -> deterministic train/eval split (JSON-lines parts + split.json)
2. `train_tokenizer` BPE on the train split -> Hugging Face tokenizer directory + compression report (loading,
   hashing and reading any tokenizer: `tokenizers`)
3. `write_shards`    tokenize a split with any tokenizer -> webdataset tar shards + manifest.json
4. `GlobalTrainLoader` / `EvalDocs`  exact, resumable iteration over the shards (the one training loader: its
   position is global and so resumes on another number of ranks) and the eval documents of a rank
"""

from .bpe import compression_report, train_tokenizer
from .config import DataConfig
from s2t2_dist.errors import DataError, DataFormatError, ManifestError, ShardError
from .fasta import Record, read_fasta
from .records import RecordFilter, RecordPolicy, read_raw
from .shards import load_manifest, write_shards
from .split import load_split, split_dataset, split_of
from .tokenizers import TokenizerInfo, load_tokenizer, tokenizer_hash

__all__ = [
    "DataConfig", "DataError", "DataFormatError", "ManifestError", "ShardError", "Record", "RecordFilter",
    "RecordPolicy", "TokenizerInfo", "compression_report", "load_manifest", "load_split", "load_tokenizer",
    "read_fasta", "read_raw", "split_dataset", "split_of", "tokenizer_hash", "train_tokenizer", "write_shards",
    "GlobalTrainLoader", "EvalDocs", "prepare",
]


def __getattr__(name):  # torch-dependent and orchestration parts load lazily (prepare does not need torch)
    if name == "EvalDocs":
        from .reader import EvalDocs

        return EvalDocs
    if name == "GlobalTrainLoader":
        from .global_loader import GlobalTrainLoader

        return GlobalTrainLoader
    if name == "prepare":
        from .pipeline import prepare

        return prepare
    raise AttributeError(name)
