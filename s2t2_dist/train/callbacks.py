"""What the training loop does besides training, as callbacks (OLMo-core's Callback style): the progress bar,
throughput and memory, the step's time split and MFU, the profiler, fault traces, sync debugging and evaluation.

The loop (train/loop.py) calls each hook of every callback in list order; a callback overrides the hooks it needs.
Hooks that run on every step must not read a device value back (a GPU keeps running ahead); a logging step may,
after the loop's one reduction. ``LoopState`` is what the loop shares with them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from s2t2_dist import envvars, faults
import s2t2_dist.train.phases as phases
from s2t2_dist.train.flops import mfu, peak_flops

log = logging.getLogger("s2t2.train")

#: environment variable: torch.cuda.set_sync_debug_mode for the steps that read nothing back (see SyncDebug)
SYNC_DEBUG_ENV = "S2T2_SYNC_DEBUG"


class StepClock:
    """Splits a step into its phases (laps: data, forward, backward, optimizer). The host's wait for data is
    timed on every step (perf_counter); the device phases only on ``timed`` steps (the logging ones), with CUDA
    events on a GPU (recorded without a sync, read after the logging step's reduction) and host time on a CPU
    (where every op has finished when it returns)."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self.timed = False
        self.data_s = 0.0  # host time waiting for batches since the last reset
        self._t = 0.0
        self._laps: list[tuple[str, Any]] = []
        self._mark: Any = None

    def start(self, timed: bool) -> None:
        self.timed, self._laps = timed, []
        self._t = time.perf_counter()
        self._mark = self._event() if timed else None

    def _event(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        host, self._t = now - self._t, now
        if name == "data":
            self.data_s += host
        if not self.timed:
            return
        if name == "data" or not self.cuda:  # the host's wait for a batch is host time on a GPU too
            self._laps.append((name, host))
            if self.cuda:
                self._mark = self._event()  # the device's phases start once the batch is there
        else:
            end = self._event()
            self._laps.append((name, (self._mark, end)))
            self._mark = end

    def split(self) -> dict[str, float]:
        """Seconds per phase of the last timed step (a host sync on a GPU: call it on a logging step only)."""
        out: dict[str, float] = {}
        for name, v in self._laps:
            if not isinstance(v, float):
                v[1].synchronize()
                v = v[0].elapsed_time(v[1]) / 1000.0
            out[name] = out.get(name, 0.0) + v
        return out


@dataclass
class LoopState:
    """What the loop shares with its callbacks. ``step``: optimiser steps done (the step being run is step + 1
    until the loop advances it); ``logging`` / ``quiet``: whether the step being run logs / reads nothing back."""
    cfg: Any
    task: Any
    engine: Any
    logger: Any
    rank: int
    world: int
    accum: int
    step: int = 0
    start_step: int = 0
    logging: bool = False
    quiet: bool = True
    result: Any = None
    clock: StepClock = field(default_factory=StepClock)
    #: this rank's loss of the step just taken (a device tensor; reading it is a host sync)
    step_loss: Any = None
    #: the loss's parts read back on the last logging step (stage 1: ce, alpha*H), for the progress bar
    loss_parts: dict = field(default_factory=dict)


class Callback:
    """A no-op for every hook; subclasses override what they need."""

    #: True makes every step read back (not quiet): the fault trace records each step's loss
    reads_every_step: bool = False

    def pre_train(self, state: LoopState) -> None:
        """Before the first step of this invocation (after a resume)."""

    def pre_step(self, state: LoopState) -> None:
        """Before the step's first micro-batch."""

    def on_micro_batch(self, state: LoopState, batch: dict, loss: torch.Tensor) -> torch.Tensor:
        """After a micro-batch's forward, before its backward; returns the loss to backpropagate."""
        return loss

    def post_step(self, state: LoopState) -> None:
        """After the optimiser step (state.step already counts it), before anything is read back."""

    def register(self, state: LoopState, batch) -> None:
        """Logging steps: add this rank's values to the step's StatsBatch (reduced in the loop's one collective)."""

    def log_metrics(self, state: LoopState, reduced) -> dict[str, float]:
        """Logging steps, after the reduction: global scalars to log (host values)."""
        return {}

    def on_step_loss(self, step: int, loss: float, applied: bool) -> None:
        """Each step's global mean loss, when it is read back (on the next step that is not quiet)."""

    def end_step(self, state: LoopState) -> None:
        """After the step's logging, before its checkpoint."""

    def post_train(self, state: LoopState) -> None:
        """At the end of the invocation, also after an error (release what the callback holds)."""


class ProgressBar(Callback):
    """A tqdm bar on rank 0 with the last loss read back."""

    def __init__(self):
        self.bar = None

    def pre_train(self, state):
        if state.rank == 0:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.cfg.steps, initial=state.step, desc="train", dynamic_ncols=True)

    def post_step(self, state):
        if self.bar is not None:
            self.bar.update(1)

    def end_step(self, state):
        if self.bar is not None and not state.quiet and state.result.final_loss is not None:
            # the loss first, then its parts (a dict keeps the order; tqdm sorts keyword postfixes)
            self.bar.set_postfix({"loss": f"{state.result.final_loss:.4f}", **state.loss_parts})

    def post_train(self, state):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Throughput(Callback):
    """Tokens per second (global and this rank's), step time and data wait since the last logging step."""

    def __init__(self, tokens_per_micro_batch: int | None = None):
        self.per_micro = tokens_per_micro_batch
        self.tokens = 0
        self.t_last = time.perf_counter()
        self.tokens_per_s = self.step_time_s = 0.0  # of the last interval (global tokens)

    def pre_train(self, state):
        self.t_last, state.clock.data_s = time.perf_counter(), 0.0

    def on_micro_batch(self, state, batch, loss):
        self.tokens += self.per_micro or batch["input_ids"].numel()
        return loss

    def register(self, state, batch):
        batch.add("loop.tokens", float(self.tokens))

    def log_metrics(self, state, reduced):
        dt = max(time.perf_counter() - self.t_last, 1e-9)
        every = state.cfg.log_every
        self.tokens_per_s, self.step_time_s = reduced.float("loop.tokens") / dt, dt / every
        state.logger.scalars(state.step, {"node/tokens_per_s": self.tokens / dt, "node/step_time_s": dt / every,
                                          "node/data_wait_s": state.clock.data_s / every}, scope="node")
        return {"train/tokens_per_s": self.tokens_per_s}

    def end_step(self, state):
        if state.logging:
            self.tokens, self.t_last, state.clock.data_s = 0, time.perf_counter(), 0.0


class Memory(Callback):
    """Peak memory on logging steps: the GPU's allocator peak, the process's resident set."""

    def log_metrics(self, state, reduced):
        out = {}
        if torch.cuda.is_available():
            out["node/gpu_mem_max_gib"] = torch.cuda.max_memory_allocated() / 2**30
        try:
            import resource

            out["node/cpu_rss_max_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        except ImportError:
            pass
        state.logger.scalars(state.step, out, scope="node")
        return {}


class StepSplit(Callback):
    """On logging steps: that step's time by phase (the task's before_step_phase if it names one, data wait,
    forward, backward, optimiser), the interval's MFU against the GPU's bf16 peak (train/flops.py; none on a CPU or
    an unknown GPU: said once), one line on rank 0, the values in TensorBoard (node/split_*_s, train/mfu). Reads
    the Throughput callback's interval numbers."""

    def __init__(self, throughput: Throughput, flops_per_token: float | None = None):
        self.throughput, self.fpt = throughput, flops_per_token
        self.peak = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        self.said = False

    def log_metrics(self, state, reduced):
        split = state.clock.split()
        state.logger.scalars(state.step, {f"node/split_{k}_s": v for k, v in split.items()}, scope="node")
        tps = self.throughput.tokens_per_s
        u = mfu(self.fpt or 0.0, tps / max(state.world, 1), self.peak)
        if state.rank == 0:
            parts = ", ".join(f"{k} {v:.3f}" for k, v in split.items())
            why = "" if u is not None else self._why_no_mfu()
            log.info("step %d: %.3f s/step (this step: %s s), %.0f tokens/s%s", state.step,
                     self.throughput.step_time_s, parts, tps, f", MFU {100 * u:.1f}%" if u is not None else why)
        return {"train/mfu": u} if u is not None else {}

    def _why_no_mfu(self) -> str:
        if self.said:
            return ""
        self.said = True
        if not self.fpt:
            return " (MFU not reported: the stage gives no FLOPs per token)"
        if not torch.cuda.is_available():
            return " (MFU not reported: no GPU)"
        return (f" (MFU not reported: no bf16 peak known for {torch.cuda.get_device_name()!r}; "
                "train/flops.py PEAK_BF16_FLOPS)")


class Profiler(Callback):
    """train.profile=[first, last]: a torch.profiler trace of steps first..last (1-based, inclusive) per rank,
    written to RUN/tb/profile (TensorBoard's PyTorch profiler plugin, Perfetto or chrome://tracing open it)."""

    def __init__(self, first: int, last: int, out_dir: Path):
        self.first, self.last, self.out_dir = first, last, Path(out_dir)
        self.prof = None

    def pre_step(self, state):
        if state.step + 1 == self.first and self.prof is None:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts, record_shapes=True, profile_memory=True,
                                on_trace_ready=tensorboard_trace_handler(str(self.out_dir),
                                                                         worker_name=f"rank{state.rank:05d}"))
            self.prof.__enter__()

    def post_step(self, state):
        if self.prof is not None and state.step >= self.last:
            self._stop()
            if state.rank == 0:
                log.info("profile of steps %d-%d written to %s", self.first, self.last, self.out_dir)

    def _stop(self):
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)

    def post_train(self, state):
        if self.prof is not None:  # the run ended inside the window: keep what was recorded
            self._stop()


class FaultTrace(Callback):
    """The fault tests' trace (faults.TRACE_ENV): every step's batch identities and loss (so every step reads its
    loss back while tracing), the loop's named points; the injected loss/gradient faults (faults.ENV)."""

    def __init__(self):
        self.reads_every_step = envvars.is_set(faults.TRACE_ENV)

    def pre_train(self, state):
        latest = state.result.last_checkpoint
        faults.record("start", step=state.step, checkpoint=str(latest) if latest is not None else None)

    def on_micro_batch(self, state, batch, loss):
        faults.record_batch(state.step + 1, batch)
        return faults.poison_loss(loss, state.step + 1)

    def post_step(self, state):
        faults.poison_params(state.engine.module, state.step)
        faults.point("loop.step_end", state.step)

    def on_step_loss(self, step, loss, applied):
        faults.record_step(step, loss, applied)


class SyncDebug(Callback):
    """S2T2_SYNC_DEBUG=error|warn (bench/gpu_smoke.py): on CUDA, a step that neither logs, checkpoints nor stops
    runs under torch.cuda.set_sync_debug_mode, so any host sync in it raises (or warns) where it happens."""

    def __init__(self, mode: str):
        self.mode = mode

    def pre_step(self, state):
        if state.quiet:
            torch.cuda.set_sync_debug_mode(self.mode)

    def post_step(self, state):
        if state.quiet:
            torch.cuda.set_sync_debug_mode(0)


class Evaluation(Callback):
    """The task's held-out evaluation every train.eval_every steps (collective), logged under eval/."""

    def end_step(self, state):
        every = state.cfg.eval_every
        if every and state.step % every == 0:
            state.result.last_eval = (state.step, _evaluate(state.task, state.engine, state.logger, state.step))
            state.engine.train()


def _evaluate(task, engine, logger, step: int) -> dict[str, float]:
    """One pass over the held-out documents in eval mode, logged under eval/ at `step`. Collective."""
    engine.eval()
    metrics = task.evaluate()
    logger.scalars(step, {f"eval/{k}": v for k, v in metrics.items()})
    return metrics


def final_evaluation(result, task, engine, logger) -> dict[str, float]:
    """The held-out metrics of a finished run: the periodic evaluation's when it ran at the last step (a second
    pass over the same documents with the same weights would only cost time), else evaluated and logged now.
    Collective."""
    if result.last_eval is not None and result.last_eval[0] == result.step:
        return result.last_eval[1]
    return _evaluate(task, engine, logger, result.step)


class FirstStep(Callback):
    """The start-up phase "first step" (train/phases.py): from the loop's start to the end of its first step,
    waited for on a GPU (one device sync, once; a lazy torch.compile of the blocks happens in it)."""

    def pre_train(self, state):
        phases.begin(phases.FIRST_STEP)

    def post_step(self, state):
        if state.step == state.start_step + 1:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            phases.end(phases.FIRST_STEP)


class OnStep(Callback):
    """A caller's function of (step, this rank's loss as a device tensor: reading it is a host sync)."""

    def __init__(self, fn: Callable[[int, torch.Tensor], None]):
        self.fn = fn

    def post_step(self, state):
        self.fn(state.step, state.step_loss)


def default_callbacks(cfg, rank: int, tb_dir: Path | None, *, progress: bool, tokens_per_micro_batch: int | None,
                      flops_per_token: float | None) -> list[Callback]:
    """The loop's callbacks for a TrainConfig: the progress bar (rank 0, unless progress=False), throughput, memory,
    the step split and MFU, the profiler (train.profile), fault traces and injection, sync debugging (CUDA and
    S2T2_SYNC_DEBUG), evaluation (train.eval_every)."""
    tp = Throughput(tokens_per_micro_batch)
    cbs: list[Callback] = [ProgressBar()] if progress and rank == 0 else []
    cbs += [FaultTrace(), tp, Memory(), StepSplit(tp, flops_per_token)]
    if cfg.profile and tb_dir is not None:
        cbs.append(Profiler(cfg.profile[0], cfg.profile[1], Path(tb_dir) / "profile"))
    mode = envvars.get(SYNC_DEBUG_ENV) if torch.cuda.is_available() else None
    if mode:
        cbs.append(SyncDebug(mode))
    cbs += [FirstStep(), Evaluation()]  # FirstStep's device sync after SyncDebug has left its mode
    return cbs
