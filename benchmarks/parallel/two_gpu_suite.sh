#!/usr/bin/env bash
# Two-GPU checks and measurements that fit one short job, most important first; every step has its own
# time limit and writes under $OUT, so a step that runs out of time leaves the earlier results intact.
#   1. the pipeline transport on NCCL (tests/scenarios/transport_gpu.py: ordered per-pipeline stream, CB posted ahead,
#      every 2-process layout against one process)
#   2. GPT-1.3B at dp = 2 (unsharded and with shard_optimizer_state) and at tp = 2 (local-tensor layers, then torch's
#      DTensor plan as the baseline), per-GPU tokens/s, MFU and peak memory (benchmarks/parallel/train_throughput.py)
#   3. ring / Ulysses attention on CUDA with NCCL against full attention (tests/scenarios/context.py)
# Usage on a 2-GPU machine: OUT=/some/dir bash benchmarks/parallel/two_gpu_suite.sh
set -u
OUT=${OUT:?set OUT to a writable folder}
export PYTHONPATH=$PWD OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv" 2>&1
python -c "import torch, lightning; print(torch.__version__, lightning.__version__)" > "$OUT/versions.txt" 2>&1

L3D_TEST_DEVICE=cuda timeout 125 python -m tests.scenarios.transport_gpu --out "$OUT/transport" --budget 110 \
    > "$OUT/transport.log" 2>&1; echo "transport rc=$?" >> "$OUT/steps.txt"

COMMON="--preset 1.3b --seq-length 2048 --micro-batch-size 4 --num-microbatches 4 --steps 6 --warmup 2 --timeout 70"
timeout 150 python benchmarks/parallel/train_throughput.py $COMMON --layouts 2,1,1 --compression fe fe-sharded \
    --out "$OUT/dp2_sharded_1.3b.json" > "$OUT/dp2_sharded_1.3b.txt" 2>&1; echo "dp2 rc=$?" >> "$OUT/steps.txt"
timeout 75 python benchmarks/parallel/train_throughput.py $COMMON --layouts 1,1,2 --compression fe \
    --out "$OUT/tp2_local_1.3b.json" > "$OUT/tp2_local_1.3b.txt" 2>&1; echo "tp2 local rc=$?" >> "$OUT/steps.txt"
L3D_TP_IMPLEMENTATION=dtensor timeout 75 python benchmarks/parallel/train_throughput.py $COMMON --layouts 1,1,2 --compression fe \
    --out "$OUT/tp2_dtensor_1.3b.json" > "$OUT/tp2_dtensor_1.3b.txt" 2>&1; echo "tp2 dtensor rc=$?" >> "$OUT/steps.txt"

L3D_TEST_DEVICE=cuda timeout 60 python -c "
import json, os
from pathlib import Path
from tests.launch import run_scenario
r = run_scenario(2, 'context', ['--world', '2'], Path(os.environ['OUT']) / 'context_cuda.json', timeout=55)
print(json.dumps(r)[:3000])" > "$OUT/context_cuda.log" 2>&1; echo "context rc=$?" >> "$OUT/steps.txt"
cat "$OUT/steps.txt"
# A remote job often brings back only a few files: print the results that matter, so they come back in the output.
python - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
summary = out / "transport" / "summary.json"
if summary.exists():
    for key, run in json.loads(summary.read_text()).items():
        print("transport", key, "ok" if "report" in run else run.get("error", run)[:400], run.get("seconds"))
for name in ("dp2_sharded_1.3b", "tp2_local_1.3b", "tp2_dtensor_1.3b"):
    path = out / f"{name}.json"
    for r in json.loads(path.read_text())["results"] if path.exists() else []:
        print(name, r["layout"], r["variant"], round(r["tokens_per_s"]), "tok/s", f"{r['mfu']:.3f}", "MFU",
              r["step_ms"]["median"], "ms", r.get("peak_mem_gb"), "GB")
PY
