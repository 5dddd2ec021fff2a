"""The misuse table of docs/reliability.md, made by running every case: a new user's mistakes, each run as the real
`s2t2` command in a fresh process on real files (the shipped protein FASTA, the shipped stories260K model).

    PYTHONPATH=. python tests/helpers/scripts/misuse_table.py [WORKDIR] > /tmp/misuse.md
    PYTHONPATH=. python tests/helpers/scripts/misuse_table.py --write     # regenerate the table in docs/reliability.md

For each case: the message shown (the error line, or the warnings of a run that goes on), the exit code, and what
was kept (files that existed before the command, compared byte for byte afterwards; or that nothing was written).

Cases run through `s2t2_dist.cli.main` -- the function the `s2t2` command calls -- in this process (a fresh
interpreter per case would cost minutes of imports); Ctrl-C runs a fresh `python -m s2t2_dist.cli` process, and the
lock cases run beside a separate live process that holds the locks. What varies
from run to run (the work directory, run ids, pids, host names, times) is replaced by W, RUNID, PID, HOST, TIME,
so the table is the same on every machine: tests/faults/test_misuse_table.py regenerates it and compares.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
FASTA = REPO / "s2t2_dist" / "assets" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "S2T2_DEVICE": "cpu", "DS_ACCELERATOR": "cpu", "S2T2_LOG_LEVEL": "WARNING"}


def s2t2(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env={**ENV, **(env or {})}, timeout=timeout)


class _Captured:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


class _LogCapture(logging.Handler):
    """The s2t2 loggers' warnings of an in-process case (the stages' own basicConfig is then a no-op)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        if record.name.startswith("s2t2"):
            self.lines.append(f"WARNING: {record.getMessage()}")


def s2t2_inproc(*args, env=None):
    """`s2t2 ARGS` through the command's own function in this process: its stdout, stderr and warnings captured."""
    from s2t2_dist.cli import main as cli_main

    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update({k: str(v) for k, v in (env or {}).items()})
    out, err, cap = io.StringIO(), io.StringIO(), _LogCapture()
    root = logging.getLogger()
    root.addHandler(cap)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_main([str(a) for a in args])
            except SystemExit as e:  # argparse
                rc = e.code if isinstance(e.code, int) else 2
            except Exception as e:  # noqa: BLE001 - a bug: shown as the traceback's last line would be
                print(f"Traceback (most recent call last): {type(e).__name__}: {e}", file=sys.stderr)
                rc = 1
    finally:
        root.removeHandler(cap)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return _Captured(rc, out.getvalue(), err.getvalue() + "\n".join(cap.lines))


_VARYING = [(re.compile(r"(?<=run )[0-9a-f]{12}\b"), "RUNID"),
            (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d"), "TIME"),
            (re.compile(r"pid \d+"), "pid PID"), (re.compile(r"on host [^,]+,"), "on host HOST,"),
            (re.compile(r"(?<=tokenizers )\d+\.\d+\.\d+"), "VERSION"),
            (re.compile(r"(?<=transformers )\d+\.\d+\.\d+\S*"), "VERSION")]


def normalise(msg: str, work: Path) -> str:
    msg = msg.replace(str(work), "W").replace(str(REPO), "REPO")
    for rx, sub in _VARYING:
        msg = rx.sub(sub, msg)
    return msg


def snapshot(d: Path) -> dict:
    # the run lock names its current holder and is rewritten by every run that takes it: not an output
    if d.is_file():
        return {d.name: hashlib.sha256(d.read_bytes()).hexdigest()}
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".s2t2.lock"} if d.exists() else {}


def kept(before: dict, d: Path, fresh: bool = False) -> str:
    after = snapshot(d)
    if fresh:
        if not after:
            return "nothing written"
        return f"wrote {', '.join(after)}" if len(after) <= 2 else f"{len(after)} files written"
    changed = [k for k in before if after.get(k) != before[k]]
    new = [k for k in after if k not in before]
    if not changed and not new:
        return f"all {len(before)} files of {d.name}/ unchanged"
    return f"{len(before) - len(changed)} of {len(before)} files unchanged; changed: {changed[:3]}; new: {len(new)}"


def message(proc) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ": error: " in ln or ln.startswith("Traceback")]
    if lines:
        return lines[-1]
    warn = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if "WARNING:" in ln]
    warn = list(dict.fromkeys(w[w.index("WARNING:"):] for w in warn))  # printed and logged: once
    return " / ".join(warn) if warn else "(no error)"


def fasta(path: Path, n: int = 160, edit=None, double=False) -> Path:
    out, recs = [], 0
    for line in FASTA.read_text().splitlines():
        recs += line.startswith(">")
        if recs > n:
            break
        out.append(edit(recs, line) if edit and not line.startswith(">") else line)
    text = "\n".join(out) + "\n"
    path.write_text(text + (text.replace(">", ">copy_") if double else ""))
    return path


def generate(work: Path) -> str:
    """Run every case in the (empty or cached) work directory; returns the markdown table."""
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update({k: ENV[k] for k in ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "S2T2_DEVICE",
                                           "DS_ACCELERATOR")})
    from s2t2_dist.recipes.llama2c import save_hf

    model = save_hf(work / "stories260k")
    prep = ["context_len=64", "shard_size=64", "eval_fraction=0.1", "--no-progress"]
    data = work / "data"
    other = work / "data96"
    base_fa = fasta(work / "sample.fasta")
    for out, v in ((data, 64), (other, 96)):
        if not (out / "prepare_summary.json").exists():
            assert s2t2_inproc("prepare", f"inputs=[{base_fa}]", f"output_dir={out}", f"vocab_size={v}",
                               *prep).returncode == 0
    rows: list[tuple[str, str, str, int, str]] = []

    def case(stage, what, args, watch: Path, fresh=False, env=None, prepare_fn=None, proc=False):
        if prepare_fn:
            prepare_fn()
        if fresh and watch.exists() and watch != work / "submitit":
            shutil.rmtree(watch)
        before = snapshot(watch)
        p = (s2t2 if proc else s2t2_inproc)(stage, *args, env=env)
        rows.append((stage, what, message(p), p.returncode, kept(before, watch, fresh)))
        print(f"{stage}: {what}: rc {p.returncode}", file=sys.stderr, flush=True)
        return p

    # ---------------------------------------------------------------- prepare
    readme = work / "readme.fasta"
    readme.write_text((REPO / "README.md").read_text())
    case("prepare", "a text file (README.md) given as FASTA", [f"inputs=[{readme}]", f"output_dir={work / 'p1'}",
                                                                 *prep], work / "p1", fresh=True)
    digits = fasta(work / "digits.fasta", 40, edit=lambda i, s: s if i > 2 else s[:5] + "123" + s[8:])
    case("prepare", "a residue that is no amino acid (digits), strict default", [f"inputs=[{digits}]",
         f"output_dir={work / 'p2'}", *prep], work / "p2", fresh=True)
    junk = fasta(work / "junk.fasta", 160, edit=lambda i, s: s if i % 5 == 0 else "1" * len(s))
    case("prepare", "80% of the records are not protein, on_bad_record=skip", [f"inputs=[{junk}]",
         f"output_dir={work / 'p3'}", "on_bad_record=skip", "vocab_size=40", *prep], work / "p3", fresh=True)
    allx = fasta(work / "all_x.fasta", 80, edit=lambda i, s: "X" * len(s))
    case("prepare", "every residue X (unknown)", [f"inputs=[{allx}]", f"output_dir={work / 'p4'}", "vocab_size=40",
                                                  *prep], work / "p4", fresh=True)
    lines = fasta(work / "tmp.fasta", 20).read_text().splitlines()
    empty = work / "empty_record.fasta"
    empty.write_text("\n".join(lines[:1] + [ln for ln in lines[1:] if ln.startswith(">")][:1] + lines[1:]) + "\n")
    case("prepare", "a record with a header and no sequence", [f"inputs=[{empty}]", f"output_dir={work / 'p5'}",
                                                               *prep], work / "p5", fresh=True)
    dups = fasta(work / "dups.fasta", 160, double=True)
    case("prepare", "every record twice under another id (eval texts also in train)", [f"inputs=[{dups}]",
         f"output_dir={work / 'p6'}", "vocab_size=40", *prep], work / "p6", fresh=True)
    case("prepare", "vocab_size=50000 on 160 proteins", [f"inputs=[{base_fa}]", f"output_dir={work / 'p7'}",
                                                         "vocab_size=50000", *prep], work / "p7", fresh=True)
    case("prepare", "eval_fraction so small the eval split is empty", [f"inputs=[{base_fa}]",
         f"output_dir={work / 'p8'}", "vocab_size=40", "eval_fraction=0.001", *prep[:2], "--no-progress"],
         work / "p8", fresh=True)
    copy = work / "data_copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(data, copy)
    case("prepare", "re-run into a finished output_dir with vocab_size changed", [f"inputs=[{base_fa}]",
         f"output_dir={copy}", "vocab_size=80", *prep], copy)
    case("prepare", "mistyped key `vocab_szie=100`", [f"inputs=[{base_fa}]", f"output_dir={work / 'p9'}",
                                                      "vocab_szie=100", *prep], work / "p9", fresh=True)

    # ---------------------------------------------------------------- translate
    run = work / "t"
    targs = [f"model.path={model}", "model.source_vocab=all", "train.context_len=64", "train.batch_size=2",
             "train.micro_batch_size=2", "train.log_every=1", "train.ckpt_every=2", "translator.heatmap=[8,8]",
             "train.steps=4", "--config", REPO / "configs" / "translate_olmo1b.yaml"]
    ok = [f"data.train={data}/shards/new/train", f"data.tokenizer={data}/tokenizer", f"data.eval={data}/shards/new/eval"]

    def t(what, *extra, watch=None, fresh=True, env=None, prepare_fn=None):
        return case("translate", what, [*targs, *ok, f"run_dir={run}", *extra], watch or run, fresh=fresh, env=env,
                    prepare_fn=prepare_fn)

    t("shards of the 64-token tokenizer, data.tokenizer the 96-token one", f"data.tokenizer={other}/tokenizer")
    t("shards of the 96-token tokenizer, data.tokenizer the 64-token one", f"data.train={other}/shards/new/train",
      f"data.eval={other}/shards/new/eval")
    t("eval shards of another tokenizer", f"data.eval={other}/shards/new/eval")
    t("train.context_len=4096, longer than the model's 512 positions", "train.context_len=4096")
    t("train.context_len=128, the shards hold 64-token blocks", "train.context_len=128")
    t("model.path does not exist", f"model.path={work / 'no_model'}")
    t("model.path is a directory without config.json", f"model.path={data}/tokenizer")
    t("data.train points at the eval split", f"data.train={data}/shards/new/eval")
    t("train.batch_size=3 with micro_batch_size=2", "train.batch_size=3")
    bad = work / "bad_shards"

    def damage(field):
        def f():
            shutil.rmtree(bad, ignore_errors=True)
            shutil.copytree(data / "shards/new/train", bad)
            m = json.loads((bad / "manifest.json").read_text())
            if field == "count":
                m["totals"]["n_samples"] += 7
                (bad / "manifest.json").write_text(json.dumps(m))
            else:
                name = m["shards"][1]["name"]
                (bad / name).write_bytes((bad / name).read_bytes()[:1000])
        return f

    t("a shard manifest whose sample count disagrees with its shards", f"data.train={bad}",
      prepare_fn=damage("count"))
    t("a truncated train shard", f"data.train={bad}", prepare_fn=damage("truncate"))
    empty_eval = work / "empty_eval"

    def make_empty_eval():
        shutil.rmtree(empty_eval, ignore_errors=True)
        shutil.copytree(data / "shards/new/eval", empty_eval)
        m = json.loads((empty_eval / "manifest.json").read_text())
        for s in m["shards"]:
            (empty_eval / s["name"]).unlink()
        m["shards"], m["totals"] = [], {k: 0 for k in m["totals"]}
        (empty_eval / "manifest.json").write_text(json.dumps(m))

    t("an eval split with no documents", f"data.eval={empty_eval}", "train.eval_every=1", prepare_fn=make_empty_eval)
    import yaml

    y = yaml.safe_load((REPO / "configs" / "translate_olmo1b.yaml").read_text())
    y["slurm"] = {"nodes": 1, "time": "30", "partition": "debug"}
    (work / "with_slurm.yaml").write_text(yaml.safe_dump(y))
    t("the stage YAML carries the documented slurm: section", "--config", work / "with_slurm.yaml",
      fresh=True)
    y["slurm"]["nodez"] = 2
    (work / "bad_slurm.yaml").write_text(yaml.safe_dump(y))
    shutil.rmtree(run, ignore_errors=True)
    s2t2_inproc("translate", *targs, *ok, f"run_dir={run}", "train.stop_after=2")
    t("resume (checkpoint at step 2) with optim.lr changed", "optim.lr=0.5", fresh=False)
    s2t2_inproc("translate", *targs, *ok, f"run_dir={run}")
    res = json.loads((run / "result.json").read_text())["final_loss"]
    t("re-run a finished run", fresh=False)
    again = json.loads((run / "result.json").read_text())["final_loss"]
    rows[-1] = rows[-1][:2] + (f"(no error) final_loss {res:.4f} -> {again:.4f}",) + rows[-1][3:]
    # Ctrl-C: SIGINT to the process group at a step boundary
    from s2t2_dist import faults

    shutil.rmtree(run, ignore_errors=True)
    trace = work / "trace"
    shutil.rmtree(trace, ignore_errors=True)
    proc = subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", "translate", *map(str, targs), *ok,
                             f"run_dir={run}", "train.steps=400", "train.ckpt_every=0"], cwd=REPO,
                            env={**ENV, faults.TRACE_ENV: str(trace)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    while not any(e["ev"] == "step" and e["step"] >= 3 for e in faults.read_trace(trace, 0)):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    r = json.loads((run / "result.json").read_text())
    ck = sorted(p.name for p in (run / "checkpoints").iterdir())
    stopped_at = f"step_{r['step']:08d}"
    rows.append(("translate", "Ctrl-C (SIGINT to the process group) during training",
                 [ln for ln in err.splitlines() if "interrupted" in ln][-1], proc.returncode,
                 # the step it stops at depends on timing: said without the number, so the table is reproducible
                 f"a checkpoint at the step it stopped ({'yes' if ck == [stopped_at] else ck}; "
                 f"preempted: {r['preempted']}); the next launch resumes there"))

    # ---------------------------------------------------------------- evaluate
    ev = work / "ev"
    eargs = [f"run_dir={ev}", f"data.eval={data}/shards/new/eval", "eval.context_len=64"]
    case("evaluate", "model.path does not exist", [*eargs, f"model.path={work / 'no_model'}"], ev, fresh=True)
    case("evaluate", "model directory without config.json", [*eargs, f"model.path={data}/tokenizer"], ev, fresh=True)
    badm = work / "model_other_tokenizer"
    shutil.rmtree(badm, ignore_errors=True)
    shutil.copytree(model, badm)
    shutil.copy(other / "tokenizer" / "tokenizer.json", badm / "tokenizer.json")
    c = json.loads((badm / "config.json").read_text())
    c["vocab_size"] = 64
    (badm / "config.json").write_text(json.dumps(c))
    from safetensors.torch import load_file, save_file  # weights of 64 rows too: config.json agrees

    sd = load_file(str(badm / "model.safetensors"))
    save_file({k: v[:64].clone() if ("embed" in k or "lm_head" in k) and v.dim() == 2 else v for k, v in sd.items()},
              str(badm / "model.safetensors"), metadata={"format": "pt"})
    case("evaluate", "a model whose tokenizer has more tokens (96) than embedding rows (64)",
         [*eargs, f"model.path={badm}"], ev, fresh=True)
    case("evaluate", "an eval split with no documents", [*eargs, f"model.path={model}", f"data.eval={empty_eval}"],
         ev, fresh=True)
    case("evaluate", "new-tokenizer eval shards for the model as it is (init.kind=as_is)",
         [*eargs, f"model.path={model}"], ev, fresh=True)

    # ---------------------------------------------------------------- finetune
    ft = work / "ft"
    fargs = [f"run_dir={ft}", f"model.path={model}", f"data.tokenizer={data}/tokenizer", "train.context_len=64",
             "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2"]
    case("finetune", "init.kind=translated with an init.p_file that does not exist",
         [*fargs, f"data.train={data}/shards/new/train", f"init.p_file={work / 'none.safetensors'}"], ft, fresh=True)
    case("finetune", "new_tok_truncate on shards of another tokenizer",
         [*fargs, f"data.train={other}/shards/new/train", "init.kind=new_tok_truncate"], ft, fresh=True)

    # ---------------------------------------------------------------- submit
    case("submit", "a mistyped stage key (train.stepz) before queueing",
         ["translate", "--config", work / "with_slurm.yaml", "train.stepz=3", "--cluster", "local"],
         work / "submitit", fresh=True)
    case("submit", "a mistyped key in the YAML's slurm: section",
         ["translate", "--config", work / "bad_slurm.yaml", "--cluster", "local"], work / "submitit", fresh=True)

    new_cases(work, case, rows, model, data, other, base_fa, prep, targs, ok)
    round4_cases(work, case, rows, model, data, targs, ok)
    round5_cases(work, case, rows, model, data, targs, ok)
    round6_cases(work, case, targs, ok, data, other)
    out = ["| stage | case | message shown | exit | kept |", "|---|---|---|---:|---|"]
    for stage, what, msg, rc, k in rows:
        msg = normalise(msg, work).replace("|", "\\|").replace("`", "'")
        out.append(f"| {stage} | {what} | `{msg}` | {rc} | {normalise(k, work)} |")
    return "\n".join(out) + "\n"


def _rewrite_p(src: Path, dst: Path, values=None, meta=None) -> Path:
    """A copy of a real P file with its values or metadata changed (safetensors: no code)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        m = dict(f.metadata())
        t = {k: f.get_tensor(k) for k in f.keys()}
    if values is not None:  # the stored values: the non-zeros (csc, coo layouts) or the whole matrix (dense)
        key = "values" if "values" in t else "dense"
        t[key] = values(t[key]).contiguous()
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    save_file(t, str(dst), metadata=m)
    return dst


_HOLDER = ("import sys, time\nfrom s2t2_dist.utils.rundir import claim\n"
           "for a in sys.argv[1:]: claim(*a.split('=', 1)[::-1])\nprint('held', flush=True)\ntime.sleep(600)\n")


def new_cases(work, case, rows, model, data, other, base_fa, prep, targs, ok) -> None:
    """Locks, owners, literal values, checked values, resumes that tell the truth."""
    import torch

    ok_run = [*targs, *ok]
    fr = work / "fresh"  # the run directory of cases refused before any work (nothing may appear in it)

    def t(what, *extra, run=None, fresh=True, proc=False, watch=None):
        r = run or fr
        return case("translate", what, [*ok_run, f"run_dir={r}", *extra], watch or r, fresh=fresh, proc=proc)

    # a finished translate run: its P file is the start of the damaged ones
    tp = work / "tp"
    if not (tp / "P.safetensors").exists():
        assert s2t2_inproc("translate", *ok_run, f"run_dir={tp}", "train.steps=2").returncode == 0
    good_p = tp / "P.safetensors"
    bad = work / "bad_p"
    bad.mkdir(exist_ok=True)
    bad_ps = {
        "NaN values": _rewrite_p(good_p, bad / "nan.safetensors", values=lambda x: x * float("nan")),
        "one inf value": _rewrite_p(good_p, bad / "inf.safetensors",
                                    values=lambda x: x.index_fill(0, torch.tensor([0]), float("inf"))),
        "all zeros": _rewrite_p(good_p, bad / "zero.safetensors", values=lambda x: x * 0),
        "negative values": _rewrite_p(good_p, bad / "neg.safetensors", values=lambda x: -x),
        "values scaled x3 (marginals off)": _rewrite_p(good_p, bad / "x3.safetensors", values=lambda x: x * 3),
        "damaged shape metadata (not JSON)": _rewrite_p(good_p, bad / "shape.safetensors", meta={"shape": "[48, "}),
        "shape metadata missing": _rewrite_p(good_p, bad / "noshape.safetensors", meta={"shape": None}),
        "target tokenizer hash missing": _rewrite_p(good_p, bad / "nohash.safetensors",
                                                    meta={"target_tokenizer_hash": None}),
        "unknown kind in metadata": _rewrite_p(good_p, bad / "kind.safetensors", meta={"kind": "magic"}),
    }
    trunc = bad / "truncated.safetensors"
    trunc.write_bytes(good_p.read_bytes()[:200])
    bad_ps["truncated file"] = trunc
    for what, f in bad_ps.items():
        t(f"translator.init_p: a P file with {what}", f"translator.init_p={f}")

    # ---- values validated where they enter
    for ov, what in (("optim.lr=nan", "optim.lr=nan"), ("optim.lr=inf", "optim.lr=inf (trained to a uniform P)"),
                     ("optim.lr=-1e-3", "a negative optim.lr"), ("train.keep_checkpoints=0",
                     "train.keep_checkpoints=0 (deleted every checkpoint)"),
                     ("train.keep_checkpoints=-1", "train.keep_checkpoints=-1"), ("train.steps=-1", "train.steps=-1 (0 scores the start)"),
                     ("translator.alpha=-2", "translator.alpha=-2"), ("translator.n_iter=0", "translator.n_iter=0"),
                     ("translator.init_weight=2", "translator.init_weight=2"),
                     ("translator.recipe=paper", "translator.recipe=paper (a removed key)"),
                     ("translator.alpha=-1", "translator.alpha=-1 (the old \"recipe's\" sentinel)"),
                     ("optim.lr=0", "optim.lr=0 (the old \"recipe's default\" sentinel)"),
                     ("translator.kind=dense", "translator.kind=dense (no such kind)"),
                     ("train.precision=fp8", "train.precision=fp8"), ("data.num_workers=-1", "data.num_workers=-1"),
                     ("train.micro_batch_size=0", "train.micro_batch_size=0"),
                     ("model.trust_remote_code=maybe", "model.trust_remote_code=maybe"),
                     ("train.steps=ten", "train.steps=ten"), ("train=3", "a whole section given a value (train=3)"),
                     ("train.steps", "an override without '=' (train.steps)"),
                     ("translator.heatmap=[8]", "translator.heatmap with one number"),
                     ("optim.betas=[0.9,1.5]", "optim.betas=[0.9,1.5]")):
        t(what, ov)
    for what, name, text in (("an id beyond the vocabulary", "ids_big", "5\n99999\n"),
                             ("a word in it", "ids_word", "5\nsix\n"), ("nothing in it", "ids_empty", ""),
                             ("an id listed twice", "ids_dup", "5\n7\n5\n")):
        t(f"model.source_vocab: an id file with {what}", "model.source_vocab=" + str(_text(work / name, text)))
    t("model.source_vocab: neither a rule nor a file (single_bytes)", "model.source_vocab=single_bytes")
    t("data.tokenizer does not exist", f"data.tokenizer={work / 'no_tokenizer'}")
    # config files
    cfg_text = (REPO / "configs" / "translate_olmo1b.yaml").read_text()
    t("a YAML key given twice (train.steps)", "--config",
      _text(work / "dup_key.yaml", cfg_text.replace("train:\n", "train:\n  steps: 7\n  steps: 9\n", 1)))
    t("a YAML section given twice (optim:)", "--config",
      _text(work / "dup_section.yaml", cfg_text + "optim:\n  lr: 1\n"))
    t("a config file in Latin-1, not UTF-8", "--config", _bytes(work / "latin1.yaml", b"run_dir: caf\xe9\n"))
    t("a config file with a UTF-8 byte-order mark (accepted)", "--config",
      _bytes(work / "bom.yaml", b"\xef\xbb\xbf" + cfg_text.encode()), "train.steps=2")
    t("a config file that is not valid YAML", "--config", _text(work / "broken.yaml", "train: [1, 2\n"))
    t("a config file that does not exist", "--config", work / "no_such.yaml")
    t("a config file whose top level is a list", "--config", _text(work / "list.yaml", "- a\n- b\n"))
    # literal command-line strings
    for name in ("exp #2", "0010", "2024_01_05", "0x1F"):
        d = work / "lit" / name
        t(f"run_dir=.../{name} on the command line (a string, taken literally)", "train.steps=2", run=d)
        rows[-1] = rows[-1][:4] + (f"wrote {len(snapshot(d))} files into lit/{name}/ "
                                   f"({'the directory named as typed' if d.is_dir() else 'NOT the directory typed'})",)

    # ---- one run per directory, every output checked before work
    held = [work / "held_t", work / "held_p"]
    for d in held:
        shutil.rmtree(d, ignore_errors=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, f"translate={held[0]}", f"prepare={held[1]}"],
                              stdout=subprocess.PIPE,
                              text=True, env=ENV, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        t("a second run on a run_dir a live run holds", run=held[0], fresh=False)
        case("prepare", "a second prepare into an output_dir a live run holds",
             [f"inputs=[{base_fa}]", f"output_dir={held[1]}", "vocab_size=40", *prep], held[1])
        case("evaluate", "evaluate on a run_dir a live translate run holds",
             [f"run_dir={held[0]}", f"data.eval={data}/shards/new/eval", "eval.context_len=64",
              f"model.path={model}", "init.kind=as_is"], held[0])
    finally:
        holder.kill()
        holder.wait()
    t("the same run_dir after its holder was killed (SIGKILL: the OS dropped the lock)", "train.steps=2",
      run=held[0], fresh=False)
    t("run_dir set to a prepare output_dir", run=data, fresh=False)
    t("run_dir is a file", run=base_fa, fresh=False)
    link_run = work / "linked"
    shutil.rmtree(link_run, ignore_errors=True)
    link_run.mkdir()
    (link_run / "result.json").symlink_to(work / "data" / "prepare_summary.json")
    t("a file in run_dir is a symbolic link out of it (result.json -> another run's file)", run=link_run,
      fresh=False)
    ev_args = [f"data.eval={data}/shards/new/eval", "eval.context_len=64", f"model.path={model}", "init.kind=as_is"]
    case("evaluate", "run_dir set to a translate run's directory", [f"run_dir={tp}", *ev_args], tp)
    case("evaluate", "run_dir set to a prepare output_dir", [f"run_dir={data}", *ev_args], data)
    case("prepare", "output_dir set to a translate run's directory",
         [f"inputs=[{base_fa}]", f"output_dir={tp}", "vocab_size=40", *prep], tp)
    case("prepare", "the same input listed twice", [f"inputs=[{base_fa},{base_fa}]", f"output_dir={work / 'pp1'}",
                                                    "vocab_size=40", *prep], work / "pp1", fresh=True)
    link_fa = work / "sample_link.fasta"
    if not link_fa.is_symlink():
        link_fa.symlink_to(base_fa)
    case("prepare", "an input listed by its path and by a symbolic link", [f"inputs=[{base_fa},{link_fa}]",
         f"output_dir={work / 'pp2'}", "vocab_size=40", *prep], work / "pp2", fresh=True)
    copy_fa = work / "sample_copy.fasta"
    shutil.copy(base_fa, copy_fa)
    case("prepare", "two files of the same content", [f"inputs=[{base_fa},{copy_fa}]", f"output_dir={work / 'pp3'}",
                                                       "vocab_size=40", *prep], work / "pp3", fresh=True)
    case("prepare", "output_dir is a file", [f"inputs=[{base_fa}]", f"output_dir={base_fa}", "vocab_size=40", *prep],
         work / "pp4", fresh=True)
    bom = work / "bom.fasta"
    bom.write_bytes(b"\xef\xbb\xbf" + base_fa.read_bytes())
    case("prepare", "a FASTA with a UTF-8 byte-order mark (read as without)", [f"inputs=[{bom}]",
         f"output_dir={work / 'pp5'}", "vocab_size=40", *prep], work / "pp5", fresh=True)
    cr = work / "cr.fasta"
    cr.write_bytes(base_fa.read_bytes().replace(b"\n", b"\r"))
    case("prepare", "a FASTA with CR-only line endings (old Mac)", [f"inputs=[{cr}]", f"output_dir={work / 'pp6'}",
                                                                   "vocab_size=40", *prep], work / "pp6", fresh=True)
    case("prepare", "an input that does not exist", [f"inputs=[{work / 'none.fasta'}]", f"output_dir={work / 'pp7'}",
                                                     *prep], work / "pp7", fresh=True)
    case("prepare", "vocab_size=5", [f"inputs=[{base_fa}]", f"output_dir={work / 'pp8'}", "vocab_size=5", *prep],
         work / "pp8", fresh=True)
    case("prepare", "shard_size=0", [f"inputs=[{base_fa}]", f"output_dir={work / 'pp9'}", "shard_size=0",
                                     "context_len=64", "--no-progress"], work / "pp9", fresh=True)
    case("prepare", "format=xml (no such format)", [f"inputs=[{base_fa}]", f"output_dir={work / 'pp10'}",
                                                    "format=xml", *prep], work / "pp10", fresh=True)
    case("prepare", "a prepare config in Latin-1", ["--config", work / "latin1.yaml", f"inputs=[{base_fa}]"],
         work / "pp11", fresh=True)

    # ---- resume tells the truth
    rr = work / "resume"
    shutil.rmtree(rr, ignore_errors=True)
    assert s2t2_inproc("translate", *ok_run, f"run_dir={rr}", "train.steps=4", "train.stop_after=2").returncode == 0
    t("resume with train.steps changed (4 -> 8: another lr schedule)", "train.steps=8", run=rr, fresh=False)
    t("resume with train.batch_size changed", "train.steps=4", "train.batch_size=4", run=rr, fresh=False)
    t("resume with translator.kind changed", "train.steps=4", "translator.kind=softmax", run=rr, fresh=False)
    t("resume with optim.warmup_frac changed", "train.steps=4", "optim.warmup_frac=0.5", run=rr, fresh=False)
    newest = sorted((rr / "checkpoints").glob("step_*"))[-1]
    eng = sorted(newest.glob("engine*"))[0]
    eng.write_bytes(eng.read_bytes()[:64])
    p = t("resume when the only checkpoint is damaged (truncated engine file)", "train.steps=4", run=rr, fresh=False)
    rows[-1] = rows[-1][:2] + (" / ".join(ln.split("s2t2.checkpoint: ")[-1] for ln in p.stderr.splitlines()
                                          if "checkpoint" in ln and ("damaged" in ln or "every" in ln)),) \
        + rows[-1][3:]

    # ---- evaluate
    ev = work / "ev22"
    empty = _text(work / "empty.fasta", "")
    for what, files in (("one empty file", [empty]), ("a FASTA with a byte-order mark", [bom]),
                        ("a FASTA with CR-only line endings", [cr]), ("a file that does not exist",
                                                                      [work / "nope.fasta"])):
        case("evaluate", f"data.files: {what}", [f"run_dir={ev}", f"model.path={model}", "init.kind=as_is",
             "eval.context_len=64", f"data.files=[{','.join(map(str, files))}]"], ev, fresh=True)
    case("evaluate", "both data.eval and data.files", [f"run_dir={ev}", *ev_args, f"data.files=[{bom}]"], ev,
         fresh=True)
    case("evaluate", "eval.context_len=4096", [f"run_dir={ev}", *ev_args, "eval.context_len=4096"], ev, fresh=True)
    for what in ("NaN values", "all zeros", "damaged shape metadata (not JSON)"):
        case("evaluate", f"init.kind=translated with a P file of {what}",
             [f"run_dir={ev}", f"data.eval={data}/shards/new/eval", "eval.context_len=64", f"model.path={model}",
              "init.kind=translated", f"init.p_file={bad_ps[what]}", f"data.tokenizer={data}/tokenizer"], ev,
             fresh=True)

    # ---- finetune
    ft_args = [f"model.path={model}", f"data.tokenizer={data}/tokenizer", f"data.train={data}/shards/new/train",
               "train.context_len=64", "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2",
               "engine.kind=plain", "init.kind=translated", f"init.p_file={good_p}"]
    fa, fb = work / "ft_a", work / "ft_b"
    if not (fa / "final").exists():
        assert s2t2_inproc("finetune", f"run_dir={fa}", *ft_args).returncode == 0
    case("finetune", "export.dir set to another finetune run's export", [f"run_dir={fb}", *ft_args,
         f"export.dir={fa / 'final'}"], fa)
    case("finetune", "run_dir set to a translate run's directory", [f"run_dir={tp}", *ft_args], tp)
    for what in ("NaN values", "all zeros", "target tokenizer hash missing"):
        case("finetune", f"init.p_file: a P file with {what}",
             [f"run_dir={fb}", *ft_args[:-1], f"init.p_file={bad_ps[what]}"], fb, fresh=True)
    for ov in ("optim.lr=nan", "train.keep_checkpoints=0", "export.dtype=fp8"):
        case("finetune", ov, [f"run_dir={fb}", *ft_args, ov], fb, fresh=True)
    case("finetune", "re-run of a finished run (its own export replaced by the same weights)",
         [f"run_dir={fa}", *ft_args], fa / "final")
    case("finetune", "resume a finished run with train.steps changed (2 -> 5)", [f"run_dir={fa}", *ft_args,
         "train.steps=5"], fa)
    case("submit", "a YAML key given twice, before queueing",
         ["translate", "--config", work / "dup_key.yaml", "--cluster", "local"], work / "submitit", fresh=True)


def _live(rows, stage, what, args, watch: Path, ready, act, env=None, shown=None):
    """A case that needs the command running: start `s2t2 STAGE ARGS` as a process, wait for `ready()`, `act(proc)`,
    let it end. `shown`: the words of its non-error line to show (a clean stop is not an error)."""
    before = snapshot(watch) if watch.exists() else {}
    proc = subprocess.Popen([sys.executable, "-m", "s2t2_dist.cli", stage, *map(str, args)], cwd=REPO, text=True,
                            env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    act(proc)
    out, err = proc.communicate(timeout=600)
    p = _Captured(proc.returncode, out, err)
    msg = message(p)
    if shown:
        msg = [ln for ln in err.splitlines() if shown in ln][-1]
    rows.append((stage, what, msg, proc.returncode, kept(before, watch, fresh=not before)))
    print(f"{stage}: {what}: rc {proc.returncode}", file=sys.stderr, flush=True)


def _slurm_requeue(rows, what, env):
    """slurm/common.sh's requeue decision after a step stopped cleanly for the time limit, with a fake scontrol."""
    fake = Path(tempfile.mkdtemp(prefix="s2t2_fake_scontrol_"))
    (fake / "scontrol").write_text('#!/bin/sh\necho "scontrol $*" >&2\n')
    (fake / "scontrol").chmod(0o755)
    base = {k: v for k, v in ENV.items() if not k.startswith("SLURM_")}
    p = subprocess.run(["bash", "-c", ". slurm/common.sh; s2t2_requeue"], cwd=REPO, capture_output=True, text=True,
                       env={**base, "PATH": f"{fake}:{os.environ['PATH']}", "S2T2_HOME": str(REPO),
                            "S2T2_PYTHON": sys.executable, "SLURM_JOB_ID": "7", **env})
    shutil.rmtree(fake)
    said = [re.sub(r"^\[s2t2 [^]]*\] ", "", ln) for ln in p.stderr.splitlines()]
    rows.append(("slurm", what, " / ".join(said), p.returncode,
                 "requeued" if any(ln.startswith("scontrol requeue") for ln in said) else "not requeued"))


def round4_cases(work, case, rows, model, data, targs, ok) -> None:
    """Environment variables, models that load wrong, signals outside the loop, the run directory
    watched. Each of these was silent or a raw traceback before."""
    from s2t2_dist import faults

    ev = work / "ev35"
    missing = work / "none.fasta"
    # ---- environment variables: checked before any work, one line naming the variable (real processes: a
    # variable is read at start-up)
    for var, val, what in (
            ("S2T2_LOG_LEVEL", "debug", "S2T2_LOG_LEVEL=debug (lower case: accepted; the run goes on to its next check)"),
            ("S2T2_LOG_LEVEL", "loud", "S2T2_LOG_LEVEL=loud"),
            ("S2T2_TRACEBACK", "0", "S2T2_TRACEBACK=0 (off: the user error stays one line)"),
            ("S2T2_TRACEBACK", "maybe", "S2T2_TRACEBACK=maybe"),
            ("S2T2_MASTER_PORT", "99999", "S2T2_MASTER_PORT=99999"),
            ("S2T2_DIST_BACKEND", "nccl", "S2T2_DIST_BACKEND=nccl on a machine without CUDA"),
            ("S2T2_DEVICE", "gpu", "S2T2_DEVICE=gpu (no such choice)"),
            ("S2T2_TRACEBAK", "1", "S2T2_TRACEBAK=1 (a misspelt variable)"),
            ("S2T2_FAULT", "kill_at:3", "S2T2_FAULT=kill_at:3 (no such fault)")):
        # logging and tracebacks are set up once per process: those two run as fresh processes
        case("prepare", what, [f"inputs=[{missing}]", f"output_dir={work / 'penv'}", "--no-progress"],
             work / "penv", fresh=True, env={var: val}, proc=var in ("S2T2_LOG_LEVEL", "S2T2_TRACEBACK"))
    cache_file = _text(work / "cache_is_a_file", "x")
    case("evaluate", "S2T2_CACHE_DIR pointing at a file", [f"run_dir={ev}", f"model.path={model}",
         "init.kind=as_is", "eval.context_len=64", f"data.files=[{work / 'sample.fasta'}]"], ev, fresh=True,
         env={"S2T2_CACHE_DIR": str(cache_file)})
    for env, what in (({"S2T2_REQUEUE": "no"}, "S2T2_REQUEUE=no after a clean stop for the time limit"),
                      ({"S2T2_REQUEUE": "false"}, "S2T2_REQUEUE=false after a clean stop"),
                      ({"S2T2_MAX_RESTARTS": "abc", "SLURM_RESTART_COUNT": "60"},
                       "S2T2_MAX_RESTARTS=abc, restarted 60 times"),
                      ({"S2T2_MAX_RESTARTS": "10.5", "SLURM_RESTART_COUNT": "60"},
                       "S2T2_MAX_RESTARTS=10.5, restarted 60 times")):
        _slurm_requeue(rows, what, env)

    # ---- a model that would load wrong
    def model_without(what, drop=(), set_=None, tensor=None):
        d = work / f"model_{what}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(model, d)
        c = json.loads((d / "config.json").read_text())
        for k in drop:
            c.pop(k)
        c.update(set_ or {})
        (d / "config.json").write_text(json.dumps(c))
        if tensor:
            from safetensors.torch import load_file, save_file

            sd = load_file(str(d / "model.safetensors"))
            del sd[tensor]
            save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
        return d

    for what, kw in (("config.json without num_hidden_layers (was: 32 layers, 27 of them random; exit 0)",
                      {"drop": ["num_hidden_layers"]}),
                     ("config.json without vocab_size", {"drop": ["vocab_size"]}),
                     ("config.json without rms_norm_eps (was: 1e-6 instead of the model's 1e-5, silently)",
                      {"drop": ["rms_norm_eps"]}),
                     ("config.json saying 3 layers beside weights of 5", {"set_": {"num_hidden_layers": 3}}),
                     ("weights missing a tensor (model.norm.weight)", {"tensor": "model.norm.weight"})):
        d = model_without(what.split(" (")[0].replace(" ", "_").replace(".", "_"), **kw)
        case("evaluate", f"model.path: {what}", [f"run_dir={ev}", f"model.path={d}", "init.kind=as_is",
             "eval.context_len=64", f"data.files=[{work / 'sample.fasta'}]", f"data.cache_dir={work / 'cache35'}"],
             ev, fresh=True)

    ok_run = [*targs, *ok]
    # ---- inputs written by other tools
    tok2 = work / "tokenizer_v2"
    tok2.mkdir(exist_ok=True)
    tj = json.loads((data / "tokenizer" / "tokenizer.json").read_text())
    (tok2 / "tokenizer.json").write_text(json.dumps({**tj, "version": "2.0"}))
    case("translate", "data.tokenizer: a tokenizer.json of another format version", [*ok_run,
         f"run_dir={work / 'fresh4'}", f"data.tokenizer={tok2}"], work / "fresh4", fresh=True)

    # ---- signals outside the training loop, on real processes
    run = work / "sig"
    shutil.rmtree(run, ignore_errors=True)
    _live(rows, "translate", "SIGUSR1 (time-limit warning) while the model loads, before the first step",
          [*ok_run, f"run_dir={run}"], run, lambda: (run / ".s2t2.lock").exists(),
          lambda proc: proc.send_signal(signal.SIGUSR1), shown="stopped by")
    # (whether the marker was written before the signal depends on timing: said as what matters)
    rows[-1] = rows[-1][:4] + ("no checkpoint, no result" if not (run / "checkpoints").exists()
                               and not (run / "result.json").exists() else "WROTE ON",)
    for sig in ("sigusr1", "sigterm"):
        shutil.rmtree(run, ignore_errors=True)
        _live(rows, "translate", f"{sig.upper()} while the final export is written", [*ok_run, f"run_dir={run}"], run,
              lambda: True, lambda proc: None, env={faults.ENV: f"{sig}_in_export:4"}, shown="arrived during")
    shutil.rmtree(run, ignore_errors=True)
    _live(rows, "translate", "Ctrl-C while the final export is written", [*ok_run, f"run_dir={run}"], run,
          lambda: True, lambda proc: None, env={faults.ENV: "sigint_in_export:4"}, shown="interrupted")
    rows[-1] = rows[-1][:4] + (f"P.safetensors {'not ' if not (run / 'P.safetensors').exists() else ''}written "
                               "(the export is atomic); the next launch exports it",)

    # ---- the run directory watched: lock and owner marker re-checked at each checkpoint
    long = [*ok_run, "train.steps=60", "train.ckpt_every=2"]
    for what, act in (("the run's lock file deleted while it runs", lambda r: (r / ".s2t2.lock").unlink()),
                      ("the run directory removed while it runs", remove_at_once),
                      ("the owner marker replaced by another run's while it runs",
                       lambda r: _replace_marker(r, {"stage": "translate", "run_id": "0123456789ab",
                                                     "created": "TIME"}))):
        shutil.rmtree(run, ignore_errors=True)
        _live(rows, "translate", what, [*long, f"run_dir={run}"], run,
              lambda: (run / "checkpoints" / "step_00000002").is_dir(), lambda proc, a=act: a(run))
        rows[-1] = rows[-1][:4] + ("stopped before its next write" if rows[-1][3] == 2 else rows[-1][4],)


def _replace_marker(run: Path, marker: dict) -> None:
    """Another run's marker, written as a run writes one (whole, then renamed over): a plain write_text lets the
    watched run read a half-written file, and the row would depend on timing."""
    tmp = run / ".s2t2_run.json.tmp"
    tmp.write_text(json.dumps(marker))
    os.replace(tmp, run / ".s2t2_run.json")


def round5_cases(work, case, rows, model, data, targs, ok) -> None:
    """Round five: damaged weights never give a score, a tokenizer of another model, `s2t2 source-lm` and `s2t2
    config` inside the one-line contract, numbers checked against their consumer's range, the environment checker's
    gaps, paths of the wrong kind. Each was a traceback, a silent change of meaning or a NaN score before."""
    import struct

    ev = work / "ev_r5"
    ev_args = [f"run_dir={ev}", "init.kind=as_is", "eval.context_len=64", f"data.files=[{work / 'sample.fasta'}]",
               f"data.cache_dir={work / 'cache_r5'}"]

    def damaged(name, edit):
        d = work / f"model_r5_{name}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(model, d)
        edit(d)
        return d

    def header_garbage(d):
        w = d / "model.safetensors"
        w.write_bytes(struct.pack("<Q", 7 * 10**18) + w.read_bytes()[8:])

    def truncate(d):
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])

    def fifo(d):
        (d / "model.safetensors").unlink()
        os.mkfifo(d / "model.safetensors")

    def model_type(d):
        c = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**c, "model_type": "llama9000"}))

    def nan_weights(d):
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "model.safetensors"))
        sd["model.embed_tokens.weight"].fill_(float("nan"))
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})

    def tokenizer64(d):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        Tokenizer(WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0")).save(str(d / "tokenizer.json"))

    for what, name, edit in (
            ("model.safetensors with garbage in its first 8 bytes (was: MemoryError, a read of 7e18 bytes)",
             "garbage", header_garbage),
            ("model.safetensors cut to half its size (was: a raw SafetensorError)", "truncated", truncate),
            ("model.safetensors is a FIFO (was: transformers' traceback)", "fifo", fifo),
            ("config.json with an unknown model_type", "model_type", model_type),
            ("weights that parse but hold NaN (was: exit 0, perplexity nan in eval.json)", "nan", nan_weights),
            ("a 64-token tokenizer.json beside 512 embedding rows (was: exit 0, perplexity 6.7e10)", "tok64",
             tokenizer64)):
        case("evaluate", f"model.path: {what}", [*ev_args, f"model.path={damaged(name, edit)}"], ev, fresh=True)

    # ---- the source-model cache: built by s2t2 source-lm, its checksums recorded and compared
    src = work / "src_r5"
    shutil.rmtree(src, ignore_errors=True)
    assert s2t2_inproc("source-lm", "stories260k", "--cache", src).returncode == 0
    built = src / "stories260k"
    good = (built / "model.safetensors").read_bytes()
    mid = work / "model_r5_4k"
    shutil.rmtree(mid, ignore_errors=True)
    shutil.copytree(built, mid)
    data4k = bytearray(good)
    data4k[len(good) // 2: len(good) // 2 + 4096] = bytes(range(256)) * 16
    (mid / "model.safetensors").write_bytes(bytes(data4k))
    case("evaluate", "model.path: an s2t2-written model with 4 KiB overwritten in the middle of its weights (was: "
         "exit 0, a score)", [*ev_args, f"model.path={mid}"], ev, fresh=True)
    for what, data_ in (("its weights cut in half", good[: len(good) // 2]),
                        ("1000 bytes in place of its weights", bytes(range(250)) * 4)):
        (built / "model.safetensors").write_bytes(data_)
        p = case("source-lm", f"the cached model with {what} (was: handed out, exit 0)",
                 ["stories260k", "--cache", src], built)
        said = [ln for ln in p.stderr.splitlines() if "building it again" in ln]
        same = (built / "model.safetensors").read_bytes() == good
        rows[-1] = rows[-1][:2] + ((said or ["(nothing said)"])[-1],) + rows[-1][3:4] + \
            (f"rebuilt: weights {'identical to the first build' if same else 'NOT as built'}",)
    cache_file = work / "cache_is_a_file"
    case("source-lm", "--cache pointing at a file", ["stories260k", "--cache", cache_file], cache_file)
    case("source-lm", "S2T2_CACHE_DIR pointing at a file", ["stories260k"], cache_file,
         env={"S2T2_CACHE_DIR": str(cache_file)})

    # ---- numbers against their consumer's range; paths of the wrong kind
    fr = work / "fresh_r5"
    pdir = work / "p_is_a_dir"
    pdir.mkdir(exist_ok=True)
    shards_n = json.loads((data / "shards/new/train/manifest.json").read_text())["totals"]["n_samples"]
    big = 2 * (shards_n // 2 + 1)
    for what, extra in (("optim.lr=1e308 (was: C infinite after step 1, IndexError at step 2)", ["optim.lr=1e308"]),
                        ("optim.grad_clip=-1 (was: silently no clipping)", ["optim.grad_clip=-1"]),
                        ("train.seed=-1", ["train.seed=-1"]),
                        ("train.ckpt_every=-5", ["train.ckpt_every=-5"]),
                        ("data.shuffle_window=0 (was: refused after the model load)", ["data.shuffle_window=0"]),
                        (f"train.batch_size={big}, more than the {shards_n} training blocks (was: refused after the "
                         "model load)", [f"train.batch_size={big}", f"train.micro_batch_size={big}"]),
                        ("translator.init_p is a directory (was: \"does not exist\")", [f"translator.init_p={pdir}"]),
                        ("translator.init_p is /dev/null (a device)", ["translator.init_p=/dev/null"]),
                        ("run_dir is /dev/null (a device)", [])):
        r = Path("/dev/null") if "run_dir" in what else fr
        case("translate", what, [*targs, *ok, f"run_dir={r}", *extra], fr, fresh=True)
    # a finetune run resumed with another P file: the refusal names the key
    good_p = work / "tp" / "P.safetensors"
    other_p = work / "P_copy_r5.safetensors"
    shutil.copy(good_p, other_p)
    fa = work / "ft_a"
    ft_args = [f"model.path={model}", f"data.tokenizer={data}/tokenizer", f"data.train={data}/shards/new/train",
               "train.context_len=64", "train.steps=2", "train.batch_size=2", "train.micro_batch_size=2",
               "engine.kind=plain", "init.kind=translated"]
    case("finetune", "resume with another init.p_file (was: two hashes, the key unnamed)",
         [f"run_dir={fa}", *ft_args, f"init.p_file={other_p}"], fa)

    # ---- s2t2 config: the stages' contract
    cfg = REPO / "configs" / "translate_olmo1b.yaml"
    p = case("config", "translate translator.kind=Sparse (was: a traceback)", ["translate", "--config", cfg,
             "translator.kind=Sparse"], work / "none_r5", fresh=True)
    rows[-1] = rows[-1][:2] + (p.stderr.strip().splitlines()[-1],) + rows[-1][3:]
    case("config", "translate with S2T2_MASTER_PORT=99999 (was: not checked)", ["translate"], work / "none_r5",
         fresh=True, env={"S2T2_MASTER_PORT": "99999"})
    y = yaml_text = (work / "with_slurm.yaml").read_text().replace("nodes: 1", "nodes: 0")
    assert yaml_text != (work / "with_slurm.yaml").read_text()
    case("submit", "slurm: nodes: 0 in the YAML (was: no value in the message)",
         ["translate", "--config", _text(work / "nodes0.yaml", y), "--cluster", "local"], work / "submitit",
         fresh=True)

    # ---- the environment checker
    missing = work / "none.fasta"
    for var, val, what in (("S2T2_DIST_BACKEND", "mpi", "S2T2_DIST_BACKEND=mpi, this torch built without MPI (was: "
                                                         "both ranks' tracebacks)"),
                           ("S2T2_LOG_LEVEL", "\u00b2", "S2T2_LOG_LEVEL=\u00b2 (a superscript digit; was: the "
                                                         "checker's own ValueError)"),
                           ("S2T2_CACHE_DIR", "~no_such_user_s2t2/cache", "S2T2_CACHE_DIR=~no_such_user_s2t2/cache "
                                                                          "(was: the checker's own RuntimeError)"),
                           ("S2T2_PRODUCT_KERNEL", "live", "S2T2_PRODUCT_KERNEL=live (removed; was: ignored "
                                                          "without a word)"),
                           ("S2T2_NATIVE", "0", "S2T2_NATIVE=0 (removed)")):
        p = case("prepare", what, [f"inputs=[{missing}]", f"output_dir={work / 'penv_r5'}", "--no-progress"],
                 work / "penv_r5", fresh=True, env={var: val}, proc=var == "S2T2_LOG_LEVEL")
        warned = [ln[ln.index("WARNING:"):] for ln in p.stderr.splitlines() if "WARNING:" in ln and var in ln]
        if warned:  # the warning, then the run's next check (the missing input)
            rows[-1] = rows[-1][:2] + (" / ".join([*dict.fromkeys(warned), rows[-1][2]]),) + rows[-1][3:]


def round6_cases(work, case, targs, ok, data, other) -> None:
    """Round six: `s2t2 reproduce` validates every option before any work, refuses an output of another scale and a
    second run on one output directory; a run lock path that is a directory. Each was a traceback (some after
    minutes of work), an option ignored without a word, or two runs marking each other's arms failed."""
    fr = work / "rp_fresh"
    a_file = _text(work / "rp_is_a_file", "not a directory\n")
    missing = work / "rp_no_such_dir"
    rp = ("reproduce", "--quiet")
    for what, args, watch in (
            ("--ranks 0 (was: torchrun's AssertionError after 22 s)", ["--ranks", "0", "--no-progress"], fr),
            ("--out is a file (was: FileExistsError)", ["--out", a_file], a_file),
            ("--cache is a file (was: an error after the pretraining)", ["--cache", a_file, "--out", fr], a_file),
            ("--scale smollm2 lm.model= a missing directory (was: a ConfigError traceback after the data)",
             ["--scale", "smollm2", "--out", fr, f"lm.model={missing}"], fr),
            ("--scale smollm2 --record a missing directory (was: ignored)",
             ["--scale", "smollm2", "--out", fr, "--record", missing], fr),
            ("--phase report on the tiny scale (was: ignored)", ["--phase", "report", "--out", fr], fr),
            ("--record on the tiny scale (was: ignored)", ["--record", work, "--out", fr], fr)):
        case(rp[0], what, [*rp[1:], *args], watch, fresh=watch == fr)
    tiny_out = work / "rp_tiny_out"
    shutil.rmtree(tiny_out, ignore_errors=True)
    tiny_out.mkdir()
    _text(tiny_out / "reproduce_config.yaml", "scale: tiny\n")
    _text(tiny_out / "table1.md", "| the tiny table |\n")
    case(rp[0], "--scale smollm2 --phase report --out a tiny scale's output (was: its table replaced, exit 0)",
         [*rp[1:], "--scale", "smollm2", "--phase", "report", "--out", tiny_out], tiny_out)
    held = work / "rp_held"
    shutil.rmtree(held, ignore_errors=True)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, f"reproduce={held}"], stdout=subprocess.PIPE,
                              text=True, env=ENV, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        case(rp[0], "a second reproduction on an --out a live one holds (was: each marked the other's arms failed)",
             [*rp[1:], "--out", held], held)
    finally:
        holder.kill()
        holder.wait()
    lock_dir = work / "rp_lockdir_run"
    shutil.rmtree(lock_dir, ignore_errors=True)
    (lock_dir / ".s2t2.lock").mkdir(parents=True)
    case("translate", "a run_dir whose lock path .s2t2.lock is a directory (was: IsADirectoryError)",
         [*targs, *ok, f"run_dir={lock_dir}"], lock_dir)
    # the 96-token tokenizer's shards, their manifests rewritten to name the 64-token tokenizer
    relabelled = work / "rp_relabelled"
    shutil.rmtree(relabelled, ignore_errors=True)
    shutil.copytree(other / "shards" / "new", relabelled)
    tok64 = json.loads((data / "shards" / "new" / "train" / "manifest.json").read_text())["tokenizer"]
    for split in ("train", "eval"):
        mp = relabelled / split / "manifest.json"
        m = json.loads(mp.read_text())
        mp.write_text(json.dumps({**m, "tokenizer": tok64}))
    fr6 = work / "rp_fresh_t"
    case("translate", "shards of the 96-token tokenizer whose manifests name the 64-token one (was: a ValueError "
         "traceback at the first loss)", [*targs, f"data.train={relabelled}/train", f"data.eval={relabelled}/eval",
                                         f"data.tokenizer={data}/tokenizer", f"run_dir={fr6}"], fr6, fresh=True)
    # one embedding row NaN, the last (byte tokens come first in stories260K's vocabulary: a row no source reads)
    model = Path(next(str(a) for a in targs if str(a).startswith("model.path=")).split("=", 1)[1])
    nan_row = work / "model_r6_nan_row"
    shutil.rmtree(nan_row, ignore_errors=True)
    shutil.copytree(model, nan_row)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(nan_row / "model.safetensors"))
    sd["model.embed_tokens.weight"][-1] = float("nan")
    save_file(sd, str(nan_row / "model.safetensors"), metadata={"format": "pt"})
    fr7 = work / "rp_fresh_nan_row"
    case("translate", "model.path: one embedding row NaN, a row no source token reads (was: ran without a word)",
         [*(a for a in targs if not str(a).startswith(("model.path=", "model.source_vocab="))), *ok,
          f"model.path={nan_row}", "model.source_vocab=single_byte", f"run_dir={fr7}"], fr7, fresh=True)


def remove_at_once(path: Path) -> None:
    """Remove a directory as one step the watched run can see: renamed away, then deleted. A plain rmtree deletes the
    files first, so the run would see its lock file or marker gone before the directory, whichever rmtree reached
    (all correct, but a different line from run to run)."""
    gone = path.with_name(path.name + ".removed")
    path.rename(gone)
    shutil.rmtree(gone)


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


DOC = REPO / "docs" / "reliability.md"
BEGIN, END = "<!-- misuse-table:begin (generated by tests/helpers/scripts/misuse_table.py --write) -->", \
    "<!-- misuse-table:end -->"


def committed_table(doc: str | None = None) -> str:
    doc = DOC.read_text() if doc is None else doc
    return doc.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_table(table: str) -> None:
    doc = DOC.read_text()
    head, rest = doc.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table}{END}{rest.split(END, 1)[1]}")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--write"]
    work = Path(args[0]) if args else Path(tempfile.mkdtemp(prefix="s2t2_misuse_"))
    table = generate(work)
    if "--write" in sys.argv:
        write_table(table)
    else:
        print(table, end="")


if __name__ == "__main__":
    main()
