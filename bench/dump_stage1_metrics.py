"""Every scalar a short stage-1 run writes to TensorBoard, its text and images, and its result.json, as one JSON
file: run it with two checkouts on PYTHONPATH and compare the files to show that a change of plumbing left the
logged numbers alone (benchmarks/translator_share_cpu2_2026-11-24.md).

    PYTHONPATH=. python -m bench.dump_stage1_metrics --work /tmp/m --out after.json --ranks 2
    PYTHONPATH=/path/to/old/checkout python -m bench.dump_stage1_metrics --work /tmp/m --out before.json --ranks 2
    python -m bench.dump_stage1_metrics --compare before.json after.json

The inputs (protein shards by prepare_small of tests/helpers/stage_fixtures.py, stories260K) are built once in
--work and reused; each run gets a fresh run directory. ``--ranks 2`` runs ``torchrun --nproc_per_node 2`` (gloo,
C's columns sharded).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _inputs(work: Path) -> tuple[Path, Path]:
    data, model = work / "data", work / "stories260k"
    if not (data / "tokenizer").exists():
        from tests.helpers.stage_fixtures import prepare_small

        prepare_small(data)
    if not model.exists():
        from s2t2_dist.api import save_hf

        save_hf(model)
    return data, model


def _run(work: Path, ranks: int, kind: str, steps: int) -> Path:
    data, model = _inputs(work)
    run_dir = work / f"run_{ranks}_{kind}"
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--config", str(REPO / "configs" / "translate_olmo1b.yaml"), f"run_dir={run_dir}",
            f"model.path={model}", "model.source_vocab=all", f"data.train={data}/shards/new/train",
            f"data.eval={data}/shards/new/eval", "train.eval_max_docs=4", f"data.tokenizer={data}/tokenizer",
            "train.context_len=64", "train.batch_size=8", "train.micro_batch_size=2", "train.log_every=2",
            "train.ckpt_every=4", "train.eval_every=4", f"train.steps={steps}", f"translator.kind={kind}",
            "translator.heatmap=[8,8]", "data.num_workers=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "S2T2_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    if ranks == 1:
        cmd = [sys.executable, str(REPO / "launch" / "translate.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(REPO / "launch" / "translate.py"), *args]
    subprocess.run(cmd, check=True, env=env, cwd=work)
    return run_dir


def _dump(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / "global"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    tags = acc.Tags()
    out = {"scalars": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in sorted(tags["scalars"])},
           "text": {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
                    for t in sorted(tags["tensors"])},
           "images": {t: [(e.step, hashlib.sha256(e.encoded_image_string).hexdigest()) for e in acc.Images(t)]
                      for t in sorted(tags["images"])}}
    res = json.loads((run_dir / "result.json").read_text())
    out["result"] = res
    return out


#: scalars that measure the machine, not the run (they differ between any two runs)
TIMING = ("train/tokens_per_s", "node/", "timing")


def _compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for section in ("scalars", "text", "images"):
        for tag in sorted(set(a[section]) | set(b[section])):
            if any(t in tag for t in TIMING):
                continue
            if a[section].get(tag) != b[section].get(tag):
                diffs.append(f"{section} {tag}: {a[section].get(tag)} != {b[section].get(tag)}")

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                if any(t in k for t in ("seconds", "time", "path", "dir", "p_file", "wall")):
                    continue
                walk(x.get(k), y.get(k), f"{path}.{k}")
        elif x != y:
            diffs.append(f"result{path}: {x} != {y}")
    walk(a["result"], b["result"], "")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/s2t2_metrics"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--kind", default="sparse")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--compare", nargs=2, type=Path)
    a = ap.parse_args()
    if a.compare:
        x, y = (json.loads(p.read_text()) for p in a.compare)
        diffs = _compare(x, y)
        n = sum(len(v) for v in x["scalars"].values())
        print(f"{len(x['scalars'])} scalar tags ({n} points), {len(x['text'])} text, {len(x['images'])} image tags: "
              + ("identical (timings left out)" if not diffs else f"{len(diffs)} differences"))
        for d in diffs:
            print("  " + d)
        sys.exit(1 if diffs else 0)
    a.work.mkdir(parents=True, exist_ok=True)
    out = _dump(_run(a.work.resolve(), a.ranks, a.kind, a.steps))
    a.out.write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}: {len(out['scalars'])} scalar tags")


if __name__ == "__main__":
    main()
