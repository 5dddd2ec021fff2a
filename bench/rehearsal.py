"""Full-size rehearsal: every stage's REAL command on the OLMo-1B architecture.

The OLMo-1B architecture from the shipped config (`recipes.tiny`, random weights) is saved ONCE as a Hugging Face
directory under --cache, so the real `from_pretrained` path loads it; then, as subprocesses, the commands a user
types: prepare (real UniRef50/UniProt FASTA) -> translate (1 rank single_byte fp32 with a checkpoint and a resume;
2 ranks `all` bf16, C sharded) -> finetune (ZeRO-3 via `deepspeed`, FSDP2 via `torchrun`, 2 ranks, activation
checkpointing, OLMo-1B width at --ft-layers blocks) -> export -> plain `transformers` load -> `launch/evaluate.py`.
In the same run, in one process: a bare Hugging Face forward + backward of the same model and batch (the step-time
reference) and the translator's share of a stage-1 step at v = 243 and v = 50,280.

For every leg: peak RSS per rank (VmHWM of each rank's process, polled every 0.2 s) against the memory model
`predict_*` below, step time (TensorBoard node/step_time_s), checkpoint size and save time (the checkpoint's
`.partial` directory appearing -> renamed), and the load time of its files (torch.load of every file).

    PYTHONPATH=. nice -n 5 python -m bench.rehearsal --out /work/rehearsal_cache/run           # full size (~30 min)
    PYTHONPATH=. python -m bench.rehearsal --out /tmp/reh --cache /tmp/reh_cache --layers 2 --d-model 256 \\
        --heads 4 --ft-layers 2                                                                    # a quick check

Writes OUT/results.json and OUT/table.md (the table in BENCHMARKS.md). Needs ~16 GB free for the full-size legs:
each leg waits until --min-free-gib are available.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTEIN = Path(os.environ.get("S2T2_SHARED_DATA", "/work/shared/data")) / "protein"
FASTAS = ["esm_some_proteins_uniref50.fasta", "mmseqs2_QUERY_uniprotkb.fasta",
          "bio_embeddings_disprot_disordercdhit.fasta"]
GIB = 2 ** 30
U = 512  # the new BPE's vocabulary (configs/prepare_uniref50.yaml)
B, T = 2, 512  # global batch x context of every training leg


# ---------------------------------------------------------------------------------------------------------------
# measuring subprocesses


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return kids


def _hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _rank(pid: int) -> int | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    return int(env[b"RANK"]) if b"RANK" in env else None


class Watch(threading.Thread):
    """Peak RSS of each rank of a process tree (VmHWM: the kernel's high-water mark, so a 0.2 s poll misses only
    growth in a process's last 0.2 s), and the save time of each checkpoint appearing under `ckpt_root`."""

    def __init__(self, root_pid: int, ckpt_root: Path | None):
        super().__init__(daemon=True)
        self.root, self.ckpt_root = root_pid, ckpt_root
        self.peak: dict[int, int] = {}
        self.saves: dict[str, float] = {}
        self._partial: dict[str, float] = {}
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            kids, todo, tree = _children(), [self.root], []
            while todo:
                p = todo.pop()
                tree.append(p)
                todo += kids.get(p, [])
            for p in tree:
                try:
                    with open(f"/proc/{p}/cmdline", "rb") as f:
                        cmd = f.read()
                    if b"launch/" not in cmd and b"rehearsal.py" not in cmd:
                        continue
                    r = _rank(p)
                    if r is None and p != self.root:
                        continue  # the launcher (torchrun / deepspeed): no rank
                    r = 0 if r is None else r
                    self.peak[r] = max(self.peak.get(r, 0), _hwm(p))
                except (OSError, ValueError):
                    pass
            if self.ckpt_root is not None and self.ckpt_root.is_dir():
                now = time.time()
                for d in os.listdir(self.ckpt_root):
                    if d.endswith(".partial"):
                        self._partial.setdefault(d[:-8], now)
                    elif d in self._partial and d not in self.saves:
                        self.saves[d] = now - self._partial[d]
            time.sleep(0.2)


def run_leg(name: str, cmd: list[str], out: Path, *, ckpt_root: Path | None = None, min_free: float = 0) -> dict:
    wait_for_memory(min_free, name)
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu",
               S2T2_DEVICE="cpu")
    log = out / f"{name}.log"
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        w = Watch(proc.pid, ckpt_root)
        w.start()
        rc = proc.wait()
        w.stop = True
        w.join()
    res = {"cmd": " ".join(cmd), "rc": rc, "wall_s": round(time.time() - t0, 1),
           "peak_gib_per_rank": {r: round(v / GIB, 2) for r, v in sorted(w.peak.items())},
           "ckpt_save_s": {k: round(v, 1) for k, v in w.saves.items()}}
    print(f"[{name}] rc={rc} {res['wall_s']} s peak/rank {res['peak_gib_per_rank']} GiB", flush=True)
    if rc != 0:
        print(log.read_text()[-3000:], flush=True)
        raise SystemExit(f"rehearsal: leg {name} failed (rc {rc}); log {log}")
    return res


def wait_for_memory(gib: float, what: str) -> None:
    while gib:
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) for x in f if x.startswith("MemAvailable")) / 2 ** 20
        if avail >= gib:
            return
        print(f"[{what}] waiting: {avail:.1f} GiB available < {gib}", flush=True)
        time.sleep(20)


def tb_scalars(run_dir: Path, tag: str, scope: str = "node_000") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb" / scope))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def du(path: Path) -> float:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) / GIB


def load_files_s(path: Path) -> float:
    """Seconds to read and deserialise every file of a checkpoint (torch.load / safetensors): the I/O part of a
    resume, measured after the run (the engines' own load adds the copies into the model)."""
    import torch

    t0 = time.perf_counter()
    for p in sorted(Path(path).rglob("*")):
        if p.suffix in (".pt", ".bin") or p.name.endswith("_states.pt"):
            torch.load(p, map_location="cpu", weights_only=False)
        elif p.suffix == ".safetensors":
            from safetensors.torch import load_file

            load_file(str(p))
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------
# the memory model (per rank, bytes). Everything stated; the activation term of one block is computed from the
# autograd graph of one block at this width and batch (`block_activation_bytes`), not fitted to a measurement.

RUNTIME = 0.55 * GIB  # python + torch + transformers + the stage's modules, before any tensor (measured: bare import)


def n_params(layers: int, d: int, ff: int, vocab: int, tied: bool) -> tuple[int, int]:
    """(parameters of the blocks, of the embedding + head) of an OLMo model (non-parametric LayerNorm)."""
    per_block = 4 * d * d + 3 * d * ff
    return layers * per_block, vocab * d * (1 if tied else 2)


def predict_translate(a: dict, layers: int, v: int, world: int, dtype_bytes: int, micro: int) -> dict:
    """Two phases; the peak is the larger. Loading: `from_pretrained` maps the safetensors shards (their pages count
    in the process's RSS while they are read) and builds the model in the stage's dtype. The step: see the terms."""
    blocks, emb = n_params(layers, a["d"], a["ff"], a["vocab"], True)
    weights = (blocks + emb) * dtype_bytes
    load = {"runtime": RUNTIME, "safetensors shards mapped (fp32 file)": a["file_bytes"], "model in its dtype": weights}
    step = {
        "runtime": RUNTIME,
        "frozen LM weights (replicated)": weights,
        # saved for backward through the frozen blocks (grad only w.r.t. the inputs): per micro-batch
        "activations (blocks)": layers * a["block_act_per_token"] * micro * T * dtype_bytes / 4,
        # logits [micro, T, u] fp32, their softmax for the loss and its gradient
        "logits + CE": 3 * micro * T * U * 4,
        # C's columns on this rank and their grad + Adam moments (fp32); the sparse Sinkhorn's working set: 10
        # fp32 copies of the local v x u/W block (peak growth of one translator forward + backward, measured
        # in-process: 9.4 at v = 50,280, u = 256; saved for backward alone: 1.9)
        "C, grad, Adam m, v": 4 * v * U * 4 / world,
        "Sinkhorn working set": 10 * v * U * 4 / world,
        # E[src], L[src] in fp32 (kept for backward) and E', L' (u x d) with their gradients
        "E/L source rows fp32 + E', L'": (2 * v * a["d"] + 4 * U * a["d"]) * 4,
    }
    # export: every rank gathers P's global COO (int64 row, col + fp32 value: 20 B per non-zero; P is dense after a
    # few steps from either start, so v x u of them) and rank 0 builds the file's tensors from it
    export = {"runtime": RUNTIME, "frozen LM weights (replicated)": weights, "P global COO + file tensors": 2 * 20 * v * U}
    return {"load": load, "step": step, "export P": export}


def predict_finetune(a: dict, layers: int, world: int, engine: str) -> dict:
    """Three phases (the peak is the largest): rank 0 writes the initial model (the source model loaded in fp32
    from its mapped shards, E', L' built from P); each rank loads that model (mapped file + a whole fp32 copy before
    sharding); the step."""
    src_blocks, src_emb = n_params(layers, a["d"], a["ff"], a["vocab"], True)
    blocks, emb = n_params(layers, a["d"], a["ff"], U, False)  # the translated model: u rows, untied
    n = blocks + emb
    per_block = 4 * a["d"] ** 2 + 3 * a["d"] * a["ff"]
    init = {"runtime": RUNTIME, "source shards mapped + fp32 model": 2 * 4 * (src_blocks + src_emb)}
    load = {"runtime (+ deepspeed / FSDP)": RUNTIME + 0.35 * GIB, "initial model mapped + fp32 copy": 2 * 4 * n}
    step = {
        "runtime (+ deepspeed / FSDP)": RUNTIME + 0.35 * GIB,
        # fp32 master weights + gradients + AdamW m, v: 16 bytes per parameter, sharded over the ranks
        "params + grads + Adam (sharded, 16 B/param)": 16 * n / world,
        # one block gathered whole (fp32) in forward and in the backward recompute, plus its gradient
        "gathered block + its grad": 2 * per_block * 4,
        # activation checkpointing: each block's input kept, one block's activations live during its recompute
        "activations (checkpointed)": (layers * a["d"] + a["block_act_per_token"]) * (B // world) * T * 4,
        "logits + CE": 3 * (B // world) * T * U * 4,
    }
    if engine == "zero3":
        # ZeRO-3 keeps its own fp32 flat copy of each rank's partition for the optimizer, and configs/ds_zero3.json's
        # stage3_max_live_parameters (1e9) lets every gathered parameter stay live below 1e9 parameters: the whole
        # fp32 model on every rank (FSDP2 reshards each block after its forward)
        step["ZeRO-3 fp32 partition copy (4 B/param / W)"] = 4 * n / world
        step["gathered parameters kept live (max_live 1e9)"] = 4 * min(n, 10 ** 9)
    return {"init (rank 0)": init, "load": load, "step": step}


def block_activation_bytes(d: int, heads: int) -> float:
    """Bytes autograd saves per token for ONE OLMo block at width d (fp32), from the graph: the saved tensors of a
    2-block model minus those of a 1-block model, forward on 1 x 512 with the input requiring grad."""
    import torch

    from s2t2_dist.api import tiny_from_config

    def saved(n):
        m = tiny_from_config("olmo-1b", n_layers=n, d_model=d, n_heads=heads, vocab=U)
        for p in m.parameters():
            p.requires_grad_(False)
        seen, total = set(), [0]
        params = {q.untyped_storage().data_ptr() for q in m.parameters()}  # frozen weights: not activations

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total[0] += st.nbytes()
            return t

        x = torch.randn(1, T, d, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m.model(inputs_embeds=x, use_cache=False).last_hidden_state
        del out
        return total[0]

    return (saved(2) - saved(1)) / T


# ---------------------------------------------------------------------------------------------------------------
# in-process measurements (run as a subprocess of the rehearsal: `--inner share`)


def target_tokenizer(out: Path) -> Path:
    """The rehearsal's protein tokenizer (the prepare leg's), else a char BPE of U tokens trained here on the
    shipped protein FASTA (seconds): the share leg runs alone too."""
    prepared = out / "data" / "tokenizer"
    if (prepared / "tokenizer.json").is_file():
        return prepared
    own = out / "share_tokenizer"
    if not (own / "tokenizer.json").is_file():
        from s2t2_dist.api import build_bpe_tokenizer, save_tokenizer_dir
        from s2t2_dist.api import read_fasta

        seqs = [r.text for r in read_fasta(REPO / "s2t2_dist/assets/protein/mmseqs2_QUERY_uniprotkb.fasta")
                if r.bad is None]
        save_tokenizer_dir(build_bpe_tokenizer(seqs, vocab_size=U), own)
    return own


def shipped_translator(model_dir: str, src_tok, src_ids, tok_dir: Path, floor: float, steps: int = 2, device=None):
    """The stage's sparse translator as configs/translate_olmo1b.yaml starts it at these source ids
    (``translator.start.start_translator``: FVT start at its weight, source marginal "start", ``floor``), moved by
    ``steps`` steps of the config's optimiser at its resolved lr against random cotangents: C's entries with a
    gradient move, the rest stay (what P's live rows depend on). ``device``: where it is built and moved."""
    import dataclasses

    import torch

    from s2t2_dist.api import load_config
    from s2t2_dist.api import load_tokenizer
    from s2t2_dist.api import TranslateConfig
    from s2t2_dist.api import start_translator

    cfg = load_config(TranslateConfig, REPO / "configs" / "translate_olmo1b.yaml",
                      [f"model.path={model_dir}", f"translator.floor={floor}"])
    tr, _, resolved = start_translator(cfg.translator, model_dir, src_tok, src_ids.tolist(), load_tokenizer(tok_dir),
                                       lr=cfg.optim.lr)
    tr = tr.to(device or "cpu")
    opt = dataclasses.replace(cfg.optim, lr=resolved.lr).build([tr.C])
    v = src_ids.numel()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        # a narrow stand-in for E: only the pattern of C's gradient matters
        M = torch.randn(v, 64, generator=g).to(tr.C.device)
        E_new, _ = tr.embed_and_head(M, M)
        E_new.backward(torch.randn(E_new.shape, generator=g).to(tr.C.device))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tr


def inner_share(model_dir: str, out: Path, reps: int, full_steps: list[str], device: str = "cpu",  # noqa: C901 - the measurement loop of a benchmark, with its warm-up and checks
                only: tuple = ()) -> None:
    """Bare HF forward + backward (to inputs_embeds) of the model at batch 2 x 512 fp32, then for v = 243 and
    50,280: the stage-1 step (translator + frozen LM, forward + backward) and the translator alone (forward +
    backward with the step's cotangents replaced by random ones of the same shape). ``device`` "cuda": the same on
    the first GPU, the LM under bf16 autocast as the stage runs it (the translator's product keeps fp32), every
    timing between synchronize calls, plus one step under ``torch.cuda.set_sync_debug_mode("error")`` and the
    allocator's peak."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from s2t2_dist.api import get_embedding_and_head, load_causal_lm
    from s2t2_dist.api import load_hf_tokenizer, source_token_ids
    from s2t2_dist.api import TranslatedLM
    from s2t2_dist.api import TokenTranslator, TranslatorConfig

    torch.manual_seed(0)
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    model = load_causal_lm(model_dir, dtype="float32", device=str(dev), frozen=True)
    tok = load_hf_tokenizer(model_dir)
    E, L, _ = get_embedding_and_head(model)
    body = model.base_model
    res: dict = {"threads": torch.get_num_threads(), "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def timed_once(fn):
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    def timed(fn):
        return [timed_once(fn) for _ in range(reps)]

    ids_src = torch.randint(0, 50280, (B, T)).to(dev)

    def bare():
        x = E[ids_src].detach().requires_grad_(True)
        with amp():
            h = body(inputs_embeds=x, use_cache=False).last_hidden_state
            logits = h @ L.T
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids_src[:, 1:].reshape(-1)).backward()

    res["bare_hf_step_s"] = timed(bare)
    print("bare", res["bare_hf_step_s"], flush=True)
    lm = TranslatedLM(model, freeze_model=True)
    # floor 0: the plain sparse kind; "<name>_recipe": the shipped recipe's weight floor (translator.floor: null);
    # both from a moved uniform C with the uniform source marginal. "all_shipped": the shipped recipe whole (FVT
    # start, its own source marginal, floor 1) on the protein tokenizer, after two AdamW steps at its lr.
    DEFAULT_FLOOR = TranslatorConfig().resolve(None, None).floor  # the shipped recipe's (sparse, FVT start)
    cases = [("single_byte", 0.0, "moved"), ("all", 0.0, "moved"), ("single_byte_recipe", DEFAULT_FLOOR, "moved"),
             ("all_recipe", DEFAULT_FLOOR, "moved"), ("all_shipped", DEFAULT_FLOOR, "shipped")]
    for name, floor, start in cases:
        if only and name not in only:
            continue
        vocab = name.split("_")[0] if name.startswith("all") else "single_byte"
        src = source_token_ids(tok, vocab, num_embeddings=E.shape[0])
        if start == "shipped":
            tr = shipped_translator(model_dir, tok, src, target_tokenizer(out), floor, device=dev)
        else:
            tr = TokenTranslator(src.numel(), U, floor=floor)
            with torch.no_grad():  # a moved C (as after the FVT start): supports are not all full
                tr.C.add_(torch.rand_like(tr.C) / src.numel())
        src = src.to(dev)
        tr = tr.to(dev)
        tr.register_source_ids(src)  # as the stage does: "all" is one run of ids, its rows a view of E
        ids = torch.randint(0, tr.u, (B, T)).to(dev)

        def step():
            E_new, L_new = tr.embed_and_head(E, L, src)
            with amp():
                loss = lm(ids, E_new=E_new, L_new=L_new).loss
            loss.backward()
            tr.zero_grad(set_to_none=True)

        def translator_only():
            E_new, L_new = tr.embed_and_head(E, L, src)
            torch.autograd.backward([E_new, L_new], [torch.randn_like(E_new), torch.randn_like(L_new)])
            tr.zero_grad(set_to_none=True)

        t0 = time.perf_counter()
        translator_only()  # warm-up, not timed: the solver's one-off validation, Triton's compilation on a GPU
        r = {"v": src.numel(), "u": tr.u, "floor": floor, "start": start,
             "warmup_s": round(time.perf_counter() - t0, 2)}
        with torch.no_grad():  # what the product reads (translator/product.py: only P's live rows on a CPU)
            P = tr.P()
            r["p_density"] = float((P != 0).double().mean())
            r["p_live_rows"] = int(P.any(1).sum())
        if vocab in full_steps:
            # interleaved, each translator timing next to a step timing: the box's speed drifts by tens of percent
            # within a run, which a ratio of two separate minima takes for a change of share
            pairs = [(timed_once(translator_only), timed_once(step)) for _ in range(reps)]
            r["translator_s"], r["step_s"] = [a for a, _ in pairs], [b for _, b in pairs]
            r["translator_share"] = min(r["translator_s"]) / min(r["step_s"])
            ratios = sorted(a / b for a, b in pairs)
            r["translator_share_paired"] = ratios  # per interleaved pair, sorted
            r["translator_share_paired_median"] = ratios[len(ratios) // 2]
            if cuda:  # a whole step (translator + LM) with any device -> host read an error
                torch.cuda.set_sync_debug_mode("error")
                try:
                    step()
                    r["sync_debug"] = "none"
                except RuntimeError as e:
                    r["sync_debug"] = f"sync: {str(e).splitlines()[0]}"
                finally:
                    torch.cuda.set_sync_debug_mode(0)
        else:  # the LM's part of the step taken as the bare HF step of the same batch (its head is larger: v rows)
            r["translator_s"] = timed(translator_only)
            r["translator_share"] = min(r["translator_s"]) / (min(r["translator_s"]) + min(res["bare_hf_step_s"]))
            r["share_denominator"] = "translator + bare HF step"
        res[name] = r
        print(name, r, flush=True)
    if cuda:
        res["cuda_max_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / GIB, 2)
    (out / "share.json").write_text(json.dumps(res, indent=1))


# ---------------------------------------------------------------------------------------------------------------


def build_model(cache: Path, layers: int, d: int, heads: int) -> tuple[Path, dict]:
    """The OLMo-1B architecture (shipped config, widths/depth given), random weights (seed 0), saved once."""
    out = cache / f"olmo1b-L{layers}-d{d}"
    info = {"dir": str(out)}
    if not (out / "config.json").is_file():
        t0 = time.time()
        code = ("import sys; from s2t2_dist.api import tiny_from_config, save_olmo_tokenizer; "
                f"m = tiny_from_config('olmo-1b', n_layers={layers}, d_model={d}, n_heads={heads}, seed=0); "
                f"m.save_pretrained('{out}.tmp', max_shard_size='2GB'); save_olmo_tokenizer('{out}.tmp')")
        subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        os.replace(f"{out}.tmp", out)
        info["save_s"] = round(time.time() - t0, 1)
    info["size_gib"] = round(du(out), 2)
    info["file_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    info.update(d=cfg["hidden_size"], ff=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"])
    return out, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results, logs and run directories")
    ap.add_argument("--cache", default="/work/rehearsal_cache", help="the saved model directories (kept)")
    ap.add_argument("--layers", type=int, default=16, help="depth of the stage-1 model (OLMo-1B: 16)")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ft-layers", type=int, default=8, help="depth of the stage-2 model (OLMo-1B width)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="repetitions of each in-process timing")
    ap.add_argument("--legs", default="prepare,translate1,zero3,fsdp,evaluate,translate2,share")
    ap.add_argument("--min-free-gib", type=float, default=0.0, help="wait before each leg until this much is free")
    ap.add_argument("--share-steps", default="single_byte,all",
                    help="source vocabularies whose whole stage-1 step is timed for the translator's share (the "
                         "others divide by translator + bare HF step)")
    ap.add_argument("--share-device", default="cpu", choices=["cpu", "cuda"],
                    help="where the share leg runs (cuda: the first GPU, the LM under bf16 autocast)")
    ap.add_argument("--share-cases", default="",
                    help="the share leg's cases to run (comma-separated; default every one: single_byte, all, "
                         "single_byte_recipe, all_recipe, all_shipped)")
    ap.add_argument("--report", action="store_true", help="only re-render OUT/table.md from OUT/results.json")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.inner == "share":
        return inner_share(args.model, out, args.reps, [x for x in args.share_steps.split(",") if x],
                           args.share_device, tuple(x for x in args.share_cases.split(",") if x))
    legs = set(args.legs.split(",")) if not args.report else set()
    res_path = out / "results.json"
    R = json.loads(res_path.read_text()) if res_path.is_file() else {}
    if args.report:
        attach_predictions(R)
        res_path.write_text(json.dumps(R, indent=1))
        (out / "table.md").write_text(table(R))
        return print(table(R))

    def save():
        res_path.write_text(json.dumps(R, indent=1))

    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    model, R["model"] = build_model(cache, args.layers, args.d_model, args.heads)
    a = dict(R["model"])
    a["block_act_per_token"] = block_activation_bytes(a["d"], a["heads"])
    R["model"]["block_act_bytes_per_token"] = round(a["block_act_per_token"])
    py, data = sys.executable, out / "data"
    fastas = [str(PROTEIN / f) for f in FASTAS]
    S = args.steps
    if "prepare" in legs:
        R["prepare"] = run_leg("prepare", [
            py, "launch/prepare.py", "--config", "configs/prepare_uniref50.yaml", f"inputs={json.dumps(fastas)}",
            f"output_dir={data}", f"source_tokenizer={model}", "num_workers=1", "eval_fraction=0.02",
            "shard_size=256"], out, min_free=args.min_free_gib)
        save()
    tr_common = [f"model.path={model}", f"data.train={data}/shards/new/train", f"data.eval={data}/shards/new/eval",
                 f"data.tokenizer={data}/tokenizer", "data.num_workers=0", f"train.batch_size={B}",
                 f"train.context_len={T}", "train.log_every=1", "train.eval_every=0", "train.eval_max_docs=4",
                 "eval.batch_size=4", "translator.heatmap=[32,16]"]
    translate = [py, "launch/translate.py", "--config", "configs/translate_olmo1b.yaml"]
    torchrun2 = [py, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0", "--rdzv_backend=c10d",
                 "--rdzv_endpoint=127.0.0.1:0"]
    if "translate1" in legs:  # 1 rank, single_byte, fp32: a checkpoint at step S-1, stopped, resumed
        rd = out / "translate1"
        argv = [*translate, f"run_dir={rd}", *tr_common, "model.source_vocab=single_byte", "train.precision=fp32",
                f"train.micro_batch_size={B}", f"train.steps={S}", f"train.ckpt_every={S - 1}"]
        first = run_leg("translate1a", [*argv, f"train.stop_after={S - 1}"], out, ckpt_root=rd / "checkpoints",
                        min_free=args.min_free_gib)
        ck = rd / "checkpoints" / f"step_{S - 1:08d}"
        first["ckpt_gib"], first["ckpt_load_files_s"] = round(du(ck), 3), round(load_files_s(ck), 2)
        second = run_leg("translate1b", argv, out, ckpt_root=rd / "checkpoints", min_free=args.min_free_gib)
        result = json.loads((rd / "result.json").read_text())
        R["translate1"] = {"first": first, "resume": second, "v": 243 if a["vocab"] >= 50280 else None,
                           "step_s": tb_scalars(rd, "node/step_time_s"), "eval": result.get("eval"),
                           "p_file_mb": round((rd / "P.safetensors").stat().st_size / 2 ** 20, 2)}
        save()
    p_file = out / "translate1" / "P.safetensors"
    ft_model = None
    if legs & {"zero3", "fsdp"}:
        ft_model, R["ft_model"] = build_model(cache, args.ft_layers, args.d_model, args.heads)
    ft_common = [f"model.path={ft_model}", f"data.train={data}/shards/new/train", f"data.eval={data}/shards/new/eval",
                 f"data.tokenizer={data}/tokenizer", "data.num_workers=0", f"init.p_file={p_file}",
                 "engine.activation_checkpointing=true", f"train.batch_size={B}", "train.micro_batch_size=1",
                 f"train.context_len={T}", "train.log_every=1", "train.eval_every=0", "train.eval_max_docs=4",
                 "eval.batch_size=4", f"train.steps={S}", f"train.ckpt_every={S}", "train.precision=fp32"]
    for leg in ("zero3", "fsdp"):
        if leg not in legs:
            continue
        rd = out / leg
        if leg == "zero3":
            cmd = [str(Path(py).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29517",
                   "launch/finetune.py", "--ds_config", "configs/ds_zero3.json", "--config",
                   "configs/finetune_olmo1b.yaml", f"run_dir={rd}", *ft_common]
        else:
            cmd = [*torchrun2, "launch/finetune.py", "--config", "configs/finetune_olmo1b.yaml", "engine.kind=fsdp",
                   f"run_dir={rd}", *ft_common]
        r = run_leg(leg, cmd, out, ckpt_root=rd / "checkpoints", min_free=args.min_free_gib)
        ck = rd / "checkpoints" / f"step_{S:08d}"
        r["ckpt_gib"], r["ckpt_load_files_s"] = round(du(ck), 3), round(load_files_s(ck), 2)
        result = json.loads((rd / "result.json").read_text())
        r.update(step_s=tb_scalars(rd, "node/step_time_s"), eval=result.get("eval"), export=result.get("export"),
                 export_gib=round(du(rd / "final"), 3))
        R[leg] = r
        save()
    if "evaluate" in legs:
        final = out / ("zero3" if (out / "zero3" / "final").is_dir() else "fsdp") / "final"
        t0 = time.time()  # plain transformers, no s2t2 on the path, from another directory
        code = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
                "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); t = AutoTokenizer.from_pretrained(sys.argv[1]); "
                "ids = t('MKTAYIAKQRQISFVKSHFSRQ', return_tensors='pt').input_ids; "
                "l = m(ids).logits; assert torch.isfinite(l).all(); print(type(m).__name__, tuple(l.shape))")
        p = subprocess.run([py, "-c", code, str(final)], cwd="/", capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        R["hf_load"] = {"rc": p.returncode, "s": round(time.time() - t0, 1), "out": p.stdout.strip()[-300:],
                        "err": p.stderr.strip()[-600:] if p.returncode else ""}
        rd = out / "evaluate"
        r = run_leg("evaluate", [py, "launch/evaluate.py", "--config", "configs/evaluate_olmo1b.yaml",
                                 f"run_dir={rd}", f"model.path={final}", f"data.eval={data}/shards/new/eval",
                                 "eval.max_docs=8", "eval.batch_size=4", "eval.precision=fp32"], out,
                    min_free=args.min_free_gib)
        r["eval"] = json.loads((rd / "eval.json").read_text())
        R["evaluate"] = r
        save()
    if "translate2" in legs:  # 2 ranks, all source tokens, bf16, C sharded by columns
        rd = out / "translate2"
        r = run_leg("translate2", [*torchrun2, "launch/translate.py", "--config", "configs/translate_olmo1b.yaml",
                                   f"run_dir={rd}", *tr_common, "model.source_vocab=all", "train.precision=bf16",
                                   "train.micro_batch_size=1", f"train.steps={S}", f"train.ckpt_every={S}"],
                    out, ckpt_root=rd / "checkpoints", min_free=args.min_free_gib)
        ck = rd / "checkpoints" / f"step_{S:08d}"
        r["ckpt_gib"], r["ckpt_load_files_s"] = round(du(ck), 3), round(load_files_s(ck), 2)
        result = json.loads((rd / "result.json").read_text())
        r.update(step_s=tb_scalars(rd, "node/step_time_s"), eval=result.get("eval"),
                 p_file_mb=round((rd / "P.safetensors").stat().st_size / 2 ** 20, 2))
        R["translate2"] = r
        save()
    if "share" in legs:
        R["share"] = run_leg("share", [py, __file__, "--out", str(out), "--inner", "share", "--model", str(model),
                                       "--reps", str(args.reps), "--share-steps", args.share_steps,
                                       "--share-device", args.share_device, "--share-cases", args.share_cases],
                             out, min_free=args.min_free_gib)
        R["share"].update(json.loads((out / "share.json").read_text()))
        save()
    attach_predictions(R)
    save()
    (out / "table.md").write_text(table(R))
    print(table(R))


def attach_predictions(R: dict) -> None:
    """The memory model's prediction for every leg that ran (from the model directories' configs and files)."""
    for key in ("model", "ft_model"):
        if key in R:
            d = Path(R[key]["dir"])
            R[key]["file_bytes"] = sum(p.stat().st_size for p in d.glob("*.safetensors"))
    a = dict(R["model"], block_act_per_token=R["model"]["block_act_bytes_per_token"])
    preds = {"translate1": lambda: predict_translate(a, a["layers"], 243, 1, 4, B),
             "translate2": lambda: predict_translate(a, a["layers"], 50280, 2, 2, 1),
             "zero3": lambda: predict_finetune(a, R["ft_model"]["layers"], 2, "zero3"),
             "fsdp": lambda: predict_finetune(a, R["ft_model"]["layers"], 2, "fsdp")}
    for leg, fn in preds.items():
        if leg in R:
            R[leg]["predicted"] = fn()


def _fmt_pred(phases: dict) -> str:
    name, total = max(((k, sum(t.values())) for k, t in phases.items()), key=lambda x: x[1])
    return f"{total / GIB:.2f} ({name})"


def table(R: dict) -> str:
    rows = ["| leg | ranks | peak GiB per rank (measured) | predicted GiB per rank | step s (median) | "
            "checkpoint GiB / save s / load-files s | notes |", "|---|---|---|---|---|---|---|"]

    def med(xs):
        xs = sorted(v for _, v in xs)
        return f"{xs[len(xs) // 2]:.1f}" if xs else "-"

    for leg in ("translate1", "translate2", "zero3", "fsdp"):
        r = R.get(leg)
        if not r:
            continue
        legs = [r["first"], r["resume"]] if "first" in r else [r]
        peak = max((max(x["peak_gib_per_rank"].values()) for x in legs if x["peak_gib_per_rank"]), default=0)
        ck = r["first"] if "first" in r else r
        saves = ",".join(f"{v}" for v in ck.get("ckpt_save_s", {}).values()) or "-"
        note = ""
        if r.get("eval"):
            note = f"eval BpB {r['eval']['bpb']:.3f} ({int(r['eval']['docs'])} docs)"
        if "p_file_mb" in r:
            note += f"; P file {r['p_file_mb']} MB"
        ranks = len(legs[0]["peak_gib_per_rank"])
        rows.append(f"| {leg} | {ranks} | {peak:.2f} ({', '.join(str(v) for v in legs[0]['peak_gib_per_rank'].values())}) "
                    f"| {_fmt_pred(r['predicted'])} | {med(r.get('step_s', []))} | {ck.get('ckpt_gib', '-')} / {saves} / "
                    f"{ck.get('ckpt_load_files_s', '-')} | {note} |")
    if R.get("hf_load"):
        h = R["hf_load"]
        rows.append(f"| export -> plain transformers load + forward | 1 | - | - | - | - | rc {h['rc']}, {h['s']} s: "
                    f"{h['out']} |")
    if R.get("evaluate"):
        e = R["evaluate"]
        m = e["eval"]["metrics"]
        rows.append(f"| evaluate (launch/evaluate.py, the export) | 1 | {max(e['peak_gib_per_rank'].values()):.2f} | - | "
                    f"- | - | BpB {m['bpb']:.3f} over {int(m['docs'])} docs, {e['wall_s']} s |")
    s = R.get("share")
    if s:
        rows.append("")
        rows.append(f"bare HF forward + backward, 2 x {T} {'bf16 autocast' if s.get('device', 'cpu') != 'cpu' else 'fp32'}"
                    f" on {s.get('device', 'cpu')}, 1 process: {min(s['bare_hf_step_s']):.1f} s "
                    f"(runs: {', '.join(f'{x:.1f}' for x in s['bare_hf_step_s'])}); peak {max(s['peak_gib_per_rank'].values()):.2f} GiB")
        for k in ("single_byte", "all", "single_byte_recipe", "all_recipe", "all_shipped"):
            if k in s:
                x = s[k]
                step = (f"stage-1 step {min(x['step_s']):.2f} s" if "step_s" in x
                        else "share of translator + bare HF step")
                paired = (f"; interleaved pairs: median {100 * x['translator_share_paired_median']:.2f}%, range "
                          f"{100 * x['translator_share_paired'][0]:.2f}-{100 * x['translator_share_paired'][-1]:.2f}%"
                          if "translator_share_paired" in x else "")
                sync = f"; under set_sync_debug_mode(\"error\"): {x['sync_debug']}" if "sync_debug" in x else ""
                plan = (f" (P {100 * x['p_density']:.2f}% non-zero, {x['p_live_rows']} live rows)"
                        if "p_live_rows" in x else "")
                start = ", the shipped FVT start" if x.get("start") == "shipped" else ""
                rows.append(f"- v = {x['v']}, floor {x.get('floor', 0)}{start}{plan}: {step}, translator alone (forward + backward) "
                            f"{min(x['translator_s']):.3f} s: share {100 * x['translator_share']:.2f}%{paired}{sync}")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
