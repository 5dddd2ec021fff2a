"""The grammar of ``S2T2_FAULT`` (``ACTION:N[@RANK],...``), apart from the fault points themselves
(:mod:`s2t2_dist.faults`), so that the environment's reader (:mod:`s2t2_dist.envvars`) can check a value before any
work without importing the fault machinery (which reads the environment through it)."""
from __future__ import annotations

from s2t2_dist.errors import FaultSpecError

ENV = "S2T2_FAULT"

# action -> (point, effect)
ACTIONS: dict[str, tuple[str, str]] = {
    "kill_at_step": ("loop.step_end", "kill"),
    "sigterm_at_step": ("loop.step_end", "sigterm"),
    "sigusr1_at_step": ("loop.step_end", "sigusr1"),
    "kill_at_checkpoint_start": ("checkpoint.begin", "kill"),
    "kill_in_checkpoint": ("checkpoint.after_engine_save", "kill"),
    "kill_before_rename": ("checkpoint.before_rename", "kill"),
    "kill_after_rename": ("checkpoint.after_rename", "kill"),
    "enospc_in_checkpoint": ("checkpoint.after_engine_save", "enospc"),
    "enospc_in_shard": ("shards.commit", "enospc"),
    "sigusr1_in_export": ("export.begin", "sigusr1"),
    "sigterm_in_export": ("export.begin", "sigterm"),
    "sigint_in_export": ("export.begin", "sigint"),
    "nan_loss_at_step": ("loop.loss", "nan_loss"),
    "inf_loss_at_step": ("loop.loss", "inf_loss"),
    "nan_grad_at_step": ("loop.loss", "nan_grad"),
    "inf_grad_at_step": ("loop.loss", "inf_grad"),
    "nan_param_at_step": ("loop.params", "nan_param"),
}


def parse(spec: str) -> dict[str, list[tuple[str, int, int | None]]]:
    """``S2T2_FAULT`` -> {point: [(effect, n, rank or None)]}."""
    out: dict[str, list[tuple[str, int, int | None]]] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        action, sep, rest = item.partition(":")
        if not sep or action not in ACTIONS:
            raise FaultSpecError(f"{ENV}: {item!r} is not ACTION:N[@RANK] with ACTION one of {sorted(ACTIONS)}")
        n, _, rank = rest.partition("@")
        try:
            n_i = int(n)
            rank_i = int(rank) if rank else None
        except ValueError:
            raise FaultSpecError(f"{ENV}: {item!r}: N and RANK must be integers") from None
        if n_i < 0 or (rank_i is not None and rank_i < 0):  # a step, a count or a rank: never negative
            raise FaultSpecError(f"{ENV}: {item!r}: N and RANK must be >= 0 (a step or count, a rank)")
        point_name, effect = ACTIONS[action]
        out.setdefault(point_name, []).append((effect, n_i, rank_i))
    return out
