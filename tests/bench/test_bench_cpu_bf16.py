"""bench/bench_cpu_bf16.py: both precisions timed on both products, and the hardware probe's answer reported."""
from __future__ import annotations

import math

from bench.bench_cpu_bf16 import main


def test_both_precisions_are_timed_on_both_products():
    res = main(["--repeat", "1", "--tokens", "4"])
    assert isinstance(res["cpu_computes_bf16"], bool) and res["threads"] == 1
    assert len(res["seconds"]) == 2
    for s in res["seconds"].values():
        assert s["float32"] > 0 and s["bfloat16"] > 0
        assert math.isclose(s["bf16_over_fp32"], s["bfloat16"] / s["float32"])
