#!/usr/bin/env bash
# Dynamic micro-batching on one GPU (H100 80GB), one job of about 7 minutes (at most 8.3: the parts' limits); every part has its own time limit, so a part
# that runs over loses only itself. Prints one compact block per part; logs and JSON go to $OUT.
#   1. dynamic_gpu: GPT-1.3B profile (measured), cost-model accuracy over 20 batches (budget 90 % of the card),
#      200 training steps fed by planning DataLoader workers (steps waiting for a plan, plan lead, fetch time)
#   2. dynamic_planning: planning time per 65,536-token batch on one CPU core, with that profile
#   3./4. multitask_microbatching: useful tokens/s of GPT-1.3B and T5-770M on the multi-task mix: padding, packing at
#      several rows per micro-batch (best-tuned; GPT's packing@N runs FlexAttention's block mask on CUDA, packing@N:sdpa
#      the dense SDPA mask of the earlier runs), token budget, dynamic
# The multi-task data cache (tokenizer + samples, ~11 MB, $L3D_CACHE) is built on the CPU in the background during
# part 1, so it costs no extra device time.
#   SMOKE=1 runs every part with tiny sizes on CPU (about 10 minutes on 2 busy cores).
#   packed_attention (not in the default PARTS): GPT-1.3B's attention over two packed rows of 2,048 tokens under the
#      dense SDPA mask, FlexAttention's block mask (its output and gradients against the dense mask's, its block-mask
#      build time) and causal flash (dynamic_shapes.py --parts packed); limit L5
#   PARTS="multitask_t5" (any of dynamic_gpu planning packed_attention multitask_gpt multitask_t5) runs those parts
#   only, and L1..L5 override their time limits (seconds), e.g. PARTS=multitask_t5 L4=500 for T5-770M in a call of its own
#   (its profile and compiles do not fit the 120 s it gets beside the other parts). multitask_gpt without
#   dynamic_gpu measures its own profile (same grid), e.g. PARTS=multitask_gpt L3=330 (packing under FlexAttention
#   and under the dense mask, and dynamic, in a call of its own).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu"; GPT="tiny"; T5="tiny"; GSEQ=128; GTGT=64; TSEQ=128; TTGT=64; TOK=1024; BATCHES=3; WSTEPS=12
  WTOK=512; PTOK=2048; PSIZES=1,2,4,8,16,32,64,128; PLENS=16,32,64,128; GB=16; NS=1500; VOCAB=1000; STEPS=3; WARM=1
  TB=512; L1=300; L2=120; L3=300; L4=400; L5=120
else
  DEV=""; GPT="1.3b"; T5="770m"; GSEQ=2048; GTGT=512; TSEQ=1024; TTGT=256; TOK=32768; BATCHES=20; WSTEPS=200
  WTOK=8192; PTOK=65536; PSIZES=1,2,4,8,16,32,64,128; PLENS=16,32,64,128,256,512,1024,1536,2048; GB=256; NS=20000
  VOCAB=32000; STEPS=6; WARM=2; TB=16384; L1=${L1:-215}; L2=${L2:-40}; L3=${L3:-125}; L4=${L4:-120}; L5=${L5:-75}
fi
PARTS=${PARTS:-"dynamic_gpu planning multitask_gpt multitask_t5"}
want() { [[ " $PARTS " == *" $1 "* ]]; }

part() {  # name, time limit (s), command...: run it, then print its rc, wall time and JSON lines
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(($(date +%s) - start))s (limit ${limit}s)"
  if grep -q '^|' "$OUT/$name.log"; then  # a table (multitask_microbatching): it and the summary; the rows' JSON is in the log
    grep -E '^\||^\{"summary' "$OUT/$name.log" | cut -c1-700
  else
    grep '^{' "$OUT/$name.log" | cut -c1-700
  fi
  [ "$rc" = 0 ] || tail -n 5 "$OUT/$name.log"
}

MT="--seq-length $GSEQ --target-length $GTGT --num-samples $NS --vocab-size $VOCAB --cache-dir $CACHE"
python benchmarks/dynamic/multitask_microbatching.py --prepare-only --model gpt $MT >"$OUT/prepare.log" 2>&1 &
PREPARE=$!

want dynamic_gpu && part dynamic_gpu "$L1" python benchmarks/dynamic/dynamic_gpu.py $DEV --preset "$GPT" --vocab-size "$VOCAB" \
  --max-seq-len "$GSEQ" --tokens "$TOK" --batches "$BATCHES" --parts accuracy waits --profile measure \
  --profile-sizes "$PSIZES" --profile-lens "$PLENS" --wait-steps "$WSTEPS" --wait-tokens "$WTOK" \
  --workers 2 --out "$OUT/dynamic_gpu.json"

if want planning && [ ! -f "$OUT/profile_$GPT.json" ]; then
  echo "== planning skipped: no profile in $OUT (part dynamic_gpu writes it)"
elif want planning; then part planning "$L2" env OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/dynamic/dynamic_planning.py \
  --profile "$OUT/profile_$GPT.json" --max-seq-len "$GSEQ" --tokens "$PTOK" --repeats 5 --memory-budget 50e9 \
  --layouts 1,1 1,4 2,2 1,2,interleaved --compact
fi

# Before waiting for the data cache: it is built meanwhile.
want packed_attention && part packed_attention "$L5" python benchmarks/dynamic/dynamic_shapes.py $DEV --preset "$GPT" \
  --max-len "$GSEQ" --parts packed

wait "$PREPARE"; echo "== prepare rc=$? $(tail -n 1 "$OUT/prepare.log" | cut -c1-200)"
GPROF="$OUT/profile_$GPT.json"
if [ ! -f "$GPROF" ] && ! want dynamic_gpu; then
  GPROF=measure  # multitask_gpt on its own: it measures the profile itself (written to $OUT/profile_gpt_$GPT.json)
elif [ ! -f "$GPROF" ]; then
  GPROF=none  # part 1 did not get to write it: dynamic plans with the analytic model
fi

want multitask_gpt && part multitask_gpt "$L3" python benchmarks/dynamic/multitask_microbatching.py --engine direct --model gpt --preset "$GPT" $MT \
  --global-batch "$GB" --steps "$STEPS" --warmup "$WARM" --profile "$GPROF" --profile-sizes "$PSIZES" \
  --profile-lens "$PLENS" --variants padding@4 packing@1 packing@2 packing@4 packing@2:sdpa packing@4:sdpa \
  token_budget@$TB dynamic --out "$OUT/multitask_gpt.json"

want multitask_t5 && part multitask_t5 "$L4" python benchmarks/dynamic/multitask_microbatching.py --engine direct --model t5 --preset "$T5" \
  --seq-length "$TSEQ" --target-length "$TTGT" --num-samples "$NS" --vocab-size "$VOCAB" --cache-dir "$CACHE" \
  --global-batch "$GB" --steps "$STEPS" --warmup "$WARM" --profile measure --profile-sizes "$PSIZES" \
  --profile-lens "$PLENS" --variants padding@4 packing@1 packing@2 token_budget@$TB dynamic \
  --out "$OUT/multitask_t5.json"
