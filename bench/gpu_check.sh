#!/bin/bash
# The project's GPU check, one command from the repository root on a machine with one GPU:
#   OUT=/some/dir bash bench/gpu_check.sh [SECONDS] [ITEMS]
# ITEMS (comma list, run in this order; an item is skipped when fewer seconds than its cap are left, or when a
# package it needs cannot be imported: the summary says which and why):
#   T0    python -m bench.gpu_tie --device cuda: the first-use check's float32 near-ties (kernels vs the torch steps on
#         the GPU, on the CPU, and the torch steps GPU vs CPU, whole runs) and the check's launch-by-launch verdict at
#         3,200 x 512, 3,176 x 512, 2,432 x 512, 3,200 x 128
#   A     bench/gpu_smoke.py (translate, ZeRO-3, FSDP2, evaluate; tiny model, NCCL, bf16)
#   C0    bench/kernel_diag.py --device cuda: each launch of the Sinkhorn's kernels against the torch steps at the
#         first-use check's plans of v = 50,304 and 50,280 (u = 512, 128), as specialised and without
#         specialisation: which launch, slices and chunks disagree
#   C1    bench/bench_sinkhorn.py --device cuda: the sparse Sinkhorn at 50,304 x 512 fp32 (Triton route, the 15-line
#         sort reference and one copy of C in the same run, the kernel count, host reads)
#   C1b   the same at 50,280 x 512 (OLMo's tokenizer; 50,304 is its padded embedding)
#   C2    bench/bench_plan_product.py --device cuda: the product's Triton kernels against the GEMMs
#   B1    stage 1 through launch/translate.py, OLMo-1B architecture (random weights), shipped config, 16 x 512, v = 243
#   bare  bench/bare_step.py: a bare Hugging Face forward + backward of the same model and batch
#   B2    as B1 with model.source_vocab=all (v = 50,280)
#   FT_fsdp, FT_zero3   bench/bench_finetune_gpu.py, one engine each: finetune at full OLMo-1B size (random
#         weights: the cost does not depend on their values), original tokenizer, 16 x 512, 10 steps through torchrun
#         (tokens/s, MFU, memory, step split, start-up phases, first step)
# Default SECONDS 480 (8 minutes), ITEMS T0,C0,C1,FT_fsdp,FT_zero3 (caps 60 + 80 + 40 + 140 + 140 = 460 s); the
# stage-1 items ran on 2026-11-28 and go in a second call: OUT=/some/dir2 bash bench/gpu_check.sh 480 A,C1b,C2,B1,bare,B2
# Packages the machine lacks (deepspeed, webdataset, submitit and theirs): wheels in .whl (bench/gpu_wheels.sh,
# carried by the device call), installed first into $W/pkgs. Writes $OUT/gpu_check.json (one JSON:
# bench/gpu_check_report.py), $OUT/summary.txt (each item's exit code or why it was skipped, the routes the
# Sinkhorn and the product took) and $OUT/logs.tgz. Exit status 1 when a route fell back (the torch steps or the
# dense GEMMs where the kernels should run) or torch cannot be imported, else 0 (an item's failure is in its rc).
# PYTHONPATH may point at extra packages: the machine may lack a registry.
BUDGET=${1:-480}; ITEMS=${2:-T0,C0,C1,FT_fsdp,FT_zero3}
T0=$(date +%s); W=${W:-${TMPDIR:-/tmp}/s2t2_gpu_check}; L=$W/logs; mkdir -p $L "$OUT"; S=$OUT/summary.txt
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $S; }
want() { [[ ",$ITEMS," == *",$1,"* ]]; }
if [[ -d .whl ]]; then   # the carried wheels, no registry needed (the machine's own torch stays)
  python3 -m pip install -q --no-index --no-deps --find-links .whl --target $W/pkgs .whl/*.whl > $L/wheels.log 2>&1 \
    && note "wheels: installed $(ls .whl | wc -l) from .whl" || note "wheels: install failed ($(tail -1 $L/wheels.log))"
  export PYTHONPATH=$W/pkgs${PYTHONPATH:+:$PYTHONPATH}; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $L/gpu.txt 2>&1
# the packages present (one import each: a missing one skips the items that need it, not the check)
MISSING=""
for p in torch triton transformers tokenizers webdataset deepspeed; do
  python3 -c "import $p" > /dev/null 2>&1 || MISSING="$MISSING $p"; done
python3 -c "import torch, s2t2_dist; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')
for p in ('transformers', 'triton', 'deepspeed', 'webdataset'):
    try: print(p, __import__(p).__version__)
    except ImportError: print(p, 'missing')" > $L/versions.txt 2>&1 || { note "import check failed: $(tail -1 $L/versions.txt)"; exit 1; }
[[ -n $MISSING ]] && note "missing packages:$MISSING"
# an item's packages: the first one missing, else nothing
missing_for() { local p; for p in "$@"; do [[ " $MISSING " == *" $p "* ]] && { echo $p; return; }; done; }
declare -A NEEDS=([A]="triton transformers tokenizers webdataset deepspeed" [T0]="triton" [C0]="triton" [C1]="triton"
  [C1b]="triton" [C2]="triton"
  [B1]="triton transformers tokenizers webdataset" [B2]="triton transformers tokenizers webdataset"
  [bare]="transformers tokenizers webdataset" [FT_fsdp]="transformers tokenizers webdataset"
  [FT_zero3]="transformers tokenizers webdataset deepspeed")
item() { local name=$1 cap=$2; shift 2; want $name || return 0
  local m; m=$(missing_for ${NEEDS[$name]})
  if [[ -n $m ]]; then note "$name skipped ($m cannot be imported)"; echo "skipped: no $m" > $L/$name.rc; return 0; fi
  if (( $(left) < cap )); then note "$name skipped (left $(left)s < cap $cap)"; echo "skipped: no time" > $L/$name.rc; return 0; fi
  local t=$(date +%s); timeout $cap "$@" > $L/$name.log 2>&1; local rc=$?
  echo $rc > $L/$name.rc; echo $(( $(date +%s) - t )) > $L/$name.secs
  note "$name rc=$rc"; tail -4 $L/$name.log | sed 's/^/    /' >> $S; }
M=$W/cache/olmo1b-L16-d2048; D=$W/data; FA=s2t2_dist/assets/protein/mmseqs2_QUERY_uniprotkb.fasta
need_model() { { want B1 || want B2 || want bare; } && [[ -z $(missing_for transformers tokenizers webdataset) ]]; }
BUILD_CAP=300
if need_model; then   # built on the CPUs while the first items use the GPU (each step capped)
( timeout $BUILD_CAP python3 -c "from bench.rehearsal import build_model; from pathlib import Path; print(build_model(Path('$W/cache'), 16, 2048, 16))" > $L/build.log 2>&1
  timeout $BUILD_CAP python3 -m s2t2_dist.cli prepare --no-progress "inputs=[$FA]" format=fasta domain=protein eval_fraction=0.05 vocab_size=512 context_len=512 shard_size=256 num_workers=0 source_tokenizer=$M output_dir=$D > $L/prepare.log 2>&1; echo "prepare rc=$?" >> $L/build.log ) &
BG=$!
fi
item T0 60 python3 -m bench.gpu_tie --device cuda --out $L/tie.json
item A 150 python3 -m bench.gpu_smoke --out $W/smoke; cp $W/smoke/smoke.json $L/ 2>/dev/null
item C0 80 python3 -m bench.kernel_diag --device cuda --shapes 3200x512,3176x512 --out $L/kernel_diag.json
item C1 40 python3 -m bench.bench_sinkhorn --device cuda --out $L/sinkhorn.json
item C1b 60 python3 -m bench.bench_sinkhorn --device cuda --v 50280 --out $L/sinkhorn_50280.json
item C2 60 python3 -m bench.bench_plan_product --device cuda
if need_model; then   # a wait with a limit: the build's own caps, and what is left of the budget
  while kill -0 $BG 2> /dev/null && (( $(left) > 0 )); do sleep 2; done
  kill -0 $BG 2> /dev/null && { note "model + data: still building at the budget's end: stopped"; pkill -P $BG; kill $BG; }
  note "model + data: $(tail -2 $L/build.log | tr '\n' ' ')"; fi
TR=(--config configs/translate_olmo1b.yaml model.path=$M data.train=$D/shards/new/train data.eval=$D/shards/new/eval data.tokenizer=$D/tokenizer data.num_workers=2 train.steps=30 train.log_every=5 train.ckpt_every=0 train.eval_every=0 train.eval_max_docs=64)
item B1 120 env S2T2_SYNC_DEBUG=warn python3 -m torch.distributed.run --nproc_per_node 1 launch/translate.py "${TR[@]}" run_dir=$W/tr1
item bare 60 python3 -m bench.bare_step $M 16 512 $L/bare.json
item B2 120 env S2T2_SYNC_DEBUG=warn python3 -m torch.distributed.run --nproc_per_node 1 launch/translate.py "${TR[@]}" model.source_vocab=all run_dir=$W/tr2
for e in fsdp zero3; do
  item FT_$e 140 python3 -m bench.bench_finetune_gpu --engines $e --out $W/ft_$e --timeout 130 --steps 10
  cp $W/ft_$e/finetune_gpu.json $L/finetune_$e.json 2>/dev/null; done
python3 -m bench.gpu_check_report $W $OUT/gpu_check.json >> $S 2>&1; RC=$?
note "done"; tar czf $OUT/logs.tgz -C $W logs 2>/dev/null
exit $RC
