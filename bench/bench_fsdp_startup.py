"""FSDP2 start-up at full OLMo-1B width by depth: the engine's build phases from a saved model directory,
the torchtitan way (meta-device model, fully_shard per block, each rank reads only its rows after sharding) against
the whole-model way (the model loaded whole in float32, then sharded), each in a fresh process (1 rank, gloo).

    PYTHONPATH=. python -m bench.bench_fsdp_startup --out OUT [--layers 2,4,8,16] [--cache DIR]

A phase that grows faster than the model's size shows up as a ratio that rises with depth. Only the build is timed
(no optimiser state is allocated before the first step; full AdamW on the 16-layer model needs 18.8 GB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
import torch
from s2t2_dist.api import (EngineConfig, FSDP2Engine, OptimConfig, TrainConfig, build_causal_lm, engine_kind,
                           phases)

model_dir, way = sys.argv[1], sys.argv[2]
engine_kind("fsdp").init_distributed()
rec = phases.reset()
cfg, ocfg, tcfg = EngineConfig(kind="fsdp", activation_checkpointing=False), OptimConfig(), TrainConfig(steps=2)
t0 = time.perf_counter()
if way == "meta":
    model, eng = engine_kind("fsdp").build(cfg, model_dir, ocfg, tcfg, device=torch.device("cpu"))
else:
    with phases.phase("model load"):
        model = build_causal_lm(model_dir)
    eng = FSDP2Engine.build(model, ocfg, tcfg)
total = time.perf_counter() - t0
n = sum(p.numel() for p in model.parameters())
print("RESULT " + json.dumps({"phases_s": rec.summary()["phases_s"], "build_s": round(total, 2), "params": n,
                              "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))
"""


def main(argv=None) -> int:
    from bench.rehearsal import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--layers", default="2,4,8")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ways", default="whole,meta")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               S2T2_LOG_LEVEL="WARNING")
    rows = []
    for layers in [int(x) for x in a.layers.split(",")]:
        model_dir, info = build_model(Path(a.cache or out / "cache"), layers, a.d_model, a.heads)
        for way in a.ways.split(","):
            p = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), way], capture_output=True, text=True,
                               env=env, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(p.stdout[-2000:], p.stderr[-3000:], file=sys.stderr)
                return 1
            row = {"layers": layers, "way": way, "file_gib": round(info["file_bytes"] / 2**30, 2),
                   **json.loads(line[len("RESULT "):])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "fsdp_startup.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
