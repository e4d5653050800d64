#!/usr/bin/env bash
# One device call: GPU test suite, needle runs, engine runs and benchmarks.
# Usage (on the GPU machine, repo root):
#   bash tools/gpu_check.sh [tests|needle|gen|bench|prefill|profile|sweep|sampling|models|moe]...
# Server tests need fastapi/uvicorn/openai: carry them as wheels in .whl (see README, GPU notes).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
what=${*:-tests needle gen bench}
run() { echo "=== $*"; "$@"; echo "=== rc=$?"; }
B="python3 bench_offload.py --model Qwen3-8B --output-len 64"
for w in $what; do
  case $w in
    tests) run python3 -m pytest -q -m gpu tests -p no:cacheprovider -s 2>&1 \
             | grep -v "it/s\]" | tee "$OUT/pytest_gpu.log" | grep -E "passed|failed|FAIL|Error|tokens_per_s|^E  |^ *[0-9.]+ +[0-9]+ +(PASS|FAIL)" | tail -60 ;;
    needle)
      for m in "--enable-offload --use-cuda-graph" "--enable-offload --enforce-eager" "--use-cuda-graph"; do
        run python3 tests/test_needle.py --input-len 32768 --depths 0,0.1,...,1 $m 2>&1 | tail -15 | tee -a "$OUT/needle.log"
      done ;;
    gen)
      G="python3 -m nanoserve generate --model Qwen3-8B --dummy-weights --input-len 32768 --output-len 128"
      run $G 2>&1 | grep -v "it/s\]" | tail -4 | tee "$OUT/gen_resident.log"
      run $G --enable-offload --resident-layers 0 2>&1 | grep -v "it/s\]" | tail -4 | tee "$OUT/gen_offload_all.log" ;;
    bench) run $B --input-len 4096,16384,32768,131072 --bench-all --compare-hf --out "$OUT" 2>&1 \
             | grep -v "it/s\]" | tail -45 ;;
    prefill)  # issue 16: TTFT vs the FLOP floor and transformers; batch 64 x 512 prefill rate
      run $B --input-len 4096,16384,32768,131072 --output-len 8 --resident-graph --compare-hf \
        --out "$OUT/prefill" 2>&1 | grep -v "it/s\]" | tail -16
      run $B --input-len 512 --batch-size 64 --output-len 32 --resident-graph \
        --out "$OUT/prefill64" 2>&1 | grep -v "it/s\]" | tail -6 ;;
    profile)  # a step's kernel time by category (docs/perf-notes.md)
      run python3 tools/profile_step.py --prefill 32768 --decode 1x32768,64x512 --top 8 2>&1 \
        | grep -v "it/s\]\|arn" | tee "$OUT/profile.log" ;;
    sweep) run $B --input-len 16384 --batch-size 1,4,16 --resident-graph --offload-graph \
             --out "$OUT/sweep" 2>&1 | grep -v "it/s\]" | tail -14 ;;
    models) run python3 -m pytest -q -m gpu tests/test_gpu_models.py -p no:cacheprovider 2>&1 \
              | grep -v "it/s\]" | tee "$OUT/pytest_gpu_models.log" | tail -30 ;;
    moe)  # issue 18: the MoE layer's paths alone, then Qwen3-30B-A3B at batch 1 and 32
      run python3 tools/bench_moe.py 2>&1 | tee "$OUT/bench_moe.log"
      run python3 bench_offload.py --model Qwen3-30B-A3B --output-len 64 --input-len 4096,16384 \
        --batch-size 1,32 --resident-graph --offload-graph --out "$OUT/moe" 2>&1 \
        | grep -v "it/s\]" | tail -16 ;;
    sampling)  # the sampler alone, then greedy vs sampled decode at batch 64 (issue 11), twice
      run python3 tools/profile_sampler.py --profile none 2>&1 | tee "$OUT/sampler.log"
      for i in 1 2; do
        run python3 bench_offload.py --model Qwen3-8B --input-len 512 --output-len 128 \
          --batch-size 64 --resident-graph --sampled --out "$OUT/sampled$i" 2>&1 \
          | grep -v "it/s\]" | tail -12
      done ;;
  esac
done
