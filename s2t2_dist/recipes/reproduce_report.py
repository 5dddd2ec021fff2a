"""Results of `s2t2 reproduce`: gather the runs' result files, aggregate over seeds, check the paper's claims,
write results.json, table1.md, the plots (matplotlib, Agg) and report.md.

Works the same on local runs and, with `--collect`, on the paper-scale runs a cluster produced (same layout).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from s2t2_dist.recipes.orchestrate import manifest_bytes_per_token, tb_scalars
from s2t2_dist.recipes.paper_plan import KINDS, PAPER_TABLE1, TABLE1, Job, ReproduceConfig, Setting, alpha_tag

LN2 = math.log(2)
COLUMN_NAMES = {
    "plain_p": "Plain P", "plain_p_cft": "Plain P + CFT", "sinkhorn_p": "Sinkhorn P",
    "sinkhorn_p_cft": "Sinkhorn P + CFT", "s2t2": "S2T2", "s2t2_cft": "S2T2 + CFT",
    "ft_orig_tok": "FT orig. tok.", "ft_new_tok": "FT new tok.", "fvt": "FVT start (untrained)",
    "s2t2_default": "S2T2 (shipped defaults)",
}
#: the columns of the table and its plot: the paper's Table 1 (S2T2 with the paper's literal recipe), S2T2 with the
#: shipped defaults and the training-free FVT start
COLUMNS = (*TABLE1, "s2t2_default", "fvt")
#: why the paper's FT orig. tok. BpB is 7.24: it equals log2 of its perplexity, i.e. bits per TOKEN
PAPER_ORIG_TOK_NOTE = (
    "The paper's FT orig. tok. BpB, 7.24, is log2(151.05) = 7.239 exactly: log2 of that column's own perplexity, "
    "i.e. bits per token of OLMo's tokenizer, not per byte (every other column's BpB is below log2 of its "
    "perplexity, as it must be with more than one byte per token). This project counts real UTF-8 bytes for every "
    "column, so its FT orig. tok. BpB is comparable with the others and not with the paper's 7.24.")
METRICS = ("perplexity", "bpb", "nll_per_token")


def _stats(values: list[float]) -> dict:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"n": 0, "values": []}
    return {"mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "n": len(vals), "values": vals}


def _metrics_of(job: Job, result: dict) -> dict | None:
    m = result.get("metrics") if job.stage == "evaluate" else result.get("eval")
    return m or None


def _read(path: str) -> dict | None:
    p = Path(path)
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


def p_stats(p_file: str) -> dict | None:
    """Sparsity of a learned P: density (non-zeros / (v u)), non-zeros per target column, entropy H(P)."""
    from s2t2_dist.api import load_p

    if not Path(p_file).is_file():
        return None
    return load_p(p_file).stats()


def _override(job: Job, key: str) -> str | None:
    for o in job.overrides:
        if o.startswith(key + "="):
            return o.split("=", 1)[1]
    return None


def collect(cfg: ReproduceConfig, jobs: list[Job], st: Setting, extra: dict | None = None) -> dict:
    per_run: dict = {}
    missing = []
    table: dict[str, dict[str, list]] = {m: {k: [] for k in METRICS} for m in COLUMNS}
    transfer: dict[str, dict[str, list]] = {}
    random_guess = {}
    for j in jobs:
        r = _read(j.result)
        if r is None:
            missing.append(j.name)
            continue
        entry = {"stage": j.stage, "run_dir": j.run_dir}
        if j.stage == "translate":
            entry.update(final_loss=r.get("final_loss"), p_file=r.get("p_file"),
                         kind=_override(j, "translator.kind"), alpha=float(_override(j, "translator.alpha") or 0),
                         lr=float((r.get("resolved") or {}).get("lr") or "nan"))  # the lr the run used
            if r.get("p_file"):
                entry["P"] = p_stats(r["p_file"])
        m = _metrics_of(j, r) if j.stage != "translate" else None
        if m:
            entry["metrics"] = {k: m.get(k) for k in (*METRICS, "random_guess_nll_per_token", "random_guess_bpb",
                                                     "bytes_per_token", "docs", "tokens", "bytes")}
        if j.stage == "finetune":
            entry["export"] = r.get("export")
        per_run[j.name] = entry
        if j.role and m:
            what, key, _seed = j.role
            bucket = table if what == "table1" else transfer
            bucket.setdefault(key, {k: [] for k in METRICS})
            for k in METRICS:
                bucket[key][k].append(m.get(k))
            if what == "transfer":
                random_guess.setdefault(key, (m.get("random_guess_nll_per_token"), m.get("random_guess_bpb")))
            elif key in KINDS or key.endswith("_cft") or key == "ft_new_tok":
                random_guess.setdefault("new_tok_table1", (m.get("random_guess_nll_per_token"),
                                                           m.get("random_guess_bpb")))
    results: dict = {
        "scale": cfg.scale, "config": asdict(cfg), "missing_runs": missing, "runs": per_run,
        "table1": {k: {mm: _stats(v[mm]) for mm in METRICS} for k, v in table.items()},
        "transfer": {k: {mm: _stats(v[mm]) for mm in METRICS} for k, v in transfer.items()},
        "random_guess": {k: {"nll_per_token": a, "bpb": b} for k, (a, b) in random_guess.items()},
        "paper_table1": {k: {"perplexity": a, "bpb": b} for k, (a, b) in PAPER_TABLE1.items()},
    }
    results["sparsity"] = _sparsity(cfg, jobs, per_run)
    results["curves"] = _curves(cfg, jobs, st)
    if extra:
        results.update(extra)
    results["checks"] = checks(results)
    return results


def _sparsity(cfg: ReproduceConfig, jobs: list[Job], per_run: dict) -> dict:
    """P statistics per (translator kind, alpha, lr; the FVT start apart), mean over seeds; the transfer runs give P
    vs alpha. Density counts non-zeros; max_weight_mean and col_entropy_mean are mass-based (W = P / nu)."""
    groups: dict[str, tuple[dict, list[dict]]] = {}
    for j in jobs:
        e = per_run.get(j.name)
        if j.stage != "translate" or not e or not e.get("P"):
            continue
        fvt, default = "translate_fvt" in j.name, "translate_s2t2_default" in j.name
        tag = "fvt_" if fvt else "default_" if default else ""
        key = f"{tag}{e['kind']}_{alpha_tag(e['alpha'])}_lr{e['lr']:g}"
        groups.setdefault(key, ({"fvt": fvt, "default": default, "alpha": e["alpha"], "lr": e["lr"]}, [])
                          )[1].append(e["P"])
    out = {}
    for key, (info, ps) in groups.items():
        out[key] = {k: _stats([p[k] for p in ps if p.get(k) is not None])
                    for k in ("density", "col_nnz_mean", "entropy", "max_weight_mean", "col_entropy_mean")}
        out[key].update(kind=ps[0]["kind"], v=ps[0]["v"], u=ps[0]["u"], entropy_uniform=ps[0]["entropy_uniform"],
                        **info)
    return out


def _curves(cfg: ReproduceConfig, jobs: list[Job], st: Setting) -> dict:
    """train/loss curves (TensorBoard event files) of the P runs (alpha 0) and the finetuning runs, per seed."""
    curves: dict = {"translate": {}, "finetune": {}, "bytes_per_token": {}}
    for split in ("new", "source"):
        try:
            curves["bytes_per_token"][split] = manifest_bytes_per_token(f"{st.data}/shards/{split}/train")
        except (OSError, ValueError):
            pass
    for j in jobs:
        tb = Path(j.run_dir) / "tb" / "global"
        if not tb.is_dir():
            continue
        if (j.stage == "translate" and float(_override(j, "translator.alpha") or 0) == 0 and "transfer" not in j.name
                and "translate_fvt" not in j.name):
            method = ("s2t2_default" if "translate_s2t2_default" in j.name
                      else {v: k for k, v in KINDS.items()}[_override(j, "translator.kind")])
        elif j.stage == "finetune" and j.role:
            method = j.role[1]
        else:
            continue
        pts = tb_scalars(tb, "train/loss")
        if pts:
            curves[j.stage].setdefault(method, []).append(pts)
    return curves


# ----------------------------------------------------------------------------------------------------------------
# the paper's claims


def checks(results: dict) -> list[dict]:
    out = []

    def add(claim, ok, detail):
        out.append({"claim": claim, "held": ok, "detail": detail})

    t = results["table1"]
    have = [k for k in TABLE1 if t.get(k, {}).get("bpb", {}).get("n")]
    if len(have) < len(TABLE1):
        add("all Table 1 columns measured", False, f"missing: {sorted(set(TABLE1) - set(have))}")
        return out
    val = {k: {m: t[k][m]["mean"] for m in ("perplexity", "bpb")} for k in TABLE1}

    def fmt(k, m):
        return f"{COLUMN_NAMES[k]} {val[k][m]:.3f}" if m == "bpb" else f"{COLUMN_NAMES[k]} {val[k][m]:.2f}"

    for m in ("perplexity", "bpb"):
        best = min(TABLE1, key=lambda k: val[k][m])
        add(f"S2T2 + CFT has the best {m} of all columns"
            + (" (per token of each column's own tokenizer, as in the paper)" if m == "perplexity" else ""),
            best == "s2t2_cft",
            f"best: {fmt(best, m)}; S2T2 + CFT: {val['s2t2_cft'][m]:.3f}")
    for m in ("perplexity", "bpb"):
        ok = val["s2t2"][m] < min(val["plain_p"][m], val["sinkhorn_p"][m])
        add(f"S2T2 (P only) beats Plain P and Sinkhorn P on {m}", ok,
            ", ".join(fmt(k, m) for k in ("s2t2", "plain_p", "sinkhorn_p")))
    for m in ("perplexity", "bpb"):
        add(f"S2T2 (P only, no finetuning) beats FT orig. tok. on {m}", val["s2t2"][m] < val["ft_orig_tok"][m],
            ", ".join(fmt(k, m) for k in ("s2t2", "ft_orig_tok")))
        add(f"S2T2 + CFT beats FT new tok. on {m}", val["s2t2_cft"][m] < val["ft_new_tok"][m],
            ", ".join(fmt(k, m) for k in ("s2t2_cft", "ft_new_tok")))
    others = [val[k]["bpb"] for k in TABLE1 if k != "ft_orig_tok"]
    ratio = val["ft_orig_tok"]["bpb"] / max(others)
    add("FT orig. tok. has by far the worst BpB (paper: 7.24 vs <= 4.09, x1.77 the worst other column)",
        ratio > 1.2, f"FT orig. tok. {val['ft_orig_tok']['bpb']:.3f} vs worst other {max(others):.3f} "
                     f"(x{ratio:.2f}); best other {min(others):.3f}")
    uni = results.get("unigram") or {}
    if uni:
        for k, split in (("s2t2_cft", "new"), ("ft_new_tok", "new"), ("ft_orig_tok", "source")):
            add(f"{COLUMN_NAMES[k]} beats the unigram reference of its tokenizer (BpB)", val[k]["bpb"] < uni[split]["bpb"],
                f"{val[k]['bpb']:.3f} vs unigram {uni[split]['bpb']:.3f} bits/byte")
    for k in KINDS:
        add(f"finetuning improves {COLUMN_NAMES[k]} (BpB)", val[f"{k}_cft"]["bpb"] < val[k]["bpb"],
            f"{fmt(k, 'bpb')} -> {fmt(k + '_cft', 'bpb')}")
    src = results.get("sources")
    if src and src["small"].get("val_loss") is not None and src["large"].get("val_loss") is not None:
        a, b = src["small"]["val_loss"], src["large"]["val_loss"]
        add("transfer premise: the large source LM is better on English than the small one", b < a,
            f"English validation loss: small {a:.3f}, large {b:.3f} nats/byte")
    tr = results["transfer"]
    rg = results["random_guess"]
    s2 = {k: v for k, v in tr.items() if k.startswith("s2t2_") and v.get("nll_per_token", {}).get("n")}
    if s2 and "new_tok" in tr and "orig_tok" in tr:
        best_k = min(s2, key=lambda k: s2[k]["nll_per_token"]["mean"])
        a0 = s2.get("s2t2_a0") or s2[best_k]
        rg_nll = next((v[0] for k, v in ((k, (x["nll_per_token"], x["bpb"])) for k, x in rg.items())
                       if k.startswith("s2t2_")), None)
        for label, ent in (("S2T2 (alpha 0)", a0), (f"best S2T2 ({best_k})", s2[best_k])):
            loss = ent["nll_per_token"]["mean"]
            nt, ot = tr["new_tok"]["nll_per_token"]["mean"], tr["orig_tok"]["nll_per_token"]["mean"]
            add(f"transfer: {label} beats New Tok., Orig Tok. and random guess (eval loss per token, as Figure 2)",
                loss < nt and loss < ot and (rg_nll is None or loss < rg_nll),
                f"{loss:.3f} vs New Tok. {nt:.3f}, Orig Tok. {ot:.3f}, random guess {rg_nll:.3f} nats/token")
            b, nb, ob = ent["bpb"]["mean"], tr["new_tok"]["bpb"]["mean"], tr["orig_tok"]["bpb"]["mean"]
            add(f"transfer: {label} beats New Tok. and Orig Tok. in BpB", b < nb and b < ob,
                f"{b:.3f} vs New Tok. {nb:.3f}, Orig Tok. {ob:.3f} bits/byte")
    return out


# ----------------------------------------------------------------------------------------------------------------
# outputs


def _pm(s: dict, f: str) -> str:
    if not s or not s.get("n"):
        return "—"
    if s["n"] == 1:
        return format(s["mean"], f)
    return f"{format(s['mean'], f)} ± {format(s['std'], f)}"


def table1_markdown(results: dict) -> str:
    t = results["table1"]
    n = max((t.get(k, {}).get("bpb", {}).get("n", 0) for k in TABLE1), default=0)
    head = "| | " + " | ".join(f"**{COLUMN_NAMES[k]}**" for k in COLUMNS) + " |"
    sep = "|---|" + "---:|" * len(COLUMNS)
    paper = {k: PAPER_TABLE1.get(k, (None, None)) for k in COLUMNS}  # FVT: not in the paper
    rows = ["| **Perp.** | " + " | ".join(_pm(t.get(k, {}).get("perplexity"), ".2f") for k in COLUMNS) + " |",
            "| **BpB** | " + " | ".join(_pm(t.get(k, {}).get("bpb"), ".3f") for k in COLUMNS) + " |",
            "| *paper perp.* | " + " | ".join(f"*{paper[k][0]:.2f}*" if paper[k][0] else "—" for k in COLUMNS)
            + " |",
            "| *paper BpB* | " + " | ".join(f"*{paper[k][1]:.2f}*" if paper[k][1] else "—" for k in COLUMNS) + " |"]
    spread = "mean ± standard deviation over" if n > 1 else "one run per column,"
    uni = results.get("unigram") or {}
    if uni:
        rows.append("| *unigram ref.* | " + " | ".join(
            f"*{uni['source' if k == 'ft_orig_tok' else 'new']['perplexity']:.2f} / "
            f"{uni['source' if k == 'ft_orig_tok' else 'new']['bpb']:.3f}*" for k in COLUMNS) + " |")
    return "\n".join([head, sep, *rows, "",
                      f"Held-out protein sequences; {spread} {n} seed(s). Perplexity per token of each column's "
                      "tokenizer; BpB = total NLL / (ln 2 x UTF-8 bytes). Paper: OLMo-1B on UniRef50 (Table 1). "
                      "S2T2 (shipped defaults): the config's translator section (null keys: the kind's defaults; the "
                      "FVT plan blended half-and-half with the uniform one, source marginal mu = that start's row "
                      "sums, weights below 1/v dropped, entropy weight 0.3, lr in units of 1/v; no dense warm-up), "
                      "P only; the S2T2 column uses the paper's literal recipe. "
                      "FVT start (not in the paper): S2T2's training-free surface-string start (translator.init=fvt, "
                      "init_weight 1: each target token's pieces as source tokens), as the translate stage builds it: "
                      "mu is the plan's own row sums (translator.source_marginal=start), so the plan is feasible and "
                      "the projection keeps its few source tokens per target token (see its sparsity under P); "
                      "P only, not trained, the plan bench/bench_real_model.py's FVT row evaluates. "
                      + PAPER_ORIG_TOK_NOTE
                      + (" Unigram ref. (perplexity / BpB): a model that knows only the train split's token "
                         "frequencies, for the column's tokenizer." if uni else "")])


def transfer_markdown(results: dict) -> str:
    tr = results["transfer"]
    order = sorted((k for k in tr if k.startswith("s2t2_")), key=lambda k: float(k.split("_a")[1]))
    order += [k for k in ("new_tok", "orig_tok") if k in tr]
    rg = next(iter(v for k, v in results["random_guess"].items() if k.startswith("s2t2_")), None)
    lines = ["| large model initialised with | eval loss (nats/token) | perplexity | BpB |", "|---|---:|---:|---:|"]
    names = {"new_tok": "New Tok. (truncated E, L)", "orig_tok": "Orig Tok. (its own byte tokenizer)"}
    for k in order:
        name = names[k] if k in names else f"S2T2-alpha={k.split('_a')[1]} (P from the small model)"
        lines.append(f"| {name} | {_pm(tr[k]['nll_per_token'], '.3f')} | {_pm(tr[k]['perplexity'], '.2f')} | "
                     f"{_pm(tr[k]['bpb'], '.3f')} |")
    if rg:
        lines.append(f"| random guess (ln u) | {rg['nll_per_token']:.3f} | {math.exp(rg['nll_per_token']):.2f} | "
                     f"{rg['bpb']:.3f} |")
    uni = (results.get("unigram") or {}).get("new")
    if uni:
        lines.append(f"| unigram ref. (new tokenizer's train frequencies) | {uni['nll_per_token']:.3f} | "
                     f"{uni['perplexity']:.2f} | {uni['bpb']:.3f} |")
    return "\n".join(lines)


#: line style and name of each tokenizer's unigram reference in the plots
_UNIGRAM_STYLE = {"new": (":", "new tokenizer"), "source": ("-.", "byte tokenizer")}


def _unigram_lines(ax, results: dict, metric: str, splits: tuple[str, ...]) -> None:
    """Horizontal reference lines: the unigram model of each tokenizer in `splits` (when the results have it)."""
    uni = results.get("unigram") or {}
    for split in splits:
        if split in uni:
            ls, what = _UNIGRAM_STYLE[split]
            ax.axhline(uni[split][metric], color="k", ls=ls, lw=1, label=f"unigram ref. ({what})")


def plots(results: dict, out_dir: Path) -> dict[str, Path]:  # noqa: C901 - one panel per figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    colors = {"plain_p": "tab:gray", "sinkhorn_p": "tab:blue", "s2t2": "tab:green", "plain_p_cft": "tab:gray",
              "sinkhorn_p_cft": "tab:blue", "s2t2_cft": "tab:green", "ft_orig_tok": "tab:purple",
              "ft_new_tok": "tab:orange", "fvt": "tab:brown", "s2t2_default": "tab:olive"}

    # loss curves ----------------------------------------------------------------------------------------------
    c = results["curves"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rg = results["random_guess"].get("new_tok_table1")
    for method, runs in c["translate"].items():
        _band(axes[0], runs, COLUMN_NAMES[method], colors[method])
    if rg:
        axes[0].axhline(rg["nll_per_token"], color="red", ls="--", lw=1, label="random guess (ln u)")
    axes[0].set(title="Stage 1: learning P through the frozen small LM", xlabel="step",
                ylabel="train loss (nats / target token)")
    axes[0].legend(fontsize=8)
    bpt = c.get("bytes_per_token", {})
    for method, runs in c["finetune"].items():
        split = "source" if method == "ft_orig_tok" else "new"
        scale = 1.0 / (LN2 * bpt[split]) if bpt.get(split) else None
        if scale is None:
            continue
        _band(axes[1], [[(s, v * scale) for s, v in r] for r in runs], COLUMN_NAMES[method], colors[method],
              ls="-" if method.endswith("_cft") else "--")
    if rg:
        axes[1].axhline(rg["bpb"], color="red", ls="--", lw=1, label="random guess (new tokenizer)")
    _unigram_lines(axes[1], results, "bpb", ("new", "source"))
    axes[1].set(title="Stage 2: finetuning (same step budget)", xlabel="step",
                ylabel="train loss (bits / byte, split average)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    paths["loss_curves"] = out_dir / "loss_curves.png"
    fig.savefig(paths["loss_curves"], dpi=120)
    plt.close(fig)

    # transfer (Figure 2) ----------------------------------------------------------------------------------------
    tr = results["transfer"]
    order = sorted((k for k in tr if k.startswith("s2t2_")), key=lambda k: float(k.split("_a")[1]))
    order += [k for k in ("new_tok", "orig_tok") if k in tr]
    if order:
        labels = [f"S2T2-{k.split('_a')[1]}" if k.startswith("s2t2_") else
                  {"new_tok": "New Tok.", "orig_tok": "Orig Tok."}[k] for k in order]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        rgt = next(iter(v for k, v in results["random_guess"].items() if k.startswith("s2t2_")), None)
        for ax, metric, ylabel, line in ((axes[0], "nll_per_token", "eval loss (nats / token)", "nll_per_token"),
                                         (axes[1], "bpb", "bits per byte", "bpb")):
            means = [tr[k][metric].get("mean", float("nan")) for k in order]
            errs = [tr[k][metric].get("std", 0.0) for k in order]
            cols = ["tab:green" if k.startswith("s2t2_") else "tab:orange" if k == "new_tok" else "tab:purple"
                    for k in order]
            bars = ax.bar(range(len(order)), means, yerr=errs, color=cols, capsize=4)
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
            if rgt:
                ax.axhline(rgt[line], color="red", ls="--", lw=1.5, label="random guess (ln u, new tokenizer)")
            _unigram_lines(ax, results, line, ("new",))
            ax.legend(fontsize=8, loc="upper left")
            ax.set_xticks(range(len(order)), labels, rotation=20)
            ax.set(ylabel=ylabel)
        axes[0].set_title("Transfer: P learned on the small LM, applied to the large LM (no finetuning)")
        axes[1].set_title("same, in bits per byte (comparable across tokenizers)")
        fig.tight_layout()
        paths["transfer"] = out_dir / "transfer.png"
        fig.savefig(paths["transfer"], dpi=120)
        plt.close(fig)

    # sparsity vs alpha ----------------------------------------------------------------------------------------
    sp = results["sparsity"]
    lr_t = _transfer_lr_used(results)
    pts = sorted((v for v in sp.values() if v["kind"] == "sparse" and math.isclose(v["lr"], lr_t)
                  and not v["fvt"] and not v["default"]),
                 key=lambda v: v["alpha"])
    if pts:
        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        xs = [v["alpha"] for v in pts]
        for ax, key, ylabel in ((axes[0], "density", "density of P (non-zeros / (v u))"),
                                (axes[1], "entropy", "entropy H(P) (nats)"),
                                (axes[2], "max_weight_mean", "mean largest weight per column of W = P/nu")):
            if not pts[0][key].get("n"):
                continue
            ys = [v[key]["mean"] for v in pts]
            es = [v[key]["std"] for v in pts]
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=4, color="tab:green", label="S2T2 (sparse)")
            # the unconstrained P is not a distribution (signed entries): no entropy reference for it
            refs = (("softmax", "tab:blue"),) + ((("unconstrained", "tab:gray"),) if key == "density" else ())
            for kind, col in refs:
                ref = [v for v in sp.values() if v["kind"] == kind and v["alpha"] == 0 and not v["fvt"] and not v["default"]]
                if ref and ref[0].get(key, {}).get("n"):
                    ax.axhline(ref[0][key]["mean"], color=col, ls=":", label=f"{kind} P (alpha 0)")
            if key == "entropy":
                ax.axhline(pts[0]["entropy_uniform"], color="k", ls="--", lw=0.8, label="uniform P (= init)")
            ax.set_xscale("symlog", linthresh=min([a for a in xs if a > 0], default=0.01))
            ax.set(xlabel="entropy weight alpha", ylabel=ylabel)
            ax.legend(fontsize=8)
        axes[0].set_title("Sparsity of P vs the entropy weight alpha")
        axes[1].set_title("Entropy of P vs alpha (lower: sparser)")
        axes[2].set_title("Mass-based sparsity vs alpha (1: one source per target)")
        fig.tight_layout()
        paths["sparsity"] = out_dir / "sparsity_vs_alpha.png"
        fig.savefig(paths["sparsity"], dpi=120)
        plt.close(fig)

    # Table 1 as bars --------------------------------------------------------------------------------------------
    t = results["table1"]
    keys = [k for k in COLUMNS if t.get(k, {}).get("bpb", {}).get("n")]
    if keys:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for ax, metric, f in ((axes[0], "perplexity", "%.1f"), (axes[1], "bpb", "%.3f")):
            means = [t[k][metric]["mean"] for k in keys]
            errs = [t[k][metric]["std"] for k in keys]
            bars = ax.bar(range(len(keys)), means, yerr=errs, capsize=4, color=[colors[k] for k in keys])
            for b, k in zip(bars, keys):
                b.set_alpha(0.5 if k in KINDS or k in ("fvt", "s2t2_default") else 1.0)
            ax.bar_label(bars, fmt=f, fontsize=8)
            ax.set_xticks(range(len(keys)), [COLUMN_NAMES[k] for k in keys], rotation=30, ha="right")
            ax.set(ylabel=metric if metric != "bpb" else "bits per byte")
            if rg:
                ax.axhline(math.exp(rg["nll_per_token"]) if metric == "perplexity" else rg["bpb"], color="red",
                           ls="--", lw=1, label="random guess (new tokenizer)")
            # per-token perplexities of the two tokenizers are not comparable: the byte one only in BpB
            _unigram_lines(ax, results, metric, ("new", "source") if metric == "bpb" else ("new",))
            ax.legend(fontsize=8)
        axes[0].set_title("Table 1 (lower is better; pale: P only, no finetuning)")
        fig.tight_layout()
        paths["table1"] = out_dir / "table1.png"
        fig.savefig(paths["table1"], dpi=120)
        plt.close(fig)
    return paths


def _transfer_lr_used(results: dict) -> float:
    cfg = results["config"]
    if results.get("transfer_p_lr_used") is not None:
        return float(results["transfer_p_lr_used"])
    return float(cfg["transfer_p_lr"] if cfg.get("transfer_p_lr") is not None else cfg["p_lr"])


def _p_lrs(results: dict) -> dict:
    return results.get("p_lr_by_kind") or {k: results["config"]["p_lr"] for k in KINDS.values()}


def _band(ax, runs, label, color, ls="-"):
    """Mean over seeds of curves logged at the same steps, with a min-max band."""
    steps = sorted(set.intersection(*(set(s for s, _ in r) for r in runs))) if runs else []
    if not steps:
        return
    vals = [[dict(r)[s] for r in runs] for s in steps]
    mean = [statistics.fmean(v) for v in vals]
    ax.plot(steps, mean, color=color, ls=ls, label=label + (f" (mean of {len(runs)})" if len(runs) > 1 else ""))
    if len(runs) > 1:
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.15)


def report_markdown(results: dict, plot_paths: dict[str, Path], out: Path) -> str:
    cfg = results["config"]
    lines = [f"# S2T2 reproduction — scale `{results['scale']}`", ""]
    src = results.get("sources")
    if src:
        s, l = src["small"], src["large"]
        lines += [
            f"Source LMs (real, pretrained here by `models.pretrain_english` on the shipped Shakespeare text, byte "
            f"vocabulary, OLMo architecture): small = {s['recipe']['n_layers']} layers x {s['recipe']['d_model']} "
            f"({s['params']:,} parameters, English validation loss {s['val_loss']:.3f} nats/byte); large = "
            f"{l['recipe']['n_layers']} layers x {l['recipe']['d_model']} ({l['params']:,} parameters, "
            f"{l['val_loss']:.3f} nats/byte). Table 1 uses the small model; the transfer applies its P to the "
            "large one.", ""]
    ds = results.get("data_summary")
    if ds:
        bpt = ds.get("bytes_per_token", {})
        lines += [f"Target: the shipped protein sample ({ds['train_records']} train / {ds['eval_records']} held-out "
                  f"sequences); new BPE u = {cfg['vocab_size']} ({_f(bpt.get('new'))} residues per token; the "
                  f"source byte tokenizer: {_f(bpt.get('source'))}).", ""]
    lrs = _p_lrs(results)
    lr_txt = ", ".join(f"{k} {v:g}" for k, v in lrs.items())
    lines += [f"Budget per method: P {cfg['p_steps']} steps (lr: {lr_txt}), finetuning {cfg['ft_steps']} "
              f"steps (lr {cfg['ft_lr']:g}, weight decay {cfg['ft_weight_decay']:g}), batch {cfg['batch_size']} x "
              f"{cfg['context_len']} tokens, seeds {cfg['seeds']}; transfer P: lr {_transfer_lr_used(results):g}, "
              f"alphas {cfg['alphas']}.", ""]
    sel = results.get("lr_selection")
    if sel:
        lrs_all = sorted({lr for t in sel["final_train_loss"].values() for lr in t}, key=float)
        lines += ["P learning rate chosen per translator by its final training loss (" + sel["criterion"] + "):", "",
                  "| translator | " + " | ".join(f"lr {x}" for x in lrs_all) + " |",
                  "|---|" + "---:|" * len(lrs_all)]
        for kind, t in sel["final_train_loss"].items():
            cells = [(f"**{t[x]:.4f}**" if float(x) == sel["chosen"][kind] else f"{t[x]:.4f}") if x in t else "—"
                     for x in lrs_all]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    if results.get("missing_runs"):
        lines += [f"**Missing runs** (not finished): {', '.join(results['missing_runs'])}", ""]
    lines += ["## Table 1", "", table1_markdown(results), ""]
    if "table1" in plot_paths:
        lines += [f"![Table 1]({plot_paths['table1'].relative_to(out)})", ""]
    lines += ["## Does the paper's ordering hold?", ""]
    for c in results["checks"]:
        lines.append(f"- {'**held**' if c['held'] else '**NOT held**'}: {c['claim']} — {c['detail']}")
    lines += ["", "## Transfer (Figure 2)", "", transfer_markdown(results), ""]
    for key, title in (("transfer", "Transfer"), ("sparsity", "Sparsity of P vs alpha"),
                       ("loss_curves", "Loss curves")):
        if key in plot_paths:
            lines += [f"![{title}]({plot_paths[key].relative_to(out)})", ""]
    sp = results["sparsity"]
    if sp:
        lines += ["## P", "", "| translator | alpha | lr | density | non-zeros per target token | H(P) (uniform) | "
                  "mean largest weight of W = P/nu | column entropy of W (uniform) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for k, v in sorted(sp.items(), key=lambda kv: (kv[1]["kind"], kv[1]["alpha"])):
            name = ("FVT start (no training)" if v["fvt"] else "sparse (shipped defaults, lr: the measured default)"
                    if v["default"] else v["kind"])
            lines.append(f"| {name} | {v['alpha']:g} | {v['lr']:g} | {_pm(v['density'], '.3f')} | "
                         f"{_pm(v['col_nnz_mean'], '.1f')} of {v['v']} | {_pm(v['entropy'], '.2f')} "
                         f"({v['entropy_uniform']:.2f}) | {_pm(v.get('max_weight_mean'), '.3f')} | "
                         f"{_pm(v.get('col_entropy_mean'), '.2f')} ({math.log(v['v']):.2f}) |")
        lines += ["", "Density counts non-zeros; the mass-based columns read W = P / nu (each target column sums to "
                  "one): a mean largest weight of 1.0 means every target token reads one source token, whatever "
                  "the non-zero count.", ""]
    secs = results.get("seconds")
    if secs:
        lines += ["## Time", "", ", ".join(f"{k} {v:.0f} s" for k, v in secs.items()) +
                  f" ({results.get('ranks', 1)} rank(s) per run).", ""]
    lines += ["## Files", "", "- `results.json`: every number above, per seed, with each run's directory",
              "- `runs/`: each stage run (config.yaml, TensorBoard logs under tb/, result JSON); "
              "`tensorboard --logdir runs`", "- `plan.json`: every stage run with its config and overrides", ""]
    return "\n".join(lines)


def _f(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def write_outputs(results: dict, out: Path) -> dict[str, Path]:
    from s2t2_dist.api import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    plot_paths = plots(results, out / "plots")
    results["plots"] = {k: str(p) for k, p in plot_paths.items()}
    atomic_write_json(out / "results.json", results)
    atomic_write_text(out / "table1.md", table1_markdown(results) + "\n")
    atomic_write_text(out / "report.md", report_markdown(results, plot_paths, out))
    return {"results": out / "results.json", "table": out / "table1.md", "report": out / "report.md",
            **{f"plot {k}": p for k, p in plot_paths.items()}}
