"""bench/bench_sinkhorn.py runs as typed (CPU, small C), so the Sinkhorn benchmark, including its warm-start and
moving-C legs, is known to work before the day a GPU is at hand; ``--device cuda`` without a GPU is a one-line
error, exit 2."""

import json
import os
import subprocess
import sys

from stage_fixtures import REPO, run_cmd

BENCH = str(REPO / "bench" / "bench_sinkhorn.py")
# compiled kernels: the threshold search (and so the warm starts) runs at any size; small sizes are sorted otherwise
SMALL = ["--v", "2000", "--u", "40", "--fused", "true", "--threads", "1", "--states", "moved"]


def test_bench_sinkhorn_reports_warm_cold_and_bandwidth(tmp_path):
    out = tmp_path / "b.json"
    proc = run_cmd([sys.executable, BENCH, *SMALL, "--repeats", "1", "--naive-rows", "500", "--skip-memory",
                    "--warm", "4", "--json", str(out)], timeout=600)
    assert "achieved bandwidth" in proc.stdout, proc.stdout
    res = json.loads(out.read_text())
    r = res["states"]["moved"]
    assert res["warm_iters"] == 4
    assert r["syncs"].startswith("0 host syncs") and r["unproven"] == 0
    assert r["warm_fwd"] > 0 and r["cold_fwd"] > 0 and 0 < r["achieved_bandwidth"] < r["bandwidth"] * 10
    assert 0 < r["density"] < 1 and r["naive_rows"] == 500


def test_bench_sinkhorn_moving_leg(tmp_path):
    out = tmp_path / "m.json"
    run_cmd([sys.executable, BENCH, *SMALL, "--moving", "3", "--warm-iters", "0,4", "--json", str(out)], timeout=600)
    rows = json.loads(out.read_text())
    assert [(x["lr_v"], x["warm_iters"]) for x in rows] == [(0.025, 0), (0.025, 4), (2.5, 0), (2.5, 4)]
    for x in rows:
        assert len(x["unproven"]) == 3 and x["step_s"] > 0
    assert all(x["unproven"] == [0, 0, 0] for x in rows if x["lr_v"] == 0.025)


def test_bench_sinkhorn_cuda_without_a_gpu_is_a_user_error():
    proc = subprocess.run([sys.executable, BENCH, "--device", "cuda"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
