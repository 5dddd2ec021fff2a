"""Run a function in N freshly spawned processes with an initialised process group (for tests).

    from tests.distributed import run_distributed
    results = run_distributed(my_top_level_fn, 3, arg1, arg2, backend="gloo", timeout=120)

``fn`` must be a picklable top-level function; it runs as ``fn(*args, **fn_kwargs)`` on every rank after
``torch.distributed.init_process_group`` and its return values come back as a list indexed by rank (they are
serialised with ``torch.save``, so tensors are fine). If any rank raises, the others are stopped and a
:class:`DistributedTestError` carrying the failing rank's traceback is raised; a rank that dies without a word
(segfault, ``os._exit``) or a run that exceeds ``timeout`` seconds raises too -- nothing hangs.

Rendezvous: the parent opens a ``TCPStore`` on a free port chosen by the OS (no port race) and the children join it.
With ``init=False`` the children instead get ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
(for a fresh free port) and must initialise the group themselves (to test code that does its own
``init_process_group``).
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any
from collections.abc import Callable

__all__ = ["run_distributed", "DistributedTestError", "free_port"]


class DistributedTestError(RuntimeError):
    """A rank failed, died, or the run timed out."""


def free_port() -> int:
    """A TCP port that was free a moment ago (for code that needs MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, world_size, backend, store_port, master_port, init, timeout, num_threads, env, fn, args, kwargs, q):
    import torch

    os.environ.update(env or {})
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(master_port)})
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        import torch.distributed as dist

        if init:
            store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                                  timeout=timedelta(seconds=timeout))
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
        result = fn(*args, **(kwargs or {}))
        buf = io.BytesIO()
        torch.save(result, buf)
        payload = ("ok", rank, buf.getvalue())
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        payload = ("err", rank, traceback.format_exc())
    try:
        q.put(payload)
    finally:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and payload[0] == "ok":
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after the result is sent: nothing left to report to
            pass


def run_distributed(  # noqa: C901 - process start, time-outs and error collection of N ranks
    fn: Callable,
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 120.0,
    fn_kwargs: dict[str, Any] | None = None,
    init: bool = True,
    num_threads: int | None = 1,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run ``fn(*args, **fn_kwargs)`` on ``world_size`` spawned ranks; return the per-rank results (rank order).

    ``timeout``: seconds for the whole run; the rendezvous and collective timeout is ``max(timeout, 60)`` (so a
    short run deadline on a loaded machine fails with a clear "timed out", not a rendezvous error). ``num_threads``: torch
    threads per rank (1 by default, so N ranks do not oversubscribe a small machine; None leaves torch's default).
    ``env``: extra environment variables for the children. ``start_method``: "forkserver" (default: a server
    process imports torch once per session and forks each rank from it in milliseconds; it never touches CUDA) or
    "spawn" (a fresh interpreter per rank, several seconds each).
    """
    import torch.distributed as dist

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "s2t2_dist"])
    q = ctx.Queue()
    store = None
    store_port = 0
    if init:
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=max(timeout, 60.0)))
        store_port = store.port
    master_port = free_port()
    procs = []
    for rank in range(world_size):
        p = ctx.Process(
            target=_child,
            args=(rank, world_size, backend, store_port, master_port, init, max(timeout, 60.0), num_threads, env, fn,
                  args, fn_kwargs, q),
            daemon=True,
        )
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    error: str | None = None
    try:
        while len(results) < world_size:
            try:
                status, rank, payload = q.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    error = f"timed out after {timeout:.0f} s waiting for rank(s) {missing}"
                    break
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    # give its message (if any) a moment to arrive before calling it a silent death
                    try:
                        status, rank, payload = q.get(timeout=2.0)
                    except queue.Empty:
                        error = f"rank(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]} without reporting"
                        break
                else:
                    continue
            if status == "err":
                error = f"rank {rank} raised:\n{payload}"
                break
            import torch

            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            if error is not None and p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10 if error is None else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()
        del store
    if error is not None:
        raise DistributedTestError(error)
    return [results[r] for r in range(world_size)]
