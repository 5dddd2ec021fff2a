"""A bare Hugging Face forward + backward to the input embeddings (frozen weights, as stage 1; bf16 autocast on a GPU)
of a model directory at batch B x T: tokens/s. The reference for stage 1's tokens/s in the same run
(bench/gpu_check.sh).

    PYTHONPATH=. python -m bench.bare_step MODEL_DIR 16 512 OUT.json [--micro 8]
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("B", type=int)
    ap.add_argument("T", type=int)
    ap.add_argument("out")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch (the shipped config's at 16 x 512: 8)")
    ap.add_argument("--reps", type=int, default=8)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    m = m.to(dev).requires_grad_(False)
    E, L, body = m.get_input_embeddings().weight, m.get_output_embeddings().weight, m.base_model
    n = sum(p.numel() for p in m.parameters()) - E.numel() - (0 if L is E else L.numel())
    ids = torch.randint(0, E.shape[0], (a.B, a.T), device=dev)

    def step():
        for i in range(0, a.B, a.micro):
            x = ids[i:i + a.micro]
            e = E[x].detach().float().requires_grad_(True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                logits = body(inputs_embeds=e, use_cache=False).last_hidden_state @ L.T
            F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)).backward()

    def timed():
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    for _ in range(2):
        timed()
    ts = sorted(timed() for _ in range(a.reps))
    res = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "B": a.B, "T": a.T,
           "micro": a.micro, "non_embedding_params": n, "step_s_median": ts[len(ts) // 2], "step_s_min": ts[0],
           "tokens_per_s": a.B * a.T / ts[len(ts) // 2], "torch": torch.__version__}
    if dev.type == "cuda":
        res["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(res), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
