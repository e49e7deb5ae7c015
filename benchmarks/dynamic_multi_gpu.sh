#!/usr/bin/env bash
# Issue 21's pipeline comparison on one 4-GPU host: useful tokens/s of GPT-1.3B and T5-770M on the multi-task mix at
# pp = 2 (dp = 2) and pp = 4 (dp = 1): dynamic micro-batching (planned in DataLoader workers, analytic cost model; its
# plan_waits are reported) vs padding vs packing at $PACK rows per micro-batch (default 2: set it to the best of the
# one-GPU run) vs token budget. Four torchrun launches of at most 70 s each, after building the multi-task data cache
# (~1 minute of CPU; none if $L3D_CACHE already holds it for this Python version): about 4-5 minutes of device time.
# PPS=2 or PPS=4 runs half of it; NPROC=2 PPS=2 runs pp = 2 alone (dp = 1) on two GPUs. SMOKE=1: CPU, 2 processes, pp = 2 only, tiny models (about 2 minutes).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# PPS and MODELS (model:preset:seq_length:target_length ...) may be given to run a part, e.g. PPS=4 MODELS=t5:770m:1024:256.
if [ "${SMOKE:-0}" = 1 ]; then
  N=2; PPS=${PPS:-2}; MODELS=${MODELS:-"gpt:tiny:128:64 t5:tiny:128:64"}; NS=1500; VOCAB=1000; GB=16; STEPS=3
  WARM=1; TB=512; EXTRA="--accelerator cpu --precision 32-true --num-workers 1"; LIMIT=300
else
  N=${NPROC:-4}; PPS=${PPS:-"2 4"}; MODELS=${MODELS:-"gpt:1.3b:2048:512 t5:770m:1024:256"}; NS=20000; VOCAB=32000; GB=256
  STEPS=5; WARM=2; TB=16384; EXTRA="--num-workers 2"; LIMIT=70
fi
COMMON="--num-samples $NS --vocab-size $VOCAB --cache-dir $CACHE"
python benchmarks/multitask_microbatching.py --prepare-only --model gpt --seq-length 2048 --target-length 512 \
  $COMMON >"$OUT/prepare.log" 2>&1 || tail -n 5 "$OUT/prepare.log"
for spec in $MODELS; do
  IFS=: read -r model preset seq tgt <<<"$spec"
  for pp in $PPS; do
    start=$(date +%s)
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    timeout -k 10 "$LIMIT" python -m torch.distributed.run --nproc_per_node "$N" --master_port "$port" \
      benchmarks/multitask_microbatching.py --engine lightning --devices "$N" --pp "$pp" --model "$model" \
      --preset "$preset" --seq-length "$seq" --target-length "$tgt" $COMMON --global-batch "$GB" --steps "$STEPS" \
      --warmup "$WARM" $EXTRA --variants dynamic padding@4 packing@${PACK:-2} token_budget@$TB \
      --out "$OUT/multitask_${model}_pp$pp.json" >"$OUT/multitask_${model}_pp$pp.log" 2>&1
    rc=$?
    echo "== $model pp=$pp rc=$rc $(($(date +%s) - start))s (limit ${LIMIT}s)"
    grep '^{' "$OUT/multitask_${model}_pp$pp.log" | cut -c1-600
    [ "$rc" = 0 ] || grep -v '^{' "$OUT/multitask_${model}_pp$pp.log" | tail -n 5
  done
done
