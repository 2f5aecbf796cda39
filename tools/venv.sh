#!/usr/bin/env bash
# Print the path of the project's virtualenv, creating it when missing.
#
# The venv lives outside the clone, keyed by a hash of constraints.txt, pyproject.toml's
# requirements and the Python version, so every clone on this machine (and CI's fresh clone)
# reuses one set of installed dependencies. The project itself goes in as a regular,
# non-editable install of the calling clone: no clone's path is recorded in the venv, so
# deleting one clone never breaks another. `make` also puts the clone first on PYTHONPATH, so a
# clone always runs its own sources even if another clone reinstalled since.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
python="$(bash "$root/tools/python312.sh")"
# What gets installed: pyproject.toml's requirements with all our extras, under constraints.txt.
requirements="$("$python" - "$root/pyproject.toml" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
print("\n".join(project["dependencies"] + extras["plot"] + extras["dev"] + extras["engines"]))
PY
)"
# Comments in constraints.txt (and the engine env's "#vllm-env" pins) do not change this venv.
key="$(printf '%s\n' "$requirements" | cat - <(grep -v '^#' "$root/constraints.txt") <("$python" --version) | sha256sum | cut -c1-12)"
venv="$cache/venv-py312-$key"
mkdir -p "$cache"
exec 9>"$cache/venv.lock"
flock 9   # concurrent callers (parallel makes, several clones) wait instead of racing the install
pip=("$venv/bin/pip" install -q --disable-pip-version-check -c "$root/constraints.txt")
if [ ! -f "$venv/.complete" ]; then
  echo "venv: creating $venv (first run downloads torch, ray and the engines; a few minutes)" >&2
  start=$(date +%s)
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "${pip[@]}" setuptools >&2
  # Dependencies first (the project's own extras), so a source edit never reinstalls torch.
  printf '%s\n' "$requirements" >"$venv/requirements.txt"
  "${pip[@]}" -r "$venv/requirements.txt" >&2
  touch "$venv/.complete"
  echo "venv: created in $(( $(date +%s) - start ))s" >&2
else
  echo "venv: cache hit $venv" >&2
fi
# The calling clone's code, copied into the venv when it differs from what is installed (a few
# seconds, no downloads); unchanged sources skip the reinstall, so processes of another clone that
# runs the same code are not disturbed. Build outputs go to a temporary folder: the clone stays clean.
source_key="$(bash "$root/tools/source_key.sh")"
if [ "$(cat "$venv/.weightsync-source" 2>/dev/null)" != "$source_key" ]; then
  build="$(mktemp -d)"
  trap 'rm -rf "$build"' EXIT
  cp -r "$root/pyproject.toml" "$root/README.md" "$root/sync_runtime" "$root/operator" "$build/"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall "$build" >&2
  echo "$source_key" >"$venv/.weightsync-source"
fi
echo "$venv"
