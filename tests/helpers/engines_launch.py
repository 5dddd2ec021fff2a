"""Start tests/helpers/scripts/engines_script.py under the real launchers (deepspeed, torchrun) and collect its
results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "scripts" / "engines_script.py"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def _run(cmd: list[str], timeout: float, log: Path) -> None:
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=timeout)
    log.write_text(p.stdout)
    if p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed with {p.returncode}:\n{p.stdout[-6000:]}")


def launch_deepspeed(args: list[str], out: Path, nproc: int = 2, timeout: float = 240) -> list[dict]:
    """`deepspeed --num_gpus N` (on the CPU accelerator: one process per requested device)."""
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", str(free_port()), str(SCRIPT),
           "--engine", "deepspeed", "--out", str(out), *args]
    _run(cmd, timeout, out.parent / f"{out.name}.log")
    return results(out, nproc)


def launch_torchrun(args: list[str], out: Path, nproc: int = 2, timeout: float = 240) -> list[dict]:
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(free_port()), str(SCRIPT),
           "--out", str(out), *args]
    _run(cmd, timeout, out.parent / f"{out.name}.log")
    return results(out, nproc)


def side_by_side(*launches):
    """Run independent launches (each a `launch_*` function and its arguments) at once: on 2 cores one launcher's
    start-up (imports, rendezvous) overlaps the other's. Their results, in order; the first failure is raised."""
    with ThreadPoolExecutor(len(launches)) as ex:
        futures = [ex.submit(fn, *args) for fn, *args in launches]
        return [f.result() for f in futures]


def results(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(nproc)]
