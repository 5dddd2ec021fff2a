"""BpB against the sparsity of P for every P of a bench_real_model.py output: one PNG, one table.

    python -m bench.plot_sparsity --out /tmp/rm --png docs/sparsity_tradeoff.png [--default ship,pship]

Every run directory OUT/runs/REGIME/NAME holding a P.safetensors is a point: its held-out BpB (the translate run's
result.json, or the evaluate run OUT/runs/REGIME/eval_NAME for P files written after the fact), its non-zeros per
target column, the mean largest weight and the mean entropy of the columns of W = P / nu (SparseP.stats). Names: the
bench's rows (see benchmarks/stage1_stories260k_cpu2_2026-11-27.md; fvt: no training; ~sN: seed N) and post-hoc
sparsifications of them (NAME_wT: weights below T dropped). Seeds of one row are drawn as one point: the mean, with
the range as bars."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def points(out: Path) -> list[dict]:
    from s2t2_dist.api import load_p

    pts = []
    for pf in sorted((out / "runs").glob("*/*/P.safetensors")):
        d = pf.parent
        res, ev = d / "result.json", d.parent / f"eval_{d.name}" / "eval.json"
        bpb = None
        if res.is_file():
            bpb = (json.loads(res.read_text()).get("eval") or {}).get("bpb")
        if bpb is None and ev.is_file():
            bpb = json.loads(ev.read_text())["metrics"]["bpb"]
        if bpb is None:
            continue
        st = load_p(pf).stats()
        pts.append({"regime": d.parent.name, "name": d.name, "bpb": bpb, "v": st["v"], "signed": st["signed"],
                    **{k: st[k] for k in ("density", "col_nnz_mean", "max_weight_mean", "col_entropy_mean")}})
    return pts


#: rows of bench_real_model.py that are baselines, not S2T2 candidates (drawn apart): the softmax and unconstrained
#: kinds, the paper's uniform start and the earlier defaults (`old`, `prev`: uniform source marginal,
#: no floor); p-prefixed: the protein runs
BASELINES = ("softmax", "softmax_fvt", "unconstrained", "unconstrained_fvt", "s2t2_uniform", "old", "prev",
             "psoftmax", "punc", "pold")
KEYS = ("bpb", "density", "col_nnz_mean", "max_weight_mean", "col_entropy_mean")


def unigram_lines(out: Path) -> dict:
    """The unigram row's BpB per regime from the bench's results*.json (it has no P file)."""
    lines = {}
    for f in sorted(out.glob("results*.json")):
        for reg, r in json.loads(f.read_text()).items():
            u = (r.get("rows") or {}).get("unigram") if isinstance(r, dict) else None
            if u and u.get("p_only") is not None:
                lines[reg] = u["p_only"]
    return lines


def grouped(pts: list[dict]) -> list[dict]:
    """One entry per (regime, row) over its seeds (runs NAME, NAME~s1, ...): the mean of every statistic, the
    standard deviation and range of BpB, and the number of seeds."""
    groups: dict = {}
    for p in pts:
        groups.setdefault((p["regime"], p["name"].split("~")[0]), []).append(p)
    out = []
    for (regime, base), ps in groups.items():
        g = {"regime": regime, "name": base, "n": len(ps), "v": ps[0]["v"], "signed": ps[0]["signed"],
             **{k: sum(p[k] for p in ps) / len(ps) for k in KEYS}}
        b = [p["bpb"] for p in ps]
        g["bpb_min"], g["bpb_max"] = min(b), max(b)
        g["bpb_std"] = (sum((x - g["bpb"]) ** 2 for x in b) / (len(b) - 1)) ** 0.5 if len(b) > 1 else 0.0
        for k in KEYS[1:]:
            g[k + "_range"] = (min(p[k] for p in ps), max(p[k] for p in ps))
        out.append(g)
    return out


def main(argv=None) -> int:  # noqa: C901 - a plotting script: one branch per option
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default="docs/sparsity_tradeoff.png")
    ap.add_argument("--default", default="ship,pship", help="the rows the shipped defaults take (marked), comma-separated")
    ap.add_argument("--rows", default="", help="only these rows (comma-separated names without ~sN; default: all)")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = grouped(points(Path(a.out)))
    if a.rows:
        pts = [p for p in pts if p["name"] in a.rows.split(",")]
    regimes = [r for r in ("v>d", "v<d", "protein") if any(p["regime"] == r for p in pts)]
    defaults = set(a.default.split(","))
    unigram = unigram_lines(Path(a.out))

    def style(name: str) -> tuple[str, str, str]:
        """(marker, colour, legend group) of a row."""
        if name in defaults:
            return "*", "tab:red", "shipped default"
        if name in BASELINES:
            return "^", "tab:green", "baseline (softmax, unconstrained, earlier defaults)"
        if name == "fvt":
            return "s", "tab:gray", "FVT, no training"
        if "_w" in name:
            return "x", "tab:gray", "sparsified after training"
        return "o", "tab:blue", "S2T2 candidate"

    fig, axes = plt.subplots(3, len(regimes), figsize=(5 * len(regimes), 12), squeeze=False)
    for c, reg in enumerate(regimes):
        ps = [p for p in pts if p["regime"] == reg]
        for r, (key, label) in enumerate((("col_nnz_mean", "non-zeros per target column (log)"),
                                          ("max_weight_mean", "mean largest weight of W = P/nu's columns"),
                                          ("col_entropy_mean", "mean column entropy of W = P/nu (nats)"))):
            ax = axes[r][c]
            seen = set()
            for p in ps:
                if p["signed"] and key != "col_nnz_mean":
                    continue  # the unconstrained W is signed and its columns do not sum to 1: no mass-based sparsity
                mark, colour, group = style(p["name"])
                lo, hi = p[key + "_range"]
                # error bars: the range over seeds (BpB and the statistic); none for a single seed
                ax.errorbar(p[key], p["bpb"], xerr=[[p[key] - lo], [hi - p[key]]],
                            yerr=[[p["bpb"] - p["bpb_min"]], [p["bpb_max"] - p["bpb"]]], fmt=mark,
                            ms=14 if mark == "*" else 6, color=colour, elinewidth=0.8, capsize=2,
                            label=None if group in seen else group)
                seen.add(group)
                ax.annotate(p["name"] + (f" ({p['n']} seeds)" if p["n"] > 1 else ""), (p[key], p["bpb"]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
            if key == "col_nnz_mean":
                ax.set_xscale("log")
                ax.axvline(0.05 * ps[0]["v"], color="k", ls=":", lw=0.8, label="5% non-zeros")
            elif key == "col_entropy_mean":
                ax.axvline(math.log(8), color="k", ls=":", lw=0.8, label="log 8")
            fvt = next((p["bpb"] for p in ps if p["name"] == "fvt"), None)
            if fvt:
                ax.axhline(fvt, color="tab:gray", ls="--", lw=0.8, label="FVT")
            if reg in unigram:  # no P: the floor a translation should beat (the proteins')
                ax.axhline(unigram[reg], color="tab:olive", ls="-.", lw=0.8, label="unigram (no model)")
            ax.set(xlabel=label, ylabel="held-out BpB", title=f"{reg} (v = {ps[0]['v']})")
            ax.legend(fontsize=6)
    fig.suptitle("S2T2 on stories260K: BpB against the sparsity of P (mean over seeds, bars: the range; star: the "
                 "shipped default)", fontsize=9)
    fig.tight_layout()
    Path(a.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=70)
    print("| regime | P | seeds | BpB (mean ± sd; range) | non-zeros | per column | max weight | col. entropy |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for p in sorted(pts, key=lambda p: (regimes.index(p["regime"]), p["bpb"])):
        bpb = (f"{p['bpb']:.3f} ± {p['bpb_std']:.3f}; {p['bpb_min']:.3f}-{p['bpb_max']:.3f}" if p["n"] > 1
               else f"{p['bpb']:.3f}")
        rng = lambda k, f: f.format(p[k]) if p["n"] == 1 else "-".join(f.format(x) for x in p[k + "_range"])  # noqa: E731
        mass = ("n/a (signed) | n/a (signed)" if p["signed"] else
                f"{rng('max_weight_mean', '{:.3f}')} | {rng('col_entropy_mean', '{:.2f}')}")
        print(f"| {p['regime']} | {p['name']} | {p['n']} | {bpb} | {rng('density', '{:.1%}')} | "
              f"{rng('col_nnz_mean', '{:.1f}')} | {mass} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
