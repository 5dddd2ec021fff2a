"""Non-FASTA inputs: jsonl, parquet, HF datasets on disk, plain text; column names from config; format detection."""

import gzip
import json
from collections import Counter
from pathlib import Path

import pytest
from tests.helpers.data_files import AA, C4_FILES, needs_c4

from s2t2_dist.errors import ConfigError
from s2t2_dist.data.config import DataConfig
from s2t2_dist.errors import DataError, DataFormatError
from s2t2_dist.data.records import RecordFilter, RecordPolicy, detect_format, read_raw, resolve_inputs

ROWS = [("P1", "MKVLA"), ("P2", "ACDEFGHIK"), ("P3", "WYWYW")]


def collect(inputs, policy=None, stats=None, **kw):
    policy = policy or RecordPolicy(alphabet=AA, extra_residues="UXBZO")
    filt = RecordFilter(policy, stats if stats is not None else Counter())
    out = []
    for r in read_raw([str(i) for i in inputs], allowed=policy.allowed(), uppercase=policy.uppercase, **kw):
        k = filt(r)
        if k is not None:
            out.append((k.id, k.text))
    return out


def test_jsonl_with_configured_columns_and_gz(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps({"entry": i, "sequence": s, "x": 1}) + "\n" for i, s in ROWS) + "\n")
    assert collect([p], id_column="entry", text_column="sequence") == ROWS
    gz = tmp_path / "b.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert collect([gz], id_column="entry", text_column="sequence") == ROWS


def test_jsonl_wrong_column_is_a_clear_error(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps({"id": "P1", "text": "MKV"}) + "\n")
    with pytest.raises(DataFormatError) as e:
        collect([p], id_column="id", text_column="sequence")
    assert str(p) in str(e.value) and "'sequence' not found" in str(e.value) and "id, text" in str(e.value)


def test_jsonl_bad_line_error_and_skip(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "P1", "sequence": "MKV"}\n{not json\n{"id": "P3", "sequence": null}\n'
                 '{"id": "P4", "sequence": "KLM"}\n')
    with pytest.raises(DataFormatError, match=rf"^{p}:2: not a JSON object"):
        collect([p], id_column="id", text_column="sequence")
    st = Counter()
    got = collect([p], RecordPolicy(alphabet=AA, on_bad_record="skip"), st, id_column="id", text_column="sequence")
    assert got == [("P1", "MKV"), ("P4", "KLM")]
    assert st["bad:bad_json"] == 1 and st["bad:missing_text"] == 1


def test_jsonl_bad_character_names_line(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "P1", "sequence": "MKV"}\n{"id": "P2", "sequence": "MK-V"}\n')
    with pytest.raises(DataFormatError, match=rf"^{p}:2: character '-'"):
        collect([p], id_column="id", text_column="sequence")


def test_parquet_columns_entry_sequence(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "u.parquet"
    pq.write_table(pa.table({"Entry": [i for i, _ in ROWS], "Sequence": [s for _, s in ROWS]}), p)
    assert collect([p], id_column="Entry", text_column="Sequence") == ROWS
    with pytest.raises(DataFormatError, match="'sequence' not found .*Entry, Sequence"):
        collect([p], id_column="Entry", text_column="sequence")
    pq.write_table(pa.table({"Entry": ["A", "B"], "Sequence": ["MKV", "MKZ1"]}), p)
    with pytest.raises(DataFormatError, match=rf"^{p}: row 2: character '1'"):
        collect([p], id_column="Entry", text_column="Sequence")


def test_hf_dataset_saved_on_disk(tmp_path):
    import datasets

    d = datasets.DatasetDict({"train": datasets.Dataset.from_dict(
        {"id": [i for i, _ in ROWS], "name": ["n"] * 3, "text": [s for _, s in ROWS]})})
    d.save_to_disk(str(tmp_path / "ds"))
    assert detect_format(tmp_path / "ds") == "hf_disk"
    assert collect([tmp_path / "ds"], id_column="id", text_column="text") == ROWS
    with pytest.raises(DataFormatError, match="split 'test' not in the dataset"):
        collect([tmp_path / "ds"], id_column="id", text_column="text", hf_split="test")
    single = datasets.Dataset.from_dict({"id": ["Q1"], "sequence": ["MKV"]})
    single.save_to_disk(str(tmp_path / "one"))
    assert collect([tmp_path / "one"], id_column="id", text_column="sequence") == [("Q1", "MKV")]


def test_plain_text_line_and_paragraph_modes(tmp_path):
    p = tmp_path / "doc.txt"
    p.write_text("First line.\nSecond line.\n\nThird, new para.\n\n\nFourth.\n")
    any_text = RecordPolicy(alphabet=None)
    assert collect([p], any_text, text_mode="line") == [
        ("doc.txt:1", "First line."), ("doc.txt:2", "Second line."), ("doc.txt:4", "Third, new para."),
        ("doc.txt:7", "Fourth.")]
    assert collect([p], any_text, text_mode="paragraph") == [
        ("doc.txt:1", "First line.\nSecond line."), ("doc.txt:4", "Third, new para."), ("doc.txt:7", "Fourth.")]
    assert collect([p], any_text, text_mode="file") == [("doc.txt", p.read_text().rstrip("\n"))]


@needs_c4
def test_real_c4_jsonl_gz_text_domain():
    files = C4_FILES
    got = collect(files, RecordPolicy(alphabet=None), id_column="url", text_column="text")
    assert len(got) == 30
    assert all(t.strip() for _, t in got) and all(i.startswith("http") for i, _ in got)
    got2 = collect(files, RecordPolicy(alphabet=None), id_column=None, text_column="text")
    assert [t for _, t in got2] == [t for _, t in got]
    assert got2[0][0] == "olmo_c4-sample.01.json.gz:1"


def test_resolve_inputs_globs_dirs_and_unknown(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.fasta").write_text(">b\nMKV\n")
    (tmp_path / "d" / "a.fa.gz").write_bytes(gzip.compress(b">a\nKLM\n"))
    (tmp_path / "d" / "notes.md").write_text("ignored")
    got = resolve_inputs([str(tmp_path / "d")])
    assert [(Path(p).name, f) for p, f in got] == [("a.fa.gz", "fasta"), ("b.fasta", "fasta")]
    assert collect([tmp_path / "d"]) == [("a", "KLM"), ("b", "MKV")]
    assert [Path(p).name for p, _ in resolve_inputs([str(tmp_path / "d" / "*.fasta")])] == ["b.fasta"]
    with pytest.raises(DataError, match="matches no file"):
        resolve_inputs([str(tmp_path / "nope*.fa")])
    with pytest.raises(DataError, match="cannot tell the format"):
        resolve_inputs([str(tmp_path / "d" / "notes.md")])


def test_config_validate_names_the_key(tmp_path):
    f = tmp_path / "x.fasta"
    f.write_text(">a\nMKV\n")
    DataConfig(inputs=[str(f)]).validate()
    cases = {"eval_fraction": dict(eval_fraction=1.5), "inputs": dict(inputs=[str(tmp_path / "missing.fa")]),
             "on_bad_record": dict(on_bad_record="ignore"), "vocab_size": dict(vocab_size=10),
             "max_length": dict(min_length=10, max_length=5), "context_len": dict(context_len=1),
             "shard_size": dict(shard_size=0), "replacement": dict(extra_residue_policy="replace", replacement="XX")}
    for key, kw in cases.items():
        kw.setdefault("inputs", [str(f)])
        with pytest.raises(ConfigError, match=rf"^{key}:"):
            DataConfig(**kw).validate()
    with pytest.raises(ConfigError, match="^vocab_size: a byte-level"):
        DataConfig(inputs=[str(f)], domain="text", vocab_size=100).validate()
    assert DataConfig(inputs=[str(f)], domain="text").allowed_alphabet() is None
    assert DataConfig(inputs=[str(f)]).resolved_tokenizer_kind() == "char"


def test_a_new_format_is_one_registry_entry(tmp_path, monkeypatch):
    """detect_format and read_raw take their formats from records.FORMATS; the format keys of prepare and evaluate
    offer exactly its names (evaluate: those read from files)."""
    import typing

    from s2t2_dist.data import records
    from s2t2_dist.data.fasta import Record
    from s2t2_dist.stages.evaluate import EvalDataConfig

    def read_csv(path, opts):
        for i, line in enumerate(Path(path).read_text().splitlines(), 1):
            rid, text = line.split(",")
            yield Record(rid, text, str(path), i, "line")

    monkeypatch.setitem(records.FORMATS, "csv", records.InputFormat(read_csv, (".csv",)))
    f = tmp_path / "a.csv"
    f.write_text("p1,MKV\np2,ACD\n")
    assert detect_format(f) == "csv"
    assert [(r.id, r.text) for r in read_raw([str(f)], format="auto")] == [("p1", "MKV"), ("p2", "ACD")]
    hints = typing.get_type_hints
    assert set(typing.get_args(hints(DataConfig)["format"])) == {"auto", "fasta", "jsonl", "parquet", "hf_disk",
                                                                 "hub", "text"}
    assert set(typing.get_args(hints(EvalDataConfig)["format"])) == {"auto", "fasta", "jsonl", "parquet", "text"}

