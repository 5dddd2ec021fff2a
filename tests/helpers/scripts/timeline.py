"""Summarise a S2T2_TEST_TIMELINE file (tests/conftest.py): per pytest-xdist worker, its tests, when it ended (seconds
after the first test started) and how long it ran tests, so an unbalanced `pytest -n 2` shows as one worker ending
long before the other.

    S2T2_TEST_TIMELINE=/tmp/tl.jsonl python -m pytest -q -n 2 tests
    python tests/helpers/scripts/timeline.py /tmp/tl.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    t0 = min(r["start"] for r in rows)
    by = defaultdict(list)
    for r in rows:
        by[r["worker"]].append(r)
    for worker, rs in sorted(by.items()):
        busy = sum(r["end"] - r["start"] for r in rs)
        last = max(rs, key=lambda r: r["end"])
        print(f"{worker}: {len(rs)} tests, ended at {last['end'] - t0:.0f} s ({last['test']}), ran tests {busy:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
