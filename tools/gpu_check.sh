#!/usr/bin/env bash
# One device call: GPU test suite, then the engine and offload runs and a short benchmark.
# Usage (on the GPU machine, repo root): bash tools/gpu_check.sh [tests|gen|bench|all]...
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
what=${*:-all}
run() { echo "=== $*"; "$@"; echo "=== rc=$?"; }
for w in $what; do
  case $w in
    tests|all) run python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25 ;;
  esac
  case $w in
    gen|all)
      G="python3 -m nanoserve generate --model Qwen3-8B --dummy-weights --input-len 32768 --output-len 128"
      run $G 2>&1 | grep -v "it/s\]" | tee "$OUT/gen_resident.log"
      run $G --enable-offload --resident-layers 0 2>&1 | grep -v "it/s\]" | tee "$OUT/gen_offload_all.log"
      run $G --enable-offload --gpu-kv-budget 2.5 2>&1 | grep -v "it/s\]" | tee "$OUT/gen_offload_mixed.log" ;;
  esac
  case $w in
    bench|all) run python3 bench_offload.py --input-len 16384,32768 --output-len 64 --bench-all --out "$OUT" 2>&1 | grep -v "it/s\]" | tail -30 ;;
  esac
done
