"""The one reader of S2T2_* variables (s2t2_dist/envvars.py): typed values, one line for a bad one (exit 2, before
any work), the batch shell agreeing with Python, and no S2T2_* read anywhere else in the package or slurm/."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from s2t2_dist import envvars
from s2t2_dist.envvars import VARS, check, get
from s2t2_dist.errors import EnvError

REPO = Path(__file__).resolve().parents[2]
#: being deleted with the C kernels (the lead's change): not moved into the reader
DELETED = {"S2T2_NATIVE", "S2T2_NATIVE_CACHE", "S2T2_PRODUCT_KERNEL"}
#: the reader's own calls
READER_CALLS = {"get", "raw", "is_set"}


@pytest.mark.parametrize("raw,want", [("1", True), ("0", False), ("true", True), ("FALSE", False), ("Yes", True),
                                      ("no", False), ("ON", True), ("off", False), (" no ", False), ("", True)])
def test_booleans_take_the_usual_spellings_in_any_case(raw, want):
    assert get("S2T2_REQUEUE", {"S2T2_REQUEUE": raw}) is want
    assert get("S2T2_TRACEBACK", {"S2T2_TRACEBACK": raw}) is (want if raw else False)


@pytest.mark.parametrize("name,raw,says", [
    ("S2T2_REQUEUE", "maybe", "expected a boolean"),
    ("S2T2_MAX_RESTARTS", "abc", "expected a whole number"),
    ("S2T2_MAX_RESTARTS", "10.5", "expected a whole number"),
    ("S2T2_MAX_RESTARTS", "-1", "out of range"),
    ("S2T2_MASTER_PORT", "99999", "out of range (a port number 1-65535)"),
    ("S2T2_MASTER_PORT", "0", "out of range"),
    ("S2T2_LOG_LEVEL", "verbose", "expected one of DEBUG"),
    ("S2T2_DEVICE", "gpu", "expected one of auto, cpu"),
    ("S2T2_SYNC_DEBUG", "loud", "expected one of error, warn, unset"),
    ("S2T2_LAUNCHER", "mpirun", "expected one of srun, deepspeed"),
    ("S2T2_DIST_BACKEND", "tcp", "expected a backend"),
    ("S2T2_FAULT", "boom:1", "is not ACTION:N[@RANK]"),
    ("S2T2_FAULT", "kill_at_step:-3", "must be >= 0"),
])
def test_a_bad_value_is_one_line_naming_the_variable(name, raw, says):
    with pytest.raises(EnvError) as e:
        get(name, {name: raw})
    msg = str(e.value)
    assert msg.startswith(f"{name}=") or msg.startswith(f"{name}:"), msg
    assert says in msg and "\n" not in msg


def test_typed_values():
    assert get("S2T2_LOG_LEVEL", {"S2T2_LOG_LEVEL": "debug"}) == "DEBUG"
    assert get("S2T2_LOG_LEVEL", {"S2T2_LOG_LEVEL": "warn"}) == "WARNING"
    assert get("S2T2_LOG_LEVEL", {}) == "INFO"
    assert get("S2T2_MASTER_PORT", {"S2T2_MASTER_PORT": "4242"}) == 4242
    assert get("S2T2_MAX_RESTARTS", {}) == 50
    assert get("S2T2_DEVICE", {"S2T2_DEVICE": "CPU"}) == "cpu"
    assert get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "cuda:gloo"}) == "cuda:gloo"


def test_nccl_without_cuda_is_named(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EnvError, match=r"S2T2_DIST_BACKEND='nccl': nccl needs CUDA GPUs and this machine has none"):
        get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "nccl"})
    with pytest.raises(EnvError, match="S2T2_DIST_BACKEND"):
        get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "cpu:gloo,cuda:nccl"})


def test_cache_dir_on_a_file_is_said_under_its_own_name(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(EnvError, match=r"^S2T2_CACHE_DIR=.*/f: is a file, not a directory"):
        get("S2T2_CACHE_DIR", {"S2T2_CACHE_DIR": str(f)})
    with pytest.raises(EnvError, match=r"^S2T2_CACHE_DIR=.*/f/sub: is below .*/f, which is a file"):
        get("S2T2_CACHE_DIR", {"S2T2_CACHE_DIR": str(f / "sub")})
    assert get("S2T2_CACHE_DIR", {"S2T2_CACHE_DIR": str(tmp_path / "new")}) == str(tmp_path / "new")


def test_check_refuses_a_near_miss_name_and_warns_of_removed_and_unknown_names(caplog):
    with pytest.raises(EnvError, match="S2T2_TRACEBAK is not a variable s2t2 reads .did you mean S2T2_TRACEBACK"):
        check(env={"S2T2_TRACEBAK": "1"})
    with caplog.at_level("WARNING", logger="s2t2.env"):
        check(env={"S2T2_FAULTS_SEED": "3", "S2T2_SHARED_DATA": "/x"})  # the test suite's own names: silent
        assert not caplog.records
        check(env={"S2T2_NATIVE": "0", "S2T2_PRODUCT_KERNEL": "live", "S2T2_WHATEVER_ELSE": "1"})
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3, said
    assert said[0].startswith("S2T2_NATIVE is set but no longer read (the native C kernels were removed")
    assert said[1].startswith("S2T2_PRODUCT_KERNEL is set but no longer read")
    assert said[2].startswith("S2T2_WHATEVER_ELSE is not a variable s2t2 reads: it has no effect")


@pytest.mark.parametrize("name", sorted(VARS))
@pytest.mark.parametrize("raw", ["\u00b2", "\u0661\u0662", "a\x00b", "a/" * 3000, "~no_such_user_s2t2/x", "-1",
                                 "9" * 40, "mpi", "kill_at_step:99999999999999999999@x", ":", ","])
def test_every_value_of_every_variable_is_one_line_or_accepted(name, raw):
    # the checker itself never crashes (was: ValueError for a superscript digit as the log level, OSError for a
    # name too long, RuntimeError for ~user of no such user)
    try:
        check(("package", "slurm"), env={name: raw})
    except EnvError as e:
        assert "\n" not in str(e) and name in str(e)


def test_a_backend_this_torch_was_built_without_is_refused(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_mpi_available", lambda: False)
    with pytest.raises(EnvError, match=r"S2T2_DIST_BACKEND='mpi': this torch .* was built without mpi support"):
        get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "mpi"})
    with pytest.raises(EnvError, match="without mpi support"):
        get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "cpu:mpi"})
    monkeypatch.setattr(dist, "is_mpi_available", lambda: True)
    assert get("S2T2_DIST_BACKEND", {"S2T2_DIST_BACKEND": "mpi"}) == "mpi"


def test_a_cache_dir_on_a_device_is_named_as_such():
    with pytest.raises(EnvError, match=r"S2T2_CACHE_DIR=/dev/null: is not a directory \(a device, pipe or socket\)"):
        get("S2T2_CACHE_DIR", {"S2T2_CACHE_DIR": "/dev/null"})


def _s2t2(*args, env):
    base = {k: v for k, v in os.environ.items() if not k.startswith("S2T2_")}
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cli", *args], cwd=REPO, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **env}, timeout=300)


@pytest.mark.parametrize("var,raw", [("S2T2_MASTER_PORT", "99999"), ("S2T2_TRACEBACK", "maybe"),
                                     ("S2T2_LOG_LEVEL", "loud")])
def test_the_command_refuses_a_bad_variable_before_any_work(tmp_path, var, raw):
    run = tmp_path / "run"
    p = _s2t2("evaluate", f"run_dir={run}", f"model.path={tmp_path / 'none'}", env={var: raw})
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [p.stderr.strip()]
    assert p.stderr.startswith(f"s2t2 evaluate: error: EnvError: {var}=")
    assert not run.exists()


def test_log_level_in_lower_case_and_traceback_off_are_accepted(tmp_path):
    # prepare sets up logging first (was: ValueError: Unknown level: 'debug'), then meets the missing input: one
    # line, no traceback (S2T2_TRACEBACK=0 is off; it used to turn tracebacks on)
    args = ("prepare", f"inputs=[{tmp_path / 'none.fasta'}]", f"output_dir={tmp_path / 'out'}")
    p = _s2t2(*args, env={"S2T2_LOG_LEVEL": "debug", "S2T2_TRACEBACK": "0"})
    assert p.returncode == 2 and "ConfigError: command line inputs=" in p.stderr and "Traceback" not in p.stderr, p.stderr
    p = _s2t2(*args, env={"S2T2_TRACEBACK": "yes"})
    assert "Traceback" in p.stderr


# ------------------------------------------------------------------------------------------------- the batch shell

def _shell(body: str, **env) -> subprocess.CompletedProcess:
    fake = Path(os.environ.get("TMPDIR", "/tmp")) / f"s2t2-fake-scontrol-{os.getpid()}"
    fake.mkdir(exist_ok=True)
    (fake / "scontrol").write_text('#!/bin/sh\necho "scontrol $*"\n')
    (fake / "scontrol").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("S2T2_", "SLURM_"))}
    return subprocess.run(["bash", "-c", f". slurm/common.sh; {body}"], cwd=REPO, capture_output=True, text=True,
                          env={**base, "PATH": f"{fake}:{os.environ['PATH']}", "S2T2_HOME": str(REPO),
                               "S2T2_PYTHON": sys.executable, "SLURM_JOB_ID": "7", **env})


@pytest.mark.parametrize("raw,requeued", [("no", False), ("false", False), ("OFF", False), ("0", False),
                                          ("yes", True), ("1", True), ("", True)])
def test_shell_requeue_reads_the_boolean_as_python_does(raw, requeued):
    p = _shell("s2t2_requeue", S2T2_REQUEUE=raw, SLURM_RESTART_COUNT="1")
    assert ("scontrol requeue 7" in p.stdout) is requeued, (p.stdout, p.stderr)
    assert get("S2T2_REQUEUE", {"S2T2_REQUEUE": raw}) is requeued


@pytest.mark.parametrize("raw", ["abc", "10.5", "-3"])
def test_shell_never_requeues_past_a_bad_max_restarts(raw):
    p = _shell("s2t2_requeue", S2T2_MAX_RESTARTS=raw, SLURM_RESTART_COUNT="60")
    assert "scontrol requeue" not in p.stdout
    assert "EnvError: S2T2_MAX_RESTARTS=" in p.stderr and "not requeued" in p.stderr
    p = _shell("s2t2_requeue", S2T2_MAX_RESTARTS="3", SLURM_RESTART_COUNT="3")
    assert "scontrol requeue" not in p.stdout and "already restarted 3 times" in p.stderr


def test_stage_script_checks_the_variables_before_srun():
    p = _shell("s2t2_run_stage translate", S2T2_MAX_RESTARTS="abc")
    assert p.returncode == 2
    assert p.stderr.strip() == "s2t2 env: error: EnvError: S2T2_MAX_RESTARTS='abc': expected a whole number"


# ------------------------------------------------------------------------------- nothing read outside the reader

def _constants() -> dict[str, str]:
    """Every module-level NAME = "S2T2_..." of the package (faults.ENV, loop.SYNC_DEBUG_ENV, ...)."""
    out = {}
    for f in (REPO / "s2t2_dist").rglob("*.py"):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str) and node.value.value.startswith("S2T2_"):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out[t.id] = node.value.value
    return out


def _key(node, consts) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("S2T2_"):
        return node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return consts.get(name)


def python_reads(consts: dict[str, str]) -> list[str]:
    """Each place a Python file reads an S2T2_* variable other than through envvars: `X.get(K)`, `getenv(K)`,
    `X.pop(K)`, `X[K]` (read), `K in X`, K a literal or a module constant."""
    found = []
    files = [*(REPO / "s2t2_dist").rglob("*.py"), *(REPO / "launch").glob("*.py")]
    for f in files:
        if f.name == "envvars.py" and f.parent.name == "s2t2_dist":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            key = None
            if isinstance(node, ast.Call) and node.args:
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
                via_reader = isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) \
                    and fn.value.id == "envvars" and name in READER_CALLS
                if name in ("get", "getenv", "pop") and not via_reader:
                    key = _key(node.args[0], consts)
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                key = _key(node.slice, consts)
            elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
                key = _key(node.left, consts)
            if key and key not in DELETED:
                found.append(f"{f.relative_to(REPO)}:{node.lineno}: {key}")
    return found


def test_no_s2t2_variable_is_read_outside_the_reader():
    consts = _constants()
    assert consts.get("ENV") == "S2T2_FAULT"  # the scan resolves constants (faults.ENV)
    assert python_reads(consts) == []


def test_the_scan_finds_a_direct_read(tmp_path):
    """The scan above is not vacuous: the reads it is meant to catch are caught."""
    code = ('import os\nA = os.environ.get("S2T2_DEVICE")\nB = os.environ["S2T2_TRACEBACK"]\n'
            'C = "S2T2_LOG_LEVEL" in os.environ\nD = os.getenv(SYNC_DEBUG_ENV)\nE = envvars.get("S2T2_DEVICE")\n'
            'os.environ["S2T2_DEVICE"] = "cpu"\n')
    consts = {"SYNC_DEBUG_ENV": "S2T2_SYNC_DEBUG"}
    hits = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and node.args:
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("get", "getenv") and not (isinstance(fn, ast.Attribute) and getattr(fn.value, "id", "")
                                                  == "envvars"):
                hits.append(_key(node.args[0], consts))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hits.append(_key(node.slice, consts))
        elif isinstance(node, ast.Compare):
            hits.append(_key(node.left, consts))
    assert sorted(h for h in hits if h) == ["S2T2_DEVICE", "S2T2_LOG_LEVEL", "S2T2_SYNC_DEBUG", "S2T2_TRACEBACK"]


SHELL_READ = re.compile(r"\$\{?(S2T2_[A-Z0-9_]+)")


def test_slurm_scripts_read_only_declared_variables_and_typed_ones_through_the_reader():
    typed = {n for n, v in VARS.items() if v.kind not in ("text", "path")}
    for f in sorted((REPO / "slurm").glob("*.sh")):
        code = "\n".join(ln.split("#", 1)[0] if ln.lstrip().startswith("#") else ln
                         for ln in f.read_text().splitlines())
        for m in SHELL_READ.finditer(code):
            name = m.group(1)
            assert name in VARS, f"{f.name}: {name} is read but not declared in s2t2_dist/envvars.py"
            assert name not in typed, f"{f.name}: {name} is typed: read it with `s2t2_env {name}`"
        for name in re.findall(r"s2t2_env (\w+)", code):
            assert name in VARS, (f.name, name)
    assert {v.name for v in VARS.values() if v.where == "slurm"} <= set(
        re.findall(r"S2T2_[A-Z0-9_]+", "".join(f.read_text() for f in (REPO / "slurm").glob("*.sh"))))


def test_docs_list_every_variable_as_declared():
    doc = (REPO / "docs" / "environment.md").read_text()
    table = doc.split("-->\n", 1)[1].split("<!-- envvars:end -->", 1)[0]
    assert table == envvars.markdown_table()
    for name in VARS:
        assert f"`{name}`" in table
