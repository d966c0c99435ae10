#!/usr/bin/env bash
# Generate a throwaway PKI for a local test control plane (plain openssl, valid 2 days):
#   ca.{crt,key}         cluster CA (signs the serving and client certs; kubeconfigs trust it)
#   apiserver.{crt,key}  serving cert, SAN 127.0.0.1/localhost/kubernetes.default.svc/10.0.0.1
#   admin.{crt,key}      client cert in group system:masters (the admin kubeconfig)
#   sa.key               RSA key that signs and verifies ServiceAccount tokens (TokenRequest)
# usage: hack/k8s/mkcerts.sh DIR
set -euo pipefail
D=${1:?usage: mkcerts.sh DIR}
mkdir -p "$D"
cd "$D"
umask 077
q() { "$@" 2>/dev/null || { echo "mkcerts.sh: failed: $*" >&2; exit 1; }; }
q openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=warmserve-test-ca"
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc,IP:10.0.0.1\nextendedKeyUsage=serverAuth\n' > serving.ext
q openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
q openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 2 -extfile serving.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
q openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=admin"
q openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 2 -extfile client.ext
q openssl genrsa -out sa.key 2048
rm -f ./*.csr ./*.ext ca.srl
