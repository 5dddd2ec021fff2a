"""Finetune throughput and start-up of both engines through the real launcher, in one JSON (the items F
and Z of the shared GPU check, made the project's own):

    PYTHONPATH=. python -m bench.bench_finetune_gpu --out OUT            # on a GPU: full OLMo-1B, 16 x 512, 20 steps
    PYTHONPATH=. python -m bench.bench_finetune_gpu --out OUT --layers 2 --d-model 64 --heads 4 --batch 2 \\
        --context-len 64 --steps 3 --data-vocab 128                         # the same path on a CPU, tiny

It builds the OLMo-1B architecture (shipped config, random weights, seed 0; depth and width as given) once into
--cache, prepares protein shards with its (OLMo) tokenizer, then runs for each engine

    torchrun --nproc_per_node N launch/finetune.py --config configs/finetune_olmo1b.yaml init.kind=orig_tok ...
        engine.kind=fsdp                         (FSDP2)
        --ds_config configs/ds_zero3.json        (DeepSpeed ZeRO-3)

and collects from each run: tokens/s and step time (the logging intervals after the first, which holds start-up),
MFU (the loop's train/mfu: 6 N + 12 L d T FLOPs per token against the GPU's bf16 peak), peak GPU memory, the step's
split (data, forward, backward, optimiser), the start-up phases (result.json) and the seconds from launch to the
first step's end. Prints and writes OUT/finetune_gpu.json. Each engine is capped by --timeout seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FASTA = ROOT / "s2t2_dist/assets/protein/mmseqs2_QUERY_uniprotkb.fasta"
ENGINES = {"fsdp": ["engine.kind=fsdp", "engine.ds_config="],
           "zero3": ["--ds_config", "configs/ds_zero3.json"],
           # the reference for the chunked loss (engine.loss_chunk_tokens, on in the two above): transformers' loss
           # over the full logits, same engine, same run
           "fsdp_full_logits": ["engine.kind=fsdp", "engine.ds_config=", "engine.loss_chunk_tokens=0"]}
SPLIT = ("data", "forward", "backward", "optimizer")


def build_model(cache: Path, layers: int, d: int, heads: int) -> Path:
    """The OLMo-1B architecture at this depth and width, random weights, saved once (rehearsal.build_model)."""
    from bench.rehearsal import build_model as build

    return build(cache, layers, d, heads)[0]


def prepare(data: Path, model: Path, context_len: int, vocab: int) -> Path:
    if (data / "shards" / "source" / "train").is_dir():
        return data
    cmd = [sys.executable, "-m", "s2t2_dist.cli", "prepare", "--no-progress", f"inputs=[{FASTA}]", "format=fasta",
           "domain=protein", "eval_fraction=0.05", f"vocab_size={vocab}", f"context_len={context_len}",
           "shard_size=256", "num_workers=0", f"source_tokenizer={model}", f"output_dir={data}"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL)
    return data


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def scalars(run_dir: Path, where: str, tag: str) -> list[tuple[int, float]]:
    from s2t2_dist.api import tb_scalars

    d = run_dir / "tb" / where
    return tb_scalars(d, tag) if d.is_dir() else []


def later_mean(vals: list[tuple[int, float]]) -> float | None:
    """Mean over the logging intervals after the first (which holds start-up and any compile)."""
    vals = vals[1:] if len(vals) > 1 else vals
    return sum(v for _, v in vals) / len(vals) if vals else None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(name: str, a, model: Path, data: Path, out: Path) -> dict:
    run_dir = out / name
    args = ["--config", "configs/finetune_olmo1b.yaml", *ENGINES[name], f"model.path={model}",
            f"data.train={data}/shards/source/train", f"data.eval={data}/shards/source/eval", f"data.tokenizer={model}",
            "init.kind=orig_tok", "init.p_file=", "data.num_workers=2", f"train.steps={a.steps}",
            f"train.batch_size={a.batch}", f"train.context_len={a.context_len}", f"train.log_every={a.log_every}",
            "train.ckpt_every=0", "train.eval_every=0", "train.eval_max_docs=8", "export.dtype=bfloat16",
            f"run_dir={run_dir}", *a.extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port",
           str(free_port()), "launch/finetune.py", *args]
    t0 = time.time()
    log = out / f"{name}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=f, stderr=subprocess.STDOUT,
                                timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    res = {"rc": rc, "wall_s": round(time.time() - t0, 1), "log": str(log)}
    result = run_dir / "result.json"
    if result.is_file():
        r = json.loads(result.read_text())
        res.update(final_loss=r.get("final_loss"), startup=r.get("startup"))
    res["tokens_per_s"] = later_mean(scalars(run_dir, "global", "train/tokens_per_s"))
    res["mfu"] = later_mean(scalars(run_dir, "global", "train/mfu"))
    res["step_time_s"] = later_mean(scalars(run_dir, "node_000", "node/step_time_s"))
    mem = scalars(run_dir, "node_000", "node/gpu_mem_max_gib")
    res["gpu_mem_max_gib"] = max((v for _, v in mem), default=None)
    res["split_s"] = {k: later_mean(scalars(run_dir, "node_000", f"node/split_{k}_s")) for k in SPLIT}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache", default=None, help="model directories (default OUT/cache)")
    ap.add_argument("--engines", default="fsdp,zero3", help="comma list of " + ", ".join(ENGINES))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--data-vocab", type=int, default=512, help="the protein BPE `s2t2 prepare` also trains")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine")
    ap.add_argument("extra", nargs="*", help="more finetune overrides, e.g. engine.compile=true")
    a = ap.parse_args(argv)
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = build_model(Path(a.cache or out / "cache").resolve(), a.layers, a.d_model, a.heads)
    data = prepare(out / f"data_{a.context_len}", model, a.context_len, a.data_vocab)
    report = {"model": str(model), "layers": a.layers, "d_model": a.d_model, "batch": a.batch,
              "context_len": a.context_len, "steps": a.steps, "nproc": a.nproc, "prepare_s": round(time.time() - t0, 1)}
    try:
        import torch

        report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        report["torch"] = torch.__version__
    except ImportError:
        pass
    for name in a.engines.split(","):
        report[name] = run_engine(name, a, model, data, out)
        print(name, json.dumps(report[name]), flush=True)
    (out / "finetune_gpu.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    ok = all(report[n]["rc"] == 0 for n in a.engines.split(","))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
