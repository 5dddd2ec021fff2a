"""Score any file: `s2t2 evaluate model.path=DIR data.files=[...]` on real FASTA, FASTA.gz, jsonl.gz, parquet and text
files with a tiny model that carries the real OLMo tokenizer. The result must equal an independent computation
(transformers' own tokenizer + the per-window reference scorer of eval/bpb.py); every record is scored or counted
as left out with its reason and place; the tokenized files are cached by content and tokenizer hash."""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.data_files import C4_FILES, ESM, MMSEQS, SHAKESPEARE, needs_c4
from tests.helpers.finetune_fixtures import sample_fasta
from tests.helpers.stage_fixtures import run_cmd, tiny_olmo
from s2t2_dist.config import load_config
from s2t2_dist.data.raw_eval import tokenize_files
from s2t2_dist.stages.evaluate import EvaluateConfig, run

PROTEIN = ESM  # 15 real UniRef50 sequences (shipped)
C4, C4_2 = (C4_FILES + [None, None])[:2]  # real C4 jsonl.gz samples (workplace data only)
CTX = 64

pytestmark = needs_c4


def _fasta_texts(path: Path) -> list[str]:
    out, cur = [], None
    for line in path.read_text().splitlines():
        if line.startswith(">"):
            if cur is not None:
                out.append(cur)
            cur = ""
        elif cur is not None:
            cur += line.strip()
    out.append(cur)
    return [t for t in out if t]


class Files:
    """The inputs, and what each should contribute: texts scored, records left out (reason -> count)."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.texts: list[str] = []
        self.left_out: dict[str, int] = {}
        self.paths: list[Path] = []
        # real protein FASTA and real English jsonl.gz as they are
        self._add(PROTEIN, _fasta_texts(PROTEIN))
        self._add(C4, [json.loads(l)["text"] for l in gzip.open(C4, "rt", encoding="utf-8")])
        # FASTA.gz: 8 real UniProt records (cut to 100 residues) and one record without a sequence
        plain = sample_fasta(MMSEQS, root / "s.fasta", 8, 100)
        fgz = root / "sample.fasta.gz"
        fgz.write_bytes(gzip.compress((plain.read_text() + ">no_sequence here\n").encode()))
        self.empty_line = len(plain.read_text().splitlines()) + 1
        self._add(fgz, _fasta_texts(plain), {"bad:empty_record": 1})
        # parquet of real C4 documents, one row with no text
        docs = [json.loads(l)["text"] for l in gzip.open(C4_2, "rt", encoding="utf-8")][:2]
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": docs + [None], "url": ["u"] * 3}), root / "c4.parquet")
            self._add(root / "c4.parquet", docs, {"bad:missing_text": 1})
        except ImportError:
            pass
        # plain text: 20 real lines (blank ones are not documents)
        lines = SHAKESPEARE.read_text().splitlines()[:20]
        (root / "play.txt").write_text("\n".join(lines) + "\n")
        self._add(root / "play.txt", [l for l in lines if l.strip()])
        # jsonl with a broken line in the middle
        self.jsonl = root / "notes.jsonl"
        self.jsonl.write_text('{"text": "alpha beta"}\n{"text": broken\n{"text": "gamma\\u00e9 delta"}\n')
        self._add(self.jsonl, ["alpha beta", "gamma\u00e9 delta"], {"bad:bad_json": 1})

    def _add(self, path: Path, texts: list[str], left: dict | None = None) -> None:
        self.paths.append(path)
        self.texts += texts
        for k, v in (left or {}).items():
            self.left_out[k] = self.left_out.get(k, 0) + v

    def arg(self) -> str:
        return "data.files=[" + ",".join(str(p) for p in self.paths) + "]"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("score_files")
    model = tiny_olmo(root / "model", max_position_embeddings=128, seed=3)
    return model, Files(root / "files"), root


def _reference(model_dir: Path, texts: list[str]):
    """Independent of the data pipeline: transformers' tokenizer, the start token in front (OLMo has no BOS: EOS),
    and the one-window-at-a-time scorer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from s2t2_dist.eval.bpb import score_documents

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    docs = [{"input_ids": [start] + tok(t, add_special_tokens=False)["input_ids"], "n_bytes": len(t.encode())}
            for t in texts]
    return score_documents(lambda ids: model(input_ids=ids).logits, docs, CTX)


def test_cli_scores_every_file_kind_and_equals_the_reference(world, tmp_path):
    """`s2t2 evaluate` on 2 ranks (torchrun): rank 0 tokenizes, both score their share; the totals are the
    single-process reference's."""
    model, files, root = world
    out = tmp_path / "result.json"
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                    "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0",
                    "-m", "s2t2_dist.cli", "evaluate", f"model.path={model}", files.arg(),
                    f"data.cache_dir={root / 'cache'}", f"run_dir={tmp_path / 'run'}", f"output={out}",
                    f"eval.context_len={CTX}", "eval.batch_size=4"])
    r = json.loads(out.read_text())
    assert r["world_size"] == 2
    n = len(files.texts)
    rec = r["records"]
    assert rec["scored"] == n and rec["left_out"] == files.left_out
    assert rec["read"] == n + sum(files.left_out.values())
    where = {e["reason"]: e["where"] for e in rec["examples"]}
    assert where["bad:empty_record"].endswith(f"sample.fasta.gz:{files.empty_line}")
    assert where["bad:bad_json"].endswith("notes.jsonl:2")
    # one summary line, then perplexity and BpB
    lines = [l for l in proc.stdout.splitlines() if l.startswith("evaluate")]
    assert f"records: read {rec['read']}, scored {n}, left out {sum(files.left_out.values())}" in lines[0]
    assert "bad:bad_json: 1" in lines[0] and "notes.jsonl:2" in lines[0]
    assert f"perplexity {r['metrics']['perplexity']:.4f}, bpb {r['metrics']['bpb']:.4f}" in lines[1]
    # the same numbers as an independent tokenization + the reference scorer
    ref = _reference(model, files.texts)
    m = r["metrics"]
    assert (m["docs"], m["tokens"], m["bytes"]) == (n, ref.tokens, ref.bytes)
    assert ref.bytes == sum(len(t.encode()) for t in files.texts)
    assert m["bpb"] == pytest.approx(ref.nll_nats / (math.log(2) * ref.bytes), rel=1e-5)
    # a random model is close to the uniform guess, not better than it by much
    assert 0.8 < m["bpb"] / m["random_guess_bpb"] < 1.2


def test_cache_is_keyed_by_content_and_tokenizer(world, tmp_path):
    model, files, root = world
    cache = tmp_path / "cache"
    kw = dict(cache_dir=cache, progress=False)
    paths = [str(files.jsonl), str(files.paths[0])]
    a = tokenize_files(paths, str(model), **kw)
    stamp = (Path(a["eval_dir"]) / "manifest.json").stat().st_mtime_ns
    b = tokenize_files(paths, str(model), **kw)
    assert b == a and (Path(a["eval_dir"]) / "manifest.json").stat().st_mtime_ns == stamp  # reused, not redone
    assert len(list(cache.iterdir())) == 1
    # same path, new content: a new key, the new record counted
    changed = tmp_path / "notes.jsonl"
    changed.write_text(files.jsonl.read_text())
    c = tokenize_files([str(changed), str(files.paths[0])], str(model), **kw)
    changed.write_text(files.jsonl.read_text() + '{"text": "one more"}\n')
    d = tokenize_files([str(changed), str(files.paths[0])], str(model), **kw)
    assert d["cache_key"] != c["cache_key"] and d["records"]["scored"] == c["records"]["scored"] + 1
    # another tokenizer (a tokenizer directory with one extra token): another key, other token counts
    other = tmp_path / "tok2"
    other.mkdir()
    tj = json.loads((Path(model) / "tokenizer.json").read_text())
    tj["added_tokens"].append({"id": 50280, "content": "<extra>", "single_word": False, "lstrip": False,
                               "rstrip": False, "normalized": False, "special": True})
    (other / "tokenizer.json").write_text(json.dumps(tj))
    for f in ("tokenizer_config.json",):
        (other / f).write_text((Path(model) / f).read_text())
    e = tokenize_files(paths, str(other), **kw)
    assert e["cache_key"] != a["cache_key"] and e["records"] == a["records"]


def test_max_docs_and_bad_records_are_reported(world, tmp_path, capsys):
    model, files, root = world
    base = [f"model.path={model}", files.arg(), f"data.cache_dir={root / 'cache'}", f"eval.context_len={CTX}"]
    r = run(load_config(EvaluateConfig, None, [*base, f"run_dir={tmp_path / 'a'}", "eval.max_docs=5"]))
    n = len(files.texts)
    assert r["metrics"]["docs"] == 5 and r["records"]["scored"] == 5
    assert r["records"]["left_out"]["max_docs"] == n - 5
    assert "max_docs: " in capsys.readouterr().out
    # on_bad_record=error: one line naming the file and line, exit 2
    from s2t2_dist.stages.evaluate import main

    rc = main([*base, f"run_dir={tmp_path / 'b'}", "data.on_bad_record=error"])
    err = capsys.readouterr().err
    errors = [l for l in err.splitlines() if "error" in l]  # (the other lines are progress bars)
    assert rc == 2 and len(errors) == 1 and errors[0].startswith("s2t2 evaluate: error: DataFormatError: ")
    assert errors[0].split(": ")[3].endswith(f"sample.fasta.gz:{files.empty_line}")


def test_config_needs_exactly_one_source(tmp_path):
    from s2t2_dist.errors import ConfigError

    with pytest.raises(ConfigError, match="data.eval.*or data.files"):
        load_config(EvaluateConfig, None, ["model.path=x"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(EvaluateConfig, None, ["model.path=x", "data.eval=y", f"data.files=[{PROTEIN}]"])
    with pytest.raises(ConfigError, match="data.files.*does not exist"):
        load_config(EvaluateConfig, None, ["model.path=x", f"data.files=[{tmp_path / 'nope.fasta'}]"])


def test_characters_the_tokenizer_cannot_spell_are_counted(tmp_path):
    """A protein BPE scoring English: every letter of it is <unk>; the summary says how many tokens that is."""
    from s2t2_dist.data import DataConfig, prepare
    from s2t2_dist.data.raw_eval import format_records

    prepare(DataConfig(inputs=[str(ESM)], output_dir=str(tmp_path / "p"), vocab_size=64, context_len=64,
                       eval_fraction=0.2), progress=False)
    f = tmp_path / "mixed.jsonl"
    f.write_text('{"text": "MKVLA"}\n{"text": "alpha beta"}\n')
    r = tokenize_files([str(f)], str(tmp_path / "p" / "tokenizer"), cache_dir=tmp_path / "cache", progress=False)
    assert r["records"]["scored"] == 2 and r["records"]["unk_tokens"] == len("alpha beta")
    assert "10 scored tokens are <unk>" in format_records(r["records"])


def test_two_ranks_a_bad_record_is_one_line_from_rank_0(world, tmp_path):
    """on_bad_record=error on 2 ranks: rank 0 prints the user error naming FILE:LINE, rank 1 one line naming rank 0."""
    model, files, root = world
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(AssertionError) as e:
        run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0",
                 "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "s2t2_dist.cli", "evaluate",
                 f"model.path={model}", f"data.files=[{bad}]", "data.on_bad_record=error", "eval.context_len=128",
                 f"data.cache_dir={tmp_path / 'cache'}", f"run_dir={tmp_path / 'run'}"])
    err = str(e.value)
    assert f"[rank 0] s2t2 evaluate: error: DataFormatError: {bad}:2:" in err
    # torchrun stops rank 1 as soon as rank 0 exits, so rank 1's own line may not get out; if it does, it is one
    # line naming rank 0, never a traceback
    rank1 = [ln for ln in err.splitlines() if ln.startswith("[rank 1]") and "error" in ln.lower()]
    assert all("tokenizing the files failed on rank 0" in ln for ln in rank1), rank1
    assert "s2t2_dist/" not in err  # no traceback through our code (torchrun prints its own report)
