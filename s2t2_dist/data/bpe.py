"""Step 2: train the target-domain BPE tokenizer; load any tokenizer; hash and compare tokenizers.

Proteins get a character-level BPE over residues (initial alphabet = the allowed letters, no pre-tokenizer, so
merges run over whole sequences, as the paper's 512-token UniRef50 tokenizer); other text gets a byte-level BPE
(GPT-2 style pre-tokenization, no unknown tokens). Special tokens ``<s>`` (BOS), ``</s>`` (EOS), ``<pad>``, and
``<unk>`` take ids 0..3. The output directory is a standard Hugging Face tokenizer directory::

    tokenizer.json, tokenizer_config.json, special_tokens_map.json   (AutoTokenizer.from_pretrained(dir) works)
    bpe_training.json                                                (params, training sample, compression report)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from s2t2_dist.utils.io import atomic_dir, atomic_write_json

from s2t2_dist.errors import DataError, ManifestError

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")


# ---------------------------------------------------------------------------------------------------------------
# loading any tokenizer


@dataclass
class TokenizerInfo:
    """A fast tokenizer plus what data preparation needs to know about it."""

    tokenizer: object  # tokenizers.Tokenizer
    path: str
    hash: str
    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int | None
    unk_id: int | None = None
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def start_id(self) -> int:
        """First token of an eval document: BOS, or EOS for tokenizers without one (GPT-NeoX/OLMo convention)."""
        return self.bos_id if self.bos_id is not None else self.eos_id

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 65536 else "int32"

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added, special-token strings in the text treated as text."""
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def describe(self) -> dict:
        return {"name": self.name, "path": self.path, "hash": self.hash, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id, "unk_id": self.unk_id,
                "dtype": self.dtype}


def canonical_tokenizer_json(obj_or_text) -> bytes:
    obj = json.loads(obj_or_text) if isinstance(obj_or_text, (str, bytes)) else obj_or_text
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def tokenizer_hash(path_or_tokenizer) -> str:
    """sha256 of the canonical form (sorted keys, no whitespace) of a tokenizer.json, a tokenizer directory, or a
    ``tokenizers.Tokenizer``. Identical for the same tokenizer saved by different library versions' key orders."""
    if isinstance(path_or_tokenizer, (str, os.PathLike)):
        p = _tokenizer_file(path_or_tokenizer)
        text = p.read_text(encoding="utf-8")
    else:
        text = path_or_tokenizer.to_str()
    return hashlib.sha256(canonical_tokenizer_json(text)).hexdigest()


def _tokenizer_file(path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        hub = _from_hub(str(path))
        if hub is not None:
            return hub
        raise DataError(f"tokenizer not found: {p} (give a tokenizer.json or a directory holding one)")
    return p


def _from_hub(name: str) -> Path | None:
    """``owner/name`` of a hub model: download its tokenizer files (needs network; not exercised by the tests)."""
    if os.path.isabs(name) or name.count("/") != 1 or os.path.exists(name.split("/")[0]):
        return None
    try:
        from huggingface_hub import hf_hub_download

        f = Path(hf_hub_download(name, "tokenizer.json"))
        for extra in ("tokenizer_config.json", "special_tokens_map.json"):
            try:
                hf_hub_download(name, extra)
            except Exception:  # noqa: BLE001 - optional files; the hub raises many types for a missing one
                pass
        return f
    except Exception:  # noqa: BLE001 - offline or not on the hub: the caller reports the name
        return None


def _special_from_config(d: Path) -> dict:
    out = {}
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = d / fname
        if f.is_file():
            cfg = json.loads(f.read_text(encoding="utf-8"))
            for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = cfg.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str) and k not in out:
                    out[k] = v
    return out


def load_tokenizer(path: str | os.PathLike, *, bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None, name: str | None = None) -> TokenizerInfo:
    """Load a fast tokenizer from ``tokenizer.json`` or a Hugging Face tokenizer directory.

    Special tokens: explicit arguments, else tokenizer_config.json / special_tokens_map.json next to the file, else
    well-known names (``<s>``/``</s>``, ``<|endoftext|>``...). A tokenizer needs an EOS (document separator); BOS is
    optional (OLMo has none: documents are separated by ``<|endoftext|>``).
    Truncation and padding are switched off, and special-token strings inside documents are encoded as text.
    """
    from tokenizers import Tokenizer

    f = _tokenizer_file(path)
    try:
        tok = Tokenizer.from_file(str(f))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception (another format version)
        import tokenizers

        raise DataError(f"{f}: not a tokenizer file that tokenizers {tokenizers.__version__} can read ({e}); was it "
                        "written by another tool or version?") from None
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    conf = _special_from_config(f.parent)
    vocab = tok.get_vocab(with_added_tokens=True)

    def pick(explicit, key, names):
        cand = explicit or conf.get(key)
        if cand is not None:
            if cand not in vocab:
                raise DataError(f"{f}: special token {cand!r} ({key}) is not in the vocabulary")
            return vocab[cand]
        specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
        for n in names:
            if n in vocab and (n in specials or not specials):
                return vocab[n]
        return None

    bos = pick(bos_token, "bos_token", _BOS_NAMES)
    eos = pick(eos_token, "eos_token", _EOS_NAMES)
    pad = pick(pad_token, "pad_token", _PAD_NAMES)
    unk = pick(None, "unk_token", ("<unk>", "[UNK]", "<|unk|>"))
    if eos is None:
        raise DataError(f"{f}: no end-of-document token found; pass eos_token= (e.g. '</s>' or '<|endoftext|>')")
    return TokenizerInfo(
        tokenizer=tok, path=str(f), hash=tokenizer_hash(f), vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_id=bos, eos_id=eos, pad_id=pad, unk_id=unk, name=name or f.parent.name or f.stem,
    )


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
#: bytes on /work/shared/data/protein at 5,000-100,000 records; BENCHMARKS.md #20)
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
    src = _tokenizer_file(path)
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
