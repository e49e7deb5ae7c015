#!/usr/bin/env bash
# Dynamic micro-batching's pipeline comparison on one 4-GPU host: useful tokens/s of GPT-1.3B and T5-770M on the multi-task mix at
# pp = 2 (dp = 2) and pp = 4 (dp = 1): dynamic micro-batching (planned in DataLoader workers; GPT with a measured
# profile, T5 with the analytic cost model; its plan_waits are reported) vs packing (GPT: FlexAttention's block mask
# on CUDA) vs token budget vs padding. Every row also carries the cost model's simulated time of the micro-batches it
# ran ("pred s"), the shape headers the later stages waited for, new shapes and device allocations per step.
#
# One torchrun launch per (model, pp) runs the variants in the order that matters: dynamic, packing, token_budget,
# padding last. The launch has a wall-clock deadline (LIMIT seconds after it starts; GPT 135, T5 105): a variant starts
# only with --min-variant-s left, stops before a step that would end past the deadline or its own budget (its
# finished timed steps count, the row says "stopped by budget"), and one that gets no timed step is a row
# "skipped: budget" — never killed mid-run. The result JSON is rewritten before and after every variant (the one
# running is written as "cut by the time limit"), so a launch killed by the safety timeout (LIMIT + 30 s) keeps
# every finished row. Steps: 4 timed after 1 warm-up; padding (several times the others' step) 2 timed after 1.
# Total: data cache (~1 minute of CPU; none if $L3D_CACHE holds it for this Python version) + 2 x 135 + 2 x 105 s
# + exits: at most ~9 minutes. PPS=2 or PPS=4, MODELS=gpt:1.3b:2048:512 or t5:770m:1024:256 run a part; NPROC=2 PPS=2 runs
# pp = 2 alone (dp = 1) on two GPUs. SMOKE=1: CPU, 2 processes, pp = 2 only, tiny models (about 2-3 minutes).
# The last lines printed are one table of every row, and dynamic against the best packing, token budget and padding.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# PPS and MODELS (model:preset:seq_length:target_length ...) may be given to run a part, e.g. PPS=4 MODELS=t5:770m:1024:256.
if [ "${SMOKE:-0}" = 1 ]; then
  N=2; PPS=${PPS:-2}; MODELS=${MODELS:-"gpt:tiny:128:64 t5:tiny:128:64"}; NS=1500; VOCAB=1000; GB=16; STEPS=3
  WARM=1; TB=512; EXTRA="--accelerator cpu --precision 32-true --num-workers 1"; LIMIT_GPT=${LIMIT:-150}
  LIMIT_T5=${LIMIT:-150}; SLOW="padding=1/1"
else
  N=${NPROC:-4}; PPS=${PPS:-"2 4"}; MODELS=${MODELS:-"gpt:1.3b:2048:512 t5:770m:1024:256"}; NS=20000; VOCAB=32000; GB=256
  STEPS=5; WARM=1; TB=16384; EXTRA="--num-workers 2"; LIMIT_GPT=${LIMIT:-135}; LIMIT_T5=${LIMIT:-105}
  SLOW="padding=2/1"
fi
# packing@N: N packed rows per micro-batch, the largest N that gives every replica at least 2·pp micro-batches in
# every step (a filled pipeline; the counts per replica are in docs/dynamic.md, "Baselines at pp > 1"). PACK=N
# overrides it everywhere.
pack_for() {
  if [ -n "${PACK:-}" ]; then echo "$PACK"; return; fi
  case "$1:$2" in gpt:2) echo 2 ;; gpt:*) echo 1 ;; t5:*) echo 4 ;; *) echo 2 ;; esac
}
# GPT's dynamic plans with the measured GPT-1.3B profile kept in benchmarks/results (per-micro-batch overhead and
# in-situ host time included; the analytic model under-predicts micro-batch times on these GPUs, docs/dynamic.md):
# PROFILE_GPT=none plans with the analytic one, MORE=dynamic@analytic adds an analytic-planned run after the others.
# T5 has no profile yet.
PROFILE_GPT=${PROFILE_GPT-benchmarks/results/2026-11-27n_multitask_profile_gpt1.3b_1xh200.json}
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
    variants="dynamic packing@$(pack_for "$model" "$pp") token_budget@$TB padding@4 ${MORE:-}"
    profile=none; [ "$model" = gpt ] && [ "${SMOKE:-0}" != 1 ] && profile=$PROFILE_GPT
    json="$OUT/multitask_${model}_pp$pp.json"; log="$OUT/multitask_${model}_pp$pp.log"
    rm -f "$json"; files+=("$json")
    port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # The deadline is the script's budget; the timeout only guards against a hang (rows so far are on disk).
    timeout -k 10 $((limit + 30)) python -m torch.distributed.run --nproc_per_node "$N" --master_port "$port" \
      benchmarks/dynamic/multitask_microbatching.py --engine lightning --devices "$N" --pp "$pp" --model "$model" \
      --preset "$preset" --seq-length "$seq" --target-length "$tgt" $COMMON --global-batch "$GB" --steps "$STEPS" \
      --warmup "$WARM" --steps-for $SLOW --deadline-at $((start + limit)) $EXTRA --variants $variants \
      --profile "$profile" --out "$json" >"$log" 2>&1
    rc=$?
    echo "== $model pp=$pp rc=$rc $(($(date +%s) - start))s (deadline ${limit}s)"
    grep '^{' "$log" | cut -c1-200  # the full rows are in $json; the table below has the numbers
    [ "$rc" = 0 ] || grep -v '^{' "$log" | grep -v -i warn | tail -n 5
  done
done
echo "== total $(($(date +%s) - start_all))s"
python benchmarks/dynamic/multitask_microbatching.py --table "${files[@]}"
