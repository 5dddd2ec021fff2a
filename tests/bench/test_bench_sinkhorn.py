"""bench/bench_sinkhorn.py runs as typed (small, on CPU): the route against the sort reference in the same run,
exact; no host reads; the CUDA route's kernel count; --device cuda without a GPU is one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench.bench_sinkhorn"]


def _run(args, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(BENCH + args, env=env, capture_output=True, text=True, timeout=600, cwd=REPO, **kw)


@pytest.mark.parametrize("start", ["moved", "uniform", "sparse"])
def test_bench_sinkhorn_as_typed(tmp_path, start):
    out = tmp_path / "r.json"
    proc = _run(["--v", "3000", "--u", "96", "--reps", "2", "--start", start, "--out", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["route"] == "TorchSteps" and r["host_syncs"] == 0
    assert r["routes"]["sinkhorn"]["route"] == "torch steps" and not r["routes"]["sinkhorn"]["fallback"], r["routes"]
    assert r["max_diff_P"] < 1e-9 and r["max_diff_grad"] <= 1e-5 * max(r["max_grad"], 1.0), r
    k = r["cuda_kernels"]
    assert k["triton_launches"] == 12 and k["host_syncs"] == 0 and k["total"] <= 100, k
    assert "sort reference" in proc.stdout and "Triton launches" in proc.stdout


def test_bench_sinkhorn_cuda_without_a_gpu_is_a_user_error():
    proc = _run(["--device", "cuda", "--v", "100", "--u", "10"])
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr


def test_gpu_check_runs_as_typed_and_writes_one_json(tmp_path):
    """bench/gpu_check.sh on a machine without a GPU: the item runs, fails in one line ("no CUDA device"), and the
    one JSON records it (the plumbing the GPU run relies on); an item whose package cannot be imported (here a
    deepspeed that raises ImportError, as on a bare GPU node) is skipped with the reason, and the rest still run."""
    out, work, fake = tmp_path / "out", tmp_path / "work", tmp_path / "fake"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{REPO}", OUT=str(out), W=str(work))
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), "400", "A,C0,C1,FT_zero3"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads((out / "gpu_check.json").read_text())
    assert r["items"]["C1"]["rc"] == "1" and r["items"]["C0"]["rc"] == "2", r
    assert r["items"]["A"]["rc"] == r["items"]["FT_zero3"]["rc"] == "skipped: no deepspeed", r
    summary = (out / "summary.txt").read_text()
    assert "missing packages: deepspeed" in summary and "A skipped (deepspeed cannot be imported)" in summary
    assert "routes: none recorded" in summary and r["fallbacks"] == []
    assert "no CUDA device" in (work / "logs" / "C1.log").read_text()
    assert (work / "logs" / "C0.log").read_text().startswith("--device cuda: no CUDA device here")
    assert (out / "summary.txt").is_file() and (out / "logs.tgz").is_file()


def test_gpu_check_fails_on_a_fallback_and_names_the_routes(tmp_path):
    """The report names each run's routes; a run whose Sinkhorn fell back to the torch steps fails the check."""
    work = tmp_path / "w"
    (work / "logs").mkdir(parents=True)
    ok = {"sinkhorn": {"route": "kernels", "why": "Triton", "fallback": False, "device": "cuda:0"},
          "product": {"route": "live-row kernels", "why": "Triton", "fallback": False, "device": "cuda:0"}}
    bad = dict(ok, sinkhorn={"route": "torch steps", "why": "the Triton kernels failed their first-use check",
                             "fallback": True, "device": "cuda:0"})
    for run, routes in (("tr1", ok), ("tr2", bad)):
        (work / run).mkdir()
        (work / run / "result.json").write_text(json.dumps({"routes": routes}))
    report = [sys.executable, "-m", "bench.gpu_check_report", str(work), str(tmp_path / "r.json")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(report, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "routes B1: sinkhorn: kernels; product: live-row kernels" in proc.stdout
    assert "CHECK FAILED: a route fell back: B2 sinkhorn: torch steps (the Triton kernels failed" in proc.stdout
    (work / "tr2" / "result.json").write_text(json.dumps({"routes": ok}))
    assert subprocess.run(report, env=env, capture_output=True, text=True, timeout=120, cwd=REPO).returncode == 0
