"""Every tokenizer the project reads, in one module: loading (the project's target tokenizers with their
special-token roles, a model's own tokenizer through transformers), hashing (the identity shard manifests, P files
and checkpoints record), the bytes each token stands for, and source-token id files. Training the BPE is
data/bpe.py.

torch and transformers are imported lazily (inside the functions): data preparation needs neither.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from s2t2_dist.errors import DataError

if TYPE_CHECKING:
    import torch

_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")
_PAD_NAMES = ("<pad>", "<|padding|>", "[PAD]", "<|pad|>")


# ---------------------------------------------------------------------------------------------------------------
# loading and hashing


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
        return read_tokenizer_file(tokenizer_file(path_or_tokenizer))[1]
    return hashlib.sha256(canonical_tokenizer_json(path_or_tokenizer.to_str())).hexdigest()


def tokenizer_file(path) -> Path:
    """The tokenizer.json of a file, a directory or a hub id (downloaded); DataError naming the path if none."""
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


def read_tokenizer_file(f: Path):
    """(tokenizers.Tokenizer, hash) of one tokenizer.json, its text read once: every load of a tokenizer file
    goes through here (tests count the reads of a run)."""
    from tokenizers import Tokenizer

    try:
        text = f.read_text(encoding="utf-8")
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception (another format version)
        import tokenizers

        raise DataError(f"{f}: not a tokenizer file that tokenizers {tokenizers.__version__} can read ({e}); was it "
                        "written by another tool or version?") from None
    return tok, hashlib.sha256(canonical_tokenizer_json(text)).hexdigest()


def load_tokenizer(path: str | os.PathLike, *, bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None, name: str | None = None) -> TokenizerInfo:
    """Load a fast tokenizer from ``tokenizer.json`` or a Hugging Face tokenizer directory.

    Special tokens: explicit arguments, else tokenizer_config.json / special_tokens_map.json next to the file, else
    well-known names (``<s>``/``</s>``, ``<|endoftext|>``...). A tokenizer needs an EOS (document separator); BOS is
    optional (OLMo has none: documents are separated by ``<|endoftext|>``).
    Truncation and padding are switched off, and special-token strings inside documents are encoded as text.
    """
    f = tokenizer_file(path)
    tok, h = read_tokenizer_file(f)
    return _with_roles(tok, f, h, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, name=name)


def for_documents(tok):
    """Set a tokenizers.Tokenizer up as documents are encoded here: truncation and padding off, special-token
    strings inside a document encoded as text. Returns it."""
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def _with_roles(tok, f: Path, h: str, *, bos_token: str | None = None, eos_token: str | None = None,
                pad_token: str | None = None, name: str | None = None) -> TokenizerInfo:
    """A parsed tokenizer file as load_tokenizer's TokenizerInfo: its special-token roles found, encoding set up."""
    for_documents(tok)
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
        tokenizer=tok, path=str(f), hash=h, vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_id=bos, eos_id=eos, pad_id=pad, unk_id=unk, name=name or f.parent.name or f.stem,
    )


@dataclass
class ModelTokenizer:
    """A model's own tokenizer, its file read once per run: the tokenizer.json's ids and hash (what P files and
    manifests record), its special-token roles and transformers' tokenizer of the model (names, BOS / EOS ids)
    each made on first use from that one read (transformers' loads the directory itself, once)."""

    #: the model directory or hub id
    model: str
    #: the tokenizer.json read
    path: str
    tokenizer: Any  # tokenizers.Tokenizer, as the file says
    hash: str
    trust_remote_code: bool = False
    _hf: Any = field(default=None, repr=False)
    _info: TokenizerInfo | None = field(default=None, repr=False)

    def ids(self) -> list[int]:
        """Every real token id, sorted."""
        return sorted(self.tokenizer.get_vocab(with_added_tokens=True).values())

    @property
    def hf(self):
        """transformers' tokenizer of the model (AutoTokenizer), loaded on first use."""
        if self._hf is None:
            self._hf = load_hf_tokenizer(self.model, trust_remote_code=self.trust_remote_code)
        return self._hf

    def info(self) -> TokenizerInfo:
        """The file as load_tokenizer's TokenizerInfo (special-token roles), from the read already made."""
        if self._info is None:
            self._info = _with_roles(self.tokenizer, Path(self.path), self.hash)
        return self._info

    def transformers_hash(self) -> str:
        """`transformers_tokenizer_hash` of the model, from its one transformers tokenizer."""
        return tokenizer_hash(self.hf.backend_tokenizer)


def load_model_tokenizer(model: str | os.PathLike, trust_remote_code: bool = False) -> ModelTokenizer:
    """The tokenizer stored with a model (directory or hub id), its tokenizer.json read once. DataError naming
    the model if it has none."""
    try:
        f = tokenizer_file(model)
    except DataError as e:
        raise DataError(f"model {model}: no tokenizer.json to identify its tokenizer ({e})") from None
    tok, h = read_tokenizer_file(f)
    return ModelTokenizer(str(model), str(f), tok, h, trust_remote_code=trust_remote_code)


def load_hf_tokenizer(path_or_id: str | os.PathLike, trust_remote_code: bool = False, **kwargs: Any):
    """transformers' AutoTokenizer of a model directory or hub id (a model's own tokenizer; the project's target
    tokenizers, with their special-token roles, are load_tokenizer's TokenizerInfo)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path_or_id), trust_remote_code=trust_remote_code, **kwargs)


def transformers_tokenizer_hash(model_path: str, trust_remote_code: bool = False) -> str:
    """Hash of the tokenizer as transformers rebuilds it (`AutoTokenizer(...).backend_tokenizer`). For some
    tokenizer classes this differs from the file's hash (transformers 5 rebuilds GPTNeoXTokenizer, the OLMo hub
    tokenizer's class, from its vocabulary); accepted for the source tokenizer of a P file as an alternative."""
    tok = load_hf_tokenizer(model_path, trust_remote_code=trust_remote_code)
    return tokenizer_hash(tok.backend_tokenizer)


def same_vocabulary(a: str | TokenizerInfo, b: str | TokenizerInfo) -> bool:
    """Whether two tokenizers (paths, or loaded) map the same strings to the same ids (the same tokenizer
    re-serialised by another library version has another file hash but the same vocabulary)."""
    ta, tb = (t if isinstance(t, TokenizerInfo) else load_tokenizer(t) for t in (a, b))
    return ta.tokenizer.get_vocab(with_added_tokens=True) == tb.tokenizer.get_vocab(with_added_tokens=True)


#: the files of a Hugging Face tokenizer directory, copied verbatim with a model
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_files(info: TokenizerInfo, out_dir: Path) -> None:
    """Copy a loaded tokenizer's files verbatim into out_dir (so its hash is kept); a bare tokenizer.json gets a
    minimal tokenizer_config.json that AutoTokenizer loads."""
    src = Path(info.path)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, out_dir / "tokenizer.json")
    copied = False
    for name in TOKENIZER_FILES[1:]:
        f = src.parent / name
        if f.is_file():
            shutil.copyfile(f, out_dir / name)
            copied = copied or name == "tokenizer_config.json"
    if not copied:
        vocab = info.tokenizer.get_vocab(with_added_tokens=True)
        names = {i: t for t, i in vocab.items()}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        for key, i in (("bos_token", info.bos_id), ("eos_token", info.eos_id), ("pad_token", info.pad_id),
                       ("unk_token", info.unk_id)):
            if i is not None:
                cfg[key] = names[i]
        (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# token bytes and source-token ids


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 / GPT-NeoX): printable character -> byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return {c: b for b, c in chars.items()}


def tokenizers_backend(tokenizer_or_path):
    """-> (tokenizers.Tokenizer, description for error messages)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer_or_path, Tokenizer):
        return tokenizer_or_path, "tokenizer"
    if isinstance(tokenizer_or_path, (str, os.PathLike)):
        p = Path(tokenizer_or_path)
        if p.is_dir():
            if (p / "tokenizer.json").exists():
                return Tokenizer.from_file(str(p / "tokenizer.json")), str(p)
            return tokenizers_backend(load_hf_tokenizer(p))
        if p.is_file():
            return Tokenizer.from_file(str(p)), str(p)
        raise FileNotFoundError(f"no tokenizer at {p}")
    backend = getattr(tokenizer_or_path, "backend_tokenizer", None) or getattr(tokenizer_or_path, "_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"source_token_ids needs a fast (tokenizers-backed) tokenizer, a tokenizer.json or a directory; "
            f"got {type(tokenizer_or_path).__name__}"
        )
    return backend, type(tokenizer_or_path).__name__


def _has_type(node, name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence of components) contains one of type `name`."""
    if isinstance(node, dict):
        return node.get("type") == name or any(_has_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, name) for v in node)
    return False


def token_bytes(tokenizer_or_path) -> dict[int, bytes | None]:
    """id -> the bytes of text the token stands for (None for special tokens), for every real id.

    Byte-level BPE tokens are mapped through the byte alphabet; sentencepiece-style tokens map `▁` to a space
    and `<0xNN>` byte-fallback tokens to that byte; added (non-special) tokens are their UTF-8 content.
    """
    tok, _ = tokenizers_backend(tokenizer_or_path)
    spec = json.loads(tok.to_str())
    byte_level = _has_type(spec.get("pre_tokenizer"), "ByteLevel") or _has_type(spec.get("decoder"), "ByteLevel")
    byte_fallback = bool((spec.get("model") or {}).get("byte_fallback"))
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    bdec = byte_level_decoder()
    out: dict[int, bytes | None] = {}
    for token, i in tok.get_vocab(with_added_tokens=True).items():
        a = added.get(i)
        if a is not None and a.get("special"):
            out[i] = None
        elif a is not None and not byte_level:
            out[i] = a["content"].replace("▁", " ").encode("utf-8")
        elif a is not None:
            out[i] = a["content"].encode("utf-8")
        elif byte_level:
            try:
                out[i] = bytes(bdec[c] for c in token)
            except KeyError:  # a token outside the byte alphabet: take it literally
                out[i] = token.encode("utf-8")
        elif byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            out[i] = bytes([int(token[3:5], 16)])
        else:
            out[i] = token.replace("▁", " ").encode("utf-8")
    return out


def _one_char(b: bytes | None) -> bool:
    if not b:
        return False
    try:
        return len(b.decode("utf-8")) == 1
    except UnicodeDecodeError:
        return False


def read_id_file(path: str | os.PathLike, valid: Iterable[int] | None = None) -> list[int]:
    """Ids listed one per line (blank lines and `#` comments ignored). Errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"source-token id file not found: {p}")
    valid_set = set(valid) if valid is not None else None
    ids: list[int] = []
    seen: dict[int, int] = {}
    with open(p, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            try:
                i = int(text)
            except ValueError:
                raise ValueError(f"{p}:{lineno}: expected one integer token id, got {text!r}") from None
            if valid_set is not None and i not in valid_set:
                raise ValueError(f"{p}:{lineno}: id {i} is not a real token of the tokenizer (padding row or out of range)")
            if i in seen:
                raise ValueError(f"{p}:{lineno}: id {i} repeated (first on line {seen[i]})")
            seen[i] = lineno
            ids.append(i)
    if not ids:
        raise ValueError(f"{p}: no token ids listed")
    return ids


def source_token_ids(
    tokenizer_or_path,
    rule: str | os.PathLike = "all",
    *,
    num_embeddings: int | None = None,
    exclude_special: bool = False,
) -> torch.LongTensor:
    """Sorted ids of the source tokens S2T2 translates from (rows of E and L).

    rule:
      "all"          every real token id (OLMo: 50,280 ids; never the embedding's padding rows);
      "single_char"  tokens standing for exactly one character (the paper's "bytes" source tokens on text);
      "single_byte"  tokens standing for exactly one byte (byte-level BPE: the 256 byte tokens);
      a path, or "file:<path>": ids listed one per line (kept in the file's order, not sorted).
    `num_embeddings` (rows of E) is checked against the ids. Special tokens are excluded by the "single_*" rules
    always and by "all" when `exclude_special`.
    """
    tok, where = tokenizers_backend(tokenizer_or_path)
    real = sorted(tok.get_vocab(with_added_tokens=True).values())
    if len(set(real)) != len(real):
        raise ValueError(f"{where}: several tokens share an id")
    if num_embeddings is not None and real and real[-1] >= num_embeddings:
        raise ValueError(f"{where}: token id {real[-1]} >= the model's {num_embeddings} embedding rows")
    rule_s = os.fspath(rule)
    if rule_s in ("all", "single_char", "single_byte"):
        if rule_s == "all":
            if exclude_special:
                tb = token_bytes(tok)
                ids = [i for i in real if tb[i] is not None]
            else:
                ids = real
        else:
            tb = token_bytes(tok)
            keep = _one_char if rule_s == "single_char" else (lambda b: b is not None and len(b) == 1)
            ids = [i for i in real if keep(tb[i])]
            if not ids:
                raise ValueError(f"{where}: rule {rule_s!r} selects no tokens")
    else:
        path = rule_s[len("file:"):] if rule_s.startswith("file:") else rule_s
        if not rule_s.startswith("file:") and not Path(path).exists():
            raise ValueError(
                f"unknown source-token rule {rule_s!r}: use 'all', 'single_char', 'single_byte' or an id file path"
            )
        ids = read_id_file(path, valid=real)
        if exclude_special:
            tb = token_bytes(tok)
            ids = [i for i in ids if tb[i] is not None]
    import torch

    return torch.tensor(ids, dtype=torch.long)


def source_surface_bytes(src_tok, src_ids: list[int]) -> list:
    """The bytes of each source token (None: special), a byte-fallback token (`<0x41>`) set to None where a
    regular token stands for the same bytes: the tokenizer writes "A" as the regular token, whose embedding is the
    trained one."""
    import re

    tok, _ = tokenizers_backend(src_tok)
    tb = token_bytes(tok)
    fallback = re.compile(r"<0x[0-9A-Fa-f]{2}>")
    regular = {tb[i] for i in tb if tb[i] and not fallback.fullmatch(tok.id_to_token(i) or "")}
    out = []
    for i in src_ids:
        b = tb.get(int(i))
        out.append(None if b in regular and fallback.fullmatch(tok.id_to_token(int(i)) or "") else b)
    return out
