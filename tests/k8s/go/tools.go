//go:build tools

// Package tools pins the main packages built by tests/k8s/ensure_binaries.sh.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
)
