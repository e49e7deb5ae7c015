#!/usr/bin/env bash
# One GPU: our step against what a user would train with instead, side by side per part
# (benchmarks/speed/peers.py: fresh processes per system, same tokens, weights, micro-batch and accumulation, bf16 autocast,
# fused AdamW; tokens/s, TFLOP/s, MFU, step time median [p10-p90] {min-max}, peak memory, allocator retries and
# torch.compile's graph/break/recompile counts per system):
#   bash benchmarks/speed/single_gpu_speed.sh OUT_DIR [PART ...]        default parts: gpt4 gpt16 t5, in that order
#     gpt4   GPT-1.3B, seq 2048, 4 x 8 accumulated: plain PyTorch compiled whole (model and loss), ours compiled per
#            stage with the fused chunked head/loss, ours compiled per block (as before); if time is left: ours per
#            block with the fused head/loss, transformers GPT2LMHeadModel (SDPA) compiled whole
#     gpt16  GPT-1.3B, seq 2048, 16 x 2: plain compiled whole, ours per stage + fused head/loss; then ours per block
#     t5     T5-770M (v1.0), 512 + 128, 8 x 8: transformers T5ForConditionalGeneration compiled whole, ours compiled
#            per stage, ours per block (our T5 rows run SDPA attention unless +explicit); then ours without
#            gradient-accumulation fusion (its per-linear custom op is host work). --profile: each system's log ends with a kernel table of two extra steps (device vs host)
#     t5v    the T5 variants, same shapes, most decisive first: transformers compiled whole; ours per
#            stage with SDPA attention and gradient-accumulation fusion; our model and loss compiled whole in a plain
#            loop replayed as CUDA graphs (what the host's launches cost); ours per stage without fusion; the same
#            replayed as CUDA graphs (an experiment, not a recipe option); ours per stage with the explicit attention
#            (before); our model compiled whole in a plain loop (what the strategy costs). --profile, and a digest of
#            each system's profile on stdout (the kernels' share of the step, top kernels and host ops). A system
#            takes minutes (cold compile), so one job runs two or three: T5V_SYSTEMS="..." replaces the list
#            (peers.py system names) to run the rest in further jobs on the same machine.
# Each system is a fresh process with a cold compile (about 1-2 min for a whole-model or whole-stage graph of these
# sizes, under 1 min per block), so all three parts take about 15 minutes: run them as two jobs,
#   bash benchmarks/speed/single_gpu_speed.sh "$OUT" gpt4 gpt16     and     bash benchmarks/speed/single_gpu_speed.sh "$OUT" t5
# and t5v alone, in calls of two or three systems (see t5v above).
# Time: a run ends within SPEED_BUDGET_S seconds (default 525, for a 10-minute job): the budget is shared by
# the parts asked for in the weights gpt4 4, gpt16 3, t5 4, t5v 5 as cumulative deadlines (time a part leaves unused goes to
# the next), each system gets the time left before its part's deadline (at most SYSTEM_TIMEOUT_S, default 300), and a
# system with under 45 s left (t5v: T5V_MIN_SYSTEM_S, default 170) is skipped and listed as such. Within a part the
# systems run most decisive first.
# Results: OUT_DIR/speed_<part>.json and .txt, worker logs in OUT_DIR/speed_<part>_logs/.
# SPEED_CPU=1: the same lists on CPU with tiny presets (tests/test_benchmarks.py), compile backend aot_eager.
set -uo pipefail  # not -e: a part that fails must not cost the parts after it
out=${1:?usage: single_gpu_speed.sh OUT_DIR [gpt4|t5|gpt16 ...]}; shift
parts=("$@"); [[ ${#parts[@]} -eq 0 ]] && parts=(gpt4 gpt16 t5)
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
budget=${SPEED_BUDGET_S:-525}
start=$(date +%s)
declare -A weight=([gpt4]=4 [gpt16]=3 [t5]=4 [t5v]=5)
total=0
for part in "${parts[@]}"; do
  [[ -v "weight[$part]" ]] || { echo "unknown part $part (gpt4, gpt16, t5, t5v)" >&2; exit 2; }
  total=$(( total + weight[$part] ))
done
done_weight=0

if [[ ${SPEED_CPU:-0} == 1 ]]; then
  export L3D_COMPILE_BACKEND=aot_eager OMP_NUM_THREADS=1
  gpt=(--accelerator cpu --preset tiny --vocab-size 4096 --seq-length 32 --warmup 1 --steps 1)
  t5=(--accelerator cpu --preset tiny --vocab-size 512 --seq-length 32 --target-length 8 --warmup 1 --steps 1)
  t5v=("${t5[@]}" --profile)
  mb4=(--micro-batch-size 2 --num-microbatches 2); mb16=(--micro-batch-size 4 --num-microbatches 1)
  mb_t5=(--micro-batch-size 2 --num-microbatches 2)
else
  gpt=(--preset 1.3b --seq-length 2048 --warmup 2 --steps 3)
  t5=(--preset 770m --seq-length 512 --target-length 128 --warmup 2 --steps 4 --profile)
  # A T5-770M system compiled per stage or whole needs minutes (a cold compile of 48 blocks; benchmarks/RESULTS.md has
  # the wall times): one started with less time left would only time out, so t5v skips it (listed as skipped).
  t5v=("${t5[@]}" --min-system-s "${T5V_MIN_SYSTEM_S:-170}")
  mb4=(--micro-batch-size 4 --num-microbatches 8); mb16=(--micro-batch-size 16 --num-microbatches 2)
  mb_t5=(--micro-batch-size 8 --num-microbatches 8)
fi

run_part() {
  local part=$1; shift
  done_weight=$(( done_weight + weight[$part] ))
  local deadline=$(( start + budget * done_weight / total ))
  echo "== $part: until $(date -u -d "@$deadline" +%H:%M:%S) UTC ($(( deadline - $(date +%s) )) s)"
  python "$here/benchmarks/speed/peers.py" "$@" --timeout "${SYSTEM_TIMEOUT_S:-300}" --deadline "$deadline" \
      --out "$out/speed_$part.json" | tee "$out/speed_$part.txt"
}

for part in "${parts[@]}"; do
  case $part in
    gpt4) run_part gpt4 "${gpt[@]}" "${mb4[@]}" \
            --systems plain+whole ours@1,1,1+compile+stage+fusedce ours@1,1,1+compile ours@1,1,1+compile+fusedce \
                      hf+compile ;;
    t5) run_part t5 --model t5 "${t5[@]}" "${mb_t5[@]}" \
            --systems hf+compile ours@1,1,1+compile+stage ours@1,1,1+compile ours@1,1,1+compile+nofuse ;;
    t5v) systems=(hf+compile ours@1,1,1+compile+stage plain+whole+cudagraphs ours@1,1,1+compile+stage+nofuse
                  ours@1,1,1+compile+stage+nofuse+cudagraphs ours@1,1,1+compile+stage+explicit plain+whole)
         [[ -n ${T5V_SYSTEMS:-} ]] && read -ra systems <<< "$T5V_SYSTEMS"
         run_part t5v --model t5 "${t5v[@]}" "${mb_t5[@]}" --systems "${systems[@]}" ;;
    gpt16) run_part gpt16 "${gpt[@]}" "${mb16[@]}" \
            --systems plain+whole ours@1,1,1+compile+stage+fusedce ours@1,1,1+compile ;;
    *) echo "unknown part $part (gpt4, gpt16, t5, t5v)" >&2; exit 2 ;;
  esac
done
echo "== done in $(( $(date +%s) - start )) s; JSON: $out/speed_*.json"
