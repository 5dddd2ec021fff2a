"""`s2t2 config <stage> [--config F] [key=value ...]`: the config a stage would run with, as YAML, through the stages'
error handling and environment check (its own module: the key documentation it prints is read by the stages too)."""

from __future__ import annotations

import argparse
import sys

from s2t2_dist.config_docs import STAGE_CONFIGS, config_rows, stage_config


def main(argv: list[str]) -> int:
    """`s2t2 config <stage> [--config F] [key=value ...]`: print the resolved config as YAML."""
    from s2t2_dist.stages.common import run_main  # the stages' error handling and environment check

    return run_main("s2t2 config", lambda: _print_config(argv))


def _print_config(argv: list[str]) -> int:
    import yaml

    from s2t2_dist.config import load_config, to_dict, validate_tree
    from s2t2_dist.errors import ConfigError

    p = argparse.ArgumentParser(prog="s2t2 config", description=main.__doc__.split(": ", 1)[1])
    p.add_argument("stage", choices=sorted(STAGE_CONFIGS))
    p.add_argument("--config", "-c", help="YAML run config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. train.steps=100")
    args = p.parse_intermixed_args(argv)  # overrides may come before or after --config
    cls = stage_config(args.stage)
    overrides = list(args.overrides)
    if args.stage in ("finetune", "evaluate"):  # as their entry points read the command line
        from s2t2_dist.engines.launcher import engine_overrides

        overrides = engine_overrides(overrides)
    cfg = load_config(cls, args.config, overrides, validate=False)  # a ConfigError: run_main's one line
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    auto = [r for r in config_rows(cls, default_obj=cfg) if r.default == '"auto"']
    if auto:  # decided when the run starts: say by what rule, from the key's own help
        print("# auto (decided when the run starts):")
        print("".join(f"#   {r.key}: {r.doc}\n" for r in auto), end="")
    refused = None
    try:
        validate_tree(cfg)
    except ConfigError as e:  # incomplete (a template to fill in) or refused: the stage's own words
        refused = e
    describe = getattr(cfg, "describe_resolved", None)  # a stage whose automatic (null) keys resolve later
    if describe is not None:
        try:
            values, waits = describe()
        except ConfigError:
            if refused is None:
                raise
        else:
            print("# resolved (what a run uses for the automatic keys; " + waits + "):")
            print("".join(f"#   {x}\n" for x in yaml.safe_dump(values, sort_keys=False, width=1000).splitlines()),
                  end="")
    if refused is not None:  # the value the describe step could not read is this note's subject
        print(f"s2t2 config: note: `s2t2 {args.stage}` would refuse this config: {refused}", file=sys.stderr)
    return 0
