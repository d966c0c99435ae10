//go:build tools

// Package tools pins the commands hack/k8s/build.sh builds, so `go mod tidy` records every module
// they need in go.sum (hash-pinned; nothing third-party is vendored into this repository).
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
