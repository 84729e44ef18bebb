#!/usr/bin/env bash
# The one GPU check: on a CUDA machine, in one call, the headline kernel measurement,
# the kernel parity tests on the GPU, `qstate bench kernels` / `bench memory` on real
# sizes, and the other CUDA tests. Writes logs and JSON under OUT_DIR.
#
#   scripts/gpu_check.sh OUT_DIR        (or OUT=... scripts/gpu_check.sh)
#
# Files: summary.log (one line per stage), <stage>.log, junit XML of the test stages,
# headline.json, bench-kernels-4bit.json/.csv, bench-kernels-gpt2.json, bench-memory.json,
# diagnose-demo-reference.json / diagnose-demo-auto.json (the replay's codec, stage replay_codec),
# diagnose-cpu-threads1.json / diagnose-cpu-threads8.json (configurations in parallel on CPU, stage replay_cpu_threads),
# prediction.log / prediction.jsonl (each measured fused-kernel row beside the static
# SASS prediction of scripts/sass_budget.py, compiled with this machine's Triton).
# Every stage runs even if an earlier one failed (exit status 1 if any failed); a stage
# that would start after DEADLINE seconds is skipped, so the whole run fits a lease.
# Knobs: PYTHON, HEADLINE_NUMEL (1e8), BENCH_NUMEL (2^27), REPLAY_STEPS (400), DEADLINE (s, 480).
# Peers: if .peers/ exists (bitsandbytes, torchao and flashoptim unpacked there, carried
# to a machine without network), it is put on PYTHONPATH so their baselines can run;
# FlashOptim's FlashAdamW and Transformer Engine's FusedAdam are `bench kernels`
# baselines when importable (an "unavailable" row with the reason otherwise).
set -euo pipefail

OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
NUMEL="${HEADLINE_NUMEL:-100000000}"
BENCH_NUMEL="${BENCH_NUMEL:-2^27}"
DEADLINE="${DEADLINE:-480}"
SUMMARY="$OUT_DIR/summary.log"
T0=$(date +%s)
failed=0
unset TRITON_INTERPRET  # real kernels on the GPU
export PYTHONUNBUFFERED=1
if [ -d .peers ]; then export PYTHONPATH="$PWD/.peers${PYTHONPATH:+:$PYTHONPATH}"; fi

stage() {  # stage NAME LIMIT_S COMMAND...: run with a limit, log to OUT_DIR/NAME.log, never abort
    local name="$1" limit="$2"; shift 2
    local start rc elapsed=$(( $(date +%s) - T0 ))
    if [ "$elapsed" -ge "$DEADLINE" ]; then
        echo "== $name: SKIPPED (deadline: ${elapsed}s >= ${DEADLINE}s)" | tee -a "$SUMMARY"; failed=1; return
    fi
    echo "== $name (limit ${limit}s, at ${elapsed}s): $*" | tee -a "$SUMMARY"
    start=$(date +%s)
    set +e
    timeout "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    set -e
    local took=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ] || [ "$rc" -eq 5 ]; then  # 5: pytest selected no tests
        echo "   ok ($took s)" | tee -a "$SUMMARY"
    else
        echo "   FAILED rc=$rc ($took s); tail of $name.log:" | tee -a "$SUMMARY"
        tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
        failed=1
    fi
}

stage env 60 "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA'); import importlib.util as u; print('peers', [m for m in ('bitsandbytes', 'torchao', 'flashoptim', 'transformer_engine') if u.find_spec(m)]); import importlib.metadata as md; print('typer', md.version('typer'), 'pydantic', md.version('pydantic') if u.find_spec('pydantic') else None, 'numba', md.version('numba') if u.find_spec('numba') else None)"
command -v nvidia-smi > /dev/null && stage nvidia_smi 30 nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,power.draw --format=csv

# 1. Headline: fused 4-bit AdamW kernel vs copy bandwidth, BReD vs nearest, vs torch fused AdamW.
stage headline 150 "$PY" -m qstate_cli bench headline --numel "$NUMEL" --json "$OUT_DIR/headline.json"
# 2. Bit-exact parity of every kernel with the reference, on the GPU (with fastmath's inline-PTX
#    sqrt.rn fast path and div_top, which Triton's interpreter cannot run: their first real test).
stage kernel_tests 180 "$PY" -m pytest -q -ra tests/test_kernels_adamw.py tests/test_kernels_lion.py \
    tests/test_kernels_sgd.py tests/test_kernels_muon.py tests/test_kernels_launch.py tests/test_kernels_ptx.py \
    tests/test_kernels_nozero.py tests/test_kernels_fastmath.py tests/test_kernels_inf_scale.py \
    --junitxml="$OUT_DIR/kernel_tests.xml"
# 3. The headline command: every 4-bit rounding mode for AdamW against the baselines,
#    FlashOptim and Transformer Engine's FusedAdam included (named: they are not defaults).
stage bench_kernels 150 "$PY" -m qstate_cli bench kernels --bits 4 --numel "$BENCH_NUMEL" --dtype bf16,fp32 \
    --baseline torch-fused,torch-foreach,bf16-states,bnb-adamw8bit,torchao-adamw4bit,flashoptim-adamw,te-fusedadam \
    --warmup-ms 25 --rep-ms 150 --json "$OUT_DIR/bench-kernels-4bit.json" --csv "$OUT_DIR/bench-kernels-4bit.csv"
# 3b. The static prediction (sm_90 SASS per element, issue model) beside each measured
#     fused-kernel row: the first check of the model (docs/kernels.md).
predict() {  # the measured rows of whichever result files exist, beside the prediction
    local files=() f
    for f in "$OUT_DIR/headline.json" "$OUT_DIR/bench-kernels-4bit.json"; do [ -s "$f" ] && files+=("$f"); done
    if [ "${#files[@]}" -eq 0 ]; then echo "no measured results to put beside the prediction"; return 1; fi
    "$PY" scripts/sass_budget.py --beside "${files[@]}" \
        && "$PY" scripts/sass_budget.py --json --beside "${files[@]}" > "$OUT_DIR/prediction.jsonl"
}
export -f predict; export PY OUT_DIR
stage prediction 90 bash -c predict
# 4. Launch overhead on a whole model: one launch per group vs one launch per parameter.
stage bench_gpt2 90 "$PY" -m qstate_cli bench kernels -c bred-4bit --model gpt2-small --dtype bf16 \
    --baseline bred-4bit-per-param,torch-fused,torch-foreach,bnb-adamw8bit,torchao-adamw4bit \
    --warmup-ms 25 --rep-ms 150 --json "$OUT_DIR/bench-kernels-gpt2.json"
# 5. Memory: exact accounting and torch.cuda.max_memory_allocated on GPT-2 small shapes.
stage bench_memory 60 "$PY" -m qstate_cli bench memory --model gpt2-small --json "$OUT_DIR/bench-memory.json"
# 5b. The replay's codec on CUDA: `qstate diagnose` on the demo trace's shape (24,320
#     elements, the default configurations, REPLAY_STEPS steps) with --backend reference and
#     auto (the Triton codec where it covers a state); meta.codec names each state's path.
#     The cached 2000-step demo trace if this machine has one, else a short one made here;
#     a 2-step auto replay first compiles the codec kernels (Triton's cache), so the timed
#     runs measure the replay alone.
replay_codec() {
    local trace b t0 t1
    trace=$("$PY" -c "
from pathlib import Path
from qstate_cli.trace.demo import DemoSettings, demo_path, run_demo
out = Path('$OUT_DIR/demo-${REPLAY_STEPS}steps.pt')
if demo_path().exists():
    print('demo')
else:
    run_demo(out, DemoSettings(steps=$REPLAY_STEPS))
    print(out)") || return 1
    "$PY" -m qstate_cli diagnose "$trace" --device cuda --skip-reset-check --steps-limit 2 --backend auto \
        --json "$OUT_DIR/diagnose-demo-warmup.json" > /dev/null || return 1
    for b in reference auto; do
        t0=$(date +%s.%N)
        "$PY" -m qstate_cli diagnose "$trace" --profile --device cuda --skip-reset-check \
            --steps-limit "$REPLAY_STEPS" --backend "$b" --json "$OUT_DIR/diagnose-demo-$b.json" || return 1
        t1=$(date +%s.%N)
        echo "== backend $b: $trace, $REPLAY_STEPS steps, command wall $(awk "BEGIN { print $t1 - $t0 }") s"
    done
    "$PY" -c "
import json
ref, auto = (json.load(open('$OUT_DIR/diagnose-demo-' + b + '.json'))['meta'] for b in ('reference', 'auto'))
r, a = ref['profile']['config_element_steps_per_s'], auto['profile']['config_element_steps_per_s']
print('== per configuration, M element-steps/s (replay phases synchronized):')
for c in r:
    path = '/'.join(sorted({p[0] for p in auto['codec'][c].values()}))
    print(f'{c:14s} reference {r[c] / 1e6:9.2f}   auto {a[c] / 1e6:9.2f}   x{a[c] / r[c]:6.2f}   auto path: {path}')"
}
REPLAY_STEPS="${REPLAY_STEPS:-400}"
export -f replay_codec; export REPLAY_STEPS
stage replay_codec 75 bash -c replay_codec
# 5c. Configurations in parallel on this machine's CPU cores (`qstate diagnose --config-threads`,
#     docs/diagnose.md): the trace of 5b on --device cpu, the default configurations,
#     CPU_REPLAY_STEPS steps, on 1 thread and on 8 (numba is not installed there: the
#     reference codec); the loop's wall and CPU seconds, and whether the records are the same.
replay_cpu_threads() {
    local trace=demo n
    [ -f "$OUT_DIR/demo-${REPLAY_STEPS}steps.pt" ] && trace="$OUT_DIR/demo-${REPLAY_STEPS}steps.pt"
    for n in 1 8; do
        "$PY" -m qstate_cli diagnose "$trace" --profile --device cpu --skip-reset-check \
            --steps-limit "$CPU_REPLAY_STEPS" --config-threads "$n" --json "$OUT_DIR/diagnose-cpu-threads$n.json" \
            > /dev/null || return 1
    done
    "$PY" -c "
import json
d = {n: json.load(open('$OUT_DIR/diagnose-cpu-threads%d.json' % n)) for n in (1, 8)}
for n, doc in d.items():
    p = doc['meta']['profile']
    print(f'config threads {n} (ran {p[\"config_threads\"]}): loop {p[\"replay_s\"]:.2f} s wall, {p[\"replay_cpu_s\"]:.2f} s CPU, '
          f'{p[\"element_steps_per_s_per_config\"] / 1e6:.2f} M element-steps/s per configuration')
print('records the same:', json.dumps(d[1]['records']) == json.dumps(d[8]['records']))"
}
CPU_REPLAY_STEPS="${CPU_REPLAY_STEPS:-200}"
export -f replay_cpu_threads; export CPU_REPLAY_STEPS
stage replay_cpu_threads 45 bash -c replay_cpu_threads
# 6. Every other CUDA test (timers, replay on the GPU, ...).
stage cuda_tests 90 "$PY" -m pytest -q -ra -m cuda tests --ignore-glob='tests/test_kernels_*' \
    --junitxml="$OUT_DIR/cuda_tests.xml"

for f in headline bench_kernels prediction bench_gpt2 bench_memory replay_codec replay_cpu_threads; do
    echo "== $f (tail)"; tail -n 30 "$OUT_DIR/$f.log" 2>/dev/null || true
done
echo "== done in $(( $(date +%s) - T0 ))s: $([ "$failed" -eq 0 ] && echo 'all stages ok' || echo 'some stages FAILED') (see $SUMMARY)" | tee -a "$SUMMARY"
exit "$failed"
