# The front door, two commands; each sets up a local virtual environment on first use
# (.venv: the package with its test extras, and on a machine without an NVIDIA GPU the
# CPU build of torch first, as .ci/run does) and reuses it afterwards.
#
#   make quick    the main job: the quick suite (~2 min on a 2-core CPU) -> results/quick/
#   make test     the tests (CPU: the Triton kernels run in Triton's interpreter)
#
# PYTHON picks the interpreter that makes the environment (default python3); VENV its
# folder. `make clean-venv` removes it; it is rebuilt when pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
READY := $(VENV)/.qstate-installed
CPU_TORCH := torch==2.13.0
JOBS ?= auto

NUMBA_DIR ?= .numba
# What test-cpu-path installs into NUMBA_DIR when it has no numba. The oldest the `cpu` extra
# allows, in a folder of its own and a cache of its own (docs/cpu.md, "The oldest numba"):
#   NUMBA_CACHE_DIR=$(mktemp -d) make test-cpu-path NUMBA_DIR=.numba-0.59 \
#       NUMBA_REQ="numba==0.59.1 llvmlite==0.42.0 numpy==1.26.4"
NUMBA_REQ ?= "numba>=0.59" llvmlite
# The fused CPU path's parity tests (kernels/cpu, diagnose's CPU codec) skip where numba is
# missing, as in `make test`'s environment. `make test-cpu-path` puts numba (the `cpu`
# extra) in NUMBA_DIR, beside .venv and not in it (so `make test` keeps the reference path
# and its speed), and runs a subset that compiles a few kernel layouts (~5 min on the 2-core
# Zen 4 the first time, 7 min before 2026-12-06's forceinline helpers, docs/cpu.md; longer on a
# slower machine; numba caches them under the qstate cache), on
# JOBS workers: the replay's files, which share its kernels, together on one (tests/conftest.py,
# pytest_xdist_make_scheduler), the optimizer kernels' tests one at a time on the others. The
# whole grid: `PYTHONPATH=.numba .venv/bin/python -m pytest tests/test_kernels_cpu*.py` (~15 min
# fresh); the whole suite with numba present (every fused path on): `PYTHONPATH=.numba
# .venv/bin/python -m pytest -n 2 --dist loadfile -m "not serial"` (12-17 min on 2 cores, more
# on a slower machine): run it after changing kernels/cpu (it found a test importing a moved
# helper and a buffer shared across threads).
CPU_PATH_TESTS := tests/test_replay_codec_cpu.py tests/test_replay_stats_cpu.py tests/test_replay_model_cpu.py \
    tests/test_replay_gauss_cpu.py tests/test_replay_rule_cpu.py tests/test_replay_step_cpu.py tests/test_torch_sum_cpu.py \
    tests/test_kernels_cpu.py tests/test_kernels_cpu_momentum.py tests/test_kernels_cpu_cache.py \
    tests/test_codebook_search_cpu.py tests/test_kernels_cpu_minifloat.py tests/test_replay_threads.py \
    tests/test_kernels_cpu_launch.py tests/test_kernels_cpu_elementwise.py tests/test_optim_small.py \
    tests/test_optim_aliasing.py tests/test_optim_checkpoint.py \
    tests/test_kernels_cpu_unit_book.py tests/test_fp32_math.py tests/test_cpu_compile_time.py tests/test_as_avx2.py \
    tests/test_optim_memory.py
CPU_PATH_SELECT := replay_codec_cpu or replay_stats or torch_sum or replay_model or replay_gauss or replay_rule or replay_step or codebook_search or adamw_presets or one-state-sr or lion-bred or sgd-sr \
    or replay_threads or muon-nearest or nonfinite or auto_picks or without_numba or fp16 or cpu_cache \
    or (minifloat_codec and (nearest-e4m3 or bred-e2m2)) or minifloats_stay or kernels_cpu_launch \
    or kernels_cpu_elementwise or (optim_small and adamw) or unit_book or scratch_rows or fp32_math or cpu_compile_time \
    or optim_aliasing or optim_checkpoint or as_avx2 or shifts32 or keeps_the_states or (bf16_nan and AdamW-nearest) or nans_payload

.PHONY: quick test test-cpu-path venv clean-venv

quick: $(READY)
	$(PY) -m qstate_cli run suites/quick.yaml

# The tests on JOBS workers (pytest-xdist; a file stays on one worker), then the few real
# timing verdicts (marker `serial`) alone, since a shared CPU makes them skip as noisy.
test: $(READY)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile -m "not serial" --durations=20
	$(PY) -m pytest -q -m serial

test-cpu-path: $(READY)
	test -d $(NUMBA_DIR)/numba || $(PY) -m pip install -q --disable-pip-version-check --no-deps \
	    --target $(NUMBA_DIR) $(NUMBA_REQ)
	PYTHONPATH=$(NUMBA_DIR) $(PY) -m pytest -q -n $(JOBS) --dist loadgroup $(CPU_PATH_TESTS) -k "$(CPU_PATH_SELECT)"

venv: $(READY)

$(READY): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    echo "NVIDIA GPU found: torch comes with the package's requirements"; \
	else \
	    $(PY) -m pip install -q --disable-pip-version-check "$(CPU_TORCH)"; \
	fi
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(READY)

clean-venv:
	rm -rf $(VENV)
