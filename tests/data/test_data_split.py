"""Step 1: deterministic, disjoint train/eval split; summary counts; crash + resume."""

import json

import pytest
from tests.helpers.data_files import AA, ESM, EXTRA, MMSEQS

from s2t2_dist.data import split as split_mod
from s2t2_dist.errors import DataFormatError, ManifestError
from s2t2_dist.data.records import RecordPolicy
from s2t2_dist.data.split import iter_split_docs, load_split, split_dataset, split_hash_u64, split_of

POLICY = RecordPolicy(alphabet=AA, extra_residues=EXTRA)
FILES = [MMSEQS, ESM]


def run(out, files, **kw):
    kw.setdefault("policy", POLICY)
    kw.setdefault("eval_fraction", 0.1)
    kw.setdefault("chunk_records", 400)
    return split_dataset(inputs=[str(f) for f in files], output_dir=out, progress=False, **kw)


def docs(out, split):
    return [(i, t) for _, i, t in iter_split_docs(out, split)]


def test_split_of_is_a_fixed_function():
    # regression values: the split must never change between versions, machines or Python hash seeds
    assert split_hash_u64("UniRef50_A0A1E3NP16", 0) == split_hash_u64("UniRef50_A0A1E3NP16", 0)
    assert split_hash_u64("UniRef50_A0A1E3NP16", 0) != split_hash_u64("UniRef50_A0A1E3NP16", 1)
    import hashlib

    ref = int.from_bytes(hashlib.blake2b(b"tr|A7TBS3|A7TBS3_NEMVE", digest_size=8, key=b"s2t2-split-0").digest(), "big")
    assert split_hash_u64("tr|A7TBS3|A7TBS3_NEMVE", 0) == ref
    frac = sum(split_of(f"id{i}", eval_fraction=0.2) == "eval" for i in range(20000)) / 20000
    assert 0.19 < frac < 0.21
    assert split_of("x", eval_fraction=0.0) == "train"


def test_split_deterministic_disjoint_complete_and_order_independent(tmp_path):
    m1 = run(tmp_path / "a", FILES)
    m2 = run(tmp_path / "b", FILES)
    assert m1["params_hash"] == m2["params_hash"]
    for s in ("train", "eval"):
        for p1, p2 in zip(m1["parts"][s], m2["parts"][s]):
            assert (tmp_path / "a" / s / p1["name"]).read_bytes() == (tmp_path / "b" / s / p2["name"]).read_bytes()
    train, ev = docs(tmp_path / "a", "train"), docs(tmp_path / "a", "eval")
    ids_t, ids_e = {i for i, _ in train}, {i for i, _ in ev}
    assert not ids_t & ids_e
    assert len(train) + len(ev) == 500 + 15 == m1["summary"]["records_kept"]
    assert 0.07 < len(ev) / (len(train) + len(ev)) < 0.13
    assert all(split_of(i, eval_fraction=0.1) == "eval" for i in ids_e)
    # a different input order (and chunking) gives the same assignment of ids to splits
    m3 = run(tmp_path / "c", FILES[::-1], chunk_records=97)
    assert {i for i, _ in docs(tmp_path / "c", "eval")} == ids_e
    assert m3["records"] == m1["records"]
    # order within a split follows the input
    assert [i for i, _ in train][:2] == [i for i, _ in docs(tmp_path / "b", "train")][:2]


def test_split_by_text_keeps_identical_sequences_together(tmp_path):
    f = tmp_path / "dups.fasta"
    seqs = [line for line in MMSEQS.read_text().split(">") if line][:200]
    # every sequence twice under different ids
    text = "".join(f">{k}_a\n{s.split(chr(10), 1)[1]}>{k}_b\n{s.split(chr(10), 1)[1]}" for k, s in enumerate(seqs))
    f.write_text(text)
    run(tmp_path / "t", [str(f)], split_by="text", eval_fraction=0.3)
    ev = {i for i, _ in docs(tmp_path / "t", "eval")}
    assert ev and all((i[:-1] + ("b" if i.endswith("a") else "a")) in ev for i in ev)


def test_summary_counts_skips_by_reason(tmp_path):
    bad = tmp_path / "bad.fasta"
    bad.write_text(">x\n>y\nMK1V\n>z\nMKV\n")
    m = run(tmp_path / "s", [ESM, bad], policy=RecordPolicy(alphabet=POLICY.alphabet, on_bad_record="skip",
                                                                      min_length=4))
    s = m["summary"]
    assert s["skipped_bad"] == {"bad_character": 1, "empty_record": 1}
    assert s["filtered"] == {"too_short": 1}
    assert s["records_read"] == 18 and s["records_kept"] == 15
    assert json.loads((tmp_path / "s" / "split.json").read_text())["summary"] == s


def test_error_mode_stops_with_file_and_line(tmp_path):
    bad = tmp_path / "bad.fasta"
    bad.write_text(">x\nMKV\n>y\nMK1V\n")
    with pytest.raises(DataFormatError, match=rf"^{bad}:4:"):
        split_dataset(inputs=[str(bad)], output_dir=tmp_path / "o", policy=POLICY, progress=False)
    assert not (tmp_path / "o" / "split.json").exists()


def test_crash_then_resume_gives_the_clean_result_without_rewriting_committed_parts(tmp_path, monkeypatch):
    clean = run(tmp_path / "clean", FILES, chunk_records=100)
    calls = {"n": 0}
    real = split_mod.RecordFilter.__call__

    def crashing(self, rec):
        calls["n"] += 1
        if calls["n"] == 350:
            raise RuntimeError("simulated crash")
        return real(self, rec)

    monkeypatch.setattr(split_mod.RecordFilter, "__call__", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(tmp_path / "r", FILES, chunk_records=100)
    monkeypatch.setattr(split_mod.RecordFilter, "__call__", real)
    out = tmp_path / "r"
    assert not (out / "split.json").exists()
    committed = sorted(p for p in out.rglob("part-*.jsonl"))
    assert len(committed) == 6  # 3 commits of 100 records, train + eval each
    assert not list(out.rglob("*.tmp"))
    before = {p: p.stat().st_mtime_ns for p in committed}
    resumed = run(out, FILES, chunk_records=100)
    assert {p: p.stat().st_mtime_ns for p in committed} == before
    assert resumed["parts"] == clean["parts"] and resumed["stats"] == clean["stats"]
    for s in ("train", "eval"):
        assert docs(out, s) == docs(tmp_path / "clean", s)
    # finished: a third run returns the manifest as is
    assert run(out, FILES, chunk_records=100) == resumed


def test_other_parameters_in_same_directory_are_refused(tmp_path):
    run(tmp_path / "o", [ESM])
    with pytest.raises(ManifestError, match="different parameters"):
        run(tmp_path / "o", [ESM], eval_fraction=0.5)


def test_missing_part_is_reported(tmp_path):
    m = run(tmp_path / "o", [MMSEQS])
    (tmp_path / "o" / "train" / m["parts"]["train"][0]["name"]).unlink()
    with pytest.raises(ManifestError, match="part-00000.jsonl: listed in .* but missing"):
        load_split(tmp_path / "o")
