#!/usr/bin/env bash
# Four-GPU checks and measurements that fit one 10-minute job, most important first; every step has its
# own time limit, so one that runs out leaves the others' results intact. A remote job often brings back few files, so the
# results that matter are printed at the end.
#   tp:       ours dp vs tp vs ModelParallelStrategy at 2 and 4 GPUs, a profiled sequence-parallel
#             tp = 2 step, the transport on NCCL again
#   lanes, lanes1: independent jobs side by side on disjoint GPUs (see each part)
#   zb4, zb8: zero-bubble schedules (zb_h1, zb_interleaved) against 1F1B and interleaved 1F1B at (1,4,1) and (1,2,2)
#   diagnose: the pipeline transport on NCCL, NCCL collective times (2 and 4 GPUs), a profiled tp = 2 step,
#             tp = 4, dp = 4 with and without sharded optimizer state, context-parallel scaling at cp = 1, 2, 4
# Usage on a 4-GPU machine: OUT=/some/dir bash benchmarks/parallel/four_gpu_suite.sh diagnose
set -u
OUT=${OUT:?set OUT to a writable folder}
part=${1:-diagnose}
export PYTHONPATH=$PWD OMP_NUM_THREADS=8 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.csv" 2>&1
python -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.nccl.version())" \
    > "$OUT/versions.txt" 2>&1
step() { echo "== $1 rc=$2 $(date +%T)" | tee -a "$OUT/steps.txt"; }
GPT="--preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 4 --steps 5 --warmup 2"

case $part in
  diagnose)
    CUDA_VISIBLE_DEVICES=0,1 L3D_TEST_DEVICE=cuda timeout 100 python -m tests.scenarios.transport_gpu \
        --out "$OUT/transport" --budget 90 > "$OUT/transport.log" 2>&1; step transport $?
    timeout 60 python -c "
import json
from lightning_3d.planner.profile import measure_collectives
d = measure_collectives(4, sizes=(2**22, 2**25, 2**27))
print(json.dumps({k: d[k] for k in ('all_reduce', 'reduce_scatter', 'all_gather', 'p2p')}))" > "$OUT/collectives.txt" 2>&1
    step collectives $?
    timeout 100 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --compression fe --profile --timeout 90 \
        --out "$OUT/tp2_profile.json" > "$OUT/tp2_profile.txt" 2>&1; step tp2_profile $?
    timeout 130 python benchmarks/parallel/train_throughput.py $GPT --layouts 4,1,1 --compression fe fe-sharded --timeout 70 \
        --out "$OUT/dp4.json" > "$OUT/dp4.txt" 2>&1; step dp4 $?
    timeout 75 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,4 --compression fe --timeout 70 \
        --out "$OUT/tp4.json" > "$OUT/tp4.txt" 2>&1; step tp4 $?
    timeout 125 python benchmarks/parallel/context_parallel_scaling.py --preset 1.3b --seq 65536 --cp 1 2 4 --steps 2 --warmup 1 \
        --timeout 60 --out "$OUT/cp_scaling.json" > "$OUT/cp_scaling.txt" 2>&1; step cp_scaling $?
    ;;
  tp)
    # After the local optimizer step and bf16 collectives: dp against tp and Lightning's
    # ModelParallelStrategy (FSDP2 + TP), side by side per GPU count (eager, the same micro-batches per replica).
    PEERS="--preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 4 --warmup 2 --steps 5 --timeout 110"
    timeout 200 python benchmarks/speed/peers.py $PEERS --gpus 2 --systems ours@2,1,1 ours@1,1,2 fsdp@1,2 \
        --out "$OUT/peers_tp2.json" > "$OUT/peers_tp2.txt" 2>&1; step peers_tp2 $?
    timeout 250 python benchmarks/speed/peers.py $PEERS --gpus 4 --systems ours@4,1,1 ours@1,1,4 fsdp@1,4 ours@2,1,2 \
        --out "$OUT/peers_tp4.json" > "$OUT/peers_tp4.txt" 2>&1; step peers_tp4 $?
    timeout 90 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --sequence-parallel --compression fe \
        --profile --timeout 80 --out "$OUT/tp2_profile.json" > "$OUT/tp2_profile.txt" 2>&1; step tp2_sp_profile $?
    CUDA_VISIBLE_DEVICES=0,1 L3D_TEST_DEVICE=cuda timeout 100 python -m tests.scenarios.transport_gpu \
        --out "$OUT/transport" --budget 90 > "$OUT/transport.log" 2>&1; step transport $?
    ;;
  lanes)
    # Independent jobs side by side on disjoint GPUs (one host: each lane has its own GPUs and NVLink pairs; the
    # host's 64 cores are shared): GPU 0 the one-GPU long-sequence sweep, GPUs 2,3 tp = 2 against dp = 2
    # after the local-leaf gradients, the transport's layouts on NCCL, cp = 2 at 128k tokens.
    # GPU 1: the planner's one-GPU validation on GPT-350M.
    ( CUDA_VISIBLE_DEVICES=0 timeout 480 python benchmarks/parallel/long_sequence.py --find-longest --time-budget 440 \
        --out "$OUT/long_sequence.json" > "$OUT/long_sequence.txt" 2>&1; step long_sequence $? ) &
    ( CUDA_VISIBLE_DEVICES=1 timeout 480 python benchmarks/planner/planner_validate.py --suite one --models gpt_350m \
        --budget-s 440 --out "$OUT/planner_one.json" > "$OUT/planner_one.txt" 2>&1; step planner_one $? ) &
    PEERS="--preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 4 --warmup 2 --steps 5 --timeout 110"
    ( export CUDA_VISIBLE_DEVICES=2,3
      timeout 170 python benchmarks/speed/peers.py $PEERS --gpus 2 --systems ours@2,1,1 ours@1,1,2 \
          --out "$OUT/peers_tp2.json" > "$OUT/peers_tp2.txt" 2>&1; step peers_tp2 $?
      timeout 80 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --sequence-parallel --compression fe \
          --timeout 70 --out "$OUT/tp2_sp.json" > "$OUT/tp2_sp.txt" 2>&1; step tp2_sp $?
      L3D_TEST_DEVICE=cuda timeout 80 python -m tests.scenarios.transport_gpu --out "$OUT/transport" --budget 70 \
          --only layouts > "$OUT/transport.log" 2>&1; step transport $?
      timeout 120 python benchmarks/parallel/context_parallel_scaling.py --preset 1.3b --seq 131072 --cp 2 --steps 2 \
          --warmup 1 --timeout 110 --out "$OUT/cp_scaling.json" > "$OUT/cp_scaling.txt" 2>&1; step cp128k $? ) &
    wait
    ;;
  lanes1)
    # Four one-GPU jobs side by side, each on its own GPU, within ~5 minutes:
    # GPU 0 our long-sequence sweep (the plain model's runs in the lanes part), GPU 1 the planner's one-GPU
    # validation on GPT-350M, GPU 2 the dynamic cost model's accuracy with a measured profile and the plan
    # hand-off, GPU 3 GPT-1.3B on the multi-task mix under each micro-batching.
    T=${LANE_S:-270}
    MT="--seq-length 2048 --target-length 512 --num-samples 20000 --vocab-size 32000 --cache-dir .l3d_cache"
    ( CUDA_VISIBLE_DEVICES=0 timeout $T python benchmarks/parallel/long_sequence.py --systems ours --find-longest \
        --time-budget $((T - 30)) --out "$OUT/long_sequence.json" > "$OUT/long_sequence.txt" 2>&1; step long_sequence $? ) &
    ( CUDA_VISIBLE_DEVICES=1 timeout $T python benchmarks/planner/planner_validate.py --suite one --models gpt_350m \
        --budget-s $((T - 30)) --out "$OUT/planner_one.json" > "$OUT/planner_one.txt" 2>&1; step planner_one $? ) &
    ( CUDA_VISIBLE_DEVICES=2 timeout $T python benchmarks/dynamic/dynamic_gpu.py --preset 1.3b --vocab-size 32000 \
        --max-seq-len 2048 --tokens 32768 --batches 20 --parts accuracy waits --profile measure \
        --profile-sizes 1,2,4,8,16,32 --profile-lens 64,256,1024,2048 --profile-repeats 2 --wait-steps 200 \
        --wait-tokens 8192 --workers 2 --out "$OUT/dynamic_gpu.json" > "$OUT/dynamic_gpu.txt" 2>&1; step dynamic_gpu $? ) &
    ( export CUDA_VISIBLE_DEVICES=3
      python benchmarks/dynamic/multitask_microbatching.py --prepare-only --model gpt $MT > "$OUT/prepare.txt" 2>&1
      timeout $((T - 70)) python benchmarks/dynamic/multitask_microbatching.py --engine direct --model gpt --preset 1.3b $MT \
        --global-batch 256 --steps 4 --warmup 1 --profile none \
        --variants padding@4 packing@1 packing@2 token_budget@16384 dynamic --out "$OUT/multitask_gpt.json" \
        > "$OUT/multitask_gpt.txt" 2>&1; step multitask_gpt $? ) &
    wait
    for name in dynamic_gpu multitask_gpt; do
      echo "== $name"; grep '^{' "$OUT/$name.txt" | cut -c1-900; tail -n 4 "$OUT/$name.txt"
    done
    ;;
  tplanes)
    # Two lanes of two GPUs. GPUs 0,1: GPT-1.3B dp = 2 against tp = 2 at the same micro-batch 8 x 2,
    # compiled per block (the tensor-parallel graphs on the local leaves), then sequence parallelism compiled.
    # GPUs 2,3: T5-770M tensor parallelism on local tensors against torch's DTensor plan and dp = 2 (eager), then
    # dynamic micro-batching of GPT-1.3B at pp = 2 (dp = 1) on the multi-task mix.
    T8="--preset 1.3b --seq-length 2048 --micro-batch-size 8 --num-microbatches 2 --steps 6 --warmup 3"
    T5="--model t5 --preset 770m --seq-length 512 --target-length 128 --micro-batch-size 8 --num-microbatches 8 --warmup 2 --steps 5"
    ( export CUDA_VISIBLE_DEVICES=0,1
      timeout 330 python benchmarks/parallel/train_throughput.py $T8 --layouts 2,1,1 1,1,2 --compile default --timeout 160 \
          --out "$OUT/tp2_mb8.json" > "$OUT/tp2_mb8.txt" 2>&1; step tp2_mb8 $?
      timeout 200 python benchmarks/parallel/train_throughput.py $T8 --layouts 1,1,2 --sequence-parallel --compile default \
          --timeout 190 --out "$OUT/tp2_sp.json" > "$OUT/tp2_sp.txt" 2>&1; step tp2_sp $? ) &
    ( export CUDA_VISIBLE_DEVICES=2,3
      timeout 200 python benchmarks/parallel/train_throughput.py $T5 --layouts 2,1,1 1,1,2 --timeout 95 \
          --out "$OUT/t5_tp2.json" > "$OUT/t5_tp2.txt" 2>&1; step t5_tp2 $?
      L3D_TP_IMPLEMENTATION=dtensor timeout 100 python benchmarks/parallel/train_throughput.py $T5 --layouts 1,1,2 --timeout 95 \
          --out "$OUT/t5_tp2_dtensor.json" > "$OUT/t5_tp2_dtensor.txt" 2>&1; step t5_tp2_dtensor $?
      NPROC=2 PPS=2 MODELS=gpt:1.3b:2048:512 LIMIT=130 OUT="$OUT/dyn" timeout 220 bash benchmarks/dynamic/dynamic_multi_gpu.sh \
          > "$OUT/dyn_pp2.txt" 2>&1; step dyn_pp2 $? ) &
    wait
    cat "$OUT/dyn_pp2.txt" 2>/dev/null | tail -n 20
    ;;
  zb4|zb8)
    # Zero-bubble schedules against 1F1B and interleaved 1F1B at (1,4,1) and (1,2,2), m = 4 (zb4) or 8 (zb8) micro-
    # batches of 2 x 2048, compiled per block; peak memory beside each (the goal compares at equal memory). One
    # invocation per schedule runs both layouts, each in fresh processes.
    m=${part#zb}
    Z="--preset 1.3b --seq-length 2048 --micro-batch-size 2 --num-microbatches $m --steps 5 --warmup 2 --compile default"
    for sched in 1f1b zb_h1 "interleaved_1f1b --virtual-stages 2" "zb_interleaved --virtual-stages 2"; do
      name=${sched%% *}
      timeout 140 python benchmarks/parallel/train_throughput.py $Z --layouts 1,4,1 1,2,2 --schedule $sched --timeout 65 \
          --out "$OUT/${part}_$name.json" > "$OUT/${part}_$name.txt" 2>&1; step "${part}_$name" $?
    done
    for f in "$OUT/${part}"_*.txt; do tail -n 5 "$f"; done
    ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac

python - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
print((out / "gpus.csv").read_text(), (out / "versions.txt").read_text())
for name in ("collectives.txt",):
    if (out / name).exists():
        print(name, (out / name).read_text()[-3000:])
for name in ("tp2_profile", "dp4", "tp4", "tp2_sp", "tp2_mb8", "t5_tp2", "t5_tp2_dtensor"):
    path = out / f"{name}.json"
    for r in json.loads(path.read_text())["results"] if path.exists() else []:
        print(name, r["layout"], r["variant"], round(r["tokens_per_s"]), "tok/s", f"{r['mfu']:.3f}", "MFU",
              r["step_ms"], "ms", r.get("peak_mem_gb"), "GB")
    text = out / f"{name}.txt"
    if text.exists() and not path.exists():
        print(name, "FAILED:", text.read_text()[-1500:])
for log in sorted(out.glob("tp2_profile_logs/*rank0.log")):  # rank 0 prints the profiler's tables into its log
    text = log.read_text()
    if "PROFILE" in text:
        print(log.name, text[text.index("PROFILE"):][:9000])
for name in ("peers_tp2", "peers_tp4"):
    if (out / f"{name}.txt").exists():  # peers.py ends its output with the side-by-side table
        print(name, (out / f"{name}.txt").read_text()[-2500:])
if (out / "planner_one.txt").exists():
    text = (out / "planner_one.txt").read_text()
    print("planner_one", text[-3500:])
if (out / "long_sequence.txt").exists():
    print("long_sequence", (out / "long_sequence.txt").read_text()[-3500:])
path = out / "cp_scaling.json"
if path.exists():
    print("cp_scaling", path.read_text()[:3000])
elif (out / "cp_scaling.txt").exists():
    print("cp_scaling FAILED:", (out / "cp_scaling.txt").read_text()[-1500:])
summary = out / "transport" / "summary.json"  # last: the output's tail is what surely comes back
if summary.exists():
    for key, run in json.loads(summary.read_text()).items():
        error = str(run.get("error", run))
        lines = [l for l in error.splitlines() if any(w in l for w in ("Error", "error", "assert", "FAILED", "rank"))]
        print("transport", key, "ok" if "report" in run else error[:1500] + "\n...\n" + "\n".join(lines[-25:]),
              run.get("seconds"))
PY
