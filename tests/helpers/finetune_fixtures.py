"""Shared material for the finetune / evaluate tests: real protein shards made by `s2t2_dist.data.prepare` from a
small sample of a real FASTA file, tiny OLMo-config models saved with the real OLMo tokenizer, and valid P files.

Everything is small (context 64, new vocabulary 64, models of width 32/48 with the real 50,304-row vocabulary) so
that the whole finetune/evaluate test set runs in a few minutes on 2 CPU cores."""

from __future__ import annotations

import os
from pathlib import Path

import torch

SHARED = Path(os.environ.get("S2T2_SHARED_DATA", "/work/shared/data"))
FASTA = SHARED / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"
CTX = 64
NEW_VOCAB = 64
N_RECORDS = 160


def sample_fasta(src: Path, dst: Path, n_records: int, max_len: int = 400) -> Path:
    """The first n_records records of a real FASTA file, sequences cut to max_len residues (kept as FASTA)."""
    out, n, keep = [], 0, False
    seq: list[str] = []

    def flush():
        if keep and seq:
            s = "".join(seq)[:max_len]
            out.extend(s[i:i + 60] for i in range(0, len(s), 60))

    for line in src.read_text().splitlines():
        if line.startswith(">"):
            flush()
            seq = []
            n += 1
            keep = n <= n_records
            if keep:
                out.append(line)
        elif keep:
            seq.append(line.strip())
    flush()
    dst.write_text("\n".join(out) + "\n")
    return dst


def save_model(out: Path, config: str, d: int, seed: int, layers: int = 2, heads: int = 4) -> Path:
    """A tiny random model with a real OLMo config (vocab 50,304 rows) and the real OLMo tokenizer."""
    from s2t2_dist.recipes.tiny import save_tiny

    return save_tiny(out, config, n_layers=layers, d_model=d, n_heads=heads, seed=seed, max_position_embeddings=128)


def prepare_data(out: Path, source_tokenizer: Path) -> Path:
    from s2t2_dist.data import DataConfig, prepare

    fasta = sample_fasta(FASTA, out.parent / f"{out.name}_sample.fasta", N_RECORDS)
    cfg = DataConfig(inputs=[str(fasta)], output_dir=str(out), eval_fraction=0.15, vocab_size=NEW_VOCAB,
                     context_len=CTX, shard_size=64, num_workers=0, source_tokenizer=str(source_tokenizer),
                     tokenizer_max_records=None)
    prepare(cfg, progress=False)
    return out


def random_p(v: int, u: int, source_ids: torch.Tensor, src_hash: str, tgt_hash: str, *, kind: str = "sparse",
             seed: int = 0):
    """A valid P file content: rows sum to 1/v, columns to 1/u.

    sparse: a north-west-corner transport plan between the uniform marginals (<= v + u - 1 entries, exact), rows
    and columns permuted at random; softmax: a dense positive plan scaled to the marginals (Sinkhorn); unconstrained:
    P = C * nu with C of any sign (the unconstrained translator's convention)."""
    from s2t2_dist.translator.pfile import SparseP

    g = torch.Generator().manual_seed(seed)
    mu, nu = torch.full((v,), 1.0 / v), torch.full((u,), 1.0 / u)
    if kind == "sparse":
        r, c = [u] * v, [v] * u  # in units of 1 / (u v): exact integers
        rows, cols, vals = [], [], []
        i = j = 0
        while i < v and j < u:
            m = min(r[i], c[j])
            rows.append(i), cols.append(j), vals.append(m / (u * v))
            r[i] -= m
            c[j] -= m
            if r[i] == 0:
                i += 1
            else:
                j += 1
        pr, pc = torch.randperm(v, generator=g), torch.randperm(u, generator=g)
        idx = torch.stack([pr[torch.tensor(rows)], pc[torch.tensor(cols)]])
        values = torch.tensor(vals, dtype=torch.float32)
    else:
        if kind == "softmax":
            P = torch.rand(v, u, generator=g, dtype=torch.float64) + 0.1
            for _ in range(200):
                P *= (mu.double() / P.sum(1))[:, None]
                P *= (nu.double() / P.sum(0))[None, :]
        else:
            P = torch.randn(v, u, generator=g, dtype=torch.float64) / v * nu.double()[None, :]
        ii, jj = torch.meshgrid(torch.arange(v), torch.arange(u), indexing="ij")
        idx = torch.stack([ii.reshape(-1), jj.reshape(-1)])
        values = P.reshape(-1).float()
    return SparseP(idx, values, mu, nu, source_ids.long(), src_hash, tgt_hash, kind=kind, normalization="convex")


def write_p(path: Path, model_dir: Path, tokenizer_dir: Path, *, v: int = 96, kind: str = "sparse", seed: int = 0,
            src_hash: str | None = None) -> Path:
    from s2t2_dist.data.tokenizers import load_tokenizer, tokenizer_hash
    from s2t2_dist.translator.pfile import save_p

    u = load_tokenizer(tokenizer_dir).vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    source_ids = torch.randperm(50280, generator=g)[:v].sort().values
    p = random_p(v, u, source_ids, src_hash or tokenizer_hash(model_dir), tokenizer_hash(tokenizer_dir), kind=kind,
                 seed=seed)
    return save_p(path, p)


# ----------------------------------------------------------------------------------------------------------------
# one prepared "world" shared by every finetune / evaluate test module (built once per session, on disk)

import pytest
class World:
    def __init__(self, root: Path):
        self.root = root
        self.model_a = root / "modelA"  # OLMo-1B config (tied), width 32
        self.model_b = root / "modelB"  # OLMo-7B config (untied), width 48: transfer target
        self.data = root / "data"
        self.tokenizer = self.data / "tokenizer"
        self.new_train = self.data / "shards" / "new" / "train"
        self.new_eval = self.data / "shards" / "new" / "eval"
        self.src_train = self.data / "shards" / "source" / "train"
        self.src_eval = self.data / "shards" / "source" / "eval"
        self.p_a = root / "P_A_sparse.safetensors"  # a P "learned" on model A

    def p_file(self, kind: str) -> Path:
        return self.root / f"P_A_{kind}.safetensors"


def build_world(root: Path) -> World:
    w = World(root)
    done = root / "done"
    if done.is_file():
        return w
    root.mkdir(parents=True, exist_ok=True)
    save_model(w.model_a, "olmo-1b", 32, seed=1)
    save_model(w.model_b, "olmo-7b", 48, seed=2)
    prepare_data(w.data, w.model_a)  # source shards tokenized with the models' (real OLMo) tokenizer
    for i, kind in enumerate(("sparse", "softmax", "unconstrained")):
        write_p(w.p_file(kind), w.model_a, w.tokenizer, kind=kind, seed=i)
    done.write_text("ok")
    return w


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    if not FASTA.is_file():
        pytest.skip(f"real protein data not found at {FASTA}")
    from tests.helpers.built_once import built_once

    # one world for the test run, shared by the xdist workers
    return World(built_once(tmp_path_factory, "ft_world", build_world))


# ----------------------------------------------------------------------------------------------------------------
# real launchers (deepspeed, torchrun) started as subprocesses

import socket
import subprocess
import sys
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")
    return env


class Launch:
    """A launcher command running in the background; `wait()` raises with its output if it failed."""

    def __init__(self, cmd: list[str], log: Path, timeout: float = 900):
        self.cmd, self.log, self.timeout = cmd, log, timeout
        self._f = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=self._f, stderr=subprocess.STDOUT)

    def wait(self) -> None:
        try:
            rc = self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "timeout"
        self._f.close()
        if rc != 0:
            raise AssertionError(f"{' '.join(self.cmd)} failed ({rc}):\n{self.log.read_text()[-6000:]}")


def deepspeed(script: str, args: list[str], log: Path, nproc: int = 2) -> Launch:
    return Launch([str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), script, *args],
                  log)


def torchrun(script: str, args: list[str], log: Path, nproc: int = 2) -> Launch:
    return Launch([str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), script,
                   *args], log)


#: loads an export with nothing but transformers (run as `python -c` from /, without this package on the path),
#: compares its logits with the trained model's (export_probe.pt) and generates from a protein prompt
EXPORT_CHECK = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, probe = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(d)
p = torch.load(probe, weights_only=True)
with torch.no_grad():
    diff = (m(input_ids=p["input_ids"]).logits - p["logits"]).abs().max().item()
enc = tok("MKTAYIAKQRQISFVKSHFSRQ", return_tensors="pt")
out = m.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
print("RESULT " + json.dumps({"diff": diff, "vocab": m.config.vocab_size, "tied": m.config.tie_word_embeddings,
      "model": type(m).__name__, "prompt_ids": enc["input_ids"][0].tolist(),
      "new_tokens": out.shape[1] - enc["input_ids"].shape[1], "text": tok.decode(out[0], skip_special_tokens=True),
      "s2t2_modules": sorted(k for k in sys.modules if k.startswith("s2t2"))}))
"""


def check_export_plain(export_dir: Path, probe: Path) -> dict:
    import json

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-c", EXPORT_CHECK, str(export_dir), str(probe)], cwd="/", env=env,
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])
