"""Engine benchmarks on CPU (gloo), through the real launchers and the project's training loop.

    PYTHONPATH=. python -m bench.bench_engines                      # everything, writes bench/results_engines.json
    PYTHONPATH=. python -m bench.bench_engines --part memory --ranks 1 2 4
    PYTHONPATH=. python -m bench.bench_engines --part throughput --steps 12

1. memory: per-rank model-state memory under ZeRO-3 (configs/ds_zero3.json) with 1, 2, 4 ranks: the elements each
   rank holds (parameters, gradients, fp32 master copy, Adam m and v), counted from the tensors, and the process
   memory (RSS) growth from before the model is built to the end of training.
2. throughput: the same model, batch and data under FSDP2 (torchrun) and ZeRO-3 (deepspeed launcher), 2 ranks,
   median step time after warm-up.

The models are OLMo-shaped (non-parametric layer norm, SwiGLU, tied embeddings like OLMo-1B) with the real OLMo
embedding rows (50304) and small widths. One torch thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from s2t2_dist.api import Task

ROOT = Path(__file__).resolve().parents[1]

#: (width, layers): OLMo proportions (MLP = 2.6875 x width as in OLMo-1B/7B: 8192/2048 ~ 11008/4096), 64-wide heads
MEM_MODEL = (768, 8)  # ~96M parameters: model states dominate the process memory
TP_MODEL = (256, 4)  # ~16M parameters: quick steps on a small CPU


def model_spec(width: int, layers: int) -> dict:
    return dict(vocab_size=50304, hidden_size=width, intermediate_size=int(width * 2.6875) // 16 * 16,
                num_hidden_layers=layers, num_attention_heads=max(width // 64, 1))


def _rss_mib() -> float:
    """Resident memory now, after giving freed heap pages back to the system (so it is a steady-state figure)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _olmo_config(width: int, layers: int):
    from transformers import OlmoConfig

    return OlmoConfig(**model_spec(width, layers), max_position_embeddings=512, tie_word_embeddings=True, pad_token_id=1, eos_token_id=0,
                      bos_token_id=None)


class _Loader:
    def __init__(self, vocab, seq, micro, rank, world, n=256):
        import torch

        g = torch.Generator().manual_seed(7)
        pool = torch.randint(2, vocab, (n, seq), generator=g)[rank::world]
        self.b = [pool[i:i + micro] for i in range(0, len(pool) - micro + 1, micro)]
        self.pos = 0

    def __iter__(self):
        while self.pos < len(self.b):
            self.pos += 1
            yield {"input_ids": self.b[self.pos - 1]}
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


class _Task(Task):
    def __init__(self, engine):
        self.engine = engine

    def loss(self, batch):
        ids = batch["input_ids"]
        return self.engine.module(input_ids=ids, labels=ids).loss, {}

    def report(self, step, logger):
        return {}

    def evaluate(self):
        return {}


def _state_elements_ds(engine) -> dict:
    """Elements this rank holds in each kind of model state under DeepSpeed ZeRO-3."""
    opt = engine.optimizer  # DeepSpeedZeroOptimizer_Stage3
    params = sum(p.ds_tensor.numel() for p in engine.model.parameters())
    master = sum(t.numel() for t in opt.fp32_partitioned_groups_flat)
    adam = sum(v.numel() for st in opt.optimizer.state.values() for v in st.values() if hasattr(v, "numel") and v.dim() > 0)
    buf = getattr(opt, "grad_partitions_flat_buffer", None)
    grads = buf.numel() if buf is not None else master
    return {"params": params, "grads": grads, "fp32_master": master, "adam_m_v": adam}


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    from s2t2_dist.api import Checkpointer
    from s2t2_dist.api import OptimConfig, TrainConfig
    from s2t2_dist.api import train
    from s2t2_dist.api import MetricsLogger

    if args.worker == "deepspeed":
        from s2t2_dist.api import init_deepspeed_distributed

        denv = init_deepspeed_distributed()
    else:
        from s2t2_dist.api import init_distributed

        denv = init_distributed()
    rank, world = denv.rank, denv.world_size
    tcfg = TrainConfig(steps=args.steps, batch_size=args.batch, micro_batch_size=args.micro, context_len=args.seq,
                       log_every=10**6, ckpt_every=0)
    ocfg = OptimConfig(lr=1e-3, weight_decay=0.01)
    hf = _olmo_config(args.width, args.layers)
    rss0 = _rss_mib()
    if args.worker == "deepspeed":
        from s2t2_dist.api import DeepSpeedEngine, build_model_zero3, partitioned_numel, resolve_ds_config

        ds_cfg = resolve_ds_config(ROOT / "configs" / "ds_zero3.json", train_cfg=tcfg, optim_cfg=ocfg, world_size=world,
                                   hidden_size=hf.hidden_size)
        model = build_model_zero3(hf, ds_cfg, seed=0)
        engine = DeepSpeedEngine.build(model, optim_cfg=ocfg, train_cfg=tcfg, ds_config=ds_cfg, resolved=True)
        local, total = partitioned_numel(engine.model)
    else:
        from transformers import OlmoForCausalLM

        from s2t2_dist.api import FSDP2Engine
        from s2t2_dist.api import local_numel

        torch.manual_seed(0)
        model = OlmoForCausalLM(hf)
        engine = FSDP2Engine.build(model, ocfg, tcfg)
        local, total = local_numel(engine.model)
    rss_built = _rss_mib()
    stamps = []
    run_dir = Path(args.out) / f"run_{args.worker}_{world}"
    res = train(tcfg, _Task(engine), engine, _Loader(hf.vocab_size, args.seq, args.micro, rank, world),
                Checkpointer(run_dir), MetricsLogger(run_dir, rank, 0, denv.local_rank, enabled=False), progress=False,
                on_step=lambda s, l: stamps.append(time.perf_counter()))
    rss_end = _rss_mib()
    dts = [b - a for a, b in zip(stamps, stamps[1:])][2:]  # the first steps warm up allocators and caches
    out = {"engine": args.worker, "rank": rank, "world": world, "local_param_elements": local,
           "total_param_elements": total, "rss_before_model_mib": rss0, "rss_after_build_mib": rss_built,
           "rss_end_mib": rss_end, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "step_times_s": dts, "tokens_per_step": args.batch * args.seq,
           "final_loss": res.losses[-1][1]}
    if args.worker == "deepspeed":
        out["state_elements"] = _state_elements_ds(engine)
    (Path(args.out) / f"{args.worker}_{world}_rank{rank}.json").write_text(json.dumps(out))
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(kind: str, world: int, out: Path, steps: int, batch: int, micro: int, seq: int,
            model: tuple[int, int]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    bindir = Path(sys.executable).parent
    args = [str(Path(__file__).resolve()), "--worker", kind, "--out", str(out), "--steps", str(steps),
            "--batch", str(batch), "--micro", str(micro), "--seq", str(seq), "--width", str(model[0]),
            "--layers", str(model[1])]
    if kind == "deepspeed":
        cmd = [str(bindir / "deepspeed"), "--num_gpus", str(world), "--master_port", str(_port()), *args]
    else:
        cmd = [str(bindir / "torchrun"), "--nproc_per_node", str(world), "--master_port", str(_port()), *args]
    shutil.rmtree(out / f"run_{kind}_{world}", ignore_errors=True)  # a fresh run each time, never a resume
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-5000:]}")
    wall = time.perf_counter() - t0
    rs = [json.loads((out / f"{kind}_{world}_rank{r}.json").read_text()) for r in range(world)]
    for r in rs:
        r["launch_wall_s"] = wall
        r["loadavg_1min_after"] = os.getloadavg()[0]
    return rs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=["deepspeed", "fsdp"])
    ap.add_argument("--local_rank", type=int, default=None)  # appended by the deepspeed launcher
    ap.add_argument("--part", choices=["memory", "throughput", "all"], default="all")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--micro", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--width", type=int, default=TP_MODEL[0])
    ap.add_argument("--layers", type=int, default=TP_MODEL[1])
    ap.add_argument("--mem_model", type=int, nargs=2, default=list(MEM_MODEL), metavar=("WIDTH", "LAYERS"))
    ap.add_argument("--tp_model", type=int, nargs=2, default=list(TP_MODEL), metavar=("WIDTH", "LAYERS"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out_engines"))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"memory_model": model_spec(*args.mem_model), "throughput_model": model_spec(*args.tp_model),
              "torch_threads_per_rank": 1, "cpu_cores": os.cpu_count(), "loadavg_1min_at_start": os.getloadavg()[0],
              "memory": [], "throughput": []}
    print(f"cpu cores {os.cpu_count()}, 1-min load average at start {os.getloadavg()[0]:.1f}")

    if args.part in ("memory", "all"):
        print(f"ZeRO-3 per-rank memory (configs/ds_zero3.json), model {model_spec(*args.mem_model)}; "
              "model states counted from the tensors at 4 bytes/element; RSS growth = resident memory after 3 "
              "steps minus before the model was built (mean over ranks)")
        print("| ranks | params/rank | of total | params+grads+master+m+v per rank (MiB) | RSS growth per rank (MiB) | peak RSS per rank (MiB) |")
        print("|---|---|---|---|---|---|")
        for w in args.ranks:
            rs = _launch("deepspeed", w, out, steps=3, batch=args.batch, micro=args.micro, seq=64, model=args.mem_model)
            r0 = rs[0]
            se = r0["state_elements"]
            states_mib = 4 * (se["params"] + se["grads"] + se["fp32_master"] + se["adam_m_v"]) / 2**20
            row = {"ranks": w, "local_param_elements": [r["local_param_elements"] for r in rs],
                   "total_param_elements": r0["total_param_elements"], "state_elements_rank0": se,
                   "model_states_mib_rank0": states_mib,
                   "rss_growth_mib": [r["rss_end_mib"] - r["rss_before_model_mib"] for r in rs],
                   "peak_rss_mib": [r["peak_rss_mib"] for r in rs]}
            report["memory"].append(row)
            print(f"| {w} | {r0['local_param_elements']:,} | {r0['local_param_elements'] / r0['total_param_elements']:.3f} "
                  f"| {states_mib:.1f} | {statistics.mean(row['rss_growth_mib']):.0f} "
                  f"| {statistics.mean(row['peak_rss_mib']):.0f} |", flush=True)

    if args.part in ("throughput", "all"):
        print(f"\nFSDP2 vs ZeRO-3, 2 ranks, model {model_spec(*args.tp_model)}, batch {args.batch} x {args.seq} tokens, "
              f"micro {args.micro}, {args.steps} steps (median step time after 2 warm-up steps), alternating runs")
        print("| engine | launcher | median step (s) | min..max (s) | tokens/s (global) | launch wall (s) | final loss | load avg after |")
        print("|---|---|---|---|---|---|---|---|")
        for kind, launcher in (("fsdp", "torchrun"), ("deepspeed", "deepspeed"), ("fsdp", "torchrun"),
                               ("deepspeed", "deepspeed")):
            rs = _launch(kind, 2, out, steps=args.steps, batch=args.batch, micro=args.micro, seq=args.seq,
                         model=args.tp_model)
            dts = rs[0]["step_times_s"]
            med = statistics.median(dts)
            row = {"engine": kind, "ranks": 2, "median_step_s": med, "step_times_s": dts,
                   "tokens_per_s": rs[0]["tokens_per_step"] / med, "launch_wall_s": rs[0]["launch_wall_s"],
                   "final_loss": rs[0]["final_loss"]}
            report["throughput"].append(row)
            print(f"| {'ZeRO-3' if kind == 'deepspeed' else 'FSDP2'} | {launcher} | {med:.3f} | {min(dts):.3f}..{max(dts):.3f} "
                  f"| {row['tokens_per_s']:.0f} | {row['launch_wall_s']:.1f} | {row['final_loss']:.4f} "
                  f"| {rs[0]['loadavg_1min_after']:.1f} |", flush=True)
    (out / "results_engines.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'results_engines.json'}")


if __name__ == "__main__":
    main()
