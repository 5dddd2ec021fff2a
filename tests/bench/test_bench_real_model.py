"""bench/bench_real_model.py as typed, at a tiny size (stories260K, 2 P steps): `--score-start` scores each translate
row's start untrained (train.steps=0) next to the trained row, and the shipped-defaults row leaves init_weight to
the translator config (one home) and records the value the run resolved; `--row` overrides it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "bench_real_model.py"


def _module(path=BENCH):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rows_default_and_overridden_init_weight():
    mod = _module()
    args = mod.argparse.Namespace(sweep=["s2t2_fvt:0.01:"], row=["w9=s2t2_fvt:init_weight=0.9,alpha=1"], seed=0)
    bench = mod.Bench.__new__(mod.Bench)
    bench.args = args
    v = bench.variants()
    assert v["s2t2_fvt"][2] is None  # the shipped default, not a copy of it
    assert v["s2t2_fvt@0.01@default"][2] is None
    kind, init, w, recipe, lr, extra = v["w9"]
    assert (kind, init, w, extra) == ("sparse", "fvt", 0.9, {"alpha": 1})


def test_score_start_as_typed(tmp_path):
    out = tmp_path / "rm"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "bench.bench_real_model", "--out", str(out), "--docs", "24", "--steps",
                           "2", "--ft-steps", "0", "--batch", "2", "--context-len", "64", "--regimes", "v>d", "--only",
                           "s2t2_fvt,w9", "--row", "w9=s2t2_fvt:init_weight=0.9", "--score-start"],
                          env=env, capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["v>d"]["rows"]
    for name, written in (("s2t2_fvt", None), ("w9", 0.9)):
        cfg = yaml.safe_load((out / "configs" / "v>d" / f"{name}.yaml").read_text())["translator"]
        assert cfg.get("init_weight") == written
        start = json.loads((out / "runs" / "v>d" / f"{name}_start" / "result.json").read_text())
        trained = json.loads((out / "runs" / "v>d" / name / "result.json").read_text())
        assert start["step"] == 0 and trained["step"] == 2
        resolved = yaml.safe_load((out / "runs" / "v>d" / name / "config.yaml").read_text())["translator"]
        assert rows[name]["init_weight"] == resolved["init_weight"]
        assert rows[name]["start"] == start["eval"]["bpb"] and rows[name]["p_only"] == trained["eval"]["bpb"]
        # the start run scores the plan the trained run started from
        assert start["P"]["start"] == trained["P"]["start"]
    assert rows["w9"]["init_weight"] == 0.9
    table = (out / "table.md").read_text()
    assert "| start |" in table and f"| {rows['w9']['start']:.3f} |" in table
    # bench/start_anatomy.py builds, from the tokenizers alone, the starts these runs scored
    anatomy = _module(REPO / "bench" / "start_anatomy.py").anatomy(
        str(out / "source_lm" / "stories260k"), str(out / "data" / "tokenizer"),
        [rows["s2t2_fvt"]["init_weight"], 0.9, 1.0])
    for a, name in zip(anatomy, ("s2t2_fvt", "w9")):
        start = json.loads((out / "runs" / "v>d" / f"{name}_start" / "result.json").read_text())["P"]["start"]
        # (float64 here, float32 in the stage: a row at the floor's edge may tip either way)
        assert a["col_nnz_built"] == pytest.approx(start["col_nnz_mean_built"], abs=0.05), (name, a, start)
    assert anatomy[2]["spread_mass_built"] == 0.0
    # the shared start: a built column's weight outside its own pieces is 1 - init_weight (less what
    # of the shared part falls on its own pieces), at v = 512 as at any v
    for a in anatomy[:2]:
        assert a["spread_mass_built"] == pytest.approx(1 - a["init_weight"], abs=0.01), a
