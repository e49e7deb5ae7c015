#!/usr/bin/env bash
# Dynamic micro-batching on one GPU (H100 or H200), one job of at most 8 minutes (the parts' limits): why dynamic
# micro-batches ran slower per token than packed rows, and whether an SDPA backend order with flash attention first
# (against torch's own, which may pick cuDNN and its per-shape set-up) changes it.
#   1. dynamic_shapes: per-new-shape cost of causal attention under each SDPA backend order, and of whole GPT-1.3B
#      micro-batches (first call against repeat) under torch's order and flash first, with a profile of the slowest
#   2. multitask_microbatching (direct engine): useful tokens/s of GPT-1.3B on the multi-task mix, padding, packing
#      at 1 and 2 rows, token budget, dynamic (analytic cost model) and dynamic (measured profile, grid from length
#      16), each under the recipe's sdpa_backends no_cudnn (its default) and torch, every step timed twice (--repeat:
#      shapes already seen)
# The data cache is built on the CPU in the background during part 1. Prints a table per part; logs and JSON in $OUT.
#   SMOKE=1: tiny sizes on CPU (about 2 minutes on 2 busy cores).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
CACHE=${L3D_CACHE:-.l3d_cache}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

if [ "${SMOKE:-0}" = 1 ]; then
  DEV="--device cpu"; GPT=tiny; SEQ=128; TGT=64; NS=1500; VOCAB=1000; GB=16; STEPS=2; WARM=1; TB=512; TOK=256
  SHAPES="4x16,2x40,1x120"; PSIZES=1,2,4,8,16; PLENS=16,32,64,128; L1=120; L2=300
else
  DEV=""; GPT=1.3b; SEQ=2048; TGT=512; NS=20000; VOCAB=32000; GB=256; STEPS=4; WARM=1; TB=16384; TOK=4096
  SHAPES=""; PSIZES=1,2,4,8,16,32,64,128; PLENS=16,32,64,128,256,512,1024,1536,2048; L1=80; L2=380
fi

part() {  # name, time limit (s), lines to print (grep -E), command...: run it, print its rc, wall time and those lines
  local name=$1 limit=$2 show=$3 start rc
  shift 3
  start=$(date +%s)
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "== $name rc=$rc $(($(date +%s) - start))s (limit ${limit}s)"
  grep -E "$show" "$OUT/$name.log" | cut -c1-1200
  if [ "$rc" != 0 ]; then  # cut short: the rows it finished (the table comes only at the end), then its last lines
    grep '^{"model"' "$OUT/$name.log" | cut -c1-400
    tail -n 5 "$OUT/$name.log" | cut -c1-400
  fi
}

MT="--seq-length $SEQ --target-length $TGT --num-samples $NS --vocab-size $VOCAB --cache-dir $CACHE"
python benchmarks/dynamic/multitask_microbatching.py --prepare-only --model gpt $MT >"$OUT/prepare.log" 2>&1 &
PREPARE=$!

# --no-packed-flex: flex's compile does not fit this part's limit; dynamic_suite.sh's call times flex packing.
part shapes "$L1" '^\{' python benchmarks/dynamic/dynamic_shapes.py $DEV --preset "$GPT" --tokens "$TOK" --max-len "$SEQ" \
  ${SHAPES:+--model-shapes "$SHAPES"} --no-packed-flex

wait "$PREPARE"; echo "== prepare rc=$? $(tail -n 1 "$OUT/prepare.log" | cut -c1-200)"

part multitask_gpt "$L2" '^(\||\{"summary)' python benchmarks/dynamic/multitask_microbatching.py --engine direct --model gpt --preset "$GPT" $MT \
  --global-batch "$GB" --steps "$STEPS" --warmup "$WARM" --profile measure --profile-sizes "$PSIZES" \
  --profile-lens "$PLENS" --sdpa no_cudnn torch --repeat \
  --variants padding@4 packing@1 packing@2 token_budget@$TB dynamic@analytic dynamic --out "$OUT/multitask_gpt.json"
