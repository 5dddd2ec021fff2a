"""Launch arithmetic, checked before any rank starts: the batch layout on nodes x tasks per node, and the time-limit
signal's lead time from the size of the checkpoint the stage writes.

    python -m s2t2_dist.cluster.layout STAGE [--config FILE] [overrides ...]

is what slurm/common.sh runs in the batch shell before `srun` (ranks from SLURM_JOB_NUM_NODES x SLURM_NTASKS): an
impossible layout is one line naming the keys and exit 2, before any rank starts; so is a job time limit (asked by
`squeue`, when there is one) no longer than the lead the final checkpoint needs: the time-limit signal would come at
once, the stage would checkpoint and requeue without training, again and again. Otherwise it prints the layout and
the lead time the signal needs. `s2t2 submit` runs the same checks before the job is queued.

Signal lead time (the seconds between SLURM's time-limit warning and the kill):
    lead = ceil_to_minute(SIGNAL_MARGIN_S + SIGNAL_SAFETY x checkpoint bytes / (WRITE_BYTES_PER_S_PER_NODE x nodes))
with a conservative parallel-filesystem write speed of 0.5 GB/s per node, 1.5x on the write time and 120 s for the
step in flight, the process teardown and the requeue. Checkpoint bytes: stage 2 writes 16 bytes per parameter
(ZeRO-3 / FSDP2: weights + fp32 master + two Adam moments, rounded up), ~110 GB for OLMo-7B; stage 1 writes C, its
two Adam moments and P, 16 bytes per entry of the source vocabulary x new vocabulary. prepare and evaluate write
no checkpoint: the margin alone.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from s2t2_dist.errors import ConfigError

STAGE_NAMES = ("prepare", "translate", "finetune", "evaluate")
#: a conservative sustained write speed of a shared filesystem, per node writing its shards in parallel
WRITE_BYTES_PER_S_PER_NODE = 0.5e9
#: factor on the estimated write time
SIGNAL_SAFETY = 1.5
#: seconds for the step in flight, the teardown and the requeue
SIGNAL_MARGIN_S = 120
#: bytes per parameter in a stage-2 checkpoint (bf16/fp32 weights + fp32 master copy + Adam m and v, rounded up)
FINETUNE_BYTES_PER_PARAM = 16
#: bytes per entry of C in a stage-1 checkpoint (C, Adam m and v, and the P file, fp32)
TRANSLATE_BYTES_PER_ENTRY = 16
#: the new vocabulary assumed when the stage-1 tokenizer does not exist yet (the largest shipped prepare vocab_size)
DEFAULT_NEW_VOCAB = 8192


def param_count(hf_config: dict) -> int:
    """Parameters of a decoder-only Hugging Face model from its config.json (embeddings, attention, gated MLP;
    norms are negligible)."""
    v, d, n = hf_config["vocab_size"], hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config.get("num_attention_heads", 1)
    kv = hf_config.get("num_key_value_heads") or heads
    inter = hf_config.get("intermediate_size", 4 * d)
    per_layer = 2 * d * d + 2 * d * (d // heads) * kv + 3 * d * inter
    tied = hf_config.get("tie_word_embeddings", False)
    return v * d * (1 if tied else 2) + n * per_layer


def model_config(path: str) -> dict | None:
    """config.json of a model directory or a shipped name (allenai/OLMo-7B-hf, ...); None if neither."""
    from s2t2_dist.recipes.tiny import real_config_dict

    try:
        return real_config_dict(path)
    except (FileNotFoundError, ValueError):
        return None


def _tokenizer_vocab(path: str) -> int | None:
    p = Path(path)
    p = p / "tokenizer.json" if p.is_dir() else p
    try:
        tok = json.loads(p.read_text(encoding="utf-8"))
        return len(tok["model"]["vocab"]) + len([t for t in tok.get("added_tokens", [])
                                                 if t["content"] not in tok["model"]["vocab"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_bytes(stage: str, cfg) -> int | None:
    """Bytes of one checkpoint of ``stage`` with config ``cfg`` (0: the stage writes none; None: unknown model)."""
    if stage not in ("translate", "finetune"):
        return 0
    hf = model_config(cfg.model.path)
    if hf is None:
        return None
    if stage == "finetune":
        return FINETUNE_BYTES_PER_PARAM * param_count(hf)
    new_vocab = _tokenizer_vocab(cfg.data.tokenizer) or DEFAULT_NEW_VOCAB
    return TRANSLATE_BYTES_PER_ENTRY * hf["vocab_size"] * new_vocab


def signal_lead_s(ckpt_bytes: int | None, nodes: int) -> int:
    """Seconds between the time-limit warning and the kill for a checkpoint of ``ckpt_bytes`` written by ``nodes``
    nodes (see the module doc); whole minutes. Unknown size (None): the margin plus a 100 GB checkpoint."""
    size = 100e9 if ckpt_bytes is None else ckpt_bytes
    secs = SIGNAL_MARGIN_S + SIGNAL_SAFETY * size / (WRITE_BYTES_PER_S_PER_NODE * max(nodes, 1))
    return int(math.ceil(secs / 60) * 60)


def timeout_minutes(value: str | int) -> int:
    """SLURM time formats (minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]) in whole minutes (rounded up)."""
    s = str(value).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ConfigError(f"time: {value!r} is not a SLURM time (minutes, HH:MM:SS or D-HH:MM:SS)")
    days, a, b, c = m.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # HH:MM:SS
        secs = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # MM:SS
        secs = int(a) * 60 + int(b)
    else:  # minutes
        secs = int(a) * 60
    if secs <= 0:
        raise ConfigError(f"time: {value!r} must be positive")
    return -(-secs // 60)


def check_time_limit(limit_s: int | None, lead_s: int, what: str) -> None:
    """ConfigError when a time limit of ``limit_s`` seconds leaves no time before a signal ``lead_s`` ahead of it."""
    if limit_s is not None and limit_s <= lead_s:
        raise ConfigError(f"{what} = {limit_s} s is not longer than the {lead_s} s the final checkpoint needs "
                          f"before the time limit: the time-limit signal would come at once and the job would "
                          f"requeue without training; ask for a longer time limit")


def job_time_limit_s(env: dict) -> int | None:
    """The running job's time limit in seconds, asked from ``squeue`` (None: no job, no squeue, no limit)."""
    job = env.get("SLURM_JOB_ID")
    if not job or shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%l"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # a slow or absent controller: the check is a courtesy
        return None
    try:
        return 60 * timeout_minutes(out)
    except ConfigError:  # UNLIMITED, NOT_SET, empty
        return None


def parse_stage_config(stage: str, argv: list[str]):
    import importlib

    from s2t2_dist.cli import COMMANDS  # not submit.STAGES: submit imports this module (no import cycle)

    if stage not in COMMANDS:  # the probe: no stage config
        return None
    parse = getattr(importlib.import_module(COMMANDS[stage][0]), "parse_config", None)
    return parse(list(argv)) if parse is not None else None


def check_layout(cfg, world_size: int, ranks: str) -> int | None:
    """The micro-batch the stage will use on ``world_size`` ranks (None for stages without training); ConfigError
    naming the keys if the layout is impossible."""
    train = getattr(cfg, "train", None)
    return None if train is None else train.micro_for(world_size, ranks)


def _slurm_layout(env: dict) -> tuple[int, int, str]:
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    world = int(env.get("SLURM_NTASKS") or nodes)
    per_node = (env.get("SLURM_NTASKS_PER_NODE") or str(world // nodes)).split("(")[0]
    return nodes, world, f"--nodes={nodes} x --ntasks-per-node={per_node} = {world} ranks"


def main(argv: list[str] | None = None) -> int:
    from s2t2_dist.stages.common import run_main

    argv = list(sys.argv[1:] if argv is None else argv)

    def work() -> int:
        if not argv or argv[0] not in STAGE_NAMES:
            raise ConfigError("usage: python -m s2t2_dist.cluster.layout STAGE [--config FILE] [overrides ...]")
        stage, rest = argv[0], argv[1:]
        cfg = parse_stage_config(stage, rest)
        nodes, world, ranks = _slurm_layout(dict(os.environ))
        micro = check_layout(cfg, world, ranks)
        lead = signal_lead_s(checkpoint_bytes(stage, cfg), nodes)
        check_time_limit(job_time_limit_s(dict(os.environ)), lead, f"the time limit of job {os.environ.get('SLURM_JOB_ID')}")
        what = "" if micro is None else (f" train.batch_size={cfg.train.batch_size} = micro-batch {micro} x "
                                         f"{cfg.train.grad_accum(world)} accumulation step(s) x {world} ranks;")
        print(f"layout: {ranks};{what} the final checkpoint needs the time-limit signal {lead} s ahead",
              flush=True)
        return 0

    return run_main("s2t2 layout", work)


if __name__ == "__main__":
    sys.exit(main())
