"""Step 2: BPE training, loading with transformers, compression report against OLMo, tokenizer hash."""

import json

import pytest
from tests.helpers.data_files import AA, ESM, EXTRA, MMSEQS, OLMO_TOKENIZER as OLMO, split_and_train

from s2t2_dist.data.bpe import build_bpe_tokenizer, compression_report, save_tokenizer_dir, train_tokenizer
from s2t2_dist.data.tokenizers import load_tokenizer, tokenizer_hash
from s2t2_dist.errors import DataError
from s2t2_dist.data.split import iter_split_texts

ALPHA = AA + EXTRA


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("bpe")
    rep = split_and_train(root, [MMSEQS, ESM], max_records=400, compare_with={"olmo": str(OLMO)})
    return root, rep


def test_tokenizer_trains_and_loads_with_transformers(trained):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root, rep = trained
    tok_dir = root / "tok"
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "bpe_training.json"} <= {
        p.name for p in tok_dir.iterdir()}
    assert rep["vocab_size"] == 512
    auto = AutoTokenizer.from_pretrained(str(tok_dir))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    info = load_tokenizer(tok_dir)
    assert (auto.bos_token, auto.eos_token, auto.pad_token, auto.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    assert (info.bos_id, info.eos_id, info.pad_id, info.unk_id) == (0, 1, 2, 3)
    assert auto.model_max_length == 512
    seqs = list(iter_split_texts(root / "splits", "eval"))[:50]
    for s in seqs:
        ids = info.encode([s])[0]
        assert auto(s)["input_ids"] == [0] + ids  # BOS added by the post-processor
        assert fast(s, add_special_tokens=False)["input_ids"] == ids
        assert auto.decode(ids) == s
        assert info.unk_id not in ids
    # all 25 letters are in the vocabulary, even the rare ones never seen in training
    vocab = auto.get_vocab()
    assert all(c in vocab for c in ALPHA)


def test_compression_report_against_bytes_and_olmo(trained):
    _, rep = trained
    c = rep["compression"]["tokenizers"]
    # the paper's 512-token BPE makes UniRef50 sequences 1.82x shorter than bytes
    assert 1.6 < c["new"]["bytes_per_token"] < 2.1
    assert c["new"]["vs_bytes"] == c["new"]["bytes_per_token"]
    # the README: the OLMo tokenizer gives about 0.56 tokens per residue
    assert 0.5 < c["olmo"]["tokens_per_char"] < 0.62
    assert c["new"]["ratio_vs_olmo"] == pytest.approx(c["olmo"]["tokens"] / c["new"]["tokens"])
    assert rep["compression"]["bytes"] == rep["compression"]["chars"]  # ASCII residues: 1 byte each


def test_training_is_deterministic_and_skipped_when_done(trained, tmp_path):
    root, rep = trained
    again = train_tokenizer(split_dir=root / "splits", output_dir=tmp_path / "tok2", vocab_size=512, kind="char",
                            alphabet=ALPHA, max_records=400, progress=False)
    assert again["tokenizer_hash"] == rep["tokenizer_hash"] == tokenizer_hash(root / "tok")
    mtime = (tmp_path / "tok2" / "tokenizer.json").stat().st_mtime_ns
    train_tokenizer(split_dir=root / "splits", output_dir=tmp_path / "tok2", vocab_size=512, kind="char",
                    alphabet=ALPHA, max_records=400, progress=False)
    assert (tmp_path / "tok2" / "tokenizer.json").stat().st_mtime_ns == mtime


def test_tokenizer_hash_is_canonical(trained, tmp_path):
    root, _ = trained
    f = root / "tok" / "tokenizer.json"
    h = tokenizer_hash(f)
    assert h == tokenizer_hash(root / "tok") == load_tokenizer(f).hash
    obj = json.loads(f.read_text())
    reordered = tmp_path / "reordered.json"
    reordered.write_text(json.dumps(dict(reversed(list(obj.items()))), indent=4))
    assert tokenizer_hash(reordered) == h
    obj["model"]["merges"] = obj["model"]["merges"][:-1]
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(obj))
    assert tokenizer_hash(changed) != h
    assert len(h) == 64


def test_olmo_special_tokens_detected():
    info = load_tokenizer(OLMO)
    assert info.vocab_size == 50280
    assert info.eos_id == 50279 and info.bos_id is None and info.pad_id == 1
    assert info.start_id == 50279
    # special-token text inside a document is encoded as text, not as the special token
    ids = info.encode(["MKV<|endoftext|>A"])[0]
    assert 50279 not in ids and info.tokenizer.decode(ids) == "MKV<|endoftext|>A"


def test_byte_level_tokenizer_for_text(tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog. " * 5, "Ünïcödé — ✓ mixed text\nwith lines", "x" * 50]
    tok = build_bpe_tokenizer(texts * 20, vocab_size=300, kind="byte")
    save_tokenizer_dir(tok, tmp_path / "t")
    info = load_tokenizer(tmp_path / "t")
    for t in texts + ["never seen: 日本語"]:
        ids = info.encode([t])[0]
        assert info.tokenizer.decode(ids) == t
    rep = compression_report(texts, {"byte": info})
    assert rep["bytes"] == sum(len(t.encode()) for t in texts) and rep["bytes"] > rep["chars"]


def test_missing_tokenizer_and_missing_eos_are_clear(tmp_path):
    with pytest.raises(DataError, match="tokenizer not found"):
        load_tokenizer(tmp_path / "nope")
    from tokenizers import Tokenizer, models

    t = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    t.save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="no end-of-document token"):
        load_tokenizer(tmp_path / "t.json")


def test_bpe_sample_is_bounded_by_the_character_budget(trained, tmp_path):
    """BPE training memory grows with the characters sampled (~60 bytes each, benchmarks/data_cpu2_2026-11-23.md):
    the character budget caps the sample whatever the record cap, and the report states the estimated peak."""
    from s2t2_dist.data.bpe import BPE_BYTES_PER_CHAR, sample_for_tokenizer
    from s2t2_dist.data.split import load_split

    root, _ = trained
    total = load_split(root / "splits")["chars"]["train"]
    budget = total // 5
    texts = list(sample_for_tokenizer(root / "splits", max_records=None, max_chars=budget))
    got = sum(map(len, texts))
    assert 0.5 * budget < got <= budget  # the fraction aims at the budget, the budget is a hard stop
    # spread over the split (a hash of the id), not its first records
    first = list(sample_for_tokenizer(root / "splits", max_records=None))
    assert texts != first[:len(texts)]
    assert sum(map(len, sample_for_tokenizer(root / "splits", max_records=None, max_chars=1000))) <= 1000
    rep = train_tokenizer(split_dir=root / "splits", output_dir=tmp_path / "tok", vocab_size=300, kind="char",
                          alphabet=ALPHA, max_records=None, max_chars=budget, progress=False)
    assert rep["trained_on"]["chars"] == got and rep["params"]["max_chars"] == budget
    assert rep["trained_on"]["est_peak_bytes"] == BPE_BYTES_PER_CHAR * got


def test_prepare_help_states_the_bpe_memory_cost():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "prepare", "--help"], capture_output=True,
                         text=True, timeout=120).stdout
    flat = " ".join(out.split())
    assert "tokenizer_max_chars" in flat and "~60 bytes per character" in flat
