#!/usr/bin/env bash
# Print the path of the project's virtualenv, creating it when missing.
# The venv lives outside the clone, keyed by a hash of the pinned dependencies in pyproject.toml,
# so every clone on this machine (and CI's fresh clone) reuses it. The project itself is installed
# editable on every call (cheap), so the venv always points at the calling clone's sources.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
key="$(python3 - "$root/pyproject.toml" <<'PY'
import hashlib, sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))
pins = d["build-system"]["requires"] + d["project"]["dependencies"] + d["project"]["optional-dependencies"]["dev"]
print(hashlib.sha256("\n".join(pins).encode()).hexdigest()[:12])
PY
)"
venv="$cache/venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "venv: creating $venv (first run downloads torch and ray; a few minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "setuptools==80.9.0" >&2
  "$venv/bin/pip" install -q --disable-pip-version-check -e "$root[dev]" >&2
  touch "$venv/.complete"
else
  echo "venv: cache hit $venv" >&2
  # Re-point the editable install at this clone (a few seconds, no downloads).
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$root" >&2
fi
echo "$venv"
