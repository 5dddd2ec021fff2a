"""`s2t2 <command> [--config FILE] [dotted.key=value ...]`: one entry point for every stage.

Commands import their stage lazily so that `s2t2 --help` stays fast and a stage's heavy dependencies
(DeepSpeed, transformers) load only when used.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from s2t2_dist.registry import Registry

#: command -> (module with main(argv), one-line description)
COMMANDS = Registry("command", {
    "prepare": ("s2t2_dist.stages.prepare", "Split, train the BPE tokenizer, write webdataset shards"),
    "translate": ("s2t2_dist.stages.translate", "Stage 1: learn the token translation P through a frozen LM"),
    "finetune": ("s2t2_dist.stages.finetune", "Stage 2: finetune the whole model (DeepSpeed ZeRO / FSDP2)"),
    "evaluate": ("s2t2_dist.stages.evaluate",
                 "Perplexity and bits-per-byte on the held-out split, or on any FASTA / jsonl / parquet / text file"),
    "config": ("s2t2_dist.config_cli", "Print a stage's resolved config as YAML (--config F, key=value overrides)"),
    "submit": ("s2t2_dist.cluster.submit", "Submit a stage to SLURM with submitit (requeues on preemption)"),
    "demo": ("s2t2_dist.recipes.demo", "The whole pipeline on the bundled protein sample, in minutes on a CPU"),
    "reproduce": ("s2t2_dist.recipes.reproduce", "The paper's Table 1 and transfer experiment at a chosen scale"),
    "source-lm": ("s2t2_dist.recipes.source_lm",
                  "Build a pretrained source model (stories260k, smollm2) as a cached Hugging Face directory"),
})


def main(argv: list[str] | None = None) -> int:
    from s2t2_dist.utils import stop

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        p = argparse.ArgumentParser(prog="s2t2", description=__doc__.splitlines()[0])
        p.add_argument("command", choices=sorted(COMMANDS))
        print(p.format_help())
        for name, (_, desc) in COMMANDS.items():
            print(f"  {name:<10} {desc}")
        print("\n`s2t2 <command> --help` lists every config key of a stage with its type, default and meaning.")
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"s2t2: unknown command {cmd!r}; choose from {', '.join(sorted(COMMANDS))}", file=sys.stderr)
        return 2
    try:
        with stop.installed():  # before the stage's imports: a time-limit signal now is a clean stop, not exit 138
            module = importlib.import_module(COMMANDS[cmd][0])
            return int(module.main(rest) or 0)
    except stop.Stopped as s:  # while importing (run_main reports the ones after)
        print(f"s2t2 {cmd}: stopped by {stop.name(s.signum)} while starting; nothing was written", file=sys.stderr)
        return 0


def entry() -> None:
    """The `s2t2` console script: a rank that ran distributed exits without Python's finalization (distributed/exit.py)."""
    from s2t2_dist.distributed.exit import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()
