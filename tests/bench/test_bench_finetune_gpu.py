"""bench/bench_finetune_gpu.py as typed, at a tiny size on a CPU: both engines through torchrun, one JSON with
tokens/s, the step split and the start-up phases (MFU and GPU memory are a GPU's: absent here)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_of_both_engines(tmp_path):
    cmd = [sys.executable, "-m", "bench.bench_finetune_gpu", "--out", str(tmp_path), "--layers", "2", "--d-model", "64",
           "--heads", "4", "--batch", "2", "--context-len", "64", "--steps", "3", "--log-every", "1",
           "--data-vocab", "128", "--timeout", "500"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "finetune_gpu.json").read_text())
    for eng, build in (("fsdp", "weights load (sharded)"), ("zero3", "engine build (deepspeed.initialize, optimiser)")):
        r = report[eng]
        assert r["rc"] == 0 and r["final_loss"] is not None
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert set(r["split_s"]) == {"data", "forward", "backward", "optimizer"}
        assert all(v is not None and v >= 0 for v in r["split_s"].values())
        phases = r["startup"]["phases_s"]
        assert {"preflight", "process group", "initial model", "data", build, "first step"} <= set(phases), phases
        assert r["mfu"] is None and r["gpu_mem_max_gib"] is None  # a CPU: no peak, no GPU memory
