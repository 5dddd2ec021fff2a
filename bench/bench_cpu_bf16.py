"""bf16 against fp32 on this CPU, in the same process: the two matrix products of a SmolLM2-135M step at 4 x 256
tokens (a body projection, 576 x 1536, and the 49,152-row output head), forward and backward, each precision
alternating. On a CPU with bf16 in hardware (AVX-512 / AMX: `cpu_computes_bf16()`) bf16 is about as fast or
faster; on one that emulates it, many times slower, which is why `lm.precision=auto` trains in fp32 there.

    python -m bench.bench_cpu_bf16 --repeat 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def _time(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=1024, help="rows of the activations (batch x context)")
    args = ap.parse_args(argv)
    import torch

    from s2t2_dist.api import cpu_computes_bf16

    torch.set_num_threads(1)
    shapes = {"body projection 576 x 1536": (576, 1536), "output head 576 x 49,152": (576, 49152)}
    res = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_computes_bf16": cpu_computes_bf16(),
           "threads": 1, "tokens": args.tokens, "seconds": {}}
    for name, (d, n) in shapes.items():
        per = {}
        for dt in (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16):  # alternating: drift shows
            x = torch.randn(args.tokens, d, dtype=dt, requires_grad=True)
            w = torch.randn(n, d, dtype=dt, requires_grad=True)

            def step():
                (x @ w.t()).sum().backward()
                x.grad = w.grad = None

            per.setdefault(str(dt).removeprefix("torch."), []).append(_time(step, args.repeat))
        s = {k: min(v) for k, v in per.items()}
        res["seconds"][name] = {**s, "bf16_over_fp32": s["bfloat16"] / s["float32"]}
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
