"""`ruff check .` (what .ci/run runs) lints every module of the package: a folder whose name is in ruff's default
exclude list (as `dist/` was until it became `distributed/`) would silently drop out of the lint."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_checks_every_package_module():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed (the dev extra installs it; .ci/run runs it)")
    out = subprocess.run([ruff, "check", "--show-files", "."], cwd=REPO, capture_output=True, text=True, check=True)
    checked = {Path(line).resolve() for line in out.stdout.splitlines() if line.strip().endswith(".py")}
    package = {p.resolve() for p in (REPO / "s2t2_dist").rglob("*.py")}
    assert package and package <= checked, sorted(str(p.relative_to(REPO)) for p in package - checked)
