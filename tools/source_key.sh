#!/usr/bin/env bash
# Print a key of the clone's installable sources (what tools/venv.sh and tools/vllm_env.sh copy
# into their environments): unchanged sources keep the installed copy, so no reinstall runs under
# processes that are using it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
find pyproject.toml README.md sync_runtime operator -type f \( -name '*.py' -o -name '*.json' -o -name '*.toml' -o -name '*.md' \) \
  -not -path '*/__pycache__/*' | sort | xargs sha256sum | sha256sum | cut -c1-16
