"""`DataConfig`: every knob of `s2t2 prepare`, one flat dataclass with a `validate()` naming the bad key.

The project's config system (`s2t2_dist.config`) loads it from YAML like any other section; the step functions
themselves take explicit keyword arguments (see `s2t2_dist.data.pipeline.prepare` for the mapping).
"""

from __future__ import annotations

import glob
import os
import typing
from dataclasses import dataclass, field
from typing import Literal

from s2t2_dist.errors import ConfigError
from s2t2_dist.data.records import InputFormatName

PROTEIN_ALPHABET = "ACDEFGHIKLMNPQRSTVWY"  # the 20 standard amino acids
PROTEIN_EXTRA = "UXBZO"  # selenocysteine, unknown, Asx, Glx, pyrrolysine (all occur in UniRef50)



@dataclass
class DataConfig:
    # -- input -------------------------------------------------------------------------------------------------
    #: files, directories, globs, or hub ids (format: hub)
    inputs: list[str] = field(default_factory=list)
    #: input format: auto (from each file name) or a format of data/records.py FORMATS (fasta, jsonl, parquet,
    #: hf_disk: a save_to_disk directory, hub: hub ids, text)
    format: InputFormatName = "auto"
    #: id column of tables / jsonl / HF datasets; null: id = "<file name>:<line or row>"
    id_column: str | None = "id"
    #: column holding the sequence / text, e.g. "sequence", "Sequence", "text"
    text_column: str = "sequence"
    #: split of a DatasetDict on disk / on the hub
    hf_split: str = "train"
    #: plain-text files: one doc per line / blank-line block / file
    text_mode: Literal["line", "paragraph", "file"] = "line"
    # -- record policy -----------------------------------------------------------------------------------------
    #: protein (amino-acid alphabet, char-level BPE) or text (any characters, byte-level BPE)
    domain: Literal["protein", "text"] = "protein"
    #: "auto" (protein: the 20 amino acids; text: any), "any", or the allowed letters
    alphabet: str = "auto"
    #: protein letters handled by extra_residue_policy
    extra_residues: str = PROTEIN_EXTRA
    #: a record with an extra residue: keep it, replace the residue, skip the record (counted), or stop
    extra_residue_policy: Literal["keep", "replace", "skip", "error"] = "keep"
    #: what "replace" writes instead of an extra residue
    replacement: str = "X"
    #: upper-case sequences before checking them
    uppercase: bool = False
    #: shortest record kept, in characters; shorter ones are filtered (counted)
    min_length: int = 1
    #: longest record kept, in characters (null: no limit); longer ones are filtered (counted)
    max_length: int | None = None
    #: a malformed record (no header, bad JSON, bad character...): stop naming FILE:LINE, or skip it (counted)
    on_bad_record: Literal["error", "skip"] = "error"
    # -- split -------------------------------------------------------------------------------------------------
    #: fraction of the records held out for evaluation (by a hash of split_by: stable across runs)
    eval_fraction: float = 0.01
    #: hash of the record id, or of its text (identical texts share a split)
    split_by: Literal["id", "text"] = "id"
    #: seed of the split hash and of the tokenizer training sample
    seed: int = 0
    #: input records per split commit (the unit of resuming step 1)
    chunk_records: int = 1_000_000
    # -- tokenizer ---------------------------------------------------------------------------------------------
    #: tokens of the new BPE, its 4 special tokens included (the paper: 512 for UniRef50)
    vocab_size: int = 512
    #: auto: char for protein, byte-level for text
    tokenizer_kind: Literal["auto", "char", "byte"] = "auto"
    #: pairs seen fewer times than this are not merged by the BPE
    min_frequency: int = 2
    #: the source LM's tokenizer (file or dir): compression report + baseline shards
    source_tokenizer: str | None = None
    #: use this tokenizer (an earlier run's BPE, a model's own) instead of training one
    tokenizer_path: str | None = None
    #: deterministic sample of the train split for BPE training (at most this many records; see tokenizer_max_chars)
    tokenizer_max_records: int | None = 500_000
    #: memory bound of BPE training: the sample stops at this many characters. Training holds ~60 bytes per character
    #: sampled (protein, char-level: ~29 KB per UniRef50 record of ~480 residues); 50M ~ 3 GB peak, ~100k records
    tokenizer_max_chars: int | None = 50_000_000
    # -- shards ------------------------------------------------------------------------------------------------
    #: tokens per packed train block (the training context length)
    context_len: int = 512
    #: samples per shard: packed blocks (train) or documents (eval)
    shard_size: int = 8192
    #: tokenizer processes (0: in this process, using the tokenizer's own threads)
    num_workers: int = 0
    #: where splits/, tokenizer/, shards/ and prepare_summary.json are written
    output_dir: str = "data/prepared"

    # -- derived ------------------------------------------------------------------------------------------------
    def allowed_alphabet(self) -> str | None:
        """Letters a record may contain (None: anything)."""
        if self.alphabet == "any":
            return None
        if self.alphabet == "auto":
            return PROTEIN_ALPHABET if self.domain == "protein" else None
        return self.alphabet

    def resolved_tokenizer_kind(self) -> str:
        if self.tokenizer_kind != "auto":
            return self.tokenizer_kind
        return "char" if self.domain == "protein" else "byte"

    def validate(self) -> None:  # noqa: C901 - one flat check per key, each a one-line error naming it
        def bad(key: str, msg: str) -> ConfigError:
            return ConfigError(f"{key}: {msg}")

        if not self.inputs:
            raise bad("inputs", "no input given (files, directories, globs or hub ids)")
        if self.format not in typing.get_args(InputFormatName):
            raise bad("format", f"{self.format!r} is not one of {list(typing.get_args(InputFormatName))}")
        if self.format != "hub":
            for p in self.inputs:
                if not (os.path.exists(p) or glob.glob(p)):
                    raise bad("inputs", f"{p!r} does not exist")
        if not self.text_column:
            raise bad("text_column", "must name the column holding the sequence/text")
        if self.alphabet not in ("auto", "any") and not self.alphabet:
            raise bad("alphabet", 'empty; use "any" to accept every character')
        if self.extra_residue_policy == "replace" and len(self.replacement) != 1:
            raise bad("replacement", f"must be one character, got {self.replacement!r}")
        if self.min_length < 0:
            raise bad("min_length", f"must be >= 0, got {self.min_length}")
        if self.max_length is not None and self.max_length < max(self.min_length, 1):
            raise bad("max_length", f"{self.max_length} is below min_length {self.min_length}")
        if self.on_bad_record not in ("error", "skip"):
            raise bad("on_bad_record", f'must be "error" or "skip", got {self.on_bad_record!r}')
        if not 0.0 <= self.eval_fraction < 1.0:
            raise bad("eval_fraction", f"must be in [0, 1), got {self.eval_fraction}")
        if self.chunk_records < 1:
            raise bad("chunk_records", f"must be >= 1, got {self.chunk_records}")
        if self.vocab_size < 8:
            raise bad("vocab_size", f"must be >= 8 (4 special tokens + an alphabet), got {self.vocab_size}")
        kind = self.resolved_tokenizer_kind()
        alpha = self.allowed_alphabet()
        if kind == "char" and alpha is not None:
            need = len(set(alpha) | (set(self.extra_residues) if self.extra_residue_policy == "keep" else set())) + 4
            if self.vocab_size < need:
                raise bad("vocab_size", f"{self.vocab_size} is smaller than the alphabet plus special tokens ({need})")
        if kind == "byte" and self.vocab_size < 256 + 4:
            raise bad("vocab_size", f"a byte-level tokenizer needs >= 260 tokens (256 bytes + specials), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise bad("min_frequency", f"must be >= 1, got {self.min_frequency}")
        st = self.source_tokenizer
        if st is not None and not os.path.exists(st) and (os.path.isabs(st) or st.count("/") != 1):
            raise bad("source_tokenizer", f"{st!r} is neither a local tokenizer file/directory nor a hub id owner/name")
        tp = self.tokenizer_path
        if tp is not None and not os.path.exists(tp) and (os.path.isabs(tp) or tp.count("/") != 1):
            raise bad("tokenizer_path", f"{tp!r} is neither a local tokenizer file/directory nor a hub id owner/name")
        if self.tokenizer_max_records is not None and self.tokenizer_max_records < 1:
            raise bad("tokenizer_max_records", "must be >= 1 or null (use the whole train split)")
        if self.tokenizer_max_chars is not None and self.tokenizer_max_chars < 1:
            raise bad("tokenizer_max_chars", "must be >= 1 or null (no memory bound)")
        if self.context_len < 2:
            raise bad("context_len", f"must be >= 2, got {self.context_len}")
        if self.shard_size < 1:
            raise bad("shard_size", f"must be >= 1, got {self.shard_size}")
        if self.num_workers < 0:
            raise bad("num_workers", f"must be >= 0, got {self.num_workers}")
        if not 0 <= self.seed <= 2**32 - 1:
            raise bad("seed", f"must be in [0, {2**32 - 1}], got {self.seed}")
        if not self.output_dir:
            raise bad("output_dir", "must be a directory path")


@dataclass
class DataPaths:
    """The `data:` section of translate and finetune: what `s2t2 prepare` wrote, and how it is read."""

    #: directory of train shards (holding manifest.json), written by `s2t2 prepare`
    train: str = ""
    #: directory of eval shards (documents with byte counts); empty: no evaluation
    eval: str = ""
    #: the target tokenizer directory (the new BPE)
    tokenizer: str = ""
    #: DataLoader worker processes reading the train shards (0: in the training process)
    num_workers: int = 0
    #: train samples shuffled together in a seeded window (larger: better mixing, more memory)
    shuffle_window: int = 4096

    def validate(self) -> None:
        for k in ("train", "tokenizer"):
            if not getattr(self, k):
                raise ConfigError(f"{k}: required (a directory written by `s2t2 prepare`)")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers: must be >= 0, got {self.num_workers}")
        if self.shuffle_window < 1:  # a window of 0 samples would shuffle nothing and serve nothing
            raise ConfigError(f"shuffle_window: must be >= 1 (1: no shuffling within the epoch's order), got "
                              f"{self.shuffle_window}")
