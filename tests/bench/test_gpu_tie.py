"""bench/gpu_tie.py, the next GPU call's first item, on a CPU: without the interpreter it skips the kernels and says
so; with Triton's interpreter the kernels pass the check launch by launch and agree with the torch steps."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, interpret: bool):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "tie.json"
    p = subprocess.run([sys.executable, "-m", "bench.gpu_tie", "--device", "cpu", "--shapes", "300x40,64x9", "--out",
                        str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(out.read_text())


def test_without_a_gpu_the_kernels_are_skipped_and_said(tmp_path):
    r = _run(tmp_path, interpret=False)
    assert [p["shape"] for p in r["plans"]] == ["300 x 40", "64 x 9"]
    assert all(p["kernels"].startswith("skipped: no CUDA device") for p in r["plans"])


@pytest.mark.slow
def test_interpreted_kernels_pass_the_check_and_agree(tmp_path):
    r = _run(tmp_path, interpret=True)
    for p in r["plans"]:
        assert p["check"]["verdict"] == "passes" and p["route"] == "kernels", p
        assert p["kernels_vs_torch_cpu"]["grad_rel"] < 1e-5 and p["kernels_vs_torch_cpu"]["grad_entries_off"] == 0
