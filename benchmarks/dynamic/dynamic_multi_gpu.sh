#!/usr/bin/env bash
# Dynamic micro-batching in pipelines on one 4-GPU host: useful tokens/s of GPT-1.3B and T5-770M on the multi-task mix
# at pp = 2 (dp = 2) and pp = 4 (dp = 1), the library's choice against the fixed batchings it replaces, each fixed one
# at two settings around its pipeline fill where there are two (tuned on the same data):
#   auto            per global batch the cheapest of dynamic, packed_dynamic, packing and token budget under the cost
#                   model (the library's recommendation; its "choices" say which ran how often)
#   packing@N, @N/2 N packed rows per micro-batch (GPT: FlexAttention's block mask on CUDA; T5 its document mask),
#                   N the largest that gives every replica at least 2·pp micro-batches in every step (N/2 where N > 1)
#   token_budget@T, @2T  at most T padded tokens per micro-batch, T = 16384 / pp (at least the longest sample)
#   packed_dynamic, dynamic  the planner's two partitions on their own
# planned with the measured one-H200 profiles kept in benchmarks/results (PROFILE_GPT, PROFILE_T5; "none" plans with
# the analytic model). Every row carries the cost model's simulated time of the micro-batches it ran ("pred s"), the
# shape headers the later stages waited for, new shapes and device allocations per step.
#
# One torchrun launch per (model, pp) runs the variants in the order above (auto and the first settings of the fixed
# batchings first). The launch has a wall-clock deadline (LIMIT seconds after it starts; GPT 240, T5 210): a variant
# starts only with --min-variant-s left, stops before a step that would end past the deadline or its own budget (its
# finished timed steps count, the row says "stopped by budget"), and one that gets no timed step is a row
# "skipped: budget", never killed mid-run. The result JSON is rewritten before and after every variant (the one
# running is written as "cut by the time limit"), so a launch killed by the safety timeout (LIMIT + 30 s) keeps every
# finished row. Steps: 5 timed after 1 warm-up.
# Time: data cache (~1 minute of CPU; none if $L3D_CACHE holds it for this Python version) + 240 + 210 s per pp, so
# one pp per 10-minute job: PPS=2, then PPS=4. MODELS=gpt:1.3b:2048:512 or t5:770m:1024:256 runs one model;
# NPROC=2 PPS=2 runs pp = 2 alone (dp = 1) on two GPUs. SCHEDULE=interleaved_1f1b (2 stages per rank; the fixed
# batchings then split to a multiple of pp micro-batches, the planner plans for it) runs the interleaved comparison.
# A mix of longer tails: MODELS=gpt:1.3b:8192:512 with a profile whose lengths reach 8192, e.g.
# PROFILE_GPT=benchmarks/results/2026-12-03_multitask_longtail_profile_gpt1.3b_1xh200.json (measured with
# `multitask_microbatching.py --engine direct ... --seq-length 8192 --profile measure --profile-lens
# 16,32,64,128,256,512,1024,2048,4096,8192`, docs/dynamic.md). VARIANTS="..." replaces the list, MORE="..." adds to it.
# ARGS="--compression --shard-optimizer-state" runs every variant with CB on the pipeline's sends and ZeRO-1.
# SMOKE=1: CPU, 2 processes, pp = 2 only, tiny models, one token budget, the analytic cost model (about 3 minutes).
# The last lines printed are one table of every row, then each planned variant (auto, packed_dynamic, dynamic) over
# the best setting of each fixed batching.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
SCHEDULE=${SCHEDULE:-1f1b}
ARGS=${ARGS:-}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ "${SMOKE:-0}" = 1 ]; then
  N=2; PPS=${PPS:-2}; MODELS=${MODELS:-"gpt:tiny:128:64 t5:tiny:128:64"}; NS=1500; VOCAB=1000; GB=16; STEPS=3
  WARM=1; EXTRA="--accelerator cpu --precision 32-true --num-workers 1"; LIMIT_GPT=${LIMIT:-150}
  LIMIT_T5=${LIMIT:-150}; PROFILE_GPT=none; PROFILE_T5=none; SLOW="padding=1/1"
else
  N=${NPROC:-4}; PPS=${PPS:-"2 4"}; MODELS=${MODELS:-"gpt:1.3b:2048:512 t5:770m:1024:256"}; NS=20000; VOCAB=32000
  GB=256; STEPS=6; WARM=1; EXTRA="--num-workers 2"; LIMIT_GPT=${LIMIT:-240}; LIMIT_T5=${LIMIT:-210}
  SLOW="padding=2/1"  # padding (MORE=padding@4) takes several times the others' step: 2 timed steps after 1
  # The measured profiles (per-micro-batch overhead and in-situ host time included; the analytic model
  # under-predicts micro-batch times on these GPUs, docs/dynamic.md).
  PROFILE_GPT=${PROFILE_GPT-benchmarks/results/2026-12-02f_multitask_profile_sustained_gpt1.3b_1xh200.json}
  PROFILE_T5=${PROFILE_T5-benchmarks/results/2026-12-03b_multitask_profile_t5_770m_1xh200.json}
fi
# packing@N: N packed rows per micro-batch, the largest N that gives every replica at least 2·pp micro-batches in
# every step (a filled pipeline; the counts per replica are in docs/dynamic.md, "Baselines at pp > 1"), and N/2.
# PACK=N overrides N everywhere.
pack_for() {
  if [ -n "${PACK:-}" ]; then echo "$PACK"; return; fi
  case "$1:$2" in gpt:2) echo 2 ;; gpt:*) echo 1 ;; t5:*) echo 4 ;; *) echo 2 ;; esac
}
variants_for() {  # model pp longest-sample-tokens -> the variant list, in running order
  local pack tb
  pack=$(pack_for "$1" "$2")
  if [ "${SMOKE:-0}" = 1 ]; then tb=512; else tb=$((16384 / $2)); fi
  [ "$tb" -lt "$3" ] && tb=$3  # a token budget holds the longest sample
  local list="auto packing@$pack token_budget@$tb packed_dynamic dynamic"
  [ "$pack" -gt 1 ] && list="$list packing@$((pack / 2))"
  [ "${SMOKE:-0}" = 1 ] || list="$list token_budget@$((2 * tb))"
  echo "${VARIANTS:-$list} ${MORE:-}"
}
COMMON="--num-samples $NS --vocab-size $VOCAB --cache-dir $CACHE"
start_all=$(date +%s)
python benchmarks/dynamic/multitask_microbatching.py --prepare-only --model gpt --seq-length 2048 --target-length 512 \
  $COMMON >"$OUT/prepare.log" 2>&1 || tail -n 5 "$OUT/prepare.log"
echo "== data cache $(($(date +%s) - start_all))s"
files=()
for spec in $MODELS; do
  IFS=: read -r model preset seq tgt <<<"$spec"
  limit=$LIMIT_GPT; [ "$model" = t5 ] && limit=$LIMIT_T5
  for pp in $PPS; do
    start=$(date +%s)
    longest=$seq; [ "$model" = t5 ] && longest=$((seq + tgt))
    variants=$(variants_for "$model" "$pp" "$longest")
    profile=$PROFILE_GPT; [ "$model" = t5 ] && profile=$PROFILE_T5
    json="$OUT/multitask_${model}_pp${pp}_$SCHEDULE.json"; log="$OUT/multitask_${model}_pp${pp}_$SCHEDULE.log"
    rm -f "$json"; files+=("$json")
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # The deadline is the script's budget; the timeout only guards against a hang (rows so far are on disk).
    timeout -k 10 $((limit + 30)) python -m torch.distributed.run --nproc_per_node "$N" --master_port "$port" \
      benchmarks/dynamic/multitask_microbatching.py --engine lightning --devices "$N" --pp "$pp" --model "$model" \
      --preset "$preset" --seq-length "$seq" --target-length "$tgt" $COMMON --global-batch "$GB" --steps "$STEPS" \
      --warmup "$WARM" --steps-for $SLOW --schedule "$SCHEDULE" --deadline-at $((start + limit)) $EXTRA $ARGS \
      --variants $variants \
      --profile "$profile" --out "$json" >"$log" 2>&1
    rc=$?
    echo "== $model pp=$pp $SCHEDULE rc=$rc $(($(date +%s) - start))s (deadline ${limit}s)"
    grep '^{' "$log" | cut -c1-200  # the full rows are in $json; the table below has the numbers
    [ "$rc" = 0 ] || grep -v '^{' "$log" | grep -v -i warn | tail -n 5
  done
done
echo "== total $(($(date +%s) - start_all))s"
python benchmarks/dynamic/multitask_microbatching.py --table "${files[@]}"
