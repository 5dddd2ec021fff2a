"""Which route the translator's device-dependent ops took in this process: the sparse Sinkhorn (the Triton kernels
or the torch steps, and why) and the plan product (the live-row kernels, the gathered live rows or the dense
GEMMs). A fallback (the torch steps on CUDA, the dense GEMMs for a sparse plan on CUDA) is a slower run, not an
error: stage 1 logs these at start-up and writes them into result.json and TensorBoard, so that it is seen.

Imports nothing heavy: the ops record into the dicts below as they choose (``record``).
"""
from __future__ import annotations

__all__ = ["ROUTES", "fallbacks", "merged", "record", "summary", "text"]

#: op -> str(device) -> {"route", "why", "fallback"}
ROUTES: dict[str, dict[str, dict]] = {}


def record(op: str, device, route: str, why: str, fallback: bool = False) -> None:
    ROUTES.setdefault(op, {})[str(device)] = {"route": route, "why": why, "fallback": bool(fallback)}


def summary() -> dict:
    """{op: {"route", "why", "fallback", "device"}} of this process (one device per op; several: "device" lists
    them and the entry is the first fallback's, else the first's)."""
    out = {}
    for op, by_dev in sorted(ROUTES.items()):
        items = sorted(by_dev.items())
        dev, e = next(((d, e) for d, e in items if e["fallback"]), items[0])
        out[op] = {**e, "device": dev if len(items) == 1 else ", ".join(d for d, _ in items)}
    return out


def merged(per_rank: list[dict]) -> dict:
    """Every rank's :func:`summary` as one: a rank's entry that differs from rank 0's is added under
    ``ranks`` (by rank), a fallback on any rank is the op's entry."""
    out: dict = {}
    for op in sorted({op for s in per_rank for op in s}):
        entries = [(r, s[op]) for r, s in enumerate(per_rank) if op in s]
        r0, first = next(((r, e) for r, e in entries if e["fallback"]), entries[0])
        out[op] = dict(first)
        others = {str(r): e for r, e in entries if {k: v for k, v in e.items() if k != "device"}
                  != {k: v for k, v in first.items() if k != "device"}}
        if others:
            out[op]["ranks"] = {str(r0): first, **others}
    return out


def fallbacks(s: dict) -> list[str]:
    """The ops of a summary that fell back: ["sinkhorn: torch steps (why)", ...]."""
    return [f"{op}: {e['route']} ({e['why']})" for op, e in s.items() if e.get("fallback")]


def text(s: dict) -> str:
    """One line: ``sinkhorn: kernels; product: live-row kernels`` (with why after a fallback)."""
    return "; ".join(f"{op}: {e['route']}" + (f" (FALLBACK: {e['why']})" if e.get("fallback") else "")
                     for op, e in s.items()) or "none recorded"
