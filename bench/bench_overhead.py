"""Framework overhead: the real training loop against a bare torch loop of the same model, in the same run.

Stage 1: the translate stage's step (TranslateTask: P from C by the sparse Sinkhorn, E' = P^T E and L', the frozen
model through TranslatedLM, backward to C, TorchEngine (sharded) step, inside train/loop.train with its logging,
P reports every log_every steps, the per-step collectives and the final checkpoint excluded) against the same
frozen model's bare forward + backward with PLAIN trainable embeddings of the same shape (u x d embedding and head,
AdamW on them): what the model alone costs. The translator's own compute (P and E', L') is timed apart, so the
overhead splits into "the method" (the Sinkhorn) and "the framework" (everything else).
Stage 2: the finetune stage's step (FinetuneTask + TorchEngine replicated + the loop) against a bare
forward/backward/clip/AdamW loop of the same model on the same batches.

Median step time over --steps steps after --warmup, A and B alternated --rounds times (the best median of each
kept: the machine is shared), in CPU seconds of this process (--wall for wall time). One process, CPU, float32.

    PYTHONPATH=. python -m bench.bench_overhead [--width 256 --layers 4 --context 256 --batch 4 --v 4096 --u 512]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

#: CPU time of this process (all its threads): on a shared machine wall time varied 7x between identical rounds
#: (other jobs take the cores); CPU time does not count the time others hold them. --wall to use wall time.
clock = time.process_time


class MemLoader:
    """In-memory batches with the ResumableLoader interface (the data pipeline is benchmarked in bench_loader)."""

    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def __iter__(self):
        while True:
            b = self.batches[self.pos % len(self.batches)]
            self.pos += 1
            yield b

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def loop_step_times(task, engine, batches, steps: int, work: Path) -> list[float]:
    from s2t2_dist.api import Checkpointer
    from s2t2_dist.api import TrainConfig
    from s2t2_dist.api import train
    from s2t2_dist.api import MetricsLogger

    cfg = TrainConfig(steps=steps + 1, batch_size=1, micro_batch_size=1, context_len=batches[0]["input_ids"].shape[1],
                      log_every=10, ckpt_every=0, keep_checkpoints=1)
    stamps = []
    logger = MetricsLogger(work / "tb", rank=0, node_rank=0, local_rank=0)
    train(cfg, task, engine, MemLoader(batches), Checkpointer(work, keep=1), logger, progress=False,
          on_step=lambda s, l: stamps.append(clock()))
    logger.close()
    return [b - a for a, b in zip(stamps, stamps[1:])]  # step k's time = stamp k - stamp k-1; the final save after


def bare_step_times(model, params, batches, steps: int, lr: float, clip: float | None, inputs) -> list[float]:
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
    times = []
    for i in range(steps + 1):
        t = clock()
        ids = batches[i % len(batches)]["input_ids"]
        loss = inputs(model, ids)  # model None: the closure holds it
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(clock() - t)
    return times[1:]


def med(x, warm):
    return statistics.median(x[warm:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--v", type=int, default=4096, help="source tokens of P")
    ap.add_argument("--u", type=int, default=512, help="target vocabulary")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="1: CPU time then counts no OpenMP spin-waiting (which a loaded machine inflates)")
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of this process's CPU time")
    a = ap.parse_args(argv)
    if a.wall:
        global clock
        clock = time.perf_counter
    torch.set_num_threads(a.threads)

    from transformers import AutoModelForCausalLM

    from s2t2_dist.api import TorchEngine
    from s2t2_dist.api import get_embedding_and_head
    from s2t2_dist.api import tiny_config
    from s2t2_dist.api import TranslatedLM, materialize
    from s2t2_dist.api import FinetuneTask, TranslateTask
    from s2t2_dist.api import TokenTranslator, TranslatorConfig
    from s2t2_dist.api import EngineConfig, FinetuneConfig, OptimConfig, TranslateConfig

    torch.manual_seed(0)
    cfg = tiny_config("olmo-1b", n_layers=a.layers, d_model=a.width, n_heads=a.heads)
    base = AutoModelForCausalLM.from_config(cfg).float()
    n_body = sum(p.numel() for n, p in base.named_parameters() if "embed" not in n and "lm_head" not in n)
    batches = [{"input_ids": torch.randint(0, a.u, (a.batch, a.context))} for _ in range(8)]
    rt = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, env=SimpleNamespace(is_main=True))
    steps = a.steps + a.warmup
    res = {"s1_loop": [], "s1_bare_translator": [], "s1_bare": [], "s1_translator": [], "s2_loop": [],
           "s2_bare": []}
    print(f"OLMo-1B config, {a.layers} layers x d {a.width}, {n_body / 1e6:.1f} M body parameters; batch "
          f"{a.batch} x {a.context} tokens; P {a.v} x {a.u}; {a.threads} threads", flush=True)

    for r in range(a.rounds):
        with tempfile.TemporaryDirectory(prefix="overhead_") as work:
            work = Path(work)
            # ---- stage 1, the framework
            model = copy.deepcopy(base)
            E, L, _ = get_embedding_and_head(model)
            src_ids = torch.arange(a.v)
            tr = TokenTranslator(a.v, a.u, kind="sparse", n_iter=3)
            lm = TranslatedLM(model, freeze_model=True)
            flat = OptimConfig(lr=2e-5, eps=1e-8, warmup_frac=0.0, final_lr_frac=1.0)  # a constant lr
            eng = TorchEngine.build(tr, flat, steps + 1, params="sharded")
            # the stage's own config (its P reports with a 1 x 1 heatmap: the loop's, not the image's, cost)
            tcfg = TranslateConfig(translator=TranslatorConfig(alpha=0.0, heatmap=[1, 1]))
            task = TranslateTask(lm, tr, E, L, src_ids, tcfg, rt, [str(i) for i in range(a.u)],
                                 [str(i) for i in range(a.v)])
            res["s1_loop"].append(med(loop_step_times(task, eng, batches, steps, work / "s1"), a.warmup))
            # the translator alone: P and E', L' forward + backward to C
            tt = []
            for i in range(steps):
                t = clock()
                with torch.no_grad():
                    tr.C.add_(1e-9)  # a new C, as after an optimiser step
                E2, L2 = tr.embed_and_head(E, L, src_ids)
                (E2.sum() + L2.sum()).backward()
                tr.C.grad = None
                tt.append(clock() - t)
            res["s1_translator"].append(med(tt, a.warmup))
            # ---- stage 1, bare torch loop of the same computation: translator + frozen model, AdamW on C
            tr2 = TokenTranslator(a.v, a.u, kind="sparse", n_iter=3)
            lm2 = TranslatedLM(model, freeze_model=True)

            def s1_bare_loss(_m, ids, _tr=tr2, _lm=lm2):
                E2, L2 = _tr.embed_and_head(E, L, src_ids)
                return _lm(ids, E_new=E2.to(E.dtype), L_new=L2.to(E.dtype)).loss.float()

            res["s1_bare_translator"].append(med(bare_step_times(None, [tr2.C], batches, steps, 2e-5, 1.0,
                                                                 s1_bare_loss), a.warmup))
            # ---- stage 1, bare: the frozen body with plain u x d embeddings and head, trained
            ref = materialize(copy.deepcopy(base), E[:a.u].detach().clone(), L[:a.u].detach().clone(), inplace=True)
            for n, p in ref.named_parameters():
                p.requires_grad_(n in ("model.embed_tokens.weight", "lm_head.weight"))
            params = [p for p in ref.parameters() if p.requires_grad]
            res["s1_bare"].append(med(bare_step_times(
                ref, params, batches, steps, 2e-5, 1.0,
                lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss), a.warmup))
            del ref, lm, lm2, model, tr, tr2, eng, task

            # ---- stage 2, the framework: the translated (materialised, u-vocabulary) model, all of it trained
            m2 = materialize(copy.deepcopy(base), E[:a.u].detach().clone(), L[:a.u].detach().clone(), inplace=True)
            eng2 = TorchEngine.build(m2, dataclasses.replace(flat, lr=1e-4), steps + 1, params="replicated")
            ftask = FinetuneTask(eng2, rt, None, FinetuneConfig(engine=EngineConfig(kind="plain")))
            res["s2_loop"].append(med(loop_step_times(ftask, eng2, batches, steps, work / "s2"), a.warmup))
            m3 = materialize(copy.deepcopy(base), E[:a.u].detach().clone(), L[:a.u].detach().clone(), inplace=True)
            res["s2_bare"].append(med(bare_step_times(
                m3, list(m3.parameters()), batches, steps, 1e-4, 1.0,
                lambda m, ids: m(input_ids=ids, labels=ids, use_cache=False).loss), a.warmup))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in res.items()), flush=True)

    best = {k: min(v) for k, v in res.items()}
    s1 = best["s1_loop"] / best["s1_bare"] - 1
    s1_fw = best["s1_loop"] / best["s1_bare_translator"] - 1
    s2 = best["s2_loop"] / best["s2_bare"] - 1
    print(f"stage 1: loop {best['s1_loop'] * 1e3:.1f} ms/step vs a bare torch loop of the same translator + frozen "
          f"model {best['s1_bare_translator'] * 1e3:.1f} ms: framework {100 * s1_fw:+.1f} %; vs the frozen model with "
          f"plain trainable embeddings {best['s1_bare'] * 1e3:.1f} ms: {100 * s1:+.1f} % (the translator alone, P and "
          f"E', L' forward + backward: {best['s1_translator'] * 1e3:.1f} ms)")
    print(f"stage 2: loop {best['s2_loop'] * 1e3:.1f} ms/step vs bare torch loop {best['s2_bare'] * 1e3:.1f} ms: "
          f"{100 * s2:+.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
