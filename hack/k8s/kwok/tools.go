//go:build tools

// Package tools pins the kwok command so go.sum records its module hashes.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
