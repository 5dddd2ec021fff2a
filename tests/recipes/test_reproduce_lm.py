"""`s2t2 reproduce --scale smollm2`: the real-LM Table 1. The corpus (deduplicated, held out by a hash of the
sequence), the lanes (inputs before consumers, a failure stops only what reads it, finished arms kept), the
selection on the validation split, the paired claims, and the whole command end to end on a tiny model."""

import json
import math
import sys
from pathlib import Path

import pytest

from s2t2_dist.recipes.paper_plan import Job, preset
from s2t2_dist.recipes.protein_corpus import build_corpus, unique_sequences, source_files
from s2t2_dist.recipes.arm_records import read_result, write_record
from s2t2_dist.recipes.reproduce_lm import Arm, Lanes, LmPaths, LmPlan, report_choices, select
from s2t2_dist.recipes.reproduce_lm_report import checks
from s2t2_dist.recipes.orchestrate import StageFailed
from tests.helpers.stage_fixtures import run_cmd, tiny_olmo


def _seqs(path: Path) -> list[str]:
    from s2t2_dist.data.fasta import read_fasta

    return [r.text for r in read_fasta(path)]


def test_corpus_every_sequence_once_and_held_out_by_its_hash(tmp_path):
    s = build_corpus(tmp_path)
    train, held = _seqs(tmp_path / "trainval.fasta"), _seqs(tmp_path / "heldout.fasta")
    records, counts = unique_sequences(source_files())
    assert len(train) + len(held) == s["unique"] == len(records)
    assert s["unique"] == sum(c["records"] - c["duplicates"] - c["bad"] for c in counts.values())
    assert not set(train) & set(held) and len(set(train)) == len(train)
    assert len(held) >= 150  # the held-out split the table is scored on
    assert s["per_file"]["mmseqs2_QUERY_uniprotkb.fasta"]["duplicates"] == 2  # same protein, two ids
    # a rerun with the same inputs keeps the files as they are
    before = (tmp_path / "heldout.fasta").stat().st_mtime_ns
    assert build_corpus(tmp_path) == s
    assert (tmp_path / "heldout.fasta").stat().st_mtime_ns == before


class _FakeRunner:
    """Runs a job by writing its result and its outputs; fails the jobs named in `fail`."""

    def __init__(self, log: list, fail=()):
        self.log, self.fail = log, set(fail)

    def run(self, stage, argv, run_dir, name, result_file=None, inputs=None):
        if name in self.fail:
            raise StageFailed(f"{name}: exited with 1")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.log.append(name)
        Path(result_file).write_text(json.dumps({"finished": True, "eval": {"bpb": 1.0}}))
        for p in self.produces.get(name, []):
            Path(p).write_text("out")
        return name


def _job(root: Path, name: str, consumes=(), produces=()) -> Job:
    rd = root / "runs" / name
    return Job(name, "translate", "configs/translate_olmo1b.yaml", [], str(rd), str(rd / "result.json"),
               consumes=[str(root / "runs" / c) for c in consumes], produces=[str(root / "runs" / p) for p in produces])


def test_lanes_run_inputs_first_and_a_failure_stops_only_its_consumers(tmp_path):
    a = _job(tmp_path, "a", produces=["a/P"])
    b = _job(tmp_path, "b", consumes=["a/P"])
    c = _job(tmp_path, "c", produces=["c/P"])
    d = _job(tmp_path, "d", consumes=["c/P"])
    log: list = []

    def factory(k):
        r = _FakeRunner(log, fail={"c"})
        r.produces = {"a": a.produces, "c": c.produces}
        return r

    ft = _job(tmp_path, "ft", consumes=["a/P"])
    ft.stage = "finetune"
    for j in (a, ft):  # checkpoints left by an earlier, interrupted attempt
        (Path(j.run_dir) / "checkpoints" / "step_00000010").mkdir(parents=True)
    failed = Lanes(2, factory, say=lambda m: None).run([b, a, d, c, ft], 0.0)
    assert sorted(failed) == ["c", "d"]  # d reads c's output: never started
    # a finished finetune's checkpoints go (nothing resumes a finished arm); other stages' stay
    assert not (Path(ft.run_dir) / "checkpoints").exists() and (Path(a.run_dir) / "checkpoints").is_dir()
    assert log.index("a") < log.index("b") and "d" not in log
    assert read_result(b) is not None and (tmp_path / "record" / "b.json").is_file()
    # finished arms are skipped on a rerun, unless a consumer still to run reads an output that is gone
    assert [j.name for j in Lanes.needed([a, b])] == []
    (tmp_path / "runs" / "a" / "P").unlink()
    (tmp_path / "record" / "b.json").unlink()
    (tmp_path / "runs" / "b" / "result.json").unlink()
    assert [j.name for j in Lanes.needed([a, b])] == ["a", "b"]


def _plan(tmp_path, **lm) -> LmPlan:
    cfg = preset("smollm2")
    for k, v in lm.items():
        setattr(cfg.lm, k, v)
    d = tmp_path / "data"
    return LmPlan(cfg, LmPaths(out=tmp_path, model="m", data=d, heldout_new="hn", heldout_source="hs"))


def _record(job: Job, bpb: float) -> None:
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    Path(job.result).write_text(json.dumps({"finished": True, "eval": {"bpb": bpb}}))
    write_record(job)


def _preset_plan(root: Path, lm: dict | None = None, **keys) -> LmPlan:
    """The shipped preset's plan (with `keys` and the `lm` keys set) under `root`, its model and data inside it."""
    cfg = preset("smollm2")
    for k, v in keys.items():
        setattr(cfg, k, v)
    for k, v in (lm or {}).items():
        setattr(cfg.lm, k, v)
    return LmPlan(cfg, LmPaths(out=root, model=str(root / "m"), data=root / "data", heldout_new="hn",
                               heldout_source="hs"))


#: the P columns the kept records were selected with (the dense baselines from the paper's start)
ARMS = {"plain_p": Arm("unconstrained", "paper", None, 1e-3), "sinkhorn_p": Arm("softmax", "paper", None, 0.1),
        "s2t2": Arm("sparse", "shipped", None, 3e-5), "s2t2_a0": Arm("sparse", "paper", 0.0, 1e-5)}


def _every_row_at(lr: float) -> dict[str, float]:
    from s2t2_dist.recipes.reproduce_lm_report import FT_ROWS

    return {row: lr for row in FT_ROWS}


def _table(tmp_path, out="a", ft_lr=1e-4, lm=None, **keys):
    plan = _preset_plan(tmp_path / out, lm, **keys)
    return {j.name: j for j in plan.table_jobs(ARMS, _every_row_at(ft_lr))}


def test_a_record_stands_for_its_own_arm_only_and_for_what_it_read(tmp_path, monkeypatch):
    """A record is found by the arm's name, but stands for it only with the arm's spec: a 200-step finetune's record
    never answers for 600 steps, nor its export's score for the score of a 600-step export; a P run at other steps
    voids the finetunes and scores that read its P, not the rows that do not. Paths are not the spec: records kept
    from another machine answer for the same arms here."""
    from s2t2_dist.recipes import arm_records

    done = _table(tmp_path, ft_steps=200)
    for j in done.values():
        if j.name.startswith("seed0/"):
            _record(j, 4.3)
    names = [n for n in done if n.startswith("seed0/")]
    assert all(read_result(done[n]) is not None for n in names)
    # the same arms from another machine: other paths, the records read through --record
    monkeypatch.setattr(arm_records, "EXTRA_RECORDS", [tmp_path / "a" / "record"])
    here = _table(tmp_path, out="b", ft_steps=200)
    for n in names:  # the run directories here hold the P files (a rerun also makes a missing input again)
        for f in here[n].produces:
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            Path(f).write_text("out")
    assert all(read_result(here[n]) is not None for n in names)
    assert Lanes.needed([here[n] for n in names]) == []
    # three times the finetuning: every finetune and its score again, nothing else
    longer = _table(tmp_path, out="b", ft_steps=600)
    again = {j.name for j in Lanes.needed([longer[n] for n in names])}
    assert again == {n for n in names if "/ft_" in n or "/eval_cft_" in n or n.endswith(("new_tok_lr0.0001",
                                                                                          "orig_tok_lr0.0001"))}
    assert "seed0/eval_cft_sparse_lr3e-05_lr0.0001" in again and "seed0/eval_sparse_lr3e-05" not in again
    # other P steps: the P runs, their scores and the finetunes from them; FT orig. / new tok. keep their records
    other_p = _table(tmp_path, out="b", ft_steps=200, p_steps=300)
    again = {j.name for j in Lanes.needed([other_p[n] for n in names])}
    assert "seed0/eval_cft_softmax_lr0.1_lr0.0001" in again and "seed0/eval_sparse_paper_a0_lr1e-05" in again
    assert not again & {"seed0/ft_new_tok_lr0.0001", "seed0/eval_orig_tok_lr0.0001"}
    # a record without a spec (written before specs were) stands for nothing
    r = json.loads(Path(arm_records.record_path(done["seed0/ft_new_tok_lr0.0001"])).read_text())
    del r["spec"]
    Path(arm_records.record_path(done["seed0/ft_new_tok_lr0.0001"])).write_text(json.dumps(r))
    assert read_result(here["seed0/ft_new_tok_lr0.0001"]) is None


def test_a_record_altered_after_it_was_written_is_refused_in_one_line(tmp_path):
    """A kept record's number edited by hand (4.3749 -> 1.234) never reaches a table: its checksum is refused."""
    from s2t2_dist.errors import DataError
    from s2t2_dist.recipes import arm_records

    table = _table(tmp_path)
    job = table["seed0/eval_sparse_lr3e-05"]
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    Path(job.result).write_text(json.dumps({"finished": True, "metrics": {"bpb": 4.3749}}))
    write_record(job)
    assert read_result(job)["metrics"]["bpb"] == 4.3749
    rp = arm_records.record_path(job)
    rp.write_text(rp.read_text().replace("4.3749", "1.234"))
    with pytest.raises(DataError, match=r"^record .*eval_sparse_lr3e-05.json: its content is not what the arm "
                                        r"wrote \(checksum differs\); remove it to run the arm again$"):
        read_result(job)
    r = json.loads(rp.read_text())
    del r["checksum"]
    rp.write_text(json.dumps(r))
    with pytest.raises(DataError, match="checksum missing"):
        read_result(job)


def test_the_kept_records_stand_for_the_shipped_plans_arms(monkeypatch):
    """benchmarks/records/smollm2 (the finished arms, reused by --record on any machine) answer for every arm of the
    preset at 200 finetuning steps (`ft_steps=200 lm.ft_eval_every=0 lm.ft_lr_sweep=[1e-4,3e-4]`), the selection's (the P-only curve, each P's step grid, the finetuning step) and the table's: a
    change to what an arm is (an override, a step, the automatic step's rule in the curve's name) shows here as
    records that no longer stand for it, to be rerun rather than reused."""
    from s2t2_dist.recipes import arm_records

    kept = Path(__file__).resolve().parents[2] / "benchmarks" / "records" / "smollm2"
    monkeypatch.setattr(arm_records, "EXTRA_RECORDS", [kept])
    earlier = {"ft_lr_sweep": [1e-4, 3e-4], "ft_eval_every": 0}  # the preset they were run at: 200 steps
    table = {**_table(Path("/elsewhere"), lm=earlier, ft_steps=200),
             **_table(Path("/elsewhere"), ft_lr=3e-4, lm=earlier, ft_steps=200)}
    standing = {n for n, j in table.items() if read_result(j) is not None}
    # every arm stands but the start-only row's finetunes at the preset's 200 steps (run at 600 steps only:
    # benchmarks/records/smollm2_600) and the held-out score of the start itself; the start, 0 P-only steps, stands
    assert len(table) >= 80 and set(table) - standing == {"seed0/eval_sparse_start"} | {
        f"seed{s}/{a}" for s in (0, 1, 2) for a in ("ft_cft_sparse_start_lr0.0001", "eval_cft_sparse_start_lr0.0001",
                                                    "ft_cft_sparse_start_lr0.0003", "eval_cft_sparse_start_lr0.0003")}
    select = _preset_plan(Path("/elsewhere/a"), earlier, ft_steps=200).select_jobs()
    assert len(select) >= 30 and any(j.name.startswith("seed0/curve_") for j in select)
    # the selection's arms all stand but the ceiling probe's grid (kept in benchmarks/records/smollm2_600)
    assert [j.name for j in select if read_result(j) is None] == [
        f"seed0/probe_embeddings_lr{lr:g}" for lr in (1e-3, 3e-3, 1e-2)]


def test_the_600_step_records_stand_for_the_start_only_row_at_that_budget(monkeypatch):
    """benchmarks/records/smollm2_600: arms of the shipped preset (600 finetuning steps, validation every 200; the
    start-only row at lr 1e-4 on 3 seeds; seed 0's two rows at 3e-4; the ceiling probe), kept with their spec."""
    from s2t2_dist.recipes import arm_records

    kept = Path(__file__).resolve().parents[2] / "benchmarks" / "records" / "smollm2_600"
    monkeypatch.setattr(arm_records, "EXTRA_RECORDS", [kept])
    plan = _preset_plan(Path("/elsewhere/a"))  # the shipped preset: 600 steps, validation every 200
    table = {j.name: j for j in plan.table_jobs(ARMS, _every_row_at(1e-4))}
    for s in (0, 1, 2):
        r = read_result(table[f"seed{s}/eval_cft_sparse_start_lr0.0001"])
        assert r is not None and len(r["documents"]["index"]) == 157, s
        assert read_result(table[f"seed{s}/ft_cft_sparse_start_lr0.0001"])["step"] == 600
    # seed 0 at the other finetuning step, both rows; the ceiling probe's grid, its chosen step scored and S2T2's
    # start scored (the P-only rows' two ends)
    more = {j.name: j for j in plan.table_jobs(ARMS, _every_row_at(3e-4), 3e-3)}
    for name in ("seed0/eval_cft_sparse_start_lr0.0003", "seed0/eval_cft_sparse_lr3e-05_lr0.0003",
                 "seed0/eval_sparse_start", "seed0/eval_probe_embeddings_lr0.003"):
        r = read_result(more[name])
        assert r is not None and len(r["documents"]["index"]) == 157, name
    probes = {lr: read_result(plan.probe(lr)) for lr in plan.cfg.lm.probe_lr_sweep}
    assert all(r is not None and r["step"] == plan.cfg.p_steps for r in probes.values())
    assert min(probes, key=lambda lr: probes[lr]["eval"]["bpb"]) == 3e-3  # chosen inside its grid


def test_selection_takes_the_lowest_validation_bpb_and_waits_for_every_run(tmp_path):
    plan = _plan(tmp_path, ft_lr_sweep=[1e-4, 3e-4], baseline_starts=["paper", "shipped"])
    plan.cfg.lm.p_lr_sweep.sparse = [3e-5, 1e-4, 3e-4, 1e-3]  # the test's own grid, not the preset's
    for arm, v in zip(plan.candidates("s2t2"), (4.6, 4.5, 4.3, 4.4), strict=True):
        _record(plan.p_arm(arm, 0), v)
    # Sinkhorn P: its best step from the shipped start beats every step from the paper's
    sink = plan.candidates("sinkhorn_p")
    assert {a.start for a in sink} == {"paper", "shipped"} and len(sink) == 2 * len(plan.cfg.lm.p_lr_sweep.softmax)
    for k, arm in enumerate(sink):
        _record(plan.p_arm(arm, 0), 4.0 if (arm.start, arm.lr) == ("shipped", 0.01) else 4.6 - k * 0.01)
    for lr, (new, orig) in {1e-4: (4.0, 4.2), 3e-4: (4.1, 4.0)}.items():
        _record(plan.ft_arm("new_tok_truncate", lr, 0, tag="new_tok"), new)
        _record(plan.ft_arm("orig_tok", lr, 0), orig)
    sel = select(plan)
    assert sel["chosen"]["p"]["s2t2"]["lr"] == 3e-4 and sel["chosen"]["p"]["s2t2"]["alpha"] is None
    assert sel["chosen"]["p"]["sinkhorn_p"] == {"kind": "softmax", "start": "shipped", "alpha": None, "lr": 0.01}
    # Sinkhorn P from S2T2's start: the best of the shipped start's steps (here the column's own choice)
    assert sel["chosen"]["p"]["sinkhorn_p_fvt"] == sel["chosen"]["p"]["sinkhorn_p"]
    assert sel["chosen"]["p"]["plain_p"] is None  # not run: nothing is chosen from a partial grid
    # each finetuned row its own step: FT new tok. 1e-4 (4.0 against 4.1), FT orig. tok. 3e-4 (4.0 against 4.2)
    assert sel["chosen"]["ft_lr"]["ft_new_tok"] == 1e-4 and sel["chosen"]["ft_lr"]["ft_orig_tok"] == 3e-4
    assert sel["chosen"]["ft_lr"]["s2t2_cft"] is None  # its grid has not run
    # S2T2 + CFT's grid: seed 0 at both steps, from the chosen P; its step chosen once both have run
    grid = {j.name: j for j in plan.grid_jobs(report_choices(sel)[0])}
    p_arm = plan.p_arm(Arm(**sel["chosen"]["p"]["s2t2"]), 0).name.split("/translate_")[1]
    _record(grid[f"seed0/ft_cft_{p_arm}_lr0.0001"], 4.05)
    sel = select(plan)
    assert sel["chosen"]["ft_lr"]["s2t2_cft"] is None and sel["provisional"]["ft_lr"]["s2t2_cft"] == 1e-4
    _record(grid[f"seed0/ft_cft_{p_arm}_lr0.0003"], 4.08)
    sel = select(plan)
    assert sel["chosen"]["ft_lr"]["s2t2_cft"] == 1e-4 and "s2t2_cft" not in (sel.get("provisional") or {}).get(
        "ft_lr", {})
    # a report under way reads the best finished candidate of a partial grid, and names it provisional
    plain = plan.candidates("plain_p")
    _record(plan.p_arm(plain[1], 0), 4.3)
    _record(plan.p_arm(plain[2], 0), 4.2)
    sel = select(plan)
    assert sel["chosen"]["p"]["plain_p"] is None
    arms, ft_lrs, provisional = report_choices(sel)
    assert arms["plain_p"] == plain[2] and arms["s2t2"].lr == 3e-4 and ft_lrs["ft_new_tok"] == 1e-4
    assert "plain_p" in provisional and "s2t2_a0" not in arms  # alpha 0: nothing finished, no row
    assert "plain_p_cft" not in ft_lrs  # no finetune of it yet: no row
    table = {j.name for j in plan.table_jobs(arms, ft_lrs)}
    assert plan.p_arm(plain[2], 1).name in table and not any("_a0_" in n for n in table)
    assert {"seed1/ft_new_tok_lr0.0001", "seed1/ft_orig_tok_lr0.0003", f"seed1/ft_cft_{p_arm}_lr0.0001"} <= table
    assert not any(n.startswith("seed1/ft_new_tok_lr0.0003") for n in table)
    # names: the shipped start is S2T2's own, the paper's the baselines'; the other start and alpha 0 are tagged
    names = {j.name for j in plan.select_jobs()}
    assert {"seed0/translate_sparse_lr0.0003", "seed0/translate_softmax_lr0.1", "seed0/translate_softmax_fvt_lr0.1",
            "seed0/translate_sparse_a0_lr0.001", "seed0/curve_s2t2_auto0.015_per_u"} <= names
    # the table's seed-0 arms at the chosen steps are the selection's and the grid's runs
    chosen = {c: plan.candidates(c)[0] for c in plan.columns()}
    table = {j.name for j in plan.table_jobs(chosen, _every_row_at(3e-4))}
    assert {j.name for j in plan.table_jobs(chosen, _every_row_at(3e-4)) if j.name.startswith("seed0/ft_")} <= {
        j.name for j in plan.grid_jobs(chosen)}
    assert plan.p_arm(chosen["s2t2"], 0).name in table and "seed0/ft_new_tok_lr0.0003" in table
    arm = plan.p_arm(chosen["s2t2"], 2).name.split("/translate_")[1]  # sparse_lr3e-05
    assert {f"seed2/ft_cft_{arm}_lr0.0003", f"seed2/eval_cft_{arm}_lr0.0003", f"seed2/eval_{arm}",
            "seed2/eval_new_tok_lr0.0003", "seed2/eval_orig_tok_lr0.0003"} <= table
    # every translator is finetuned from S2T2's start too: Plain P and Sinkhorn P from the shipped start
    fvt = {plan.p_arm(chosen[c], 2).name.split("/translate_")[1] for c in ("plain_p_fvt", "sinkhorn_p_fvt")}
    assert all("_fvt_" in a and f"seed2/ft_cft_{a}_lr0.0003" in table for a in fvt)
    assert not any("cft_sparse_a0" in n for n in table)  # the alpha-0 row is P-only


def test_s2t2_at_alpha_0_is_chosen_over_both_starts_and_stays_p_only(tmp_path):
    plan = _plan(tmp_path, ft_lr_sweep=[1e-4], baseline_starts=["paper"])
    plan.cfg.lm.p_lr_sweep.sparse = [1e-5, 1e-4]
    a0 = plan.candidates("s2t2_a0")
    assert [(a.start, a.alpha) for a in a0] == [("shipped", 0.0)] * 2 + [("paper", 0.0)] * 2
    assert {a.start for a in plan.candidates("s2t2")} == {"shipped"}  # the paper's start has alpha 0 by definition
    names = [plan.p_arm(a, 0).name for a in a0]
    assert names == ["seed0/translate_sparse_a0_lr1e-05", "seed0/translate_sparse_a0_lr0.0001",
                     "seed0/translate_sparse_paper_a0_lr1e-05", "seed0/translate_sparse_paper_a0_lr0.0001"]
    for col, scores in (("s2t2", (4.41, 4.45)), ("s2t2_a0", (4.39, 4.42, 4.36, 4.40))):
        for arm, v in zip(plan.candidates(col), scores, strict=True):
            _record(plan.p_arm(arm, 0), v)
    for col in ("plain_p", "sinkhorn_p"):
        for arm in plan.candidates(col):
            _record(plan.p_arm(arm, 0), 4.38)
    for kind, tag in (("new_tok_truncate", "new_tok"), ("orig_tok", "")):
        _record(plan.ft_arm(kind, 1e-4, 0, tag=tag), 4.3)
    sel = select(plan)
    assert sel["chosen"]["p"]["s2t2_a0"] == {"kind": "sparse", "start": "paper", "alpha": 0.0, "lr": 1e-5}
    assert sel["chosen"]["p"]["s2t2"] == {"kind": "sparse", "start": "shipped", "alpha": None, "lr": 1e-5}
    assert {"s2t2", "s2t2_a0"} <= set(sel["at_grid_edge"])
    arms, _, _ = report_choices(sel)
    table = {j.name for j in plan.table_jobs(arms, _every_row_at(1e-4))}
    for seed in plan.cfg.seeds:  # both S2T2 rows scored P-only; S2T2 + CFT from the shipped recipe's P only
        assert {f"seed{seed}/eval_sparse_lr1e-05", f"seed{seed}/eval_sparse_paper_a0_lr1e-05",
                f"seed{seed}/ft_cft_sparse_lr1e-05_lr0.0001"} <= table
    assert not any("cft_sparse_paper" in n or "cft_sparse_a0" in n for n in table)


def _results(rows: dict, residue=4.2) -> dict:
    out = {"rows": {}, "references": {"residue_unigram": {"bpb": residue}, "unigram_bpe": {"bpb": 4.4}},
           "same_bytes": {"ok": True, "bytes_docs": [(100, 2)]}}
    for key, per_seed in rows.items():
        out["rows"][key] = {"seeds": {str(s): {"bpb": v} for s, v in enumerate(per_seed)},
                            "bpb": {"n": len(per_seed), "mean": sum(per_seed) / len(per_seed)}}
    return out


def test_claims_are_paired_by_seed():
    r = _results({"s2t2": [4.0, 4.1, 4.3], "sinkhorn_p": [4.2, 4.2, 4.2], "plain_p": [4.5, 4.5, 4.5],
                  "s2t2_cft": [3.9, 3.9, 3.9], "ft_new_tok": [3.95, 3.95, 3.95]})
    by = {c["claim"]: c for c in checks(r)}
    # 2 of 3 seeds is not "every seed", even though the mean (4.13) is below 4.2
    assert by["S2T2 below Sinkhorn P by >= 0.0 BpB on every seed"]["holds"] is False
    assert by["S2T2 below Plain P by >= 0.0 BpB on every seed"]["holds"] is True
    # below by 0.05 > 0.02 on each seed
    assert by["S2T2 + CFT below FT new tok. by >= 0.02 BpB on every seed"]["holds"] is True
    assert by["valid run: a finetuned row below the residue unigram"]["holds"] is True
    assert by["S2T2 + CFT below Plain P + CFT by >= 0.02 BpB on every seed"]["holds"] is None  # not run
    assert by["S2T2 + CFT below S2T2's start (FVT) + CFT by >= 0.02 BpB on every seed"]["holds"] is None
    assert all(c["interval"] is None for c in checks(r) if "interval" in c)  # no document scores: no interval


def test_a_claim_gets_a_paired_interval_where_both_rows_kept_their_documents(tmp_path):
    """S2T2 + CFT against its own start + CFT, per seed and over seeds: the interval is over the documents, paired."""
    import math

    nbytes = [100 + 7 * i for i in range(40)]
    r = _results({"s2t2_cft": [4.20, 4.21, 4.22], "fvt_start_cft": [4.25, 4.25, 4.25]})
    for key in ("s2t2_cft", "fvt_start_cft"):
        for s, row in r["rows"][key]["seeds"].items():
            row["documents"] = {"index": list(range(40)), "bytes": nbytes,
                                "nll_nats": [row["bpb"] * math.log(2) * b * (1 + 0.01 * (i % 3 - 1))
                                             for i, b in enumerate(nbytes)]}
    c = {c["claim"]: c for c in checks(r)}["S2T2 + CFT below S2T2's start (FVT) + CFT by >= 0.02 BpB on every seed"]
    iv = c["interval"]
    assert [round(p["diff"], 4) for p in iv["per_seed"]] == [-0.05, -0.04, -0.03]
    assert iv["per_seed_claims"] == ["beats by > 0.02"] * 3 and iv["docs"] == 40 and iv["seeds"] == 3
    assert iv["mean"]["lo"] <= -0.04 <= iv["mean"]["hi"] and "95% paired bootstrap over 40 documents" in c["detail"]
    # the report draws every claim that has an interval (and only those) in plots/paired.png
    from s2t2_dist.recipes.reproduce_lm_report import plots

    r["checks"], r["curve"] = checks(r), []
    drawn = plots(r, tmp_path)
    assert drawn["paired"].read_bytes()[:4] == b"\x89PNG" and c["margin"] == 0.02
    r["checks"] = [x for x in r["checks"] if not x.get("interval")]
    assert "paired" not in plots(r, tmp_path / "none")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smollm2_scale_end_to_end_on_a_tiny_model(tmp_path):
    model = tiny_olmo(tmp_path / "model")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "s2t2_dist.cli", "reproduce", "--scale", "smollm2", "--out", str(out), "--quiet",
            "seeds=[0]", "p_steps=2", "ft_steps=2", "eval_max_docs=3", "log_every=1", f"lm.model={model}",
            "lm.lanes=1", "lm.curve_steps=2", "lm.eval_every=1", "lm.p_lr_sweep.sparse=[1e-4]",
            "lm.p_lr_sweep.softmax=[0.1]", "lm.p_lr_sweep.unconstrained=[0.01]", "lm.ft_lr_sweep=[1e-4]",
            "lm.baseline_starts=[paper]", "lm.s2t2_alpha0=false"]
    run_cmd(args, timeout=1200)
    r = json.loads((out / "results.json").read_text())
    assert r["missing"] == [] and r["failed"] == []
    for key in ("plain_p", "plain_p_cft", "sinkhorn_p", "sinkhorn_p_cft", "s2t2", "s2t2_cft", "ft_orig_tok",
                "ft_new_tok", "fvt"):
        assert r["rows"][key]["bpb"]["n"] == 1, key
    assert r["same_bytes"]["ok"] and r["same_bytes"]["bytes_docs"][0][1] == 3
    s2t2 = r["selection"]["p"]["s2t2"]
    assert r["selection"]["chosen_label"]["s2t2"] == min(s2t2, key=s2t2.get)
    assert len(r["curve"]) >= 2 and r["references"]["residue_unigram"]["bpb"] > 3.5
    assert (out / "plots" / "table1.png").read_bytes()[:4] == b"\x89PNG" and (out / "table1.md").is_file()
    # each finetuned row's training curve, in bits per byte by its own run's bytes per token
    assert sorted(r["ft_curves"]) == sorted(["plain_p_cft", "sinkhorn_p_cft", "s2t2_cft", "fvt_start_cft", "ft_orig_tok",
                                          "ft_new_tok"])
    ft = json.loads((out / "runs" / "seed0" / "ft_new_tok_lr0.0001" / "result.json").read_text())
    (s0, l0), bpt = ft["losses"][0], ft["eval"]["bytes_per_token"]
    assert r["ft_curves"]["ft_new_tok"]["0"][0] == pytest.approx([s0, l0 / (math.log(2) * bpt)])
    assert all(len(c["0"]) == 2 for c in r["ft_curves"].values())
    assert (out / "plots" / "finetune_curves.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun reuses every finished arm; the records alone suffice once the run directories are gone
    import shutil

    shutil.rmtree(out / "runs" / "seed0" / "eval_sparse_lr0.0001")
    proc = run_cmd(args, timeout=300)
    assert "] seed0/" not in proc.stdout, proc.stdout
    assert json.loads((out / "results.json").read_text())["rows"] == r["rows"]


def test_a_table_under_way_marks_its_provisional_rows():
    from s2t2_dist.recipes.reproduce_lm_report import label, table1_markdown

    res = _results({"plain_p": [4.3], "plain_p_cft": [4.1], "s2t2": [4.5], "ft_new_tok": [4.2]})
    res["paper"], res["provisional"] = {}, ["plain_p"]
    for r in res["rows"].values():
        r["perplexity"] = {"mean": 90.0}
    text = table1_markdown(res)
    assert "the selection is still running for plain_p" in text
    assert f"| {label('plain_p')} * |" in text and f"| {label('plain_p_cft')} * |" in text
    assert f"| {label('s2t2')} |" in text and f"| {label('ft_new_tok')} |" in text  # final choices: unmarked
    res["provisional"] = []
    assert "*" not in table1_markdown(res) and "Provisional" not in table1_markdown(res)


def test_an_untrained_row_prints_its_one_value_once():
    """The FVT plan (letters only, no training) is scored once, seed-free: the table gives that value as the row's,
    says it has no seed, and prints no copy of it under the seed columns, where a reader would take it for three
    runs."""
    from s2t2_dist.recipes.reproduce_lm_report import label, table1_markdown

    res = _results({"s2t2": [4.3, 4.31, 4.32]})
    res["rows"]["fvt"] = {"seeds": {"all": {"bpb": 5.9612}}, "bpb": {"n": 1, "mean": 5.9612}}
    res["paper"], res["provisional"] = {}, []
    for r in res["rows"].values():
        r["perplexity"] = {"mean": 90.0}
    row = next(x for x in table1_markdown(res).splitlines() if x.startswith(f"| {label('fvt')} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "5.9612 (no seed: untrained)" and cells[3:6] == ["-", "-", "-"], cells
    s2t2 = next(x for x in table1_markdown(res).splitlines() if x.startswith(f"| {label('s2t2')} |"))
    assert "4.3000 | 4.3100 | 4.3200" in s2t2


def _scored(job: Job, bpb: float) -> None:
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    Path(job.result).write_text(json.dumps({"finished": True, "metrics": {
        "bpb": bpb, "perplexity": 2 ** bpb, "nll_per_token": bpb, "tokens": 50, "bytes": 100, "docs": 2}}))
    write_record(job)


def test_auto_precision_trains_in_bf16_only_where_the_hardware_computes_it(tmp_path, monkeypatch):
    """lm.precision=auto: bf16 arms on a CPU with bf16 in hardware, fp32 ones on a CPU that emulates it (each step
    ~15x slower there); the value is in every arm's spec, so the kept bf16 records never stand for fp32 arms; the
    preset's bf16 on an emulating CPU is warned about."""
    import torch

    import s2t2_dist.api as api
    from s2t2_dist.recipes.arm_records import arm_spec
    from s2t2_dist.recipes.reproduce_lm import precision_warning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    specs = {}
    for native in (True, False):
        monkeypatch.setattr(api, "cpu_computes_bf16", lambda n=native: n, raising=False)
        plan = _plan(tmp_path, precision="auto")
        ft = plan.ft_arm("new_tok_truncate", 1e-4, 0, tag="new_tok")
        assert f"train.precision={'bf16' if native else 'fp32'}" in ft.overrides
        specs[native] = arm_spec(ft)
        assert (precision_warning("bf16") == []) is native and precision_warning("fp32") == []
    assert specs[True] != specs[False]
    assert "lm.precision=bf16" in precision_warning("bf16")[0] and precision_warning("auto") == []


def test_the_grid_pairs_every_row_with_the_start_at_the_same_step():
    """Seed 0's grid: each finetuned row minus S2T2's start + CFT at the same finetuning step, paired over the
    documents; a step the start has no documents at (or lacks) gets no comparison; the grid's text lists them."""
    import math

    from s2t2_dist.recipes.reproduce_lm_report import grid_markdown, grid_vs_start

    nbytes = [100 + 7 * i for i in range(40)]

    def pt(bpb):
        return {"validation": bpb, "heldout": bpb, "bytes": sum(nbytes), "docs": 40, "documents": {
            "index": list(range(40)), "bytes": nbytes,
            "nll_nats": [bpb * math.log(2) * b * (1 + 0.01 * (i % 3 - 1)) for i, b in enumerate(nbytes)]}}

    grid = {"fvt_start_cft": {"0.0001": pt(4.20), "0.0003": pt(4.15)},
            "plain_p_fvt_cft": {"0.0001": pt(4.21), "0.0003": pt(4.25), "2e-05": pt(4.3)},
            "ft_orig_tok": {"0.0003": {"validation": 4.1, "heldout": 4.1, "bytes": 1, "docs": 40}}}
    vs = grid_vs_start(grid)
    assert set(vs) == {"plain_p_fvt_cft"} and set(vs["plain_p_fvt_cft"]) == {"0.0001", "0.0003"}
    near, far = vs["plain_p_fvt_cft"]["0.0001"], vs["plain_p_fvt_cft"]["0.0003"]
    assert round(near["diff"], 4) == 0.01 and near["claim"] == "loses" and near["lo"] > 0
    assert round(far["diff"], 4) == 0.1 and far["lo"] <= 0.1 <= far["hi"]
    text = grid_markdown({"ft_grid": grid, "grid_vs_start": vs})
    assert "- Plain P from S2T2's start + CFT: lr 0.0001 +0.0100 [" in text and "lr 0.0003 +0.1000 [" in text


def test_each_finetuned_row_runs_at_its_own_step_from_a_seed_0_grid(tmp_path):
    """Seed 0 runs every finetuned row at every finetuning step (the grid); each row's own step, chosen on
    validation, is the step its other seeds run at; the report shows the grid (validation / held out, the chosen
    step in bold) and every finetuned row at equal total tokens (a P + CFT row's P-only steps counted)."""
    from torch.utils.tensorboard import SummaryWriter

    from s2t2_dist.recipes.reproduce_lm_report import FT_ROWS, collect, plots, table1_markdown

    plan = _plan(tmp_path, ft_lr_sweep=[1e-4, 3e-4])
    plan.cfg.seeds = [0, 1]
    chosen = {c: plan.candidates(c)[0] for c in plan.columns()}
    grid = plan.grid_jobs(chosen)
    fts = [j for j in grid if j.stage == "finetune"]
    assert len({j.name for j in fts}) == len(FT_ROWS) * 2 and all(j.name.startswith("seed0/") for j in fts)
    assert {j.role[1] for j in grid if j.stage == "evaluate"} == set(FT_ROWS)
    # the start-only row reads S2T2's start; the *_fvt rows a P from that start; the others their column's
    reads = {j.role[1]: next(c for c in j.consumes if c.endswith("final")) for j in grid if j.stage == "evaluate"}
    assert "translate_sparse_start" in {Path(c).parent.name for f in fts for c in f.consumes}
    assert "_fvt_" in reads["plain_p_fvt_cft"] and "_fvt_" not in reads["plain_p_cft"]
    own = {row: (3e-4 if row in ("s2t2_cft", "ft_new_tok") else 1e-4) for row in FT_ROWS}
    table = plan.table_jobs(chosen, own)
    by_name = {j.name: j for j in table}
    assert "seed1/ft_new_tok_lr0.0003" in by_name and "seed1/ft_new_tok_lr0.0001" not in by_name
    assert "seed1/ft_orig_tok_lr0.0001" in by_name and "seed1/eval_cft_sparse_start_lr0.0001" in by_name
    # records: validation every 200 steps; the held-out scores
    for j in {j.name: j for j in grid + table}.values():
        if j.stage == "finetune":
            lr = float(next(o for o in j.overrides if o.startswith("optim.lr=")).split("=")[1])
            v = 4.2 if lr == 3e-4 else 4.3
            Path(j.run_dir).mkdir(parents=True, exist_ok=True)
            Path(j.result).write_text(json.dumps({
                "finished": True, "eval": {"bpb": v, "bytes_per_token": 2.0}, "losses": [[1, 7.0], [2, 6.0]]}))
            with SummaryWriter(str(Path(j.run_dir) / "tb" / "global")) as tb:  # where the record reads its curve
                for step, bpb in ((200, v + 0.2), (400, v + 0.1), (600, v)):
                    tb.add_scalar("eval/bpb", bpb, step)
            write_record(j)
        elif j.stage == "evaluate" and j.role and j.role[1] in FT_ROWS:
            _scored(j, 4.25 if j.name.endswith("_lr0.0003") else 4.35)
        elif j.stage == "evaluate":
            _scored(j, 4.5)
    sel = {"chosen": {"ft_lr": own}, "at_grid_edge": ["ft_new_tok"]}
    res = collect(plan, table, sel, {"residue_unigram": {"bpb": 4.2}, "unigram_bpe": {"bpb": 4.4}}, grid=grid)
    assert res["missing"] == [] and res["same_bytes"]["ok"]
    assert res["ft_grid"]["s2t2_cft"] == {"0.0001": {"validation": 4.3, "heldout": 4.35, "bytes": 100, "docs": 2},
                                          "0.0003": {"validation": 4.2, "heldout": 4.25, "bytes": 100, "docs": 2}}
    assert res["rows"]["s2t2_cft"]["bpb"]["mean"] == pytest.approx(4.25)  # both seeds at its own step
    assert res["rows"]["plain_p_cft"]["bpb"]["mean"] == pytest.approx(4.35)
    eq = res["equal_tokens"]["rows"]
    # 600 steps in all: a P + CFT row after 400 finetuning steps, the rows without P-only steps after 600
    assert eq["s2t2_cft"]["1"] == {"finetuning_steps": 400, "bpb": pytest.approx(4.3)}
    assert eq["fvt_start_cft"]["0"] == {"finetuning_steps": 600, "bpb": pytest.approx(4.3)}
    assert eq["ft_new_tok"]["0"]["finetuning_steps"] == 600
    text = table1_markdown(res)
    assert "| S2T2 + CFT | 0.0003 | 4.2500 +- 0.000 |" in text
    assert "| S2T2 + CFT | 4.3000 / 4.3500 | **4.2000 / 4.2500** |" in text
    assert "Chosen at an end of the grid" in text and "At equal total tokens" in text
    assert "Bytes per token on the held-out proteins: the new BPE 2.000, the source model's own 2.000" in text
    pl = plots(res, tmp_path / "report")
    assert pl["finetune"].name == "finetune_curves.png" and all(p.stat().st_size > 1000 for p in pl.values())


def test_the_adaptive_unigram_reads_a_sequences_own_composition():
    """Letters counted as the sequence is read: a sequence of one letter gets cheap fast; with a prior of huge
    strength it is the residue unigram; every residue is scored once (its bytes)."""
    from s2t2_dist.recipes.reproduce_lm import adaptive_unigram, residue_unigram

    train = ["ACDEFGHIKLMNPQRSTVWY" * 5]
    assert adaptive_unigram(train, ["A" * 200], 20.0)["bpb"] < 1.0 < residue_unigram(train, ["A" * 200])["bpb"]
    mixed = ["ACDEFGHIKLMNPQRSTVWY" * 3, "MKVLA"]
    far = adaptive_unigram(train, mixed, 1e12)
    assert far["bpb"] == pytest.approx(residue_unigram(train, mixed)["bpb"], rel=1e-6) and far["bytes"] == 65


def test_the_bpe_unigram_leaves_the_special_tokens_out(tmp_path):
    """The training blocks carry BOS/EOS as separators, no scored document holds them: they get no probability."""
    import math

    from s2t2_dist.recipes.orchestrate import prepare_protein, unigram_reference

    out = prepare_protein(tmp_path / "p", vocab_size=40, context_len=64, progress=False)
    d = Path(out["output_dir"]) if "output_dir" in out else tmp_path / "p"
    r = unigram_reference(d / "shards" / "new" / "train", d / "shards" / "new" / "eval")
    assert r["special_tokens_left_out"] == [0, 1, 2, 3]
    assert r["random_guess_bpb"] == pytest.approx(math.log(40) * r["tokens"] / (math.log(2) * r["bytes"]))
    assert r["bpb"] < r["random_guess_bpb"]


def test_the_ceiling_probe_is_chosen_on_validation_and_bounds_the_p_only_rows(tmp_path):
    """The P-only ceiling probe: an embeddings-only finetune (the body frozen) of S2T2's start for the P-only
    steps at each step of its grid, chosen on validation; its held-out score and the start's are the two ends the
    P-only rows are read between (0 = the start, 1 = the probe)."""
    from s2t2_dist.recipes.reproduce_lm_report import probe_gap, table1_markdown

    plan = _plan(tmp_path)
    probes = [plan.probe(lr) for lr in plan.cfg.lm.probe_lr_sweep]
    assert all("trainable=embeddings" in j.overrides and f"train.steps={plan.cfg.p_steps}" in j.overrides
               and j.consumes[-1].endswith("seed0/translate_sparse_start/P.safetensors") for j in probes)
    assert not any("trainable" in o for o in plan.ft_arm("new_tok_truncate", 1e-4, 0, tag="new_tok").overrides)
    assert {j.name for j in probes} <= {j.name for j in plan.select_jobs()}
    for j, v in zip(probes, (4.30, 4.25, 4.28)):
        _record(j, v)
    sel = select(plan)
    assert sel["chosen"]["probe_lr"] == plan.cfg.lm.probe_lr_sweep[1] and "p_only_probe" not in sel.get(
        "at_grid_edge", [])
    chosen = {c: plan.candidates(c)[0] for c in plan.columns()}
    table = {j.name: j for j in plan.table_jobs(chosen, _every_row_at(1e-4), sel["chosen"]["probe_lr"])}
    ev = table[f"seed0/eval_{probes[1].name.split('/', 1)[1]}"]
    assert ev.role == ("table1", "p_only_probe", 0) and table["seed0/eval_sparse_start"].role[1] == "fvt_start"
    assert "seed1/eval_sparse_start" not in table  # the two ends on seed 0
    rows = {"fvt_start": {"seeds": {"0": {"bpb": 5.0}}}, "p_only_probe": {"seeds": {"0": {"bpb": 4.0}}},
            "s2t2": {"seeds": {"0": {"bpb": 4.6}, "1": {"bpb": 4.5}}}, "plain_p": {"seeds": {"0": {"bpb": 5.2}}}}
    gap = probe_gap(rows)
    assert gap["rows"]["s2t2"] == {"0": pytest.approx(0.4)} and gap["rows"]["plain_p"] == {"0": pytest.approx(-0.2)}
    refs = {"residue_unigram": {"bpb": 4.17}, "unigram_bpe": {"bpb": 4.36}}
    md = table1_markdown({"rows": {}, "references": refs, "probe_gap": gap, "paper": {}})
    assert "S2T2 0.40" in md and "Plain P -0.20" in md
