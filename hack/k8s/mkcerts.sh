#!/usr/bin/env bash
# Generate a throwaway PKI for a local test control plane (plain openssl, valid 2 days):
#   ca.{crt,key}         cluster CA (signs the serving and client certs; kubeconfigs trust it)
#   apiserver.{crt,key}  serving cert, SAN 127.0.0.1/localhost/kubernetes.default.svc/10.0.0.1
#                        (serverAuth only)
#   admin.{crt,key}      client cert in group system:masters (the admin kubeconfig; clientAuth only)
#   sa.key               RSA key that signs and verifies ServiceAccount tokens (TokenRequest)
# usage: hack/k8s/mkcerts.sh DIR
#
# Or the certificates of warmserve's operator<->agent mutual TLS, for the chart's
# tls.mode=existingSecret (tls.serverSecret, tls.clientSecret) or a hand-run agent:
# usage: hack/k8s/mkcerts.sh --warmserve DIR [NAMESPACE [RELEASE_FULLNAME]]
#   DIR/ca.{crt,key}                   the CA (keep ca.key offline, or delete it)
#   DIR/agent-server/{ca.crt,tls.crt,tls.key}
#                                      agents: serverAuth only, DNS SAN $SERVER_NAME
#   DIR/operator-client/{ca.crt,tls.crt,tls.key}
#                                      operator: clientAuth only, CN <fullname>-operator (the
#                                      identity agents accept) and URI SAN
#                                      spiffe://$TRUST_DOMAIN/ns/<namespace>/sa/<fullname>-operator
#   DIR/admin-client/{ca.crt,tls.crt,tls.key}
#                                      an admin's `warmserve agent inspect`: clientAuth only, CN
#                                      <fullname>-admin (list it in tls.readerIdentities)
# NAMESPACE defaults to warmserve, RELEASE_FULLNAME to warmserve; env SERVER_NAME (default
# warmserve-agent), TRUST_DOMAIN (cluster.local) and DAYS (365) change the rest. Each folder is
# one Secret: kubectl create secret generic NAME --type=kubernetes.io/tls --from-file=DIR/agent-server
set -euo pipefail
q() { "$@" 2>/dev/null || { echo "mkcerts.sh: failed: $*" >&2; exit 1; }; }

# leaf NAME SUBJECT EXTENSIONS DAYS: a P-256 key and a certificate signed by ca.{crt,key}.
leaf() {
  q openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" \
    -out "$1.csr" -subj "$2"
  printf '%b' "$3" > "$1.ext"
  q openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" \
    -days "$4" -extfile "$1.ext"
  rm -f "$1.csr" "$1.ext"
}

if [ "${1:-}" = "--warmserve" ]; then
  D=${2:?usage: mkcerts.sh --warmserve DIR [NAMESPACE [RELEASE_FULLNAME]]}
  NS=${3:-warmserve}
  FULL=${4:-warmserve}
  SERVER_NAME=${SERVER_NAME:-warmserve-agent}
  TRUST_DOMAIN=${TRUST_DOMAIN:-cluster.local}
  DAYS=${DAYS:-365}
  mkdir -p "$D"
  cd "$D"
  umask 077
  q openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key \
    -out ca.crt -days "$DAYS" -subj "/CN=$FULL-mtls-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  base='basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n'
  leaf agent "/CN=$SERVER_NAME" "${base}extendedKeyUsage=serverAuth\nsubjectAltName=DNS:$SERVER_NAME\n" "$DAYS"
  leaf operator "/CN=$FULL-operator" \
    "${base}extendedKeyUsage=clientAuth\nsubjectAltName=URI:spiffe://$TRUST_DOMAIN/ns/$NS/sa/$FULL-operator\n" "$DAYS"
  leaf admin "/CN=$FULL-admin" "${base}extendedKeyUsage=clientAuth\n" "$DAYS"
  for pair in agent:agent-server operator:operator-client admin:admin-client; do
    mkdir -p "${pair#*:}"
    cp ca.crt "${pair#*:}/ca.crt"
    mv "${pair%%:*}.crt" "${pair#*:}/tls.crt"
    mv "${pair%%:*}.key" "${pair#*:}/tls.key"
  done
  rm -f ca.srl
  exit 0
fi

D=${1:?usage: mkcerts.sh DIR | mkcerts.sh --warmserve DIR [NAMESPACE [RELEASE_FULLNAME]]}
mkdir -p "$D"
cd "$D"
umask 077
q openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj "/CN=warmserve-test-ca"
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc,IP:10.0.0.1\nextendedKeyUsage=serverAuth\n' > serving.ext
q openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
q openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 2 -extfile serving.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
q openssl req -newkey rsa:2048 -nodes -keyout admin.key -out admin.csr -subj "/O=system:masters/CN=admin"
q openssl x509 -req -in admin.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out admin.crt -days 2 -extfile client.ext
q openssl genrsa -out sa.key 2048
rm -f ./*.csr ./*.ext ca.srl
