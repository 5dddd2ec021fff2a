"""The real-LM reproduction's outputs: results.json, table1.md, report.md and plots, from the arms' records.

Everything here reads finished arms only (`reproduce_lm.read_result`); a missing arm is listed, never guessed. The
checks are the claims the reproduction tests, each on every seed (paired by seed)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from s2t2_dist.recipes.paper_plan import PAPER_TABLE1, TABLE1

#: rows of the table, in order: key -> label (Table 1's columns, then the training-free references)
ROWS = {**TABLE1, "plain_p_fvt": "Plain P from S2T2's start", "sinkhorn_p_fvt": "Sinkhorn P from S2T2's start",
        "s2t2_a0": "S2T2, alpha 0 (paper)", "fvt": "FVT plan, letters only (no training)",
        "fvt_start": "S2T2's start (FVT)",
        "p_only_probe": "P-only ceiling probe (free E', L' on the frozen body)"}
#: the P-only rows, read as a fraction of the gap from S2T2's start to the ceiling probe
P_ONLY_ROWS = ("plain_p", "plain_p_fvt", "sinkhorn_p", "sinkhorn_p_fvt", "s2t2", "s2t2_a0")
#: the finetuned rows, in the table's order
FT_ROWS = ("plain_p_cft", "plain_p_fvt_cft", "sinkhorn_p_cft", "sinkhorn_p_fvt_cft", "s2t2_cft", "fvt_start_cft",
           "ft_orig_tok", "ft_new_tok")
#: the table's order: the P-only rows, the finetuned rows, the training-free ones and the probe
ORDER = (*P_ONLY_ROWS, *FT_ROWS, "fvt", "fvt_start", "p_only_probe")


def label(key: str) -> str:
    return f"{ROWS[key.removesuffix('_cft')]} + CFT" if key.endswith("_cft") else ROWS[key]


#: the paired claims: (better, worse, margin in BpB)
ORDERING = [("s2t2", "sinkhorn_p", 0.0), ("s2t2", "plain_p", 0.0), ("s2t2_a0", "sinkhorn_p", 0.0),
            ("s2t2_a0", "plain_p", 0.0), ("s2t2_cft", "ft_new_tok", 0.02),
            ("s2t2_cft", "plain_p_cft", 0.02), ("s2t2_cft", "sinkhorn_p_cft", 0.02),
            # does a learned P beat the start it was learned from, after the same finetuning?
            ("s2t2_cft", "fvt_start_cft", 0.02), ("plain_p_fvt_cft", "fvt_start_cft", 0.02),
            ("sinkhorn_p_fvt_cft", "fvt_start_cft", 0.02),
            # and does the start itself beat the plain new tokenizer?
            ("fvt_start_cft", "ft_new_tok", 0.02)]


def _stats(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs)}


def _rows(jobs) -> tuple[dict[str, dict], list[str]]:
    """Each table row's held-out scores by seed, from the finished evaluate jobs; and the jobs not finished."""
    from s2t2_dist.recipes.arm_records import read_result

    rows: dict[str, dict] = {}
    missing = []
    for j in jobs:
        if j.stage != "evaluate" or not j.role:
            continue
        _, key, seed = j.role
        r = read_result(j)
        if r is None:
            missing.append(j.name)
            continue
        m = r["metrics"]
        row = rows.setdefault(key, {"seeds": {}})
        row["seeds"]["all" if seed is None else str(seed)] = {
            "bpb": m["bpb"], "perplexity": m["perplexity"], "nll_per_token": m["nll_per_token"],
            "tokens": m["tokens"], "bytes": m["bytes"], "docs": m["docs"], "run": j.name,
            # each document's scores (records made before they were kept have none): the paired intervals'
            **({"documents": r["documents"]} if r.get("documents") else {})}
        rows[key]["random_guess_bpb"] = m.get("random_guess_bpb")
    for key, row in rows.items():
        vals = list(row["seeds"].values())
        row["bpb"] = _stats([v["bpb"] for v in vals])
        row["perplexity"] = _stats([v["perplexity"] for v in vals])
    return rows, missing


def collect(plan, jobs, selection: dict, references: dict, grid: list | None = None,
            extra: dict | None = None) -> dict:
    """The table's rows and claims from `jobs`; with `grid` (seed 0's finetuned rows at every finetuning step),
    each row's validation and held-out score at each step beside them."""
    rows, missing = _rows(jobs)
    results = {"scale": plan.cfg.scale, "rows": rows, "missing": missing, "selection": selection,
               "references": references, "paper": {k: {"perplexity": a, "bpb": b}
                                                   for k, (a, b) in PAPER_TABLE1.items()}}
    results["curve"] = _curve(plan)
    results["ft_curves"] = ft_curves(jobs)
    results["ft_grid"], grid_missing = ft_grid(grid or [])
    results["missing"] += [n for n in grid_missing if n not in results["missing"]]
    results["equal_tokens"] = equal_tokens(jobs, plan.cfg.p_steps, plan.cfg.ft_steps)
    grid_rows = {f"grid/{k}": {"seeds": {lr: v for lr, v in r.items() if v.get("bytes")}}
                 for k, r in results["ft_grid"].items()}
    results["same_bytes"] = _same_bytes({**rows, **grid_rows})
    results.update(extra or {})
    results["probe_gap"] = probe_gap(rows)
    results["grid_vs_start"] = grid_vs_start(results["ft_grid"])
    results["checks"] = checks(results)
    return results


#: the row every other finetuned row of the grid is paired with at the same step: what finetuning the start alone
#: gives, so that a row minus it is what the row's own P (or tokenizer) adds
GRID_BASE = "fvt_start_cft"


def grid_vs_start(grid: dict) -> dict:
    """Seed 0's grid: each finetuned row minus S2T2's start + CFT at the same finetuning step, held out, with a 95%
    paired bootstrap interval over the documents, where both kept each document's scores."""
    from s2t2_dist.api import claim, paired_difference

    base = grid.get(GRID_BASE) or {}
    out: dict = {}
    for key, points in grid.items():
        if key == GRID_BASE:
            continue
        for lr, pt in points.items():
            b = (base.get(lr) or {}).get("documents")
            if pt.get("documents") and b:
                d = paired_difference([(pt["documents"], b)])["per_seed"][0]
                out.setdefault(key, {})[lr] = {**d, "claim": claim(d, 0.02)}
    return out


def ft_grid(jobs) -> tuple[dict, list[str]]:
    """Seed 0's finetuned rows by finetuning step: the validation BpB each finetune ended at (what chose the
    row's step) and its held-out score; and the held-out scores not yet run."""
    from s2t2_dist.recipes.arm_records import read_result

    producer = {p: j for j in jobs for p in j.produces}
    out: dict = {}
    missing: list[str] = []
    for j in jobs:
        if j.stage != "evaluate" or not j.role:
            continue
        ft = _finetune_of(j, producer)
        lr = next(o.split("=", 1)[1] for o in ft.overrides if o.startswith("optim.lr="))
        fr, er = read_result(ft), read_result(j)
        point = {"validation": ((fr or {}).get("eval") or {}).get("bpb")}
        if er:
            m = er["metrics"]
            point.update(heldout=m["bpb"], bytes=m["bytes"], docs=m["docs"],
                         **({"documents": er["documents"]} if er.get("documents") else {}))
        elif j.name not in missing:
            missing.append(j.name)
        out.setdefault(j.role[1], {})[f"{float(lr):g}"] = point
    return out, missing


def equal_tokens(jobs, p_steps: int, ft_steps: int) -> dict:
    """Each finetuned row's validation BpB at equal total tokens: after `ft_steps` steps of training in all (a P +
    CFT row's P-only steps counted), read off its validation curve; by seed. A row whose curve has no point there
    is left out (its finetune scored validation too rarely)."""
    from s2t2_dist.recipes.arm_records import read_result

    producer = {p: j for j in jobs for p in j.produces}
    out: dict = {"total_steps": ft_steps, "rows": {}}
    for j in jobs:
        if j.stage != "evaluate" or not j.role or j.role[1] not in FT_ROWS:
            continue
        row, seed = j.role[1], str(j.role[2])
        ft = _finetune_of(j, producer)
        before = p_steps if any(producer.get(c) is not None and producer[c].stage == "translate"
                                and f"train.steps={p_steps}" in producer[c].overrides for c in ft.consumes) else 0
        at = ft_steps - before
        pts = {int(s): v for series in (read_result(ft) or {}).get("curve") or [] if series["tag"] == "eval/bpb"
               for s, v in series["points"]}
        if at in pts:
            out["rows"].setdefault(row, {})[seed] = {"finetuning_steps": at, "bpb": pts[at]}
    return out


def probe_gap(rows: dict) -> dict:
    """Each P-only row's share of the gap from S2T2's start (0 steps) to the ceiling probe (free E', L' on the
    frozen body at the P-only budget), on the seeds both ends were scored on: 0 is the start, 1 the probe's BpB
    (above 1: better than the probe, which then was no bound at that budget). {} without both ends."""
    start, probe = (rows.get(k, {}).get("seeds", {}) for k in ("fvt_start", "p_only_probe"))
    ends = {s: (start[s]["bpb"], probe[s]["bpb"]) for s in set(start) & set(probe)}
    if not ends:
        return {}
    out: dict = {"start": {s: a for s, (a, _) in ends.items()}, "probe": {s: b for s, (_, b) in ends.items()},
                 "rows": {}}
    for key in P_ONLY_ROWS:
        seeds = (rows.get(key) or {}).get("seeds") or {}
        fr = {s: (a - seeds[s]["bpb"]) / (a - b) for s, (a, b) in ends.items() if s in seeds and a != b}
        if fr:
            out["rows"][key] = fr
    return out


def _curve(plan) -> list[list[float]]:
    from s2t2_dist.recipes.arm_records import read_result

    if not plan.cfg.lm.curve_steps:
        return []
    r = read_result(plan.curve()) or {}
    pts: dict[int, float] = {}
    for series in r.get("curve") or []:
        if series["tag"] == "eval/bpb":
            for s, v in series["points"]:
                pts[int(s)] = float(v)
    return [[s, pts[s]] for s in sorted(pts)]


def _finetune_of(job, producer: dict):
    """The finetune whose export a held-out score reads (None: it reads none), by `producer` (path -> its job)."""
    return next((producer[c] for c in job.consumes if c in producer and producer[c].stage == "finetune"), None)


def ft_curves(jobs) -> dict[str, dict[str, list[list[float]]]]:
    """Each finetuned row's training loss per step, by seed, in bits per byte: nats per token over ln 2 times
    tokens per byte of the run's own validation score (each row has its own tokenizer, so per-token losses do not
    compare; the training split's bytes per token are the validation split's within sampling). What a row's seeds
    did on the way to their held-out scores: a spike or a plateau shows here, not in the table."""
    from s2t2_dist.recipes.arm_records import read_result

    producer = {p: j for j in jobs for p in j.produces}
    out: dict[str, dict[str, list[list[float]]]] = {}
    for j in jobs:
        if j.stage != "evaluate" or not j.role or j.role[1] not in FT_ROWS:
            continue
        ft = _finetune_of(j, producer)
        r = read_result(ft) if ft is not None else None
        bpt = ((r or {}).get("eval") or {}).get("bytes_per_token")
        if not r or not bpt or not r.get("losses"):
            continue
        k = 1.0 / (math.log(2) * bpt)
        out.setdefault(j.role[1], {})[str(j.role[2])] = [[int(s), float(v) * k] for s, v in r["losses"]
                                                         if math.isfinite(v)]
    return out


def _same_bytes(rows: dict) -> dict:
    """Every row scored on the same held-out documents and bytes (the table is void otherwise)."""
    seen = {(v["bytes"], v["docs"]) for r in rows.values() for v in r["seeds"].values()}
    return {"ok": len(seen) <= 1, "bytes_docs": sorted(seen)}


def _seed_values(results: dict, key: str) -> dict[str, float]:
    row = results["rows"].get(key) or {}
    return {s: v["bpb"] for s, v in (row.get("seeds") or {}).items()}


def checks(results: dict) -> list[dict]:
    out = []
    refs = results["references"]
    residue = refs["residue_unigram"]["bpb"]

    def add(claim, ok, detail, reads_finetuned=False):
        out.append({"claim": claim, "holds": ok, "detail": detail, "reads_finetuned": reads_finetuned})

    add("every row scored on the same held-out documents and bytes", results["same_bytes"]["ok"],
        f"{results['same_bytes']['bytes_docs']}")
    ft_rows = [k for k in FT_ROWS if (results["rows"].get(k) or {}).get("bpb", {}).get("n")]
    best = min(ft_rows, key=lambda k: results["rows"][k]["bpb"]["mean"]) if ft_rows else None
    add("valid run: a finetuned row below the residue unigram",
        None if best is None else results["rows"][best]["bpb"]["mean"] < residue,
        "no finetuned row yet" if best is None else
        f"best {best} {results['rows'][best]['bpb']['mean']:.4f} vs residue unigram {residue:.4f}", True)
    free = {name: refs[k]["bpb"] for k, name in (("residue_unigram", "the residue unigram"),
                                                  ("adaptive_unigram", "the in-sequence adaptive unigram"),
                                                  ("unigram_bpe", "the 512-BPE unigram")) if refs.get(k)}
    ref_name = min(free, key=free.get)
    scored = {k: r["bpb"]["mean"] for k, r in results["rows"].items() if (r.get("bpb") or {}).get("n")}
    top = min(scored, key=scored.get) if scored else None
    add(f"some row below the best training-free reference ({ref_name})",
        None if top is None else scored[top] < free[ref_name],
        "no row yet" if top is None else f"best row {label(top)} {scored[top]:.4f} vs {ref_name} "
                                         f"{free[ref_name]:.4f}", True)
    s2_rows = [k for k in ("s2t2", "s2t2_a0") if (results["rows"].get(k) or {}).get("bpb", {}).get("n")]
    s2k = min(s2_rows, key=lambda k: results["rows"][k]["bpb"]["mean"]) if s2_rows else None
    s2 = results["rows"][s2k]["bpb"] if s2k else {}
    add("S2T2 P-only below the residue unigram", None if not s2 else s2["mean"] < residue,
        "missing" if not s2 else f"{s2k} {s2['mean']:.4f} vs {residue:.4f}")
    for better, worse, margin in ORDERING:
        a, b = _seed_values(results, better), _seed_values(results, worse)
        paired = sorted(set(a) & set(b))
        wins = [s for s in paired if a[s] < b[s] - margin]
        diffs = ", ".join(f"seed {s}: {a[s] - b[s]:+.4f}" for s in paired)
        add(f"{label(better)} below {label(worse)} by >= {margin} BpB on every seed",
            None if not paired else len(wins) == len(paired), f"{len(wins)}/{len(paired)} seeds; {diffs}",
            better in FT_ROWS or worse in FT_ROWS)
        out[-1]["margin"] = margin
        out[-1]["interval"] = _interval(results, better, worse, paired, margin)
        if out[-1]["interval"]:
            out[-1]["detail"] += "; " + interval_text(out[-1]["interval"])
    return out


def _interval(results: dict, better: str, worse: str, seeds: list[str], margin: float) -> dict | None:
    """The paired bootstrap of better minus worse over the held-out documents (and the seeds), where both rows kept
    each document's scores on every paired seed; else None (a corpus total has no interval)."""
    from s2t2_dist.api import claim, paired_difference

    docs = [((results["rows"][better]["seeds"][s] or {}).get("documents"),
             (results["rows"][worse]["seeds"][s] or {}).get("documents")) for s in seeds]
    if not docs or any(x is None or y is None for x, y in docs):
        return None
    r = paired_difference(docs)
    r["seed_names"] = seeds
    r["claim"] = claim(r["mean"], margin)
    r["per_seed_claims"] = [claim(p, margin) for p in r["per_seed"]]
    return r


def interval_text(r: dict) -> str:
    per = ", ".join(f"seed {s}: {p['diff']:+.4f} [{p['lo']:+.4f}, {p['hi']:+.4f}] {c}"
                    for s, p, c in zip(r["seed_names"], r["per_seed"], r["per_seed_claims"]))
    m = r["mean"]
    return (f"95% paired bootstrap over {r['docs']} documents: {per}; over seeds and documents "
            f"{m['diff']:+.4f} [{m['lo']:+.4f}, {m['hi']:+.4f}]: {r['claim']}")


# ----------------------------------------------------------------------------------------------------------------
# text


def _f(x, nd=4) -> str:
    return "-" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{nd}f}"


def _spread(b: dict) -> str:
    return f"+- {_f(b.get('sd'), 3)}" if b.get("n", 0) > 1 else "(1 seed)"  # no sd from one seed


def _mark(key: str, provisional: set[str]) -> str:
    """The suffix " *" of a row read by a choice still provisional (its P column's, or its finetuning step)."""
    by_ft = f"ft_lr:{key}" in provisional
    by_probe = "probe_lr" in provisional and key == "p_only_probe"
    return " *" if key.removesuffix("_cft") in provisional or by_ft or by_probe else ""


def _ft_lr(results: dict, key: str) -> float | None:
    """The finetuning step a finetuned row is reported at (chosen, or the best so far)."""
    sel = results.get("selection") or {}
    lr = ((sel.get("chosen") or {}).get("ft_lr") or {}).get(key)
    return lr if lr is not None else ((sel.get("provisional") or {}).get("ft_lr") or {}).get(key)


def table1_markdown(results: dict) -> str:
    refs = results["references"]
    seeds = sorted({s for r in results["rows"].values() for s in r["seeds"] if s != "all"})
    head = ["row", "finetuning lr", "BpB (mean +- sd)", *[f"seed {s}" for s in seeds], "perplexity (mean)",
            "paper BpB"]
    prov = set(results.get("provisional") or [])
    lines = []
    if prov:
        lines += [f"Provisional (marked *): the selection is still running for {', '.join(sorted(prov))}; those rows "
                  "use the best finished candidate so far and may change.", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in ORDER:
        r = results["rows"].get(key)
        if not r:
            continue
        b = r["bpb"]
        lab = label(key) + _mark(key, prov)
        per = [_f(r["seeds"].get(s, {}).get("bpb")) for s in seeds]
        # a row no seed enters (nothing trained): its one value, once, not a spread over seeds it never ran
        spread = "(no seed: untrained)" if "all" in r["seeds"] else _spread(b)
        paper = results["paper"].get(key, {}).get("bpb")
        lr = _ft_lr(results, key) if key in FT_ROWS else None
        lines.append(f"| {lab} | {'-' if lr is None else f'{lr:g}'} | {_f(b.get('mean'))} {spread} | "
                     + " | ".join(per) + f" | {_f(r['perplexity'].get('mean'), 1)} | {_f(paper, 2)} |")
    rg = next((r.get("random_guess_bpb") for r in results["rows"].values() if r.get("random_guess_bpb")), None)
    ada = refs.get("adaptive_unigram") or {}
    lines += ["", "BpB: bits per byte of the held-out proteins (the same bytes for every row); perplexity: per token "
              "of the row's own tokenizer (the new 512-BPE, or SmolLM2's for FT orig. tok.: not comparable across "
              "tokenizers); paper BpB: the paper's Table 1 (OLMo-1B on UniRef50; its FT orig. tok. figure is bits per "
              "OLMo token, ~4.04 BpB at OLMo's ~1.79 bytes a token). Each finetuned row at its own finetuning step, "
              "chosen on seed 0's validation split.",
              "", f"Training-free references on the same held-out bytes: residue unigram "
              f"{_f(refs['residue_unigram']['bpb'])} BpB, in-sequence adaptive unigram {_f(ada.get('bpb'))}"
              + (f" (prior strength {ada['strength']:g}, chosen on validation)" if ada.get("strength") else "")
              + f", 512-BPE token unigram {_f(refs['unigram_bpe']['bpb'])} (special tokens left out), random guess "
              f"(log2 u per token) {_f(rg)}."]
    bpt = bytes_per_token(results["rows"])
    if bpt:
        lines += ["", "Bytes per token on the held-out proteins: " + ", ".join(
            f"{name} {v:.3f}" for name, v in bpt.items()) + " (the paper's figures per OLMo token convert at OLMo's "
            "own, ~1.79 here)."]
    gap = results.get("probe_gap") or {}
    if gap.get("rows"):
        s = sorted(gap["start"])[0]
        lines += ["", f"P-only rows as a share of the gap from S2T2's start ({_f(gap['start'][s])}) to the ceiling "
                  f"probe ({_f(gap['probe'][s])}, seed {s}; free E' and L' for the new tokens on the frozen body, "
                  "trained for the P-only steps; 0 = the start, 1 = the probe): "
                  + ", ".join(f"{label(k)} {fr[s]:.2f}" for k, fr in gap["rows"].items() if s in fr) + "."]
    if results.get("ft_grid"):
        lines += ["", grid_markdown(results)]
    eq = (results.get("equal_tokens") or {}).get("rows") or {}
    if eq:
        lines += ["", f"At equal total tokens (validation BpB after {results['equal_tokens']['total_steps']} steps "
                  "of training in all, a P + CFT row's P-only steps counted; read off its validation curve):", "",
                  "| row | finetuning steps | " + " | ".join(f"seed {s}" for s in seeds) + " |",
                  "|" + "---|" * (2 + len(seeds))]
        for key in (k for k in FT_ROWS if k in eq):
            at = next(iter(eq[key].values()))["finetuning_steps"]
            lines.append(f"| {label(key)} | {at} | " + " | ".join(_f((eq[key].get(s) or {}).get("bpb"))
                                                               for s in seeds) + " |")
    return "\n".join(lines) + "\n"


def bytes_per_token(rows: dict) -> dict[str, float]:
    """Bytes per token of each tokenizer on the held-out bytes, from a row scored with it (the new BPE: any row
    but FT orig. tok.; the source model's own: FT orig. tok.)."""
    out = {}
    for name, keys in (("the new BPE", [k for k in ORDER if k != "ft_orig_tok"]), ("the source model's own",
                                                                                  ["ft_orig_tok"])):
        v = next((v for k in keys for v in ((rows.get(k) or {}).get("seeds") or {}).values()
                  if v.get("tokens")), None)
        if v:
            out[name] = v["bytes"] / v["tokens"]
    return out


def grid_markdown(results: dict) -> str:
    """Seed 0's finetuned rows at every finetuning step: validation (what chose the step) / held out."""
    grid = results["ft_grid"]
    lrs = sorted({lr for r in grid.values() for lr in r}, key=float)
    lines = ["Each finetuned row at every finetuning step (seed 0; validation / held-out BpB; the row's own step, "
             "chosen on validation, in bold):", "", "| row | " + " | ".join(f"lr {lr}" for lr in lrs) + " |",
             "|" + "---|" * (1 + len(lrs))]
    for key in (k for k in FT_ROWS if k in grid):
        own = _ft_lr(results, key)
        cells = []
        for lr in lrs:
            pt = grid[key].get(lr) or {}
            cell = f"{_f(pt.get('validation'))} / {_f(pt.get('heldout'))}"
            cells.append(f"**{cell}**" if own is not None and float(lr) == own else cell)
        lines.append(f"| {label(key)} | " + " | ".join(cells) + " |")
    vs = results.get("grid_vs_start") or {}
    if vs:
        lines += ["", f"Minus {label(GRID_BASE)} at the same step (held out, seed 0; 95% paired bootstrap over the "
                  "documents; what a row's own P or tokenizer adds to finetuning the start alone, a negative "
                  "difference its gain):", ""]
        lines += [f"- {label(k)}: " + "; ".join(f"lr {lr} {d['diff']:+.4f} [{d['lo']:+.4f}, {d['hi']:+.4f}] "
                                                 f"{d['claim']}" for lr, d in sorted(vs[k].items(), key=lambda x:
                                                                                     float(x[0])))
                  for k in FT_ROWS if k in vs]
    edge = [k for k in (results.get("selection") or {}).get("at_grid_edge", []) if k in FT_ROWS]
    if edge:
        lines += ["", "Chosen at an end of the grid (the best step may lie beyond it): "
                  + ", ".join(label(k) for k in edge) + "."]
    return "\n".join(lines)


def _verdict(c: dict) -> str:
    return "HOLDS" if c["holds"] else "open" if c["holds"] is None else "FAILS"


def selection_markdown(sel: dict) -> str:
    lines = ["| P column | candidate | validation BpB | sources per target token (end) | C with a gradient |",
             "|---|---|---|---|---|"]
    for col, scores in sel["p"].items():
        ch = (sel.get("chosen_label") or {}).get(col)
        so_far = (sel.get("provisional_label") or {}).get(col)
        for cand, v in scores.items():
            mark = " **(chosen)**" if cand == ch else " (best so far)" if cand == so_far else ""
            end = ((sel.get("p_end") or {}).get(col) or {}).get(cand) or {}
            live = end.get("live_grad_frac")
            lines.append(f"| {label(col)} | {cand}{mark} | {_f(v)} | {_f(end.get('sources_per_target'), 2)} | "
                         f"{'-' if live is None else f'{100 * live:.2f}%'} |")
    if sel.get("at_grid_edge"):
        lines += ["", "Chosen at an end of its grid (the best step may lie beyond it): "
                  + ", ".join(label(c) for c in sel["at_grid_edge"]) + "."]
    if sel.get("probe"):
        ch = sel["chosen"].get("probe_lr")
        lines += ["", "| ceiling probe lr | validation BpB |", "|---|---|"]
        lines += [f"| {lr}{' **(chosen)**' if ch is not None and float(lr) == ch else ''} | {_f(v)} |"
                  for lr, v in sel["probe"].items()]
    return "\n".join(lines) + "\n"


def report_markdown(results: dict, plots: dict[str, Path], out: Path) -> str:
    cfg = results.get("config", {})
    parts = [f"# S2T2 with a real pretrained LM (scale {results['scale']})", ""]
    parts += [f"Config: `{out / 'reproduce_config.yaml'}`. Seeds {cfg.get('seeds')}, P {cfg.get('p_steps')} steps, "
              f"finetuning {cfg.get('ft_steps')} steps, batch {cfg.get('batch_size')} x {cfg.get('context_len')}.", ""]
    parts += ["## Table 1 (held-out split)", "", table1_markdown(results)]
    parts += ["## Claims", ""] + [f"- {_verdict(c)}: {c['claim']} ({c['detail']})" for c in results["checks"]] + [""]
    val = results["references"].get("validation") or {}
    parts += ["## Selection (seed 0, validation split)", "", selection_markdown(results["selection"]),
              f"Validation split: residue unigram {_f((val.get('residue_unigram') or {}).get('bpb'))}, 512-BPE "
              f"unigram {_f((val.get('unigram_bpe') or {}).get('bpb'))} BpB.", ""]
    if results["curve"]:
        parts += ["## S2T2 P-only curve (validation BpB, seed 0)", "",
                  " ".join(f"{s}: {_f(v)}" for s, v in results["curve"]), "",
                  f"On the validation split: residue unigram {_f((val.get('residue_unigram') or {}).get('bpb'))}, "
                  f"512-BPE unigram {_f((val.get('unigram_bpe') or {}).get('bpb'))}.", ""]
    if results["missing"]:
        parts += ["## Not yet run", "", ", ".join(results["missing"]), ""]
    for name, p in plots.items():
        parts.append(f"![{name}]({p.relative_to(out)})")
    return "\n".join(parts) + "\n"


def plots(results: dict, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    d = out / "plots"
    d.mkdir(parents=True, exist_ok=True)
    refs = results["references"]
    keys = [k for k in ORDER if k in results["rows"]]
    if keys:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        for i, k in enumerate(keys):
            vals = [v["bpb"] for v in results["rows"][k]["seeds"].values()]
            ax.scatter([i] * len(vals), vals, color="C0", s=18, zorder=3)
            ax.bar(i, statistics.fmean(vals), color="C1" if k.startswith("s2t2") else "C7", alpha=0.6)
        _unigram_lines(ax, refs)
        ax.set_xticks(range(len(keys)))
        prov = set(results.get("provisional") or [])
        ax.set_xticklabels([label(k) + _mark(k, prov) for k in keys], rotation=30, ha="right", fontsize=8)
        lo = min(v["bpb"] for k in keys for v in results["rows"][k]["seeds"].values())
        ax.set_ylim(lo - 0.15, max(refs["residue_unigram"]["bpb"], refs["unigram_bpe"]["bpb"]) + 0.6)
        ax.set_ylabel("held-out bits per byte (dots: seeds)")
        ax.set_title("Table 1 with SmolLM2-135M on proteins" + (" (*: provisional choice)" if prov else ""))
        paths["table1"] = _save(fig, ax, d / "table1.png")
    if results["curve"]:
        fig, ax = plt.subplots(figsize=(6, 4))
        xs, ys = zip(*results["curve"])
        ax.plot(xs, ys, marker="o", label="S2T2 P-only")
        _unigram_lines(ax, refs.get("validation") or refs)
        ax.set_title("validation split, seed 0")
        ax.set_xlabel("step (4 x 256 tokens)")
        ax.set_ylabel("bits per byte")
        paths["curve"] = _save(fig, ax, d / "curve.png")
    paired = [c for c in results.get("checks") or [] if c.get("interval")]
    if paired:
        paths["paired"] = _paired_plot(paired, d / "paired.png")
    curves = results.get("ft_curves") or {}
    if curves:
        paths["finetune"] = _ft_plot(curves, refs.get("validation") or refs, d / "finetune_curves.png",
                                     "at each row's own step")
    return paths


def _once(named: set[str], name: str) -> str | None:
    """`name` the first time it is asked for, then None (matplotlib leaves an unlabelled artist out of the legend)."""
    if name in named:
        return None
    named.add(name)
    return name


def _paired_plot(paired: list[dict], path: Path) -> Path:
    """One line per paired claim: each seed's difference (the first row minus the second, BpB; below 0: the first
    row better) with its 95% bootstrap interval over the documents, and the mean over seeds and documents; the
    claim's margin as a dotted line (a claim holds where the whole interval lies left of it)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.55 * len(paired)))
    named: set[str] = set()  # each seed, and the mean, in the legend once (claims may pair different seeds)
    for i, c in enumerate(paired):
        r, y = c["interval"], len(paired) - 1 - i
        n = len(r["per_seed"])
        for j, (seed, p) in enumerate(zip(r["seed_names"], r["per_seed"])):
            off = (j - n / 2) * 0.12
            ax.errorbar(p["diff"], y + off, xerr=[[p["diff"] - p["lo"]], [p["hi"] - p["diff"]]], fmt="o", ms=4,
                        color=f"C{int(seed) % 10}", capsize=2, label=_once(named, f"seed {seed}"))
        m = r["mean"]
        ax.errorbar(m["diff"], y + (n / 2) * 0.12, xerr=[[m["diff"] - m["lo"]], [m["hi"] - m["diff"]]], fmt="D",
                    ms=5, color="k", capsize=3, label=_once(named, "over seeds"))
        margin = c.get("margin") or 0.0
        if margin:
            ax.plot([-margin] * 2, [y - 0.4, y + 0.4], color="k", ls=":", lw=1)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(paired)))
    ax.set_yticklabels([c["claim"].split(" by >=")[0] for c in reversed(paired)], fontsize=7)
    ax.set_xlabel("held-out BpB, first row minus second (95% paired bootstrap over the documents)", fontsize=8)
    ax.set_title("Paired claims (dotted: the claim's margin; a claim holds left of it)", fontsize=9)
    return _save(fig, ax, path, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _ft_plot(curves: dict, refs: dict, path: Path, at: str, window: int = 10) -> Path:
    """One panel per finetuned row, one line per seed: the training loss in BpB, a moving mean over `window`
    steps (the raw points faint behind it); `at`: the finetuning step, for the title."""
    import matplotlib.pyplot as plt

    keys = [k for k in FT_ROWS if k in curves]
    fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.4), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], keys):
        for i, (seed, pts) in enumerate(sorted(curves[k].items())):
            xs, ys = zip(*pts)
            sm = [statistics.fmean(ys[max(0, n - window + 1):n + 1]) for n in range(len(ys))]
            ax.plot(xs, ys, color=f"C{i}", lw=0.5, alpha=0.25)
            ax.plot(xs, sm, color=f"C{i}", lw=1.4, label=f"seed {seed}")
        ax.axhline(refs["residue_unigram"]["bpb"], color="k", ls="--", lw=1, label="residue unigram (validation)")
        ax.set_title(label(k), fontsize=9)
        ax.set_xlabel("finetuning step")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("training loss, bits per byte")
    lo = min(v for k in keys for pts in curves[k].values() for _, v in pts)
    axes[0][0].set_ylim(lo - 0.1, refs["residue_unigram"]["bpb"] + 1.2)
    fig.suptitle(f"Finetuning runs of Table 1{' ' + at if at else ''} (training split, moving mean over {window} steps)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _unigram_lines(ax, refs: dict) -> None:
    """The two training-free lines of a split: the residue unigram and the new BPE's token unigram."""
    ax.axhline(refs["residue_unigram"]["bpb"], color="k", ls="--", lw=1, label="residue unigram")
    ax.axhline(refs["unigram_bpe"]["bpb"], color="k", ls=":", lw=1, label="512-BPE unigram")


def _save(fig, ax, path: Path, **legend) -> Path:
    """Legend (``legend``: its placement; default: inside, small), layout, PNG, figure closed."""
    import matplotlib.pyplot as plt

    ax.legend(**{"fontsize": 8, **legend})
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _without_documents(x):
    """``results`` without the per-document scores (they stay in the arms' records: results.json stays small)."""
    if isinstance(x, dict):
        return {k: _without_documents(v) for k, v in x.items() if k != "documents"}
    if isinstance(x, list):
        return [_without_documents(v) for v in x]
    return x


def write_outputs(results: dict, out: Path) -> dict[str, Path]:
    from s2t2_dist.api import atomic_write_json, atomic_write_text

    pl = plots(results, out)
    paths = {"results": out / "results.json", "table": out / "table1.md", "report": out / "report.md",
             **{f"plot {k}": p for k, p in pl.items()}}
    atomic_write_json(paths["results"], _without_documents(results))
    atomic_write_text(paths["table"], table1_markdown(results))
    atomic_write_text(paths["report"], report_markdown(results, pl, out))
    return paths
