#!/usr/bin/env bash
# Ours against Lightning's strategies on four GPUs, and T5 on four GPUs, on a 4-GPU host, in parts that each fit a
# 10-minute job
# (benchmarks/RESULTS.md has the results):
#   bash benchmarks/speed/multi_gpu_suite.sh OUT_DIR peers [REGIME]   # GPT-1.3B, seq 2048, compiled: Lightning DDPStrategy,
#                                                              # ModelParallelStrategy (FSDP2, FSDP2+TP) and ours in
#                                                              # every layout, side by side in one run
#   bash benchmarks/speed/multi_gpu_suite.sh OUT_DIR t5               # T5-770M in (2,2,1) and (1,2,2): tokens/s and MFU
# The full 3D layouts on an 8-GPU host:
#   bash benchmarks/speed/multi_gpu_suite.sh OUT_DIR full3d REGIME [LAYOUT ...]  # GPT-1.3B, eager, off vs all (CB + LEP + FE
#                                                              # + SC) per layout; default (2,2,2) (8,1,1) (2,4,1) (4,1,2) (1,4,2)
#   bash benchmarks/speed/multi_gpu_suite.sh OUT_DIR full3d-loss      # GPT-1.3B (2,2,2): 300 steps on real text, off vs all
#                                                              # (data: convergence.py prepare)
# Every system / layout runs in fresh processes; writes OUT_DIR/*.json and *.txt.
set -euo pipefail
out=$1; part=$2; shift 2
mkdir -p "$out"
case $part in
  peers)
    regime=${1:-nvlink}
    python benchmarks/speed/peers.py --preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 8 --gpus 4 \
        --regime "$regime" --systems ddp+compile fsdp@4,1+compile ours@4,1,1+compile ours@2,2,1+compile \
        ours@1,4,1+compile fsdp@2,2+compile ours@2,1,2+compile --warmup 2 --steps 6 --timeout "${PEER_TIMEOUT:-240}" \
        --out "$out/peers_1.3b_4gpu_${regime}.json" | tee "$out/peers_1.3b_4gpu_${regime}.txt" ;;
  t5)
    python benchmarks/parallel/train_throughput.py --model t5 --preset 770m --seq-length 512 --target-length 128 \
        --micro-batch-size 8 --num-microbatches 8 --layouts 2,2,1 1,2,2 --warmup 2 --steps 4 --timeout 100 \
        --out "$out/t5_770m_4gpu.json" | tee "$out/t5_770m_4gpu.txt" ;;
  full3d)
    # Eager: compiling per stage runs stage after stage at pp = 4 (see RESULTS.md), too slow for one 10-minute job.
    # --sc-warmup 1 with --warmup 2: the timed steps are PowerSGD steps, its first (allocating) one untimed.
    regime=${1:-nvlink}; shift || true
    layouts=("$@"); [[ ${#layouts[@]} -eq 0 ]] && layouts=(2,2,2 8,1,1 2,4,1 4,1,2 1,4,2)
    python benchmarks/parallel/train_throughput.py --preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 8 \
        --layouts "${layouts[@]}" --compression off all --sc-warmup 1 --warmup 2 --steps 4 --timeout 150 \
        --regime "$regime" --out "$out/full3d_1.3b_8gpu_${regime}.json" | tee "$out/full3d_1.3b_8gpu_${regime}.txt" ;;
  full3d-loss)
    python benchmarks/compression/convergence.py run --data benchmarks/.data --layout 2,2,2 --preset 1.3b --steps 300 --lr 3e-4 \
        --batch-size 16 --num-microbatches 4 --val-every 100 --val-batches 20 --concurrent --modes off all \
        --out "$out/full3d_loss_1.3b_2x2x2.json" ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
