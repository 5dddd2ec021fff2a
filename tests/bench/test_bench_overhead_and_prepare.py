"""bench/bench_overhead.py and bench/bench_prepare.py run as typed (at a small size), on the product as it is: the
stage configs the stages themselves take, and the shard writer observed by the profiler, not replaced."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], timeout: float = 300) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_overhead_times_both_stages_through_the_real_loop():
    out = _run(["bench.bench_overhead", "--width", "64", "--layers", "2", "--v", "512", "--u", "64",
                "--context", "64", "--steps", "12", "--rounds", "1"])
    s1 = re.search(r"stage 1: loop ([\d.]+) ms/step .* framework ([+-][\d.]+) %", out)
    s2 = re.search(r"stage 2: loop ([\d.]+) ms/step vs bare torch loop ([\d.]+) ms", out)
    assert s1 and s2, out
    assert float(s1.group(1)) > 0 and float(s2.group(1)) > 0 and float(s2.group(2)) > 0


def test_prepare_ab_reports_each_checkout_and_the_writer_share(tmp_path):
    res_file = tmp_path / "res.json"
    out = _run(["bench.bench_prepare", "--residues", "100000", "--workers", "0", "--baseline-tree", str(REPO),
                "--ab-reps", "2", "--workdir", str(tmp_path / "w"), "--json", str(res_file)])
    runs = json.loads(res_file.read_text())["ab_shards_workers0"]
    assert set(runs) == {"baseline", "this"}
    for rs in runs.values():
        # two timed runs (no profiler), then one profiled: the writer's share of the step, a fraction
        assert [r["writer_share"] is None for r in rs] == [True, True, False]
        assert 0 < rs[-1]["writer_share"] < 1 and rs[0]["samples"] > 0
    assert "all shards byte-identical between the two: True" in out
    assert re.search(r"\| this \(.*\) \| [\d.]+ / [\d.]+ \| [\d.]+ / [\d.]+ \| [\d.]+% \|", out), out
