#!/usr/bin/env bash
# Print the path of a Python 3.12 interpreter (megatron-core 0.19 and transformers 5.25 need it).
set -euo pipefail
for candidate in "${WEIGHTSYNC_PYTHON:-}" python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
  [ -n "$candidate" ] || continue
  if path="$(command -v "$candidate" 2>/dev/null)" && "$path" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    echo "$path"
    exit 0
  fi
done
echo "python3.12 not found: install Python 3.12 (e.g. pyenv install 3.12) or set WEIGHTSYNC_PYTHON" >&2
exit 1
