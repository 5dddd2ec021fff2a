"""distributed/exit.py: a process that tore down a process group leaves through os._exit (no interpreter finalization,
where gloo/NCCL handles can abort a finished rank); any other process exits normally."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers.stage_fixtures import REPO

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch.distributed as dist
    from s2t2_dist.distributed.exit import exit_process
    from s2t2_dist.stages.common import teardown

    atexit.register(lambda: print("finalization ran", flush=True))
    if sys.argv[1] == "dist":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
        teardown()
        assert not dist.is_initialized()
    print("results written", end="", flush=False)  # unflushed on purpose: exit_process must flush it
    exit_process(int(sys.argv[3]))
""")


@pytest.mark.parametrize("mode", ["dist", "plain"])
@pytest.mark.parametrize("code", [0, 3])
def test_exit_process(tmp_path, mode, code):
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path / "store"), str(code)], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert p.returncode == code, p.stderr
    assert p.stdout.startswith("results written")
    # finalization (atexit, C++ destructors at interpreter exit) is skipped only after a teardown
    assert ("finalization ran" in p.stdout) == (mode == "plain")
