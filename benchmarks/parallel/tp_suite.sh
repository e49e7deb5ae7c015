#!/usr/bin/env bash
# Tensor parallelism on two GPUs, one job of <= 9.5 minutes, most important first; each step
# has its own time limit and writes under $OUT, and the summary at the end is what comes back.
#   1. correctness on the GPU machine's torch (its version differs from CI's): the tensor-parallel scenario
#      (tests/test_tensor_parallel.py: operators, layers, GPT and T5 plans, compiled stages, the backward overlap)
#   2. the backward overlap alone (benchmarks/parallel/tp_overlap.py): one column-parallel GEMM, overlap on and off, and again
#      with CUDA_DEVICE_MAX_CONNECTIONS=1
#   3. GPT-1.3B, micro-batch 8 x 2, compiled per block: dp = 2 and tp = 2 with the overlap, then tp = 2 without it
#      (L3D_TP_OVERLAP=0), the same shapes
#   4. T5-770M, compiled per block: dp = 2 against tp = 2 (the local-tensor plan)
# SUITE=sp runs the sequence-parallel rows instead (one job of about 6 minutes): tp_overlap.py (SP with the
# gathered input saved, the default, and with L3D_TP_SP_REGATHER=1), then GPT-1.3B tp = 2 compiled with SP ("tp2 SP")
# and with SP and async tensor parallelism ("tp2 SP async", L3D_TP_ASYNC=1: inductor's micro-pipeline TP pass on
# symmetric memory; its log lines say which collectives it fused), each against dp = 2 of the default suite.
# Usage on a machine with 2 (or more: the first two are used) GPUs: OUT=/some/dir bash benchmarks/parallel/tp_suite.sh
set -u
OUT=${OUT:?set OUT to a writable folder}
SUITE=${SUITE:-default}
export PYTHONPATH=$PWD OMP_NUM_THREADS=8 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
step() { echo "== $1 rc=$2 $(date +%T)" | tee -a "$OUT/steps.txt"; }
python -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.nccl.version())" \
    > "$OUT/versions.txt" 2>&1

GPT="--preset 1.3b --seq-length 2048 --micro-batch-size 8 --num-microbatches 2 --steps 6 --warmup 3 --compile default"
if [ "$SUITE" = sp ]; then
  timeout 100 python benchmarks/parallel/tp_overlap.py --out "$OUT/tp_overlap.json" > "$OUT/tp_overlap.txt" 2>&1
  step tp_overlap $?
  timeout 150 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --sequence-parallel --timeout 140 \
      --out "$OUT/tp2_sp.json" > "$OUT/tp2_sp.txt" 2>&1; step tp2_sp $?
  L3D_TP_ASYNC=1 TORCH_LOGS="+torch._inductor.fx_passes.micro_pipeline_tp" timeout 170 \
      python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --sequence-parallel --timeout 160 \
      --out "$OUT/tp2_sp_async.json" > "$OUT/tp2_sp_async.txt" 2>&1; step tp2_sp_async $?
  python - <<'PY'
import json, os, pathlib, re
out = pathlib.Path(os.environ["OUT"])
print((out / "versions.txt").read_text().strip())
print("tp_overlap", (out / "tp_overlap.txt").read_text()[-2000:] if (out / "tp_overlap.txt").exists() else "missing")
for name in ("tp2_sp", "tp2_sp_async"):
    path, text = out / f"{name}.json", out / f"{name}.txt"
    for r in json.loads(path.read_text())["results"] if path.exists() else []:
        ms = r["step_ms"]
        print(name, r["layout"], round(r["tokens_per_s"]), "tok/s", f"{r['mfu']:.3f}", "MFU",
              f"{ms['median']:.1f} [{ms['p10']:.1f}-{ms['p90']:.1f}] ms", r.get("peak_mem_gb"), "GB",
              "final loss", r.get("final_loss"))
    if text.exists():
        log = text.read_text()
        print(name, "fused matmul reduce-scatter log lines:", log.count("successfully fused matmul reduce scatter"),
              "| no patterns:", log.count("found no matching"), "| skipped:", len(re.findall(r"skipping \w+", log)))
        if not path.exists():
            print(name, "FAILED:", log[-1500:])
print((out / "steps.txt").read_text())
PY
  exit 0
fi

# 1. The CPU (gloo) scenario under this machine's torch; pytest if installed, else the scenario's raw report.
if python -c "import pytest" 2>/dev/null; then
  timeout 150 python -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py > "$OUT/tp_tests.txt" 2>&1
else
  timeout 150 python -c "
import json, tempfile
from pathlib import Path
from tests.launch import run_scenario
r = run_scenario(2, 'tensor_parallel', ['--world', '2'], Path(tempfile.mkdtemp()) / 'r.json', timeout=140)
print(json.dumps(r['ranks'][0])[:6000])" > "$OUT/tp_tests.txt" 2>&1
fi
step tp_tests $?

timeout 80 python benchmarks/parallel/tp_overlap.py --out "$OUT/tp_overlap.json" > "$OUT/tp_overlap.txt" 2>&1
step tp_overlap $?
CUDA_DEVICE_MAX_CONNECTIONS=1 timeout 70 python benchmarks/parallel/tp_overlap.py --out "$OUT/tp_overlap_c1.json" \
    > "$OUT/tp_overlap_c1.txt" 2>&1; step tp_overlap_c1 $?

timeout 260 python benchmarks/parallel/train_throughput.py $GPT --layouts 2,1,1 1,1,2 --timeout 125 \
    --out "$OUT/tp2_overlap.json" > "$OUT/tp2_overlap.txt" 2>&1; step tp2_overlap $?
L3D_TP_OVERLAP=0 timeout 130 python benchmarks/parallel/train_throughput.py $GPT --layouts 1,1,2 --timeout 125 \
    --out "$OUT/tp2_sync.json" > "$OUT/tp2_sync.txt" 2>&1; step tp2_sync $?

T5="--model t5 --preset 770m --seq-length 512 --target-length 128 --micro-batch-size 8 --num-microbatches 8"
timeout 200 python benchmarks/parallel/train_throughput.py $T5 --warmup 2 --steps 5 --compile default --layouts 2,1,1 1,1,2 \
    --timeout 95 --out "$OUT/t5_tp2_compiled.json" > "$OUT/t5_tp2_compiled.txt" 2>&1; step t5_tp2_compiled $?

python - <<'PY'
import json, os, pathlib
out = pathlib.Path(os.environ["OUT"])
print((out / "versions.txt").read_text().strip())
print("tp_tests", (out / "tp_tests.txt").read_text()[-2500:])
for name in ("tp_overlap", "tp_overlap_c1"):
    text = out / f"{name}.txt"
    if text.exists():
        print(name, text.read_text()[-2000:])
for name in ("tp2_overlap", "tp2_sync", "t5_tp2_compiled"):
    path = out / f"{name}.json"
    for r in json.loads(path.read_text())["results"] if path.exists() else []:
        ms = r["step_ms"]
        print(name, r["layout"], round(r["tokens_per_s"]), "tok/s", f"{r['mfu']:.3f}", "MFU",
              f"{ms['median']:.1f} [{ms['p10']:.1f}-{ms['p90']:.1f}] {{{ms['min']:.1f}-{ms['max']:.1f}}} ms",
              r.get("peak_mem_gb"), "GB")
    text = out / f"{name}.txt"
    if text.exists() and not path.exists():
        print(name, "FAILED:", text.read_text()[-1500:])
print((out / "steps.txt").read_text())
PY
