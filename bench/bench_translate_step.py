"""The translator's share of a stage-1 optimiser step, measured in the same process on the same step.

A stage-1 step runs the translator ONCE (TokenTranslator.begin_step: Sinkhorn, E', L'; finish_step: one backward
into C) and the frozen LM once per micro-batch (forward + backward to E', L'). Both are timed here as the stage runs
them, nothing scaled: the translator's seconds per step against the LM's seconds per step (micro-batches x tokens).

    PYTHONPATH=. python -m bench.bench_translate_step --v 243,50280 --layers 1,4      # OLMo-1B width, random weights
    PYTHONPATH=. python -m bench.bench_translate_step --model /path/to/olmo-1b --v 50280 --micro-batches 1
    ... --json out.json   (one record per (v, model): reusable by other benchmarks)

``--model``: a Hugging Face model directory (e.g. the full-size rehearsal's OLMo-1B); otherwise OLMo-1B's config
(d 2048, 16 heads, MLP 8192, 50,304 rows) with ``--layers`` layers. The target vocabulary is ``--u`` tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def measure(model, v: int, u: int, kind: str, micro_batches: int, batch: int, T: int, repeat: int,
            moved: bool) -> dict:
    from s2t2_dist.api import TranslatedLM
    from s2t2_dist.api import TokenTranslator

    E = model.get_input_embeddings().weight
    L = model.get_output_embeddings().weight
    src_ids = torch.arange(v)
    tr = TokenTranslator(v, u, kind=kind)
    if moved:  # a trained C rather than the 1/v start (where every support is full)
        # logits (scale 1) move by O(1); C at P's 1/v scale by 1e-3 at every v, as the recorded runs did
        noise = 1.0 if tr.plan_kind.c_scale(v) == 1.0 else 1e-3
        with torch.no_grad():
            tr.C.add_(torch.randn_like(tr.C) * noise)
    lm = TranslatedLM(model, freeze_model=True)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, u, (batch, T), generator=g)

    def translator_step():  # what TranslateTask does once per optimiser step around the micro-batches
        tr.zero_grad(set_to_none=True)
        tr.begin_step(E, L, src_ids)
        E_new, L_new = tr.embed_and_head(E, L, src_ids)
        E_new.grad = torch.ones_like(E_new)  # the LM's gradients have these shapes: a cotangent costs the same
        if L_new is not E_new:
            L_new.grad = torch.ones_like(L_new)
        tr.finish_step()

    with torch.no_grad():
        E_fix, L_fix = tr.embed_and_head(E, L, src_ids)
    E_fix = E_fix.detach().requires_grad_(True)
    L_fix = L_fix.detach().requires_grad_(True)

    def lm_micro_batch():
        out = lm(ids, E_new=E_fix.to(E.dtype), L_new=L_fix.to(E.dtype))
        (out.loss / micro_batches).backward()
        E_fix.grad = L_fix.grad = None

    t_tr = timed(translator_step, repeat)
    t_lm = timed(lm_micro_batch, repeat) * micro_batches
    n_layers = len(getattr(getattr(model, "model", model), "layers", []))
    return {"v": v, "u": u, "d": E.shape[1], "kind": kind, "C": "moved" if moved else "init 1/v",
            "layers": n_layers, "tokens_per_step": micro_batches * batch * T, "micro_batches": micro_batches,
            "translator_s": round(t_tr, 3), "lm_s": round(t_lm, 3), "share": round(t_tr / (t_tr + t_lm), 4),
            "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="", help="a Hugging Face model directory (default: OLMo-1B's config)")
    ap.add_argument("--layers", default="1", help="comma-separated depths of the OLMo-1B-config model")
    ap.add_argument("--v", default="243,50280", help="comma-separated numbers of source tokens")
    ap.add_argument("--u", type=int, default=512)
    ap.add_argument("--kind", default="sparse")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimiser step")
    ap.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--context-len", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--init", action="store_true", help="C at the 1/v start instead of a moved C")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the records to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    models = []
    if args.model:
        from transformers import AutoModelForCausalLM

        models.append(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    else:
        from s2t2_dist.api import tiny_from_config

        models += [tiny_from_config("olmo-1b", n_layers=int(n), d_model=2048, n_heads=16, vocab=50304)
                   for n in args.layers.split(",")]
    records = []
    print("| v | layers | d | tokens/step | translator s | LM s | translator share |\n|---|---|---|---|---|---|---|")
    for model in models:
        for p in model.parameters():
            p.requires_grad_(False)
        for v in (int(x) for x in args.v.split(",")):
            r = measure(model, v, args.u, args.kind, args.micro_batches, args.batch, args.context_len, args.repeat,
                        moved=not args.init)
            records.append(r)
            print(f"| {v} | {r['layers']} | {r['d']} | {r['tokens_per_step']} | {r['translator_s']} | {r['lm_s']} "
                  f"| {100 * r['share']:.2f}% |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
