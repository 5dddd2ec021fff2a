"""`prepare`: the three data steps from one `DataConfig`, in a fixed layout under ``output_dir``::

    splits/                      step 1 (split_dataset)
    tokenizer/                   step 2 (train_tokenizer): the new BPE, AutoTokenizer-loadable (or, with
                                 tokenizer_path, a copy of that existing tokenizer: no training)
    shards/new/{train,eval}/     step 3 (write_shards) with the new tokenizer
    shards/source/{train,eval}/  step 3 with the source LM's tokenizer (if source_tokenizer is set)
    prepare_summary.json         counts of every step (written last)

Every step resumes or skips work already done, so re-running the same command after a crash continues, and
re-running a finished one does nothing (the summary says which steps were reused).
"""

from __future__ import annotations

import time
from pathlib import Path

from s2t2_dist.utils.io import atomic_write_json

from . import sanity
from .bpe import adopt_tokenizer, train_tokenizer
from .config import DataConfig
from .records import RecordPolicy
from .shards import write_shards
from .split import split_dataset


def policy_from_config(cfg: DataConfig) -> RecordPolicy:
    alpha = cfg.allowed_alphabet()
    return RecordPolicy(alphabet=alpha, extra_residues=cfg.extra_residues if alpha is not None else "",
                        extra_residue_policy=cfg.extra_residue_policy, replacement=cfg.replacement,
                        uppercase=cfg.uppercase, min_length=cfg.min_length, max_length=cfg.max_length,
                        on_bad_record=cfg.on_bad_record)


def tokenizer_alphabet(cfg: DataConfig) -> str | None:
    """Letters the new tokenizer must always contain (char-level BPE)."""
    alpha = cfg.allowed_alphabet()
    if alpha is None:
        return None
    extra = "" if cfg.extra_residue_policy in ("skip", "error") else (
        cfg.replacement if cfg.extra_residue_policy == "replace" else cfg.extra_residues)
    return "".join(sorted(set(alpha) | set(extra)))


def output_paths(cfg: DataConfig) -> dict[str, Path]:
    """Where `prepare` puts each output (what the training stages' data paths point at)."""
    out = Path(cfg.output_dir)
    paths = {"splits": out / "splits", "tokenizer": out / "tokenizer"}
    for name in ("new", "source") if cfg.source_tokenizer else ("new",):
        for split in ("train", "eval"):
            paths[f"{name}/{split}"] = out / "shards" / name / split
    return paths


def _stamp(path: Path) -> int | None:
    return path.stat().st_mtime_ns if path.is_file() else None


class _Step:
    """Times a step and tells whether it reused a finished result (its marker file existed and is unchanged)."""

    def __init__(self, steps: dict, name: str, marker: Path):
        self.steps, self.name, self.marker = steps, name, marker

    def __enter__(self):
        self.before, self.t0 = _stamp(self.marker), time.time()

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.steps[self.name] = {"seconds": round(time.time() - self.t0, 3),
                                     "reused": self.before is not None and self.before == _stamp(self.marker)}


def prepare(cfg: DataConfig, *, progress: bool = True, steps: tuple[str, ...] = ("split", "tokenizer", "shards")) -> dict:
    """Run the steps named in ``steps`` (in order); returns the summary of every count (also saved as
    ``prepare_summary.json``; `format_summary` makes it readable). ``progress``: tqdm bars."""
    cfg.validate()
    paths = output_paths(cfg)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    summary: dict = {"output_dir": str(out), "paths": {k: str(v) for k, v in paths.items() if k != "splits"},
                     "steps": {}}
    timing = summary["steps"]
    warnings: list[str] = summary.setdefault("warnings", [])  # data that is well-formed but almost surely wrong
    split_dir, tok_dir = paths["splits"], paths["tokenizer"]
    if "split" in steps:
        with _Step(timing, "split", split_dir / "split.json"):
            m = split_dataset(inputs=list(cfg.inputs), output_dir=split_dir, format=cfg.format,
                              id_column=cfg.id_column, text_column=cfg.text_column, hf_split=cfg.hf_split,
                              text_mode=cfg.text_mode, policy=policy_from_config(cfg),
                              eval_fraction=cfg.eval_fraction, split_by=cfg.split_by, seed=cfg.seed,
                              chunk_records=cfg.chunk_records, progress=progress)
        summary["split"] = m["summary"]
        found = sanity.split_warnings(m["summary"], cfg) + sanity.content_warnings(split_dir, cfg)
        sanity.emit(found)  # now: a later step may fail because of what they say
        warnings += found
    if "tokenizer" in steps:
        compare = {"source": cfg.source_tokenizer} if cfg.source_tokenizer else None
        with _Step(timing, "tokenizer", tok_dir / "tokenizer.json"):
            if cfg.tokenizer_path:  # an existing tokenizer: no training
                rep = adopt_tokenizer(cfg.tokenizer_path, split_dir=split_dir, output_dir=tok_dir, compare_with=compare)
            else:
                rep = train_tokenizer(split_dir=split_dir, output_dir=tok_dir, vocab_size=cfg.vocab_size,
                                      kind=cfg.resolved_tokenizer_kind(), alphabet=tokenizer_alphabet(cfg),
                                      min_frequency=cfg.min_frequency, max_records=cfg.tokenizer_max_records,
                                      max_chars=cfg.tokenizer_max_chars,
                                      seed=cfg.seed, context_len=cfg.context_len, compare_with=compare,
                                      progress=progress)
        summary["tokenizer"] = {"dir": str(tok_dir), "hash": rep.get("tokenizer_hash"),
                                "vocab_size": rep.get("vocab_size"), "trained_on": rep.get("trained_on"),
                                "adopted_from": rep.get("adopted_from"),
                                "compression": rep.get("compression")}
        found = sanity.tokenizer_warnings(rep, cfg)
        sanity.emit(found)
        warnings += found
    if "shards" in steps:
        summary["shards"] = {}
        for key, shard_dir in paths.items():
            if "/" not in key:
                continue
            name, split = key.split("/")
            tok = tok_dir if name == "new" else cfg.source_tokenizer
            with _Step(timing, f"shards {key}", shard_dir / "manifest.json"):
                m = write_shards(split_dir=split_dir, split=split, tokenizer=tok, output_dir=shard_dir,
                                 context_len=cfg.context_len, shard_size=cfg.shard_size,
                                 num_workers=cfg.num_workers, progress=progress)
            summary["shards"][key] = {"shards": len(m["shards"]),
                                      "shard_bytes": sum(s["file_bytes"] for s in m["shards"]),
                                      "vocab_size": m["tokenizer"]["vocab_size"], **m["totals"]}
    summary["seconds"] = round(time.time() - t0, 3)
    atomic_write_json(out / "prepare_summary.json", summary)
    return summary


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def format_summary(summary: dict) -> str:  # noqa: C901 - one branch per part of the report
    """The summary as a few readable lines: records read/kept/filtered by rule, tokenizer compression against
    bytes and against the source tokenizer, shards and tokens per split, and the paths to train on."""
    steps = summary.get("steps", {})
    reused = [k for k, v in steps.items() if v.get("reused")]
    state = ("everything was already done; nothing was rewritten" if steps and len(reused) == len(steps)
             else f"reused: {', '.join(reused)}" if reused else "")
    lines = [f"prepare: {summary.get('output_dir')} ({summary.get('seconds')} s{'; ' + state if state else ''})"]
    sp = summary.get("split")
    if sp:
        lines.append(f"  records  read {_n(sp['records_read'])}, kept {_n(sp['records_kept'])} "
                     f"(train {_n(sp['train_records'])}, eval {_n(sp['eval_records'])})")
        for k, v in sp["skipped_bad"].items():
            lines.append(f"           skipped as malformed ({k}): {_n(v)}")
        for k, v in sp["filtered"].items():
            lines.append(f"           filtered ({k}): {_n(v)}")
        if not sp["skipped_bad"] and not sp["filtered"]:
            lines.append("           nothing filtered or skipped")
        if sp.get("replaced_residues"):
            lines.append(f"           residues replaced: {_n(sp['replaced_residues'])}")
    tk = summary.get("tokenizer")
    if tk:
        tr = tk.get("trained_on") or {}
        how = (f"adopted from {tk['adopted_from']} (hash {str(tk.get('hash'))[:16]}), not trained"
               if tk.get("adopted_from")
               else f"trained on {_n(tr.get('records'))} records ({_n(tr.get('chars'))} characters)")
        lines.append(f"  tokenizer {tk['dir']}: vocab {_n(tk.get('vocab_size'))}, {how}")
        comp = tk.get("compression")
        if comp:
            lines.append(f"  compression on {comp.get('measured_on', 'held-out text')} ({_n(comp['bytes'])} bytes):")
            for name, c in comp["tokenizers"].items():
                if not c.get("tokens"):
                    continue
                line = (f"    {name:<7} vocab {c['vocab_size']:>7,}: {c['bytes_per_token']:.3f} bytes/token = "
                        f"{c['vs_bytes']:.2f}x fewer tokens than bytes")
                if name == "new":
                    line += "".join(f"; {k[9:]} needs {c[k]:.2f}x as many tokens" for k in sorted(c)
                                    if k.startswith("ratio_vs_"))
                lines.append(line)
    shards = summary.get("shards") or {}
    if shards:
        lines.append("  shards")
    for key, s in shards.items():
        mb = s.get("shard_bytes", 0) / 1e6
        if "dropped_tail_tokens" in s:
            what = (f"{_n(s['n_samples'])} blocks, {_n(s['n_tokens'])} tokens "
                    f"(last {_n(s['dropped_tail_tokens'])} tokens of the stream dropped)")
        else:
            what = f"{_n(s['n_samples'])} documents, {_n(s['n_tokens'])} tokens"
            if s.get("n_tokens"):
                what += f", {s['text_bytes'] / s['n_tokens']:.3f} bytes/token"
        lines.append(f"    {key:<13} {s['shards']:>4} shard{'s' if s['shards'] != 1 else ''}, {mb:,.1f} MB: {what}")
    for w in summary.get("warnings") or []:
        lines.append(f"  WARNING: {w}")
    paths = summary.get("paths") or {}
    if paths.get("new/train"):
        lines.append(f"  train on: train {paths['new/train']}, eval {paths['new/eval']}, "
                     f"tokenizer {paths['tokenizer']}")
    if paths.get("source/train"):
        lines.append(f"  baseline (source tokenizer): train {paths['source/train']}, eval {paths['source/eval']}")
    return "\n".join(lines)
