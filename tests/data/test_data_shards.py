"""Step 3: shards + manifest round trip, exact packing, eval byte invariant across tokenizers, crash + resume."""

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from tests.helpers.data_files import ESM, MMSEQS, OLMO_TOKENIZER as OLMO, split_and_train

from s2t2_dist.data import shards as shards_mod
from s2t2_dist.data.tokenizers import load_tokenizer
from s2t2_dist.errors import ManifestError, ShardError
from s2t2_dist.data.shards import load_manifest, npy_load, write_shards
from s2t2_dist.data.split import iter_split_docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    split_and_train(root, [MMSEQS, ESM], chunk_records=200, max_records=400)
    return root


def shards_of(root, out, split, tok, **kw):
    kw.setdefault("context_len", 128)
    kw.setdefault("shard_size", 300)
    kw.setdefault("num_workers", 0)
    return write_shards(split_dir=root / "splits", split=split, tokenizer=tok, output_dir=out, progress=False, **kw)


def read_tar_samples(path):
    """Independent reader (plain tarfile): {key: {ext: bytes}} in member order."""
    out = {}
    with tarfile.open(path) as tf:
        for m in tf:
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return out


def all_samples(m):
    d = Path(m["_dir"]) if "_dir" in m else None
    res = []
    for s in m["shards"]:
        samples = read_tar_samples(d / s["name"])
        assert len(samples) == s["n_samples"]
        res.extend(samples.items())
    return res


def reference_stream(root, tok_dir):
    info = load_tokenizer(tok_dir)
    pre = [] if info.bos_id is None else [info.bos_id]
    stream = []
    for _, _, text in iter_split_docs(root / "splits", "train"):
        stream += pre + info.encode([text])[0] + [info.eos_id]
    return np.array(stream)


def test_packing_is_exact_and_manifest_round_trips(prepared, tmp_path):
    root = prepared
    m = shards_of(root, tmp_path / "train", "train", root / "tok")
    m = load_manifest(tmp_path / "train", verify_checksums=True)
    T = 128
    samples = all_samples(m)
    keys = [k for k, _ in samples]
    assert keys == [f"{i:012d}" for i in range(len(samples))]
    blocks = [npy_load(v["input_ids.npy"]) for _, v in samples]
    assert all(b.dtype == np.uint16 and b.shape == (T,) for b in blocks)
    stream = reference_stream(root, root / "tok")
    n = len(blocks)
    assert np.array_equal(np.concatenate(blocks), stream[: n * T])
    tot = m["totals"]
    assert tot["n_samples"] == n and tot["n_tokens"] == n * T
    assert tot["stream_tokens"] == len(stream) and 0 <= tot["dropped_tail_tokens"] == len(stream) - n * T < T
    assert all(s["n_samples"] == 300 for s in m["shards"][:-1]) and 0 < m["shards"][-1]["n_samples"] <= 300
    assert m["tokenizer"]["hash"] == load_tokenizer(root / "tok").hash
    assert m["split"] == "train" and m["kind"] == "packed" and m["context_len"] == T
    texts = [t for _, _, t in iter_split_docs(root / "splits", "train")]
    assert tot["n_docs"] == len(texts) and tot["text_bytes"] == sum(len(t.encode()) for t in texts)
    assert m["summary"]["train_records"] == len(texts) and m["summary"]["train_shards"] == len(m["shards"])
    # BOS opens and EOS closes every document inside the stream
    assert stream[0] == 0 and (stream == 1).sum() == len(texts) and (stream == 0).sum() == len(texts)


def test_eval_bytes_are_the_same_for_two_tokenizers(prepared, tmp_path):
    root = prepared
    mn = shards_of(root, tmp_path / "new", "eval", root / "tok", shard_size=40)
    mo = shards_of(root, tmp_path / "olmo", "eval", OLMO, shard_size=40)
    mn, mo = load_manifest(tmp_path / "new"), load_manifest(tmp_path / "olmo")
    assert mn["totals"]["n_docs"] == mo["totals"]["n_docs"] > 50
    assert mn["totals"]["text_bytes"] == mo["totals"]["text_bytes"]
    assert mn["tokenizer"]["hash"] != mo["tokenizer"]["hash"]
    infos = {"new": load_tokenizer(root / "tok"), "olmo": load_tokenizer(OLMO)}
    texts = {rid: t for _, rid, t in iter_split_docs(root / "splits", "eval")}
    per = {}
    for name, m in (("new", mn), ("olmo", mo)):
        rows = []
        for key, files in all_samples(m):
            meta = json.loads(files["json"])
            ids = npy_load(files["input_ids.npy"]).astype(np.int64)
            info = infos[name]
            assert ids[0] == info.start_id
            text = texts[meta["id"]]
            # the scored tokens (1..n) decode to exactly the document, whose UTF-8 size is n_bytes
            assert info.tokenizer.decode(ids[1:].tolist()) == text
            assert meta["n_bytes"] == len(text.encode("utf-8"))
            rows.append((key, meta["id"], meta["n_bytes"], len(ids) - 1))
        per[name] = rows
        assert sum(r[3] for r in rows) == m["totals"]["n_tokens"]
    assert [r[:3] for r in per["new"]] == [r[:3] for r in per["olmo"]]
    assert infos["olmo"].start_id == 50279  # OLMo has no BOS: documents start after <|endoftext|>
    assert mo["dtype"] == "uint16"


def test_worker_count_does_not_change_the_bytes(prepared, tmp_path):
    root = prepared
    m0 = shards_of(root, tmp_path / "w0", "train", root / "tok")
    m2 = shards_of(root, tmp_path / "w2", "train", root / "tok", num_workers=2, task_chars=20_000)
    assert [s["sha256"] for s in m0["shards"]] == [s["sha256"] for s in m2["shards"]]
    assert m0["totals"] == m2["totals"]


@pytest.mark.parametrize("crash_at", [1, 299, 301, 700])
def test_crash_mid_shard_then_resume(prepared, tmp_path, monkeypatch, crash_at):
    root = prepared
    kw = dict(context_len=64, shard_size=150)  # 64-token blocks: shard boundaries fall inside documents
    clean = shards_of(root, tmp_path / "clean", "train", root / "tok", **kw)
    out = tmp_path / "crash"
    calls = {"n": 0}
    real = shards_mod.ShardFile.write

    def crashing(self, key, files):
        calls["n"] += 1
        if calls["n"] == crash_at:
            raise RuntimeError("simulated crash")
        return real(self, key, files)

    monkeypatch.setattr(shards_mod.ShardFile, "write", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        shards_of(root, out, "train", root / "tok", **kw)
    monkeypatch.setattr(shards_mod.ShardFile, "write", real)
    assert not (out / "manifest.json").exists()
    done = sorted(out.glob("train-*.tar"))
    assert len(done) == (crash_at - 1) // 150  # only whole shards carry a final name
    for p in done:
        assert p.read_bytes() == (tmp_path / "clean" / p.name).read_bytes()
    stamps = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in done}
    # a hard kill would leave a .tmp behind: the rerun must overwrite it
    (out / f"train-{len(done):06d}.tar.tmp").write_bytes(b"garbage from a killed run")
    m = shards_of(root, out, "train", root / "tok", **kw)
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in done} == stamps
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in clean["shards"]]
    assert m["totals"] == clean["totals"]
    assert not list(out.glob("*.tmp"))


def test_resume_rewrites_a_recorded_shard_that_was_damaged(prepared, tmp_path):
    root = prepared
    m = shards_of(root, tmp_path / "o", "eval", root / "tok", shard_size=20)
    (tmp_path / "o" / "manifest.json").unlink()  # as if the run died before the manifest
    victim = tmp_path / "o" / m["shards"][2]["name"]
    victim.write_bytes(victim.read_bytes()[:1000])
    again = shards_of(root, tmp_path / "o", "eval", root / "tok", shard_size=20)
    assert again["shards"] == m["shards"]


def test_other_job_in_same_directory_is_refused(prepared, tmp_path):
    root = prepared
    shards_of(root, tmp_path / "o", "eval", root / "tok")
    with pytest.raises(ManifestError, match="another job"):
        shards_of(root, tmp_path / "o", "eval", root / "tok", context_len=256)


def test_manifest_mismatches_are_clear_errors(prepared, tmp_path):
    root = prepared
    shards_of(root, tmp_path / "o", "train", root / "tok")
    mpath = tmp_path / "o" / "manifest.json"
    good = mpath.read_text()
    m = json.loads(good)
    m["shards"][1]["n_samples"] += 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="expected"):
        load_manifest(tmp_path / "o")
    m = json.loads(good)
    m["totals"]["n_samples"] += 5
    mpath.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="totals say"):
        load_manifest(tmp_path / "o")
    mpath.write_text(good[:100])
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(tmp_path / "o")
    mpath.write_text(good)
    name = json.loads(good)["shards"][0]["name"]
    shard = tmp_path / "o" / name
    data = shard.read_bytes()
    shard.write_bytes(data[:-20000])
    with pytest.raises(ShardError, match=rf"shard .*{name} has \d+ bytes"):
        load_manifest(tmp_path / "o")
    corrupt = bytearray(data)
    corrupt[5000:5010] = b"XXXXXXXXXX"
    shard.write_bytes(bytes(corrupt))
    load_manifest(tmp_path / "o")  # same size: only the checksum sees it
    with pytest.raises(ShardError, match=rf"{name}: sha256 differs"):
        load_manifest(tmp_path / "o", verify_checksums=True)
    shard.unlink()
    with pytest.raises(ShardError, match=rf"shard .*{name} is missing"):
        load_manifest(tmp_path / "o")


def test_shard_file_is_a_reproducible_webdataset_tar(tmp_path):
    import webdataset as wds

    samples = [(f"{i:012d}", {"input_ids.npy": bytes([i]) * (100 + i), "json": b'{"id": "x"}'}) for i in range(5)]
    infos = []
    for name in ("a.tar", "b.tar"):
        sf = shards_mod.ShardFile(tmp_path / name)
        for key, files in samples:
            sf.write(key, files)
        assert not (tmp_path / name).exists() and (tmp_path / f"{name}.tmp").exists()
        infos.append(sf.commit())
    a, b = (tmp_path / "a.tar").read_bytes(), (tmp_path / "b.tar").read_bytes()
    assert a == b and infos[0]["sha256"] == infos[1]["sha256"] and infos[0]["file_bytes"] == len(a)
    assert len(a) % 10240 == 0  # whole tar records
    with tarfile.open(tmp_path / "a.tar") as tf:
        members = tf.getmembers()
    assert [m.name for m in members[:2]] == ["000000000000.input_ids.npy", "000000000000.json"]
    assert all(m.mtime == 0 and m.mode == 0o444 and m.uname == "s2t2" for m in members)
    with open(tmp_path / "a.tar", "rb") as f:  # webdataset's own tar reader, as the loader uses it
        got = list(wds.tariterators.group_by_keys(wds.tariterators.tar_file_expander([{"url": "a", "stream": f}])))
    assert [(s["__key__"], s["input_ids.npy"], s["json"]) for s in got] == [
        (k, f["input_ids.npy"], f["json"]) for k, f in samples]
    sf = shards_mod.ShardFile(tmp_path / "c.tar")
    sf.write(*samples[0])
    sf.abort()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tar", "b.tar"]
