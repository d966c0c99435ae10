//go:build tools

// Package tools pins the Prometheus server that hack/testbin/build.sh builds for the dashboard
// test, so `go mod tidy` records every module it needs in go.sum (hash-pinned).
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
)
