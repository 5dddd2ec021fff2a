"""Fault injection and tracing for the reliability suite (tests/faults/).

The training loop, the checkpointer and the shard writer call :func:`point` at named places; the environment
variable ``S2T2_FAULT`` says what happens there. When it is unset (every real run) a call is one dict lookup.

    S2T2_FAULT="kill_at_step:5@1"                  rank 1 SIGKILLs itself at the end of step 5
    S2T2_FAULT="kill_in_checkpoint:6@1"            rank 1 dies after writing its engine files of checkpoint 6
    S2T2_FAULT="kill_before_rename:6"              rank 0 dies with meta.json written but the .partial not renamed
    S2T2_FAULT="nan_loss_at_step:3,inf_grad_at_step:5@1"
    S2T2_FAULT="enospc_in_checkpoint:4@1"          "No space left on device" while rank 1 writes checkpoint 4
    S2T2_FAULT="enospc_in_shard:2"                 "No space left on device" while committing shard 2
    S2T2_FAULT="sigusr1_in_export:8"               SIGUSR1 as the final export (after step 8) begins

Grammar: comma-separated ``ACTION:N[@RANK]``; N is the step (loop, checkpoints) or the shard number (shards);
without ``@RANK`` every rank fires. Actions and the points they act at are in ``ACTIONS``.

``S2T2_FAULT_TRACE=DIR`` makes every rank append JSON lines to ``DIR/trace_rankNNNNN.jsonl``: one ``start`` per
process (pid, the step it resumed from), one ``batch`` per micro-batch (the sample indices, or a content hash of
each row when the loader does not return indices), one ``step`` per optimiser step (loss, applied) and every
point reached (e.g. ``checkpoint.after_rename``: a checkpoint became complete). Tests read it to count samples
across restarts, to find a rank's pid for an outside ``kill -9``, and to know which checkpoint was the last
complete one.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

from s2t2_dist import envvars

from s2t2_dist.fault_spec import ACTIONS, ENV, parse  # noqa: F401 (the spec's grammar, re-exported)
from s2t2_dist.errors import FaultSpecError

TRACE_ENV = "S2T2_FAULT_TRACE"


_plan: dict | None = None
_plan_src: str | None = None
_trace_file = None
_trace_dir: str | None = None


def _rank() -> int:
    from s2t2_dist.distributed import collectives as coll

    if coll.initialized():
        return coll.rank()
    for k in ("RANK", "SLURM_PROCID"):
        if os.environ.get(k, "").isdigit():
            return int(os.environ[k])
    return 0


def _active_plan() -> dict:
    global _plan, _plan_src
    spec = envvars.raw(ENV)  # parsed (and its errors said) by parse() below
    if spec != _plan_src:
        _plan, _plan_src = (parse(spec) if spec else {}), spec
    return _plan


def enabled() -> bool:
    return bool(envvars.is_set(ENV) or envvars.is_set(TRACE_ENV))


def _fires(point_name: str, n: int | None) -> list[str]:
    plan = _active_plan()
    if not plan or point_name not in plan:
        return []
    rank = _rank()
    return [eff for eff, at, r in plan[point_name] if at == n and (r is None or r == rank)]


def point(name: str, step: int | None = None, **ctx: Any) -> None:
    """A named place in the code. Traces it (when tracing) and applies the faults configured for it."""
    if not (envvars.is_set(ENV) or envvars.is_set(TRACE_ENV)):
        return
    record("point", name=name, step=step, **ctx)
    for eff in _fires(name, step):
        _apply(eff, name, step, ctx)


def _apply(effect: str, name: str, step, ctx) -> None:
    where = f"{name} (step/shard {step}, rank {_rank()})"
    if effect == "kill":
        record("fault", effect="SIGKILL", where=where)
        os.kill(os.getpid(), signal.SIGKILL)
    elif effect in ("sigterm", "sigusr1", "sigint"):
        record("fault", effect=effect.upper(), where=where)
        os.kill(os.getpid(), {"sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1, "sigint": signal.SIGINT}[effect])
    elif effect == "enospc":
        record("fault", effect="ENOSPC", where=where)
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV} at {where})", ctx.get("path"))
    else:
        raise FaultSpecError(f"effect {effect!r} does not apply at {name}")


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by nan or inf (the loss itself stays finite)."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def poison_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The loss of a micro-batch of optimiser step `step`, poisoned if a loss/grad fault is configured for it."""
    if not envvars.is_set(ENV):
        return loss
    for eff in _fires("loop.loss", step):
        record("fault", effect=eff, where=f"loss of step {step}, rank {_rank()}")
        if eff == "nan_loss":
            loss = loss * float("nan")
        elif eff == "inf_loss":
            loss = loss * float("inf")
        elif eff == "nan_grad":
            loss = _PoisonGrad.apply(loss, float("nan"))
        elif eff == "inf_grad":
            loss = _PoisonGrad.apply(loss, float("inf"))
    return loss


def poison_params(module: torch.nn.Module, step: int) -> None:
    """After optimiser step `step`: one entry of the first trained parameter set to NaN, if configured (a step that
    broke the parameters while its loss and gradient were finite)."""
    if not envvars.is_set(ENV):
        return
    for eff in _fires("loop.params", step):
        record("fault", effect=eff, where=f"parameters after step {step}, rank {_rank()}")
        p = next(p for p in module.parameters() if p.requires_grad)
        with torch.no_grad():
            p.view(-1)[0] = float("nan")


# ---------------------------------------------------------------------------------------------------------------
# tracing


def _trace():
    global _trace_file, _trace_dir
    d = envvars.get(TRACE_ENV)
    if not d:
        return None
    if _trace_file is None or _trace_dir != d:
        Path(d).mkdir(parents=True, exist_ok=True)
        _trace_file = open(Path(d) / f"trace_rank{_rank():05d}.jsonl", "a", buffering=1)  # line-buffered
        _trace_dir = d
    return _trace_file


def record(event: str, **fields: Any) -> None:
    f = _trace()
    if f is None:
        return
    f.write(json.dumps({"ev": event, "pid": os.getpid(), **fields}, default=str) + "\n")
    f.flush()


def sample_ids(batch: dict) -> list:
    """Identities of a batch's samples: the loader's indices when it returns them, else a hash of each row."""
    idx = batch.get("index")
    if idx is not None:
        return [int(i) for i in idx.reshape(-1).tolist()]
    ids = batch["input_ids"]
    return [hashlib.blake2b(row.cpu().numpy().tobytes(), digest_size=8).hexdigest() for row in ids]


def record_batch(step: int, batch: dict) -> None:
    if not envvars.is_set(TRACE_ENV):
        return
    record("batch", step=step, ids=sample_ids(batch))


def record_step(step: int, loss: float, applied: bool) -> None:
    if not envvars.is_set(TRACE_ENV):
        return
    record("step", step=step, loss=loss, applied=applied)


# ---------------------------------------------------------------------------------------------------------------
# reading traces back (tests)


def read_trace(directory: str | Path, rank: int) -> list[dict]:
    p = Path(directory) / f"trace_rank{rank:05d}.jsonl"
    out = []
    if not p.is_file():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line torn by a SIGKILL mid-write
            break
    return out


def effective_history(events: list[dict]) -> dict:
    """What the training as a whole did, from one rank's trace over several launches: each launch rolls the history
    back to the step it resumed from. Returns {"batches": {step: [ids of each micro-batch]}, "losses": {step: loss},
    "starts": [(pid, resumed_step)], "complete": [checkpoint steps completed, in order]}."""
    batches: dict[int, list] = {}
    losses: dict[int, float] = {}
    starts, complete = [], []
    for e in events:
        ev = e["ev"]
        if ev == "start":
            s = int(e["step"])
            starts.append((e["pid"], s))
            batches = {k: v for k, v in batches.items() if k <= s}
            losses = {k: v for k, v in losses.items() if k <= s}
        elif ev == "batch":
            batches.setdefault(int(e["step"]), []).append(e["ids"])
        elif ev == "step":
            losses[int(e["step"])] = e["loss"]
        elif ev == "point" and e["name"] == "checkpoint.after_rename":
            complete.append(int(e["step"]))
    return {"batches": batches, "losses": losses, "starts": starts, "complete": complete}
