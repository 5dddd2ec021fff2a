"""The one training loop, shared by stage 1 (translate: only C trains) and stage 2 (finetune: the whole model).

A stage supplies a Task (how to compute the loss of a micro-batch, what to report) and an Engine (who owns the
parameters and the optimiser); the loop owns the step counter, gradient accumulation, skipping of non-finite
steps, checkpoint/resume (with the data position and RNG), the one reduction of a logging step and clean stopping
on SIGTERM/SIGUSR1 (what SLURM sends before preemption or a time limit). Everything else it does (progress bar,
throughput, memory, step split and MFU, profiler, fault traces, sync debugging, evaluation) is a callback
(train/callbacks.py).
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from collections.abc import Callable, Iterator

import torch

from s2t2_dist.distributed import collectives as coll
from s2t2_dist.distributed.stats_batch import Reduced, StatsBatch
import s2t2_dist.train.phases as phases
from s2t2_dist.train.callbacks import SYNC_DEBUG_ENV, Callback, LoopState, OnStep, default_callbacks
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.train.config import TrainConfig
from s2t2_dist.train.metrics import MetricsLogger
from s2t2_dist.errors import NonFiniteParameters, TooManyBadSteps


class Task:
    """A stage's hooks into the loop: ``loss`` is required; every other hook is a no-op here."""

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, Any]]:
        """Mean loss of one micro-batch (the tensor to backpropagate) and extra scalars to log (floats or 0-dim
        tensors: tensors are read on logging steps only, so no host sync per micro-batch)."""
        raise NotImplementedError

    def report(self, step: int, logger: MetricsLogger) -> dict[str, float]:
        """Expensive diagnostics, called every log interval (collective: every rank calls it)."""
        return {}

    def report_stats(self, step: int, logger: MetricsLogger,
                     batch: StatsBatch) -> Callable[[Reduced], dict[str, float]] | None:
        """report() in two halves, so that the logging step reduces the task's statistics in the loop's one
        collective: registers this rank's partial values into ``batch`` and returns what turns the reduced host
        values into the metrics (no collective, no device read there). None (here): report() is called instead."""
        return None

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (collective)."""
        return {}

    #: the name of the step-split phase (StepClock) that times :meth:`before_step`; "": it does no work worth a
    #: phase (stage 1's "plan": the sparse Sinkhorn and the products over P, run once per step there)
    before_step_phase: str = ""

    def before_step(self, steps_done: int, logging: bool) -> None:
        """Before the step's first micro-batch."""

    def after_backward(self, logging: bool) -> None:
        """After the step's last backward, before engine.step() (the gradient must be final here: the engine's
        clipping and non-finite check read it); ``logging``: this step logs (the only steps on which a task may
        read values back to the host)."""

    def state_dict(self) -> dict:
        """The task's own counters that a resumed run must carry on (saved with this rank's loop state in every
        checkpoint: Python values or tensors where they live, so that saving reads nothing back in the step). {}
        (here): none."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` on a resume by the same number of ranks (another number of ranks: not
        called, as for the random streams: per-rank counts do not carry over)."""

    def parameters_finite(self) -> torch.Tensor | None:
        """After engine.step(): a 0-dim device tensor, 1 when this rank's trained parameters are all finite. It is
        read with the step's loss (no sync of its own); a 0 on any rank stops the run before the step is
        checkpointed. None (here): nothing to check beyond the loss and gradient."""
        return None


class ResumableLoader(Protocol):
    def __iter__(self) -> Iterator[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


__all__ = ["Task", "train", "LoopResult", "TooManyBadSteps", "SYNC_DEBUG_ENV"]


@dataclass
class LoopResult:
    step: int
    finished: bool
    preempted: bool
    losses: list[tuple[int, float]] = field(default_factory=list)
    bad_steps: int = 0
    last_checkpoint: Path | None = None
    #: loss of the last step taken, by this invocation or (resumed) by the run before it
    final_loss: float | None = None
    #: (step, metrics) of this invocation's last periodic evaluation (train.eval_every)
    last_eval: tuple[int, dict[str, float]] | None = None


class _StopFlag:
    """Remembers SIGTERM/SIGUSR1/SIGINT so the loop can checkpoint at the next step boundary instead of dying
    mid-step. A second Ctrl-C (SIGINT) while that checkpoint is pending interrupts at once, as Python would.
    A SIGINT ignored on entry stays ignored, as Python leaves it: a shell starts background jobs (`nohup ... &` in a
    script) so that a Ctrl-C meant for the foreground does not reach them, and the export after the loop ignores it
    too."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self._requested: int | None = None
        self._old = {}
        for s in signals:
            if s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN:
                continue
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. inside some test runners): signals stay as they are
                pass

    @property
    def requested(self) -> int | None:
        """The signal received, or a stop the process asked for from another thread (utils/stop.request)."""
        from s2t2_dist.utils import stop

        return self._requested if self._requested is not None else stop.outside()

    def _handler(self, signum, frame):
        if signum == signal.SIGINT and self._requested == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            import sys

            print("\ninterrupted: writing a checkpoint at the end of this step (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        self._requested = signum

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


_world = coll.rank_world
_sum_across = coll.sum_scalars


class _Pending:
    """Steps taken but not yet read back: (step, this rank's summed micro-batch losses, applied, grad norm,
    parameters not finite) as device values. Nothing is read to the host on a step that does not log, checkpoint
    or stop (a GPU keeps running ahead); the next step that does registers them into its StatsBatch and finishes
    them from the reduced values: bad steps counted, losses recorded."""

    def __init__(self, state: LoopState, callbacks: list[Callback]):
        self.state, self.callbacks, self.steps = state, callbacks, []
        self.norm = float("nan")

    def batch(self) -> StatsBatch:
        # where the step's values live (the losses' device): NCCL for CUDA, gloo for CPU
        return StatsBatch(self.steps[0][1].device if self.steps else "cpu")

    def add(self, batch: StatsBatch, stop_flag: float) -> Callable[[Reduced], bool]:
        """Registers the pending steps and the stop flag into ``batch``; returns what reads them back and tells
        whether some rank asked to stop."""
        k, dev = len(self.steps), batch.device
        if k:
            batch.add("loop.loss_sums", torch.stack([v.reshape(()).to(dev, torch.float64) for _, v, *_ in self.steps]))
            # the applied flag is the same on every rank (the engine's decision); the norm is already global
            batch.add("loop.applied_norm", torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(())
                                                        for _, _, *vals, _ in self.steps for v in vals]), "local")
            # summed over ranks: a shard that went non-finite on one rank stops every rank at the same step
            batch.add("loop.params_bad", torch.stack([torch.as_tensor(b, dtype=torch.float64, device=dev).reshape(())
                                                      for *_, b in self.steps]))
        batch.add("loop.stop", stop_flag)
        return lambda r: self.finish(r, k)

    def finish(self, r: Reduced, k: int) -> bool:
        st, cfg = self.state, self.state.cfg
        sums = r["loop.loss_sums"].tolist() if k else []
        host = r["loop.applied_norm"].reshape(k, 2).tolist() if k else []
        bad_params = r["loop.params_bad"].reshape(k).tolist() if k else []
        for (at, *_), (ok, norm), total, nonfinite in zip(self.steps, host, sums, bad_params):
            mean_loss = total / st.accum / st.world
            if nonfinite:
                raise NonFiniteParameters(
                    f"the trained parameters hold NaN or infinite values after step {at} (on {int(nonfinite)} "
                    f"rank(s)) although its loss and gradient were finite: lower optim.lr (now {st.engine.lr():g}); "
                    f"this step was not checkpointed, the last checkpoint is {st.result.last_checkpoint or 'none'}")
            if ok != 1.0 or not math.isfinite(mean_loss):
                st.result.bad_steps += 1
                st.logger.scalars(at, {"train/bad_steps": st.result.bad_steps})
                if st.result.bad_steps > cfg.max_bad_steps:
                    raise TooManyBadSteps(
                        f"{st.result.bad_steps} steps had non-finite loss or gradients (limit train.max_bad_steps="
                        f"{cfg.max_bad_steps}); last at step {at}. The parameters were not updated by them.")
            st.result.losses.append((at, mean_loss))
            st.result.final_loss = mean_loss
            for cb in self.callbacks:
                cb.on_step_loss(at, mean_loss, bool(ok))
            self.norm = norm
        self.steps.clear()
        return r.float("loop.stop") > 0


def _resume(cfg: TrainConfig, checkpointer: Checkpointer, engine, loader, result: LoopResult, rank: int,
            world: int, task: Task) -> int:
    """Restores the newest complete checkpoint (engine, data position, RNG, counters) into the run; returns the
    steps already done (0 on a fresh start)."""
    resumed = checkpointer.resume(engine)
    if resumed is None:
        return 0
    latest, state = resumed
    step, result.bad_steps = int(state["step"]), int(state["bad_steps"])
    result.final_loss = state.get("last_loss")
    # the run's whole loss curve, not only this invocation's (result.json reads it)
    result.losses = [(int(s), float(v)) for s, v in state.get("losses", []) if int(s) <= step]
    loader.load_state_dict(state["loader"])
    if state.get("world_size", world) == world:
        torch.set_rng_state(state["rng"])
        if state.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"])  # this rank's device (dropout, sampling on the GPU)
        task.load_state_dict(state.get("task") or {})
    else:  # an elastic restart: per-rank random streams cannot be carried to another number of ranks
        torch.manual_seed(cfg.seed + rank + 1_000_003 * step)
    result.last_checkpoint = latest
    return step


def train(  # noqa: C901 - THE training loop: its branches are the step's phases (kept <= 130 lines)
    cfg: TrainConfig,
    task: Task,
    engine,
    loader: ResumableLoader,
    checkpointer: Checkpointer,
    logger: MetricsLogger,
    *,
    tokens_per_micro_batch: int | None = None,
    progress: bool = True,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
    flops_per_token: float | None = None,
    callbacks: list[Callback] = (),
) -> LoopResult:
    """Trains ``task`` with ``engine`` up to cfg.steps (resuming from ``checkpointer``'s newest checkpoint).
    ``flops_per_token``: the model's training FLOPs per token (train/flops.py), for MFU; ``callbacks``: run after
    the defaults (callbacks.default_callbacks); ``on_step(step, this rank's loss tensor)``: after each step."""
    rank, world = _world()
    torch.manual_seed(cfg.seed + rank)
    result = LoopResult(step=0, finished=False, preempted=False)
    st = LoopState(cfg=cfg, task=task, engine=engine, logger=logger, rank=rank, world=world,
                   accum=cfg.grad_accum(world), result=result)
    with phases.phase("checkpoint resume"):
        st.step = st.start_step = _resume(cfg, checkpointer, engine, loader, result, rank, world, task)
    cbs = default_callbacks(cfg, rank, getattr(logger, "log_dir", None), progress=progress,
                            tokens_per_micro_batch=tokens_per_micro_batch, flops_per_token=flops_per_token)
    cbs += list(callbacks) + ([OnStep(on_step)] if on_step is not None else [])
    reads_every_step = any(cb.reads_every_step for cb in cbs)
    pending = _Pending(st, cbs)

    def save(at_step: int) -> None:
        state = {"step": at_step, "bad_steps": result.bad_steps, "loader": loader.state_dict(),
                 "rng": torch.get_rng_state(), "last_loss": result.final_loss, "world_size": world,
                 "losses": [[s, v] for s, v in result.losses], "task": task.state_dict(),
                 "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        result.last_checkpoint = checkpointer.save(at_step, engine, state)

    stop = _StopFlag()
    engine.train()
    data = iter(loader)
    try:
        for cb in cbs:
            cb.pre_train(st)
        while st.step < cfg.steps:
            nxt = st.step + 1
            st.logging = nxt % cfg.log_every == 0 or nxt == cfg.steps
            budget_hit = cfg.stop_after and nxt - st.start_step >= cfg.stop_after
            ckpt_step = (cfg.ckpt_every and nxt % cfg.ckpt_every == 0) or nxt == cfg.steps or budget_hit
            st.quiet = not (st.logging or ckpt_step or reads_every_step)  # nothing is read back in this step
            for cb in cbs:
                cb.pre_step(st)
            st.clock.start(timed=st.logging)
            task.before_step(st.step, st.logging)
            if task.before_step_phase:
                st.clock.lap(task.before_step_phase)
            # The micro-batch losses are summed on the device: reading one (float()) would stall the host until
            # its forward has run, before the backward is even queued.
            loss_sum, extra = None, {}
            for _ in range(st.accum):
                batch = next(data, None)
                if batch is None:  # epoch boundary: the loader starts its next epoch
                    data = iter(loader)
                    batch = next(data)
                st.clock.lap("data")
                loss, extra = task.loss(batch)
                st.clock.lap("forward")
                for cb in cbs:
                    loss = cb.on_micro_batch(st, batch, loss)
                engine.backward(loss / st.accum)
                st.clock.lap("backward")
                loss_sum = loss.detach().double() if loss_sum is None else loss_sum + loss.detach().double()
            task.after_backward(st.logging)
            # device tensors where the engine can decide without a host read (TorchEngine), else host values
            grad_norm, applied = engine.step_async()
            st.clock.lap("optimizer")
            st.step += 1
            st.step_loss = loss_sum / st.accum
            for cb in cbs:
                cb.post_step(st)
            finite = task.parameters_finite()
            pending.steps.append((st.step, loss_sum, applied, grad_norm, 0.0 if finite is None else ~finite))
            stop_flag = 1.0 if stop.requested is not None else 0.0
            if not st.quiet:
                # ONE collective and one host read for everything this step reduces: the loop's numbers, the
                # last micro-batch's extra scalars and, on a logging step, the task's and callbacks' statistics
                batch = pending.batch()
                finish = pending.add(batch, stop_flag)
                reported = None
                if st.logging:
                    for k, v in extra.items():
                        if isinstance(v, torch.Tensor):
                            batch.add(f"extra.{k}", v, "local")
                    reported = task.report_stats(st.step, logger, batch)
                    for cb in cbs:
                        cb.register(st, batch)
                red = batch.reduce()
                stop_now = finish(red)
                if st.logging:
                    extra = {k: red.float(f"extra.{k}") if isinstance(v, torch.Tensor) else v
                             for k, v in extra.items()}
                    _log_step(st, engine, logger, cbs, red, pending.norm, extra, reported)
            else:
                # only the stop flag, a host value over the host (gloo) group: no device sync
                (stop_now,) = _sum_across([stop_flag])
                if stop_now:
                    batch = pending.batch()
                    pending.add(batch, stop_flag)(batch.reduce())
            for cb in cbs:
                cb.end_step(st)
            if ckpt_step or stop_now:
                save(st.step)
            if stop_now or (budget_hit and st.step < cfg.steps):
                result.preempted = True
                break
        result.finished = st.step >= cfg.steps
    finally:
        stop.restore()
        for cb in cbs:
            cb.post_train(st)
        logger.flush()
    result.step = st.step
    return result


def _log_step(st: LoopState, engine, logger: MetricsLogger, cbs: list[Callback], red: Reduced, norm: float,
              extra: dict, reported) -> None:
    """A logging step's scalars: the loop's, the callbacks', the task's report."""
    loss = st.result.final_loss
    st.loss_parts = {k: f"{float(v):.4f}" for k, v in extra.items()}
    values = {"train/loss": loss, "train/perplexity": math.exp(min(loss, 50.0)), "train/lr": engine.lr(),
              "train/grad_norm": float(norm), **{f"train/{k}": float(v) for k, v in extra.items()}}
    for cb in cbs:
        values.update(cb.log_metrics(st, red))
    logger.scalars(st.step, values)
    logger.scalars(st.step, reported(red) if reported is not None else st.task.report(st.step, logger))
