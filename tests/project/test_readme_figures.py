"""README's results table quotes figures that the committed records hold: recomputed here from those records, so
that a record changed or a figure edited by hand fails this test instead of going stale."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDS = REPO / "benchmarks" / "records"
START_ONLY = REPO / "benchmarks" / "table1_smollm2_start_only_2026-12-02" / "results.json"


def _bpb(path: Path) -> float:
    return json.loads(path.read_text())["metrics"]["bpb"]


def _mean(paths) -> float:
    return statistics.fmean(_bpb(p) for p in paths)


def _results_row() -> str:
    text = (REPO / "README.md").read_text()
    return text.split("## Results and status", 1)[1].split("**On a fresh machine**", 1)[0]


def test_the_proteins_figures_are_the_records():
    readme = _results_row()
    seeds = (0, 1, 2)
    p_only = {k: _mean(RECORDS / "smollm2" / f"seed{s}" / f"eval_{k}.json" for s in seeds)
              for k in ("sparse_paper_a0_lr1e-05", "unconstrained_lr0.001", "softmax_lr0.1")}
    assert f"{p_only['sparse_paper_a0_lr1e-05']:.3f} / {p_only['unconstrained_lr0.001']:.3f} / " \
           f"{p_only['softmax_lr0.1']:.3f}" in readme
    # + CFT at 200 finetuning steps (the earlier preset, each row at the step validation chose) and at 600 (the
    # preset's kept records, each row at its own step)
    at200 = {"cft_sparse_lr3e-05_lr0.0003": None, "cft_unconstrained_lr0.001_lr0.0003": None,
             "cft_softmax_lr0.1_lr0.0003": None, "new_tok_lr0.0001": None, "orig_tok_lr0.0003": None}
    for k in at200:
        at200[k] = _mean(RECORDS / "smollm2" / f"seed{s}" / f"eval_{k}.json" for s in seeds)
    assert " | " + " / ".join(f"{v:.3f}" for v in at200.values()) + " (Plain P + CFT first" in readme
    assert min(list(at200.values())[:4]) == at200["cft_unconstrained_lr0.001_lr0.0003"]
    s2_600 = _mean(RECORDS / "smollm2_600" / f"seed{s}" / "eval_cft_sparse_lr3e-05_lr0.0001.json" for s in seeds)
    new_600 = _bpb(RECORDS / "smollm2_600" / "seed0" / "eval_new_tok_lr0.0001.json")
    assert f"| {s2_600:.3f} (3 seeds) / {new_600:.3f} (seed 0), both at 1e-4;" in readme
    assert not (RECORDS / "smollm2_600" / "seed1" / "eval_new_tok_lr0.0001.json").exists()  # "seed 0" is all
    # S2T2 + CFT against its own start at 600 steps, with each document's scores: the paired intervals, each row at
    # the step seed 0's validation chose from the grid (its finetune records' validation BpB), then at one shared step
    from s2t2_dist.api import paired_difference

    k600 = RECORDS / "smollm2_600"
    grid = ("2e-05", "0.0001", "0.0003")
    own = {k: min(grid, key=lambda lr: json.loads((k600 / "seed0" / f"ft_cft_{k}_lr{lr}.json").read_text())
                  ["eval"]["bpb"]) for k in ("sparse_start", "sparse_lr3e-05")}
    assert own == {"sparse_start": "0.0003", "sparse_lr3e-05": "0.0001"}  # what the README names
    for at in (own, {"sparse_start": "0.0001", "sparse_lr3e-05": "0.0001"}):
        rec = {(s, k): json.loads((k600 / f"seed{s}" / f"eval_cft_{k}_lr{at[k]}.json").read_text())
               for s in seeds for k in at}
        start = statistics.fmean(rec[s, "sparse_start"]["metrics"]["bpb"] for s in seeds)
        learned = statistics.fmean(rec[s, "sparse_lr3e-05"]["metrics"]["bpb"] for s in seeds)
        iv = paired_difference([(rec[s, "sparse_lr3e-05"]["documents"], rec[s, "sparse_start"]["documents"])
                                for s in seeds])
        assert all(p["lo"] > 0 for p in iv["per_seed"])  # "each paired interval excluding 0"
        per = " / ".join(f"{p['diff']:+.3f}" for p in iv["per_seed"])
        m = iv["mean"]
        if at is own:
            assert f"**the start {start:.3f} (at 3e-4) against {learned:.3f} (at 1e-4) on 3 seeds: S2T2 + CFT " \
                   f"minus the start {per}, over seeds {m['diff']:+.3f} [{m['lo']:+.3f}, {m['hi']:+.3f}]: no" in readme
        else:
            assert f"| the start {start:.3f} against {learned:.3f}: {per}, over seeds {m['diff']:+.3f} " \
                   f"[{m['lo']:+.3f}, {m['hi']:+.3f}] |" in readme
    refs = json.loads(START_ONLY.read_text())["refs"]
    assert f"{refs['residue_unigram']['bpb']:.3f} / **{refs['adaptive_unigram']['bpb']:.3f}**" in readme
    # the ceiling probe: the 600-step records of seed 0
    s0 = RECORDS / "smollm2_600" / "seed0"
    start0, probe = _bpb(s0 / "eval_sparse_start.json"), _bpb(s0 / "eval_probe_embeddings_lr0.003.json")
    shares = [(start0 - _bpb(RECORDS / "smollm2" / "seed0" / f"eval_{k}.json")) / (start0 - probe)
              for k in ("sparse_lr3e-05", "unconstrained_lr0.001", "softmax_lr0.1", "sparse_paper_a0_lr1e-05")]
    assert f"| {probe:.3f}; the P-only rows go {100 * min(shares):.0f}-{100 * max(shares):.0f}% of the way from " \
           f"S2T2's start ({start0:.3f})" in readme
