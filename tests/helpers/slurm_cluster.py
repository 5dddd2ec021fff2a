"""A real, private SLURM cluster on this host: munged, MariaDB + slurmdbd (accounting, so `sacct` and therefore
submitit work), slurmctld and several slurmd "nodes" (n1, n2, ...) that all run here.

Everything lives in one folder (config, state, spools, logs, sockets, pid files); nothing in /etc is read or
written, and clients find the cluster through the `SLURM_CONF` of `cluster.env()`. Only the daemons this manager
started are stopped, by their pid files (checked against /proc before any signal is sent).

From Python (pytest fixtures use this)::

    with LocalSlurmCluster() as c:
        job = c.sbatch("slurm/translate_1b.sh", sbatch_args=["--nodes=2"])
        assert c.wait(job) == "COMPLETED"

By hand::

    python -m tests.helpers.slurm_cluster start --dir /tmp/s2t2-slurm     # prints `export SLURM_CONF=...`
    export SLURM_CONF=/tmp/s2t2-slurm/etc/slurm.conf; sinfo; sbatch ...; sacct
    python -m tests.helpers.slurm_cluster stop --dir /tmp/s2t2-slurm

Needs the Debian packages `slurmctld slurmd slurm-client munge` (and `slurmdbd mariadb-server` for
accounting); see .ci/install_slurm.sh. Settings chosen for fast tests: a requeued job starts again in ~7 s
(`cred_expire=5`, `sched_interval=1`), finished jobs stay visible to scontrol for a day (`MinJobAge`), job ids
start from the clock (`FirstJobId`) so a new cluster never reuses an old job's id (and its output files).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

#: binary -> Debian package providing it
CORE_BINARIES = {
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "sbatch": "slurm-client",
    "scontrol": "slurm-client",
    "srun": "slurm-client",
}
ACCOUNTING_BINARIES = {
    "slurmdbd": "slurmdbd",
    "sacct": "slurm-client",
    "sacctmgr": "slurm-client",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
}
TERMINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
    "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
}
_SEARCH_PATH = ["/usr/sbin", "/sbin", "/usr/local/sbin"]


class SlurmClusterError(RuntimeError):
    pass


def which(name: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(_SEARCH_PATH)
    return shutil.which(name, path=path)


def missing_packages(accounting: bool = True) -> list[str]:
    """Debian packages whose binaries are missing here (empty: the cluster can start)."""
    wanted = dict(CORE_BINARIES)
    if accounting:
        wanted.update(ACCOUNTING_BINARIES)
    return sorted({pkg for b, pkg in wanted.items() if which(b) is None})


def require_packages(accounting: bool = True) -> None:
    """In a pytest fixture: skip when SLURM is not installed here, but fail under CI (which must provide it)."""
    import pytest

    missing = missing_packages(accounting)
    if missing:
        msg = f"SLURM is not installed (missing Debian packages: {' '.join(missing)}); run .ci/install_slurm.sh"
        if os.environ.get("CI"):
            pytest.fail(msg + " -- CI must provide a real SLURM", pytrace=False)
        pytest.skip(msg)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """True if pid runs (a zombie left by a non-reaping init counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`scontrol -o show job|node` prints KEY=VALUE pairs separated by spaces; values may contain spaces."""
    out: dict[str, str] = {}
    key = None
    for tok in line.strip().split(" "):
        m = re.match(r"^([A-Za-z][\w:/.\-]*)=(.*)$", tok)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += " " + tok
    return out


@dataclass
class _Daemon:
    name: str
    argv: list[str]
    ready: object = None  # callable -> bool
    proc: subprocess.Popen | None = None


@dataclass
class LocalSlurmCluster:
    """A SLURM cluster of `nodes` slurmd daemons on this host, in `root` (a new temp folder if None)."""

    root: Path | None = None
    nodes: int = 2
    cpus_per_node: int = 2
    #: fake GPUs per node (a GRES with a count and no device files): lets scripts that ask for
    #: --gpus-per-node run unchanged; torch still sees no GPU
    gpus_per_node: int = 2
    memory_mb_per_node: int = 4096
    accounting: bool = True
    cluster_name: str = "s2t2local"
    #: seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or preempted
    kill_wait_s: int = 15
    keep_root: bool = False
    _daemons: list[_Daemon] = field(default_factory=list, init=False, repr=False)
    _own_root: bool = field(default=False, init=False, repr=False)

    # ------------------------------------------------------------------ layout
    def __post_init__(self):
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="s2t2-slurm-"))
            self._own_root = True
        self.root = Path(self.root).resolve()
        self.hostname = socket.gethostname().split(".")[0]
        self.user = getpass.getuser()
        self.is_root = os.geteuid() == 0

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.nodes)]

    def path(self, *parts: str) -> Path:
        return self.root.joinpath(*parts)

    @property
    def munge_socket(self) -> Path:
        return self.path("munge", "munge.socket")

    def env(self, base: dict | None = None) -> dict[str, str]:
        """Environment for SLURM clients (sbatch, squeue, sacct, submitit) talking to this cluster.

        SLURM_* variables of an enclosing job (tests run inside a real allocation) are dropped: they would leak
        into the jobs submitted here."""
        env = {k: v for k, v in (os.environ if base is None else base).items()
               if not (k.startswith("SLURM_") or k.startswith("SBATCH_") or k.startswith("SALLOC_")
                       or k.startswith("SRUN_"))}
        env["SLURM_CONF"] = str(self.conf)
        paths = env.get("PATH", "/usr/bin:/bin").split(os.pathsep)
        env["PATH"] = os.pathsep.join(paths + [p for p in _SEARCH_PATH if p not in paths])
        return env

    @property
    def state_file(self) -> Path:
        return self.path("cluster.json")

    # ------------------------------------------------------------------ start
    def start(self, timeout_s: float = 60.0) -> LocalSlurmCluster:
        missing = missing_packages(self.accounting)
        if missing:
            raise SlurmClusterError(
                "SLURM is not installed here; missing Debian packages: " + " ".join(missing)
                + " (install with: bash .ci/install_slurm.sh)")
        if self.state_file.exists() and any(self._pids().values()):
            raise SlurmClusterError(f"a cluster is already running in {self.root}; stop it first")
        try:
            self._write_files()
            self._start_all(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _check_root_reachable(self) -> None:
        # munged refuses a socket whose folders others cannot traverse, and MariaDB runs as the mysql user.
        for d in [self.root, *self.root.parents]:
            if d != self.root and not (d.stat().st_mode & 0o001):
                raise SlurmClusterError(
                    f"{d} is not searchable by other users (mode {oct(d.stat().st_mode & 0o777)}), which munged and "
                    f"MariaDB require of every folder above {self.root}; choose a root under /tmp (the default)")

    def _write_files(self) -> None:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        self._check_root_reachable()
        # The MariaDB server drops to the mysql user: it must be able to reach its datadir.
        os.chmod(r, 0o755)
        for d in ("etc", "state", "log", "run", "munge", "spool", "db"):
            self.path(d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.path("munge"), 0o755)  # munged refuses a socket folder others can write to
        for n in self.node_names:
            self.path("spool", n).mkdir(parents=True, exist_ok=True)
        key = self.path("etc", "munge.key")
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)

        self.ports = {"slurmctld": free_port(), "slurmdbd": free_port(), "mariadb": free_port()}
        for n in self.node_names:
            self.ports[n] = free_port()
        self.db_password = secrets.token_hex(12)
        first_job_id = int(time.time()) % 50_000_000 + 1_000_000
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket},cred_expire=5\n"
        slurm_user = "root" if self.is_root else self.user
        lines = [
            f"ClusterName={self.cluster_name}",
            f"SlurmctldHost={self.hostname}(127.0.0.1)",
            f"SlurmctldPort={self.ports['slurmctld']}",
            f"SlurmUser={slurm_user}",
            f"SlurmdUser={slurm_user}",
            auth.strip(),
            "CredType=cred/munge",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/run/slurmctld.pid",
            f"SlurmdPidFile={r}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups, no systemd: track job processes by parentage.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MinJobAge=86400",
            f"FirstJobId={first_job_id}",
            f"KillWait={self.kill_wait_s}",
            "InactiveLimit=0",
            "Waittime=0",
            "JobRequeue=1",
            "MailProg=/bin/true",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            # Preemption is available for experiments: a job in `urgent` requeues jobs in `debug`.
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
        ]
        if self.accounting:
            lines += [
                "AccountingStorageType=accounting_storage/slurmdbd",
                "AccountingStorageHost=127.0.0.1",
                f"AccountingStoragePort={self.ports['slurmdbd']}",
                # the munge socket for the slurmdbd connection (AuthInfo does not apply to it)
                f"AccountingStoragePass={self.munge_socket}",
                "JobAcctGatherType=jobacct_gather/linux",
                "JobAcctGatherFrequency=30",
            ]
        else:
            lines += ["AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none"]
        gres = ""
        if self.gpus_per_node:
            lines.append("GresTypes=gpu")
            gres = f" Gres=gpu:{self.gpus_per_node}"
            # slurmd drops GPUs without device files; plain files stand in for /dev/nvidiaN (task/none never
            # restricts devices, so they are only used to number the GPUs, e.g. in CUDA_VISIBLE_DEVICES).
            self.path("dev").mkdir(exist_ok=True)
            for i in range(self.gpus_per_node):
                self.path("dev", f"fakegpu{i}").touch()
            files = f"{r}/dev/fakegpu[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else f"{r}/dev/fakegpu0"
            self.path("etc", "gres.conf").write_text(
                "AutoDetect=off\n" + "".join(
                    f"NodeName={n} Name=gpu File={files}\n" for n in self.node_names))
        for n in self.node_names:
            lines.append(
                f"NodeName={n} NodeHostname={self.hostname} NodeAddr=127.0.0.1 Port={self.ports[n]} "
                f"Sockets=1 CoresPerSocket={self.cpus_per_node} ThreadsPerCore=1 "
                f"RealMemory={self.memory_mb_per_node}{gres} State=UNKNOWN")
        nodes = ",".join(self.node_names)
        lines += [
            f"PartitionName=debug Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
            f"PartitionName=urgent Nodes={nodes} Default=NO MaxTime=INFINITE State=UP PriorityTier=2",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        self.path("etc", "cgroup.conf").unlink(missing_ok=True)
        if self.accounting:
            dbd = self.path("etc", "slurmdbd.conf")
            dbd.write_text("\n".join([
                auth.strip(),
                "DbdAddr=127.0.0.1",
                "DbdHost=localhost",
                f"DbdPort={self.ports['slurmdbd']}",
                f"SlurmUser={slurm_user}",
                "DebugLevel=info",
                f"LogFile={r}/log/slurmdbd.log",
                f"PidFile={r}/run/slurmdbd.pid",
                "StorageType=accounting_storage/mysql",
                "StorageHost=127.0.0.1",
                f"StoragePort={self.ports['mariadb']}",
                "StorageUser=slurm",
                f"StoragePass={self.db_password}",
                "StorageLoc=slurm_acct_db",
            ]) + "\n")
            os.chmod(dbd, 0o600)
        self.state_file.write_text(json.dumps(
            {"ports": self.ports, "nodes": self.node_names, "first_job_id": first_job_id,
             "conf": str(self.conf)}, indent=1))

    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.path("log", f"{name}.console"), "ab")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=env or self.env(), start_new_session=True, cwd=self.root)
        finally:
            log.close()
        self.path("run", "own").mkdir(parents=True, exist_ok=True)
        self.path("run", "own", f"{name}.pid").write_text(f"{proc.pid}\n")
        d = _Daemon(name, argv, proc=proc)
        self._daemons.append(d)
        return proc

    def _wait(self, what: str, check, timeout_s: float, proc: subprocess.Popen | None = None, log: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if check():
                return
            if proc is not None and proc.poll() is not None:
                raise SlurmClusterError(f"{what} exited with code {proc.returncode}; {self._tail(log)}")
            time.sleep(0.1)
        raise SlurmClusterError(f"{what} not ready after {timeout_s:.0f} s; {self._tail(log)}")

    def _tail(self, name: str, n: int = 15) -> str:
        if not name:
            return ""
        out = []
        for f in (self.path("log", name), self.path("log", name.split(".")[0] + ".console")):
            if f.is_file():
                out.append(f"{f}:\n" + "\n".join(f.read_text(errors="replace").splitlines()[-n:]))
        return "\n".join(out)

    def _run(self, argv: list[str], check: bool = True, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        argv = [which(argv[0]) or argv[0], *argv[1:]]
        res = subprocess.run(argv, capture_output=True, text=True, env=kw.pop("env", None) or self.env(),
                             timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise SlurmClusterError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
        return res

    def _start_all(self, timeout_s: float) -> None:
        r = self.root
        t0 = time.monotonic()
        munged = self._spawn("munged", [
            which("munged"), "-F", f"--key-file={r}/etc/munge.key", f"--socket={self.munge_socket}",
            f"--pid-file={r}/run/munged.pid", f"--log-file={r}/log/munged.log",
            f"--seed-file={r}/run/munged.seed", "--num-threads=2"])
        self._wait("munged", self.munge_socket.exists, 10, munged, "munged.log")

        if self.accounting:
            self._start_mariadb(timeout_s)
            # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF.
            dbd = self._spawn("slurmdbd", [which("slurmdbd"), "-D"])
            self._wait("slurmdbd", lambda: _port_open(self.ports["slurmdbd"]), timeout_s, dbd, "slurmdbd.log")

        ctld = self._spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._run(["scontrol", "ping"], check=False).returncode == 0
                   and "UP" in self._run(["scontrol", "ping"], check=False).stdout, timeout_s, ctld, "slurmctld.log")
        for n in self.node_names:
            self._spawn(f"slurmd-{n}", [which("slurmd"), "-D", "-N", n, "-f", str(self.conf)])
        self._wait("slurmd nodes", self._nodes_idle, timeout_s, None, "slurmctld.log")
        if self.accounting:
            # slurmctld registers the cluster with slurmdbd by itself; sacct works once it has.
            self._wait("accounting (cluster registration)", self._cluster_registered, timeout_s, None,
                       "slurmdbd.log")
        self.startup_s = time.monotonic() - t0

    def _start_mariadb(self, timeout_s: float) -> None:
        r = self.root
        datadir = self.path("db", "data")
        sock = self.path("db", "mysqld.sock")
        user_args = ["--user=mysql"] if self.is_root else []
        # mariadb-install-db lets root, and the OS user who ran it, in through the socket (unix_socket auth)
        db_admin = "root" if self.is_root else self.user
        if self.is_root:
            shutil.chown(self.path("db"), "mysql", "mysql")
        if not datadir.exists():
            res = subprocess.run(
                [which("mariadb-install-db"), "--no-defaults", *user_args, f"--datadir={datadir}",
                 "--auth-root-authentication-method=socket", f"--auth-root-socket-user={db_admin}", "--skip-test-db"],
                capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise SlurmClusterError(f"mariadb-install-db failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
        db = self._spawn("mariadb", [
            which("mariadbd"), "--no-defaults", *user_args, f"--datadir={datadir}", f"--socket={sock}",
            f"--port={self.ports['mariadb']}", "--bind-address=127.0.0.1", f"--pid-file={r}/db/mariadb.pid",
            f"--log-error={r}/log/mariadb.log", "--skip-name-resolve", "--innodb-buffer-pool-size=32M",
            "--performance-schema=OFF", "--skip-log-bin", "--max-connections=50"])
        self._wait("mariadb", lambda: _port_open(self.ports["mariadb"]) and sock.exists(), timeout_s, db,
                   "mariadb.log")
        sql = (f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.db_password}';"
               f"CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '{self.db_password}';"
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
               "CREATE DATABASE IF NOT EXISTS slurm_acct_db; FLUSH PRIVILEGES;")
        res = subprocess.run([which("mariadb"), "--no-defaults", f"--socket={sock}", f"-u{db_admin}", "-e", sql],
                             capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise SlurmClusterError(f"creating the slurm database user failed: {res.stderr.strip()}")

    def _nodes_idle(self) -> bool:
        res = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        if res.returncode != 0:
            return False
        states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
        return all(states.get(n, "").rstrip("*") == "idle" for n in self.node_names)

    def _cluster_registered(self) -> bool:
        res = self._run(["sacctmgr", "-n", "-P", "list", "cluster", "format=cluster"], check=False)
        return res.returncode == 0 and self.cluster_name in res.stdout.split()

    # ------------------------------------------------------------------ stop
    def _pids(self) -> dict[str, int]:
        out = {}
        own = self.path("run", "own")  # pid files written here at spawn (the daemons write theirs in run/)
        if not own.is_dir():
            return out
        for f in own.glob("*.pid"):
            try:
                pid = int(f.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            if _alive(pid) and self._is_ours(pid):
                out[f.stem] = pid
        return out

    def _is_ours(self, pid: int) -> bool:
        """Only signal a process whose command line or SLURM_CONF names this cluster's folder (pid reuse guard)."""
        if any(str(self.root) in a for a in _cmdline(pid)):
            return True
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                return f"SLURM_CONF={self.conf}".encode() in f.read().split(b"\0")
        except OSError:
            return False

    def cancel_all_jobs(self, timeout_s: float = 20.0) -> None:
        if not self.conf.exists():
            return
        try:
            res = self._run(["squeue", "-h", "-o", "%i"], check=False, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return
        ids = res.stdout.split() if res.returncode == 0 else []
        if not ids:
            return
        self._run(["scancel", *ids], check=False, timeout=10)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            res = self._run(["squeue", "-h", "-o", "%i %T"], check=False, timeout=10)
            if res.returncode != 0 or not res.stdout.strip():
                return
            time.sleep(0.5)

    def stop(self, timeout_s: float = 15.0) -> None:
        """Cancel this cluster's jobs, then stop exactly the daemons started here (slurmd first, munged last)."""
        try:
            if any(n.startswith("slurmctld") for n in self._pids()):
                self.cancel_all_jobs()
        except Exception:  # noqa: BLE001 - stopping must go on
            pass
        order = [f"slurmd-{n}" for n in self.node_names] + ["slurmctld", "slurmdbd", "mariadb", "munged"]
        pids = self._pids()
        for group in (order[: self.nodes], order[self.nodes:]):
            started = []
            for name in group:
                pid = pids.get(name)
                if pid is None:
                    continue
                try:
                    os.kill(pid, signal.SIGTERM)
                    started.append((name, pid))
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + timeout_s
            for name, pid in started:
                while _alive(pid) and time.monotonic() < deadline:
                    self._reap(pid)
                    time.sleep(0.05)
                if _alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self._reap(pid)
                self.path("run", "own", f"{name}.pid").unlink(missing_ok=True)
        self._daemons.clear()
        if self._own_root and not self.keep_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def _reap(self, pid: int) -> None:
        for d in self._daemons:
            if d.proc is not None and d.proc.pid == pid:
                d.proc.poll()

    def running(self) -> dict[str, int]:
        return self._pids()

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ jobs
    def sbatch(self, script: str | Path, *args: str, sbatch_args: list[str] | tuple = (), env: dict | None = None,
               cwd: str | Path | None = None) -> str:
        """Submit a batch script; returns the job id (as a string, like submitit)."""
        res = self._run(["sbatch", "--parsable", *sbatch_args, str(script), *args], env=self.env(env), cwd=cwd)
        return res.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` of a job as a dict (JobState, NodeList, Restarts, ExitCode, ...); {} if unknown."""
        res = self._run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        if res.returncode != 0 or not res.stdout.strip():
            return {}
        return parse_scontrol_record(res.stdout.splitlines()[0])

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "UNKNOWN")

    def sacct(self, job_id: str, fields: str = "JobID,State,NodeList,ExitCode") -> list[dict[str, str]]:
        res = self._run(["sacct", "-j", str(job_id), "-o", fields, "--parsable2", "--noheader", "-D"], check=False)
        names = fields.split(",")
        return [dict(zip(names, line.split("|"))) for line in res.stdout.splitlines() if line.strip()]

    def wait_sacct(self, job_id: str, state: str, timeout_s: float = 30.0) -> list[dict[str, str]]:
        """Poll sacct until the job's allocation row shows `state` (accounting lags scontrol by a moment)."""
        deadline = time.monotonic() + timeout_s
        rows: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            rows = self.sacct(job_id)
            if any(r["JobID"] == str(job_id) and r["State"].split()[0] == state for r in rows):
                return rows
            time.sleep(0.5)
        raise TimeoutError(f"sacct never showed job {job_id} {state}: {rows}")

    def wait(self, job_id: str, states: set[str] | None = None, timeout_s: float = 60.0, poll_s: float = 0.5) -> str:
        """Poll `scontrol show job` until the job is in one of `states` (default: any terminal state)."""
        states = states or TERMINAL_STATES
        deadline = time.monotonic() + timeout_s
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.state(job_id)
            if state in states:
                return state
            time.sleep(poll_s)
        raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f} s (waiting for {sorted(states)}); "
                           f"{self.job(job_id)}")

    def node_addr(self, node: str) -> str:
        res = self._run(["scontrol", "-o", "show", "node", node])
        return parse_scontrol_record(res.stdout.splitlines()[0]).get("NodeAddr", "")


def _cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.slurm_cluster",
                                description="Start/stop a private local SLURM cluster (several slurmd on this host)")
    sub = p.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("start")
    st.add_argument("--dir", required=True, help="folder for config, state, logs (created)")
    st.add_argument("--nodes", type=int, default=2)
    st.add_argument("--cpus-per-node", type=int, default=2)
    st.add_argument("--gpus-per-node", type=int, default=2, help="fake GPUs (GRES count, no devices)")
    st.add_argument("--no-accounting", action="store_true", help="skip MariaDB + slurmdbd (sacct will not work)")
    sp = sub.add_parser("stop")
    sp.add_argument("--dir", required=True)
    ss = sub.add_parser("status")
    ss.add_argument("--dir", required=True)
    a = p.parse_args(argv)
    root = Path(a.dir)
    if a.cmd == "start":
        root.mkdir(parents=True, exist_ok=True)
        c = LocalSlurmCluster(root, nodes=a.nodes, cpus_per_node=a.cpus_per_node, gpus_per_node=a.gpus_per_node,
                              accounting=not a.no_accounting)
        c.start()
        print(f"# started in {c.startup_s:.1f} s: {', '.join(f'{k}={v}' for k, v in c.running().items())}",
              file=sys.stderr)
        print(f"export SLURM_CONF={c.conf}")
        return 0
    info = json.loads((root / "cluster.json").read_text()) if (root / "cluster.json").exists() else {}
    c = LocalSlurmCluster(root, nodes=len(info.get("nodes", [])) or 2)
    if a.cmd == "stop":
        c.stop()
        print("stopped", file=sys.stderr)
        return 0
    print(json.dumps({"running": c.running(), **info}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
