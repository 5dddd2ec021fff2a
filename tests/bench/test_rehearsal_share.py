"""bench/rehearsal.py's share leg runs as typed at a tiny width on CPU: the translator and the stage-1 step timed in
interleaved pairs, at v = 243. The v = 50,280 cases are for a GPU (`--share-device cuda`, bench/gpu_check.sh): on a
CPU each of their steps takes tens of seconds (the CPU route is exact, not fast), and the shipped plan at that size
is exercised by tests/translator/test_plan_product.py's bench run."""

import json
import sys

import pytest

from tests.helpers.stage_fixtures import run_cmd

pytestmark = pytest.mark.slow


def test_share_leg_runs_at_a_tiny_width(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = run_cmd([sys.executable, "-m", "bench.rehearsal", "--out", str(out), "--cache", str(cache),
                    "--layers", "1", "--d-model", "128", "--heads", "2", "--legs", "share", "--reps", "2",
                    "--share-steps", "single_byte", "--share-cases", "single_byte"], timeout=900)
    assert "interleaved pairs" in proc.stdout, proc.stdout[-3000:]
    s = json.loads((out / "share.json").read_text())
    assert s["device"] == "cpu" and "sync_debug" not in s["single_byte"]  # (the sync debug mode is CUDA's)
    assert set(s) >= {"single_byte"} and not {"all", "all_recipe", "single_byte_recipe", "all_shipped"} & set(s)
    r = s["single_byte"]
    # (at this width the LM is tiny: the translator is most of a step, its share near 1, noise either side)
    assert r["v"] == 243 and len(r["translator_s"]) == 2 and 0 < r["translator_share"] < 2, r
    assert len(r["step_s"]) == 2 and len(r["translator_share_paired"]) == 2  # timed against the whole step, in pairs
    assert r["translator_share_paired"][0] <= r["translator_share_paired_median"]
    assert 0 < r["p_live_rows"] <= 243
    table = json.loads((out / "results.json").read_text())
    assert "share" in table
