"""Step 2: train the target-domain BPE tokenizer (loading, hashing and reading tokenizers: data/tokenizers.py).

Proteins get a character-level BPE over residues (initial alphabet = the allowed letters, no pre-tokenizer, so
merges run over whole sequences, as the paper's 512-token UniRef50 tokenizer); other text gets a byte-level BPE
(GPT-2 style pre-tokenization, no unknown tokens). Special tokens ``<s>`` (BOS), ``</s>`` (EOS), ``<pad>``, and
``<unk>`` take ids 0..3. The output directory is a standard Hugging Face tokenizer directory::

    tokenizer.json, tokenizer_config.json, special_tokens_map.json   (AutoTokenizer.from_pretrained(dir) works)
    bpe_training.json                                                (params, training sample, compression report)
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Iterable, Iterator

from s2t2_dist.utils.io import atomic_dir, atomic_write_json

from s2t2_dist.errors import DataError, ManifestError

from .tokenizers import TokenizerInfo, load_tokenizer, tokenizer_file

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]


# ---------------------------------------------------------------------------------------------------------------
# training


def build_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int = 512, kind: str = "char",
                        alphabet: str | None = None, min_frequency: int = 2, length: int | None = None):
    """Train and return a ``tokenizers.Tokenizer`` (not saved). ``alphabet``: letters always in the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if kind == "char":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        tok.decoder = decoders.Fuse()
        initial = sorted(set(alphabet)) if alphabet else []
    elif kind == "byte":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        initial = pre_tokenizers.ByteLevel.alphabet()
    else:
        raise DataError(f"tokenizer_kind: {kind!r} is not 'char' or 'byte'")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=initial, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                       special_tokens=[(BOS, bos)])
    return tok


def save_tokenizer_dir(tok, output_dir: str | os.PathLike, *, context_len: int = 512, extra: dict | None = None) -> Path:
    """Write ``tok`` as a Hugging Face tokenizer directory, atomically (built in ``dir.tmp``, then renamed)."""
    out = Path(output_dir)
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    files = {  # written by hand (not save_pretrained) so that transformers 4.x and 5.x both load it with AutoTokenizer
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **specials,
                                  "model_max_length": context_len, "clean_up_tokenization_spaces": False,
                                  "padding_side": "right"},
        "special_tokens_map.json": specials,
    }
    if extra is not None:
        files["bpe_training.json"] = extra
    with atomic_dir(out) as tmp:
        tok.save(str(tmp / "tokenizer.json"))
        for name, obj in files.items():
            (tmp / name).write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    return out


#: measured peak memory of char-level BPE training per character of its sample (bench/bench_bpe_memory.py: 60-72
#: bytes on UniProt protein records at 5,000-100,000 records; BENCHMARKS.md, "Data pipeline")
BPE_BYTES_PER_CHAR = 64


def sample_for_tokenizer(split_dir: str | os.PathLike, *, max_records: int | None, seed: int = 0,
                         max_chars: int | None = None) -> Iterator[str]:
    """A deterministic sample of about ``max_records`` train texts (by a hash of the id, not the first N), and of
    at most ``max_chars`` characters: BPE training holds ~BPE_BYTES_PER_CHAR bytes per character, so this bounds
    its memory. The sampling fraction aims at the smaller budget; the character budget is also a hard stop."""
    from .split import iter_split_docs, load_split, split_hash_u64

    m = load_split(split_dir)
    n, chars = m["records"]["train"], m["chars"]["train"]
    frac = 1.0
    if max_records is not None and max_records < n:
        frac = max_records / n
    if max_chars is not None and max_chars < chars:
        frac = min(frac, max_chars / chars)
    limit = frac * 2.0**64
    taken = 0
    for _, rid, text in iter_split_docs(split_dir, "train"):
        if frac >= 1.0 or split_hash_u64(rid, seed + 7919) < limit:
            taken += len(text)
            if max_chars is not None and taken > max_chars:
                return
            yield text


def train_tokenizer(*, split_dir: str | os.PathLike, output_dir: str | os.PathLike, vocab_size: int = 512,
                    kind: str = "char", alphabet: str | None = None, min_frequency: int = 2,
                    max_records: int | None = 500_000, max_chars: int | None = None, seed: int = 0,
                    context_len: int = 512,
                    compare_with: dict[str, str] | None = None, report_max_records: int = 20_000,
                    progress: bool = True) -> dict:
    """Train the BPE on (a deterministic sample of) the train split of step 1 and save it to ``output_dir``.

    ``compare_with``: {name: tokenizer path} (e.g. the source LM's tokenizer) for the compression report, measured
    on the eval split. Returns the report (also in ``output_dir/bpe_training.json``). Skips the training if
    ``output_dir`` already holds a tokenizer trained with the same parameters on the same split.
    """
    from .split import load_split, split_manifest_hash

    load_split(split_dir)
    params = {"vocab_size": vocab_size, "kind": kind, "alphabet": alphabet, "min_frequency": min_frequency,
              "max_records": max_records, "seed": seed, "context_len": context_len,
              "split_hash": split_manifest_hash(split_dir)}
    if max_chars is not None:  # absent when unbounded: tokenizers trained before the key existed still match
        params["max_chars"] = max_chars
    out = Path(output_dir)
    info_file = out / "bpe_training.json"
    if info_file.is_file() and (out / "tokenizer.json").is_file():
        done = json.loads(info_file.read_text())
        if done.get("params") == params:
            return done
        # Never replace a tokenizer made with other settings: shards, summaries and runs may depend on it.
        theirs = done.get("params") or {}
        changed = ", ".join(f"{k} {theirs.get(k)!r} -> {v!r}" for k, v in params.items() if theirs.get(k) != v)
        raise ManifestError(f"{out}: this directory holds a tokenizer made with other settings ({changed}); "
                            "choose another output_dir or delete it")
    count = [0, 0]

    def texts():
        it = sample_for_tokenizer(split_dir, max_records=max_records, seed=seed, max_chars=max_chars)
        if progress:
            from tqdm.auto import tqdm

            it = tqdm(it, desc="bpe: reading sample", unit="rec", dynamic_ncols=True)
        for t in it:
            count[0] += 1
            count[1] += len(t)
            yield t

    tok = build_bpe_tokenizer(texts(), vocab_size=vocab_size, kind=kind, alphabet=alphabet,
                              min_frequency=min_frequency)
    if count[0] == 0:
        raise DataError(f"{split_dir}: the train split is empty; nothing to train a tokenizer on")
    report = {"params": params, "trained_on": {"records": count[0], "chars": count[1],
                                               "est_peak_bytes": BPE_BYTES_PER_CHAR * count[1]},
              "vocab_size": tok.get_vocab_size(with_added_tokens=True)}
    save_tokenizer_dir(tok, out, context_len=context_len, extra=report)
    return _finish_report(report, split_dir, out, compare_with, report_max_records)


def _finish_report(report: dict, split_dir, out: Path, compare_with: dict | None, report_max_records: int) -> dict:
    """Add the tokenizer's hash and its compression on held-out text (eval split; train split if there is no eval
    split) to ``report`` and save it as ``out/bpe_training.json`` (written last: the step's completion marker)."""
    from .split import iter_split_docs, load_split

    m = load_split(split_dir)
    which = "eval" if m["records"]["eval"] else "train"
    sample = [t for i, _, t in iter_split_docs(split_dir, which) if i < report_max_records]
    toks = {"new": load_tokenizer(out, name="new")}
    for nm, p in (compare_with or {}).items():
        toks[nm] = load_tokenizer(p, name=nm)
    report["tokenizer_hash"] = toks["new"].hash
    report["compression"] = compression_report(sample, toks)
    report["compression"]["measured_on"] = f"{which} split, first {len(sample)} records"
    atomic_write_json(out / "bpe_training.json", report)
    return report


def adopt_tokenizer(path: str | os.PathLike, *, split_dir: str | os.PathLike, output_dir: str | os.PathLike,
                    compare_with: dict[str, str] | None = None, report_max_records: int = 20_000) -> dict:
    """Use an existing tokenizer instead of training one: a target BPE from an earlier `prepare` (its directory or
    tokenizer.json) or a model's own tokenizer (its directory, or a hub id). Its files are copied verbatim into
    ``output_dir`` (so its hash is kept and the layout is the same as after training); the report records where it
    came from and its hash. Skips the copy if ``output_dir`` already holds the same tokenizer for the same split."""
    from .split import load_split, split_manifest_hash

    load_split(split_dir)
    src = tokenizer_file(path)
    info = load_tokenizer(src)  # checks it is usable (an end-of-document token) before anything is written
    params = {"adopted_from": str(path), "tokenizer_hash": info.hash, "split_hash": split_manifest_hash(split_dir)}
    out = Path(output_dir)
    info_file = out / "bpe_training.json"
    if info_file.is_file() and (out / "tokenizer.json").is_file():
        done = json.loads(info_file.read_text())
        if done.get("params") == params:
            return done
    with atomic_dir(out) as tmp:
        shutil.copyfile(src, tmp / "tokenizer.json")
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if (src.parent / name).is_file():
                shutil.copyfile(src.parent / name, tmp / name)
    report = {"params": params, "adopted_from": str(path), "trained_on": None, "vocab_size": info.vocab_size}
    return _finish_report(report, split_dir, out, compare_with, report_max_records)


# ---------------------------------------------------------------------------------------------------------------
# compression report


def compression_report(texts: Iterable[str], tokenizers: dict[str, TokenizerInfo | str]) -> dict:
    """Bytes per token of each tokenizer on the same texts (no special tokens), and ratios between them.

    ``vs_bytes`` = bytes / tokens: how many times shorter than one token per byte (= per residue for proteins;
    the paper reports 1.82 for its 512-token UniRef50 BPE). ``ratio_vs_<name>`` = tokens(name) / tokens(this).
    """
    texts = list(texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_chars = sum(len(t) for t in texts)
    out: dict = {"docs": len(texts), "bytes": n_bytes, "chars": n_chars, "tokenizers": {}}
    counts = {}
    for name, tk in tokenizers.items():
        info = tk if isinstance(tk, TokenizerInfo) else load_tokenizer(tk, name=name)
        n_tok = 0
        for i in range(0, len(texts), 1024):
            n_tok += sum(len(ids) for ids in info.encode(texts[i:i + 1024]))
        counts[name] = n_tok
        out["tokenizers"][name] = {
            "hash": info.hash, "vocab_size": info.vocab_size, "tokens": n_tok,
            "bytes_per_token": n_bytes / n_tok if n_tok else None,
            "tokens_per_char": n_tok / n_chars if n_chars else None,
            "vs_bytes": n_bytes / n_tok if n_tok else None,
        }
    for a in counts:
        for b in counts:
            if a != b and counts[a]:
                out["tokenizers"][a][f"ratio_vs_{b}"] = counts[b] / counts[a]
    return out
