//go:build tools

// Package tools pins the helm command so go.sum records its module hashes.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
