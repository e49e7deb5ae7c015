#!/usr/bin/env bash
# The Optimus-CC benchmark suite (benchmarks/INDEX.md, compression) on a 4-GPU host, in parts that each fit a 10-minute job:
#   bash benchmarks/compression/compression_suite.sh OUT_DIR step-time nvlink ib ethernet  # (a) step time per technique
#   bash benchmarks/compression/compression_suite.sh OUT_DIR step-time-sc nvlink ib ethernet  # (a) SC only: (2,2,1), off/sc/all/all-stages
#   bash benchmarks/compression/compression_suite.sh OUT_DIR memory                # (c) peak memory, one variant per launch
#   bash benchmarks/compression/compression_suite.sh OUT_DIR step-time-2gpu nvlink ib  # the same on a 2-GPU host: (1,2,1), (2,1,1)
#   bash benchmarks/compression/compression_suite.sh OUT_DIR kernels               # (b) CB kernel throughput
#   bash benchmarks/compression/compression_suite.sh OUT_DIR sc-kernels            # SC compute per step: torch's hook vs ours
#   bash benchmarks/compression/compression_suite.sh OUT_DIR convergence           # (d) loss curves (data: convergence.py prepare)
# Every variant of a layout runs in the same worker processes, one after the other (fresh model and strategy).
set -euo pipefail
out=$1; part=$2; shift 2
mkdir -p "$out"
common=(--preset 350m --seq-length 1024 --micro-batch-size 4 --num-microbatches 8 --schedule 1f1b
        --precision bf16-mixed --warmup 3 --steps 10 --timeout 150)
case $part in
  step-time)
    for regime in "$@"; do
      # (1,4,1) has no data-parallel traffic: SC does not apply there.
      python benchmarks/parallel/train_throughput.py "${common[@]}" --regime "$regime" --layouts 1,4,1 \
          --compression off cb cb-every all --out "$out/step_time_${regime}_1x4x1.json"
      python benchmarks/parallel/train_throughput.py "${common[@]}" --regime "$regime" --layouts 2,2,1 \
          --compression off fe cb cb-every sc all all-stages --out "$out/step_time_${regime}_2x2x1.json"
    done ;;
  step-time-sc)
    for regime in "$@"; do
      python benchmarks/parallel/train_throughput.py "${common[@]}" --regime "$regime" --layouts 2,2,1 \
          --compression off sc all all-stages --out "$out/step_time_sc_${regime}_2x2x1.json"
    done ;;
  memory)
    # Variants in one process group leave memory behind (allocator state), so each runs in a launch of its own.
    for mode in off cb cb-lep cb-every; do
      python benchmarks/parallel/train_throughput.py "${common[@]}" --steps 3 --layouts 1,4,1 --compression "$mode" \
          --out "$out/memory_1x4x1_${mode}.json"
    done ;;
  step-time-2gpu)
    for regime in "$@"; do
      extra=()
      [[ $regime == nvlink ]] && extra=(all+state all+diagnostics all+comm all+throughput all+timeline all+allcb)
      python benchmarks/parallel/train_throughput.py "${common[@]}" --regime "$regime" --layouts 1,2,1 \
          --compression off fe cb all "${extra[@]}" --out "$out/step_time_${regime}_1x2x1.json"
      python benchmarks/parallel/train_throughput.py "${common[@]}" --regime "$regime" --layouts 2,1,1 \
          --compression off sc all --out "$out/step_time_${regime}_2x1x1.json"
    done ;;
  kernels)
    python benchmarks/compression/compression_kernels.py --out "$out/compression_kernels_fp32.json"
    python benchmarks/compression/compression_kernels.py --dtype bfloat16 --out "$out/compression_kernels_bf16.json" ;;
  sc-kernels)  # one GPU
    for preset in 350m 1.3b; do
      python benchmarks/compression/sc_kernels.py --preset "$preset" --pp 2 --ranks 32 64 128 --out "$out/sc_kernels_${preset}.json"
    done ;;
  convergence)
    layout=${CONV_LAYOUT:-2,2,1}; preset=${CONV_PRESET:-125m}
    python benchmarks/compression/convergence.py run --data benchmarks/.data --layout "$layout" --preset "$preset" --steps 2000 \
        --batch-size 8 --num-microbatches 4 --val-every 250 --val-batches 40 --concurrent --modes ${CONV_MODES:-off sc all} \
        --out "$out/convergence_${preset}_${layout//,/x}.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
