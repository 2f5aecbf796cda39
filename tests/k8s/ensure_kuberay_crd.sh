#!/usr/bin/env bash
# Fetches KubeRay's own RayCluster CRD from its published Go module into a cache outside the
# clone (next to the control-plane binaries of ensure_binaries.sh), keyed by version:
#
#   ${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}/kuberay-$KUBERAY_VERSION/ray.io_rayclusters.yaml
#
# Source: `go mod download github.com/ray-project/kuberay/ray-operator@$KUBERAY_VERSION` (checked
# against the Go checksum database like any module), file config/crd/bases/ray.io_rayclusters.yaml.
# Idempotent: a complete cache prints one "cache hit" line. Prints the CRD file's path as the last
# line of stdout; exits non-zero with a message on stderr on failure.
set -euo pipefail

KUBERAY_VERSION=v1.4.2
MODULE=github.com/ray-project/kuberay/ray-operator
CRD_IN_MODULE=config/crd/bases/ray.io_rayclusters.yaml

CACHE_ROOT="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
DEST="$CACHE_ROOT/kuberay-$KUBERAY_VERSION"
CRD="$DEST/ray.io_rayclusters.yaml"
STAMP="$DEST/.complete"

die() { echo "ensure_kuberay_crd: ERROR: $*" >&2; exit 1; }

mkdir -p "$CACHE_ROOT"
exec 8>"$CACHE_ROOT/kuberay.lock"
flock 8   # parallel callers wait for one download instead of racing it

if [[ -f "$STAMP" && -s "$CRD" && "$(head -n1 "$STAMP")" == "$MODULE@$KUBERAY_VERSION" ]]; then
    echo "kuberay CRD: cache hit ($CRD)"
    echo "$CRD"
    exit 0
fi

command -v go >/dev/null || die "go not found on PATH (needed to download $MODULE@$KUBERAY_VERSION)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Outside any module (a stray go.work or go.mod in a parent directory must not apply).
if ! (cd "$work" && GOWORK=off GOFLAGS=-mod=mod go mod download -json "$MODULE@$KUBERAY_VERSION") >"$work/info.json" 2>"$work/err"; then
    cat "$work/err" "$work/info.json" >&2
    die "go mod download $MODULE@$KUBERAY_VERSION failed"
fi
dir="$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' "$work/info.json")"
sum="$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",$/\1/p' "$work/info.json")"
[[ -n "$dir" && -s "$dir/$CRD_IN_MODULE" ]] || die "no $CRD_IN_MODULE in $MODULE@$KUBERAY_VERSION (Dir: ${dir:-none})"
mkdir -p "$DEST"
cp "$dir/$CRD_IN_MODULE" "$CRD.tmp"
chmod 644 "$CRD.tmp"
mv -f "$CRD.tmp" "$CRD"
printf '%s\n%s\n' "$MODULE@$KUBERAY_VERSION" "$sum" >"$STAMP"
echo "kuberay CRD: fetched $MODULE@$KUBERAY_VERSION ($sum)" >&2
echo "$CRD"
