"""Host syncs and collectives in whole stage-1 steps: the real translate stage (prepared protein shards,
stories260K, TranslateTask, the loop, TorchEngine) under a dispatch-mode counter (s2t2_dist/utils/syncs.py) and
with torch.distributed's collectives wrapped. On a GPU each counted op stalls the host; a step that neither logs,
checkpoints, evaluates nor stops must count none, and its only bookkeeping collective is the stop flag's.

Steps (8, two micro-batches each): 1, 2 and 7 are quiet; 3 and 6 log; 4 checkpoints (no log); 5 evaluates (no log);
8 logs and checkpoints (the last step)."""

import traceback
from collections import Counter

import pytest

from s2t2_dist.config import load_config
from s2t2_dist.stages.translate import TranslateConfig
from tests.helpers.stage_fixtures import REPO, small_inputs
from tests.helpers.distributed import run_distributed

STEPS, LOG_EVERY, CKPT_EVERY, EVAL_EVERY = 8, 3, 4, 5
QUIET, LOGGING, CKPT, EVAL = [1, 2, 7], [3, 6, 8], [4, 8], [5]

# torch.distributed's collectives, wrapped while the stage runs
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all_single",
               "broadcast", "broadcast_object_list", "barrier", "reduce_scatter_tensor", "gather", "scatter",
               "reduce")
# who asked for a collective: the first of these files found on the stack (innermost first)
ORIGINS = (("s2t2_dist/distributed/stats_batch.py", "stats"), ("s2t2_dist/distributed/sharded_sinkhorn.py", "translator"),
           ("s2t2_dist/engines/", "engine"), ("s2t2_dist/train/checkpoint.py", "checkpoint"),
           ("s2t2_dist/eval/", "eval"), ("s2t2_dist/train/loop.py", "loop"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return small_inputs(tmp_path_factory)


def _origin() -> str:
    files = [f.filename for f in reversed(traceback.extract_stack()[:-2])]
    for f in files:
        for part, name in ORIGINS:
            if part in f:
                return name
    return "other:" + next((f for f in files if "s2t2_dist" in f), files[0])


def _counted_run(data, model, run_dir, kind):
    """Runs `s2t2 translate` in this process (one rank of the group the stage sets up) and returns, per step,
    (step, host syncs, what they were, fused reads, collectives by origin)."""
    import torch.distributed as dist

    import s2t2_dist.train.loop as loop
    from s2t2_dist.distributed.stats_batch import StatsBatch
    from s2t2_dist.stages.translate import run
    from s2t2_dist.utils.syncs import SyncCounter

    real_train, real_reduce, per_step = loop.train, StatsBatch.reduce, []
    tally = {"reads": 0, "coll": Counter()}
    real_coll = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def wrapped(*a, **kw):
            tally["coll"][_origin()] += 1
            return real_coll[name](*a, **kw)
        return wrapped

    def reduce(self):  # the fused read: one device -> host copy (on a GPU the counter sees it as "copy to host";
        tally["reads"] += 1  # on CPU it is no sync, so it is counted here)
        return real_reduce(self)

    def counted_train(cfg, task, engine, loader, ckpt, logger, **kw):
        counter, marks = SyncCounter(), []
        inner = task.before_step

        def snapshot():
            return counter.total, dict(counter.counts), tally["reads"], Counter(tally["coll"])

        def before_step(done, logging):  # a step's count runs from its before_step to the next one's
            marks.append((done + 1, snapshot()))
            inner(done, logging)

        task.before_step = before_step
        with counter:
            res = real_train(cfg, task, engine, loader, ckpt, logger, **kw)
        ends = [m[1] for m in marks[1:]] + [snapshot()]
        for (step, (t0, c0, r0, k0)), (t1, c1, r1, k1) in zip(marks, ends):
            what = {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}
            per_step.append((step, t1 - t0, what, r1 - r0, dict(k1 - k0)))
        return res

    loop.train, StatsBatch.reduce = counted_train, reduce
    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml", [
            f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all", f"data.train={data}/shards/new/train",
            f"data.eval={data}/shards/new/eval", "train.eval_max_docs=2", "eval.batch_size=2",
            f"data.tokenizer={data}/tokenizer", "train.context_len=64", "train.batch_size=8",
            "train.micro_batch_size=2", f"train.log_every={LOG_EVERY}", f"train.ckpt_every={CKPT_EVERY}",
            f"train.eval_every={EVAL_EVERY}", f"train.steps={STEPS}", f"translator.kind={kind}",
            "translator.alpha=0.01", "translator.heatmap=[8,8]", "data.num_workers=0"])
        summary = run(cfg)
    finally:
        loop.train, StatsBatch.reduce = real_train, real_reduce
        for name, fn in real_coll.items():
            setattr(dist, name, fn)
    assert summary["finished"]
    return per_step


@pytest.fixture(scope="module", params=[(k, w) for k in ("sparse", "softmax", "unconstrained") for w in (1, 2)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def counted(request, inputs, tmp_path_factory):
    (kind, world), (data, model) = request.param, inputs
    run_dir = tmp_path_factory.mktemp(f"run_{kind}_{world}") / "run"
    if world == 1:
        results = [_counted_run(data, model, run_dir, kind)]
    else:
        results = run_distributed(_counted_run, world, data, model, run_dir, kind, init=False, timeout=300)
    for rank, per_step in enumerate(results):
        assert [s for s, *_ in per_step] == list(range(1, STEPS + 1))
        for step, n, what, reads, coll in per_step:
            tag = "quiet" if step in QUIET else "+".join(t for t, s in (("log", LOGGING), ("ckpt", CKPT),
                                                                          ("eval", EVAL)) if step in s)
            print(f"{kind} world={world} rank={rank} step={step} ({tag}): {n} host syncs {what} + {reads} fused "
                  f"read(s); collectives {sorted(coll.items())}")
    return kind, world, results


def test_no_host_sync_outside_logging_steps(counted):
    kind, world, results = counted
    for rank, per_step in enumerate(results):
        syncs = {step: (n, what, reads) for step, n, what, reads, _ in per_step}
        quiet = {s: syncs[s] for s in QUIET if syncs[s] != (0, {}, 0)}
        assert not quiet, f"{kind}, {world} rank(s), rank {rank}: host syncs on quiet steps {quiet}"
        # a logging step reads everything back in the one fused read, nothing else (6 and 8: also checkpoints)
        for s in LOGGING + [4]:
            assert syncs[s] == (0, {}, 1), (kind, world, rank, s, syncs[s])
        # the eval step's syncs are the scorer's (its reads of the scores), and no fused read: it does not log
        assert syncs[5][2] == 0


def test_one_collective_per_logging_step(counted):
    """Bookkeeping collectives per step: the stop flag's all_reduce (a host float over the gloo host group, no
    device sync) on a quiet step; on a logging or checkpoint step ONE all_reduce (StatsBatch: losses, tokens, stop
    flag, P statistics, gradient monitor, heatmap and top translations) and nothing else from the loop or the task.
    Besides them every step runs the translator's own collectives (sharded Sinkhorn, E'/L' gathers, H) and the
    engine's (the global grad norm of the sharded C); a logging step's report recomputes P after the update (the
    Sinkhorn's forward collectives again), a checkpoint its saving collectives, an eval the scorer's."""
    kind, world, results = counted
    for rank, per_step in enumerate(results):
        coll = {step: c for step, *_, c in per_step}
        if world == 1:  # one rank: nothing to reduce
            assert all(not c for c in coll.values()), coll
            continue
        for s in range(1, STEPS + 1):
            book = {k: v for k, v in coll[s].items() if k not in ("translator", "engine", "checkpoint", "eval")}
            expect = {"loop": 1} if s in QUIET + EVAL else {"stats": 1}
            assert book == expect, (kind, rank, s, coll[s])
            assert coll[s].get("engine") == 1, (kind, rank, s, coll[s])  # the sharded C's global grad norm
        step_math = coll[QUIET[0]]["translator"]
        assert all(coll[s]["translator"] == step_math for s in QUIET + CKPT[:1]), coll
        # the logging step's report (and the eval) recomputes P for the updated C: the Sinkhorn's forward
        # collectives again (none for the unconstrained kind), as many on each logging step
        assert len({coll[s]["translator"] for s in LOGGING}) == 1
        assert coll[3]["translator"] > step_math or (kind == "unconstrained" and coll[3]["translator"] == step_math)
        assert coll[5]["translator"] > step_math
        assert coll[4].get("checkpoint", 0) > 0 and coll[5].get("eval", 0) > 0
        assert "checkpoint" not in coll[QUIET[0]] and "eval" not in coll[QUIET[0]]
