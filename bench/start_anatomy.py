"""Anatomy of the sparse FVT start: for each init_weight, how many source rows each target column keeps after
the weight floor, and how much of the column's mass is the start's shared part (not the column's own FVT pieces).
No model weights are read: tokenizers only, the start built as the translate stage builds it (`surface_prior`:
source marginal "start", `ot.prior.start_plan`, uniform nu) and floored as the sparse kind floors it
(`floor_plan_reference`). `--plain` builds the earlier start (the plain blend with mu nu^T, the
shared part left to the floor) for comparison.

    python -m bench.start_anatomy --model ~/.cache/s2t2/source_lm/smollm2-135m-instruct-q4_1 \
        --tokenizer OUT/data/tokenizer --weights 0.5,0.8,0.9,0.95,1
"""
from __future__ import annotations

import argparse
import sys

import torch


def anatomy(model: str, tokenizer: str, weights: list[float], floor: float = 1.0, plain: bool = False) -> list[dict]:
    from s2t2_dist.api import load_hf_tokenizer, load_tokenizer, source_token_ids
    from s2t2_dist.api import blend_with_uniform, fvt_plan, row_marginal, shared_rows, start_plan
    from s2t2_dist.api import surface_decomposition
    from s2t2_dist.api import floor_plan_reference

    src_tok = load_hf_tokenizer(model)
    src_ids = source_token_ids(src_tok, "all").tolist()
    tgt = load_tokenizer(tokenizer)
    v, u = len(src_ids), tgt.vocab_size
    dec = surface_decomposition(src_tok, src_ids, tgt)
    nu = torch.full((u,), 1.0 / u, dtype=torch.float64)
    F = fvt_plan(dec, torch.full((v,), 1.0 / v, dtype=torch.float64), nu)
    built = torch.tensor([bool(p) for p in dec.pieces])
    mu = row_marginal(F) if plain or not bool(built.any()) else row_marginal(F[:, built])  # as start_plan's
    own = F > 0
    out = []
    for w in weights:
        P0 = blend_with_uniform(F, mu, nu, w) if plain else start_plan(dec, nu, v, w, floor / v)
        P = floor_plan_reference(P0.clone(), P0, nu, floor)
        W = P / nu
        nnz = (P > 0).sum(0).double()
        spread = (W * ~own).sum(0)  # mass of the column outside its own FVT pieces
        out.append({"init_weight": w, "v": v, "u": u, "rows_with_mu_above_floor": int((mu * (1 - w) >= floor / v).sum()),
                    "shared_rows": 0 if plain else int(shared_rows(mu, 1 - w, floor / v).sum()),
                    "col_nnz_built": float(nnz[built].mean()), "spread_mass_built": float(spread[built].mean()),
                    "mu_support": int((mu > 0).sum()), "mu_rows_used_by_pieces": int((F[:, built] > 0).any(1).sum())})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="source model directory (its tokenizer)")
    ap.add_argument("--tokenizer", required=True, help="the new (target) tokenizer directory")
    ap.add_argument("--weights", default="0.5,0.8,0.9,0.95,1")
    ap.add_argument("--floor", type=float, default=1.0, help="translator.floor (units of 1/v)")
    ap.add_argument("--plain", action="store_true", help="the earlier start (plain blend)")
    a = ap.parse_args(argv)
    print("| init_weight | v | u | rows with mu (1 - w) >= floor / v | rows of the shared part | non-zeros per built "
          "column | shared mass per built column |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in anatomy(a.model, a.tokenizer, [float(x) for x in a.weights.split(",")], a.floor, a.plain):
        print(f"| {r['init_weight']:g} | {r['v']} | {r['u']} | {r['rows_with_mu_above_floor']} | "
              f"{r['shared_rows'] if not a.plain else '-'} | {r['col_nnz_built']:.1f} | {r['spread_mass_built']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
