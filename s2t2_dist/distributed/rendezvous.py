"""The SLURM rendezvous, computed in one place: the first node's address and a port from the job id.

Every task derives the same values without talking to the others. Used in Python by distributed/env.py (SLURM ranks
without a launcher) and cluster/submit.py (inside submitit jobs), and by the batch scripts before srun:

    eval "$(python -m s2t2_dist.distributed.rendezvous)"      # exports MASTER_ADDR and MASTER_PORT

Imports no torch, so the batch script's call is fast.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys

from s2t2_dist import envvars


def _int(env: dict, key: str, default: int) -> int:
    val = env.get(key)
    if val is None or val == "":
        return default
    try:
        return int(val)
    except ValueError:
        raise RuntimeError(f"environment variable {key}={val!r} is not an integer") from None


def slurm_first_host_addr(env: dict) -> str:
    """Address of the first node of the SLURM allocation, usable as the rendezvous address (S2T2_MASTER_ADDR wins).

    Node names need not resolve (a cluster may name nodes n1, n2 without DNS), so ask SLURM for the node's
    address and fall back to resolving the name only if scontrol is missing.
    """
    if envvars.get("S2T2_MASTER_ADDR", env):
        return envvars.get("S2T2_MASTER_ADDR", env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    try:
        first = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()[0]
        out = subprocess.run(["scontrol", "show", "node", first], capture_output=True, text=True, check=True).stdout
        for tok in out.split():
            if tok.startswith("NodeAddr="):
                return tok.split("=", 1)[1]
        return socket.gethostbyname(first)
    except (OSError, subprocess.CalledProcessError, IndexError):
        return env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")


#: the job's port is PORT_BASE + job id % PORT_SPAN: 20000-31999, away from common services and below Linux's
#: ephemeral range (32768-60999 by default), where the ranks' own sockets (gloo and NCCL pairs, other jobs' clients)
#: take ports: a job port up there failed with EADDRINUSE when 4 jobs shared a host (the local cluster's CI)
PORT_BASE, PORT_SPAN = 20000, 12000


def job_port(env: dict) -> int:
    """S2T2_MASTER_PORT, else a port every task of the job derives identically from the job id (PORT_BASE)."""
    port = envvars.get("S2T2_MASTER_PORT", env)  # range-checked: 1-65535
    if port:
        return port
    return PORT_BASE + _int(env, "SLURM_JOB_ID", 0) % PORT_SPAN


def slurm_port(env: dict) -> int:
    """The rendezvous port: MASTER_PORT when a launcher or the batch script set it, else :func:`job_port`."""
    if env.get("MASTER_PORT"):
        return _int(env, "MASTER_PORT", 0)
    return job_port(env)


def shell_exports(env: dict) -> str:
    """The batch script's rendezvous: ``export`` lines for MASTER_ADDR and MASTER_PORT (an inherited MASTER_PORT
    from the submitting shell is ignored: the job's own port wins)."""
    return (f"export MASTER_ADDR={shlex.quote(slurm_first_host_addr(env))}\n"
            f"export MASTER_PORT={job_port(env)}\n")


if __name__ == "__main__":
    import os

    try:
        exports = shell_exports(dict(os.environ))
    except envvars.EnvError as e:  # S2T2_MASTER_PORT out of range, ...: one line, before any rank starts
        print(f"s2t2 rendezvous: error: EnvError: {e}", file=sys.stderr)
        sys.exit(2)
    sys.stdout.write(exports)
