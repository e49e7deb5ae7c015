#!/usr/bin/env bash
# The Optimus-CC benchmark suite of benchmarks/RESULTS.md on a 4-GPU host, in parts that each fit one device call:
#   bash benchmarks/compression_suite.sh OUT_DIR step-time nvlink ib   # (a) step time per technique, (c) peak memory
#   bash benchmarks/compression_suite.sh OUT_DIR step-time ethernet
#   bash benchmarks/compression_suite.sh OUT_DIR callbacks             # issue 4: overhead of each callback
#   bash benchmarks/compression_suite.sh OUT_DIR kernels               # (b) CB kernel throughput
#   bash benchmarks/compression_suite.sh OUT_DIR convergence           # (d) loss curves (data: convergence.py prepare)
set -euo pipefail
out=$1; part=$2; shift 2
mkdir -p "$out"
common=(--preset 350m --seq-length 1024 --micro-batch-size 4 --num-microbatches 8 --schedule 1f1b
        --precision bf16-mixed --warmup 4 --steps 10 --timeout 280)
case $part in
  step-time)
    for regime in "$@"; do
      # (1,4,1) has no data-parallel traffic: SC does not apply there.
      python benchmarks/train_throughput.py "${common[@]}" --regime "$regime" --layouts 1,4,1 \
          --compression off fe cb cb-nolep all --out "$out/step_time_${regime}_1x4x1.json"
      python benchmarks/train_throughput.py "${common[@]}" --regime "$regime" --layouts 2,2,1 \
          --compression off fe cb sc all --out "$out/step_time_${regime}_2x2x1.json"
    done ;;
  callbacks)
    python benchmarks/train_throughput.py "${common[@]}" --regime nvlink --layouts 2,2,1 --steps 12 \
        --compression all all+state all+diagnostics all+comm all+throughput all+timeline all+allcb \
        --out "$out/callback_overhead_2x2x1.json" ;;
  kernels)
    python benchmarks/compression_kernels.py --out "$out/compression_kernels_fp32.json"
    python benchmarks/compression_kernels.py --dtype bfloat16 --out "$out/compression_kernels_bf16.json" ;;
  convergence)
    python benchmarks/convergence.py run --data benchmarks/.data --layout 2,2,1 --preset 125m --steps 2000 \
        --batch-size 8 --num-microbatches 4 --val-every 250 --val-batches 40 --concurrent --modes off all \
        --out "$out/convergence_125m_2x2x1.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
