"""Config sections shared by both stages (the loop and the optimiser)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from s2t2_dist.errors import ConfigError

#: the largest optim.lr taken: no AdamW setting of these models is near it, and 1e308 trained to an infinite C
MAX_LR = 10.0
#: seeds go to torch.manual_seed with the rank and step added (loop.py): kept far inside its 64-bit range
MAX_SEED = 2**32 - 1


def check_seed(seed: int, key: str = "seed") -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{key}: must be in [0, {MAX_SEED}], got {seed}")


@dataclass
class OptimConfig:
    #: the optimiser, a name registered in train/optim.py (OPTIMIZERS)
    name: str = "adamw"
    #: peak learning rate
    lr: float = 1e-3
    #: AdamW decoupled weight decay
    weight_decay: float = 0.0
    #: AdamW (beta1, beta2)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    #: AdamW epsilon
    eps: float = 1e-5
    #: fraction of train.steps of linear warm-up from 0 to lr
    warmup_frac: float = 0.2
    #: the cosine decay after warm-up ends at this fraction of lr
    final_lr_frac: float = 0.1
    #: clip the global gradient norm to this (0: no clipping)
    grad_clip: float = 1.0

    def validate(self) -> None:
        if not 0 < self.lr <= MAX_LR:
            raise ConfigError(f"lr: must be > 0 and at most {MAX_LR:g} (AdamW moves every parameter by up to about lr "
                              f"a step; beyond that the parameters blow up), got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas: need two values in [0, 1), got {self.betas}")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"warmup_frac: must be in [0, 1), got {self.warmup_frac}")
        if not 0 <= self.final_lr_frac <= 1:
            raise ConfigError(f"final_lr_frac: must be in [0, 1], got {self.final_lr_frac}")
        if not 0 <= self.weight_decay * self.lr < 1:  # AdamW scales each parameter by 1 - lr x weight_decay
            raise ConfigError(f"weight_decay: must be >= 0 with lr x weight_decay < 1 (AdamW multiplies every "
                              f"parameter by 1 - lr x weight_decay), got {self.weight_decay} at lr {self.lr}")
        if not 0 < self.eps <= 1:
            raise ConfigError(f"eps: must be in (0, 1], got {self.eps}")
        if self.grad_clip < 0:  # the engines read any value <= 0 as "no clipping": a sign slip would switch it off
            raise ConfigError(f"grad_clip: must be >= 0 (0: no clipping), got {self.grad_clip}")
        from s2t2_dist.train.optim import OPTIMIZERS

        OPTIMIZERS.lookup(self.name, "name")

    def build(self, params, *, fused: bool = False):
        """The optimiser over `params` (parameters, grouped: no weight decay for vectors; or ready-made groups);
        `fused`: the engine's wish for a fused kernel (train/optim.py)."""
        from s2t2_dist.train.optim import OPTIMIZERS, param_groups

        return OPTIMIZERS.lookup(self.name, "optim.name")(param_groups(params, self.weight_decay), self, fused)

    def schedule(self, optimizer, total_steps: int):
        """The lr schedule: linear warm-up over warmup_frac, cosine decay to final_lr_frac, over total_steps."""
        from s2t2_dist.train.optim import build_scheduler

        return build_scheduler(optimizer, total_steps, self.warmup_frac, self.final_lr_frac)

    def fingerprint(self) -> dict:
        """The settings a resumed run must share, by value (a refusal names the changed one); `name` only when it
        is not adamw, so checkpoints written before optim.name existed still resume."""
        d = dataclasses.asdict(self)
        if d["name"] == "adamw":
            del d["name"]
        return d


@dataclass
class TrainConfig:
    #: optimiser steps of the whole run (a resumed run continues up to it); 0: no training, the stage scores and
    #: exports its start (translate: the initial P, e.g. the FVT start; finetune: the initialised model)
    steps: int = 2000
    #: global batch in sequences per optimiser step (paper: 16), split over ranks and accumulation steps
    batch_size: int = 16
    #: sequences per rank per forward pass; auto: the largest divisor of batch_size / ranks whose
    #: micro_batch_size x context_len fits max_micro_tokens (so one config runs on any rank count dividing batch_size)
    micro_batch_size: int | Literal["auto"] = 16
    #: with micro_batch_size auto: the most tokens per rank per forward pass (activation memory grows with it)
    max_micro_tokens: int = 4096
    #: tokens per training sequence (must equal the shards' context_len)
    context_len: int = 512
    #: seed of model initialisation and data order
    seed: int = 0
    #: auto: bf16 compute on GPU, fp32 on CPU; fp32; bf16
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    #: steps between loss / throughput logs (TensorBoard, progress bar)
    log_every: int = 10
    #: steps between held-out evaluations on data.eval (0: none during training)
    eval_every: int = 0
    #: held-out documents scored per evaluation (0: all)
    eval_max_docs: int = 0
    #: steps between checkpoints (0: only the final one)
    ckpt_every: int = 100
    #: the newest checkpoints kept on disk; older ones are deleted
    keep_checkpoints: int = 2
    #: a step whose loss or gradients are not finite is skipped; after this many the run stops
    max_bad_steps: int = 10
    #: stop (with a checkpoint) after this many steps of this invocation; 0 = run to `steps` (for tests, time limits)
    stop_after: int = 0
    #: [first, last]: a torch.profiler trace of steps first..last (1-based) per rank in RUN_DIR/tb/profile
    #: (TensorBoard's profiler plugin opens it); []: no profiling
    profile: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"steps: must be >= 0 (0: score the start without training), got {self.steps}")
        for k in ("batch_size", "micro_batch_size", "context_len", "max_micro_tokens", "log_every"):
            if getattr(self, k) != "auto" and getattr(self, k) <= 0:
                raise ConfigError(f"{k}: must be > 0, got {getattr(self, k)}")
        for k in ("ckpt_every", "max_bad_steps", "eval_every", "eval_max_docs", "stop_after"):
            if getattr(self, k) < 0:
                raise ConfigError(f"{k}: must be >= 0, got {getattr(self, k)}")
        check_seed(self.seed)
        if self.profile and (len(self.profile) != 2 or not 1 <= self.profile[0] <= self.profile[1]):
            raise ConfigError(f"profile: [first, last] steps with 1 <= first <= last, or [] for none; got "
                              f"{self.profile}")
        if self.keep_checkpoints < 1:  # 0 deleted every checkpoint as soon as it was written
            raise ConfigError(f"keep_checkpoints: must be >= 1 (the newest checkpoint is what a restart resumes "
                              f"from), got {self.keep_checkpoints}")

    def micro_for(self, world_size: int, ranks: str = "") -> int:
        """The micro-batch on ``world_size`` ranks (auto resolved); ConfigError naming the keys if the layout is
        impossible. ``ranks``: how the rank count came about, for the message (e.g. "slurm.nodes=2 x ...")."""
        if self.batch_size % world_size:
            raise ConfigError(f"train.batch_size={self.batch_size} is not a multiple of the ranks "
                              f"({ranks or f'{world_size} ranks'}), "
                              "whatever train.micro_batch_size: impossible layout; change train.batch_size or the "
                              "number of ranks")
        per_rank = self.batch_size // world_size
        if self.micro_batch_size == "auto":
            fits = max(self.max_micro_tokens // self.context_len, 1)
            return max(m for m in range(1, min(per_rank, fits) + 1) if per_rank % m == 0)
        if per_rank % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size={self.batch_size} is not a multiple of micro_batch_size x ranks = "
                f"{self.micro_batch_size} x {world_size}{f' ({ranks})' if ranks else ''}: impossible layout; "
                "set train.micro_batch_size=auto or a divisor of batch_size / ranks")
        return self.micro_batch_size

    def grad_accum(self, world_size: int) -> int:
        return self.batch_size // (self.micro_for(world_size) * world_size)

    def resolve_layout(self, world_size: int) -> int:
        """Fix micro_batch_size for ``world_size`` ranks (auto becomes a number); returns the accumulation steps."""
        self.micro_batch_size = self.micro_for(world_size)
        return self.grad_accum(world_size)
