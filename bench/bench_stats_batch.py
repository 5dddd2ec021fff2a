"""A logging step's statistics of P (non-zeros, marginals, entropy, mass, gradient monitor, top translations,
heatmap block) computed the old way (one collective per statistic, a host read per value: the reference kept in
tests/distributed/test_stats_batch.py) against the fused one (StatsBatch: one all_reduce, one read), in the same
processes, alternating, on gloo ranks with C's columns sharded. P is computed once, before the timings (both reuse it).

    PYTHONPATH=. nice -n 10 python -m bench.bench_stats_batch --v 50280 --u 512 --ranks 2 --repeat 7
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def _worker(v: int, u: int, repeat: int):
    import torch
    import torch.distributed as dist

    from s2t2_dist.api import PStats, TokenTranslator
    from tests.distributed.test_stats_batch import _old_report  # the per-statistic reference

    group = dist.group.WORLD if dist.is_initialized() else None
    g = torch.Generator().manual_seed(0)
    tr = TokenTranslator(v, u, group=group)
    with torch.no_grad():
        tr.C.add_(torch.randn(tr.C.shape, generator=g) * 1e-3)  # moved off the all-ties start
    st = PStats(tr)
    st.watch_grad()
    tr.C.grad = torch.randn(tr.C.shape, generator=g)
    st.end_step()
    heat = (128, 64)
    with torch.no_grad():
        P = tr.P()

        def new():
            b = st.stats_batch()
            parts = [st.add_density(b, P), st.add_marginals(b, P), st.add_mass(b, P), st.add_grad(b),
                     st.add_entropy(b, P), st.add_top(b, 3, P), st.add_block(b, *heat, P)]
            r = b.reduce()
            return [p(r) for p in parts]

        times = {"old": [], "new": []}
        for i in range(repeat + 1):
            for name, fn in (("old", lambda: _old_report(tr, heat)), ("new", new)):
                if group is not None:
                    dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i:  # the first round warms up
                    times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--v", type=int, default=50280)
    ap.add_argument("--u", type=int, default=512)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    load0 = os.getloadavg()[0]
    if a.ranks == 1:
        res = [_worker(a.v, a.u, a.repeat)]
    else:
        from tests.helpers.distributed import run_distributed

        res = run_distributed(_worker, a.ranks, a.v, a.u, a.repeat, timeout=1200)
    t = res[0]
    old, new = statistics.median(t["old"]), statistics.median(t["new"])
    print(f"v={a.v} u={a.u} ranks={a.ranks} repeat={a.repeat} load average {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"rank 0 median: per-statistic {old * 1e3:.1f} ms, fused {new * 1e3:.1f} ms, ratio {old / new:.2f}; "
          f"best {min(t['old']) * 1e3:.1f} / {min(t['new']) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
