"""The one config system: dataclasses, YAML files, dotted CLI overrides, validation.

A run config is a tree of dataclasses. `load_config(Cls, "configs/x.yaml", ["optim.lr=1e-4"])` reads the YAML,
applies the overrides and checks every key and type against the dataclass fields, so a mistyped key fails with
its dotted path and a suggestion instead of being ignored. Each section validates its own values in `validate()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from s2t2_dist.errors import ConfigError

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 without sexagesimal numbers: `time: 8:00:00` stays the string SLURM expects, not 28800."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int", __import__("re").compile(r"^[-+]?(0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o?[0-7_]+)$"),
    list("-+0123456789"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(r"^[-+]?(\.[0-9]+|[0-9][0-9_]*(\.[0-9_]*)?)([eE][-+]?[0-9]+)?$|^[-+]?\.(inf|Inf|INF)$|^\.(nan|NaN|NAN)$"),
    list("-+0123456789."))


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives the same key twice (YAML lets the last one win silently; a config must not)."""

    def __init__(self, key, line: int, first: int):
        super().__init__(f"key {key!r} given twice (first at line {first}); remove one")
        self.key, self.line, self.first = key, line, first


def _construct_mapping(self, node, deep=False):
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then overriding a key is meant
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first != key_node.start_mark.line + 1:
                raise DuplicateKeyError(key, key_node.start_mark.line + 1, first)
    return yaml.SafeLoader.construct_mapping(self, node, deep)


_Loader.construct_mapping = _construct_mapping


def yaml_load(text: str):
    return yaml.load(text, Loader=_Loader)


class _CliValue(str):
    """A value typed on the command line, kept as the user wrote it: only keys of a non-string type parse it
    (as YAML), so `run_dir="runs/exp #2"`, `0010`, `2024_01_05` and `0x1F` stay the strings they are."""


def _from_cli(raw: str, tp: Any) -> Any:
    origin, args = typing.get_origin(tp) or (tp if tp in (dict, list, tuple) else None), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if raw in ("null", "~") and len(rest) < len(args):
            return None
        if rest == [str]:
            return str(raw)
    if tp is str or (origin is typing.Literal and all(isinstance(a, str) for a in args)):
        return str(raw)
    if origin in (list, tuple) and not raw.startswith("["):  # a,b,c: split (and each item coerced) by _coerce
        return str(raw)
    if raw == "":
        return ""
    try:
        return yaml_load(raw)
    except yaml.YAMLError:
        return str(raw)


def _plain(value: Any) -> Any:
    """Command-line values inside an untyped mapping parsed as YAML (they are stored, not checked)."""
    if isinstance(value, _CliValue):
        return _from_cli(value, Any)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:  # noqa: C901 - THE type dispatch of the config system: one branch per supported type
    origin = typing.get_origin(tp) or (tp if tp in (dict, list, tuple) else None)  # bare `dict`: as dict[Any, Any]
    args = typing.get_args(tp)
    if isinstance(value, _CliValue):
        value = _from_cli(value, tp)
    if tp is Any:
        return _plain(value)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # `float | None` and the like: the one type's own message
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: {value!r} matches none of {[_type_name(a) for a in args]}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping for section {tp.__name__}, got {value!r}")
        return _build(tp, value, key)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = yaml_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return _plain(dict(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if value.replace("e", "").replace(".", "").isdigit() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is not None and not math.isfinite(number):  # nan and inf are never a setting (lr=inf: uniform P)
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        if number is not None:
            return number
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def _build(cls: type[T], data: dict, prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        removed = getattr(cls, "REMOVED_KEYS", {})  # a section's former keys -> what to write instead
        if k not in fields and k in removed:
            raise ConfigError(f"{key}: this key was removed; {removed[k]}")
        if k not in fields:
            close = difflib.get_close_matches(str(k), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; known keys of this section: {sorted(fields)}")
        kwargs[k] = _coerce(v, hints[k], key)
    try:
        obj = cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from None
    return obj


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        elif not isinstance(nxt, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is a value, not a section")
        node = nxt
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        # kept literally; the dataclass coercion parses it (as YAML) only for a key of a non-string type
        out.append((key, _CliValue(raw)))
    return out


def validate_tree(obj: Any, prefix: str = "") -> None:
    """Run every section's validate(), depth first, and prefix errors with the section's dotted path."""
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        validate_tree(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as e:
            raise ConfigError(f"{prefix}.{e}" if prefix else str(e)) from None


def _drop_slurm_section(cls, data: dict) -> None:
    """A stage YAML may carry the `slurm:` section that `s2t2 submit` reads and checks (docs/slurm.md); the stage
    itself does not use it and drops it knowingly (the product does not import the cluster package)."""
    if "slurm" not in data or "slurm" in {f.name for f in dataclasses.fields(cls)}:
        return
    section = data.pop("slurm")
    if section is not None and not isinstance(section, dict):
        raise ConfigError(f"slurm: expected a mapping of SLURM resources (docs/slurm.md), got {section!r}")


def read_yaml(path: str | Path) -> dict:
    """The one YAML reader of configs (stage configs, SLURM sections): a mapping, or a ConfigError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x}); save the config as "
                          "UTF-8") from None
    try:
        data = yaml_load(text) or {}
    except DuplicateKeyError as e:
        raise ConfigError(f"{path}:{e.line}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply dotted `key=value` overrides to a config tree in place; returns it. Values stay the text typed until
    the dataclass coercion parses those of non-string keys (`_CliValue`)."""
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value)
    return data


def config_from_dict(cls: type[T], data: dict, *, validate: bool = True, prefix: str = "") -> T:
    """Build and validate a config tree from a plain mapping (keys and types checked against the dataclasses).
    validate=False: keys and types only (`s2t2 config` shows a config that is not complete yet). prefix: the
    section's name in error messages (e.g. "slurm": slurm.KEY)."""
    cfg = _build(cls, data, prefix)
    if validate:
        validate_tree(cfg, prefix)
    return cfg


def error_source(message: str, path: str | Path | None, overrides: list[str]) -> str:
    """Where the value a ConfigError names came from: "command line KEY=VALUE" when an override set that key (or a
    section above it), else the YAML file (with the override that also changed the named section, if any); "" for
    defaults without a file. The key is the message's leading dotted path, or the quoted one of an unknown key."""
    import re

    m = re.match(r"(?:unknown config key '([^']+)')|([A-Za-z_][\w.\[\]]*):", message)
    key = (m.group(1) or m.group(2)) if m else ""
    given = [(k, item) for item, (k, _) in zip(overrides, parse_overrides(overrides))]
    hit = [item for k, item in given if key and (key == k or key.startswith(k + ".") or key.startswith(k + "["))]
    if hit:
        return f"command line {hit[-1]}"
    inside = [item for k, item in given if key and k.startswith(key + ".")]  # a section-level error
    if inside:
        return f"{path} with command line {' '.join(inside)}" if path is not None else f"command line {' '.join(inside)}"
    return str(path) if path is not None else ""


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None, *,
                validate: bool = True) -> T:
    data: dict = read_yaml(path) if path is not None else {}
    apply_overrides(data, overrides or [])
    try:
        _drop_slurm_section(cls, data)
        return config_from_dict(cls, data, validate=validate)
    except ConfigError as e:
        where = error_source(str(e), path, list(overrides or []))
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    from s2t2_dist.utils.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(to_dict(cfg), sort_keys=False))
