#!/usr/bin/env bash
# The bench part of the one GPU check (issue 4). Run from the repository root on the
# device machine:  OUT=/some/dir bash scripts/bench_gpu.sh
# Budget: about 4-6 minutes on an H200 when bitsandbytes/torchao are installed (torchao
# compiles once per size and dtype), about 2-3 without them (their rows then say
# "unavailable"). Each step has its own timeout so one slow step cannot eat the lease.
set -u
OUT=${OUT:-reports}
mkdir -p "$OUT"
run() {  # run LIMIT_S NAME CMD...: log to $OUT/NAME.log, keep going on failure
  local limit=$1 name=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.out" 2>"$OUT/$name.log"; echo "   exit $?"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
run 120 pytest-cuda python -m pytest -q -m cuda tests/test_bench_timing.py tests/test_bench_cli.py tests/test_bench_engine.py
# Headline: every 4-bit rounding mode vs the baselines, 16M and 134M elements, fp32 and bf16.
run 300 kernels python -m qstate_cli bench kernels --bits 4 --numel 2^24,2^27 --dtype fp32,bf16 \
    --json "$OUT/bench-kernels-gpu.json" --csv "$OUT/bench-kernels-gpu.csv"
# Launch overhead: a whole GPT-2 small step (148 tensors), per-parameter peers vs ours.
run 180 kernels-gpt2 python -m qstate_cli bench kernels --bits 4 --rounding bred --model gpt2-small --dtype bf16 \
    --baseline torch-fused,torch-foreach,bnb-adamw8bit,torchao-adamw4bit --json "$OUT/bench-kernels-gpt2-gpu.json"
# Memory: exact accounting + torch.cuda.max_memory_allocated pass on GPT-2 small shapes.
run 180 memory python -m qstate_cli bench memory --model gpt2-small --json "$OUT/bench-memory-gpu.json"
for f in kernels kernels-gpt2 memory; do echo "== $f"; tail -n 45 "$OUT/$f.out" 2>/dev/null; done
