"""Sum the fault ledgers of one or more runs of the reliability suite into the table of docs/reliability.md.

    for seed in 1 2 3; do
      S2T2_FAULTS_SEED=$seed S2T2_FAULTS_LEDGER=/tmp/ledger.jsonl python -m pytest tests/faults -q
    done
    python tests/helpers/scripts/ledger_table.py /tmp/ledger.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import OrderedDict


def table(lines: list[dict]) -> str:
    rows: OrderedDict[str, dict] = OrderedDict()
    for e in lines:
        r = rows.setdefault(e["fault"], {"n": 0, "lost": set(), "steps": []})
        r["n"] += int(e.get("count", 1))
        r["lost"].add(e.get("lost", "nothing"))
        if e.get("step") is not None:
            r["steps"].append(int(e["step"]))
    out = ["| fault | times injected | at steps | lost |", "|---|---:|---|---|"]
    for fault, r in rows.items():
        steps = ", ".join(str(s) for s in sorted(set(r["steps"]))) or "-"
        out.append(f"| {fault} | {r['n']} | {steps} | {'; '.join(sorted(r['lost']))} |")
    return "\n".join(out)


if __name__ == "__main__":
    entries = []
    for path in sys.argv[1:]:
        with open(path) as f:
            entries += [json.loads(line) for line in f if line.strip()]
    print(table(entries))
