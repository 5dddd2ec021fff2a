"""What each config key means, from the config dataclasses themselves: `s2t2 <stage> --help` and `s2t2 config`.

Convention (every config dataclass of every stage): a field's description is the `#:` comment block directly above
it (Sphinx's attribute-doc syntax), so the source is the documentation and nothing is written twice:

    #: rolling windows per forward call
    batch_size: int = 8

`config_rows(Cls)` lists every dotted key (and section) with its type, default and description; `format_keys`
renders them for --help. `s2t2 config <stage> [--config F] [key=value ...]` prints the resolved config as YAML (an unknown key or a
wrong type: one line, exit 2; a config that loads but would not pass the stage's validation is printed, with one
line on stderr saying why).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
import types
import typing
from typing import Any

from s2t2_dist.registry import Registry

#: the config class of each stage command ("module:Class"), imported only when asked for
STAGE_CONFIGS = Registry("stage", {
    "prepare": "s2t2_dist.data.config:DataConfig",
    "translate": "s2t2_dist.stages.translate:TranslateConfig",
    "finetune": "s2t2_dist.stages.finetune:FinetuneConfig",
    "evaluate": "s2t2_dist.stages.evaluate:EvaluateConfig",
})


def stage_config(stage: str) -> type:
    return STAGE_CONFIGS.load(stage, "stage")


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its `#:` comment block joined into one line} for one dataclass ('' where there is none); a
    field a subclass inherits (or redeclares without a comment) keeps its base class's description."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not object and dataclasses.is_dataclass(base):
            docs.update({k: v for k, v in _own_field_docs(base).items() if v or k not in docs})
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    lines, _ = inspect.getsourcelines(cls)
    src = textwrap.dedent("".join(lines))
    lines = src.splitlines()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef))
    docs = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            i, parts = stmt.lineno - 2, []
            while i >= 0 and lines[i].strip().startswith("#:"):
                parts.insert(0, lines[i].strip()[2:].strip())
                i -= 1
            docs[stmt.target.id] = " ".join(p for p in parts if p)
    return docs


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in args) + "}"
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0])}]" if args else "list"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _show(value: Any) -> str:
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list, tuple, dict)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


@dataclasses.dataclass
class KeyDoc:
    key: str
    type: str
    default: str
    doc: str


def config_rows(cls: type, prefix: str = "", default_obj: Any = None) -> list[KeyDoc]:
    """Every leaf key of a config tree, dotted, with its type, default and description. Defaults come from an
    instance, so a section whose parent sets other defaults (e.g. evaluate's init.kind=as_is) shows those."""
    obj = default_obj if default_obj is not None else cls()
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            rows.append(KeyDoc(key, "section", "", docs.get(f.name, "")))
            rows.extend(config_rows(tp, key + ".", value))
        else:
            rows.append(KeyDoc(key, type_name(tp), _show(value), docs.get(f.name, "")))
    return rows


def format_keys(cls: type, stage: str | None = None) -> str:
    """The --help listing: `key: type = default` and its description on the next line."""
    rows = config_rows(cls)
    head = ("config keys (in the --config YAML file, or as dotted key=value on the command line"
            + (f"; `s2t2 config {stage} ...` prints the resolved config" if stage else "") + "):")
    out = [head]
    for r in rows:
        if r.type == "section":
            out.append(f"  [{r.key}] {r.doc}")
            continue
        out.append(f"  {r.key}: {r.type} = {r.default}")
        out.append(f"      {r.doc}")
    return "\n".join(out)
