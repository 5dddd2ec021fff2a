"""BpB against the sparsity of P for every P of a bench_real_model.py output (issue #24): one PNG, one table.

    python bench/plot_sparsity.py --out /tmp/rm --png docs/sparsity_tradeoff.png [--default w05,pw05]

Every run directory OUT/runs/REGIME/NAME holding a P.safetensors is a point: its held-out BpB (the translate run's
result.json, or the evaluate run OUT/runs/REGIME/eval_NAME for P files written after the fact), its non-zeros per
target column, the mean largest weight and the mean entropy of the columns of W = P / nu (SparseP.stats). Names: the
bench's rows (see BENCHMARKS.md "#24 (session 5)"; fvt: no training; ~sN: seed N) and post-hoc sparsifications of
them (NAME_wT: weights below T dropped)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def points(out: Path) -> list[dict]:
    from s2t2_dist.pfile import load_p

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
        pts.append({"regime": d.parent.name, "name": d.name, "bpb": bpb, "v": st["v"],
                    **{k: st[k] for k in ("density", "col_nnz_mean", "max_weight_mean", "col_entropy_mean")}})
    return pts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--png", default="docs/sparsity_tradeoff.png")
    ap.add_argument("--default", default="w05,pw05", help="the rows the shipped defaults take (marked), comma-separated")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = points(Path(a.out))
    regimes = [r for r in ("v>d", "v<d", "protein") if any(p["regime"] == r for p in pts)]
    defaults = set(a.default.split(","))
    fig, axes = plt.subplots(3, len(regimes), figsize=(5 * len(regimes), 12), squeeze=False)
    for c, reg in enumerate(regimes):
        ps = [p for p in pts if p["regime"] == reg]
        for r, (key, label) in enumerate((("col_nnz_mean", "non-zeros per target column (log)"),
                                          ("max_weight_mean", "mean largest weight of W = P/nu's columns"),
                                          ("col_entropy_mean", "mean column entropy of W = P/nu (nats)"))):
            ax = axes[r][c]
            for p in ps:
                base = p["name"].split("~")[0]
                trained = "_w" not in base and base != "fvt"
                mark = "*" if base in defaults else ("o" if trained else ("s" if base == "fvt" else "x"))
                ax.scatter(p[key], p["bpb"], marker=mark, s=160 if mark == "*" else 40,
                           color="tab:red" if mark == "*" else ("tab:blue" if trained else "tab:gray"))
                ax.annotate(p["name"], (p[key], p["bpb"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
            if key == "col_nnz_mean":
                ax.set_xscale("log")
                ax.axvline(0.05 * ps[0]["v"], color="k", ls=":", lw=0.8, label="5% non-zeros")
            elif key == "col_entropy_mean":
                ax.axvline(math.log(8), color="k", ls=":", lw=0.8, label="log 8")
            fvt = next((p["bpb"] for p in ps if p["name"] == "fvt"), None)
            if fvt:
                ax.axhline(fvt, color="tab:gray", ls="--", lw=0.8, label="FVT")
            ax.set(xlabel=label, ylabel="held-out BpB", title=f"{reg} (v = {ps[0]['v']})")
            ax.legend(fontsize=7)
    fig.suptitle("S2T2 on stories260K: BpB against the sparsity of P (star: the shipped default; o: trained; "
                 "x: sparsified after training)", fontsize=9)
    fig.tight_layout()
    Path(a.png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.png, dpi=70)
    print("| regime | P | BpB | non-zeros | per column | max weight | col. entropy |\n|---|---|---:|---:|---:|---:|---:|")
    for p in sorted(pts, key=lambda p: (regimes.index(p["regime"]), p["bpb"])):
        print(f"| {p['regime']} | {p['name']} | {p['bpb']:.3f} | {100 * p['density']:.1f}% | {p['col_nnz_mean']:.1f} "
              f"| {p['max_weight_mean']:.3f} | {p['col_entropy_mean']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
