"""`prepare(DataConfig)` end to end on the shipped samples: proteins (with the OLMo baseline shards) and English."""

import json

from tests.helpers.data_files import ESM, MMSEQS, OLMO_TOKENIZER, SHAKESPEARE

from s2t2_dist.data import DataConfig, EvalDocs, GlobalTrainLoader, prepare
from s2t2_dist.data.pipeline import format_summary


def test_prepare_proteins_with_source_baseline_and_rerun(tmp_path):
    cfg = DataConfig(inputs=[str(MMSEQS), str(ESM)], output_dir=str(tmp_path / "out"), eval_fraction=0.1,
                     vocab_size=256, context_len=128, shard_size=200, num_workers=0,
                     source_tokenizer=str(OLMO_TOKENIZER), tokenizer_max_records=300)
    s = prepare(cfg, progress=False)
    text = format_summary(s)
    assert "records  read 515, kept 515" in text and "new/train" in text and "source needs" in text
    assert s["split"]["records_read"] == 515
    assert not any(step["reused"] for step in s["steps"].values())
    comp = s["tokenizer"]["compression"]["tokenizers"]
    assert set(comp) == {"new", "source"}
    for name in ("new", "source"):
        tr, ev = s["shards"][f"{name}/train"], s["shards"][f"{name}/eval"]
        assert tr["n_docs"] == s["split"]["train_records"] and ev["n_docs"] == s["split"]["eval_records"]
    # same eval documents, same bytes, whatever the tokenizer
    assert s["shards"]["new/eval"]["text_bytes"] == s["shards"]["source/eval"]["text_bytes"]
    saved = json.loads((tmp_path / "out" / "prepare_summary.json").read_text())
    assert saved["shards"] == s["shards"]
    out = tmp_path / "out"
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.suffix in (".tar", ".jsonl")}
    s2 = prepare(cfg, progress=False)  # everything is done: nothing is rewritten
    assert s2["shards"] == s["shards"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert all(step["reused"] for step in s2["steps"].values()) and len(s2["steps"]) == 6
    assert "everything was already done" in format_summary(s2)
    L = GlobalTrainLoader(out / "shards" / "new" / "train", global_batch_size=4, micro_batch_size=4)
    assert next(iter(L))["input_ids"].shape == (4, 128)
    d = next(iter(EvalDocs(out / "shards" / "source" / "eval")))
    assert d["input_ids"][0].item() == 50279


def test_prepare_english_text_domain(tmp_path):
    cfg = DataConfig(inputs=[str(SHAKESPEARE)], format="text", text_mode="paragraph", domain="text",
                     output_dir=str(tmp_path / "out"), eval_fraction=0.05, vocab_size=400, context_len=256,
                     shard_size=100, num_workers=0)
    s = prepare(cfg, progress=False)
    assert s["split"]["records_kept"] > 600  # blank-line separated speeches
    c = s["tokenizer"]["compression"]["tokenizers"]["new"]
    assert c["bytes_per_token"] > 1.5  # a byte-level BPE compresses English
    tok = json.loads((tmp_path / "out" / "tokenizer" / "tokenizer.json").read_text())
    assert tok["pre_tokenizer"]["type"] == "ByteLevel"
    docs = list(EvalDocs(tmp_path / "out" / "shards" / "new" / "eval"))
    assert sum(d["n_bytes"] for d in docs) == s["shards"]["new/eval"]["text_bytes"]
