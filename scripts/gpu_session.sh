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

# 1. correctness on the GPU: the new kernel and graphs first, then the kernels and engine against PEFT
part tests 130 env ASYNCSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --timeout 90 \
  tests/test_paged_attention.py tests/test_cuda_graphs.py tests/test_kernels.py tests/test_engine_tiny.py
# 2. decode steps at TinyLlama-1.1B shapes: graphs against eager, 32 / 64 running, 4 / 1,000 adapters
part step_1b 110 python3 scripts/bench_gpu_step.py --shape 1b --work $WORK --running 32 64 --adapters 1000 4 \
  --steps 20 --out "$OUT/step_1b.jsonl"
# 3. the same at Llama-7B shapes, against the HBM floor
part step_7b 150 python3 scripts/bench_gpu_step.py --shape 7b --work $WORK --running 64 32 --adapters 1000 4 \
  --steps 20 --pool-mem 24GiB --out "$OUT/step_7b.jsonl"
# 4. Punica's SGMV against gather-BMM, batch 64 distinct adapters (and the other kernels)
part kernels 40 python3 scripts/bench_kernels.py --hidden 4096 --batches 64 --ranks 16 --no-save \
  --table-out "$OUT/kernels.md"
# 5. S-LoRA's 1,000 against 5 at 7B shapes: 1,000 names over the 7B checkpoint's adapter files
if [ -d $WORK/7b/adapters ]; then
  python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_gpu_step import link_adapters; from pathlib import Path; link_adapters(Path('$WORK/7b/adapters'), Path('$WORK/a7b-1000'), 1000)"
  part adapter_scale_7b 120 python3 scripts/bench_adapter_scale.py --adapters $WORK/a7b-1000 --model $WORK/7b \
    --dtype bfloat16 --device cuda --pool-mem 24GiB --host-adapter-mem 24GiB --duration 8 --max-running 32
fi
echo "total $((SECONDS - START))s" >> "$OUT/session.log"
rm -rf $WORK
