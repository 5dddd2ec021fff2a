"""Fixtures of the reliability suite: a tiny real dataset (a few real protein records -> prepared shards), the real
stories260K LM, a stage-1 P file and the uninterrupted 2-rank stage-1 run the interrupted ones are compared with. The
suite's tools (the ledger, `Job`, the stage arguments) are in tests/helpers/faults_suite.py."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from s2t2_dist import faults
from tests.helpers.built_once import built_once
from tests.helpers.faults_suite import TRANSLATE_STEPS, Job, prepare_tiny, translate_args, write_tiny_fasta


@pytest.fixture(scope="session")
def rng() -> random.Random:
    """Random fault steps; the seed is printed (and S2T2_FAULTS_SEED replays a run)."""
    seed = int(os.environ.get("S2T2_FAULTS_SEED") or random.SystemRandom().randrange(1 << 30))
    print(f"\nS2T2_FAULTS_SEED={seed}")
    r = random.Random(seed)
    r.seed_value = seed
    return r


# The session fixtures below are built once per test run and shared by the xdist workers (tests/helpers/built_once.py);
# the tests only read them.
@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    root = built_once(tmp_path_factory, "faults_data",
                      lambda d: prepare_tiny(d / "data", write_tiny_fasta(d / "tiny.fasta")))
    return root / "data"


@pytest.fixture(scope="session")
def stories(tmp_path_factory) -> Path:
    from s2t2_dist.recipes.llama2c import save_hf

    return built_once(tmp_path_factory, "faults_model", lambda d: save_hf(d / "stories260k")) / "stories260k"


@pytest.fixture(scope="session")
def stage1_p(tiny_data, stories, tmp_path_factory) -> Path:
    """A P file from a short real stage-1 run (one process) on the tiny shards: what stage 2 starts from."""
    from s2t2_dist.config import load_config
    from s2t2_dist.stages.translate import TranslateConfig, run

    def build(root: Path) -> None:
        old = os.environ.get("S2T2_DEVICE")
        os.environ["S2T2_DEVICE"] = "cpu"
        try:
            summary = run(load_config(TranslateConfig, None,
                                      translate_args(tiny_data, stories, root / "run", "train.steps=4")))
        finally:
            if old is None:
                os.environ.pop("S2T2_DEVICE", None)
            else:
                os.environ["S2T2_DEVICE"] = old
        (root / "p_file").write_text(summary["p_file"])

    return Path((built_once(tmp_path_factory, "stage1", build) / "p_file").read_text())



@pytest.fixture(scope="session")
def translate_reference(tiny_data, stories, tmp_path_factory):
    """The uninterrupted 2-rank stage-1 run everything interrupted is compared with: (run_dir, [history per rank])."""
    def build(root: Path) -> None:
        Job("translate.py", translate_args(tiny_data, stories, root / "run", f"train.steps={TRANSLATE_STEPS}"),
            trace=root / "trace", log=root / "job.log").expect(rc_ok=True)

    root = built_once(tmp_path_factory, "translate_ref", build)
    return root / "run", [faults.effective_history(faults.read_trace(root / "trace", r)) for r in (0, 1)]
