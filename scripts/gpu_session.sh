#!/usr/bin/env bash
# One GPU session (issue 36): the CUDA tests, then the benchmarks, most important first, each part
# under its own timeout and all under one deadline, results written to $OUT as they come.
#
#   bash scripts/gpu_session.sh            # in the repo root on the GPU box; .whl/ carried beside it
#
# DEADLINE_S (default 450): seconds from start after which no part starts and each part's timeout is
# cut to what is left. Results: $OUT/tests.log, $OUT/step_1b.jsonl, $OUT/step_7b.jsonl,
# $OUT/kernels.md, $OUT/adapter_scale_7b.log, $OUT/session.log (timings of the parts).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-450}
START=$SECONDS
export PYTHONUNBUFFERED=1 ASYNCSERVE_NATIVE=0
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "wheel install failed" >> "$OUT/session.log"
fi
export PYTHONPATH=$PWD:$PWD/tests:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# the 7B checkpoint (13.5 GB) in memory where /dev/shm has room, else on disk (the page cache keeps it)
WORK=/tmp/asyncserve-bench
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -gt 40 ] 2>/dev/null && WORK=/dev/shm/asyncserve-bench
{ nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nproc; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/env.txt" 2>&1

part() {   # part NAME TIMEOUT_S COMMAND...: run under min(TIMEOUT_S, time left), log its time and exit code
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE_S - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then echo "$name: skipped, ${left}s left" >> "$OUT/session.log"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: rc=$? in $((SECONDS - t0))s (limit ${limit}s)" >> "$OUT/session.log"
}

# the 1.1B / 7B skeletons (config + SmolLM2's tokenizer, made beforehand: the default model's wheel does not travel)
[ -d .bench/gpu ] && mkdir -p $WORK && cp -rn .bench/gpu/. $WORK/
# 1. correctness on the GPU: the new kernel and graphs first (launches blocking, so a device assert names
# its kernel), then the kernels and engine against PEFT on the eager path, each in a process of its own
# (a device assert poisons the process)
part tests_graphs 70 env ASYNCSERVE_TEST_DEVICE=cuda CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -x --tb=long \
  -p no:cacheprovider --timeout 60 tests/test_paged_attention.py tests/test_cuda_graphs.py
part tests_eager 110 env ASYNCSERVE_TEST_DEVICE=cuda ASYNCSERVE_ENFORCE_EAGER=1 python3 -m pytest -q -x --tb=short \
  -p no:cacheprovider --timeout 60 tests/test_kernels.py tests/test_engine_tiny.py
# mixtures of experts: their eager CUDA path (routing read back on the host, no graphs) against PEFT
part tests_moe 60 env ASYNCSERVE_TEST_DEVICE=cuda python3 -m pytest -q -x --tb=short -p no:cacheprovider --timeout 50 \
  tests/test_moe.py -k "one_generate_call and not triton or merged_mode"
# 2.-3. decode steps at TinyLlama-1.1B and Llama-7B shapes (the HBM floor), 32 / 64 running, 4 / 1,000
# adapters: eager first, then graphs, in processes of their own
for mode in eager graphs; do
  part step_1b_$mode 70 python3 scripts/bench_gpu_step.py --shape 1b --work $WORK --running 32 64 --adapters 1000 4 \
    --modes $mode --steps 20 --out "$OUT/step_1b.jsonl"
  part step_7b_$mode 100 python3 scripts/bench_gpu_step.py --shape 7b --work $WORK --running 64 32 --adapters 1000 4 \
    --modes $mode --steps 20 --pool-mem 24GiB --out "$OUT/step_7b.jsonl"
done
# 5. S-LoRA's 1,000 against 5 at 7B shapes: 1,000 names over the 7B checkpoint's adapter files
if [ -d $WORK/7b/adapters ]; then
  python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_gpu_step import link_adapters; from pathlib import Path; link_adapters(Path('$WORK/7b/adapters'), Path('$WORK/a7b-1000'), 1000)"
  part adapter_scale_7b 120 python3 scripts/bench_adapter_scale.py --adapters $WORK/a7b-1000 --model $WORK/7b \
    --dtype bfloat16 --device cuda --pool-mem 24GiB --host-adapter-mem 24GiB --duration 8 --max-running 32
fi
echo "total $((SECONDS - START))s" >> "$OUT/session.log"
rm -rf $WORK
