"""How a process that was a rank of a torch.distributed job ends.

After the process group is torn down, Python's own shutdown can still kill a rank: objects of the communication
backend (gloo / NCCL work handles still referenced from Python, e.g. by DeepSpeed's ZeRO-3 prefetching) are
destroyed during interpreter finalization, and a C++ destructor that needs the GIL or meets a joinable thread calls
std::terminate ("terminate called without an active exception", SIGABRT). The run has finished and written its
results by then, but the launcher and SLURM see a failed rank (seen twice in CI under the deepspeed launcher: a
ZeRO-3 run on 2 gloo ranks, exit status 250, and the SLURM probe, after its last line was printed). So a process whose process group was torn down leaves through os._exit
after flushing, skipping finalization; any other process exits normally.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

_tore_down = False


def destroy_process_group() -> None:
    """``torch.distributed.destroy_process_group()``, remembering that this process may exit the hard way."""
    import torch.distributed as dist

    from s2t2_dist.distributed.collectives import forget_groups

    global _tore_down
    dist.destroy_process_group()
    forget_groups()
    _tore_down = True


def exit_process(code: int | None = 0) -> NoReturn:
    """``sys.exit(code)``, or ``os._exit(code)`` after flushing when this process tore down a process group."""
    code = int(code or 0)
    if _tore_down:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to lose
                pass
        os._exit(code)
    sys.exit(code)
