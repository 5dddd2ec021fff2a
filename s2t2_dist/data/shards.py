"""Step 3: tokenize a split with any tokenizer and write webdataset tar shards plus a manifest.

Train split (``kind: packed``): the documents' token stream ``[BOS] doc [EOS] [BOS] doc [EOS] ...`` (BOS only if the
tokenizer has one) cut into blocks of exactly ``context_len`` tokens; block i is sample ``%012d`` % i, the
concatenation of all blocks is the stream's prefix, and the last ``< context_len`` tokens (the tail) are not written
(their count is in the manifest). Eval split (``kind: docs``): one sample per document, ``[start] doc`` (start = BOS,
or EOS for tokenizers without BOS) and its JSON ``{"id", "n_bytes", "n_chars"}``, n_bytes = UTF-8 bytes of the text.

A sample is ``KEY.input_ids.npy`` (uint16 if the vocabulary fits, else int32) [+ ``KEY.json``]. Shards hold
``shard_size`` samples (the last one fewer) and are named ``{split}-%06d.tar``. Tokenization runs in ``num_workers``
processes (ordered, so the output is byte-identical for any worker count); packing and writing run in this process.

Shards are written with webdataset's ``TarWriter`` (members ``KEY.EXT`` in key order; mode 0444, fixed mtime and
owner, so a shard's bytes depend only on its samples).

Crash safety: a shard is written as ``NAME.tmp`` and renamed; after each rename a journal line records the shard and
the position to restart from (document, token offset inside it). Re-running with the same arguments resumes after
the last recorded shard without rewriting it. ``manifest.json`` is written last, atomically.
"""

from __future__ import annotations

import collections
import hashlib
import io
import itertools
import json
import os
import time
from pathlib import Path
from collections.abc import Iterator

import numpy as np

from s2t2_dist import envvars
from s2t2_dist.utils.io import (
    AtomicFile, append_json_line, atomic_write_json, json_sha256, load_json, read_json_lines, sha256_file,
    write_json_lines)

from s2t2_dist.errors import ManifestError, ShardError

from .tokenizers import TokenizerInfo, for_documents, load_tokenizer
from .split import iter_split_lines, load_split, split_manifest_hash

MANIFEST_FORMAT = "s2t2-shards"
MANIFEST_VERSION = 1


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def sample_key(index: int) -> str:
    return f"{index:012d}"


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


def npy_load(data: bytes) -> np.ndarray:
    return np.lib.format.read_array(io.BytesIO(data), allow_pickle=False)


# ---------------------------------------------------------------------------------------------------------------
# shard file


class _HashingWriter:
    """Write-through file wrapper counting and sha256-hashing the bytes written (the manifest records both)."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.n_bytes = 0

    def write(self, b) -> int:
        if self._f is None:  # detached: the shard was abandoned
            return len(b)
        self.sha256.update(b)
        self.n_bytes += len(b)
        return self._f.write(b)

    def detach(self) -> None:
        self._f = None


class ShardFile:
    """One tar shard, written by webdataset's ``TarWriter`` into ``path.tmp``; ``commit()`` finishes the archive,
    fsyncs it and renames it to ``path``, ``abort()`` removes it.

    Samples are passed pre-encoded (``encoder=False``: bytes per extension), so the writer only frames them.
    """

    def __init__(self, path: Path):
        from webdataset import TarWriter  # imported here: webdataset imports torch, tokenizer workers need neither

        self.path = Path(path)
        self._file = AtomicFile(self.path, "wb", buffering=1 << 20)
        self._hashed = _HashingWriter(self._file.file)
        self._tar = TarWriter(self._hashed, encoder=False, compress=False, mtime=0, user="s2t2", group="s2t2")
        self.n_samples = 0

    def write(self, key: str, files: dict[str, bytes]) -> None:
        self._tar.write({"__key__": key, **files})
        self.n_samples += 1

    def commit(self) -> dict:
        if envvars.is_set("S2T2_FAULT"):  # fault injection (tests/faults): e.g. a disk that fills here
            from s2t2_dist import faults

            faults.point("shards.commit", int(self.path.name.rsplit("-", 1)[-1].split(".")[0]), path=str(self.path))
        self._tar.close()  # end-of-archive blocks, padded to a whole tar record; the file stays open
        self._file.commit()
        return {"name": self.path.name, "file_bytes": self._hashed.n_bytes, "sha256": self._hashed.sha256.hexdigest()}

    def abort(self) -> None:
        self._hashed.detach()
        try:
            self._tar.close()  # releases the tar stream; what it still writes goes nowhere
        finally:
            self._file.abort()


# ---------------------------------------------------------------------------------------------------------------
# tokenization workers

_W: dict = {}


def _init_worker(tok_json: str, bos: int | None, eos: int, start: int, kind: str) -> None:
    from tokenizers import Tokenizer

    tok = for_documents(Tokenizer.from_str(tok_json))  # the parent's tokenizer, sent as its JSON
    _W.update(tok=tok, bos=bos, eos=eos, start=start, kind=kind)


def _encode_task(task: tuple[int, list[str]]):
    """(first doc index, JSON lines) -> (first, (flat int64 tokens, per-doc token counts, per-doc UTF-8 bytes,
    per-doc chars, ids or None))."""
    first, lines = task
    tok, kind = _W["tok"], _W["kind"]
    docs = [json.loads(line) for line in lines]
    texts = [d["text"] for d in docs]
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.20)
    encs = enc(texts, add_special_tokens=False)
    if kind == "packed":
        pre = [] if _W["bos"] is None else [_W["bos"]]
        post = [_W["eos"]]
    else:
        pre, post = [_W["start"]], []
    seqs = [pre + e.ids + post for e in encs]
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64, count=len(texts))
    nchars = np.fromiter((len(t) for t in texts), dtype=np.int64, count=len(texts))
    ids = [d["id"] for d in docs] if kind == "docs" else None
    return first, (flat, lens, nbytes, nchars, ids)


def _tasks(split_dir, split: str, start_doc: int, task_chars: int) -> Iterator[tuple[int, list[str]]]:
    batch: list[str] = []
    first = start_doc
    size = 0
    for idx, line in iter_split_lines(split_dir, split, start=start_doc):
        if not batch:
            first = idx
        batch.append(line)
        size += len(line)
        if size >= task_chars or len(batch) >= 4096:
            yield first, batch
            batch, size = [], 0
    if batch:
        yield first, batch


def _results(info: TokenizerInfo, kind: str, split_dir, split: str, start_doc: int, num_workers: int,
             task_chars: int):
    """Encoded tasks in input order. With workers, at most 2 tasks per worker are in flight (Pool.imap would
    read the whole input ahead into memory)."""
    args = (info.tokenizer.to_str(), info.bos_id, info.eos_id, info.start_id, kind)
    tasks = _tasks(split_dir, split, start_doc, task_chars)
    if num_workers <= 0:
        _init_worker(*args)
        for task in tasks:
            yield _encode_task(task)
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # never fork a process that may hold tokenizer threads
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    try:
        pool = ctx.Pool(num_workers, initializer=_init_worker, initargs=args)
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    try:
        inflight: collections.deque = collections.deque()
        for task in tasks:
            inflight.append(pool.apply_async(_encode_task, (task,)))
            if len(inflight) >= 2 * num_workers:
                yield inflight.popleft().get()
        while inflight:
            yield inflight.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


# ---------------------------------------------------------------------------------------------------------------
# writing


def write_shards(
    *,
    split_dir: str | os.PathLike,
    split: str,
    tokenizer: str | os.PathLike | TokenizerInfo,
    output_dir: str | os.PathLike,
    context_len: int = 512,
    shard_size: int = 8192,
    num_workers: int = 0,
    bos_token: str | None = None,
    eos_token: str | None = None,
    task_chars: int = 1 << 20,
    progress: bool = True,
) -> dict:
    """Tokenize split ``split`` ("train": packed blocks, "eval": whole documents) of the step-1 directory
    ``split_dir`` and write shards + ``manifest.json`` into ``output_dir``. Returns the manifest.

    Resumes a crashed run; returns the existing manifest if the same job already finished; raises ManifestError
    if ``output_dir`` holds shards made from other data, tokenizer or settings.
    """
    kind = "packed" if split == "train" else "docs"
    info = tokenizer if isinstance(tokenizer, TokenizerInfo) else load_tokenizer(tokenizer, bos_token=bos_token,
                                                                                  eos_token=eos_token)
    split_m = load_split(split_dir)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(info.dtype)
    job = {"split": split, "kind": kind, "context_len": context_len, "shard_size": shard_size,
           "tokenizer_hash": info.hash, "bos_id": info.bos_id, "eos_id": info.eos_id, "dtype": dtype.name,
           "split_hash": split_manifest_hash(split_dir)}
    jhash = json_sha256(job)
    mpath = out / "manifest.json"
    if mpath.exists():
        m = load_json(mpath, "manifest", ManifestError)
        if m.get("job_hash") == jhash:
            return m
        raise ManifestError(f"{mpath}: this directory holds shards of another job (different split, tokenizer or "
                            "settings); choose another output_dir or delete it")

    journal = out / f"_journal-{split}.jsonl"
    entries = read_json_lines(journal)
    if entries and entries[0].get("job_hash") != jhash:
        raise ManifestError(f"{journal}: a half-finished job with different inputs or settings is in {out}; "
                            "choose another output_dir or delete it")
    done: list[dict] = []
    for e in entries[1:]:  # trust a recorded shard only if it is there, whole
        p = out / e["shard"]["name"]
        if p.is_file() and p.stat().st_size == e["shard"]["file_bytes"]:
            done.append(e)
        else:
            break
    write_json_lines(journal, [{"job_hash": jhash, "job": job}] + done)
    state = done[-1]["resume"] if done else {"doc": 0, "offset": 0, "sample": 0, "docs_before": 0,
                                             "bytes_before": 0, "chars_before": 0, "tokens_before": 0}
    shards = [e["shard"] for e in done]
    n_docs_total = split_m["records"][split]

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_docs_total, initial=state["doc"], desc=f"tokenize {split}", unit="doc",
                   dynamic_ncols=True)  # no unit_scale: counts print as integers (59/59, not 59.0/59.0)
    writer = _PackedWriter if kind == "packed" else _DocWriter
    w = writer(out, split, context_len, shard_size, dtype, state, shards, journal)
    t0 = time.time()
    try:
        for first, (flat, lens, nbytes, nchars, ids) in _results(info, kind, split_dir, split, state["doc"],
                                                                 num_workers, task_chars):
            w.add(first, flat, lens, nbytes, nchars, ids)
            if bar is not None:
                bar.update(len(lens))
        w.finish()
    except OSError as e:  # a full disk, a quota, an I/O error: say where, and that re-running continues
        w.abort()
        raise _write_error(e, out / shard_name(split, len(w.shards)), len(w.shards)) from e
    except BaseException:
        w.abort()
        raise
    finally:
        if bar is not None:
            bar.close()

    totals = w.totals()
    if info.vocab_size and totals["n_tokens"] and kind == "docs":
        totals["bytes_per_token"] = totals["text_bytes"] / totals["n_tokens"]
    manifest = {
        "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "job_hash": jhash,
        "split": split, "kind": kind, "context_len": context_len, "dtype": dtype.name,
        "tokenizer": info.describe(),
        "input": {"split_dir": str(split_dir), "split_hash": job["split_hash"]},
        "config": {"shard_size": shard_size, "num_workers": num_workers, "context_len": context_len},
        "shards": shards, "totals": totals,
        "summary": {**split_m["summary"], f"{split}_shards": len(shards), f"{split}_samples": totals["n_samples"],
                    f"{split}_tokens": totals["n_tokens"], "seconds_this_run": round(time.time() - t0, 3)},
    }
    atomic_write_json(mpath, manifest)
    return manifest


def _write_error(e: OSError, shard: Path, n_done: int) -> OSError:
    import errno
    import shutil

    try:
        free = f"{shutil.disk_usage(shard.parent).free:,} bytes free there"
    except OSError:
        free = "free space unknown"
    full = " -- the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return OSError(e.errno, f"writing shard {shard} failed: {e.strerror or e}{full} ({free}); the {n_done} shards "
                            "written before it are complete and kept: free space and run the same command again "
                            "to continue from them")


class _WriterBase:
    def __init__(self, out: Path, split: str, context_len: int, shard_size: int, dtype, state: dict,
                 shards: list[dict], journal: Path):
        self.out, self.split, self.T, self.shard_size, self.dtype = out, split, context_len, shard_size, dtype
        self.shards, self.journal = shards, journal
        self.next_sample = state["sample"]
        self.resume_offset = state["offset"]
        self.resume_doc = state["doc"]
        self.cum = {k: state[k] for k in ("docs_before", "bytes_before", "chars_before", "tokens_before")}
        self.cur: ShardFile | None = None
        self.cur_first = self.next_sample
        self.cur_tokens = 0
        self.cur_bytes = 0

    def _open(self) -> ShardFile:
        if self.cur is None:
            self.cur = ShardFile(self.out / shard_name(self.split, len(self.shards)))
            self.cur_first = self.next_sample
            self.cur_tokens = 0
            self.cur_bytes = 0
        return self.cur

    def _commit(self, resume: dict) -> None:
        info = self.cur.commit()
        info.update(first_index=self.cur_first, n_samples=self.cur.n_samples, n_tokens=self.cur_tokens)
        if self.cur_bytes:
            info["text_bytes"] = self.cur_bytes
        self.shards.append(info)
        append_json_line(self.journal, {"shard": info, "resume": resume})
        self.cur = None

    def abort(self) -> None:
        if self.cur is not None:
            self.cur.abort()
            self.cur = None


class _PackedWriter(_WriterBase):
    """Packs the document token stream into blocks; tracks where each shard ends in document coordinates."""

    def __init__(self, *a):
        super().__init__(*a)
        self.buf = np.zeros(0, dtype=np.int64)
        self.pos = self.next_sample * self.T  # global stream position of buf[0]
        # documents overlapping the buffer: true start position, doc index, cumulative stats before the doc
        self.d_start = np.zeros(0, dtype=np.int64)
        self.d_index = np.zeros(0, dtype=np.int64)
        self.d_cum = np.zeros((0, 4), dtype=np.int64)  # docs, bytes, chars, stream tokens before the doc
        self.stream_end = self.pos

    def add(self, first, flat, lens, nbytes, nchars, ids) -> None:
        n = len(lens)
        true_lens = lens.copy()
        if self.resume_offset and first == self.resume_doc:
            # resuming inside this document: its first `offset` tokens are already in a committed shard
            flat = flat[self.resume_offset:]
            lens = lens.copy()
            lens[0] -= self.resume_offset
            self.resume_offset = 0
            starts = self.stream_end - (true_lens[0] - lens[0]) + np.concatenate([[0], np.cumsum(true_lens)[:-1]])
        else:
            starts = self.stream_end + np.concatenate([[0], np.cumsum(true_lens)[:-1]])
        cum = np.zeros((n, 4), dtype=np.int64)
        cum[:, 0] = self.cum["docs_before"] + np.arange(n)
        cum[:, 1] = self.cum["bytes_before"] + np.concatenate([[0], np.cumsum(nbytes)[:-1]])
        cum[:, 2] = self.cum["chars_before"] + np.concatenate([[0], np.cumsum(nchars)[:-1]])
        cum[:, 3] = self.cum["tokens_before"] + np.concatenate([[0], np.cumsum(true_lens)[:-1]])
        self.cum = {"docs_before": int(cum[-1, 0] + 1), "bytes_before": int(cum[-1, 1] + nbytes[-1]),
                    "chars_before": int(cum[-1, 2] + nchars[-1]), "tokens_before": int(cum[-1, 3] + true_lens[-1])}
        self.d_start = np.concatenate([self.d_start, starts])
        self.d_index = np.concatenate([self.d_index, first + np.arange(n)])
        self.d_cum = np.concatenate([self.d_cum, cum])
        self.stream_end += int(lens.sum())
        self.buf = np.concatenate([self.buf, flat]) if len(self.buf) else flat
        nb = len(self.buf) // self.T
        T = self.T
        for b in range(nb):
            block = self.buf[b * T:(b + 1) * T]
            self._open().write(sample_key(self.next_sample), {"input_ids.npy": npy_bytes(block.astype(self.dtype))})
            self.next_sample += 1
            self.cur_tokens += T
            if self.cur.n_samples >= self.shard_size:
                self._commit(self._resume_at(self.next_sample * T))
        self.buf = self.buf[nb * T:].copy()
        self.pos += nb * T
        keep = max(int(np.searchsorted(self.d_start, self.pos, side="right")) - 1, 0)
        self.d_start, self.d_index, self.d_cum = self.d_start[keep:], self.d_index[keep:], self.d_cum[keep:]

    def _resume_at(self, p: int) -> dict:
        i = int(np.searchsorted(self.d_start, p, side="right")) - 1
        c = self.d_cum[i]
        return {"doc": int(self.d_index[i]), "offset": int(p - self.d_start[i]), "sample": self.next_sample,
                "docs_before": int(c[0]), "bytes_before": int(c[1]), "chars_before": int(c[2]),
                "tokens_before": int(c[3])}

    def finish(self) -> None:
        if self.cur is not None:
            self._commit(self._resume_at(self.next_sample * self.T) if len(self.d_start) else {})
        self.tail = len(self.buf)

    def totals(self) -> dict:
        n = sum(s["n_samples"] for s in self.shards)
        return {"n_samples": n, "n_tokens": n * self.T, "n_docs": self.cum["docs_before"],
                "text_bytes": self.cum["bytes_before"], "n_chars": self.cum["chars_before"],
                "stream_tokens": self.cum["tokens_before"], "dropped_tail_tokens": self.cum["tokens_before"] - n * self.T}


class _DocWriter(_WriterBase):
    def add(self, first, flat, lens, nbytes, nchars, ids) -> None:
        ends = np.cumsum(lens)
        for j in range(len(lens)):
            doc = first + j
            toks = flat[ends[j] - lens[j]:ends[j]]
            meta = {"id": ids[j], "n_bytes": int(nbytes[j]), "n_chars": int(nchars[j])}
            self._open().write(sample_key(doc), {"input_ids.npy": npy_bytes(toks.astype(self.dtype)),
                                                 "json": json.dumps(meta, ensure_ascii=False).encode("utf-8")})
            self.next_sample += 1
            self.cur_tokens += int(lens[j]) - 1  # scored tokens (all but the start token)
            self.cur_bytes += int(nbytes[j])
            self.cum["docs_before"] += 1
            self.cum["bytes_before"] += int(nbytes[j])
            self.cum["chars_before"] += int(nchars[j])
            self.cum["tokens_before"] += int(lens[j]) - 1
            if self.cur.n_samples >= self.shard_size:
                self._commit({"doc": doc + 1, "offset": 0, "sample": self.next_sample, **self.cum})

    def finish(self) -> None:
        if self.cur is not None:
            self._commit({"doc": self.next_sample, "offset": 0, "sample": self.next_sample, **self.cum})

    def totals(self) -> dict:
        return {"n_samples": sum(s["n_samples"] for s in self.shards), "n_tokens": self.cum["tokens_before"],
                "n_docs": self.cum["docs_before"], "text_bytes": self.cum["bytes_before"],
                "n_chars": self.cum["chars_before"]}


# ---------------------------------------------------------------------------------------------------------------
# reading manifests back


def load_manifest(path: str | os.PathLike, *, check_files: bool = True, verify_checksums: bool = False) -> dict:
    """Read and check ``manifest.json`` (a file or its directory): structure, counts, and (``check_files``)
    that every shard exists with the recorded size (``verify_checksums``: and sha256). Raises ManifestError /
    ShardError naming the problem."""
    p = Path(path)
    if p.is_dir():
        p = p / "manifest.json"
    m = load_json(p, "shard manifest (written by `s2t2 prepare`)", ManifestError)
    if m.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f"{p}: not a shard manifest (format {m.get('format')!r})")
    if m.get("version") != MANIFEST_VERSION:
        raise ManifestError(f"{p}: manifest version {m.get('version')} is not supported (expected {MANIFEST_VERSION})")
    for k in ("split", "kind", "context_len", "dtype", "tokenizer", "shards", "totals"):
        if k not in m:
            raise ManifestError(f"{p}: manifest lacks {k!r}")
    expect = 0
    for s in m["shards"]:
        if s.get("first_index") != expect:
            raise ManifestError(f"{p}: shard {s.get('name')} starts at sample {s.get('first_index')}, expected "
                                f"{expect}; the shard list is inconsistent")
        expect += s["n_samples"]
    if expect != m["totals"]["n_samples"]:
        raise ManifestError(f"{p}: shards hold {expect} samples but totals say {m['totals']['n_samples']}")
    m["_dir"] = str(p.parent)
    if check_files:
        for s in m["shards"]:
            f = p.parent / s["name"]
            if not f.is_file():
                raise ShardError(f"shard {f} is missing (listed in {p})")
            size = f.stat().st_size
            if size != s["file_bytes"]:
                raise ShardError(f"shard {f} has {size} bytes but {p} says {s['file_bytes']}: truncated or replaced")
            if verify_checksums and sha256_file(f) != s["sha256"]:
                raise ShardError(f"shard {f}: sha256 differs from {p}: the shard is corrupt or was replaced")
    return m
