"""bench/rehearsal.py's share leg (#21 item 4) runs as typed at a tiny width: the translator and the stage-1 step
timed in interleaved pairs for v = 243 (the moved uniform start, floor 0) and v = 50,280 (the shipped recipe whole:
FVT start on a protein tokenizer trained by the leg, its own source marginal, floor 1). The other cases (a moved
uniform start at v = 50,280: every row live, every support large) are for a GPU: on a CPU each of their steps takes
tens of seconds (the CPU route is exact, not fast)."""

import json
import sys

import pytest

from stage_fixtures import REPO, run_cmd

pytestmark = pytest.mark.slow


def test_share_leg_runs_at_a_tiny_width(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = run_cmd([sys.executable, str(REPO / "bench" / "rehearsal.py"), "--out", str(out), "--cache", str(cache),
                    "--layers", "1", "--d-model", "128", "--heads", "2", "--legs", "share", "--reps", "2",
                    "--share-steps", "all", "--share-cases", "single_byte,all_shipped"], timeout=900)
    assert "interleaved pairs" in proc.stdout, proc.stdout[-3000:]
    s = json.loads((out / "share.json").read_text())
    assert s["device"] == "cpu" and "sync_debug" not in s["all_shipped"]  # (the sync debug mode is CUDA's)
    assert set(s) >= {"single_byte", "all_shipped"} and not {"all", "all_recipe", "single_byte_recipe"} & set(s)
    for name, v in (("single_byte", 243), ("all_shipped", 50280)):
        r = s[name]
        # (at this width the LM is tiny: the translator is most of a step, its share near 1, noise either side)
        assert r["v"] == v and len(r["translator_s"]) == 2 and 0 < r["translator_share"] < 2, (name, r)
        if name.startswith("all"):  # timed against the whole step, in pairs
            assert len(r["step_s"]) == 2 and len(r["translator_share_paired"]) == 2
            assert r["translator_share_paired"][0] <= r["translator_share_paired_median"]
        else:
            assert r["share_denominator"] == "translator + bare HF step"
    shipped = s["all_shipped"]
    # the shipped start's plan lives on the few sources of the target tokens' surface strings (what the product
    # kernels read: translator/product.py)
    assert shipped["start"] == "shipped" and (out / "share_tokenizer" / "tokenizer.json").is_file()
    assert 0 < shipped["p_live_rows"] < 2000, shipped
    table = json.loads((out / "results.json").read_text())
    assert "share" in table
