"""Help texts carry no measured numbers (BpB, non-zero fractions, speeds): measurements change with every benchmark
and live in BENCHMARKS.md with their command; a help text that quotes one goes stale (`s2t2 translate --help` once
said "1.3%" where the measurements said 0.6%). The product cites stable section names, never the issue or work
session a change came from, and a key's help is at most two lines (its rationale lives in the docs)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import subprocess
import textwrap
import typing
import sys
from pathlib import Path

import pytest

from s2t2_dist.config_docs import STAGE_CONFIGS, config_rows, format_keys

REPO = Path(__file__).resolve().parents[2]
#: what a measurement looks like in prose: 4.440 BpB, 1.3%, 43% non-zeros, 75 s on 2 cores, 1.5x faster
MEASURED = re.compile(r"\d+\.\d+\s*%|\d[\d.,]*\s*BpB|\d+\s*%\s*non-zeros|\d+(\.\d+)?\s*s on \d|\d+(\.\d+)?x faster")


def _config_class(stage: str):
    import importlib

    module, name = STAGE_CONFIGS[stage].split(":")
    return getattr(importlib.import_module(module), name)


def test_the_pattern_finds_what_it_is_for():
    assert MEASURED.search("on the demo's proteins 4.440 with 1.3% (BENCHMARKS.md)")
    assert MEASURED.search("stories260K: 68% -> 43% non-zeros, 1.585 -> 1.611 BpB")
    assert not MEASURED.search("fewer than 5% of the target columns; 0.01/v; optim.lr=1e-3")


@pytest.mark.parametrize("stage", sorted(STAGE_CONFIGS))
def test_stage_help_has_no_measured_numbers(stage):
    text = format_keys(_config_class(stage), stage)
    assert not [m.group(0) for m in MEASURED.finditer(text)], text


def test_translate_help_as_typed():
    p = subprocess.run([sys.executable, "-m", "s2t2_dist.cli", "translate", "--help"], cwd=REPO, text=True,
                       capture_output=True, timeout=300)
    assert p.returncode == 0 and "translator.init" in p.stdout
    assert not [m.group(0) for m in MEASURED.finditer(p.stdout)]
    assert "docs/translator.md" in p.stdout  # where the reasons are (the numbers: BENCHMARKS.md)


@pytest.mark.parametrize("cmd", ["demo", "reproduce"])
def test_recipe_help_has_no_measured_numbers(cmd, capsys):
    from s2t2_dist.cli import main

    with pytest.raises(SystemExit):
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert out and not [m.group(0) for m in MEASURED.finditer(out)], out


#: a citation of the project's history: "session 14", "#37" (what `grep -rInE` of the README's check looks for),
#: "issue 36"
HISTORY = re.compile(r"session [0-9]+|#[0-9]{2}\b|[Ii]ssue #?[0-9]+\b")
#: where the product speaks: the package, its launchers, the shipped configs and scripts, the benchmarks' code,
#: README and docs (BENCHMARKS.md's dated records and CHANGELOG.md keep history)
PRODUCT = ["s2t2_dist", "launch", "slurm", "configs", "bench", "setup.cfg", "README.md", "docs"]
#: a key's help: two lines of the 120-column source, joined into one line by --help
HELP_MAX_LINES = 2
HELP_MAX_CHARS = 2 * 120


def test_the_history_pattern_finds_what_it_is_for():
    for cited in ["0.8 since #37 session 14", "BENCHMARKS.md #24", "(issue 36)", "see issue #33", "session 5"]:
        assert HISTORY.search(cited), cited
    for clean in ['run_dir="runs/exp #2"', "byte {b:#04x}", "BENCHMARKS.md, \"Stage-1 quality\"", "v = 49,152"]:
        assert not HISTORY.search(clean), clean


def _product_files():
    for name in PRODUCT:
        path = REPO / name
        for f in [path] if path.is_file() else sorted(path.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                try:
                    yield f, f.read_text(encoding="utf-8")
                except UnicodeDecodeError:  # images and other binary files
                    continue


def test_the_product_cites_no_issue_or_session_numbers():
    found = [f"{f.relative_to(REPO)}:{i}: {ln.strip()[:100]}" for f, text in _product_files()
             for i, ln in enumerate(text.splitlines(), 1) if HISTORY.search(ln)]
    assert not found, "cite a section name (BENCHMARKS.md, docs/), not the history:\n" + "\n".join(found)


def _config_classes(cls, seen=None):
    seen = set() if seen is None else seen
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and klass not in seen:
            seen.add(klass)
            yield klass
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _config_classes(hints[f.name], seen)


def _help_blocks(klass):
    """{field: number of `#:` lines above it} in the class's own source (the block --help shows)."""
    src = textwrap.dedent(inspect.getsource(klass))
    lines = src.splitlines()
    node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef))
    out = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            i = stmt.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#:"):
                i -= 1
            out[stmt.target.id] = stmt.lineno - 2 - i
    return out


@pytest.mark.parametrize("stage", sorted(STAGE_CONFIGS))
def test_a_keys_help_is_at_most_two_lines(stage):
    cls = _config_class(stage)
    long_blocks = [f"{k.__name__}.{name}: {n} lines" for k in _config_classes(cls)
                   for name, n in _help_blocks(k).items() if n > HELP_MAX_LINES]
    long_help = [f"{r.key}: {len(r.doc)} characters" for r in config_rows(cls) if len(r.doc) > HELP_MAX_CHARS]
    assert not long_blocks and not long_help, "move the rationale to docs/: " + "; ".join(long_blocks + long_help)
    assert any(r.doc for r in config_rows(cls))  # the walk found the help it checks


def test_source_lm_help_gives_its_whole_first_paragraph(capsys):
    from s2t2_dist.cli import main

    with pytest.raises(SystemExit):
        main(["source-lm", "--help"])
    out = capsys.readouterr().out
    assert "once, and print its path (for `model.path=` of translate / finetune / evaluate)." in out
    assert "stories260k" in out and "smollm2" in out  # the names, below the options
