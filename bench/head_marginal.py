"""How much of the gap between FVT and the original tokenizer a P-only head cannot close (a diagnostic).

A P-only translator predicts target token j from the frozen LM's hidden state h with the logit
``sum_i W_ij (L_i . h)``: a convex average of source LOGITS. The quantity the LM actually knows is its
next-source-token distribution p(i | context); the probability that the next target token is j is (nearly) the
SUM of p(i) over the source tokens whose text begins with j. This script scores the held-out target documents
(the translate stage's eval split, its windows and its BpB) three ways, all with the FVT input E' (each target
token the mean of its pieces' embeddings: exact for a target token that is one source token):

  fvt        L' = FVT as well (the translate stage's FVT row, `train.steps=0` with init_weight 1)
  p_file     E' and L' from a P file (a trained S2T2 run), for reference (--p-file)
  marginal   the LM's next-source-token distribution summed onto target tokens: q_j = sum of p(i) over the
             source tokens i whose longest target-token prefix is j (f(i) = j; a source token with no target
             prefix, e.g. a special token, is left out and q renormalised). No head a P can express does this
             (a sum of probabilities is not an average of logits); it bounds what the frozen LM's own next-token
             knowledge gives when it reads target tokens, so the gap left between it and the original tokenizer
             is the cost of reading the text cut into target tokens, which no head can remove.

    PYTHONPATH=. python -m bench.head_marginal --model ~/.cache/s2t2/source_lm/smollm2-135m-instruct-q4_1 \\
        --tokenizer OUT/data/tokenizer --eval OUT/data/shards/new/eval [--p-file RUN/P.safetensors] --json OUT.json

Seconds on a CPU (one forward over the eval split per row). Results: benchmarks/smollm2_cpu2_2026-11-28.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def prefix_map(target: dict[int, bytes | None], source: list) -> torch.Tensor:
    """f (long, v): for each source row the target token that is the longest prefix of its bytes, -1 if none."""
    index = {bytes(b): j for j, b in target.items() if b}
    max_len = max(map(len, index), default=0)
    out = torch.full((len(source),), -1, dtype=torch.long)
    for i, b in enumerate(source):
        if not b:
            continue
        for n in range(min(max_len, len(b)), 0, -1):
            j = index.get(bytes(b[:n]))
            if j is not None:
                out[i] = j
                break
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the source LM (a Hugging Face directory)")
    ap.add_argument("--tokenizer", required=True, help="the target tokenizer (s2t2 prepare's OUT/data/tokenizer)")
    ap.add_argument("--eval", required=True, help="the eval shards of the target tokenizer (translate's data.eval)")
    ap.add_argument("--p-file", default="", help="also score E', L' of this P file")
    ap.add_argument("--context-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from s2t2_dist.api import EvalDocs
    from s2t2_dist.api import load_hf_tokenizer, load_tokenizer, source_surface_bytes, source_token_ids, token_bytes
    from s2t2_dist.api import evaluate_documents
    from s2t2_dist.api import fvt_plan
    from s2t2_dist.api import surface_decomposition

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32).eval()
    src_tok, tgt = load_hf_tokenizer(args.model), load_tokenizer(args.tokenizer)
    src_ids = source_token_ids(src_tok, "all").tolist()
    v, u = len(src_ids), tgt.vocab_size
    E = model.get_input_embeddings().weight.detach()[src_ids]
    L = model.get_output_embeddings().weight.detach()[src_ids]
    dec = surface_decomposition(src_tok, src_ids, tgt)
    nu = torch.full((u,), 1.0 / u, dtype=torch.float64)
    W = (fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu) / nu).float()  # FVT: column means
    E_fvt, L_fvt = W.t() @ E, W.t() @ L
    f = prefix_map(token_bytes(tgt.tokenizer), source_surface_bytes(src_tok, src_ids))
    mapped = f >= 0
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def hidden(E_in):
        def run(ids):
            with torch.no_grad():
                return backbone(inputs_embeds=E_in[ids]).last_hidden_state
        return run

    def head_logits(E_in, L_out):
        h = hidden(E_in)
        return lambda ids: h(ids) @ L_out.t()

    def marginal(E_in):
        h = hidden(E_in)
        cols = f[mapped]

        def run(ids):
            logp = torch.log_softmax(h(ids) @ L[mapped].t(), dim=-1)  # over the mapped source tokens
            q = torch.zeros(*logp.shape[:-1], u).index_add_(-1, cols, logp.exp())
            return torch.log(q.clamp_min(1e-30))  # log-probabilities: the scorer's log_softmax leaves them as they are
        return run

    rows = {"fvt": head_logits(E_fvt, L_fvt), "marginal": marginal(E_fvt)}
    if args.p_file:
        from s2t2_dist.api import load_p

        P = load_p(args.p_file).dense().float()
        Wp = P / P.sum(0, keepdim=True).clamp_min(1e-30)
        rows["p_file"] = head_logits(Wp.t() @ E, Wp.t() @ L)
        rows["p_file_marginal"] = marginal(Wp.t() @ E)
    out = {"v": v, "u": u, "source_rows_with_a_target_prefix": int(mapped.sum()),
           "target_tokens_reached": int(torch.unique(f[mapped]).numel())}
    for name, fn in rows.items():
        m, _, _ = evaluate_documents(fn, EvalDocs(args.eval), args.context_len, vocab_size=u, batch_size=args.batch)
        out[name] = {"bpb": m["bpb"], "nll_per_token": m["nll_per_token"], "tokens": m["tokens"]}
        print(f"{name:18s} BpB {m['bpb']:.4f}  nll/token {m['nll_per_token']:.4f}  ({int(m['tokens'])} tokens)",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
