"""What a finished arm of a reproduction leaves for later phases and the report: OUT/record/<job name>.json, its
result plus the validation curve from its TensorBoard logs. Small, so it can be kept (and committed) when the run
directories cannot; a record stands for a finished arm wherever it is found."""

from __future__ import annotations

import json
from pathlib import Path

from s2t2_dist.recipes.paper_plan import Job

#: further directories of arm records to reuse, read-only (`--record`: records kept from another machine)
EXTRA_RECORDS: list[Path] = []


def record_path(job: Job) -> Path:
    return Path(job.run_dir).parents[len(Path(job.name).parts)] / "record" / f"{job.name}.json"


def read_result(job: Job) -> dict | None:
    # the record first: it is the result plus what the report reads from the run directory (the curve)
    for p in (record_path(job), *(d / f"{job.name}.json" for d in EXTRA_RECORDS), Path(job.result)):
        if p.is_file():
            try:
                r = json.loads(p.read_text())
            except ValueError:
                continue
            if r.get("finished", True):
                return r
    return None


def write_record(job: Job) -> None:
    from s2t2_dist.utils.io import atomic_write_json

    r = json.loads(Path(job.result).read_text())
    if job.stage in ("translate", "finetune"):
        r["curve"] = _eval_curve(Path(job.run_dir))
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
