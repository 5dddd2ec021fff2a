"""The translator's recipe (translator/recipe.py): one resolver of stage 1's automatic keys (null), the paper's
recipe as a config file, one-line refusals of removed keys and old sentinels, and a new translator kind as one
registry entry (translator/kinds.py) that trains through the real stage and round-trips its P file."""
import json

import pytest
import torch

from s2t2_dist.config import load_config
from s2t2_dist.errors import ConfigError
from s2t2_dist.stages.translate import TranslateConfig
from s2t2_dist.translator import TranslatorConfig, freeze_warning
from s2t2_dist.translator.kinds import REGISTRY, Kind, register
from tests.helpers.stage_fixtures import REPO


def _load(*overrides, config="translate_olmo1b.yaml"):
    return load_config(TranslateConfig, REPO / "configs" / config, ["model.path=m", *overrides])


@pytest.mark.parametrize("v,u", [(243, 512), (512, 512), (50280, 512), (243, 2048)])
def test_shipped_config_resolves_to_the_shipped_recipe(v, u):
    """configs/translate_olmo1b.yaml (null lr and floor) resolves to the shipped recipe: lr 0.015 x 1/u whatever v,
    alpha 0.3, floor 1 from the FVT start with its own source marginal."""
    cfg = _load()
    assert cfg.optim.lr is None and cfg.translator.floor is None
    r = cfg.translator.resolve(v, u, lr=cfg.optim.lr)
    assert (r.lr, r.lr_from, r.alpha, r.floor, r.source_marginal, r.init) == (0.015 / u, "auto", 0.3, 1.0,
                                                                             "start", "fvt")
    assert r.lr_x_v == pytest.approx(0.015 * v / u)
    # the stage's defaults (no file) are the same recipe
    d = TranslatorConfig().resolve(v, u)
    assert (d.lr, d.alpha, d.floor, d.source_marginal) == (r.lr, r.alpha, r.floor, r.source_marginal)


def test_the_automatic_step_under_a_uniform_source_marginal_is_the_1_over_v_one():
    """Under mu = 1/v (a uniform start, or source_marginal: uniform) every entry of C has the 1/v scale of the row
    projections to travel: the sparse kind's step is 0.025 x 1/v there, out of the freezing range at any v."""
    for v in (243, 50280):
        r = TranslatorConfig(init="uniform").resolve(v, 512)
        assert r.source_marginal == "uniform" and r.lr == pytest.approx(0.025 / v) and r.freeze_warning() == ""
        assert TranslatorConfig(source_marginal="uniform").resolve(v, 512).lr == r.lr
    # the same v under the start's marginal (mass on few rows) takes the 1/u step
    assert TranslatorConfig().resolve(50280, 512).lr == 0.015 / 512


@pytest.mark.parametrize("kind", sorted(REGISTRY))
@pytest.mark.parametrize("uniform", [False, True])
def test_a_kinds_rule_tag_names_its_automatic_lr(kind, uniform):
    """auto_tag (run names, e.g. the reproduce curve's) is auto_lr itself: "auto<step>[_per_<v|u>]" read back gives
    the lr at any v, u, so a run at another rule never carries this rule's name."""
    k = REGISTRY[kind]
    tag = k.auto_tag(uniform)
    step, _, unit = tag.removeprefix("auto").partition("_per_")
    for v, u in ((235, 512), (50280, 2048)):
        assert float(step) / {"": 1, "v": v, "u": u}[unit] == pytest.approx(k.auto_lr(v, u, uniform))
    assert REGISTRY["sparse"].auto_tag(False) == "auto0.015_per_u"


@pytest.mark.parametrize("kind", ["sparse", "unconstrained"])
def test_c_scale_is_the_uniform_starts_entry(kind):
    """c_scale(v), the unit benches give C's steps in, is the size of C's entries at the uniform start."""
    from s2t2_dist.translator import TokenTranslator

    for v in (27, 235):
        tr = TokenTranslator(v, 64, kind=kind)
        assert torch.allclose(tr.C.double(), torch.full_like(tr.C.double(), REGISTRY[kind].c_scale(v)))
    assert REGISTRY["softmax"].c_scale(235) == 1.0  # logits: only differences of O(1) matter


def test_the_kinds_defaults_and_a_given_lr_is_absolute():
    v, u = 300, 512
    for kind, lr, floor in (("softmax", 0.1, 0.0), ("unconstrained", 2.5 / v, 0.0)):
        r = TranslatorConfig(kind=kind).resolve(v, u)
        assert (r.lr, r.alpha, r.floor, r.source_marginal) == (pytest.approx(lr), 0.0, floor, "uniform")
    r = TranslatorConfig().resolve(v, u, lr=2e-5)
    assert (r.lr, r.lr_from) == (2e-5, "given")
    # a uniform start: no floor by default, the uniform source marginal whatever source_marginal says
    r = TranslatorConfig(init="uniform").resolve(v, u)
    assert (r.floor, r.source_marginal, r.alpha) == (0.0, "uniform", 0.3)
    assert TranslatorConfig(init_p="x.safetensors").resolve(v, u).init == "p_file"
    # without v or u the automatic lr waits for the model and the tokenizer (s2t2 config translate)
    assert TranslatorConfig().resolve(None, None).lr is None and TranslatorConfig().resolve(v, None).lr is None
    assert TranslatorConfig().resolve(None, None, lr=1e-3).lr == 1e-3
    with pytest.raises(TypeError, match="u must be a token count"):  # the lr where u goes (the old signature)
        TranslatorConfig().resolve(v, 2e-5)


def test_paper_config_is_the_papers_recipe():
    cfg = _load(config="translate_paper.yaml")
    r = cfg.translator.resolve(243, 512, lr=cfg.optim.lr)
    assert (r.kind, r.lr, r.lr_from, r.alpha, r.floor, r.source_marginal, r.init) == (
        "sparse", 1e-3, "given", 0.0, 0.0, "uniform", "uniform")
    # at v = 50,280 the paper's lr is in the sparse plan's freezing range (lr x v >= 1): warned
    w = cfg.translator.resolve(50280, 512, lr=cfg.optim.lr).freeze_warning()
    assert "freezing range" in w and "(0.025 x 1/v = 4.97e-07 here)" in w
    assert freeze_warning("softmax", 50280, 1e-3) == ""


@pytest.mark.parametrize("override,says", [
    ("translator.recipe=paper", "translator.recipe: this key was removed; .*configs/translate_paper.yaml"),
    ("translator.dense_frac=0.75", "translator.dense_frac: this key was removed"),
    ("translator.dense_lr=0.1", "translator.dense_lr: this key was removed"),
    ("model.dtype=bfloat16", "model.dtype: this key was removed; .*train.precision"),
    ("translator.alpha=-1", "translator.alpha: -1 no longer means the recipe's; write null"),
    ("translator.floor=-1", "translator.floor: -1 no longer means the recipe's; write null"),
    ("optim.lr=0", "optim.lr: 0 no longer means the recipe's default; write null"),
    ("translator.floor=1", "translator.floor: the softmax kind has no weight floor"),
])
def test_old_keys_and_sentinels_are_one_line_saying_what_to_write(override, says, capsys):
    with pytest.raises(ConfigError, match=says):
        _load(override, *(["translator.kind=softmax"] if "floor=1" in override else []))
    from s2t2_dist.stages import translate

    extra = ["translator.kind=softmax"] if "floor=1" in override else []
    assert translate.main(["--config", str(REPO / "configs" / "translate_olmo1b.yaml"), override, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("s2t2 translate: error: ConfigError: command line " + override), err


def test_an_old_yaml_with_the_recipe_key_names_file_and_key(tmp_path):
    f = tmp_path / "old.yaml"
    f.write_text("translator:\n  recipe: default\n  alpha: -1\noptim:\n  lr: 0\n")
    with pytest.raises(ConfigError, match=rf"^{f}: translator.recipe: this key was removed"):
        load_config(TranslateConfig, f)


def test_config_command_prints_null_and_what_it_resolves(capsys):
    from s2t2_dist.config_cli import main

    assert main(["translate", "--config", str(REPO / "configs" / "translate_olmo1b.yaml")]) == 0
    out = capsys.readouterr().out
    head, _, resolved = out.partition("# resolved")
    assert "  lr: null" in head and "  floor: null" in head
    assert ("#   lr: 0.015 x 1/u (the automatic step of the sparse kind), once v and u are read from the model and "
            "the tokenizer") in resolved
    assert "#   floor: 1.0" in resolved and "#   alpha: 0.3" in resolved and "#   source_marginal: start" in resolved
    assert main(["translate", "--config", str(REPO / "configs" / "translate_paper.yaml")]) == 0
    assert "#   lr: 0.001" in capsys.readouterr().out


def test_help_documents_no_sentinel_value(capsys):
    from s2t2_dist.config_docs import format_keys

    text = format_keys(TranslateConfig, "translate")
    assert "-1" not in text and "recipe's" not in text and "0: the" not in text
    assert "translator.alpha: float | null = null" in text and "optim.lr: float | null = null" in text


# ----------------------------------------------------------------------------------------------------------------
# a new kind: one class, one registry entry, nothing else edited


class ColumnSoftmaxKind(Kind):
    """Each column of P a softmax of C's column, scaled to nu_j: a plan with exact column sums (rows free)."""

    name = "column_softmax_test"
    default_step = 0.1

    def plan(self, C):
        return torch.softmax(C, dim=0) * self.tr.nu_local.to(C.dtype)

    def init_from_plan(self, P):
        return P.clamp(min=1e-30).log()


@pytest.fixture
def dummy_kind():
    register(ColumnSoftmaxKind)
    yield ColumnSoftmaxKind.name
    del REGISTRY[ColumnSoftmaxKind.name]


@pytest.fixture(scope="module")
def tiny_inputs(tmp_path_factory):
    from tests.helpers.stage_fixtures import small_inputs

    return small_inputs(tmp_path_factory)


def test_a_registered_kind_trains_one_stage1_step_and_round_trips_its_p_file(dummy_kind, tiny_inputs, tmp_path):
    from s2t2_dist.stages.translate import run
    from s2t2_dist.translator.pfile import load_p

    data, model = tiny_inputs
    run_dir = tmp_path / "run"
    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml", [
        f"run_dir={run_dir}", f"model.path={model}", "model.source_vocab=all", f"data.train={data}/shards/new/train",
        "data.eval=", f"data.tokenizer={data}/tokenizer", "data.num_workers=0", "train.context_len=64",
        "train.batch_size=2", "train.micro_batch_size=2", "train.steps=1", "train.log_every=1",
        "train.ckpt_every=0", "train.eval_every=0", "translator.heatmap=[8,8]", f"translator.kind={dummy_kind}",
        "translator.alpha=null",  # (the shipped config gives the sparse kind's 0.3)
        # this kind's rows are free, so its P's row sums are the start's: the P file's check bounds their distance
        # from mu (L1 <= 1), which the plain blend at 0.5 stays inside (at the shipped 0.8: 1.47)
        "translator.init_weight=0.5"])
    summary = run(cfg, progress=False)
    assert summary["finished"] and summary["step"] == 1
    # its defaults came from its class: lr 0.1 x 1 (natural scale 1), no entropy, no floor, uniform marginal
    res = json.loads((run_dir / "result.json").read_text())["resolved"]
    assert res == {**res, "kind": dummy_kind, "v": 512, "lr": 0.1, "lr_from": "auto", "alpha": 0.0, "floor": 0.0,
                   "source_marginal": "uniform", "init": "fvt"}
    assert summary["gradient_on_C"]["live_grad_frac_at_end"] > 0  # the step reached C
    p = load_p(summary["p_file"])
    assert p.kind == dummy_kind
    P = p.dense(torch.float64)
    torch.testing.assert_close(P.sum(0), p.nu.double(), atol=1e-6, rtol=0)  # its plan's column sums
    assert p.stats()["kind"] == dummy_kind
    # config.yaml: null for the automatic keys, the resolved values below them
    text = (run_dir / "config.yaml").read_text()
    assert "  lr: null" in text and "# resolved" in text and "#   lr: 0.1" in text
    assert load_config(TranslateConfig, run_dir / "config.yaml").optim.lr is None  # still the same config


def test_the_translator_does_not_import_the_file_format():
    """translator/pfile.py reads the kinds' registry; nothing else of translator/ imports it (the module computes
    C -> P -> E', L'; stats.py summarises P; the stage writes the file)."""
    import ast

    pkg = REPO / "s2t2_dist" / "translator"
    for path in pkg.glob("*.py"):
        if path.name == "pfile.py":
            continue
        names = {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert not any(m and m.endswith("pfile") for m in names), path


def test_freeze_warning_reads_the_scale_of_the_source_marginal():
    """The row projections act at mu_i: under an FVT start marginal on few rows (SmolLM2: ~487 of 49,152, where 0.025
    / 487 learned best and did not freeze, benchmarks/smollm2_cpu2_2026-11-28.md) the range starts at lr ~ 1/487,
    not 1/v."""
    import torch

    from s2t2_dist.translator.recipe import effective_rows

    v = 49152
    uniform = torch.full((v,), 1.0 / v, dtype=torch.float64)
    few = torch.zeros(v, dtype=torch.float64)
    few[:487] = 1.0 / 487
    assert effective_rows(uniform) == pytest.approx(v) and effective_rows(few) == pytest.approx(487)
    assert freeze_warning("sparse", v, 4.9e-5, uniform) == freeze_warning("sparse", v, 4.9e-5) != ""
    assert "lr x v = 2.41" in freeze_warning("sparse", v, 4.9e-5, uniform)
    assert freeze_warning("sparse", v, 4.9e-5, few) == ""
    w = freeze_warning("sparse", v, 4e-3, few)
    assert "lr x the source marginal's effective rows = 1.95 >= 1" in w and "~1/487 scale" in w
