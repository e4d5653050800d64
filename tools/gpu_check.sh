#!/usr/bin/env bash
# One device call: GPU test suite, needle runs, engine runs and benchmarks. Before spending device
# time on a changed Triton kernel, compile it here without a GPU: tools/check_kernels.py.
# Usage (on the GPU machine, repo root):
#   bash tools/gpu_check.sh [tests|tests2|testsrest|ab|needle|gen|bench|prefill|profile|stall|cpusplit|cpurate|splitbench|decode|sweep|
#                            kernels|sampling|fp8|fp8bench|prefixrate|heldrate|bg|follow|onerow|onerowtpot|gemvncu|gemvstages|awqvariants|moerouter|pdl|pdlchain|gptqactorder|fp8moe|tilesab|awqab|decodeprofile|copyforms|pageorder|tune|linear|h2d|link|ttft|models|moe|moeoffload|tpsmoke|tptests|allreduce|tp32k|tp128k|onem|synth|json|tunemoe|ttftchunk|moetargets|quant|quantpass|fp8rows|quantmodels]...
# Step arguments from the environment: PROFILE_ARGS, TUNE_ARGS, LINEAR_ARGS, LINK_ARGS; SPLIT_LENS,
# SPLIT_BATCH, SPLIT_CPU and SPLIT_KV for splitbench; DECODE_TILES, TILES_MODELS for tilesab; ONEM_LEN for onem; BG_STEPS for bg, FOLLOW_S for follow; PREFIX_ARGS for prefixrate; HELD_S for heldrate; ONEROW_SPLITS (the CUDA GEMVs' K splits timed) for onerow; ONEROW_MODELS, ONEROW_FLAGS, ONEROW_SHAPE for onerowtpot; AWQ_VARIANT_ARGS for awqvariants; AWQ_OLD for awqab; PROFILE_MODELS for decodeprofile; PDL_MODELS, PDL_FLAGS for pdl; SYNTH_LEN, SYNTH_MODE, SYNTH_CPU, SYNTH_ARGS for synth; QUANT_ARGS for quant; QUANTPASS_ARGS for quantpass; FP8ROWS_ARGS for fp8rows;
# MOE_BATCHES for moetargets; CHUNKS, TTFT_MODELS for ttftchunk; TUNEMOE_ARGS for tunemoe; QUANT_MODELS, QUANT_BATCH_MODELS, QUANT_MOE_MODELS for quantmodels (each a list, may be empty);
# GPU_TESTS for tests; AB_FILE, AB_OTHER, AB_CMD, AB_ORDER, AB_TAIL for ab; REPS and
# DECODE_SYNC for decode; STEP_TIMEOUT for every step.
# Server tests need fastapi/uvicorn/openai: carry them as wheels in .whl (see README, GPU notes).
# A/B of a kernel on one machine (step `ab`): copy the other version into an untracked, not
# ignored file here (it travels with the tree; a changed source rebuilds), e.g.
#   git show main:nanoserve/quant/csrc/awq_gemv.cu > ab_awq_main.cu
#   AB_FILE=nanoserve/quant/csrc/awq_gemv.cu AB_OTHER=ab_awq_main.cu \
#   AB_CMD="python3 bench_offload.py --model Qwen3-8B-AWQ --input-len 32768 --output-len 32 \
#   --resident-graph" bash tools/gpu_check.sh ab
# The device's git HEAD need not be yours: in session 29 `git show HEAD:` there gave the
# session's first commit.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# a build killed by a step's timeout leaves torch's lock on its extension: the next build of it
# waited forever (session 31). Cleared unless a `bg` job runs (its build may hold one); torch
# puts a build under $TORCH_EXTENSIONS_DIR/<name>, or <cache>/torch_extensions/<py_cu>/<name>
if [ ! -f /tmp/bg/log ] || [ -f /tmp/bg/rc ]; then
  find "${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torch_extensions}" -maxdepth 3 \
    -name lock -type f -delete 2>/dev/null
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
what=${*:-tests tests2 testsrest needle gen bench}
# STEP_TIMEOUT=s: each command stops after s seconds (a hang still leaves the others' output)
run() { echo "=== $*"; timeout -s ABRT "${STEP_TIMEOUT:-0}" "$@"; echo "=== rc=$?"; }
B="python3 bench_offload.py --model Qwen3-8B --output-len 64"
for w in $what; do
  case $w in
    tests|tests2|testsrest)  # the GPU suite in three calls: `tests` the test_gpu_[a-m]*.py files
            # (about 400 s on an H100 in session 31), `tests2` test_gpu_[n-z]*.py (about 300 s),
            # `testsrest` the other files' GPU tests (needle, prefill attention: about 100 s);
            # GPU_TESTS overrides any. tests/test_gpu_1m.py (two minutes on an H200) runs alone:
            # GPU_TESTS=tests/test_gpu_1m.py
      # (pytest does not --ignore a file named on its command line: the lists leave it out)
      case $w in
        tests) set -- $(ls tests/test_gpu_[a-m]*.py) ;;
        tests2) set -- $(ls tests/test_gpu_[n-z]*.py | grep -v test_gpu_1m.py) ;;
        *) set -- tests --ignore-glob="tests/test_gpu_*.py" ;;
      esac
      [ -n "${GPU_TESTS:-}" ] && set -- $GPU_TESTS
      # the whole log (progress bars share lines with pytest's dots) into $OUT, its summary here
      run python3 -m pytest -q -rfE -m gpu "$@" -p no:cacheprovider -s --durations=30 \
        >"$OUT/pytest_$w.log" 2>&1
      tr '\r' '\n' <"$OUT/pytest_$w.log" | grep -E "^=== |[0-9]+ (passed|failed|skipped|errors?)|FAIL|Error|ERROR|tokens_per_s|^E  |^ *[0-9.]+ +[0-9]+ +(PASS|FAIL)|^[0-9.]+s (call|setup)" | tail -60 ;;
    ab)  # AB_FILE's version here ("new") and AB_OTHER's ("old") alternately under AB_CMD, in
         # AB_ORDER (default new old new old; an entry may also name a third version's file),
         # each run's last AB_TAIL lines (default 3); AB_FILE is put back as it was
      cp "$AB_FILE" /tmp/ab_new
      for v in ${AB_ORDER:-new old new old}; do
        if [ "$v" = old ]; then cp "$AB_OTHER" "$AB_FILE"
        elif [ "$v" = new ]; then cp /tmp/ab_new "$AB_FILE"; else cp "$v" "$AB_FILE"; fi
        run bash -c "$AB_CMD" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -"${AB_TAIL:-3}" \
          | sed "s/^/$v /"
      done
      cp /tmp/ab_new "$AB_FILE" ;;
    kernels)  # the hand-written kernels against their references, and the engine on them
      run python3 -m pytest -q -m gpu tests/test_gpu_kernels.py \
        tests/test_gpu_linear.py tests/test_gpu_rope_store.py tests/test_gpu_engine.py \
        -p no:cacheprovider 2>&1 | grep -v -E "(it|tok)/s\]" | tee "$OUT/pytest_kernels.log" \
        | grep -E "passed|failed|FAIL|Error|^E  " | tail -30 ;;
    needle)
      for m in "--enable-offload --use-cuda-graph" "--enable-offload --enforce-eager" "--use-cuda-graph"; do
        run python3 tests/test_needle.py --input-len 32768 --depths 0,0.1,...,1 $m 2>&1 | tail -15 | tee -a "$OUT/needle.log"
      done ;;
    gen)
      G="python3 -m nanoserve generate --model Qwen3-8B --dummy-weights --input-len 32768 --output-len 128"
      run $G 2>&1 | grep -v -E "(it|tok)/s\]" | tail -4 | tee "$OUT/gen_resident.log"
      run $G --enable-offload --resident-layers 0 2>&1 | grep -v -E "(it|tok)/s\]" | tail -4 | tee "$OUT/gen_offload_all.log" ;;
    bench) run $B --input-len 4096,16384,32768,131072 --bench-all --compare-hf --out "$OUT" 2>&1 \
             | grep -v -E "(it|tok)/s\]" | tail -45 ;;
    prefill)  # issue 16: TTFT vs the FLOP floor and transformers; batch 64 x 512 prefill rate
      run $B --input-len 4096,16384,32768,131072 --output-len 8 --resident-graph --compare-hf \
        --out "$OUT/prefill" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -16
      run $B --input-len 512 --batch-size 64 --output-len 32 --resident-graph \
        --out "$OUT/prefill64" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -6 ;;
    profile)  # a step's kernel time by category (docs/perf-notes.md)
      run python3 tools/profile_step.py ${PROFILE_ARGS:---prefill 32768 --decode 1x32768,64x512 --top 8} 2>&1 \
        | grep -v "it/s\]\|arn" | tee "$OUT/profile.log" ;;
    decodeprofile)  # issues 35-36: where batch 1's step goes, kernel by kernel, for the target
                    # models (PROFILE_MODELS, model:context), with PDL off: with it on, a kernel's
                    # time includes its wait for the one ahead (session 32)
      for ml in ${PROFILE_MODELS-Qwen3-30B-A3B:4096 Qwen3-30B-A3B-FP8:4096 Qwen3-8B-FP8:32768 Qwen3-8B-AWQ:32768}; do
        NANOSERVE_PDL=0 run python3 tools/profile_step.py --model ${ml%%:*} --prefill ${ml##*:} \
          --decode 1x${ml##*:} --top 16 --temperature 0 2>&1 | grep -v "it/s\]\|arn" \
          | tee "$OUT/decodeprofile_${ml%%:*}.log" | sed -n '/^## decode/,$p' | head -30
      done ;;
    stall)  # issue 17: a stream's largest gap while a 32K prompt arrives (before: a tree of an
            # earlier commit in .before86, if carried, runs this bench against its engine)
      run $B --input-len 32768 --output-len 8 --resident-graph --offload-graph --stall \
        --out "$OUT/stall" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -4
      if [ -d .before86 ]; then
        cp bench_offload.py .before86/bench_stall_new.py
        (cd .before86 && PYTHONPATH=$PWD run python3 bench_stall_new.py --model Qwen3-8B \
          --output-len 8 --input-len 32768 --resident-graph --stall --out "$OUT/stall_before" \
          2>&1 | grep -v -E "(it|tok)/s\]" | tail -3)
      fi ;;
    cpusplit)  # issue 33: CPU attention beside the link: its GPU tests and the CPU kernel's own
               # tests on this host's CPU and compiler (they found a crash the dev machine did
               # not have), the 32K needle with the split (graphs, eager, FP8 KV), every layer
               # streamed
      run python3 -m pytest -q tests/test_gpu_cpu_share.py tests/test_cpu_attention.py \
        -p no:cacheprovider 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tee "$OUT/pytest_cpusplit.log" | grep -E "passed|failed|^E  " | tail -20
      for m in "--use-cuda-graph" "--enforce-eager" "--use-cuda-graph --kv-cache-dtype fp8"; do
        run python3 tests/test_needle.py --input-len 32768 --depths 0,0.5,1 --enable-offload \
          --resident-layers 0 --cpu-attention auto $m 2>&1 | grep -v -E "(it|tok)/s\]" | tail -6 \
          | tee -a "$OUT/needle_cpusplit.log"
      done ;;
    cpurate)  # issue 33: the CPU kernel's GB/s by threads against the host's read rate
      run python3 tools/probes/cpu_attention_rate.py 2>&1 | tee "$OUT/cpurate.log" ;;
    splitbench)  # issue 33's table: every layer streamed, the split off / auto / fixed
      run $B --input-len ${SPLIT_LENS:-32768} --batch-size ${SPLIT_BATCH:-1} --offload-graph \
        --cpu-attention ${SPLIT_CPU:-off,auto} --kv-cache-dtype ${SPLIT_KV:-auto} \
        --out "$OUT/split-${SPLIT_KV:-auto}-b${SPLIT_BATCH:-1}" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -24 ;;
    onem)  # issue 34: ONEM_LEN tokens (default 1M) of the 1M Llama shape, FP8 KV resident on
           # one GPU (a 4K row first: the warm-up runs at the shortest length). Over 10 minutes
           # at 1M (a whole call of 1,051 s was not enough in session 26, about 18 minutes of a
           # session's 30): BG_STEPS=onem in `bg`, then `follow`; 256K and 512K give the TTFT
           # ratio's trend for a fraction of that
      run python3 bench_offload.py --model Llama-3-8B-1048k --input-len 4096,${ONEM_LEN:-1048576} \
        --output-len 16 --resident-graph --kv-cache-dtype fp8 --out "$OUT/onem" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -12 ;;
    synth)  # issue 34: decode only at SYNTH_LEN tokens (default 1M; 2097152 for 2M) of the 1M
            # Llama shape, FP8 KV, each prompt's KV written instead of prefilled
            # (--synthetic-prefill); SYNTH_MODE offload-graph (the residency plan splits GPU
            # and host; an H100's 1M, an H200's 2M) or resident-graph; SYNTH_CPU: the CPU split's
            # settings (default off,auto: the link alone, then the CPU beside it); SYNTH_ARGS:
            # more bench arguments (2M on an H200: --host-kv-budget 48)
      run python3 bench_offload.py --model Llama-3-8B-1048k --input-len ${SYNTH_LEN:-1048576} \
        --output-len 16 --${SYNTH_MODE:-offload-graph} --resident-layers -1 \
        --cpu-attention ${SYNTH_CPU:-off,auto} ${SYNTH_ARGS:-} \
        --kv-cache-dtype fp8 --synthetic-prefill --out "$OUT/synth" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -16 ;;
    json)  # issue 37: batch 64 x 512, half the requests under a JSON schema, against none
           # (llguidance travels as a wheel in .whl, as the server's packages do)
      run $B --input-len 512 --batch-size 64 --output-len 64 --resident-graph --json-schema \
        --out "$OUT/json" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -8 ;;
    decode)  # issue 17: TPOT at batch 1 / 32K, 64 x 512 and offloaded 4K (every layer streamed)
      for i in ${REPS:-1}; do
        for a in "" ${DECODE_SYNC:-}; do  # DECODE_SYNC=--sync-scheduling: also synchronous
          run $B --input-len 32768 --output-len 128 --resident-graph $a \
            --out "$OUT/dec1$a$i" 2>&1 | grep -E "^(resident|offload)-"
          run $B --input-len 512 --batch-size 64 --output-len 128 --resident-graph $a \
            --out "$OUT/dec64$a$i" 2>&1 | grep -E "^(resident|offload)-"
          run $B --input-len 4096 --output-len 128 --offload-graph $a \
            --out "$OUT/off4k$a$i" 2>&1 | grep -E "^(resident|offload)-"
        done
      done
      rm -f "$OUT"/*/bench.png ;;  # the rows are in bench.json; fewer files come back
    h2d)  # issue 17: PCIe copies alone and beside decode's GEMVs (offloaded decode's overlap),
          # and offloaded decode's own load pattern
      run python3 tools/bench_h2d_contention.py 2>&1 | tee "$OUT/h2d.log"
      run python3 tools/bench_h2d_contention.py --layer-loads 2>&1 | tee -a "$OUT/h2d.log" ;;
    ttft)  # prompts of many new lengths in a fresh engine: what a new prefill shape costs
      run python3 tools/ttft_lengths.py 2>&1 | grep -v -E "(it|tok)/s\]" | tee "$OUT/ttft.log" | tail -4 ;;
    link)  # issue 17: offloaded decode's link and compute timelines at 4K, from CUDA events
      run python3 tools/link_timeline.py ${LINK_ARGS:---num-kv-buffers 2,3} 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tee "$OUT/link.log" ;;
    sweep) run $B --input-len 16384 --batch-size 1,4,16 --resident-graph --offload-graph \
             --out "$OUT/sweep" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -14 ;;
    fp8)  # issue 13: FP8 KV tests, accuracy, the 32K needle in three modes, the bench, 512K
      run python3 -m pytest -q -m gpu tests/test_gpu_fp8.py tests/test_gpu_kernels.py \
        tests/test_gpu_offload.py -p no:cacheprovider -s 2>&1 | grep -v -E "(it|tok)/s\]" \
        | tee "$OUT/pytest_fp8.log" | grep -E "passed|failed|FAIL|Error|^E  |Qwen3-8B shape" | tail -40
      run python3 tools/fp8_accuracy.py --device cuda 2>&1 | tee "$OUT/fp8_accuracy.log"
      for m in "--enable-offload --use-cuda-graph" "--enable-offload --enforce-eager" "--use-cuda-graph"; do
        run python3 tests/test_needle.py --input-len 32768 --kv-cache-dtype fp8 $m 2>&1 | tail -15 \
          | tee -a "$OUT/needle_fp8.log"
      done ;;
    fp8bench)  # issue 13's targets: 32K and 128K streamed and resident, bf16 128K, 512K
      run $B --input-len 32768,131072 --bench-all --kv-cache-dtype fp8 --out "$OUT/fp8" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -14
      run $B --input-len 131072 --resident-graph --out "$OUT/bf16-128k" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -5  # resident 128K: fp8's ratio to its floor against bf16's
      run python3 -m nanoserve generate --model Qwen3-8B --dummy-weights --input-len 524288 \
        --output-len 32 --kv-cache-dtype fp8 2>&1 | grep -v -E "(it|tok)/s\]" | tail -8 | tee "$OUT/gen_512k_fp8.log" ;;
    tpsmoke)  # issue 15: TP engines stage by stage (eager, graphs, offload) with timings
      run python3 tools/tp_smoke.py --tp "$(nvidia-smi -L | wc -l)" --hang-s 90 2>&1 \
        | grep --line-buffered -v -E "(it|tok)/s\]" | tail -40 ;;
    tptests)  # issue 15 (2 or 4 GPUs): needle under TP, offload on == off, graphs == eager
      run python3 -m pytest -q -m gpu tests/test_gpu_tp.py -p no:cacheprovider -s 2>&1 \
        | grep --line-buffered -v -E "(it|tok)/s\]" | tee "$OUT/pytest_tp.log" \
        | grep --line-buffered -E "passed|failed|FAIL|Error|^E  |TP=|/11 passed" | tail -40 ;;
    allreduce)  # issue 15: NCCL's transport between the GPUs and an all-reduce's time by size
      run python3 tools/bench_allreduce.py --tp "2,$(nvidia-smi -L | wc -l)" 2>&1 | tee "$OUT/allreduce.log" | tail -8
      NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET timeout -s ABRT "${STEP_TIMEOUT:-0}" \
        python3 tools/bench_allreduce.py --tp 2 --sizes 8K 2>&1 \
        | sed 's/^.*NCCL INFO //' | grep -E " via |P2P|SHM|TP=" | sort | uniq -c | sort -rn | head -12 ;;
    tp32k)  # issue 15: resident 32K at TP 1, 2(, 4), batch 1
      n=$(nvidia-smi -L | wc -l); sizes=1,2; [ "$n" -ge 4 ] && sizes=1,2,4
      run $B --input-len 32768 --resident-graph --tensor-parallel-size $sizes \
        --out "$OUT/tp32k" 2>&1 | grep --line-buffered -v -E "(it|tok)/s\]" | tail -14 ;;
    tp128k)  # issue 15: offloaded 128K, every layer streamed, TP 1 and every GPU
      run $B --input-len 131072 --offload-graph --tensor-parallel-size "1,$(nvidia-smi -L | wc -l)" \
        --out "$OUT/tp128k" 2>&1 | grep --line-buffered -v -E "(it|tok)/s\]" | tail -12 ;;
    heldrate)  # issue 34: what the tensor cores hold at the power limit (bf16 matmul, cuDNN's
               # prefix attention) against their burst rates, beside clock, power and NVML's
               # reasons (about 2 minutes)
      run python3 tools/probes/sustained_rate.py --seconds ${HELD_S:-40} 2>&1 \
        | tee "$OUT/sustained.log" | tail -30 ;;
    prefixrate)  # issue 34: cuDNN's prefix attention by chunk and keys per call, the per-call
                 # gather and merge, summed over a 1M prompt (PREFIX_ARGS)
      run python3 tools/probes/prefix_attention_rate.py ${PREFIX_ARGS:---engine-only} 2>&1 \
        | tee "$OUT/prefix_rate.log" ;;
    bg)  # BG_STEPS (steps of this script, default onem) in the background, for work longer than
         # one call: make the next call at once (an idle machine goes back after 30 s) with
         # `follow`, which waits a bounded time and always prints the log. The job's steps run
         # without the caller's STEP_TIMEOUT (BG_TIMEOUT, default none); it writes its exit
         # status to /tmp/bg/rc when it ends
      rm -rf /tmp/bg; mkdir -p /tmp/bg
      setsid nohup env -u STEP_TIMEOUT STEP_TIMEOUT=${BG_TIMEOUT:-0} OUT=/tmp/bg bash -c \
        "bash tools/gpu_check.sh ${BG_STEPS:-onem}; echo \$? >/tmp/bg/rc" >/tmp/bg/log 2>&1 \
        </dev/null &
      echo "=== started ${BG_STEPS:-onem} in the background" ;;
    follow)  # waits at most FOLLOW_S seconds (default 540) for `bg`'s job, then its log's tail
             # and its files in OUT, finished or not. Keep FOLLOW_S under the call's limit: a
             # call the device budget cuts short before follow prints brings nothing back
             # (session 35 lost a whole tables run so)
      for _ in 1 2 3 4 5; do [ -f /tmp/bg/log ] && break; sleep 1; done  # `bg` just started it
      if [ ! -f /tmp/bg/log ]; then echo "=== no background job on this machine"; continue; fi
      end=$((SECONDS + ${FOLLOW_S:-540}))
      while [ ! -f /tmp/bg/rc ] && [ $SECONDS -lt $end ]; do sleep 5; done
      if [ -f /tmp/bg/rc ]; then echo "=== finished, rc=$(cat /tmp/bg/rc)"; else
        echo "=== still running"; fi
      tail -c 6000 /tmp/bg/log | tr '\r' '\n' | tail -40
      cp -r /tmp/bg/. "$OUT"/ 2>/dev/null; rm -f "$OUT"/*/bench.png ;;
    copyforms)  # issue 34: an FP8 kv head's tiles pulled by each copy form, no attention work
      run python3 tools/probes/copy_forms.py 2>&1 | tee "$OUT/copy_forms.log" ;;
    pageorder)  # issue 34: decode's read rate with a sequence's pages scattered or ascending
      run python3 tools/probes/decode_page_order.py 2>&1 | tee "$OUT/page_order.log" ;;
    tune)  # the decode kernel's tiles for bf16 and FP8 KV (nanoserve/attention/triton_decode.py)
      run python3 tools/tune_decode.py ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune_decode.log" ;;
    linear)  # issue 17: decode's linear layers, cuBLAS against the Triton skinny matmul
      run python3 tools/bench_linear.py ${LINEAR_ARGS:-} 2>&1 | tee "$OUT/bench_linear.log" ;;
    models) run python3 -m pytest -q -m gpu tests/test_gpu_models.py -p no:cacheprovider 2>&1 \
              | grep -v -E "(it|tok)/s\]" | tee "$OUT/pytest_gpu_models.log" | tail -30 ;;
    onerow)  # issues 35-36: the one-row CUDA kernels (quant/cuda_gemv.py: AWQ and FP8;
             # models/cuda_moe.py: one token's experts): their GPU tests, one layer against
             # Triton's (then `onerowtpot`)
      # (the whole of test_gpu_models.py takes more than 300 s on an H100: its MoE CUDA tests)
      run python3 -m pytest -q -m gpu tests/test_gpu_quant.py \
        tests/test_gpu_models.py::test_one_tokens_cuda_experts_against_the_triton_path_and_in_graphs \
        tests/test_gpu_models.py::test_qwen3_30b_a3b_widths_decode_in_graphs_at_batch_1_and_32 \
        tests/test_gpu_models.py::test_fused_moe_greedy_tokens_equal_the_loops \
        -p no:cacheprovider 2>&1 | grep -v -E "(it|tok)/s\]" | tee "$OUT/pytest_onerow.log" \
        | grep -E "passed|failed|^E  " | tail -20
      NANOSERVE_ONE_ROW_CUDA=1 run python3 tools/bench_quant.py --rows 1 --formats awq,fp8 \
        --splits "${ONEROW_SPLITS-2,4,8,16,32}" 2>&1 \
        | tee "$OUT/bench_onerow.log"
      for flag in 1 0; do  # the MoE layer at batch 1: "fused" with the CUDA kernels, then without
        NANOSERVE_ONE_ROW_CUDA=$flag run python3 tools/bench_moe.py --batch 1 2>&1 \
          | sed "s/^/cuda=$flag /" | tee -a "$OUT/bench_moe1.log"
      done ;;
    gemvncu)  # issue 36: Nsight Compute on the one-row GEMVs (tools/probes/gemv_once.py):
              # duration, DRAM and L2 throughput, occupancy, warp stalls, issue slots and
              # instructions (bytes or issue bound?); Firecracker machines: gVisor's ncu reads
              # no counters
      run ncu --clock-control none -k regex:gemv_kernel --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section InstructionStats python3 tools/probes/gemv_once.py --calls 1 \
        >"$OUT/gemv_ncu.log" 2>&1
      grep -E "^(awq|fp8) |gemv_kernel|Duration|DRAM Thr|L2 Cache Thr|Achieved Occ|Registers Per|Waves|Warp Cycles Per Issued|Issued Warp|No Eligible|Executed Ipc A|Issue Slots Busy|==ERROR" \
        "$OUT/gemv_ncu.log" ;;
    gemvstages)  # issue 36: each one-row GEMV beside kernels that only read its bytes (its own
                 # pattern: all its loads, the weight's alone, the weight's and x's; contiguous
                 # runs): arithmetic, x or access pattern? (about a minute)
      run python3 tools/probes/gemv_stages.py 2>&1 | grep -v "it/s" | tee "$OUT/gemv_stages.log" ;;
    awqvariants)  # issue 36: the AWQ GEMV built with 8 warps a CTA (2 an SM) and other shapes,
                  # against the engine's 4 (3 an SM), per layer (tools/probes/awq_variants.py;
                  # four builds of a minute or so each, then a minute of timing)
      run python3 tools/probes/awq_variants.py ${AWQ_VARIANT_ARGS:-} 2>&1 | grep -v "it/s" \
        | tee "$OUT/awq_variants.log" ;;
    pdlchain)  # issues 35-36: what programmatic dependent launch saves between Triton kernels
               # in a graph, chains of 32 (tools/probes/pdl_chain.py, under a minute)
      run python3 tools/probes/pdl_chain.py 2>&1 | tee "$OUT/pdl_chain.log" ;;
    moerouter)  # issue 35: a MoE layer's routing at batch 1, the engine's and candidates', part by
                # part in graphs (tools/probes/moe_router.py, a minute)
      run python3 tools/probes/moe_router.py 2>&1 | grep -v "it/s" | tee "$OUT/moe_router.log" ;;
    onerowtpot)  # each model's batch-1 TPOT with the one-row CUDA kernels and without
                 # (NANOSERVE_ONE_ROW_CUDA=0), alternating ONEROW_FLAGS on one machine;
                 # ONEROW_SHAPE another shape (e.g. "--input-len 512 --batch-size 64")
      for m in ${ONEROW_MODELS-Qwen3-8B-AWQ Qwen3-8B-FP8 Qwen3-30B-A3B}; do
        len=32768; [ "$m" = Qwen3-30B-A3B ] && len=4096
        for flag in ${ONEROW_FLAGS:-1 0}; do
          NANOSERVE_ONE_ROW_CUDA=$flag run python3 bench_offload.py --model $m \
            ${ONEROW_SHAPE:---input-len $len} --output-len 64 --resident-graph --out "$OUT/onerow_${m}_$flag" 2>&1 \
            | grep -E "^resident" | sed "s/^/cuda=$flag /"
        done
      done
      rm -f "$OUT"/*/bench.png ;;
    pdl)  # issues 35-36: the decode step with programmatic dependent launch (the default on
          # sm_90 since session 32; NANOSERVE_PDL=1 / 0 forces it:
          # the one-row GEMVs, the Triton kernels, inductor's) and without: the PDL GPU tests,
          # then batch-1 TPOT alternating PDL_FLAGS on one machine, for PDL_MODELS (model:input
          # length)
      run python3 -m pytest -q -m gpu tests/test_gpu_pdl.py tests/test_gpu_quant.py -k "cuda_gemv or pdl" \
        -p no:cacheprovider \
        2>&1 | tee "$OUT/pytest_pdl.log" | grep -E "passed|failed|^E  " | tail -20
      for ml in ${PDL_MODELS-Qwen3-30B-A3B:4096 Qwen3-8B-FP8:32768 Qwen3-8B-AWQ:32768}; do
        for flag in ${PDL_FLAGS:-1 0 1 0}; do
          NANOSERVE_PDL=$flag run python3 bench_offload.py --model ${ml%%:*} --input-len ${ml##*:} \
            --output-len 64 --resident-graph 2>&1 | grep -E "^resident" | sed "s/^/pdl=$flag ${ml%%:*} /"
        done
      done ;;
    gptqactorder)  # issue 36: act-order GPTQ (Qwen3-8B's shape, dummy weights) run as AWQ with
                   # its inputs sorted (quant/linear.py's input_order) against the element-by-
                   # element act-order GEMM (the repack skipped for act-order), alternating
      G=/tmp/gptq-act-order; mkdir -p $G
      python3 -c "import json; c = json.load(open('nanoserve/model_configs/Qwen3-8B-AWQ/config.json')); c['quantization_config'] = {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, 'desc_act': True, 'sym': True}; json.dump(c, open('$G/config.json', 'w'))"
      sed 's/^        awq = gptq_as_awq(q, self.qweight, self.qzeros, order)$/        if order is not None:\n            return\n&/' \
        nanoserve/quant/linear.py > /tmp/linear_act_order_apart.py
      grep -q "if order is not None:" /tmp/linear_act_order_apart.py || echo "=== the skip was not inserted"
      AB_FILE=nanoserve/quant/linear.py AB_OTHER=/tmp/linear_act_order_apart.py AB_CMD="python3 \
        bench_offload.py --model $G --dummy-weights --input-len 32768 --output-len 32 \
        --resident-graph" bash tools/gpu_check.sh ab ;;
    awqab)  # issue 36: the AWQ GEMV's GPU tests, then Qwen3-8B-AWQ's batch-1 TPOT at 32K with
            # this tree's kernel and AWQ_OLD's (an untracked copy of another version, made before
            # the call: git show REV:nanoserve/quant/csrc/awq_gemv.cu > ab_awq_old.cu), alternating
      run python3 -m pytest -q -m gpu tests/test_gpu_quant.py -k "awq or gptq" -p no:cacheprovider \
        2>&1 | tee "$OUT/pytest_awqab.log" | grep -E "passed|failed|^E  " | tail -20
      AB_FILE=nanoserve/quant/csrc/awq_gemv.cu AB_OTHER=${AWQ_OLD:-ab_awq_old.cu} AB_CMD="python3 \
        bench_offload.py --model Qwen3-8B-AWQ --input-len 32768 --output-len 32 \
        --resident-graph" bash tools/gpu_check.sh ab ;;
    fp8moe)  # issues 35-36: one token's FP8 experts through the CUDA MoE kernels (session 32):
             # their GPU tests, then Qwen3-30B-A3B-FP8's batch-1 TPOT at 4K against Triton's
             # fused path for FP8 experts (the dispatch sed'ed to 16-bit stacks only), alternating
      run python3 -m pytest -q -m gpu tests/test_gpu_models.py tests/test_gpu_quant.py \
        -k "fp8_cuda_experts or fp8_experts or fp8_moe" -p no:cacheprovider 2>&1 \
        | tee "$OUT/pytest_fp8moe.log" | grep -E "passed|failed|^E  " | tail -20
      sed 's/^        if cuda_moe.supports(x, weights, ids, gate_up, down, scales, block):$/        if scales is None and cuda_moe.supports(x, weights, ids, gate_up, down):/' \
        nanoserve/models/fused_moe.py > /tmp/fused_moe_triton_fp8.py
      grep -q "if scales is None and cuda_moe" /tmp/fused_moe_triton_fp8.py \
        || echo "=== the Triton-only dispatch was not made"
      AB_FILE=nanoserve/models/fused_moe.py AB_OTHER=/tmp/fused_moe_triton_fp8.py AB_CMD="python3 \
        bench_offload.py --model Qwen3-30B-A3B-FP8 --input-len 4096 --output-len 64 \
        --resident-graph" bash tools/gpu_check.sh ab ;;
    tilesab)  # the engine's batch-1 TPOT with the default decode tiles replaced by DECODE_TILES
              # (Tiles' arguments, e.g. "128, 4, 2") against the default, alternating, on
              # TILES_MODELS (default Qwen3-30B-A3B @ 4K and Qwen3-8B @ 32K)
      tiles=${DECODE_TILES:?DECODE_TILES, the Tiles arguments to time}
      sed "s/^TILES = {\"default\": Tiles(64, 4, 2),\$/TILES = {\"default\": Tiles($tiles),/" \
        nanoserve/attention/triton_decode.py > /tmp/triton_decode_tiles.py
      grep -q "Tiles($tiles)" /tmp/triton_decode_tiles.py || echo "=== $tiles was not turned on"
      cp nanoserve/attention/triton_decode.py /tmp/triton_decode_default.py
      cp /tmp/triton_decode_tiles.py nanoserve/attention/triton_decode.py  # "new": DECODE_TILES
      IFS=';' read -ra models <<< "${TILES_MODELS:-Qwen3-30B-A3B --input-len 4096;Qwen3-8B --input-len 32768}"
      for m in "${models[@]}"; do
        AB_FILE=nanoserve/attention/triton_decode.py AB_OTHER=/tmp/triton_decode_default.py \
          AB_CMD="python3 bench_offload.py --model $m --output-len 64 --resident-graph" \
          bash tools/gpu_check.sh ab
      done
      cp /tmp/triton_decode_default.py nanoserve/attention/triton_decode.py ;;
    quant)  # issue 36: the quantized GEMM's GPU tests and its tiles against the memory floor
            # (decode) and cuBLAS (prefill), Qwen3-8B's shapes
      run python3 -m pytest -q -m gpu tests/test_gpu_quant.py -p no:cacheprovider 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tee "$OUT/pytest_quant.log" | grep -E "passed|failed|^E  " | tail -20
      run python3 tools/bench_quant.py ${QUANT_ARGS:---rows 1,16,64,4096} 2>&1 | tee "$OUT/bench_quant.log" ;;
    quantpass)  # issue 36: FP8's activation quantization pass by the groups a program takes (a
                # whole row a program holds it in registers: session 37)
      run python3 tools/probes/quantize_pass.py ${QUANTPASS_ARGS:-} 2>&1 \
        | tee "$OUT/quantize_pass.log" ;;
    fp8rows)  # issue 36: FP8's product of 16-64 rows piece by piece (tools/probes/fp8_rows.py:
              # quantization pass, GEMM alone, bf16 cuBLAS, a K-split shape's programs unsplit;
              # other tiles at 64 rows, a 64-row tile below), then Nsight Compute on the 64-row
              # GEMM of each shape (FP8ROWS_ARGS; the two take about 5 minutes on an H100: run
              # it alone or in `bg`)
      run python3 tools/probes/fp8_rows.py ${FP8ROWS_ARGS:-} 2>&1 | tee "$OUT/fp8_rows.log"
      run ncu --clock-control none -k regex:_fp8_gemm_kernel --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats python3 tools/probes/fp8_rows.py --ncu --rows 64 \
        >"$OUT/fp8_rows_ncu.log" 2>&1
      grep -E "^ncu: |_fp8_gemm_kernel|Duration|DRAM Thr|Memory Thr|L2 Cache Thr|Achieved Occ|Registers Per|Shared Memory Config|Waves|Grid Size|Warp Cycles Per Issued|Stall|==ERROR" \
        "$OUT/fp8_rows_ncu.log" | head -120 ;;
    quantmodels)  # issue 36's targets: Qwen3-8B bf16, FP8 and AWQ at 32K, batch 1; FP8 64 x 512;
                  # Qwen3-30B-A3B bf16 and FP8 at 4K (about 9 minutes on an H100: STEP_TIMEOUT)
      for m in ${QUANT_MODELS-Qwen3-8B Qwen3-8B-FP8 Qwen3-8B-AWQ}; do
        run python3 bench_offload.py --model $m --input-len 32768 --output-len 32 \
          --resident-graph --out "$OUT/quant_$m" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -2
      done
      for m in ${QUANT_BATCH_MODELS-Qwen3-8B Qwen3-8B-FP8}; do
        run python3 bench_offload.py --model $m --input-len 512 --batch-size 64 --output-len 64 \
          --resident-graph --out "$OUT/quant64_$m" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -2
      done
      for m in ${QUANT_MOE_MODELS-Qwen3-30B-A3B Qwen3-30B-A3B-FP8}; do  # FP8 experts through the fused MoE path
        run python3 bench_offload.py --model $m --input-len 4096 --output-len 64 \
          --resident-graph --out "$OUT/quantmoe_$m" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -2
      done ;;
    tunemoe)  # issue 35: the fused MoE kernels' tiles per batch band, written into $OUT
              # (TUNEMOE_ARGS: e.g. "--model Qwen3-30B-A3B --tp 2")
      run python3 tools/tune_moe.py ${TUNEMOE_ARGS:-} --write "$OUT/moe_configs" 2>&1 \
        | tee "$OUT/tune_moe.log" ;;
    moeoffload)  # issue 35's item 3: Qwen3-30B-A3B at 128K (YaRN), every layer streamed, bf16
                 # and FP8 KV, against the PCIe floor
      for kv in auto fp8; do
        run python3 bench_offload.py --model Qwen3-30B-A3B-YaRN --input-len 131072 --output-len 32 \
          --offload-graph --resident-layers 0 --kv-cache-dtype $kv --out "$OUT/moeoffload_$kv" 2>&1 \
          | grep -v -E "(it|tok)/s\]" | tail -4
      done ;;
    ttftchunk)  # TTFT by prefill chunk (--max-num-batched-tokens, CHUNKS) on the TTFT targets:
                # Qwen3-30B-A3B 32 x 4,096, Qwen3-8B-FP8 1 x 32K (TTFT_MODELS overrides; the
                # first needs an H200: its batch of 32 does not fit an 80 GB card)
      IFS=';' read -ra models <<< "${TTFT_MODELS:-Qwen3-30B-A3B --input-len 4096 --batch-size 32;Qwen3-8B-FP8 --input-len 32768}"
      for m in "${models[@]}"; do
        for c in ${CHUNKS:-8192 16384 32768}; do
          run python3 bench_offload.py --model $m --output-len 4 --resident-graph \
            --max-num-batched-tokens $c --out "$OUT/ttftchunk/${m%% *}_$c" 2>&1 \
            | grep -v -E "(it|tok)/s\]" \
            | tail -2 | sed "s/^/chunk $c /"
        done
      done ;;
    moetargets)  # issue 35's table: Qwen3-30B-A3B TPOT at batch 1 and 32 @ 4K, TTFT 32 x 4,096
                 # and 1 x 32K (batch 32 does not fit an 80 GB card: MOE_BATCHES=1 there)
      run python3 bench_offload.py --model Qwen3-30B-A3B --input-len 4096 --output-len 64 \
        --batch-size ${MOE_BATCHES:-1,32} --resident-graph --out "$OUT/moe4k" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -6
      run python3 bench_offload.py --model Qwen3-30B-A3B --input-len 32768 --output-len 16 \
        --resident-graph --out "$OUT/moe32k" 2>&1 | grep -v -E "(it|tok)/s\]" | tail -4 ;;
    moe)  # issue 18: the MoE layer's paths alone, then Qwen3-30B-A3B at batch 1 and 32
      run python3 tools/bench_moe.py 2>&1 | tee "$OUT/bench_moe.log"
      run python3 bench_offload.py --model Qwen3-30B-A3B --output-len 64 --input-len 4096,16384 \
        --batch-size 1,32 --resident-graph --offload-graph --out "$OUT/moe" 2>&1 \
        | grep -v -E "(it|tok)/s\]" | tail -16 ;;
    sampling)  # the sampler alone, then greedy vs sampled decode at batch 64 (issue 11), twice
      run python3 tools/profile_sampler.py --profile none 2>&1 | tee "$OUT/sampler.log"
      for i in 1 2; do
        run python3 bench_offload.py --model Qwen3-8B --input-len 512 --output-len 128 \
          --batch-size 64 --resident-graph --sampled --out "$OUT/sampled$i" 2>&1 \
          | grep -v -E "(it|tok)/s\]" | tail -12
      done ;;
  esac
done
