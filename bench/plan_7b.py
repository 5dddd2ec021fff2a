"""The OLMo-7B memory plan, checked by the machine (no GPU needed).

1. OLMo-7B built from its real config (s2t2_dist/assets/olmo, transcribed from the hub) on the meta device:
   parameters counted, for the original vocabulary and for S2T2's target vocabulary (u = 512, untied E', L').
2. Per-rank partitions for 8 / 16 / 32 ranks:
   - FSDP2: the meta model really sharded with `fully_shard` over a fake process group of R ranks (torch's
     FakeProcessGroup: no communication), each rank's local shard sizes read from the DTensors;
   - ZeRO-3: DeepSpeed's partitioning rule (every parameter flattened and split into ceil(n / R) elements per rank,
     the last padded; parameters below stage3_param_persistence_threshold kept whole on every rank);
   - DeepSpeed's own estimators (`estimate_zero3_model_states_mem_needs`, `estimate_zero2_...`) with the offload
     settings of the shipped configs/ds_zero3.json, ds_zero3_offload.json, ds_zero2.json.
3. The host memory rank 0 needs to write the initial (translated) 7B model: the stage loads the source model in
   float32, swaps in E', L' and saves it (stages/init_model.write_initial_model). Measured here as the peak RSS of
   those three calls on a model of OLMo-7B's width with fewer blocks, divided by its float32 size, and scaled to 7B;
   for a source checkpoint stored in float32 (safetensors are memory-mapped: pages of the file, reclaimable, not
   counted as anonymous memory) and in bfloat16 (converted to float32 on load: a full float32 copy in memory).

    PYTHONPATH=. python -m bench.plan_7b [--ranks 8 16 32] [--host-layers 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9


def meta_model(vocab: int | None = None, layers: int | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    from s2t2_dist.api import real_config_dict

    d = real_config_dict("olmo-7b")
    if vocab is not None:  # the target vocabulary: the source's special ids mean nothing there
        d.update(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if layers is not None:
        d["num_hidden_layers"] = layers
    cfg = AutoConfig.for_model(**d)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg), d


def counts(model) -> dict:
    params = list({id(p): p for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    tied = head is model.get_input_embeddings().weight
    return {"params": sum(p.numel() for p in params), "tensors": len(params), "largest_module": largest,
            "embedding": emb, "head": 0 if tied else head.numel(), "tied": tied,
            "smallest_tensor": min(p.numel() for p in params)}


def fsdp2_local(world: int, vocab: int | None = None) -> dict:
    """Shard a meta OLMo-7B with fully_shard (blocks, then the root) over a fake world; rank 0's and the largest
    local element counts."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from s2t2_dist.api import transformer_blocks

    model, _ = meta_model(vocab)
    out = {}
    for rank in (0, world - 1):  # FSDP2 pads the last ranks' shards: rank 0 holds the most
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            m = model if rank == 0 else meta_model(vocab)[0]
            mesh = init_device_mesh("cpu", (world,))
            for b in transformer_blocks(m):
                fully_shard(b, mesh=mesh)
            fully_shard(m, mesh=mesh)
            out[rank] = sum(p.to_local().numel() for p in m.parameters())
        finally:
            dist.destroy_process_group()
    return {"rank0": out[0], "last_rank": out[world - 1]}


def zero3_partition(model, world: int, persistence_threshold: int) -> int:
    """Elements of rank 0's ZeRO-3 partition (DeepSpeed: ceil(numel / world) per parameter; small ones whole)."""
    n = 0
    for p in {id(p): p for p in model.parameters()}.values():
        n += p.numel() if p.numel() < persistence_threshold else math.ceil(p.numel() / world)
    return n


def ds_estimates(c: dict, world: int, per_node: int = 8) -> dict:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    nodes = max(world // per_node, 1)
    gpn = min(world, per_node)
    out = {}
    for name in ("ds_zero3.json", "ds_zero3_offload.json", "ds_zero2.json"):
        zc = json.loads((REPO / "configs" / name).read_text())["zero_optimization"]
        off_opt = (zc.get("offload_optimizer") or {}).get("device") == "cpu"
        off_par = (zc.get("offload_param") or {}).get("device") == "cpu"
        if zc["stage"] == 3:
            cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
                c["params"], c["largest_module"], num_gpus_per_node=gpn, num_nodes=nodes, cpu_offload=off_opt,
                cpu_offload_params=off_par, zero_init=True)
        else:
            cpu, gpu = estimate_zero2_model_states_mem_needs(c["params"], num_gpus_per_node=gpn, num_nodes=nodes,
                                                             cpu_offload=off_opt)
        out[name] = {"gpu_gb_per_rank": gpu / GB, "cpu_gb_per_node": cpu / GB}
    return out


MAKE_SOURCE = r"""
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from s2t2_dist.api import real_config_dict
d = real_config_dict("olmo-7b"); d["num_hidden_layers"] = int(sys.argv[1])
dt = getattr(torch, sys.argv[3])
AutoModelForCausalLM.from_config(AutoConfig.for_model(**d), dtype=dt).save_pretrained(sys.argv[2])
"""

# a fresh process (ru_maxrss is a high-water mark): what write_initial_model does on rank 0
WRITE_INITIAL = r"""
import json, resource, sys, time, torch
from transformers import AutoModelForCausalLM
from s2t2_dist.api import materialize
src, out, u = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # interpreter, torch, transformers
t = time.time()
m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
src_bytes = sum(p.numel() for p in m.parameters()) * 4
dm = m.config.hidden_size
m = materialize(m, torch.randn(u, dm), torch.randn(u, dm), inplace=True, dtype=torch.float32)
m.save_pretrained(out, safe_serialization=True)
print(json.dumps({"src_bytes": src_bytes, "seconds": time.time() - t, "base_rss": base,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def host_plan(layers: int, u: int, full: dict, full_out: dict, src_dtype: str = "float32") -> dict:
    """Peak RSS of load + materialize + save on an OLMo-7B-width model with `layers` blocks, scaled to 7B: the
    process's fixed part (interpreter and libraries) plus (peak - fixed) / model bytes x the 7B model's bytes."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="plan7b_") as work:
        subprocess.run([sys.executable, "-c", MAKE_SOURCE, str(layers), work + "/src", src_dtype], env=env,
                       check=True, capture_output=True)
        r = subprocess.run([sys.executable, "-c", WRITE_INITIAL, work + "/src", work + "/out", str(u)],
                           capture_output=True, text=True, env=env, check=True)
    m = json.loads(r.stdout.strip().splitlines()[-1])
    ratio = (m["peak_rss"] - m["base_rss"]) / m["src_bytes"]
    return {"source_dtype_on_disk": src_dtype, "measured_layers": layers, "measured_src_gb": m["src_bytes"] / GB, "measured_peak_rss_gb":
            m["peak_rss"] / GB, "fixed_rss_gb": m["base_rss"] / GB, "peak_over_fp32_model": ratio,
            "seconds": m["seconds"], "olmo7b_src_fp32_gb": full["params"] * 4 / GB,
            "olmo7b_out_fp32_gb": full_out["params"] * 4 / GB,
            "olmo7b_peak_rss_gb_est": m["base_rss"] / GB + ratio * full["params"] * 4 / GB}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--u", type=int, default=512, help="S2T2 target vocabulary")
    ap.add_argument("--host-layers", type=int, default=1, help="blocks of the host-memory model (0: skip)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    t0 = time.time()
    orig, cfgd = meta_model()
    trans, _ = meta_model(vocab=a.u)
    c_orig, c_trans = counts(orig), counts(trans)
    thr = 10 * cfgd["hidden_size"]  # ds "auto" stage3_param_persistence_threshold (engines/deepspeed_engine.py)
    res = {"config": {k: cfgd[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "intermediate_size", "vocab_size", "tie_word_embeddings")},
           "params": {"original_vocab": c_orig, f"u{a.u}": c_trans}, "ranks": {}}
    print(f"OLMo-7B (real config, meta device): {c_orig['params'] / 1e9:.4f} B parameters "
          f"({c_orig['tensors']} tensors, tied={c_orig['tied']}); with u={a.u}: {c_trans['params'] / 1e9:.4f} B; "
          f"largest module {c_orig['largest_module'] / 1e6:.1f} M; smallest tensor {c_orig['smallest_tensor']}")
    print("ranks | vocab | FSDP2 rank-0 shard (M) | ZeRO-3 rank-0 partition (M) | Psi/R (M) | "
          "16 B/param states GB | ds_zero3 GPU GB/rank | ds_zero3_offload GPU GB/rank, CPU GB/node | ds_zero2 GPU GB/rank")
    for R in a.ranks:
        row = {}
        for name, model, c, vocab in (("original", orig, c_orig, None), (f"u{a.u}", trans, c_trans, a.u)):
            fs = fsdp2_local(R, vocab)
            z3 = zero3_partition(model, R, thr)
            est = ds_estimates(c, R)
            row[name] = {"fsdp2": fs, "zero3_partition": z3, "psi_over_r": c["params"] / R,
                         "states_gb_16B": 16 * z3 / GB, "ds": est}
            print(f"{R:5d} | {name:8s} | {fs['rank0'] / 1e6:10.2f} (last {fs['last_rank'] / 1e6:.2f}) | "
                  f"{z3 / 1e6:10.2f} | {c['params'] / R / 1e6:9.2f} | {16 * z3 / GB:6.2f} | "
                  f"{est['ds_zero3.json']['gpu_gb_per_rank']:6.2f} | "
                  f"{est['ds_zero3_offload.json']['gpu_gb_per_rank']:5.2f}, "
                  f"{est['ds_zero3_offload.json']['cpu_gb_per_node']:6.1f} | "
                  f"{est['ds_zero2.json']['gpu_gb_per_rank']:6.2f}")
        res["ranks"][R] = row
    for src_dtype in ("float32", "bfloat16") if a.host_layers else ():
        hp = host_plan(a.host_layers, a.u, c_orig, c_trans, src_dtype)
        res[f"host_write_initial_model_{src_dtype}"] = hp
        print(f"writing the initial model (rank 0, host), source stored in {src_dtype}: measured peak RSS {hp['measured_peak_rss_gb']:.2f} GB for a "
              f"{hp['measured_src_gb']:.2f} GB float32 model ({hp['measured_layers']} block(s) at 7B width): "
              f"{hp['fixed_rss_gb']:.2f} GB fixed + {hp['peak_over_fp32_model']:.2f} x the model; OLMo-7B: source {hp['olmo7b_src_fp32_gb']:.1f} GB float32 -> "
              f"~{hp['olmo7b_peak_rss_gb_est']:.1f} GB peak host memory on rank 0; output "
              f"{hp['olmo7b_out_fp32_gb']:.1f} GB on disk ({hp['seconds']:.1f} s for the measured model)")
    print(f"({time.time() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
