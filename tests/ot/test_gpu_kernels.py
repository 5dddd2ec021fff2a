"""The GPU kernels (the sparse Sinkhorn's CUDA route, the translator product's live-row kernels) on a CPU, by
Triton's interpreter: each interpreted module runs in a pytest of its own, started with TRITON_INTERPRET=1 in its
environment (Triton reads the switch when the kernels are defined, so it must be set before anything imports them)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "helpers" / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize("module,least", [("sinkhorn_triton_interpreted.py", 24), ("gpu_kernels_interpreted.py", 9),
                                            ("stage1_kernels_interpreted.py", 1)])
def test_interpreted(module, least):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("S2T2_TEST_TIMELINE", None)  # (tests/conftest.py: this run's timeline is the outer pytest's)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-o", "addopts=",
                           str(SCRIPTS / module)], env=env, capture_output=True, text=True, timeout=1500,
                          cwd=REPO)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= least and "failed" not in proc.stdout, proc.stdout[-2000:]
