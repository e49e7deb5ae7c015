#!/usr/bin/env bash
# Ours against plain PyTorch on one GPU, in parts that each fit a 10-minute job (results: benchmarks/INDEX.md):
#   bash benchmarks/speed/single_gpu_suite.sh OUT_DIR mfu                 # GPT-1.3B, seq 2048: plain PyTorch vs ours, eager,
#                                                                   # compiled, autotuned (8 micro-batches per step)
#   bash benchmarks/speed/single_gpu_suite.sh OUT_DIR mfu-bar             # GPT-1.3B, seq 2048, compiled, 65,536 tokens per
#                                                                   # step at micro-batch 4, 8 and 16 (the 60 % bar)
#   bash benchmarks/speed/single_gpu_suite.sh OUT_DIR sweep 125m 350m     # per preset, seq 1024 and 2048 (SWEEP_SEQS): ours
#                                                                   # with/without torch.compile, activation checkpointing
# Writes OUT_DIR/*.json and *.txt; every system runs in fresh processes (benchmarks/speed/peers.py).
set -euo pipefail
out=$1; part=$2; shift 2
mkdir -p "$out"
case $part in
  mfu)
    python benchmarks/speed/peers.py --preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 8 \
        --systems plain plain+compile ours@1,1,1 ours@1,1,1+compile ours@1,1,1+autotune --warmup 3 --steps 10 \
        --timeout 400 --out "$out/mfu_1.3b.json" | tee "$out/mfu_1.3b.txt" ;;
  mfu-bar)
    for mb in 4 8 16; do
      extra=(); [[ $mb == 4 ]] && extra=(plain+compile+fp32res)  # the model before the bf16 residual stream
      python benchmarks/speed/peers.py --preset 1.3b --seq-length 2048 --micro-batch-size "$mb" --num-microbatches $(( 32 / mb )) \
          --systems "${extra[@]}" plain+compile ours@1,1,1+compile --warmup 3 --steps 8 --timeout 130 \
          --out "$out/mfu_1.3b_mb${mb}.json" | tee "$out/mfu_1.3b_mb${mb}.txt"
    done ;;
  sweep)
    for preset in "$@"; do
      for seq in ${SWEEP_SEQS:-1024 2048}; do
        mb=$(( 8192 / seq ))  # 8192 tokens per micro-batch at both lengths
        python benchmarks/speed/peers.py --preset "$preset" --seq-length "$seq" --micro-batch-size "$mb" \
            --systems ours@1,1,1 ours@1,1,1+compile ours@1,1,1+ckpt ours@1,1,1+compile+ckpt --warmup 3 --steps 8 \
            --timeout 300 --out "$out/sweep_${preset}_${seq}.json" | tee "$out/sweep_${preset}_${seq}.txt"
      done
    done ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
