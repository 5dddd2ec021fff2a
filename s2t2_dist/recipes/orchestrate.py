"""Running the stages one after another, for `s2t2 demo` and `s2t2 reproduce`.

A `Runner` runs a stage (`prepare` excepted: that is a library call) either in this process (1 rank: the stage's
`main(argv)`, no interpreter start-up per run) or as `torchrun --nproc_per_node N launch/<stage>.py ARGV` (N gloo
ranks on a CPU, NCCL on GPUs): exactly the command a user types. A child's output is copied to a log file
(RUN_DIR/../logs/NAME.log) and, unless told otherwise, to this terminal (rank 0's progress bars). A run whose
directory already holds a finished result for the same arguments is reused, so an interrupted demo or reproduction
continues where it stopped; a run with other arguments is started afresh.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from s2t2_dist.api import COMMANDS

#: the repository (or installed package parent) holding launch/ and s2t2_dist/
REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = Path(__file__).resolve().parents[1]
ASSETS = PACKAGE_ROOT / "assets"

#: the file each stage writes when it has finished (relative to its run directory)
RESULT_FILES = {"translate": "result.json", "finetune": "result.json", "evaluate": "eval.json"}
RUN_INFO = "orchestrate.json"


class StageFailed(RuntimeError):
    """A stage run ended with an error; the message names the run, the command and the log file."""


def launch_script(stage: str) -> Path:
    return REPO_ROOT / "launch" / f"{stage}.py"


def quiet_process_env() -> None:
    """For stages run in this process: no per-run "Loading weights" bars, no stage JSON summaries (the demo and
    reproduce print one line per run), DeepSpeed told it is on a CPU instead of warning about it."""
    import torch

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("S2T2_LOG_LEVEL", "WARNING")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def child_env(ranks: int, extra: dict | None = None) -> dict:
    """Environment of a stage subprocess: the package importable without installing, one BLAS thread per rank
    on a CPU shared by the ranks, no tokenizer thread pools inside forked data workers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // max(ranks, 1))))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("S2T2_LOG_LEVEL", "WARNING")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < ranks:
        # NCCL cannot put two ranks on one GPU: more ranks than GPUs run on the CPU with gloo
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["S2T2_DEVICE"] = "cpu"
    if not torch.cuda.is_available() or env.get("CUDA_VISIBLE_DEVICES") == "":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(extra or {})
    return env


def entry(stage: str) -> list[str]:
    """What the interpreter runs for a stage: launch/<stage>.py in a checkout, else the installed package's CLI."""
    script = launch_script(stage)
    return [str(script)] if script.is_file() else ["-m", "s2t2_dist.cli", stage]


def torchrun_command(ranks: int, stage: str, argv: list[str]) -> list[str]:
    target = entry(stage)
    if target[0] == "-m":  # torchrun runs a module with --module
        target = ["--module", *target[1:]]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_port=0",
            "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *target, *argv]


def _tee(proc: subprocess.Popen, log_path: Path, echo) -> None:
    """Copy the child's merged output to the log file and (raw bytes, so progress bars keep working) to `echo`."""
    fd = proc.stdout.fileno()
    with open(log_path, "ab") as log:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            if echo is not None:
                echo.write(chunk)
                echo.flush()


def _config_hashes(argv: list[str]) -> dict:
    """Content hashes of the config files named in argv: a changed file is another run."""
    from s2t2_dist.api import sha256_file

    out = {}
    for flag, val in zip(argv, argv[1:]):
        if flag in ("--config", "-c") and Path(val).is_file():
            out[val] = sha256_file(val)
    return out


def _tail(path: Path, n: int = 60) -> str:
    try:
        lines = path.read_text(errors="replace").replace("\r", "\n").splitlines()
    except OSError:
        return ""
    return "\n".join(line for line in lines[-n:] if line.strip())


@dataclass
class StageRun:
    stage: str
    name: str
    run_dir: Path
    result: dict
    seconds: float
    reused: bool
    command: str
    log: Path | None = None


#: the stage processes running now (every Runner's): what a stop signal to the command is passed on to
LIVE: set = set()


def signal_children(signum: int) -> int:
    """Send ``signum`` to every stage process running now; returns how many."""
    n = 0
    for proc in list(LIVE):
        try:
            proc.send_signal(signum)
            n += 1
        except (ProcessLookupError, OSError):
            pass
    return n


@dataclass
class Runner:
    """Runs stages on `ranks` ranks; in this process when `ranks == 1` and `in_process` (default)."""

    ranks: int = 1
    log_dir: Path = Path("logs")
    in_process: bool = True
    echo: bool = True
    env: dict = field(default_factory=dict)
    timeout_s: float | None = None
    history: list[StageRun] = field(default_factory=list)
    #: the output directory the runs live under (`--out`): a run is identified by its arguments relative to it (and
    #: to the checkout), so a copied or moved output directory reuses its finished runs
    root: Path | None = None

    def _relative(self, args: list[str]) -> list[str]:
        out = [a.replace(str(REPO_ROOT), "$REPO") for a in args]
        if self.root is not None:
            out = [a.replace(str(Path(self.root).resolve()), "$OUT") for a in out]
        return out

    def command(self, stage: str, argv: list[str]) -> list[str]:
        if self.ranks == 1:
            return [sys.executable, *entry(stage), *argv]
        return torchrun_command(self.ranks, stage, argv)

    def run(self, stage: str, argv: list[str], run_dir: str | Path, name: str, result_file: str | Path | None = None,
            inputs: list[str] | None = None) -> StageRun:
        """Run `stage` with `argv` (which must put its outputs under run_dir) and return its result JSON. `inputs`:
        what the files it reads were made by (their paths stay the same when the runs that write them change)."""
        run_dir = Path(run_dir)
        result_path = Path(result_file) if result_file else run_dir / RESULT_FILES[stage]
        identity = {"stage": stage, "argv": self._relative(list(argv)), "ranks": self.ranks,
                    "config_files": _config_hashes(argv)}
        if inputs:
            identity["inputs"] = list(inputs)
        info_path = run_dir / RUN_INFO
        cmd = self.command(stage, argv)
        printable = " ".join(shlex.quote(c) for c in cmd)
        same = moved = False
        if info_path.is_file():
            try:
                info = json.loads(info_path.read_text())
                same, moved = info.get("identity") == identity, info.get("argv") != list(argv)
            except ValueError:
                same = False
        if same and result_path.is_file():
            try:
                result = json.loads(result_path.read_text())
            except ValueError:
                result = {"finished": False}
            if result.get("finished", True):
                secs = float(json.loads(info_path.read_text()).get("seconds") or 0.0)
                run = StageRun(stage, name, run_dir, result, secs, True, printable)
                self.history.append(run)
                return run
        from s2t2_dist.api import atomic_write_json

        # a run interrupted in a copied output directory starts afresh too: its checkpoints name the old paths
        if not same or moved:
            if run_dir.exists():
                shutil.rmtree(run_dir)  # another configuration was here: start afresh
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(info_path, {"identity": identity, "command": printable, "argv": list(argv)})
        # else: the same run was interrupted; the stage resumes from its latest checkpoint in run_dir
        t0 = time.time()
        log = None
        if self.ranks == 1 and self.in_process:
            self._in_process(stage, argv, name, printable)
        else:
            log = self._subprocess(cmd, name, printable)
        if not result_path.is_file():
            raise StageFailed(f"{name}: {stage} finished without writing {result_path}\n  command: {printable}"
                              + (f"\n  log: {log}" if log else ""))
        result = json.loads(result_path.read_text())
        if result.get("finished") is False:
            raise StageFailed(f"{name}: {stage} stopped before its last step (step {result.get('step')}); "
                              f"rerun to resume\n  command: {printable}")
        run = StageRun(stage, name, run_dir, result, time.time() - t0, False, printable, log)
        atomic_write_json(info_path, {"identity": identity, "command": printable, "argv": list(argv),
                                      "seconds": round(run.seconds, 1)})
        self.history.append(run)
        return run

    def _in_process(self, stage: str, argv: list[str], name: str, printable: str) -> None:
        module = importlib.import_module(COMMANDS[stage][0])
        try:
            rc = module.main(list(argv))
        except SystemExit as e:  # argparse / config errors
            rc = e.code
        except Exception as e:
            raise StageFailed(f"{name}: {stage} failed: {type(e).__name__}: {e}\n  command: {printable}") from e
        if rc not in (0, None):
            raise StageFailed(f"{name}: {stage} exited with {rc}\n  command: {printable}")

    def _subprocess(self, cmd: list[str], name: str, printable: str) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        # a rerun (a resume, a retry) appends: the earlier attempt's output is what explains why it was rerun
        again = log.is_file() and log.stat().st_size > 0
        with open(log, "a") as f:
            if again:
                f.write(f"\n--- rerun at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n")
            f.write(f"$ {printable}\n")
        # a session of its own: a terminal's Ctrl-C reaches the command, which passes each signal on once
        # (signal_children), so that one Ctrl-C is never two to a stage (the second stops it at once)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=child_env(self.ranks, self.env), cwd=str(REPO_ROOT), start_new_session=True)
        LIVE.add(proc)
        echo = getattr(sys.stderr, "buffer", None) if self.echo else None
        t = threading.Thread(target=_tee, args=(proc, log, echo), daemon=True)
        t.start()
        try:
            rc = proc.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            rc = "timeout"
        except BaseException:  # Ctrl-C, a stop signal (utils/stop.Stopped): the stage checkpoints and ends too
            proc.terminate()
            proc.wait()
            raise
        finally:
            LIVE.discard(proc)
        t.join(timeout=10)
        if rc != 0:
            raise StageFailed(f"{name}: exited with {rc}\n  command: {printable}\n  log: {log}\n--- last lines ---\n"
                              f"{_tail(log)}")
        return log


# ----------------------------------------------------------------------------------------------------------------
# inputs shipped with the package


def protein_sample() -> list[Path]:
    """The real protein sequences shipped in s2t2_dist/assets/protein (licences and sources there)."""
    names = ("mmseqs2_QUERY_uniprotkb.fasta", "esm_some_proteins_uniref50.fasta")
    paths = [ASSETS / "protein" / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"shipped protein sample missing: {missing} (is the package installed with its data?)")
    return paths


def english_sample() -> Path:
    p = ASSETS / "english" / "tinyshakespeare_head.txt"
    if not p.is_file():
        raise FileNotFoundError(f"shipped English text missing: {p}")
    return p


def prepare_protein(out: Path, *, vocab_size: int, context_len: int, eval_fraction: float = 0.1,
                    source_tokenizer: str | None = None, progress: bool = True, inputs: list[Path] | None = None,
                    split_by: str = "id") -> dict:
    """`prepare` (split, BPE, shards; source-tokenizer shards too when `source_tokenizer` is given) on the shipped
    protein sample. Rerunning with the same settings reuses the finished steps. split_by="text" keeps identical
    sequences (the sample has some under different ids) in one split, so no eval text is also a train text."""
    from s2t2_dist.api import DataConfig
    from s2t2_dist.api import prepare

    cfg = DataConfig(inputs=[str(p) for p in (inputs or protein_sample())], format="fasta", domain="protein",
                     extra_residue_policy="keep", eval_fraction=eval_fraction, seed=0, vocab_size=vocab_size,
                     split_by=split_by,
                     tokenizer_max_records=None, source_tokenizer=source_tokenizer, context_len=context_len,
                     shard_size=256, num_workers=0, output_dir=str(out))
    return prepare(cfg, progress=progress)


def stories260k_cached(out: Path, log=None) -> bool:
    """``out`` holds the conversion of the shipped checkpoint, its files as written (their recorded checksums)."""
    from s2t2_dist.api import ConfigError
    from s2t2_dist.api import RECORD, verify_record
    from s2t2_dist.recipes.llama2c import default_checkpoint
    from s2t2_dist.api import sha256_file

    try:
        if json.loads((out / "llama2c_source.json").read_text())["checkpoint"]["sha256"] != \
                sha256_file(default_checkpoint()) or not (out / "config.json").is_file() or \
                not (out / RECORD).is_file():
            return False
        verify_record(out, str(out))
    except ConfigError as e:  # the cached files are not the ones written: built again (before ValueError: a subclass)
        if log:
            log(f"[stories260k] {e}: building it again")
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def stories260k(cache: Path, log=print) -> Path:
    """The shipped stories260K (llama2.c) converted to a Hugging Face directory, once, under `cache`."""
    from s2t2_dist.api import write_record
    from s2t2_dist.recipes.llama2c import save_hf
    from s2t2_dist.api import atomic_dir, build_lock

    out = Path(cache) / "stories260k"
    if stories260k_cached(out, log):
        return out

    def waiting(pid):
        if log:
            log(f"[stories260k] waiting for the build of {out} in progress (pid {pid})")

    with build_lock(out.with_name("stories260k.lock"), on_wait=waiting):
        if stories260k_cached(out):  # built meanwhile by the one waited for
            return out
        with atomic_dir(out) as tmp:  # complete or absent, whatever fails (a full disk included)
            save_hf(tmp)
            write_record(tmp)
    return out


def english_bytes(cache: Path, log=print, **recipe) -> tuple[Path, dict]:
    """A byte-level English LM pretrained by `models.pretrain_english` on the shipped English text (cached by
    recipe + data hash under `cache`). Returns (HF directory, recipe info incl. its validation loss)."""
    from s2t2_dist.recipes.pretrain_english import EnglishLMConfig, pretrain_english

    data = recipe.pop("data", None) or [str(english_sample())]
    cfg = EnglishLMConfig(data=list(data), **recipe)
    res = pretrain_english(cfg, cache_root=cache, log=log)
    return res.path, res.info


# ----------------------------------------------------------------------------------------------------------------
# reading results back


def tb_scalars(tb_dir: str | Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of a scalar tag in a TensorBoard directory (e.g. RUN_DIR/tb/global); [] if absent."""
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # "No path found after ..." at the end of a file
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [(int(e.step), float(e.value)) for e in acc.Scalars(tag)]


def manifest_bytes_per_token(shard_dir: str | Path) -> float:
    """UTF-8 bytes per token of a shard split (its manifest's totals)."""
    m = json.loads((Path(shard_dir) / "manifest.json").read_text())
    tot = m.get("totals") or {}
    n_tok = tot.get("stream_tokens") or tot.get("n_tokens") or sum(s.get("n_tokens", 0) for s in m.get("shards", []))
    n_bytes = tot.get("text_bytes")
    if not n_tok or not n_bytes:
        raise ValueError(f"{shard_dir}/manifest.json: no token/byte totals")
    return float(n_bytes) / float(n_tok)


def fmt_seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def unigram_reference(train_shards: str | Path, eval_shards: str | Path) -> dict:
    """A model that knows only token frequencies: the train split's unigram distribution (add-one smoothed) over the
    tokens a document can hold (the special tokens, BOS / EOS / pad / unk, which the training blocks carry as
    separators and no scored document holds, are left out), scored on the eval documents exactly as the models are
    (every token after the document's first; BpB over the documents' UTF-8 bytes). The level any LM of that
    tokenizer should beat once it has learned anything beyond frequencies."""
    import numpy as np

    from s2t2_dist.api import EvalDocs, ShardReader
    from s2t2_dist.api import load_manifest

    m = load_manifest(train_shards)
    V = int(m["tokenizer"]["vocab_size"])
    reader = ShardReader(m)
    counts = np.ones(V, dtype=np.float64)
    for index, sample in reader.iter_range(list(range(len(m["shards"]))), 0, int(m["totals"]["n_samples"])):
        ids = reader.decode_ids(index, sample, "?").astype(np.int64)
        counts += np.bincount(ids[ids < V], minlength=V)
    special = [int(i) for k in ("bos_id", "eos_id", "pad_id", "unk_id")
               if (i := m["tokenizer"].get(k)) is not None and 0 <= int(i) < V]
    counts[special] = 0.0
    with np.errstate(divide="ignore"):
        logp = np.log(counts / counts.sum())
    nll, n_bytes, n_tok = 0.0, 0, 0
    for doc in EvalDocs(eval_shards):
        ids = doc["input_ids"][1:].numpy()
        nll -= float(logp[ids].sum())
        n_bytes += int(doc["n_bytes"])
        n_tok += int(ids.size)
    return {"nll_per_token": nll / n_tok, "perplexity": math.exp(nll / n_tok), "bpb": nll / (math.log(2) * n_bytes),
            "vocab_size": V, "tokens": n_tok, "bytes": n_bytes, "special_tokens_left_out": special,
            "random_guess_bpb": math.log(V) * n_tok / (math.log(2) * n_bytes)}
