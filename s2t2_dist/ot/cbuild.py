"""Build and load the package's C kernels (``csrc/``): one home for the compiler, the flags and the cache.

A kernel file is compiled on first use with the system's C compiler (``$CC``, else ``cc``/``gcc``/``clang``;
inductor's CPU kernels need one too), ``-O3 -march=native``, into a cache keyed on the sources, the compiler, the
flags and the CPU (``$S2T2_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/s2t2_dist/native``): an atomic rename, so ranks
that build at once never load a half-written file. No compiler, a failed build, or ``S2T2_NATIVE=0``: :func:`load`
returns None (with one warning for the first two) and the caller uses its torch path instead.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["CSRC", "load", "enabled"]

CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-fPIC", "-shared", "-std=c11", "-pthread"]


def enabled() -> bool:
    """False when ``S2T2_NATIVE`` turns the C kernels off."""
    return os.environ.get("S2T2_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _compiler() -> Optional[str]:
    for c in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and flags (a cluster's nodes may share a cache dir)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


def _cache_dir() -> Path:
    d = os.environ.get("S2T2_NATIVE_CACHE")
    if d:
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "s2t2_dist" / "native"


def _build(cc: str, source: Path, out: Path, march: bool) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        cmd = [cc, *_FLAGS, *(["-march=native"] if march else []), "-o", tmp, str(source), "-lm"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build never exposes a partial file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: str, headers: Sequence[str], what: str) -> Optional[ctypes.CDLL]:
    """``csrc/<source>`` (which includes ``headers``, also in ``csrc/``) built and loaded, or None (see the module
    docstring); ``what`` names the torch path used instead in the warning. Callers cache the result."""
    if not enabled():
        return None
    cc = _compiler()
    if cc is None:
        warnings.warn(f"s2t2_dist: no C compiler (cc/gcc/clang or $CC) found: {what}", RuntimeWarning, stacklevel=3)
        return None
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        ver = ""
    src = b"".join((CSRC / f).read_bytes() for f in [source, *sorted(headers)])
    stem = Path(source).stem
    last: Optional[Exception] = None
    for march in (True, False):  # a compiler without -march=native still gets a portable build
        key = hashlib.sha256(b"\0".join([src, cc.encode(), ver.encode(), " ".join(_FLAGS).encode(),
                                         str(march).encode(), _cpu_signature().encode()])).hexdigest()[:24]
        path = _cache_dir() / f"{stem}_{key}.so"
        try:
            if not path.exists():
                _build(cc, CSRC / source, path, march)
            return ctypes.CDLL(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            last = e
    warnings.warn(f"s2t2_dist: could not build {source} ({last}): {what}", RuntimeWarning, stacklevel=3)
    return None
