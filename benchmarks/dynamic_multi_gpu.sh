#!/usr/bin/env bash
# Issue 21's pipeline comparison on one 4-GPU host: useful tokens/s of GPT-1.3B and T5-770M on the multi-task mix at
# pp = 2 (dp = 2) and pp = 4 (dp = 1): dynamic micro-batching (planned in DataLoader workers, analytic cost model; its
# plan_waits are reported) vs packing at $PACK rows per micro-batch (GPT: FlexAttention's block mask on CUDA) vs
# token budget vs padding.
#
# One torchrun launch per (model, pp) runs the variants in the order that matters: dynamic, packing, token_budget,
# padding last. The launch has a wall-clock deadline (LIMIT seconds after it starts, default 115): a variant starts
# only with --min-variant-s left, stops before a step that would end past the deadline or its own budget (its
# finished timed steps count, the row says "stopped by budget"), and one that gets no timed step is a row
# "skipped: budget" — never killed mid-run. The result JSON is rewritten before and after every variant (the one
# running is written as "cut by the time limit"), so a launch killed by the safety timeout (LIMIT + 30 s) keeps
# every finished row. Steps: 4 timed after 2 warm-up; padding (about 4x the others' step) 2 timed after 1.
# Total: data cache (~1 minute of CPU; none if $L3D_CACHE holds it for this Python version) + 4 x LIMIT + exits,
# at most ~9 minutes. PPS=2 or PPS=4, MODELS=gpt:1.3b:2048:512 or t5:770m:1024:256 run a part; NPROC=2 PPS=2 runs
# pp = 2 alone (dp = 1) on two GPUs. SMOKE=1: CPU, 2 processes, pp = 2 only, tiny models (about 2-3 minutes).
# The last lines printed are one table of every row, and dynamic against the best packing, token budget and padding.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# PPS and MODELS (model:preset:seq_length:target_length ...) may be given to run a part, e.g. PPS=4 MODELS=t5:770m:1024:256.
if [ "${SMOKE:-0}" = 1 ]; then
  N=2; PPS=${PPS:-2}; MODELS=${MODELS:-"gpt:tiny:128:64 t5:tiny:128:64"}; NS=1500; VOCAB=1000; GB=16; STEPS=3
  WARM=1; TB=512; EXTRA="--accelerator cpu --precision 32-true --num-workers 1"; LIMIT=${LIMIT:-150}
  SLOW="padding=1/1"
else
  N=${NPROC:-4}; PPS=${PPS:-"2 4"}; MODELS=${MODELS:-"gpt:1.3b:2048:512 t5:770m:1024:256"}; NS=20000; VOCAB=32000; GB=256
  STEPS=6; WARM=2; TB=16384; EXTRA="--num-workers 2"; LIMIT=${LIMIT:-115}
  SLOW="padding=2/1"
fi
# packing@PACK: PACK packed rows per micro-batch. The multi-task global batch of 256 samples packs into about 40 rows
# of 2,048 tokens (GPT) / 1,024 + 256 (T5), so packing@2 gives each replica >= 2·pp micro-batches at pp = 2 (dp = 2)
# and pp = 4 (dp = 1): enough to fill the pipeline (docs/dynamic.md, "Baselines at pp > 1").
VARIANTS="dynamic packing@${PACK:-2} token_budget@$TB padding@4"
COMMON="--num-samples $NS --vocab-size $VOCAB --cache-dir $CACHE"
start_all=$(date +%s)
python benchmarks/multitask_microbatching.py --prepare-only --model gpt --seq-length 2048 --target-length 512 \
  $COMMON >"$OUT/prepare.log" 2>&1 || tail -n 5 "$OUT/prepare.log"
echo "== data cache $(($(date +%s) - start_all))s"
files=()
for spec in $MODELS; do
  IFS=: read -r model preset seq tgt <<<"$spec"
  for pp in $PPS; do
    start=$(date +%s)
    json="$OUT/multitask_${model}_pp$pp.json"; log="$OUT/multitask_${model}_pp$pp.log"
    rm -f "$json"; files+=("$json")
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # The deadline is the script's budget; the timeout only guards against a hang (rows so far are on disk).
    timeout -k 10 $((LIMIT + 30)) python -m torch.distributed.run --nproc_per_node "$N" --master_port "$port" \
      benchmarks/multitask_microbatching.py --engine lightning --devices "$N" --pp "$pp" --model "$model" \
      --preset "$preset" --seq-length "$seq" --target-length "$tgt" $COMMON --global-batch "$GB" --steps "$STEPS" \
      --warmup "$WARM" --steps-for $SLOW --deadline-at $((start + LIMIT)) $EXTRA --variants $VARIANTS \
      --out "$json" >"$log" 2>&1
    rc=$?
    echo "== $model pp=$pp rc=$rc $(($(date +%s) - start))s (deadline ${LIMIT}s)"
    grep '^{' "$log" | cut -c1-400
    [ "$rc" = 0 ] || grep -v '^{' "$log" | grep -v -i warn | tail -n 5
  done
done
echo "== total $(($(date +%s) - start_all))s"
python benchmarks/multitask_microbatching.py --table "${files[@]}"
