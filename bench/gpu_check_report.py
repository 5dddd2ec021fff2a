"""One JSON from bench/gpu_check.sh's work folder: each item's exit code and seconds, the benches' JSON, the stage
runs' throughput (tokens/s over the logging intervals after the first, which holds start-up), and the ratios the
issues target (stage 1 at v = 50,280 over v = 243; stage 1 over the bare step).

    python -m bench.gpu_check_report WORK_DIR OUT.json
"""
import json
import re
import sys
from pathlib import Path

from bench.gpu_smoke import stage_stats
from s2t2_dist.api import fallbacks, text


def _json(p: Path):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def main() -> None:
    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    logs = work / "logs"
    res = {"gpu": (logs / "gpu.txt").read_text().strip() if (logs / "gpu.txt").is_file() else None,
           "versions": (logs / "versions.txt").read_text().strip() if (logs / "versions.txt").is_file() else None,
           "items": {}}
    for rc in sorted(logs.glob("*.rc")):
        name = rc.stem
        secs = logs / f"{name}.secs"
        res["items"][name] = {"rc": rc.read_text().strip(), "seconds": int(secs.read_text()) if secs.is_file() else None}
    res["smoke"] = _json(logs / "smoke.json")
    res["sinkhorn"] = _json(logs / "sinkhorn.json")
    res["sinkhorn_50280"] = _json(logs / "sinkhorn_50280.json")
    res["kernel_diag"] = _json(logs / "kernel_diag.json")
    res["bare"] = _json(logs / "bare.json")
    res["finetune"] = {e: _json(logs / f"finetune_{e}.json") for e in ("fsdp", "zero3")
                       if (logs / f"finetune_{e}.json").is_file()} or None
    c2 = logs / "C2.log"
    if c2.is_file():
        res["product_rows"] = [line for line in c2.read_text().splitlines() if re.match(r"\| (shipped|moved) ", line)]
    for name in ("tr1", "tr2"):
        run = work / name
        if (run / "tb").is_dir():
            st = stage_stats(run)
            r = _json(run / "result.json") or {}
            st["startup"] = r.get("startup")
            res[name] = st
    tps = {k: (res.get(k) or {}).get("tokens_per_s") for k in ("tr1", "tr2")}
    if tps["tr1"] and tps["tr2"]:
        res["stage1_v50280_over_v243"] = tps["tr2"] / tps["tr1"]
    if tps["tr1"] and res["bare"]:
        res["stage1_v243_over_bare"] = tps["tr1"] / res["bare"]["tokens_per_s"]
    res["routes"] = routes(work, {"C1": res["sinkhorn"], "C1b": res["sinkhorn_50280"]})
    fell = [f"{run} {line}" for run, s in res["routes"].items() for line in fallbacks(s)]
    res["fallbacks"] = fell
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k in ("items", "stage1_v50280_over_v243",
                                                            "stage1_v243_over_bare")}))
    for run, s in res["routes"].items():
        print(f"routes {run}: {text(s)}")
    if not res["routes"]:
        print("routes: none recorded (no stage run or Sinkhorn bench finished)")
    if fell:
        print("CHECK FAILED: a route fell back: " + "; ".join(fell))
    return 1 if fell else 0


def routes(work: Path, benches: dict[str, dict | None]) -> dict:
    """{run: routes summary} of the stage-1 runs (their result.json) and the Sinkhorn benches ({item: its JSON})."""
    out = {}
    for name, rj in (("A translate", work / "smoke" / "runs" / "translate" / "result.json"),
                     ("B1", work / "tr1" / "result.json"), ("B2", work / "tr2" / "result.json")):
        r = _json(rj)
        if r and r.get("routes"):
            out[name] = r["routes"]
    for name, bench in benches.items():
        if bench and bench.get("routes"):
            out[name] = bench["routes"]
    return out


if __name__ == "__main__":
    sys.exit(main())
