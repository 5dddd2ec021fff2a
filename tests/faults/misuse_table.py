"""The misuse table of docs/reliability.md, made by running every case: a new user's mistakes, each run as the real
`s2t2` command in a fresh process on real files (the shipped protein FASTA, the shipped stories260K model).

    PYTHONPATH=. python tests/faults/misuse_table.py [WORKDIR] > /tmp/misuse.md

For each case: the message shown (the error line, or the warnings of a run that goes on), the exit code, and what
was kept (files that existed before the command, compared byte for byte afterwards; or that nothing was written).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FASTA = REPO / "s2t2_dist" / "assets" / "protein" / "mmseqs2_QUERY_uniprotkb.fasta"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "S2T2_DEVICE": "cpu", "DS_ACCELERATOR": "cpu", "S2T2_LOG_LEVEL": "WARNING"}


def s2t2(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "s2t2_dist.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, env={**ENV, **(env or {})}, timeout=timeout)


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()} if d.exists() else {}


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
    lines = [ln for ln in proc.stderr.splitlines() if ": error: " in ln]
    if lines:
        return lines[-1]
    warn = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if "WARNING:" in ln]
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


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="s2t2_misuse_"))
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from s2t2_dist.recipes.llama2c import save_hf

    model = save_hf(work / "stories260k")
    prep = ["context_len=64", "shard_size=64", "eval_fraction=0.1", "--no-progress"]
    data = work / "data"
    other = work / "data96"
    base_fa = fasta(work / "sample.fasta")
    for out, v in ((data, 64), (other, 96)):
        if not (out / "prepare_summary.json").exists():
            assert s2t2("prepare", f"inputs=[{base_fa}]", f"output_dir={out}", f"vocab_size={v}", *prep).returncode == 0
    rows: list[tuple[str, str, str, int, str]] = []

    def case(stage, what, args, watch: Path, fresh=False, env=None, prepare_fn=None):
        if prepare_fn:
            prepare_fn()
        before = snapshot(watch)
        p = s2t2(stage, *args, env=env)
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
    s2t2("translate", *targs, *ok, f"run_dir={run}", "train.stop_after=2")
    t("resume (checkpoint at step 2) with optim.lr changed", "optim.lr=0.5", fresh=False)
    s2t2("translate", *targs, *ok, f"run_dir={run}")
    res = json.loads((run / "result.json").read_text())["final_loss"]
    p = t("re-run a finished run", fresh=False)
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
    rows.append(("translate", "Ctrl-C (SIGINT to the process group) during training",
                 [ln for ln in err.splitlines() if "interrupted" in ln][-1], proc.returncode,
                 f"checkpoint {ck} at step {r['step']} (preempted: {r['preempted']}); the next launch resumes there"))

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

    print("| stage | case | message shown | exit | kept |")
    print("|---|---|---|---:|---|")
    for stage, what, msg, rc, k in rows:
        msg = msg.replace(str(work), "W").replace("|", "\\|").replace("`", "'")
        print(f"| {stage} | {what} | `{msg}` | {rc} | {k} |")


if __name__ == "__main__":
    main()
