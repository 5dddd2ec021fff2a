"""GPU smoke kit: the whole pipeline once, through the real launchers, on every GPU of this node (or on CPU).

    PYTHONPATH=. python -m bench.gpu_smoke                  # all GPUs, NCCL, bf16; on a CPU-only machine: 2 gloo ranks
    PYTHONPATH=. python -m bench.gpu_smoke --ranks 2 --steps 4 --out /tmp/smoke

On a small model built from a REAL config (OLMo-1B's architecture, tokenizer and 50,304-row vocabulary; depth and
width shrunk, `--layers/--width` to grow it), on the shipped protein sample:
  1. translate   stage 1, torchrun on R ranks, C sharded by columns over the ranks (NCCL all-to-all / gathers);
  2. finetune    stage 2 from stage 1's P under ZeRO-3 (configs/ds_zero3.json, DeepSpeed launched by torchrun);
  3. finetune    the same under FSDP2 (engine.kind=fsdp);
  4. evaluate    the FSDP2 export, R ranks in lockstep.
Every stage runs with the default process group `cpu:gloo,cuda:nccl` (gloo on a CPU), bf16 on GPUs (float32 on a
CPU unless --precision bf16). Prints, per stage: seconds per step, tokens/s, peak GPU memory (CPU RSS on a CPU),
and the model FLOPs utilisation (MFU: 6 N FLOP per token for training, 4 N for stage 1 (no weight gradients; the
Sinkhorn not counted), N the transformer's parameters without embeddings, over the GPUs' dense bf16 peak).
Writes OUT/smoke.json. Exit status 0 only if every stage finished with finite losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: dense bf16 peak FLOP/s of one GPU (vendor datasheets, without sparsity), matched against the device name
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "L4": 121e12,
             "V100": 125e12}


def peak_flops() -> tuple[float | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "cpu"
    name = torch.cuda.get_device_name(0)
    for k, v in PEAK_BF16.items():
        if k in name:
            return v, name
    return None, name


def non_embedding_params(model_dir: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM
    import torch

    cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(cfg)
    emb = {id(m.get_input_embeddings().weight), id(m.get_output_embeddings().weight)}
    return sum(p.numel() for p in m.parameters() if id(p) not in emb)


def stage_stats(run_dir: Path) -> dict:
    from s2t2_dist.api import tb_scalars

    tb = run_dir / "tb"
    out = {}
    for key, tag, where in (("tokens_per_s", "train/tokens_per_s", "global"),
                            ("step_time_s", "node/step_time_s", "node_000"),
                            ("gpu_mem_max_gib", "node/gpu_mem_max_gib", "node_000"),
                            ("cpu_rss_max_gib", "node/cpu_rss_max_gib", "node_000")):
        vals = tb_scalars(tb / where, tag) if (tb / where).is_dir() else []
        if vals:
            # the first logging interval includes start-up and compilation: report the later ones when there are
            vals = vals[1:] if len(vals) > 1 and key in ("tokens_per_s", "step_time_s") else vals
            out[key] = (max(v for _, v in vals) if "mem" in key or "rss" in key
                        else sum(v for _, v in vals) / len(vals))
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    gpus = torch.cuda.device_count()
    ap.add_argument("--ranks", type=int, default=gpus or 2, help="ranks (default: every GPU; 2 on a CPU)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=128, help="target (protein BPE) vocabulary u")
    ap.add_argument("--source-vocab", default=None,
                    help="source tokens of P (default: all 50,280 on GPUs, single_byte (243) on a CPU)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=None, help="default: bf16 on GPUs, fp32 on CPU")
    ap.add_argument("--out", default="/tmp/s2t2_gpu_smoke")
    ap.add_argument("--sync-debug", choices=["error", "warn", "off"], default="error",
                    help="torch.cuda.set_sync_debug_mode for stage 1's non-logging steps (CUDA only)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)

    from s2t2_dist.api import save_tiny
    from s2t2_dist.api import Runner, prepare_protein

    on_gpu = gpus > 0
    precision = a.precision or ("bf16" if on_gpu else "fp32")
    source_vocab = a.source_vocab or ("all" if on_gpu else "single_byte")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    peak, device = peak_flops()
    R = a.ranks
    print(f"GPU smoke: {R} rank(s) on {device if on_gpu else 'CPU (gloo)'} x {min(gpus, R) if on_gpu else 0} GPU(s), "
          f"precision {precision}, {a.steps} steps per stage -> {out}", flush=True)

    t0 = time.time()
    data = out / "data"
    prepare_protein(data, vocab_size=a.vocab_size, context_len=a.context_len, progress=False)
    model = out / "model"
    if not (model / "config.json").is_file():
        save_tiny(model, "olmo-1b", n_layers=a.layers, d_model=a.width, n_heads=a.heads)
    n_params = non_embedding_params(model)

    batch = a.micro_batch * R
    common = [f"data.train={data}/shards/new/train", f"data.eval={data}/shards/new/eval",
              f"data.tokenizer={data}/tokenizer", "data.num_workers=0", f"train.steps={a.steps}",
              f"train.batch_size={batch}", f"train.micro_batch_size={a.micro_batch}",
              f"train.context_len={a.context_len}", "train.log_every=2", "train.ckpt_every=0", "train.eval_every=0",
              "train.eval_max_docs=16", f"train.precision={precision}"]
    runner = Runner(ranks=R, log_dir=out / "logs", in_process=False, echo=not a.quiet)
    runs = out / "runs"
    report: dict = {"ranks": R, "device": device, "precision": precision, "non_embedding_params": n_params,
                    "stages": {}}
    failures = []

    def record(name: str, run, flop_per_token: float | None) -> None:
        st = stage_stats(run.run_dir)
        res = run.result
        losses = [l for _, l in res.get("losses", [])] or ([res["final_loss"]] if res.get("final_loss") else [])
        st["final_loss"] = res.get("final_loss")
        st["seconds"] = round(run.seconds, 1)
        if flop_per_token and st.get("tokens_per_s") and peak:
            st["mfu"] = st["tokens_per_s"] * flop_per_token / (peak * min(R, gpus))
        if losses and not all(math.isfinite(x) for x in losses):
            failures.append(f"{name}: non-finite loss {losses}")
        report["stages"][name] = st
        mem = (f"{st['gpu_mem_max_gib']:.2f} GiB GPU" if "gpu_mem_max_gib" in st
               else f"{st.get('cpu_rss_max_gib', float('nan')):.2f} GiB RSS")
        mfu = f"{100 * st['mfu']:.1f} %" if "mfu" in st else "n/a"
        print(f"  {name:18s} {st.get('step_time_s', float('nan')):.3f} s/step  "
              f"{st.get('tokens_per_s', float('nan')):10.0f} tok/s  {mem}  MFU {mfu}  "
              f"final loss {st['final_loss']}  ({st['seconds']} s)", flush=True)

    # stage 1's steps that neither log nor checkpoint must not synchronise with the GPU: on CUDA they run under
    # torch.cuda.set_sync_debug_mode (the loop reads S2T2_SYNC_DEBUG; on a CPU nothing changes)
    from s2t2_dist.api import SYNC_DEBUG_ENV

    if a.sync_debug != "off":
        os.environ[SYNC_DEBUG_ENV] = a.sync_debug
    report["sync_debug"] = a.sync_debug if on_gpu else "n/a (CPU)"
    try:
        tr = runner.run("translate", ["--config", str(REPO / "configs" / "translate_olmo1b.yaml"), *common,
                                      f"run_dir={runs / 'translate'}", f"model.path={model}",
                                      f"model.source_vocab={source_vocab}", "translator.heatmap=[32,16]"],
                        runs / "translate", "translate")
    finally:
        os.environ.pop(SYNC_DEBUG_ENV, None)
    record("translate", tr, 4 * n_params)
    from s2t2_dist.api import fallbacks, text

    report["routes"] = tr.result.get("routes") or {}
    print(f"  routes: {text(report['routes'])}", flush=True)
    failures += [f"translate: {f}" for f in fallbacks(report["routes"])]
    p_file = tr.result["p_file"]
    ft_common = [*common, f"model.path={model}", f"init.p_file={p_file}", "optim.lr=1e-3"]
    # the two finetunes are independent: run side by side (their start-up dominates at smoke sizes); on GPUs
    # one after the other, each with all the GPUs
    jobs = {"zero3": (["--ds_config", str(REPO / "configs" / "ds_zero3.json"), *ft_common,
                       f"run_dir={runs / 'zero3'}", f"export.dir={out / 'export_zero3'}"], "finetune_zero3"),
            "fsdp": ([*ft_common, "engine.kind=fsdp", f"run_dir={runs / 'fsdp'}", f"export.dir={out / 'export_fsdp'}"],
                     "finetune_fsdp")}
    done: dict = {}

    def go(key: str) -> None:
        argv, name = jobs[key]
        try:
            done[key] = Runner(ranks=R, log_dir=out / "logs", in_process=False, echo=not a.quiet).run(
                "finetune", argv, runs / key, name)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            done[key] = e

    if on_gpu:
        for key in jobs:
            go(key)
    else:
        threads = [threading.Thread(target=go, args=(k,)) for k in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for key in jobs:
        if isinstance(done[key], BaseException):
            raise done[key]
    z3, fs = done["zero3"], done["fsdp"]
    record("finetune ZeRO-3", z3, 6 * n_params)
    record("finetune FSDP2", fs, 6 * n_params)
    ev = runner.run("evaluate", [f"run_dir={runs / 'evaluate'}", f"model.path={fs.result['export']}",
                                 f"data.eval={data}/shards/new/eval", f"data.tokenizer={data}/tokenizer",
                                 "init.kind=as_is", f"eval.context_len={a.context_len}", "eval.max_docs=16",
                                 f"eval.precision={precision}"], runs / "evaluate", "evaluate")
    m = ev.result["metrics"]
    report["stages"]["evaluate"] = {"bpb": m["bpb"], "perplexity": m["perplexity"], "seconds": round(ev.seconds, 1)}
    print(f"  {'evaluate':18s} BpB {m['bpb']:.3f}  perplexity {m['perplexity']:.1f}  ({ev.seconds:.1f} s)")
    if not math.isfinite(m["bpb"]):
        failures.append(f"evaluate: BpB {m['bpb']}")
    report["seconds"] = round(time.time() - t0, 1)
    report["failures"] = failures
    (out / "smoke.json").write_text(json.dumps(report, indent=1))
    print(f"{'FAILED: ' + '; '.join(failures) if failures else 'OK'} in {report['seconds']} s; {out / 'smoke.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
