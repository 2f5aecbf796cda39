#!/usr/bin/env bash
# `make test`: the tiers in two lanes that run side by side, then one verdict.
#
#   lane vllm   make test-vllm VLLM_PART=a                   (engine environment)
#   lane venv   make test-unit, test-e2e, test-megatron      (project venv),
#               then make test-vllm VLLM_PART=b              (engine environment)
#
# Why two lanes: most of a real-engine test's wall time is one process importing torch and vLLM
# or waiting on another process (an engine core, a pod, the apiserver), so a lane alone keeps
# about one of CI's two cores busy. Part b of the vLLM files (the Makefile's VLLM_PART_B) moves
# to the venv lane so that both lanes take about as long. The lanes share no state: each vLLM test uses its own
# namespaces, Ray cluster and control plane (tests/engines/conftest.py, tests/e2e/conftest.py).
# Environments are created first, one at a time, so two lanes never build the same cache.
#
# Each lane writes its log to a file and the log is printed whole when the lane ends, so the
# output reads like a serial run. WS_TEST_SERIAL=1 runs the tiers one after another instead.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
make="${MAKE:-make} --no-print-directory"

start=$(date +%s)
# Every environment and binary the lanes need, built before either lane starts.
bash tools/venv.sh >/dev/null || exit 1
bash tools/vllm_env.sh >/dev/null || exit 1
$make k8s-bins || exit 1

if [ "${WS_TEST_SERIAL:-0}" = 1 ]; then
  failed=""
  for tier in test-unit test-e2e test-megatron test-vllm; do $make "$tier" || failed="$failed $tier"; done
else
  logs="$(mktemp -d "${TMPDIR:-/tmp}/ws-test-lanes.XXXXXX")"
  lane() {  # lane NAME 'TARGET [VAR=VALUE]'...: in order, all of them even after a failure
    local name=$1 rc=0 t0
    shift
    t0=$(date +%s)
    for target in "$@"; do
      # shellcheck disable=SC2086  # a target and its variables, one word each
      $make $target || { rc=1; echo "$target" >>"$logs/$name.failed"; }
    done
    echo "lane $name: $(($(date +%s) - t0))s"
    return $rc
  }
  lane vllm "test-vllm VLLM_PART=a" >"$logs/vllm.log" 2>&1 &
  vllm_pid=$!
  lane venv test-unit test-e2e test-megatron "test-vllm VLLM_PART=b" >"$logs/venv.log" 2>&1 &
  venv_pid=$!
  echo "make test: lanes started (logs in $logs): vllm, venv"
  # Print each lane's log as soon as it ends, the first to end first.
  pending="vllm:$vllm_pid venv:$venv_pid"
  while [ -n "$pending" ]; do
    # shellcheck disable=SC2046  # one pid per word
    wait -n $(for entry in $pending; do echo "${entry##*:}"; done) 2>/dev/null
    still=""
    for entry in $pending; do
      name=${entry%%:*} pid=${entry##*:}
      if kill -0 "$pid" 2>/dev/null; then still="$still $entry"; continue; fi
      echo "===== lane $name ====="
      cat "$logs/$name.log"
    done
    pending="${still# }"
  done
  failed="$(cat "$logs"/*.failed 2>/dev/null | tr '\n' ' ')"
fi
echo "make test: suite wall time $(($(date +%s) - start))s"
if [ -n "${failed// /}" ]; then
  echo "make test: FAILED: $failed"
  exit 1
fi
