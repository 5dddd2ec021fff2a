"""What a trained P is (a diagnostic): does it translate, and how much of its score needs a dense column?

Two measures of a P file, with the source model's and the target tokenizer's ``tokenizer.json``:

* **letters**: for each target column j, the share of its weights ``W = P / nu`` (negative weights counted as 0)
  on the source tokens whose text is one of the characters of target token j's text, and whether its largest
  weight is on one of them; nu-weighted mean over the columns with text (specials left out), beside the share a
  flat column would have. Meant for single-character sources (`model.source_vocab=single_byte`): a translation
  puts a token's weight on its own letters; a P at the flat share does not translate, whatever it scores.
* **top-k** (``--top-k K --write OUT``): P cut to its K largest weights per column, each column rescaled to nu_j
  (the convex weights still sum to one), written as a P file that ``s2t2 evaluate`` scores like any other
  (``init.kind=translated init.p_file=OUT``); its kind is ``unconstrained``, whose file check reads no row sums
  (cutting a column moves P's row sums off mu, and the convex translation reads only the columns).

    PYTHONPATH=. python -m bench.p_anatomy --p-file RUN/P.safetensors \\
        --source-tokenizer ~/.cache/s2t2/source_lm/smollm2-135m-instruct-q4_1/tokenizer.json \\
        --target-tokenizer OUT/data/prepared/tokenizer/tokenizer.json [--top-k 2 --write P_top2.safetensors]

Results: benchmarks/table1_smollm2_p_only_cause_cpu2_2026-11-29.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch


def letter_share(W: torch.Tensor, nu: torch.Tensor, source_texts: list[str], target_texts: list[str]) -> dict:
    """The letters measure of the weights ``W`` (v x u): module docstring. ``source_texts[i]`` is row i's text,
    ``target_texts[j]`` column j's (empty: a special, left out)."""
    on = flat = mass = 0.0
    top = columns = 0
    for j, text in enumerate(target_texts):
        letters = set(text.strip())
        if not letters or float(nu[j]) <= 0:
            continue
        mine = torch.tensor([s in letters for s in source_texts])
        w = W[:, j].clamp_min(0)
        if float(w.sum()) <= 0:
            continue
        on += float(nu[j]) * float(w[mine].sum() / w.sum())
        flat += float(nu[j]) * float(mine.sum()) / len(source_texts)
        mass += float(nu[j])
        top += int(mine[int(W[:, j].argmax())])
        columns += 1
    if not columns:
        raise ValueError("no target column has text and mass: not a P of these tokenizers")
    return {"weight_on_own_letters": on / mass, "flat_column_share": flat / mass,
            "largest_weight_on_own_letter": top / columns, "columns": columns,
            "sources_per_column": float((W != 0).sum()) / W.shape[1]}


def top_k_plan(P: torch.Tensor, nu: torch.Tensor, k: int) -> tuple[torch.Tensor, float]:
    """(P cut to its ``k`` largest entries per column, each column rescaled to ``nu_j``; the share of P's mass
    those entries held). An all-zero column stays zero."""
    if not 1 <= k <= P.shape[0]:
        raise ValueError(f"k must be 1 to v = {P.shape[0]}, got {k}")
    idx = P.topk(k, dim=0).indices
    kept = P.gather(0, idx)
    T = torch.zeros_like(P).scatter_(0, idx, kept)
    sums = T.sum(0)
    T = T * torch.where(sums > 0, nu.to(P.dtype) / sums.clamp_min(torch.finfo(P.dtype).tiny), 0).unsqueeze(0)
    return T, float(kept.sum() / P.sum())


def main(argv=None) -> int:
    from tokenizers import Tokenizer

    from s2t2_dist.api import translation_weights
    from s2t2_dist.api import load_p, save_p

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p-file", required=True)
    ap.add_argument("--source-tokenizer", required=True, help="the source model's tokenizer.json")
    ap.add_argument("--target-tokenizer", required=True, help="the new tokenizer's tokenizer.json")
    ap.add_argument("--top-k", type=int, default=0, help="also write P cut to its K largest weights per column")
    ap.add_argument("--write", default="", help="where --top-k's P file goes")
    ap.add_argument("--json", default="", help="also write the report to this file")
    a = ap.parse_args(argv)
    for flag, path in (("--p-file", a.p_file), ("--source-tokenizer", a.source_tokenizer),
                       ("--target-tokenizer", a.target_tokenizer)):
        if not Path(path).is_file():
            print(f"{flag}: no such file: {path}", file=sys.stderr)
            return 2
    if bool(a.top_k) != bool(a.write):
        print("--top-k and --write go together", file=sys.stderr)
        return 2
    p = load_p(a.p_file)
    src, tgt = Tokenizer.from_file(a.source_tokenizer), Tokenizer.from_file(a.target_tokenizer)
    if tgt.get_vocab_size() != p.shape[1]:
        print(f"--target-tokenizer: {tgt.get_vocab_size()} tokens, the P file has u = {p.shape[1]}", file=sys.stderr)
        return 2
    P = p.dense(torch.float64)
    nu = p.nu.double()
    W = translation_weights(P, p.mu.double(), nu, p.normalization, "head")  # P / nu, 0 where nu is 0
    report = {"p_file": a.p_file, "kind": p.kind, **letter_share(
        W, nu, [src.decode([int(i)]) for i in p.source_ids], [tgt.decode([j]) for j in range(p.shape[1])])}
    if a.top_k:
        try:
            T, kept = top_k_plan(P, nu, a.top_k)
        except ValueError as e:
            print(f"--top-k: {e}", file=sys.stderr)
            return 2
        nz = (T != 0).nonzero().t().contiguous()
        save_p(a.write, replace(p, indices=nz, values=T[nz[0], nz[1]].float(), kind="unconstrained"))
        report["top_k"] = {"k": a.top_k, "mass_kept": kept, "file": a.write}
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
