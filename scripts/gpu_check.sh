#!/usr/bin/env bash
# One command for a CUDA machine: the kernel parity tests on the GPU, the other CUDA
# tests, and the headline measurement of the fused 4-bit AdamW step at 1e8 elements.
#
#   scripts/gpu_check.sh OUT_DIR        (or OUT=... scripts/gpu_check.sh)
#
# Writes into OUT_DIR: summary.log (one line per stage), <stage>.log for each stage,
# junit XML of the test stages, and headline.json (results kind "kernels", written row by
# row). Every stage runs even if an earlier one failed; the exit status is 1 if any failed.
# Stages (roughly, on an H200): env (s), headline (~1-2 min incl. compilation),
# kernel_tests (~2-4 min: each kernel variant compiles once), cuda_tests (the rest).
# Environment knobs: PYTHON, HEADLINE_NUMEL (default 1e8), STAGE_TIMEOUT (s, default 900).
set -euo pipefail

OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
NUMEL="${HEADLINE_NUMEL:-100000000}"
STAGE_TIMEOUT="${STAGE_TIMEOUT:-900}"
SUMMARY="$OUT_DIR/summary.log"
failed=0
unset TRITON_INTERPRET  # real kernels on the GPU

stage() {  # stage NAME COMMAND...: run, log to OUT_DIR/NAME.log, record the outcome, never abort
    local name="$1"; shift
    local start rc
    start=$(date +%s)
    echo "== $name: $*" | tee -a "$SUMMARY"
    set +e
    timeout "$STAGE_TIMEOUT" "$@" > "$OUT_DIR/$name.log" 2>&1
    rc=$?
    set -e
    local took=$(( $(date +%s) - start ))
    if [ "$rc" -eq 0 ]; then
        echo "   ok ($took s)" | tee -a "$SUMMARY"
    else
        echo "   FAILED rc=$rc ($took s); tail of $name.log:" | tee -a "$SUMMARY"
        tail -n 20 "$OUT_DIR/$name.log" | sed 's/^/   | /' | tee -a "$SUMMARY"
        failed=1
    fi
}

pytest_run() {  # pytest, but "no tests selected" (exit 5) is not a failure
    local rc=0
    "$PY" -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then echo "(no tests selected)"; return 0; fi
    return "$rc"
}
export -f pytest_run
export PY

stage env "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
if command -v nvidia-smi > /dev/null; then
    stage nvidia_smi nvidia-smi
fi
stage headline "$PY" -m qstate_cli.kernels.headline --out "$OUT_DIR" --numel "$NUMEL"
stage kernel_tests bash -c 'pytest_run "$@"' _ -q -ra tests/test_kernels_adamw.py tests/test_kernels_lion.py \
    tests/test_kernels_sgd.py tests/test_kernels_muon.py tests/test_kernels_launch.py tests/test_kernels_ptx.py \
    --junitxml="$OUT_DIR/kernel_tests.xml"
stage cuda_tests bash -c 'pytest_run "$@"' _ -q -ra -m cuda tests --ignore-glob='tests/test_kernels_*' \
    --junitxml="$OUT_DIR/cuda_tests.xml"
# `qstate bench kernels` (built in parallel) belongs here once it exists, e.g.
# stage bench_kernels "$PY" -m qstate_cli bench kernels --bits 4 ... (writes JSON into $OUT_DIR)

echo "== done: $([ "$failed" -eq 0 ] && echo 'all stages ok' || echo 'some stages FAILED') (see $SUMMARY)" | tee -a "$SUMMARY"
exit "$failed"
