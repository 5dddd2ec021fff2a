"""Host syncs and collectives in whole finetune steps: the real finetune stage (prepared protein shards, a tiny
OLMo-1B-config model with the real 50,304-row vocabulary, FinetuneTask, the loop) under the dispatch-mode sync
counter (s2t2_dist/utils/syncs.py) with torch.distributed's collectives wrapped, for the plain engine (replicas,
bucketed gradient all-reduce) and FSDP2 (built on the meta device, loaded after sharding) on 1 and 2 gloo ranks,
and DeepSpeed ZeRO-3 on 2 (its own reads counted, not required to be 0).

A quiet step (no log, checkpoint, evaluation or stop) must read nothing back to the host -- the engines decide a
non-finite step and clip on the device -- and its only bookkeeping collective is the loop's stop flag. A logging
step reads back once (the loop's StatsBatch). Steps (6, two micro-batches each): 1, 2, 4, 5 quiet; 3, 6 log; 6 also
checkpoints (the last step). Also: the start-up phases reach result.json."""

from collections import Counter

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.finetune_fixtures import CTX, world  # noqa: F401 - the session fixture

STEPS, LOG_EVERY = 6, 3
QUIET, LOGGING = [1, 2, 4, 5], [3, 6]
DEEPSPEED = ["engine.ds_config=configs/ds_zero3.json",
             "engine.ds_overrides.zero_optimization.stage3_param_persistence_threshold=0"]
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all_single",
               "broadcast", "broadcast_object_list", "barrier", "reduce_scatter_tensor", "gather", "scatter",
               "reduce", "all_gather_single", "reduce_scatter_single")  # the last two: FSDP2's (torch >= 2.12)


def _counted_run(w, run_dir, kind):
    """`s2t2 finetune` in this process (one rank of the group the stage sets up); per step: (step, host syncs,
    what they were, fused reads, collectives by name) and the result."""
    import torch.distributed as dist

    import s2t2_dist.train.loop as loop
    from s2t2_dist.config import load_config
    from s2t2_dist.distributed.stats_batch import StatsBatch
    from s2t2_dist.stages.finetune import FinetuneConfig, run
    from s2t2_dist.train.callbacks import Callback
    from s2t2_dist.utils.syncs import SyncCounter

    real_train, real_reduce, marks = loop.train, StatsBatch.reduce, []
    tally = {"reads": 0, "coll": Counter()}
    real_coll = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    counter = SyncCounter()

    def snapshot():
        return counter.total, dict(counter.counts), tally["reads"], Counter(tally["coll"])

    class Marks(Callback):  # a step's count runs from its pre_step to the next one's
        def pre_step(self, state):
            marks.append((state.step + 1, snapshot()))

    def counting(name):
        def wrapped(*a, **kw):
            tally["coll"][name] += 1
            return real_coll[name](*a, **kw)
        return wrapped

    def reduce(self):  # the fused read (on CPU no sync for the counter, so it is counted here)
        tally["reads"] += 1
        return real_reduce(self)

    def counted_train(*a, **kw):
        with counter:
            res = real_train(*a, callbacks=[Marks()], **kw)
        marks.append((None, snapshot()))
        return res

    loop.train, StatsBatch.reduce = counted_train, reduce
    for name in real_coll:
        setattr(dist, name, counting(name))
    try:
        cfg = load_config(FinetuneConfig, None, [
            f"run_dir={run_dir}", f"model.path={w.model_a}", f"data.train={w.new_train}", f"data.eval={w.new_eval}",
            f"data.tokenizer={w.tokenizer}", "data.num_workers=0", f"init.p_file={w.p_a}", f"train.steps={STEPS}",
            "train.batch_size=4", f"train.context_len={CTX}", f"train.log_every={LOG_EVERY}", "train.ckpt_every=0",
            "train.eval_every=0", "train.eval_max_docs=2", "eval.batch_size=2", f"engine.kind={kind}",
            *(DEEPSPEED if kind == "deepspeed" else [])])
        cfg.train.micro_batch_size = 2 // dist_world()
        summary = run(cfg)
    finally:
        loop.train, StatsBatch.reduce = real_train, real_reduce
        for name, fn in real_coll.items():
            setattr(dist, name, fn)
    per_step = []
    for (step, (t0, c0, r0, k0)), (_, (t1, c1, r1, k1)) in zip(marks, marks[1:]):
        what = {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}
        per_step.append((step, t1 - t0, what, r1 - r0, dict(k1 - k0)))
    return per_step, summary


def dist_world() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


@pytest.fixture(scope="module", params=[(k, n) for k in ("plain", "fsdp") for n in (1, 2)] + [("deepspeed", 2)],
                ids=lambda p: f"{p[0]}-{p[1]}")
def counted(request, world, tmp_path_factory):  # noqa: F811 - the fixture
    kind, n = request.param
    run_dir = tmp_path_factory.mktemp(f"ft_{kind}_{n}") / "run"
    if n == 1:
        results = [_counted_run(world, run_dir, kind)]
    else:
        results = run_distributed(_counted_run, n, world, run_dir, kind, init=False, timeout=600)
    for rank, (per_step, _) in enumerate(results):
        assert [s for s, *_ in per_step] == list(range(1, STEPS + 1))
        for step, syncs, what, reads, coll in per_step:
            print(f"{kind} world={n} rank={rank} step={step}: {syncs} host syncs {what} + {reads} fused read(s); "
                  f"collectives {sorted(coll.items())}")
    return kind, n, results


def test_quiet_steps_read_nothing_back(counted):
    kind, n, results = counted
    for rank, (per_step, summary) in enumerate(results):
        assert summary["finished"] and summary["bad_steps"] == 0
        syncs = {step: (s, what, reads) for step, s, what, reads, _ in per_step}
        if kind == "deepspeed":
            # DeepSpeed reads its own values back inside its step (gradient norm and overflow checks: 3 scalar reads
            # at this size), the same on every step after its first (which traces the module's parameter order);
            # the loop adds only its one fused read on a logging step
            quiet = syncs[QUIET[1]]
            assert quiet[2] == 0 and all(syncs[s] == quiet for s in QUIET[1:]), (rank, syncs)
            assert syncs[LOGGING[0]] == (quiet[0], quiet[1], 1), (rank, syncs)
            continue
        assert all(syncs[s] == (0, {}, 0) for s in QUIET), (kind, n, rank, syncs)
        # a logging step: the loop's one fused read, nothing else (the last step also writes its checkpoint, which
        # reads the state back)
        assert syncs[LOGGING[0]] == (0, {}, 1), (kind, n, rank, syncs[LOGGING[0]])
        assert syncs[LOGGING[1]][2] == 1


def test_collectives_per_step(counted):
    """One rank: none. Two ranks, a quiet step: the stop flag's all_reduce plus the engine's own -- the plain
    engine one all_reduce per gradient bucket (one bucket at this size) and none else; FSDP2 an all-gather per
    FSDP unit and micro-batch in the forward, again in the backward for the resharded blocks, a reduce-scatter per
    unit and micro-batch. Every quiet step the same; a logging step adds only the
    StatsBatch's all_reduce in place of the stop flag's."""
    kind, n, results = counted
    for rank, (per_step, _) in enumerate(results):
        coll = {step: c for step, *_, c in per_step}
        if n == 1:  # (the last step's checkpoint: DCP's own planning collectives, even on one rank)
            assert all(not coll[s] for s in QUIET + LOGGING[:1]), coll
            continue
        steady = QUIET[1:] if kind == "deepspeed" else QUIET  # DeepSpeed's first step gathers more (tracing)
        quiet = coll[steady[0]]
        assert all(coll[s] == quiet for s in steady), coll
        assert coll[LOGGING[0]] == quiet, coll  # the StatsBatch's all_reduce replaces the stop flag's
        if kind == "deepspeed":  # ZeRO-3 gathers and reduce-scatters, the stop flag and DeepSpeed's own all_reduce
            assert set(quiet) == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}, quiet
            assert quiet["all_reduce"] == 2, quiet
        elif kind == "plain":
            assert quiet == {"all_reduce": 2}, quiet  # the stop flag + one gradient bucket
        else:
            accum, units = 2, 2 + 1  # micro-batches per step (batch 4 = 2 ranks x 1 x 2); 2 blocks + the root
            # forward and backward (resharded after forward) gather every unit; the backward reduce-scatters it;
            # the stop flag's all_reduce. (The grad norm's reduction is a DTensor functional collective, not seen.)
            assert quiet == {"all_gather_single": 2 * accum * units, "reduce_scatter_single": accum * units,
                             "all_reduce": 1}, quiet


def test_startup_phases_in_result(counted):
    kind, n, results = counted
    startup = results[0][1]["startup"]
    phases = startup["phases_s"]
    built = {"plain": ["model load", "optimiser"], "fsdp": ["model build (meta)", "sharding", "weights load (sharded)",
                                                         "optimiser"],
             "deepspeed": ["model load (ZeRO partitions)", "engine build (deepspeed.initialize, optimiser)"]}[kind]
    for name in ("preflight", "process group", "initial model", "data", *built, "first step"):
        assert name in phases and phases[name] >= 0, (name, startup)
    assert ("sharding" in phases) == (kind == "fsdp")
    assert startup["first_step_done_s"] >= phases["first step"]
