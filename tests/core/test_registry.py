"""One Registry type for every name -> implementation table (s2t2_dist/registry.py)."""

import pytest

from s2t2_dist.errors import ConfigError, UserError
from s2t2_dist.registry import Registry


def test_every_registry_of_the_project_is_one_type():
    from s2t2_dist.cli import COMMANDS
    from s2t2_dist.config_docs import STAGE_CONFIGS
    from s2t2_dist.data.records import FORMATS
    from s2t2_dist.engines.build import KINDS as ENGINES
    from s2t2_dist.train.optim import OPTIMIZERS
    from s2t2_dist.translator.kinds import REGISTRY as TRANSLATOR_KINDS

    for r in (COMMANDS, STAGE_CONFIGS, FORMATS, ENGINES, OPTIMIZERS, TRANSLATOR_KINDS):
        assert isinstance(r, Registry) and r.what and len(r) >= 1


def test_register_lookup_and_lazy_load():
    r = Registry("widget", {"a": 1})

    @r.register("b")
    def b():
        return 2

    assert r.lookup("b") is b and r["a"] == 1 and list(r) == ["a", "b"]
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        r.register("a", 3)
    with pytest.raises(ConfigError, match=r"^widget\.kind: 'c' is not a registered widget; choose from a, b$"):
        r.lookup("c", "widget.kind")
    lazy = Registry("thing", {"json": "json:dumps"})
    import json

    assert lazy.load("json") is json.dumps


def test_unknown_names_are_user_errors_naming_the_key():
    from s2t2_dist.engines.build import engine_kind
    from s2t2_dist.train.config import OptimConfig

    with pytest.raises(ConfigError, match=r"^engine\.kind: 'zero9'.*deepspeed, fsdp, plain"):
        engine_kind("zero9")
    with pytest.raises(UserError, match="name: 'lion'"):
        OptimConfig(name="lion").validate()
