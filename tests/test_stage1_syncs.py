"""Host syncs in whole stage-1 steps: the real translate stage (prepared protein shards, stories260K, TranslateTask,
the loop, TorchEngine) under a dispatch-mode counter (s2t2_dist/utils/syncs.py). On a GPU each counted op stalls
the host; a step that neither logs, checkpoints nor stops must count none."""

import pytest

from s2t2_dist.config import load_config
from s2t2_dist.stages.translate import TranslateConfig
from stage_fixtures import REPO, prepare_small
from distributed import run_distributed

STEPS, LOG_EVERY = 5, 3  # logging steps 3 and 5 (5 also checkpoints); steps 1, 2 and 4 must not sync


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs_inputs")
    from s2t2_dist.recipes.llama2c import save_hf

    return prepare_small(root / "data"), save_hf(root / "stories260k")


def _counted_run(data, model, run_dir, kind):
    """Runs `s2t2 translate` in this process (one rank of the group the stage sets up) and returns, per step,
    (step, logging step, host syncs, what they were)."""
    import s2t2_dist.train.loop as loop
    from s2t2_dist.stages.translate import run
    from s2t2_dist.utils.syncs import SyncCounter

    real_train, per_step = loop.train, []

    def counted_train(cfg, task, engine, loader, ckpt, logger, **kw):
        counter, marks = SyncCounter(), []
        inner = task.before_step

        def before_step(done, logging):  # a step's count runs from its before_step to the next one's
            marks.append((done + 1, logging, counter.total, dict(counter.counts)))
            inner(done, logging)

        task.before_step = before_step
        with counter:
            res = real_train(cfg, task, engine, loader, ckpt, logger, **kw)
        ends = [(m[2], m[3]) for m in marks[1:]] + [(counter.total, dict(counter.counts))]
        for (step, logging, t0, c0), (t1, c1) in zip(marks, ends):
            per_step.append((step, logging, t1 - t0, {k: v - c0.get(k, 0) for k, v in c1.items() if v - c0.get(k, 0)}))
        return res

    loop.train = counted_train
    try:
        cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml", [
            f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all", f"data.train={data}/shards/new/train",
            "data.eval=", f"data.tokenizer={data}/tokenizer", "train.context_len=64", "train.batch_size=8",
            "train.micro_batch_size=2", f"train.log_every={LOG_EVERY}", "train.ckpt_every=0", f"train.steps={STEPS}",
            f"translator.kind={kind}", "translator.dense_frac=0", "translator.alpha=0.01", "translator.heatmap=[8,8]", "data.num_workers=0"])
        summary = run(cfg)
    finally:
        loop.train = real_train
    assert summary["finished"]
    return per_step


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", ["sparse", "softmax", "unconstrained"])
def test_no_host_sync_outside_logging_steps(inputs, tmp_path, kind, world):
    data, model = inputs
    if world == 1:
        results = [_counted_run(data, model, tmp_path / "run", kind)]
    else:
        results = run_distributed(_counted_run, world, data, model, tmp_path / "run", kind, init=False,
                                  timeout=240)
    for rank, per_step in enumerate(results):
        assert [s for s, *_ in per_step] == list(range(1, STEPS + 1))
        for step, logging, n, what in per_step:
            print(f"{kind} world={world} rank={rank} step={step} logging={logging}: {n} host syncs {what}")
        assert [s for s, logging, *_ in per_step if logging] == [3, 5]
        quiet = {step: what for step, logging, n, what in per_step if not logging and n}
        assert not quiet, f"{kind}, {world} rank(s), rank {rank}: host syncs on non-logging steps {quiet}"
    # the counter sees them where they are: a logging step reads its statistics back
    assert all(n > 0 for step, logging, n, _ in results[0] if logging)
