"""Session-scoped real inputs for stage tests: prepared shards from real protein FASTA and a tiny OLMo model
saved with save_pretrained (random weights from the real OLMo-1B config), so stages load them by their real
code paths (`from_pretrained`, manifests, tokenizer.json)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def protein_fasta() -> Path:
    shipped = REPO / "s2t2_dist" / "assets" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"
    if shipped.is_file():
        return shipped
    # the workplace's shared data sits next to the main checkout (a worktree may be one level deeper)
    for up in REPO.parents:
        f = up / "shared" / "data" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"
        if f.is_file():
            return f
    return REPO.parent / "shared" / "data" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"


def prepare_small(out: Path, vocab_size: int = 96, context_len: int = 64, source_tokenizer: str | None = None) -> Path:
    from s2t2_dist.data.config import DataConfig
    from s2t2_dist.data.pipeline import prepare

    cfg = DataConfig(inputs=[str(protein_fasta())], eval_fraction=0.05, vocab_size=vocab_size,
                     context_len=context_len, shard_size=64, output_dir=str(out), extra_residue_policy="keep",
                     source_tokenizer=source_tokenizer)
    prepare(cfg, progress=False)
    return out


def small_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """prepare_small's shards (vocabulary 96, context 64) and the real pretrained stories260K: the stage test modules'
    read-only inputs, built once per test run for all of them (tests/helpers/built_once.py)."""
    from tests.helpers.built_once import built_once
    from s2t2_dist.recipes.llama2c import save_hf

    def build(d: Path) -> None:
        prepare_small(d / "data")
        save_hf(d / "stories260k")

    d = built_once(tmp_path_factory, "small_inputs", build)
    return d / "data", d / "stories260k"


def tiny_olmo(out: Path, name: str = "olmo-1b", **kw) -> Path:
    from s2t2_dist.recipes.tiny import save_tiny

    kw.setdefault("n_layers", 2)
    kw.setdefault("d_model", 32)
    kw.setdefault("n_heads", 2)
    return save_tiny(out, name, **kw)


def run_cmd(args: list[str], cwd: Path = REPO, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update({"PYTHONPATH": str(REPO) + os.pathsep + e.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
              "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "S2T2_DEVICE": "cpu"})
    e.update(env or {})
    proc = subprocess.run(args, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"command failed ({proc.returncode}): {' '.join(args)}\n--- stdout\n{proc.stdout[-4000:]}"
                             f"\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


#: the default process group of a test run that has no CPU backend, as NCCL on a GPU node: a CPU collective that
#: does not go through s2t2_dist.distributed.collectives (which routes CPU tensors to a gloo group) fails here too
NCCL_LIKE = {"S2T2_DIST_BACKEND": "cuda:gloo"}


def torchrun(nproc: int, script: str, *args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                    "--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", script, *args],
                   timeout=timeout, env=env)
