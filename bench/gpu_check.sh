#!/bin/bash
# The project's GPU check, one command from the repository root on a machine with one GPU:
#   OUT=/some/dir bash bench/gpu_check.sh [SECONDS] [ITEMS]
# ITEMS (comma list, run in this order; an item is skipped when fewer seconds than its cap are left):
#   A     bench/gpu_smoke.py (translate, ZeRO-3, FSDP2, evaluate; tiny model, NCCL, bf16)
#   C1    bench/bench_sinkhorn.py --device cuda: the sparse Sinkhorn at 50,304 x 512 fp32 (Triton route, the 15-line
#         sort reference and one copy of C in the same run, the kernel count, host reads)
#   C2    bench/bench_plan_product.py --device cuda: the product's Triton kernels against the GEMMs
#   B1    stage 1 through launch/translate.py, OLMo-1B architecture (random weights), shipped config, 16 x 512, v = 243
#   bare  bench/bare_step.py: a bare Hugging Face forward + backward of the same model and batch
#   B2    as B1 with model.source_vocab=all (v = 50,280)
#   FT    bench/bench_finetune_gpu.py: finetune at full OLMo-1B size, original tokenizer, 16 x 512, 20 steps, FSDP2 and
#         DeepSpeed ZeRO-3 through torchrun (tokens/s, MFU, memory, step split, start-up phases)
# Default SECONDS 480 (8 minutes). Writes $OUT/gpu_check.json (one JSON: bench/gpu_check_report.py), $OUT/summary.txt
# and $OUT/logs.tgz. Needs torch with CUDA, transformers, tokenizers, triton, deepspeed, webdataset, submitit
# importable (PYTHONPATH may point at extra packages: the machine may lack a registry).
BUDGET=${1:-480}; ITEMS=${2:-A,C1,C2,B1,bare,B2,FT}
T0=$(date +%s); W=${W:-${TMPDIR:-/tmp}/s2t2_gpu_check}; L=$W/logs; mkdir -p $L "$OUT"; S=$OUT/summary.txt
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
note() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $S; }
want() { [[ ",$ITEMS," == *",$1,"* ]]; }
item() { local name=$1 cap=$2; shift 2; want $name || return 0
  if (( $(left) < cap )); then note "$name skipped (left $(left)s < cap $cap)"; echo skipped > $L/$name.rc; return 0; fi
  local t=$(date +%s); timeout $cap "$@" > $L/$name.log 2>&1; local rc=$?
  echo $rc > $L/$name.rc; echo $(( $(date +%s) - t )) > $L/$name.secs
  note "$name rc=$rc"; tail -4 $L/$name.log | sed 's/^/    /' >> $S; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $L/gpu.txt 2>&1
python3 -c "import torch, transformers, triton, deepspeed, webdataset, submitit, s2t2_dist.stages.translate; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA', 'transformers', transformers.__version__, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__)" > $L/versions.txt 2>&1 || { note "import check failed: $(tail -1 $L/versions.txt)"; exit 1; }
M=$W/cache/olmo1b-L16-d2048; D=$W/data; FA=s2t2_dist/assets/protein/mmseqs2_QUERY_uniprotkb.fasta
need_model() { want B1 || want B2 || want bare; }
if need_model; then   # built on the CPUs while the first items use the GPU
( python3 -c "import sys; sys.path.insert(0, 'bench'); from rehearsal import build_model; from pathlib import Path; print(build_model(Path('$W/cache'), 16, 2048, 16))" > $L/build.log 2>&1
  python3 -m s2t2_dist.cli prepare --no-progress "inputs=[$FA]" format=fasta domain=protein eval_fraction=0.05 vocab_size=512 context_len=512 shard_size=256 num_workers=0 source_tokenizer=$M output_dir=$D > $L/prepare.log 2>&1; echo "prepare rc=$?" >> $L/build.log ) &
BG=$!
fi
item A 150 python3 bench/gpu_smoke.py --out $W/smoke; cp $W/smoke/smoke.json $L/ 2>/dev/null
item C1 60 python3 bench/bench_sinkhorn.py --device cuda --out $L/sinkhorn.json
item C2 60 python3 bench/bench_plan_product.py --device cuda
if need_model; then wait $BG; note "model + data: $(tail -2 $L/build.log | tr '\n' ' ')"; fi
TR=(--config configs/translate_olmo1b.yaml model.path=$M data.train=$D/shards/new/train data.eval=$D/shards/new/eval data.tokenizer=$D/tokenizer data.num_workers=2 train.steps=30 train.log_every=5 train.ckpt_every=0 train.eval_every=0 train.eval_max_docs=64)
item B1 120 env S2T2_SYNC_DEBUG=warn python3 -m torch.distributed.run --nproc_per_node 1 launch/translate.py "${TR[@]}" run_dir=$W/tr1
item bare 60 python3 bench/bare_step.py $M 16 512 $L/bare.json
item B2 120 env S2T2_SYNC_DEBUG=warn python3 -m torch.distributed.run --nproc_per_node 1 launch/translate.py "${TR[@]}" model.source_vocab=all run_dir=$W/tr2
item FT 250 python3 bench/bench_finetune_gpu.py --out $W/ft --timeout 110; cp $W/ft/finetune_gpu.json $L/ 2>/dev/null
python3 bench/gpu_check_report.py $W $OUT/gpu_check.json >> $S 2>&1
note "done"; tar czf $OUT/logs.tgz -C $W logs 2>/dev/null
