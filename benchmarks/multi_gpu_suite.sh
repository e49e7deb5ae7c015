#!/usr/bin/env bash
# Issue 7's and issue 5's multi-GPU measurements on a 4-GPU host, in parts that each fit one device call
# (benchmarks/RESULTS.md has the results):
#   bash benchmarks/multi_gpu_suite.sh OUT_DIR peers [REGIME]   # GPT-1.3B, seq 2048, compiled: Lightning DDPStrategy,
#                                                              # ModelParallelStrategy (FSDP2, FSDP2+TP) and ours in
#                                                              # every layout, side by side in one run
#   bash benchmarks/multi_gpu_suite.sh OUT_DIR t5               # T5-770M in (2,2,1) and (1,2,2): tokens/s and MFU
# Every system / layout runs in fresh processes; writes OUT_DIR/*.json and *.txt.
set -euo pipefail
out=$1; part=$2; shift 2
mkdir -p "$out"
case $part in
  peers)
    regime=${1:-nvlink}
    python benchmarks/peers.py --preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 8 --gpus 4 \
        --regime "$regime" --systems ddp+compile fsdp@4,1+compile ours@4,1,1+compile ours@2,2,1+compile \
        ours@1,4,1+compile fsdp@2,2+compile ours@2,1,2+compile --warmup 2 --steps 6 --timeout "${PEER_TIMEOUT:-240}" \
        --out "$out/peers_1.3b_4gpu_${regime}.json" | tee "$out/peers_1.3b_4gpu_${regime}.txt" ;;
  t5)
    python benchmarks/train_throughput.py --model t5 --preset 770m --seq-length 512 --target-length 128 \
        --micro-batch-size 8 --num-microbatches 8 --layouts 2,2,1 1,2,2 --warmup 2 --steps 4 --timeout 100 \
        --out "$out/t5_770m_4gpu.json" | tee "$out/t5_770m_4gpu.txt" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
