"""DeepSpeed ZeRO (stage 1, 2, 3, with or without offload) behind the Engine interface.

The DeepSpeed JSON config is the user's (given by path, e.g. `configs/ds_zero3.json`), but everything the run config
already decides is taken from the run config, so the two can never disagree:

- batch keys: `train_batch_size` = train.batch_size, `train_micro_batch_size_per_gpu` = train.micro_batch_size,
  `gradient_accumulation_steps` = train.batch_size / (micro_batch_size x ranks);
- `gradient_clipping` = optim.grad_clip; `bf16.enabled` = (GPU and train.precision in bf16/auto);
- optimiser and schedule: always the paper's torch AdamW + cosine/warm-up (train.optim), given to DeepSpeed as a
  client optimiser and a client scheduler; an "optimizer" or "scheduler" section in the JSON is an error.

A key that is missing or "auto" is filled; an explicit value that disagrees raises ConfigError naming the key, the
file's value and the run config's value.

On machines without a GPU DeepSpeed runs on its CPU accelerator with gloo; `prepare_deepspeed()` is the one place
that arranges it (and skips the slow JIT build of the shared-memory communication op).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch

from s2t2_dist.errors import ConfigError
from s2t2_dist.distributed import collectives as coll
from s2t2_dist.engines.base import Engine, EngineKind
from s2t2_dist.models.hf import enable_activation_checkpointing
import s2t2_dist.train.phases as phases
from s2t2_dist.train.optim import param_groups

#: subdirectory (DeepSpeed "tag") of a loop checkpoint directory that holds DeepSpeed's own files
log = logging.getLogger("s2t2.deepspeed")

DS_TAG = "deepspeed"
DS_WORLD_FILE = "deepspeed_world.json"

_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


# --------------------------------------------------------------------------------------------------------------
# environment


def prepare_deepspeed():
    """Import deepspeed the way this project needs it; idempotent; returns the module.

    Without CUDA: the CPU accelerator (DS_ACCELERATOR=cpu, set before the first import) and no JIT build of
    `deepspeed_shm_comm` (36-87 s on a small machine; gloo does the collectives instead)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops

    ops = deepspeed.ops.__compatible_ops__
    if not torch.cuda.is_available() and ops.get("deepspeed_shm_comm", False):
        ops["deepspeed_shm_comm"] = False
    return deepspeed


def init_deepspeed_distributed(timeout_s: float = 1800.0):
    """torch.distributed from whatever launcher started us (s2t2_dist.distributed.env), then DeepSpeed's comm layer on top of
    the same process group. Returns the DistEnv."""
    from s2t2_dist.distributed.env import init_distributed

    deepspeed = prepare_deepspeed()
    denv = init_distributed(timeout_s=timeout_s)
    if denv.world_size > 1 or coll.initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return denv


def _world_size() -> int:
    if coll.initialized():
        return coll.world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


# --------------------------------------------------------------------------------------------------------------
# config


def load_ds_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"DeepSpeed config {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"DeepSpeed config {path}: the top level must be a JSON object")
    return data


def merge_config(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, nested objects key by key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_config(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


def _fill(cfg: dict, key: str, value: Any, source: str, why: str, dotted: str | None = None) -> None:
    """Fill cfg[key] if missing/"auto"; an explicit different value is a ConfigError."""
    dotted = dotted or key
    cur = cfg.get(key, "auto")
    if _is_auto(cur) or cur is None:
        cfg[key] = value
        return
    same = (
        math.isclose(float(cur), float(value), rel_tol=0, abs_tol=1e-12)
        if isinstance(cur, (int, float)) and not isinstance(cur, bool) and isinstance(value, (int, float))
        else cur == value
    )
    if not same:
        raise ConfigError(
            f"DeepSpeed config {source}: {dotted}={cur!r} disagrees with the run config, which gives {value!r} "
            f"({why}); set it to \"auto\" or remove it"
        )
    cfg[key] = value


def zero_stage(ds_cfg: dict) -> int:
    z = ds_cfg.get("zero_optimization") or {}
    return int(z.get("stage", 0))


def _static_check(cfg: dict, source: str) -> int:
    """What can be checked without the run config; returns the ZeRO stage."""
    for section in ("optimizer", "scheduler"):
        if section in cfg:
            raise ConfigError(
                f"DeepSpeed config {source}: remove the {section!r} section; the optimiser and lr schedule come from "
                "the run config (optim.*: torch AdamW with the paper's cosine/warm-up schedule)"
            )
    if (cfg.get("fp16") or {}).get("enabled") in (True, "true"):
        raise ConfigError(
            f"DeepSpeed config {source}: fp16.enabled=true is not supported (the paper trains in bfloat16); "
            "remove the fp16 section and use train.precision=bf16 or auto"
        )
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"DeepSpeed config {source}: zero_optimization must be an object")
    try:
        stage = int(zero.get("stage", 0))
    except (TypeError, ValueError):
        raise ConfigError(f"DeepSpeed config {source}: zero_optimization.stage={zero.get('stage')!r} is not 1, 2 or 3") from None
    if stage not in (1, 2, 3):
        raise ConfigError(
            f"DeepSpeed config {source}: zero_optimization.stage must be 1, 2 or 3 (got {stage}); "
            "for no sharding use engine.kind=plain"
        )
    return stage


def check_ds_config_file(path: str | Path, overrides: dict | None = None) -> int:
    """Early check of a DeepSpeed config file (exists, JSON, no optimizer/scheduler/fp16, ZeRO 1-3): its stage."""
    return _static_check(merge_config(load_ds_config(path), overrides or {}), str(path))


def resolve_ds_config(  # noqa: C901 - one flat check per DeepSpeed key derived from the run
    raw: dict | str | Path,
    *,
    train_cfg,
    optim_cfg,
    world_size: int | None = None,
    on_gpu: bool | None = None,
    hidden_size: int | None = None,
    offload: bool = False,
    overrides: dict | None = None,
    source: str | None = None,
    block_numel: int | None = None,
) -> dict:
    """The DeepSpeed config this run uses: the file (or dict) with `overrides` merged in, every run-config-owned key
    filled or checked, "auto" bucket sizes derived from the transformer block's size `block_numel` (else from the
    model width, as the HF Trainer does).

    `offload=True` asks for ZeRO-Offload (optimizer states and, under ZeRO-3, parameters on CPU) when the file does
    not already say where to put them."""
    if isinstance(raw, (str, Path)):
        source = source or str(raw)
        raw = load_ds_config(raw)
    source = source or "<dict>"
    cfg = merge_config(raw, overrides or {})
    world = world_size if world_size is not None else _world_size()
    gpu = torch.cuda.is_available() if on_gpu is None else on_gpu

    _static_check(cfg, source)
    # --- batch layout, all from the run config
    accum = train_cfg.grad_accum(world)  # raises ConfigError for an impossible layout
    why_b = f"train.batch_size={train_cfg.batch_size}, train.micro_batch_size={train_cfg.micro_batch_size}, {world} ranks"
    _fill(cfg, "train_batch_size", int(train_cfg.batch_size), source, why_b)
    _fill(cfg, "train_micro_batch_size_per_gpu", int(train_cfg.micro_batch_size), source, why_b)
    _fill(cfg, "gradient_accumulation_steps", int(accum), source, why_b)
    _fill(cfg, "gradient_clipping", float(optim_cfg.grad_clip or 0.0), source, f"optim.grad_clip={optim_cfg.grad_clip}")

    # --- precision
    cfg.pop("fp16", None)
    if train_cfg.precision == "bf16" and not gpu:
        warnings.warn("train.precision=bf16 without a GPU: DeepSpeed runs in float32 on CPU", stacklevel=2)
    want_bf16 = gpu and train_cfg.precision in ("bf16", "auto")
    bf16 = dict(cfg.get("bf16") or {})
    _fill(bf16, "enabled", bool(want_bf16), source,
          f"train.precision={train_cfg.precision} on {'GPU' if gpu else 'CPU'}", "bf16.enabled")
    cfg["bf16"] = bf16

    # --- ZeRO
    zero = dict(cfg.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    h = hidden_size
    if block_numel:
        # sized by one transformer block (OLMo-1B: 67 M elements, 7B: 202 M): the next block's all-gather and the
        # previous block's gradient reduction overlap this block's compute in one transfer each (HF's hidden^2 is
        # 1/16 to 1/48 of a block: dozens of small transfers per block); parameters under 1e5 elements (norms,
        # biases: a few MB in all) stay gathered, DeepSpeed's default, so they cost no transfer per step
        autos = {"reduce_bucket_size": int(block_numel), "stage3_prefetch_bucket_size": int(block_numel),
                 "stage3_param_persistence_threshold": max(10 * (h or 0), 100_000)}
    else:  # no model facts: the HF Trainer's formulas of the width, or DeepSpeed's defaults
        autos = {
            "reduce_bucket_size": (h * h) if h else None,
            "stage3_prefetch_bucket_size": int(0.9 * h * h) if h else None,
            "stage3_param_persistence_threshold": (10 * h) if h else None,
        }
    for k, v in autos.items():
        if _is_auto(zero.get(k)):
            if v is None:
                zero.pop(k)  # DeepSpeed's default
            else:
                zero[k] = v
    if stage < 3:
        for k in [k for k in zero if k.startswith("stage3_")]:
            zero.pop(k)
    if offload:
        opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none")
        if opt_dev in (None, "none"):
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": gpu}
        if stage == 3 and (zero.get("offload_param") or {}).get("device", "none") in (None, "none"):
            zero["offload_param"] = {"device": "cpu", "pin_memory": gpu}
    if not gpu:
        for k in ("offload_optimizer", "offload_param"):
            if isinstance(zero.get(k), dict):
                zero[k] = {**zero[k], "pin_memory": False}  # no pinned memory without CUDA
    if stage < 3 and (zero.get("offload_param") or {}).get("device", "none") not in (None, "none"):
        raise ConfigError(f"DeepSpeed config {source}: zero_optimization.offload_param needs stage 3 (stage={stage})")
    cfg["zero_optimization"] = zero
    cfg.setdefault("steps_per_print", 10**9)  # the loop logs; keep DeepSpeed's own progress lines out
    cfg.setdefault("wall_clock_breakdown", False)
    leftover = _find_auto(cfg)
    if leftover:
        raise ConfigError(f"DeepSpeed config {source}: no value could be derived for {leftover} = \"auto\"")
    return cfg


def block_numel(hf_config) -> int | None:
    """Weights of one decoder block of a transformers config (attention q, k, v, o with grouped keys/values, and a
    gated MLP): what ZeRO-3 gathers per block; None when the config does not say."""
    h = getattr(hf_config, "hidden_size", None)
    ff = getattr(hf_config, "intermediate_size", None)
    heads = getattr(hf_config, "num_attention_heads", None)
    if not (h and ff and heads):
        return None
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    return int(2 * h * h + 2 * h * (h * kv // heads) + 3 * h * ff)


def _find_auto(d: dict, prefix: str = "") -> str | None:
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            found = _find_auto(v, key)
            if found:
                return found
        elif _is_auto(v):
            return key
    return None


def offloads_optimizer(ds_cfg: dict) -> bool:
    dev = ((ds_cfg.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device", "none")
    return dev not in (None, "none")


# --------------------------------------------------------------------------------------------------------------
# model construction under ZeRO-3

_KEEP_ALIVE: list = []


def build_model_zero3(model_path_or_config, ds_cfg: dict, *, dtype: torch.dtype | None = None, seed: int | None = None,
                      **hf_kwargs):
    """Build a Hugging Face causal LM so that no rank ever holds the whole model under ZeRO-3.

    `HfDeepSpeedConfig(ds_cfg)` is created first and kept alive (transformers holds it only by weakref); with it,
    `from_pretrained` / `from_config` construct the model inside `deepspeed.zero.Init` and load or initialise each
    parameter partition by partition (a raw `deepspeed.zero.Init()` around an HF constructor crashes or skips HF's
    weight initialisation). `ds_cfg` must be the resolved config (no "auto"). For ZeRO-1/2 this is a plain build.

    `model_path_or_config`: a directory / hub id (from_pretrained) or a transformers PretrainedConfig (from_config,
    random init; seed it with `seed`)."""
    prepare_deepspeed()
    from transformers import AutoModelForCausalLM, PretrainedConfig
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds = HfDeepSpeedConfig(ds_cfg)
    _KEEP_ALIVE.clear()  # only the newest config is the one transformers sees
    _KEEP_ALIVE.append(hf_ds)
    if seed is not None:
        torch.manual_seed(seed)
    if isinstance(model_path_or_config, PretrainedConfig):
        kw = {"dtype": dtype} if dtype is not None else {}
        model = AutoModelForCausalLM.from_config(model_path_or_config, **kw, **hf_kwargs)
    else:
        from s2t2_dist.models.hf import from_pretrained_checked

        model = from_pretrained_checked(model_path_or_config, dtype=dtype or torch.float32, **hf_kwargs)
    return model


def partitioned_numel(model: torch.nn.Module) -> tuple[int, int]:
    """(elements this rank holds, elements of the whole model): under ZeRO-3 the first is about 1/ranks of the second."""
    local = total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            local += p.ds_tensor.numel()
            total += p.ds_numel
        else:
            local += p.numel()
            total += p.numel()
    return local, total


# --------------------------------------------------------------------------------------------------------------
# loading without running code


def _ds_safe_globals() -> list:
    """The non-tensor classes DeepSpeed's ZeRO checkpoint files pickle (an enum and the loss scaler's state)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [ZeroStageEnum, LossScaler, DynamicLossScaler]


def universal_checkpoint(src: Path, out: Path) -> Path:
    """DeepSpeed's own ds_to_universal conversion of the ZeRO checkpoint folder `src` into `out` (atomically: built
    in OUT.partial), in this process (no worker pool)."""
    import argparse
    import shutil

    from deepspeed.checkpoint import ds_to_universal

    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(src), output_folder=str(partial), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    with _weights_only_loads():
        ds_to_universal.main(args)
    partial.rename(out)
    return out


@contextlib.contextmanager
def _weights_only_loads():
    """DeepSpeed's universal-checkpoint code calls torch.load(weights_only=False); inside this block every torch.load
    is weights_only with DeepSpeed's own classes allowed (as `_safe_ds_load`): no code runs from a checkpoint,
    converted or not."""
    original = torch.load
    safe = _ds_safe_globals()

    def load(f, map_location=None, *args, **kwargs):
        import pickle

        try:
            with torch.serialization.safe_globals(safe):
                return original(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise RuntimeError(f"DeepSpeed checkpoint file {f} holds pickled objects other than tensors, containers "
                               "and DeepSpeed's own state; refusing to unpickle it (no code runs from a checkpoint): "
                               f"{str(e).splitlines()[-1] if str(e) else e}") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def _safe_ds_load(path: str, map_location=None):
    import pickle

    try:
        with torch.serialization.safe_globals(_ds_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise RuntimeError(f"DeepSpeed checkpoint file {path} holds pickled objects other than tensors, containers "
                           f"and DeepSpeed's own state; refusing to unpickle it (no code runs from a checkpoint): "
                           f"{str(e).splitlines()[-1] if str(e) else e}") from None


# --------------------------------------------------------------------------------------------------------------
# the engine


class DeepSpeedEngine(Engine):
    """`deepspeed.initialize` with the paper's AdamW + schedule; one `step()` per optimiser step of the loop.

    The loop calls backward(loss / accum) `accum` times then step(); DeepSpeed's own accumulation counter is driven
    accordingly (its intermediate step() calls only count micro-batches), so its gradient-accumulation boundary —
    where ZeRO reduces and partitions gradients — is the loop's last micro-batch."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule, ds_config: dict):
        """`optimizer` over the model's trainable parameters, `schedule(optimizer)` -> its lr scheduler, `ds_config`
        resolved (resolve_ds_config); `DeepSpeedEngine.build` makes all three from the run config."""
        deepspeed = prepare_deepspeed()
        self._deepspeed = deepspeed
        self.rank, self.world = coll.rank_world()
        self.ds_config = copy.deepcopy(ds_config)
        self.gas = int(self.ds_config["gradient_accumulation_steps"])
        self.stage = zero_stage(self.ds_config)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=schedule, config=self.ds_config)
        self.module = self.ds  # the task calls engine.module(...): DeepSpeed's forward gathers ZeRO-3 params
        self.model = self.ds.module  # the underlying transformers model
        self._managed = bool(getattr(self.ds, "managed_gradient_accumulation", lambda: True)())
        self._micro = 0

    @classmethod
    def build(cls, model: torch.nn.Module, *, optim_cfg, train_cfg, ds_config: dict | str | Path,
              ds_overrides: dict | None = None, offload: bool = False, activation_checkpointing: bool = False,
              resolved: bool = False) -> DeepSpeedEngine:
        """The engine over `model` with optim_cfg's optimiser and schedule; `ds_config` a path or dict, resolved
        here against the run config unless `resolved`."""
        if resolved:
            if not isinstance(ds_config, dict):
                raise TypeError("resolved=True needs the resolved DeepSpeed config as a dict")
        else:
            hidden = getattr(getattr(model, "config", None), "hidden_size", None)
            ds_config = resolve_ds_config(ds_config, train_cfg=train_cfg, optim_cfg=optim_cfg,
                                          world_size=coll.world_size(), hidden_size=hidden, offload=offload,
                                          overrides=ds_overrides)
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DeepSpeedEngine: the model has no trainable parameters")
        if offloads_optimizer(ds_config) and ds_config.get("zero_force_ds_cpu_optimizer", True):
            # ZeRO-Offload steps the optimiser on CPU: DeepSpeed's CPU Adam in AdamW mode is the same update rule.
            if optim_cfg.name != "adamw":
                raise ConfigError(f"optim.name={optim_cfg.name}: ZeRO-Offload steps with DeepSpeed's CPU AdamW; "
                                  "use optim.name=adamw or no offload")
            prepare_deepspeed()
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(param_groups(params, optim_cfg.weight_decay), lr=optim_cfg.lr,
                                         betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                                         weight_decay=optim_cfg.weight_decay, adamw_mode=True)
        else:
            # fused on CUDA: one kernel over ZeRO's few flat float32 partitions (foreach/for-loop on a CPU)
            optimizer = optim_cfg.build(params, fused=torch.cuda.is_available())
        return cls(model, optimizer, lambda opt: optim_cfg.schedule(opt, train_cfg.steps), ds_config)

    # ---- training
    def backward(self, loss: torch.Tensor) -> None:
        if self._micro >= self.gas:
            raise RuntimeError(
                f"DeepSpeedEngine: {self._micro + 1} backward() calls before step(), but gradient_accumulation_steps="
                f"{self.gas}; the loop and the DeepSpeed config disagree"
            )
        self.ds.backward(loss, scale_wrt_gas=False)  # the loop already divided by the accumulation steps
        self._micro += 1
        if self._managed and self._micro < self.gas:
            self.ds.step()  # not a boundary: DeepSpeed only counts the micro-batch

    def step(self) -> tuple[float, bool]:
        if self._micro != self.gas:
            raise RuntimeError(
                f"DeepSpeedEngine.step() after {self._micro} backward() calls; gradient_accumulation_steps={self.gas}"
            )
        self.ds.step()
        self._micro = 0
        applied = bool(self.ds.was_step_applied())
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if not applied:
            # DeepSpeed skipped the update (non-finite gradients on some rank: its norm is inf/nan on every rank and
            # the gradients were dropped) but does not advance the schedule; keep lr a function of the loop's step.
            self.scheduler.step()
        elif not math.isfinite(norm):
            raise RuntimeError(f"DeepSpeed applied a step with gradient norm {norm}; refusing to continue")
        return norm, applied

    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    @property
    def device(self) -> torch.device:
        return torch.device(self.ds.device)

    # ---- checkpoints
    def save(self, directory: Path) -> None:
        ok = self.ds.save_checkpoint(str(directory), tag=DS_TAG, client_state={"s2t2_world_size": self.world},
                                     save_latest=False)
        if ok is False:
            raise RuntimeError(f"DeepSpeed could not save a checkpoint into {directory}")
        if self.rank == 0:  # read before loading: whether this checkpoint must go through a universal one
            (Path(directory) / DS_WORLD_FILE).write_text(json.dumps({"world_size": self.world}))

    def load(self, directory: Path) -> None:
        d = Path(directory) / DS_TAG
        if not d.is_dir():
            raise FileNotFoundError(f"checkpoint {directory}: no DeepSpeed state ({d.name}/ is missing)")
        wf = Path(directory) / DS_WORLD_FILE
        saved = json.loads(wf.read_text())["world_size"] if wf.is_file() else self.world
        if saved != self.world:
            return self._load_universal(Path(directory), saved)
        # DeepSpeed's TorchCheckpointEngine loads with torch.load(weights_only=False): unpickling a checkpoint could
        # run code. Load through weights_only=True instead, allowing the two DeepSpeed classes its files hold.
        ce = self.ds.checkpoint_engine
        ce.load = _safe_ds_load
        try:
            path, client = self.ds.load_checkpoint(str(directory), tag=DS_TAG, load_module_strict=True,
                                                   load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            del ce.load  # back to the class's method
        if path is None:
            raise RuntimeError(f"checkpoint {directory}: DeepSpeed could not load {d}")
        w = (client or {}).get("s2t2_world_size")
        if w is not None and w != self.world:
            raise RuntimeError(f"checkpoint {directory} was written by {w} ranks, this run has {self.world}")

    def _load_universal(self, directory: Path, saved_world: int) -> None:
        """Resume a checkpoint of `saved_world` ranks: rank 0 converts it once into DeepSpeed's universal format
        (every parameter and its Adam moments whole, in RUN/checkpoints/step_N/deepspeed_universal), which every
        rank then loads into its own ZeRO partitions."""

        uni = directory / (DS_TAG + "_universal")
        err = None
        if self.rank == 0 and not (uni / "zero").is_dir():
            try:
                universal_checkpoint(directory / DS_TAG, uni)
            except BaseException as e:  # noqa: BLE001 - raised on every rank
                err = e
        coll.raise_if_any_failed(err, f"converting {directory} ({saved_world} ranks) to a universal checkpoint")
        # DeepSpeed's ZeRO-3 universal load gives every parameter group the hyperparameters of group 0 (here: weight
        # decay to the no-decay group, too); this run's own groups are put back after it (lr comes from the schedule)
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                  for g in self.optimizer.param_groups]
        cfg = self.ds._config
        cfg.load_universal_checkpoint = True
        ce = self.ds.checkpoint_engine
        ce.load = _safe_ds_load
        try:
            with _weights_only_loads():
                path, _ = self.ds.load_checkpoint(str(directory), tag=uni.name, load_module_strict=True,
                                                  load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            del ce.load
            cfg.load_universal_checkpoint = False
        if path is None:
            raise RuntimeError(f"checkpoint {directory}: DeepSpeed could not load the universal checkpoint {uni}")
        for g, own in zip(self.optimizer.param_groups, groups):
            g.update(own)
        # ...and hands ONE step-count tensor to every group's state: Adam increments it in place once per group, so
        # the bias correction would run ahead (seen: losses off by 1e-4 one step after the resume). One each.
        inner = getattr(self.optimizer, "optimizer", None)
        for st in (inner.state.values() if inner is not None else ()):
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        log.warning("resumed the DeepSpeed checkpoint of %d ranks on %d through %s", saved_world, self.world, uni)

    # ---- export
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The full float32 weights (the optimiser's master copy), gathered parameter by parameter; collective: every
        rank must call it; rank 0 gets the dict, other ranks an empty one. Peak extra memory on a GPU: one parameter."""
        from deepspeed.utils import safe_get_full_fp32_param

        model = self.model
        persistent = set(model.state_dict().keys())
        out: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:
                with self._deepspeed.zero.GatheredParameters([p], modifier_rank=None, enabled=hasattr(p, "ds_id")):
                    full = p.data.detach().float().clone()
            if self.rank == 0:
                out[name] = full.detach().float().cpu().clone()
            del full
        for name, b in model.named_buffers():
            if name in persistent and self.rank == 0:
                out[name] = b.detach().cpu().clone()
        return out


class DeepSpeed(EngineKind):
    """engine.kind=deepspeed: DeepSpeed's comm layer over the launcher's process group; the model built straight
    into ZeRO-3 partitions (build_model_zero3: no rank ever holds all of it)."""

    def init_distributed(self) -> None:
        init_deepspeed_distributed()

    def build(self, cfg, source, optim_cfg, train_cfg, *, device, dtype=None, trust_remote_code=False):
        if isinstance(source, torch.nn.Module):
            hidden = getattr(getattr(source, "config", None), "hidden_size", None)
        else:
            from transformers import AutoConfig, PretrainedConfig

            hf = source if isinstance(source, PretrainedConfig) else AutoConfig.from_pretrained(
                str(source), trust_remote_code=trust_remote_code)
            hidden = getattr(hf, "hidden_size", None)
        hf_config = getattr(source, "config", None) if isinstance(source, torch.nn.Module) else hf
        ds_cfg = resolve_ds_config(cfg.ds_config, train_cfg=train_cfg, optim_cfg=optim_cfg, hidden_size=hidden,
                                   offload=cfg.offload, overrides=cfg.ds_overrides or None,
                                   block_numel=block_numel(hf_config))
        # float32 master weights whatever `dtype`: bf16 compute is DeepSpeed's (bf16.enabled)
        with phases.phase("model load (ZeRO partitions)"):
            model = source if isinstance(source, torch.nn.Module) else build_model_zero3(
                source, ds_cfg, seed=train_cfg.seed)
        with phases.phase("engine build (deepspeed.initialize, optimiser)"):
            from s2t2_dist.engines.model_setup import checkpointing_for

            ckpt = checkpointing_for(cfg, model, train_cfg, sharded=zero_stage(ds_cfg) >= 1)
            engine = DeepSpeedEngine.build(model, optim_cfg=optim_cfg, train_cfg=train_cfg, ds_config=ds_cfg,
                                           resolved=True, activation_checkpointing=ckpt)
        return engine.model, engine
