"""What a finished arm of a reproduction leaves for later phases and the report: OUT/record/<job name>.json, its
result plus the validation curve from its TensorBoard logs and the arm's spec. Small, so it can be kept (and
committed) when the run directories cannot; a record stands for a finished arm wherever it is found, as long as its
spec is the arm's: a record of a 200-step finetune never stands for a 600-step one, nor the score of its export for
the score of another's. Each record carries a checksum of its content: one altered after it was written is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from s2t2_dist.api import DataError
from s2t2_dist.recipes.paper_plan import Job

#: further directories of arm records to reuse, read-only (`--record`: records kept from another machine)
EXTRA_RECORDS: list[Path] = []


#: override keys that say where things are or how the run was kept, not what the arm is (paths differ between
#: machines; checkpoints, logging and loader workers leave the result as it is)
NOT_SPEC_KEYS = frozenset({"run_dir", "output", "model.path", "init.p_file", "eval.name", "data.train", "data.eval",
                           "data.tokenizer", "data.num_workers", "train.ckpt_every", "train.keep_checkpoints",
                           "train.log_every"})


def arm_spec(job: Job) -> list[str]:
    """What a finished arm stands for: its stage, config and every override that is not a path, then the specs of
    the arms whose outputs it reads (``job.upstream``)."""
    own = sorted(o for o in job.overrides if o.split("=", 1)[0] not in NOT_SPEC_KEYS)
    return [job.stage, job.config, *own, *job.upstream]


def upstream_of(*producers: Job) -> list[str]:
    """``Job.upstream`` of a job that reads these jobs' outputs."""
    return [json.dumps(arm_spec(p)) for p in producers]


def record_path(job: Job) -> Path:
    return Path(job.run_dir).parents[len(Path(job.name).parts)] / "record" / f"{job.name}.json"


def checksum(r: dict) -> str:
    """sha256 of a record's content (everything but the checksum itself), in a canonical JSON form."""
    body = {k: v for k, v in r.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_result(job: Job) -> dict | None:
    """The finished result that stands for `job`: its record, here or in EXTRA_RECORDS, with the job's spec (a
    record without one, or of another spec, stands for nothing: the lanes run the arm again, and the run directory
    they hand it to starts afresh if it ran another spec: orchestrate.Runner's identity). A record of the job's
    spec whose content is not what was written (its checksum) is refused in one line (DataError): a number edited
    by hand never reaches a table."""
    spec = arm_spec(job)
    for p in (record_path(job), *(d / f"{job.name}.json" for d in EXTRA_RECORDS)):
        if p.is_file():
            try:
                r = json.loads(p.read_text())
            except ValueError:
                continue
            if r.get("finished", True) and r.get("spec") == spec:
                if r.get("checksum") != checksum(r):
                    raise DataError(f"record {p}: its content is not what the arm wrote (checksum "
                                    f"{'missing' if 'checksum' not in r else 'differs'}); remove it to run the arm "
                                    "again")
                return r
    return None


def write_record(job: Job) -> None:
    from s2t2_dist.api import atomic_write_json

    r = json.loads(Path(job.result).read_text())
    if job.stage in ("translate", "finetune"):
        r["curve"] = _eval_curve(Path(job.run_dir))
    r["spec"] = arm_spec(job)
    r["checksum"] = checksum(r)
    rp = record_path(job)
    rp.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(rp, r)


def _eval_curve(run_dir: Path) -> list:
    from s2t2_dist.recipes.orchestrate import tb_scalars

    pts: dict = {}
    if not (run_dir / "tb" / "global").is_dir():
        return []
    for tag in ("eval/bpb", "train/loss"):
        try:
            pts[tag] = tb_scalars(run_dir / "tb" / "global", tag)
        except (OSError, ValueError):
            pts[tag] = []
    return [{"tag": t, "points": [[int(s), float(v)] for s, v in p]} for t, p in pts.items()]
