"""The one training loop, shared by stage 1 (translate: only C trains) and stage 2 (finetune: the whole model).

A stage supplies a Task (how to compute the loss of a micro-batch, what to report) and an Engine (who owns the
parameters and the optimiser); the loop owns the step counter, gradient accumulation, skipping of non-finite
steps, logging, periodic evaluation, checkpoint/resume (with the data position and RNG) and clean stopping on
SIGTERM/SIGUSR1 (what SLURM sends before preemption or a time limit).
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

from s2t2_dist import envvars, faults
from s2t2_dist.distributed import collectives as coll
from s2t2_dist.distributed.stats_batch import Reduced, StatsBatch
from s2t2_dist.train.checkpoint import Checkpointer
from s2t2_dist.train.config import TrainConfig
from s2t2_dist.train.metrics import MetricsLogger


class Task(Protocol):
    def loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean loss of one micro-batch (the tensor to backpropagate) and extra scalars to log (floats or 0-dim
        tensors: tensors are read on logging steps only, so no host sync per micro-batch)."""

    def report(self, step: int, logger: MetricsLogger) -> dict[str, float]:
        """Expensive diagnostics, called every log interval (collective: every rank calls it)."""

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (collective)."""

    # Optional (called when the task defines them):
    # report_stats(step, logger, batch: StatsBatch) -> Callable[[Reduced], dict[str, float]]: report() in two
    #     halves, so that the logging step reduces the task's statistics in the loop's one collective: registers
    #     this rank's partial values into ``batch`` and returns what turns the reduced host values into the metrics
    #     (no collective, no device read there); report() is then not called
    # before_step(steps_done: int, logging: bool) -> None: before the step's first micro-batch
    # after_backward(logging: bool) -> None: after its last backward, before engine.step() (the gradient must be
    #     final here: the engine's clipping and non-finite check read it); ``logging``: this step logs (the only
    #     steps on which a task may read values back to the host)


class ResumableLoader(Protocol):
    def __iter__(self) -> Iterator[dict]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


#: environment variable: torch.cuda.set_sync_debug_mode for the steps that read nothing back (see train())
SYNC_DEBUG_ENV = "S2T2_SYNC_DEBUG"


class TooManyBadSteps(RuntimeError):
    pass


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


class _StopFlag:
    """Remembers SIGTERM/SIGUSR1/SIGINT so the loop can checkpoint at the next step boundary instead of dying
    mid-step. A second Ctrl-C (SIGINT) while that checkpoint is pending interrupts at once, as Python would."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)):
        self.requested: int | None = None
        self._old = {}
        for s in signals:
            try:
                self._old[s] = signal.signal(s, self._handler)
            except ValueError:  # not the main thread (e.g. inside some test runners): signals stay as they are
                pass

    def _handler(self, signum, frame):
        if signum == signal.SIGINT and self.requested == signal.SIGINT:
            raise KeyboardInterrupt
        if signum == signal.SIGINT:
            import sys

            print("\ninterrupted: writing a checkpoint at the end of this step (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)
        self.requested = signum

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)


_world = coll.rank_world
_sum_across = coll.sum_scalars


def train(
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
) -> LoopResult:
    rank, world = _world()
    accum = cfg.grad_accum(world)
    torch.manual_seed(cfg.seed + rank)
    step, bad_steps = 0, 0
    result = LoopResult(step=0, finished=False, preempted=False)

    resumed = checkpointer.resume(engine)
    latest = None
    if resumed is not None:
        latest, state = resumed
        step, bad_steps = int(state["step"]), int(state["bad_steps"])
        result.final_loss = state.get("last_loss")
        loader.load_state_dict(state["loader"])
        if state.get("world_size", world) == world:
            torch.set_rng_state(state["rng"])
            if state.get("cuda_rng") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state(state["cuda_rng"])  # this rank's device (dropout, sampling on the GPU)
        else:  # an elastic restart: per-rank random streams cannot be carried to another number of ranks
            torch.manual_seed(cfg.seed + rank + 1_000_003 * step)
        result.last_checkpoint = latest
    faults.record("start", step=step, checkpoint=str(latest) if latest is not None else None)

    def save(at_step: int) -> None:
        state = {"step": at_step, "bad_steps": bad_steps, "loader": loader.state_dict(), "rng": torch.get_rng_state(),
                 "last_loss": result.final_loss, "world_size": world,
                 "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        result.last_checkpoint = checkpointer.save(at_step, engine, state)

    stop = _StopFlag()
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=step, desc="train", dynamic_ncols=True)
    engine.train()
    data = iter(loader)
    steps_this_run = 0
    t_last, toks_since, wait_since = time.perf_counter(), 0, 0.0
    before_step = getattr(task, "before_step", None)
    after_backward = getattr(task, "after_backward", None)
    report_stats = getattr(task, "report_stats", None)
    step_async = getattr(engine, "step_async", None)
    tracing = envvars.is_set(faults.TRACE_ENV)  # the fault tests' trace records every step's loss
    # S2T2_SYNC_DEBUG=error|warn (bench/gpu_smoke.py): on CUDA, a step that neither logs, checkpoints nor stops
    # runs under torch.cuda.set_sync_debug_mode, so any host sync in it raises (or warns) where it happens
    sync_debug = envvars.get(SYNC_DEBUG_ENV) if torch.cuda.is_available() else None
    # Steps not yet read back: (step, this rank's summed micro-batch losses, applied, grad norm), device values.
    # Nothing is read to the host on a step that does not log, checkpoint or stop (a GPU keeps running ahead).
    pending: list[tuple[int, Any, Any, Any]] = []
    last = {"norm": float("nan"), "tok_total": 0.0}

    def flush(batch: StatsBatch, stop_flag: float) -> Callable[[Reduced], bool]:
        """Registers the pending steps (each one's loss sum, applied flag and grad norm: device values), the tokens
        and the stop flag into ``batch`` (reduced over the ranks in one collective with whatever else the step
        reports, read back once); returns what then counts bad steps, records the losses and tells whether some
        rank asked to stop."""
        k = len(pending)
        if k:
            dev = batch.device
            batch.add("loop.loss_sums", torch.stack([v.reshape(()).to(dev, torch.float64) for _, v, _, _ in pending]))
            # the applied flag is the same on every rank (the engine's decision); the norm is already global
            batch.add("loop.applied_norm", torch.stack([torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(())
                                                        for _, _, *vals in pending for v in vals]), "local")
        batch.add("loop.tokens", float(toks_since))
        batch.add("loop.stop", stop_flag)

        def finish(r: Reduced) -> bool:
            nonlocal bad_steps
            sums = r["loop.loss_sums"].tolist() if k else []
            host = r["loop.applied_norm"].reshape(k, 2).tolist() if k else []
            for (at, _, _, _), (ok, norm), total in zip(pending, host, sums):
                mean_loss = total / accum / world
                if ok != 1.0 or not math.isfinite(mean_loss):
                    bad_steps += 1
                    logger.scalars(at, {"train/bad_steps": bad_steps})
                    if bad_steps > cfg.max_bad_steps:
                        raise TooManyBadSteps(
                            f"{bad_steps} steps had non-finite loss or gradients (limit train.max_bad_steps="
                            f"{cfg.max_bad_steps}); last at step {at}. The parameters were not updated by them."
                        )
                result.losses.append((at, mean_loss))
                result.final_loss = mean_loss
                faults.record_step(at, mean_loss, bool(ok))
                last["norm"] = norm
            if bar is not None and k:
                bar.set_postfix({"loss": f"{result.final_loss:.4f}", **last.get("parts", {})})  # in this order
            pending.clear()
            last["tok_total"] = r.float("loop.tokens")
            return r.float("loop.stop") > 0
        return finish

    def new_batch() -> StatsBatch:
        # where the step's values live (the losses' device): NCCL for CUDA, gloo for CPU
        return StatsBatch(pending[0][1].device if pending else "cpu")

    try:
        while step < cfg.steps:
            logging_step = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
            budget_hit = cfg.stop_after and steps_this_run + 1 >= cfg.stop_after
            ckpt_step = (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or step + 1 == cfg.steps or budget_hit
            quiet = not (logging_step or ckpt_step or tracing)  # nothing is read back in this step
            if sync_debug and quiet:
                torch.cuda.set_sync_debug_mode(sync_debug)
            if before_step is not None:
                before_step(step, logging_step)
            # The micro-batch losses are summed on the device: reading one (float()) would stall the host until
            # its forward has run, before the backward is even queued.
            loss_sum, extra = None, {}
            for _ in range(accum):
                t0 = time.perf_counter()
                try:
                    batch = next(data)
                except StopIteration:  # epoch boundary: the loader starts its next epoch
                    data = iter(loader)
                    batch = next(data)
                wait_since += time.perf_counter() - t0
                faults.record_batch(step + 1, batch)
                loss, extra = task.loss(batch)
                loss = faults.poison_loss(loss, step + 1)
                engine.backward(loss / accum)
                loss_sum = loss.detach().double() if loss_sum is None else loss_sum + loss.detach().double()
                toks_since += tokens_per_micro_batch or batch["input_ids"].numel()
            if after_backward is not None:
                after_backward(logging_step)
            # device tensors where the engine can decide without a host read (TorchEngine), else host values
            grad_norm, applied = engine.step_async() if step_async is not None else engine.step()
            step += 1
            steps_this_run += 1
            pending.append((step, loss_sum, applied, grad_norm))
            faults.point("loop.step_end", step)
            if on_step is not None:
                on_step(step, loss_sum / accum)  # this rank's loss, a device tensor: reading it is a host sync
            if bar is not None:
                bar.update(1)
            if sync_debug and quiet:
                torch.cuda.set_sync_debug_mode(0)
            stop_flag = 1.0 if stop.requested is not None else 0.0
            reported = None  # the task's statistics, finished from the step's one reduction
            if not quiet:
                # ONE collective and one host read for everything this step reduces: the loop's numbers, the
                # last micro-batch's extra scalars and, on a logging step, the task's statistics (report_stats)
                batch = new_batch()
                finish_loop = flush(batch, stop_flag)
                if logging_step:
                    for k, v in extra.items():
                        if isinstance(v, torch.Tensor):
                            batch.add(f"extra.{k}", v, "local")
                    if report_stats is not None:
                        reported = report_stats(step, logger, batch)
                red = batch.reduce()
                stop_now = finish_loop(red)
                if logging_step:
                    extra = {k: red.float(f"extra.{k}") if isinstance(v, torch.Tensor) else v
                             for k, v in extra.items()}
                    if bar is not None and extra:  # the loss's parts beside it (stage 1: ce, alpha*H)
                        last["parts"] = {k: f"{float(v):.4f}" for k, v in extra.items()}
                        bar.set_postfix({"loss": f"{result.final_loss:.4f}", **last["parts"]})
            else:
                # only the stop flag, a host value over the host (gloo) group: no device sync
                (stop_now,) = _sum_across([stop_flag])
                if stop_now:
                    batch = new_batch()
                    flush(batch, stop_flag)(batch.reduce())
            if logging_step:
                now = time.perf_counter()
                dt = now - t_last
                logger.scalars(
                    step,
                    {
                        "train/loss": result.final_loss,
                        "train/perplexity": math.exp(min(result.final_loss, 50.0)),
                        "train/lr": engine.lr(),
                        "train/grad_norm": float(last["norm"]),
                        "train/tokens_per_s": last["tok_total"] / max(dt, 1e-9),
                        **{f"train/{k}": float(v) for k, v in extra.items()},  # tensors read in the batch
                    },
                )
                node_vals = {"node/tokens_per_s": toks_since / max(dt, 1e-9),
                             "node/step_time_s": dt / cfg.log_every, "node/data_wait_s": wait_since / cfg.log_every}
                node_vals.update(_memory_stats())
                logger.scalars(step, node_vals, scope="node")
                logger.scalars(step, reported(red) if reported is not None else task.report(step, logger))
                t_last, toks_since, wait_since = time.perf_counter(), 0, 0.0
            if cfg.eval_every and step % cfg.eval_every == 0:
                engine.eval()
                logger.scalars(step, {f"eval/{k}": v for k, v in task.evaluate().items()})
                engine.train()
            if ckpt_step or stop_now:
                save(step)
            if stop_now or (budget_hit and step < cfg.steps):
                result.preempted = True
                break
        result.finished = step >= cfg.steps
    finally:
        stop.restore()
        if bar is not None:
            bar.close()
        logger.flush()
    result.step, result.bad_steps = step, bad_steps
    return result


def _memory_stats() -> dict[str, float]:
    out = {}
    if torch.cuda.is_available():
        out["node/gpu_mem_max_gib"] = torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource

        out["node/cpu_rss_max_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError:
        pass
    return out
