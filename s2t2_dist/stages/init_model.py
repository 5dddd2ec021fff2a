"""The model a finetuning run (or an evaluation) starts from: ONE code path for every initialisation of the paper.

    init.kind = translated        E' = W_E^T E[src], L' = W_L^T L[src] from a stage-1 P file (sparse, softmax or
                                  unconstrained translator: the file records which, and its normalisation), put
                                  into a new embedding / head of u rows with `models.materialize`; the model then
                                  reads and predicts the NEW tokenizer's ids natively ("S2T2 + CFT").
    init.kind = new_tok_truncate  the new tokenizer, E and L cut to their first u rows ("FT new tok.").
    init.kind = orig_tok          the model and its own tokenizer as they are ("FT orig. tok."; data = the shards
                                  tokenized with the source tokenizer).
    init.kind = as_is             the same as orig_tok, named for its other use: a model directory that already
                                  speaks the run's tokenizer (e.g. an exported finetuned model being evaluated).

For translated / new_tok_truncate, rank 0 loads the source model once (float32, on CPU), builds the new
embedding and head, and writes a standard Hugging Face directory (config with vocab u, safetensors, the new
tokenizer's files copied verbatim so its hash is kept). Every rank then loads that directory through
`engines.build.build_model_and_engine`, so under ZeRO-3 the model is built straight into partitions and no rank
holds all of it on its accelerator. Rank 0's host memory holds the whole float32 model while writing (OLMo-7B:
~28 GB). The directory is written atomically and reused when it already holds the same initialisation (resume).

Tokenizer hashes are `data.tokenizers.tokenizer_hash` of the tokenizer.json files (the model directory's for the
source, the run's data.tokenizer for the target), the quantity the data pipeline records in shard manifests and
stage 1 records in the P file. For the source, the hash of the tokenizer as transformers rebuilds it
(`AutoTokenizer(model).backend_tokenizer`) is accepted too: for some classes (GPTNeoXTokenizer, the OLMo hub
tokenizer's) transformers 5 rebuilds it and its serialisation differs from the file. A mismatch is an error naming
both hashes. `resolve_plan` reads the tokenizers and the P file once per run and the plan carries them on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.errors import InitError

log = logging.getLogger("s2t2.init")

InitKind = Literal["translated", "orig_tok", "new_tok_truncate", "as_is"]
#: kinds that build a new embedding / head (and write an initial model directory)
NEW_VOCAB_KINDS = ("translated", "new_tok_truncate")
INFO_FILE = "s2t2_init.json"


@dataclass
class InitConfig:
    #: translated (from a P file) | new_tok_truncate (new tokenizer, E and L cut to u rows) | orig_tok (model and
    #: its tokenizer as they are; data = source-tokenizer shards) | as_is (= orig_tok: an HF dir used as it is)
    kind: InitKind = "translated"
    #: the P file written by stage 1 (translated only)
    p_file: str = ""
    #: where the initial model directory is written; default RUN_DIR/init
    dir: str = ""

    def validate(self) -> None:
        if self.kind == "translated" and not self.p_file:
            raise ConfigError("p_file: init.kind=translated needs the P file of stage 1 (e.g. runs/translate/P.safetensors)")
        if self.kind != "translated" and self.p_file:
            raise ConfigError(f"p_file: only used with init.kind=translated (kind={self.kind}); remove it")


@dataclass
class InitPlan:
    """What a run starts from, as every rank sees it."""

    kind: str
    #: the Hugging Face directory (or hub id) to load: RUN_DIR/init, or the source model itself for orig_tok
    model_dir: str
    #: the tokenizer the model speaks from now on (its files go into the export)
    tokenizer: str
    tokenizer_hash: str
    #: u: tokens of that tokenizer (the random-guess line is ln u)
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    #: start-of-document id of the shards (BOS, or EOS for tokenizers without one)
    start_id: int
    source_tokenizer_hash: str | None = None
    p_kind: str | None = None
    #: what resolving read, handed on so that the run reads each input once (not part of the record): the
    #: tokenizer the model speaks (data.tokenizers.TokenizerInfo) and the P file (pfile.SparseP, translated only)
    loaded: dict = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "loaded"}


# ----------------------------------------------------------------------------------------------------------------
# tokenizers (data/tokenizers.py), their errors said as InitError


@contextlib.contextmanager
def _as_init_error(prefix: str = ""):
    from s2t2_dist.errors import DataError

    try:
        yield
    except DataError as e:
        raise InitError(f"{prefix}{e}") from None


# ----------------------------------------------------------------------------------------------------------------
# new embeddings


@torch.no_grad()
def translated_embeddings(model, p) -> tuple[torch.Tensor, torch.Tensor]:
    """(E', L') of `model` under the P file `p` (a translator.pfile.SparseP): E' = W_E^T E[source_ids], L' = W_L^T L[source_ids]
    with the P file's own normalisation, in float32: the same function as training (translator.translated_rows)."""
    from s2t2_dist.models.hf import check_finite_embeddings, get_embedding_and_head
    from s2t2_dist.translator import translated_rows

    E, L, _ = get_embedding_and_head(model)
    check_finite_embeddings(E, L, "model.path")
    src = p.source_ids.long()
    if src.numel() and (int(src.max()) >= E.shape[0] or int(src.min()) < 0):
        raise InitError(f"the P file's source ids reach {int(src.max())} but the model has {E.shape[0]} embedding rows")
    E_src = E.detach().float()[src]
    L_src = E_src if L is E else L.detach().float()[src]
    return translated_rows(p.dense(torch.float32), E_src, L_src, p.mu, p.nu, p.normalization)


@torch.no_grad()
def truncated_embeddings(model, u: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(E[:u], L[:u]): the "FT new tok." baseline (the new tokenizer's id j reuses the source model's row j)."""
    from s2t2_dist.models.hf import check_finite_embeddings, get_embedding_and_head

    E, L, _ = get_embedding_and_head(model)
    check_finite_embeddings(E, L, "model.path")
    if u > E.shape[0]:
        raise InitError(f"new_tok_truncate: the new tokenizer has {u} tokens but the model only {E.shape[0]} rows")
    return E.detach().float()[:u].clone(), L.detach().float()[:u].clone()


# ----------------------------------------------------------------------------------------------------------------
# the plan and the initial directory


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def resolve_plan(init: InitConfig, model_path: str, tokenizer: str, out_dir: str | Path, *, target=None,
                 source=None) -> tuple[InitPlan, dict]:
    """Check the configuration (hashes, sizes) and say what the run starts from. Cheap (no model weights are read);
    every rank calls it, once per run (the plan carries what it read: `InitPlan.loaded`). ``target`` (the
    TokenizerInfo of ``tokenizer``) and ``source`` (the model's ModelTokenizer) are used instead of reading them
    again when the caller has them. Returns (plan, identity of the initial directory for reuse checks)."""
    from s2t2_dist.data.tokenizers import load_model_tokenizer, load_tokenizer, same_vocabulary

    tok = tokenizer or (model_path if init.kind in ("orig_tok", "as_is") else "")
    if not tok:
        raise InitError(f"init.kind={init.kind} needs the new tokenizer (data.tokenizer)")

    def model_tok():
        nonlocal source
        if source is None:
            with _as_init_error():
                source = load_model_tokenizer(model_path)
        return source

    if target is None:
        with _as_init_error(f"tokenizer {tok}: "):
            target = model_tok().info() if not tokenizer else load_tokenizer(tok)
    info = target
    identity: dict = {"kind": init.kind, "model": str(model_path), "tokenizer_hash": info.hash}
    plan = InitPlan(kind=init.kind, model_dir=str(model_path), tokenizer=tok, tokenizer_hash=info.hash,
                    vocab_size=info.vocab_size, bos_id=info.bos_id, eos_id=info.eos_id, pad_id=info.pad_id,
                    start_id=info.start_id, loaded={"tokenizer": info})
    if init.kind in ("orig_tok", "as_is"):
        src_hash = model_tok().hash if tokenizer else info.hash
        plan.source_tokenizer_hash = src_hash
        if src_hash != info.hash:
            with _as_init_error(f"tokenizer {model_path}: "):
                same = same_vocabulary(model_tok().info(), info)
            if not same:
                raise InitError(
                    f"init.kind={init.kind} keeps the model's own tokenizer, but data.tokenizer {tok} (hash "
                    f"{info.hash}) is a different tokenizer from the one stored with {model_path} (hash {src_hash}); "
                    "use the source-tokenizer shards and tokenizer, or init.kind=translated / new_tok_truncate")
        rows = _embedding_rows(model_path)
        if rows is not None and info.vocab_size > rows:
            raise InitError(f"tokenizer {tok} has {info.vocab_size} tokens but {model_path} only {rows} embedding rows")
        return plan, identity
    src_hash = model_tok().hash
    plan.source_tokenizer_hash = src_hash
    plan.model_dir = str(out_dir)
    if init.kind == "translated":
        from s2t2_dist.translator.pfile import load_p

        p = load_p(init.p_file)
        if p.source_tokenizer_hash != src_hash:
            try:
                alt = model_tok().transformers_hash()
            except Exception:  # noqa: BLE001 - no transformers tokenizer: only the file hash counts
                alt = None
            if alt == p.source_tokenizer_hash:
                log.info("init: %s records the source tokenizer as transformers rebuilds it (%s; file hash %s)",
                         init.p_file, alt, src_hash)
                src_hash = alt
        p.check_compatible(src_hash, info.hash, where=f"{init.p_file}: ")
        plan.source_tokenizer_hash = src_hash
        if p.shape[1] != info.vocab_size:
            raise InitError(f"{init.p_file}: P has {p.shape[1]} target columns but the tokenizer {tok} has "
                            f"{info.vocab_size} tokens")
        plan.p_kind = p.kind
        plan.loaded["p"] = p
        identity.update(p_file=str(init.p_file), p_sha256=_file_sha256(init.p_file), p_kind=p.kind,
                        source_tokenizer_hash=src_hash)
    else:
        identity.update(source_tokenizer_hash=src_hash)
    return plan, identity


def _embedding_rows(model_path: str) -> int | None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_path))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "vocab_size", None)


def replace_dir(partial: Path, out: Path, marker: str) -> None:
    """Move the finished `partial` directory to `out`, replacing an older `out` only if this package wrote it
    (it holds `marker`): a mistyped init.dir / export.dir never deletes someone's directory."""
    from s2t2_dist.utils.io import fsync_dir

    if out.exists():
        if not (out / marker).is_file():
            raise InitError(f"refusing to replace {out}: it exists and was not written by s2t2 (no {marker}); "
                            "choose another directory or remove it")
        shutil.rmtree(out)
    partial.rename(out)
    fsync_dir(out.parent)


def initial_dir_is_current(out_dir: Path, identity: dict) -> bool:
    f = Path(out_dir) / INFO_FILE
    if not f.is_file():
        return False
    try:
        return json.loads(f.read_text()).get("identity") == identity
    except ValueError:
        return False


def write_initial_model(init: InitConfig, plan: InitPlan, identity: dict, model_path: str, out_dir: str | Path, *,
                        trust_remote_code: bool = False) -> Path:
    """Build and save the initial model directory (call on ONE rank). Reuses a directory holding the same
    initialisation. Returns its path."""
    from s2t2_dist.data.tokenizers import copy_tokenizer_files
    from s2t2_dist.models.hf import from_pretrained_checked
    from s2t2_dist.models.translated import materialize
    from s2t2_dist.utils.io import atomic_write_text, fsync_dir

    out = Path(out_dir)
    if initial_dir_is_current(out, identity):
        log.info("init: reusing %s", out)
        return out
    if out.exists() and not (out / INFO_FILE).is_file():
        raise InitError(f"init.dir {out} exists and was not written by s2t2 (no {INFO_FILE}); choose another")
    model = from_pretrained_checked(model_path, dtype=torch.float32, trust_remote_code=trust_remote_code)
    if init.kind == "translated":
        E_new, L_new = translated_embeddings(model, plan.loaded["p"])
    elif init.kind == "new_tok_truncate":
        E_new, L_new = truncated_embeddings(model, plan.vocab_size)
    else:
        raise InitError(f"init.kind={init.kind} writes no initial directory")
    model = materialize(model, E_new, L_new, inplace=True, bos_token_id=plan.bos_id, eos_token_id=plan.eos_id,
                        pad_token_id=plan.pad_id, dtype=torch.float32)
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    model.save_pretrained(str(partial), safe_serialization=True)
    del model
    copy_tokenizer_files(plan.loaded["tokenizer"], partial)
    atomic_write_text(partial / INFO_FILE, json.dumps({"identity": identity, "plan": plan.to_dict()}, indent=1))
    fsync_dir(partial)
    replace_dir(partial, out, INFO_FILE)
    log.info("init: wrote %s (%s, vocabulary %d)", out, init.kind, plan.vocab_size)
    return out


def prepare_initial_model(init: InitConfig, model_path: str, tokenizer: str, out_dir: str | Path, *,
                          is_main: bool, trust_remote_code: bool = False,
                          resolved: tuple[InitPlan, dict] | None = None) -> InitPlan:
    """resolve_plan on every rank (unless ``resolved``: its result, from the run's pre-flight), write_initial_model
    on rank 0, then a barrier. Collective when distributed; an error on rank 0 is raised on every rank."""
    from s2t2_dist.distributed.collectives import raise_if_any_failed

    plan, identity = resolved or resolve_plan(init, model_path, tokenizer, out_dir)
    err = None
    if plan.kind in NEW_VOCAB_KINDS and is_main:
        try:
            write_initial_model(init, plan, identity, model_path, out_dir, trust_remote_code=trust_remote_code)
        except BaseException as e:  # noqa: BLE001 - raised on every rank below
            err = e
    if err is not None and not _distributed():
        raise err
    raise_if_any_failed(err, f"writing the initial model {out_dir}")
    return plan


def _distributed() -> bool:
    from s2t2_dist.distributed import collectives as coll

    return coll.distributed()


def check_shards(manifest: dict, plan: InitPlan, what: str) -> None:
    """The shards must be tokenized with the tokenizer the model speaks."""
    h = (manifest.get("tokenizer") or {}).get("hash")
    if h != plan.tokenizer_hash:
        raise InitError(
            f"{what} {manifest.get('_dir')}: tokenized with tokenizer hash {h}, but this run's model speaks "
            f"{plan.tokenizer} (hash {plan.tokenizer_hash}); init.kind={plan.kind} needs "
            + ("the source-tokenizer shards (shards/source/...)" if plan.kind in ("orig_tok", "as_is")
               else "the new-tokenizer shards (shards/new/...)"))
