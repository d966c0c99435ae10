//go:build tools

// Package tools pins the S3-compatible server (Versity S3 Gateway, posix backend) that
// hack/testbin/build.sh builds for the s3:// model source tests (hash-pinned in go.sum).
package tools

import (
	_ "github.com/versity/versitygw/cmd/versitygw"
)
