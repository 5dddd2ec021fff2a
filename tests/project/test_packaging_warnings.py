"""`pip install -e .` (what .ci/run and the README do) builds the package metadata with setuptools: the metadata must
not make setuptools warn (setup.cfg had both `license` and a licence classifier: ~50 lines of deprecation warnings
in every CI log)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_building_the_metadata_prints_no_setuptools_warning(tmp_path):
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    (tmp_path / "s2t2_dist").mkdir()
    (tmp_path / "s2t2_dist" / "__init__.py").write_text("")
    p = subprocess.run([sys.executable, "-W", "default", "-c", "from setuptools import setup; setup()", "egg_info",
                        "-e", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert "Warning" not in out and "licen" not in out.lower().replace("license: apache-2.0", ""), out
    info = next(tmp_path.glob("*.egg-info")) / "PKG-INFO"
    assert "Apache-2.0" in info.read_text()
