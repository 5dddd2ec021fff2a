"""The reproduction's plan vocabulary, shared by `reproduce` (runs the jobs) and `reproduce_report` (reads their
results) so that neither imports the other: Table 1's columns and the paper's numbers, the configuration and its
presets, and the Job/Setting records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from s2t2_dist.api import ConfigError

# ----------------------------------------------------------------------------------------------------------------
# configuration

#: Table 1 columns in the paper's order: key -> label
TABLE1 = {
    "plain_p": "Plain P", "plain_p_cft": "+ CFT",
    "sinkhorn_p": "Sinkhorn P", "sinkhorn_p_cft": "+ CFT",
    "s2t2": "S2T2", "s2t2_cft": "+ CFT",
    "ft_orig_tok": "FT orig. tok.", "ft_new_tok": "FT new tok.",
}
#: translator kind of each P-only column
KINDS = {"plain_p": "unconstrained", "sinkhorn_p": "softmax", "s2t2": "sparse"}
#: the paper's numbers (Table 1), for the report
PAPER_TABLE1 = {
    "plain_p": (174.20, 4.09), "plain_p_cft": (130.44, 3.86), "sinkhorn_p": (167.74, 4.06),
    "sinkhorn_p_cft": (136.12, 3.89), "s2t2": (144.03, 3.94), "s2t2_cft": (118.78, 3.78),
    "ft_orig_tok": (151.05, 7.24), "ft_new_tok": (130.56, 3.86),
}


@dataclass
class SourceRecipe:
    """A byte-level English LM pretrained by models.pretrain_english (EnglishLMConfig keys)."""

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    context_len: int = 128
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0


@dataclass
class PLrSweep:
    """Step sizes (absolute AdamW lr) tried for each translator kind; each grid holds the kind's automatic step
    (sparse 0.015/u from its start, softmax 0.1, unconstrained 2.5/v; v = 235 at single_byte, u = 512) and the
    paper's 1e-3."""

    #: S2T2's steps (its automatic step is 0.015/u: 2.9e-5 at u = 512)
    sparse: list[float] = field(default_factory=lambda: [1e-5, 3e-5, 1e-4, 3e-4, 1e-3])
    #: Sinkhorn P's steps (automatic: 0.1)
    softmax: list[float] = field(default_factory=lambda: [1e-3, 1e-2, 1e-1, 1.0])
    #: Plain P's steps (automatic: 2.5/v)
    unconstrained: list[float] = field(default_factory=lambda: [1e-4, 3e-4, 1e-3, 1e-2])


@dataclass
class RealLMOptions:
    """Keys of the real-LM scale (smollm2)."""

    #: the source model: empty for SmolLM2-135M-Instruct (`s2t2 source-lm smollm2`), or a Hugging Face directory
    model: str = ""
    #: source tokens: single_byte (the paper's "bytes"), single_char, all, or a file of ids
    source_vocab: str = "single_byte"
    #: precision of the training runs (held-out scores are always fp32); auto: bf16 where it is computed in
    #: hardware (a GPU, or a CPU with AVX-512 / AMX bf16), else fp32 (emulated bf16 is ~15x slower: the command
    #: warns). Part of each arm's spec: the kept records are bf16 arms and stand for no fp32 one
    precision: Literal["auto", "bf16", "fp32"] = "bf16"
    #: parallel single-thread processes running the arms
    lanes: int = 2
    #: fraction of the unique sequences held out (by a hash of the sequence)
    heldout_fraction: float = 0.1
    #: the S2T2 P-only curve on seed 0: its steps (0: none) and how often it is scored on the validation split
    curve_steps: int = 1000
    eval_every: int = 100
    #: starts the dense baselines (Plain P, Sinkhorn P) are selected from: paper (C = 1/v, uniform mu), shipped (FVT)
    baseline_starts: list[str] = field(default_factory=lambda: ["paper", "shipped"])
    #: also a P-only row of S2T2 at the paper's entropy weight alpha = 0, its start (shipped or the paper's) and
    #: step chosen from the sparse grid
    s2t2_alpha0: bool = True
    #: the step sizes each P column is selected from (validation split, seed 0)
    p_lr_sweep: PLrSweep = field(default_factory=PLrSweep)
    #: finetuning steps tried: every finetuned row on seed 0 at each, its own step chosen on the validation split
    #: (each baseline at its best step); the other seeds run each row at its step
    ft_lr_sweep: list[float] = field(default_factory=lambda: [2e-5, 1e-4, 3e-4])
    #: the P-only ceiling probe's steps: free input and output embeddings for the new tokens on the frozen body
    #: (finetune trainable=embeddings from S2T2's start, p_steps steps, seed 0), chosen on the validation split; at
    #: least as expressive as any P, so the P-only rows are read as a fraction of the gap from the start to it
    #: ([]: no probe)
    probe_lr_sweep: list[float] = field(default_factory=lambda: [1e-3, 3e-3, 1e-2])
    #: checkpoint cadence of every arm (a killed lane resumes from here)
    ckpt_every: int = 50
    #: validation BpB every this many finetuning steps (0: at the end only): the finetuned rows' validation curves,
    #: which read the rows at equal total tokens (a P + CFT row has seen its P-only steps too: a multiple of
    #: p_steps puts a point there)
    ft_eval_every: int = 200

    def validate(self) -> None:
        for key in ("lanes", "eval_every"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("curve_steps", "ckpt_every", "ft_eval_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}: must be >= 0, got {getattr(self, key)}")
        if not 0 < self.heldout_fraction < 1:
            raise ConfigError(f"heldout_fraction: must be in (0, 1), got {self.heldout_fraction}")
        if not self.baseline_starts or set(self.baseline_starts) - {"paper", "shipped"}:
            raise ConfigError(f"baseline_starts: a non-empty list of paper, shipped; got {self.baseline_starts}")
        grids = [self.p_lr_sweep.sparse, self.p_lr_sweep.softmax, self.p_lr_sweep.unconstrained, self.ft_lr_sweep]
        if any(not g or min(g) <= 0 for g in grids):
            raise ConfigError("p_lr_sweep.*, ft_lr_sweep: non-empty lists of learning rates > 0")
        if any(lr <= 0 for lr in self.probe_lr_sweep):
            raise ConfigError(f"probe_lr_sweep: learning rates > 0 (or []: no probe), got {self.probe_lr_sweep}")


@dataclass
class ReproduceConfig:
    #: the preset (--scale)
    scale: str = "tiny"
    #: paired seeds: every row runs each
    seeds: list[int] = field(default_factory=lambda: [0])
    #: target BPE vocabulary (paper: 512 with OLMo's 50k rows; locally <= the byte LMs' 264 rows)
    vocab_size: int = 256
    context_len: int = 64
    #: global batch (sequences of context_len tokens) of every training run
    batch_size: int = 8
    p_steps: int = 20
    ft_steps: int = 20
    #: learning rate of P (paper 1e-3) and of whole-model finetuning (paper 2e-5 over 2000 steps on OLMo)
    p_lr: float = 1e-3
    #: local scales: choose each translator's P learning rate among these by its final TRAINING loss (mean of the
    #: last quarter of the logged steps; first seed, p_steps steps) instead of using p_lr for all. Empty: p_lr.
    p_lr_sweep: list[float] = field(default_factory=list)
    ft_lr: float = 1e-3
    ft_weight_decay: float = 0.01
    #: P learning rate of the transfer experiment's runs (paper 2e-5); null: the S2T2 column's
    transfer_p_lr: float | None = None
    #: entropy weights of the transfer experiment (alpha = 0 is the S2T2 column's P when the lrs agree)
    alphas: list[float] = field(default_factory=lambda: [0.0, 0.1])
    #: held-out documents scored (0: all)
    eval_max_docs: int = 0
    log_every: int = 2
    #: local scales: the small source LM (Table 1, P learned for the transfer)
    small: SourceRecipe = field(default_factory=SourceRecipe)
    #: local scales: the larger source LM the transfer applies P to
    large: SourceRecipe = field(default_factory=SourceRecipe)
    #: the real-LM scale's keys
    lm: RealLMOptions = field(default_factory=RealLMOptions)

    def validate(self) -> None:
        if not self.seeds:
            raise ConfigError("seeds: give at least one")
        if min(self.p_steps, self.ft_steps, self.batch_size, self.context_len) < 1:
            raise ConfigError("p_steps, ft_steps, batch_size, context_len must be >= 1")
        if not self.alphas or min(self.alphas) < 0:
            raise ConfigError("alphas: non-empty, each >= 0")
        if any(x <= 0 for x in self.p_lr_sweep) or (self.transfer_p_lr is not None and self.transfer_p_lr <= 0):
            raise ConfigError("p_lr_sweep, transfer_p_lr: learning rates must be > 0")
        if self.scale == "paper" and self.p_lr_sweep:
            raise ConfigError("p_lr_sweep: a local-scale option (the paper scale uses the paper's p_lr)")


def preset(scale: str) -> ReproduceConfig:
    if scale == "tiny":  # the pipeline end to end in CI minutes; numbers are not meaningful
        return ReproduceConfig(
            scale="tiny", seeds=[0], vocab_size=256, context_len=64, batch_size=8, p_steps=10, ft_steps=10,
            p_lr_sweep=[1e-4, 1e-3], alphas=[0.0, 0.1], eval_max_docs=30, log_every=2,
            small=SourceRecipe(n_layers=1, d_model=32, n_heads=2, context_len=64, batch_size=16, steps=40),
            large=SourceRecipe(n_layers=2, d_model=48, n_heads=4, context_len=64, batch_size=16, steps=40))
    if scale == "small":  # ~12 min on 2 shared CPU cores, 11.6 measured (the source LMs, 25 s, are cached)
        return ReproduceConfig(
            scale="small", seeds=[0, 1, 2], vocab_size=256, context_len=128, batch_size=8, p_steps=200,
            ft_steps=200, p_lr_sweep=[1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0], alphas=[0.0, 0.1, 1.0], log_every=10,
            # the source LMs are built for the runs' 128 positions (the stages refuse a longer context than the
            # model's); 8 x 128 tokens per step, as 16 x 64 before
            small=SourceRecipe(n_layers=2, d_model=64, n_heads=4, context_len=128, batch_size=8, steps=300),
            # more width and more steps: the transfer needs a target model that is better on English
            large=SourceRecipe(n_layers=2, d_model=128, n_heads=4, context_len=128, batch_size=8, steps=600))
    if scale == "smollm2":  # a real pretrained LM on a CPU: ~18 hours at bf16 in two lanes (2 cores), resumable
        return ReproduceConfig(scale="smollm2", seeds=[0, 1, 2], vocab_size=512, context_len=256, batch_size=4,
                               p_steps=200, ft_steps=600, eval_max_docs=0, log_every=10, ft_weight_decay=0.01)
    if scale == "paper":  # the paper's settings (printed as SLURM submissions, never run here)
        return ReproduceConfig(scale="paper", seeds=[0], vocab_size=512, context_len=512, batch_size=16,
                               p_steps=2000, ft_steps=2000, p_lr=1e-3, ft_lr=2e-5, transfer_p_lr=2e-5,
                               alphas=[0.0, 0.01, 0.1, 1.0], eval_max_docs=2000, log_every=10)
    raise ConfigError(f"scale: {scale!r} is not one of tiny, small, smollm2, paper")


def alpha_tag(a: float) -> str:
    return f"a{a:g}"


# ----------------------------------------------------------------------------------------------------------------
# the plan: every stage run, with its inputs and outputs


@dataclass
class Job:
    name: str  # unique, also the run directory under runs/
    stage: str  # prepare | translate | finetune | evaluate
    config: str  # the shipped YAML config it starts from (repository-relative)
    overrides: list[str]
    run_dir: str
    result: str  # the JSON it writes when finished
    #: paths this job reads that other jobs write, and what it writes for others
    consumes: list[str] = field(default_factory=list)
    produces: list[str] = field(default_factory=list)
    #: SLURM (paper scale): batch script and extra sbatch options
    script: str = ""
    sbatch: list[str] = field(default_factory=list)
    #: what the job's result is in the report: ("table1", method, seed) | ("transfer", bar, seed) | None
    role: tuple | None = None
    #: what the jobs it reads from are (recipes/arm_records.py `arm_spec`, one string each): a result of this job
    #: stands for it only while they are the same
    upstream: list[str] = field(default_factory=list)


@dataclass
class Setting:
    """Where the inputs are: local paths (tiny/small) or the cluster layout (paper)."""

    out: str  # runs root
    data: str  # `prepare` output_dir
    small_model: str
    large_model: str
    #: tokenizer of the source models (a directory or hub id), for FT orig. tok. / Orig Tok.
    source_tokenizer: str
    local: bool = True
