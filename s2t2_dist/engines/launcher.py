"""What the launchers put on a command line, as dotted overrides of the `engine:` section: `deepspeed launch/...
--ds_config configs/ds_zero3.json` (or DeepSpeed's own `--deepspeed_config`, HF's `--deepspeed X.json`) selects
engine.kind=deepspeed with that file, and the `--local_rank=N` the deepspeed launcher appends is dropped (each rank
reads it from the environment). stages/common.py `parse_args` applies `engine_overrides` to every stage config with
an `engine:` section; `s2t2 config` and the recipes do the same."""

from __future__ import annotations

from dataclasses import dataclass

from s2t2_dist.errors import ConfigError


@dataclass
class LauncherArgs:
    ds_config: str | None = None

    def overrides(self, section: str = "engine") -> list[str]:
        """Dotted overrides for the config system: a DeepSpeed config on the command line selects kind=deepspeed."""
        if self.ds_config is None:
            return []
        return [f"{section}.kind=deepspeed", f"{section}.ds_config={self.ds_config}"]


def parse_launcher_args(argv: list[str]) -> tuple[LauncherArgs, list[str]]:
    """Take `--ds_config PATH`, `--deepspeed_config PATH` (DeepSpeed's name), `--deepspeed PATH.json` (HF's name) and
    `--local_rank N` / `--local-rank=N` (appended by the deepspeed launcher) out of argv; return them and the rest."""
    out = LauncherArgs()
    rest: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key, eq, val = a.partition("=")
        if key in ("--ds_config", "--ds-config", "--deepspeed_config", "--deepspeed-config"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{key} needs a path")
                val = argv[i + 1]
                i += 1
            if out.ds_config is not None and out.ds_config != val:
                raise ConfigError(f"two different DeepSpeed configs on the command line: {out.ds_config} and {val}")
            out.ds_config = val
        elif key == "--deepspeed":
            if eq:
                out.ds_config = val
            elif i + 1 < len(argv) and argv[i + 1].endswith(".json"):
                out.ds_config = argv[i + 1]
                i += 1
            # a bare --deepspeed flag (DeepSpeed's add_config_arguments) says nothing more
        elif key in ("--local_rank", "--local-rank"):
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{key} needs a value")
                val = argv[i + 1]
                i += 1
            # dropped: each rank takes its local rank from the environment (distributed/env.py)
        else:
            rest.append(a)
        i += 1
    return out, rest


def engine_overrides(argv: list[str]) -> list[str]:
    """What the launchers add, as dotted overrides: `--ds_config` / `--deepspeed_config` / `--deepspeed X.json`
    select engine.kind=deepspeed with that file (`--local_rank=N` is dropped). Conversely `engine.kind=fsdp` or
    `engine.kind=plain` on the command line drops a DeepSpeed config the YAML file names, so one YAML serves
    `deepspeed ... --ds_config` and `torchrun ... engine.kind=fsdp`."""
    launcher, rest = parse_launcher_args(list(argv))
    rest = rest + launcher.overrides()
    keys = {a.split("=", 1)[0].lstrip("-") for a in rest if "=" in a}
    kinds = [a.split("=", 1)[1] for a in rest if a.lstrip("-").startswith("engine.kind=")]
    if kinds and kinds[-1] != "deepspeed":
        if "engine.ds_config" not in keys:
            rest.append("engine.ds_config=null")
        if not any(k.startswith("engine.ds_overrides") for k in keys):
            rest.append("engine.ds_overrides={}")
    return rest
