"""The layout's promises (docs/DESIGN.md): the public math API, the import direction (the product never imports the
research recipes, the cluster launchers or the test harness), the one E'/L' definition and P statistics shared by
training and export, and the test suite's own layout (a folder per part of the package, helpers in one package)."""
import ast
import math
import re
from pathlib import Path

import pytest
import torch

PKG = Path(__file__).resolve().parents[2] / "s2t2_dist"
TESTS = PKG.parent / "tests"


def test_public_ot_api():
    from s2t2_dist.ot import SparseSinkhorn, softmax_sinkhorn, sparse_sinkhorn, sparsemax

    one_row = SparseSinkhorn(torch.tensor([1.0]), torch.tensor([0.5, 0.5]))(torch.tensor([[3.0, 1.0]]), 1)
    assert torch.allclose(one_row, torch.tensor([[0.5, 0.5]]))  # one row: its columns hold nu
    g = torch.Generator().manual_seed(0)
    C = torch.randn(6, 4, generator=g, dtype=torch.float64)
    mu, nu = torch.full((6,), 1 / 6, dtype=torch.float64), torch.full((4,), 1 / 4, dtype=torch.float64)
    for plan in (sparse_sinkhorn(C, mu, nu, n_iter=50), softmax_sinkhorn(C, mu, nu, n_iter=50)):
        assert plan.shape == (6, 4) and (plan >= 0).all()
        assert torch.allclose(plan.sum(0), nu, atol=1e-9) and torch.allclose(plan.sum(1), mu, atol=1e-3)  # columns last: exact
    assert torch.equal(sparsemax(torch.tensor([[3.0, 1.0, 0.0]]), 2.0), torch.tensor([[2.0, 0.0, 0.0]]))  # Algorithm 2


def _package_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else "s2t2_dist." + ".".join(
                path.relative_to(PKG.parent).with_suffix("").parts[1:-node.level] + (node.module,))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n.startswith("s2t2_dist")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _imports_of(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every import of the package in `path`, at the top or inside functions
    (a lazy import closes a cycle as surely as a top-level one)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or node.level):
            base = node.module or ""
            if node.level:
                pkg = _module_name(path).split(".")
                pkg = pkg[:len(pkg) - node.level + (1 if path.name == "__init__.py" else 0)]
                base = ".".join(pkg + ([base] if base else []))
            out += [(base, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
    return [(m, n) for m, n in out if m.split(".")[0] == "s2t2_dist"]


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a name taken from the public API counts as an import of its home (the API
    resolves names lazily, so its own imports would hide them)."""
    import s2t2_dist.api as api

    graph = {}
    for mod, path in MODULES.items():
        deps = set()
        for m, name in _imports_of(path):
            if m == "s2t2_dist.api" and name in api._HOME:
                m, name = api._HOME[name], None
            target = f"{m}.{name}" if name and f"{m}.{name}" in MODULES else m
            if target in MODULES and target != mod:
                deps.add(target)
        graph[mod] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_static_or_lazy():
    """No two modules of the package import each other, directly or round a loop, counting imports inside
    functions: each cycle is listed with its modules."""
    assert _cycles(_import_graph()) == []


def test_cycle_finder_sees_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_import_of_the_package_resolves():
    """Lazy imports (inside functions) fail only when they run: each one names a module and a name that exist."""
    import importlib

    bad = []
    for mod, path in MODULES.items():
        for m, name in _imports_of(path):
            if m not in MODULES:
                bad.append(f"{mod}: no module {m}")
            elif name and name != "*" and f"{m}.{name}" not in MODULES \
                    and not hasattr(importlib.import_module(m), name):
                bad.append(f"{mod}: {m} has no {name}")
    assert bad == []


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_no_module_imports_a_private_name_of_another_part():
    """A part (a subpackage, or a top-level module such as config.py) keeps its `_private` names and modules to
    itself: another part imports only public names."""
    bad = []
    for mod, path in MODULES.items():
        for m, name in _imports_of(path):
            if _part(m) == _part(mod):
                continue
            private_module = any(p.startswith("_") and p != "__init__" for p in m.split("."))
            if private_module or (name and name.startswith("_") and f"{m}.{name}" not in MODULES):
                bad.append(f"{mod}: {m}{'.' + name if name else ''}")
            elif name and name.startswith("_"):
                bad.append(f"{mod}: {m}.{name} (a private module)")
    assert bad == []


def test_product_never_imports_recipes_or_cluster():
    outside = ("recipes", "cluster")
    bad = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.parts[0] in outside or rel.name == "cli.py":  # cli.py names every command (as strings)
            continue
        for name in _package_imports(path):
            if (name.split(".") + [""])[1] in outside:
                bad.append(f"{rel}: {name}")
    assert bad == []


def test_ot_imports_nothing_else_of_the_package():
    """The math imports nothing of the rest: the route it takes is told to the caller (ot/routing.py, on_route)."""
    for path in (PKG / "ot").rglob("*.py"):
        others = {n for n in _package_imports(path) if not n.startswith("s2t2_dist.ot")}
        assert others == set(), path
    assert _package_imports(PKG / "utils" / "routes.py") == set()  # the leaf stays a leaf


#: the package's ground floors, each importing only from the ones before it (a stage, model or rank-aware part
#: above them hands down what they need, e.g. whether this process is rank 0)
FOUNDATION = ("errors", "registry", "fault_spec", "envvars", "config_docs", "utils")


def test_the_foundation_never_imports_upward():
    bad = []
    for i, part in enumerate(FOUNDATION):
        files = list((PKG / part).rglob("*.py")) if (PKG / part).is_dir() else [PKG / f"{part}.py"]
        allowed = set(FOUNDATION[:i + 1])
        for path in files:
            for name in _package_imports(path) - {"s2t2_dist"}:
                if name.split(".")[1] not in allowed:
                    bad.append(f"{path.relative_to(PKG)}: {name}")
    assert bad == []


def test_stages_take_model_and_tokenizer_helpers_from_their_homes():
    """Model helpers are models/hf.py's and tokenizer helpers data/tokenizers.py's: a stage takes from engines/ only
    the engine it drives (stage 1: TorchEngine for P's optimiser; finetune and evaluate: engines.build; the
    launchers' arguments). No product module parses a tokenizer itself."""
    engine_names = {"TorchEngine", "EngineConfig", "build_model_and_engine", "engine_kind", "engine_overrides"}
    bad = [f"{path.name}: {m}.{n}" for path in (PKG / "stages").glob("*.py") for m, n in _imports_of(path)
           if m.startswith("s2t2_dist.engines") and n not in engine_names]
    assert bad == []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG)
        if rel.as_posix() == "data/tokenizers.py" or rel.parts[0] in ("recipes", "cluster"):
            continue
        calls = {(n.func.value.id, n.func.attr) for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
        assert not calls & {("Tokenizer", "from_file"), ("AutoTokenizer", "from_pretrained")}, path


@pytest.mark.parametrize("normalization,config", [("convex", "olmo-1b"), ("convex", "olmo-7b"),
                                                  ("paper", "olmo-1b"), ("paper", "olmo-7b")])
def test_export_builds_the_rows_training_used(normalization, config):
    """stage 2's initial E'/L' (init_model, from the P file) equal stage 1's (TokenTranslator), tied and untied."""
    from s2t2_dist.models.hf import get_embedding_and_head
    from s2t2_dist.translator.pfile import SparseP
    from s2t2_dist.recipes.tiny import tiny_from_config
    from s2t2_dist.stages.init_model import translated_embeddings
    from s2t2_dist.translator import PStats, TokenTranslator

    model = tiny_from_config(config, vocab=64, seed=3)
    E, L, _ = get_embedding_and_head(model)
    v, u = 40, 12
    g = torch.Generator().manual_seed(1)
    mu = torch.rand(v, generator=g) + 0.5
    nu = torch.rand(u, generator=g) + 0.5
    tr = TokenTranslator.from_frequencies(mu, nu, normalization=normalization)
    with torch.no_grad():
        tr.C.add_(torch.randn(tr.C.shape, generator=g) * 0.05)
    src_ids = torch.randperm(64, generator=g)[:v]
    E1, L1 = tr.embed_and_head(E.detach(), L.detach(), src_ids)
    ex = tr.export_sparse()
    p = SparseP(ex["indices"], ex["values"], tr.mu, tr.nu, src_ids, "s", "t", normalization=normalization)
    E2, L2 = translated_embeddings(model, p)
    assert torch.allclose(E1, E2, atol=1e-6) and torch.allclose(L1, L2, atol=1e-6)
    assert (ex["values"] == 0).sum() == 0 and 0 < ex["values"].numel() < v * u  # a sparse P, not a trivial one
    # one place for P's statistics: the P file's agree with the live translator's
    live, filed = PStats(tr).density_stats(), p.stats()
    assert {k: filed[k] for k in live} == pytest.approx(live)
    # ... and the P file's mass-based sparsity (W = P / nu from the non-zeros) agrees with the translator's dense one
    mass = PStats(tr).mass_stats()
    assert {k: filed[k] for k in mass} == pytest.approx(mass, rel=1e-5)
    assert 0 < filed["max_weight_mean"] <= 1 and 0 <= filed["col_entropy_mean"] <= math.log(v) + 1e-9


#: child code (bench file, the constant holding it) that imports a module of *another checkout* (an A/B against an
#: older tree, which may predate the API or the name): it must reach that tree's own module
CHILD_CODE_OF_ANOTHER_CHECKOUT = {("bench_prepare.py", "_AB_CODE")}


def _child_code_imports(path: Path) -> list[str]:
    """Modules of the package imported by the Python source held in `path`'s string constants (read line by line:
    such code is often a str.format template, which does not parse until it is filled in), but for the constants
    CHILD_CODE_OF_ANOTHER_CHECKOUT names."""
    line = re.compile(r"(?:^|;)\s*(?:from|import)\s+(s2t2_dist[\w.]*)", re.M)  # a line or a `;`-joined statement
    tree = ast.parse(path.read_text())
    other = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             for t in n.targets if isinstance(t, ast.Name) and (path.name, t.id) in CHILD_CODE_OF_ANOTHER_CHECKOUT}
    return [m for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in other for m in line.findall(node.value)]


def test_the_child_code_finder_sees_an_import_in_a_string(tmp_path):
    f = tmp_path / "b.py"
    f.write_text('CODE = """\nimport json\nfrom s2t2_dist.data import shards\nprint({x!r})\n"""\n'
                 'OK = "from s2t2_dist.api import stop"\nTEXT = "see s2t2_dist.data for the shards"\n'
                 'ONE = "import os;from s2t2_dist.data.split import x"\n')
    assert _child_code_imports(f) == ["s2t2_dist.data", "s2t2_dist.api", "s2t2_dist.data.split"]


def test_bench_and_recipes_are_clients_of_the_public_api_only():
    """The lab imports the package only through s2t2_dist.api (by name; no module path of the package appears in
    bench/), the recipes likewise (besides each other), and every name of the API resolves in the module it names
    as its home: a class or function is defined there, not re-exported through another module."""
    import inspect

    import s2t2_dist.api as api

    bench = Path(__file__).resolve().parents[2] / "bench"
    clients = [*bench.rglob("*.py"), *(PKG / "recipes").glob("*.py")]
    taken = {(p.name, m, n) for p in clients for m, n in _imports_of(p)
             if m != "s2t2_dist.api" and not (p.parent.name == "recipes" and m.startswith("s2t2_dist.recipes"))}
    assert not taken, sorted(taken)
    # nor the code a bench hands to a child process (a string run by `python -c` or a script it writes)
    in_children = {(p.name, m) for p in bench.rglob("*.py") for m in _child_code_imports(p) if m != "s2t2_dist.api"}
    assert not in_children, sorted(in_children)
    used = {n for p in clients for m, n in _imports_of(p) if m == "s2t2_dist.api"}
    assert used and used <= set(api.__all__), used - set(api.__all__)
    for name, home in api._HOME.items():
        value = getattr(api, name)
        if name in api._MODULES:
            assert inspect.ismodule(value) and value.__name__ == home, name
        elif inspect.isclass(value) or inspect.isfunction(value):
            assert value.__module__ == home, (name, value.__module__, home)
        else:
            assert hasattr(__import__(home, fromlist=["_"]), name), (name, home)
    for part in ("translator", "ot"):  # and the start itself climbs back into no stage
        for path in (PKG / part).rglob("*.py"):
            assert not [m for m in _package_imports(path) if m.startswith("s2t2_dist.stages")], path


# ------------------------------------------------------------------------------------------------ the test suite
#: folders of tests/ that are no part of the package: tests of bench/, of the package's top-level modules
#: (s2t2_dist/*.py), repository-wide rules, the reliability suite, and the shared helpers (no tests)
TEST_FOLDERS_BESIDE_THE_PARTS = {"bench", "core", "project", "faults", "helpers"}
#: the helpers' package: imported as tests.helpers.<module>; holds no test module
HELPERS = TESTS / "helpers"


def _suite_files(pattern: str = "*") -> list[Path]:
    return [p for p in TESTS.rglob(pattern) if p.is_file() and "__pycache__" not in p.parts]


def test_tests_have_a_folder_per_part_of_the_package():
    """tests/<part>/ for s2t2_dist/<part>/, each folder a package (so two folders may hold modules of one name), no
    test module left at the top, and the helpers in tests/helpers/ only."""
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    parts = {p.name for p in PKG.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders - TEST_FOLDERS_BESIDE_THE_PARTS <= parts, sorted(folders - TEST_FOLDERS_BESIDE_THE_PARTS - parts)
    top = sorted(p.name for p in TESTS.glob("*.py"))
    assert top == ["__init__.py", "conftest.py"], top
    for folder in {p.parent for p in _suite_files("*.py")}:
        assert (folder / "__init__.py").is_file(), f"{folder.relative_to(TESTS.parent)} is not a package"


def test_every_test_module_is_named_test_and_the_helpers_hold_none():
    """Outside tests/helpers/ every module is a test module (test_*.py), a conftest.py or a package's __init__.py:
    scripts the tests start and suites they run in a pytest of their own live in tests/helpers/scripts/."""
    misnamed = sorted(str(p.relative_to(TESTS.parent)) for p in _suite_files("*.py")
                      if HELPERS not in p.parents and not p.name.startswith("test_")
                      and p.name not in ("conftest.py", "__init__.py"))
    assert not misnamed, misnamed
    in_helpers = sorted(str(p.relative_to(TESTS.parent)) for p in HELPERS.rglob("test_*.py"))
    assert not in_helpers, in_helpers


def test_no_file_of_the_tests_edits_sys_path():
    """Helpers are imported as `tests.helpers.<module>` (pytest's `pythonpath = .`, setup.cfg), never through a
    folder put on sys.path by hand."""
    edit = "sys.path" + ".insert"  # (spelled so that this file does not name it)
    offenders = sorted(str(p.relative_to(TESTS.parent)) for p in _suite_files()
                       if p.suffix in (".py", ".sh", ".md", ".txt", ".cfg", ".toml") and edit in p.read_text())
    assert not offenders, offenders


def test_tests_import_each_other_by_package_path():
    """A test module reaches another one as `tests.<part>.test_x` (a bare `from test_x import` worked only while
    every module sat in one folder on sys.path)."""
    bare = re.compile(r"^\s*(from|import)\s+(test_|conftest\b)", re.M)
    offenders = sorted(str(p.relative_to(TESTS.parent)) for p in _suite_files()
                       if p.suffix == ".py" and bare.search(p.read_text()))
    assert not offenders, offenders


# --------------------------------------------------------------------------------------- the benchmarks (bench/)
#: bench/'s scripts run as modules from the repository root (`python -m bench.NAME`), which puts the root on sys.path:
#: they import `tests.helpers...` and each other (`from bench.rehearsal import ...`) without a hand-made path
BENCH = PKG.parent / "bench"
#: a hand edit of the import path: insert, append, extend, remove; an item, slice or the whole list assigned
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove)\b|\[[^\]\n]*\]\s*=(?!=)|\+?=(?!=))")
#: an import placed after such an edit, excused from the imports-at-the-top rule
LATE_IMPORT = re.compile(r"noqa:\s*E402")
#: a bench script started by its file (`python bench/x.py`, `python3 bench/x.py`, `"$PY" bench/x.py`) where the
#: docs and scripts now say `python -m bench.x`
BENCH_BY_FILE = re.compile(r"(\bpython3?|\$\{?PY\b\}?\"?)\s+(\./)?bench/\w+\.py")


def _bench_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix in (".py", ".sh", ".md", ".txt"))


def test_the_bench_patterns_find_what_they_are_for():
    edit = "sys" + ".path"  # (spelled so that this file does not name the edits it looks for)
    for found in [f"{edit}.insert(0, str(REPO))", f"{edit}.append('bench')", f"{edit}[0:0] = [x]", f"{edit} = []",
                  f"{edit} += [x]", f"python3 -c \"import sys; {edit}.insert(0, 'bench')\""]:
        assert SYS_PATH_EDIT.search(found), found
    for clean in [f"print({edit})", f"if {edit}[0] == x:", f"p in {edit}"]:
        assert not SYS_PATH_EDIT.search(clean), clean
    assert LATE_IMPORT.search("import torch  # " + "noqa: E402 - after the path insert")
    for found in ["PYTHONPATH=. python bench/gpu_smoke.py --out O", "item C1 60 python3 bench/bench_sinkhorn.py",
                  '"$PY" bench/bare_step.py M', "`python ./bench/kernel_diag.py`"]:
        assert BENCH_BY_FILE.search(found), found
    for clean in ["PYTHONPATH=. python -m bench.gpu_smoke --out O", "(`bench/rehearsal.py --legs share`)",
                  "OUT=DIR bash bench/gpu_check.sh"]:
        assert not BENCH_BY_FILE.search(clean), clean


def test_bench_is_a_package_that_never_edits_sys_path():
    """bench/ is a package (bench/__init__.py) and no file of it edits sys.path (nor needs `noqa: E402` for an
    import after such an edit): `python -m bench.NAME` from the repository root reaches tests.helpers and the other
    bench modules, and a child process it starts gets the root through PYTHONPATH."""
    assert (BENCH / "__init__.py").is_file()
    offenders = sorted(f"{p.relative_to(BENCH.parent)}:{i}: {line.strip()[:100]}" for p in _bench_files()
                       for i, line in enumerate(p.read_text().splitlines(), 1)
                       if SYS_PATH_EDIT.search(line) or LATE_IMPORT.search(line))
    assert not offenders, "\n".join(offenders)


def _product_patches(path: Path) -> list[str]:
    """Where `path` replaces an attribute of the package at run time: ``X.attr = ...`` or ``setattr(X, ...)`` with X
    a name it imported from s2t2_dist or bound to what one of those built (``task = TranslateTask(...)``); and a
    ``setattr(`` in the code it hands to a child process. An attribute of an attribute (``tr.C.grad = None``) is
    the state of a tensor, not a replacement of the product."""
    tree = ast.parse(path.read_text())
    product: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("s2t2_dist"):
            product.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            product.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("s2t2_dist"))
    for _ in range(2):  # names bound to what a product name built, and to what those built
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                f = node.value.func
                base = f.value if isinstance(f, ast.Attribute) else f
                if isinstance(base, ast.Name) and base.id in product:
                    product.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in product:
                found.append(f"{path.name}:{node.lineno}: {t.value.id}.{t.attr} = ...")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and node.args and isinstance(node.args[0], (ast.Name, ast.Attribute)):
            base = node.args[0]
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in product:
                found.append(f"{path.name}:{node.lineno}: setattr({base.id}, ...)")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\bsetattr\(", node.value):
            found.append(f"{path.name}:{node.lineno}: setattr( in child code")
    return found


def test_the_patch_finder_sees_each_kind_of_replacement(tmp_path):
    f = tmp_path / "b.py"
    f.write_text("from s2t2_dist.api import TranslateTask, shards\nimport torch\n"
                 "task = TranslateTask(1)\ntask.report = None\nsetattr(shards.ShardFile, 'write', len)\n"
                 "t = torch.zeros(1)\nt.grad = None\ntask.C.grad = None\nCODE = 'setattr(x, 1, 2)'\n")
    assert [x.split(": ", 1)[1] for x in _product_patches(f)] == [
        "task.report = ...", "setattr(shards, ...)", "setattr( in child code"]


def test_no_client_replaces_an_attribute_of_the_product():
    """bench/ and recipes/ use the product as it is: a bench that needs another behaviour takes it through a
    parameter, a config key or a hook of the product (or observes it: a profiler), never by replacing a method
    or module attribute at run time (which also times or tests code the product does not run)."""
    clients = [*BENCH.rglob("*.py"), *(PKG / "recipes").glob("*.py")]
    found = [x for p in clients for x in _product_patches(p)]
    assert not found, found


def test_docs_start_bench_scripts_as_modules():
    """Every command in README.md, BENCHMARKS.md, docs/ and bench/ (help texts, gpu_check.sh) starts a bench script
    as `python -m bench.NAME` (benchmarks/ keeps the commands as they were run)."""
    root = BENCH.parent
    files = [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").rglob("*.md")), *_bench_files()]
    offenders = [f"{p.relative_to(root)}:{i}: {line.strip()[:100]}" for p in files
                 for i, line in enumerate(p.read_text().splitlines(), 1) if BENCH_BY_FILE.search(line)]
    assert not offenders, "use `python -m bench.NAME`:\n" + "\n".join(offenders)
