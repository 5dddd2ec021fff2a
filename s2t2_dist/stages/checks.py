"""Pre-flight checks every stage runs before its first unit of work: cheap (files and JSON only, no weights), on
every rank, and each failure is a ConfigError naming the config key and the file, said in one line (run_main).

What is almost certainly a mistake but can be meant (a tiny eval split, train and eval shards that are the same
files) is a warning in the log instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from s2t2_dist.errors import ConfigError

log = logging.getLogger("s2t2.checks")

#: an eval split of fewer documents than this gives a BpB too noisy to compare runs by
MIN_EVAL_DOCS = 8
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "/", "~"))


def model_dir(path: str, key: str = "model.path") -> Path | None:
    """A local model directory must exist and hold config.json; a hub id (`org/name` that is no local path) is
    left to transformers. Returns the local directory, or None for a hub id."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists():
        if not p.is_dir():
            raise ConfigError(f"{key}: {path} is a file; give a Hugging Face model directory (holding config.json)")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{key}: {path} holds no config.json; it is not a Hugging Face model directory "
                              "(give the directory save_pretrained wrote, e.g. RUN_DIR/final)")
        from s2t2_dist.models.dir_check import check  # config.json complete and agreeing with the weights

        check(p, key)
        return p
    if _looks_like_hub_id(str(path)):
        return None
    raise ConfigError(f"{key}: model directory {path} does not exist")


def _model_config(directory: Path) -> dict:
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{directory / 'config.json'}: unreadable ({e})") from None
    return cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg


def embedding_rows(directory: Path) -> int | None:
    return _model_config(directory).get("vocab_size")


def max_positions(directory: Path) -> int | None:
    cfg = _model_config(directory)
    for k in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(cfg.get(k), int):
            return cfg[k]
    return None


def model_tokenizer(directory: Path | None, key: str = "model.path", trust_remote_code: bool = False):
    """The tokenizer stored with a local model directory (data.tokenizers.ModelTokenizer, its tokenizer.json read
    once: the run uses it from here on), or None without one (a hub id, no tokenizer.json)."""
    if directory is None or not (directory / "tokenizer.json").is_file():
        return None
    from s2t2_dist.errors import DataError
    from s2t2_dist.data.tokenizers import load_model_tokenizer

    try:
        return load_model_tokenizer(directory, trust_remote_code=trust_remote_code)
    except DataError as e:
        raise ConfigError(f"{key}: the tokenizer stored with {directory} cannot be loaded: {e}") from None


#: a tokenizer using fewer than this fraction of the model's embedding rows belongs to another model (padding adds
#: a few rows: OLMo's 50,280 tokens in 50,304 rows)
MIN_ROWS_USED = 0.5


def model_tokenizer_fits(directory: Path | None, tok, key: str = "model.path") -> None:
    """The tokenizer stored with a model (``tok``: `model_tokenizer`'s) must fit the model's embedding rows: no ids
    beyond them (it would read rows that belong to no token, or fail inside the model), and not far fewer tokens
    (a tokenizer of another model: evaluate would score, translate would learn a P of the wrong size). A few rows
    more than tokens is padding: a warning with the numbers."""
    if directory is None or tok is None:
        return
    rows = embedding_rows(directory)
    ids = tok.ids()  # only the ids matter here (special-token conventions are the stages' business)
    n = max(ids) + 1 if ids else 0
    if not isinstance(rows, int):
        return
    if n > rows:
        raise ConfigError(f"{key}: the tokenizer stored with {directory} has {n} tokens but the model "
                          f"has only {rows} embedding rows (config.json vocab_size); the tokenizer belongs to "
                          "another model")
    if n < rows * MIN_ROWS_USED:
        raise ConfigError(f"{key}: the tokenizer stored with {directory} has {n} tokens but the model has {rows} "
                          f"embedding rows (config.json vocab_size): {rows - n} rows no token reads, more than "
                          "padding explains; the tokenizer belongs to another model")
    if n < rows:
        log.warning("%s: the tokenizer stored with %s has %d tokens, the model %d embedding rows: %d rows no token "
                    "reads (padding)", key, directory, n, rows, rows - n)


def context_fits(directory: Path | None, context_len: int, key: str, model_key: str = "model.path") -> None:
    if directory is None:
        return
    n = max_positions(directory)
    if n is not None and context_len > n:
        raise ConfigError(f"{key}={context_len} is longer than the {n} positions the model {directory} was built "
                          f"for ({model_key}, config.json max_position_embeddings); use at most {n}")


def plan_fits(v: int, u: int) -> None:
    """The plan (at most v source tokens: the model's tokenizer, 0 unknown; u target tokens) within what the
    sparse Sinkhorn supports, before any weight is read."""
    from s2t2_dist.ot.dykstra import check_plan_shape

    try:
        check_plan_shape(v, u)
    except ValueError as e:
        raise ConfigError(f"model.path / data.tokenizer: {e}") from None


def source_vocab(rule: str, tok, key: str = "model.source_vocab") -> None:
    """A source-token id file: there, one integer id a line, each a real token of the model's tokenizer (``tok``:
    `model_tokenizer`'s, None: not checked), before the model is loaded."""
    if rule in ("all", "single_char", "single_byte"):
        return
    from s2t2_dist.data.tokenizers import read_id_file

    path = rule[len("file:"):] if rule.startswith("file:") else rule
    if not Path(path).is_file():
        raise ConfigError(f"{key}: {rule!r} is neither 'all', 'single_char', 'single_byte' nor an id file that "
                          "exists")
    valid = tok.ids() if tok is not None else None
    try:
        read_id_file(path, valid=valid)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}: {e}") from None


def raw_files_scored(raw: dict | None, files: list[str], key: str = "data.files") -> None:
    """Raw eval files that yield no document to score (empty, or every record left out) are a user error naming
    the files and why, not a division by zero later."""
    if raw is None or raw["records"]["scored"]:
        return
    from s2t2_dist.data.raw_eval import format_records

    raise ConfigError(f"{key}: {', '.join(files)} holds no document to score ({format_records(raw['records'])})")


def tokenizer(path: str, key: str = "data.tokenizer"):
    from s2t2_dist.data.tokenizers import load_tokenizer
    from s2t2_dist.errors import DataError

    try:
        return load_tokenizer(path)
    except DataError as e:
        raise ConfigError(f"{key}: {e}") from None


def shards(path: str, key: str, kind: str):
    """The manifest of a shard directory (packed train blocks or eval documents), checked against its files."""
    from s2t2_dist.errors import DataError
    from s2t2_dist.data.shards import load_manifest

    try:
        m = load_manifest(path)
    except DataError as e:  # the same error type (ShardError, ManifestError), naming the key too
        try:
            named = type(e)(f"{key}: {e}")
        except TypeError:
            named = ConfigError(f"{key}: {e}")
        raise named from None
    if m.get("kind") != kind:
        want = "a train split (packed blocks)" if kind == "packed" else "an eval split (documents)"
        raise ConfigError(f"{key}: {path} holds the {m.get('split')!r} split ({m.get('kind')}); {key} needs {want}")
    if not m["totals"].get("n_samples"):
        what = "no documents" if kind == "docs" else "no training blocks"
        raise ConfigError(f"{key}: {path} holds {what} (an empty split); prepare more data or a larger "
                          "eval_fraction" + (", or leave the key empty for no evaluation" if kind == "docs" else ""))
    if kind == "docs" and m["totals"]["n_samples"] < MIN_EVAL_DOCS:
        log.warning("%s: %s holds only %d eval documents; its BpB will be too noisy to compare runs by", key, path,
                    m["totals"]["n_samples"])
    return m


def shards_match_tokenizer(m: dict, key: str, tok, tok_key: str = "data.tokenizer") -> None:
    """Shards tokenized with another tokenizer than the one the run reads them with are refused (ids would mean
    other strings, or lie outside the vocabulary)."""
    t = m.get("tokenizer") or {}
    if t.get("hash") != tok.hash:
        raise ConfigError(
            f"{key} {m.get('_dir')}: shards were tokenized with {t.get('path')} (hash {str(t.get('hash'))[:12]}, "
            f"{t.get('vocab_size')} tokens) but {tok_key} is {tok.path} (hash {tok.hash[:12]}, {tok.vocab_size} "
            f"tokens); use shards and tokenizer of the same kind (prepare's shards/new/* with its tokenizer/, "
            "shards/source/* with the source model's)")


def same_shards(train: dict, evald: dict, train_key: str = "data.train", eval_key: str = "data.eval") -> None:
    """Train and eval shards from the same split input whose held-out documents overlap the train split."""
    a, b = train.get("input") or {}, evald.get("input") or {}
    if a.get("split_hash") and a.get("split_hash") != b.get("split_hash"):
        log.warning("%s and %s come from different splits (%s, %s): the eval documents may overlap the train "
                    "data", train_key, eval_key, a.get("split_dir"), b.get("split_dir"))


def context_matches_shards(m: dict, context_len: int, key: str, ctx_key: str = "train.context_len") -> None:
    if m.get("context_len") not in (None, context_len):
        raise ConfigError(f"{ctx_key}={context_len} but the shards in {key} {m.get('_dir')} hold blocks of "
                          f"{m.get('context_len')} tokens; use {ctx_key}={m.get('context_len')} or re-run prepare")


def input_file(path: str, key: str, what: str = "P file") -> None:
    """A file the run reads must be a regular file: a directory, device or pipe is named as such, not "missing"
    (opening a FIFO would wait for a writer)."""
    from s2t2_dist.utils.io import not_a_file

    kind = not_a_file(path)
    if kind is None:
        return
    if kind.startswith(("a ", "not ")):
        raise ConfigError(f"{key}: {what} {path} is {kind}, not a file")
    raise ConfigError(f"{key}: {what} {path} {kind}")


def batch_fits_shards(m: dict, batch_size: int, key: str = "data.train") -> None:
    """A global batch larger than the split leaves no full batch in an epoch: refused before the model is loaded
    (the loader would refuse it after)."""
    n = (m.get("totals") or {}).get("n_samples")
    if isinstance(n, int) and batch_size > n:
        raise ConfigError(f"train.batch_size={batch_size} is larger than the {n} training blocks in {key} "
                          f"{m.get('_dir')}: not one batch per epoch; use train.batch_size <= {n} or prepare more data")


def writable_dir(path: str, key: str) -> None:
    """A directory a stage will write must be a directory (or not exist yet) in a place this process may write."""
    from s2t2_dist.utils.io import not_a_file

    p = Path(path)
    parent = p
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if os.path.lexists(parent) and not parent.is_dir():
        what = not_a_file(parent) or "a file"
        what = what if what.startswith(("a ", "not ")) else "a broken link" if "not exist" in what else what
        where = f"{path} is {what}" if parent == p else f"{path} is below {parent}, which is {what}"
        raise ConfigError(f"{key}: {where}, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write into {parent} ({_why_not_writable(parent)})")


def _why_not_writable(path: Path) -> str:
    """A read-only filesystem is said as such: changing permissions would not help there."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only filesystem"
    except OSError:
        pass
    return "permission denied"


def writable_dirs(dirs: dict[str, str]) -> None:
    """Each given directory (empty: the default, inside the run directory) is writable, before any work."""
    for key, path in dirs.items():
        if path:
            writable_dir(path, key)


def run_dir(path: str, key: str = "run_dir", stage: str | None = None) -> None:
    """The run directory: writable, and (given the stage) not another stage's run nor linked out of itself."""
    writable_dir(path, key)
    if stage is not None:
        from s2t2_dist.utils.rundir import check_owner

        check_owner(path, stage, key)


def claim_run_dir(path: str | Path, stage: str, is_main: bool, key: str = "run_dir") -> None:
    """The job's rank 0 takes the directory's lock (`utils.rundir`); every rank learns whether it did, so the other
    ranks of a refused job stop too (and no rank of the holding job is refused by its own lock)."""
    from s2t2_dist.distributed import collectives as coll
    from s2t2_dist.utils.rundir import claim
    from s2t2_dist.errors import RunDirError

    err = None
    if is_main:
        try:
            claim(path, stage, key)
        except RunDirError as e:
            err = e
    failed = coll.any_rank(err is not None) if coll.distributed() else err is not None
    if err is not None:
        raise err
    if failed:
        raise RunDirError(f"{key}: rank 0 could not take {path} (its error says why)")


def export_dir(path: str, run_dir: str, key: str = "export.dir") -> None:
    """An export directory outside the run directory must be this run's own export (its export info names this
    run's id) or new: another run's exported model is never replaced."""
    from s2t2_dist.utils.rundir import run_id

    if not path:
        return
    writable_dir(path, key)
    out, rd = Path(path), Path(run_dir)
    if not out.is_dir() or not any(out.iterdir()):
        return
    if rd.resolve() in out.resolve().parents:  # inside its own run directory (RUN_DIR/final)
        return
    try:
        info = json.loads((out / "s2t2_export.json").read_text())
    except (OSError, ValueError):
        info = {}
    mine = run_id(rd)
    if not info.get("run_id") or info.get("run_id") != mine:
        who = f"run {info['run_id']}" if info.get("run_id") else "another run or not s2t2"
        raise ConfigError(f"{key}: {path} already holds an export of {who}; this run ({run_dir}) would replace "
                          "it; choose another export.dir")


def distinct_inputs(paths: list[str], key: str = "inputs", format: str = "auto") -> list[str]:
    """Every input file identified by its content (sha256): the same file listed twice, or by a path and a symbolic
    link to it, or two copies of the same content, is refused (its records would be read and counted twice).
    Returns the hashes, in input order."""
    from s2t2_dist.data.records import resolve_inputs
    from s2t2_dist.utils.io import sha256_file

    seen: dict[str, str] = {}
    hashes = []
    for p, _ in resolve_inputs(paths, format):
        if not os.path.isfile(p):
            continue
        h = sha256_file(p)
        if h in seen:
            same = "is the same file as" if os.path.samefile(p, seen[h]) else "has the same content as"
            raise ConfigError(f"{key}: {p} {same} {seen[h]} (sha256 {h[:12]}); its records would be read twice; "
                              "list each input once")
        seen[h] = p
        hashes.append(h)
    return hashes


def training_layout(train, eval_dir: str) -> None:
    """The batch layout against the ranks this process was started with, and evaluation that cannot happen."""
    from s2t2_dist.distributed.env import detect

    train.grad_accum(detect().world_size)
    if train.eval_every and not eval_dir:
        log.warning("train.eval_every=%d but data.eval is empty: no held-out evaluation will run",
                    train.eval_every)
