{{/*
Names and labels shared by every template. templates/rbac.yaml (the operator's RBAC) uses
warmserve.operatorServiceAccountName and warmserve.agentServiceAccountName from here.
*/}}

{{- define "warmserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-derived prefix, at most 45 characters so "<prefix>-operator-client-tls" fits 63. */}}
{{- define "warmserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "warmserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "warmserve.labels" -}}
helm.sh/chart: {{ include "warmserve.chart" . }}
app.kubernetes.io/name: {{ include "warmserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: warmserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels; call with (dict "ctx" $ "component" "operator"). */}}
{{- define "warmserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "warmserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "warmserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The agent's image: agent.image (the CUDA image, images/agent-cuda.Dockerfile) unless its
repository is empty, then the shared image (images/warmserve.Dockerfile). */}}
{{- define "warmserve.agentImage" -}}
{{- if .Values.agent.image.repository }}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) }}
{{- else }}
{{- include "warmserve.image" . }}
{{- end }}
{{- end }}

{{- define "warmserve.operatorServiceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (printf "%s-operator" (include "warmserve.fullname" .)) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "warmserve.agentServiceAccountName" -}}
{{- if .Values.agent.serviceAccount.create }}
{{- default (printf "%s-agent" (include "warmserve.fullname" .)) .Values.agent.serviceAccount.name }}
{{- else }}
{{- required "agent.serviceAccount.name is required when agent.serviceAccount.create is false" .Values.agent.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "warmserve.gatewayServiceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (printf "%s-gateway" (include "warmserve.fullname" .)) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- required "gateway.serviceAccount.name is required when gateway.serviceAccount.create is false" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Secret holding the agents' server certificate (keys ca.crt: the CA the operator's client
certificate chains to, tls.crt, tls.key). */}}
{{- define "warmserve.tlsServerSecret" -}}
{{- if eq .Values.tls.mode "existingSecret" }}
{{- include "warmserve.validateExistingSecrets" . }}
{{- .Values.tls.serverSecret }}
{{- else }}
{{- printf "%s-agent-server-tls" (include "warmserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Secret holding the operator's client certificate (keys ca.crt: the CA the agents' server
certificates chain to, tls.crt, tls.key). */}}
{{- define "warmserve.tlsClientSecret" -}}
{{- if eq .Values.tls.mode "existingSecret" }}
{{- include "warmserve.validateExistingSecrets" . }}
{{- .Values.tls.clientSecret }}
{{- else }}
{{- printf "%s-operator-client-tls" (include "warmserve.fullname" .) }}
{{- end }}
{{- end }}

{{/* Mode existingSecret: one Secret per side. One certificate for both sides would give every
agent the operator's identity, so any node's key could drive every other node. */}}
{{- define "warmserve.validateExistingSecrets" -}}
{{- if and .Values.tls.existingSecret (not (and .Values.tls.serverSecret .Values.tls.clientSecret)) }}
{{- fail "tls.existingSecret (one certificate for the agents and the operator) would let any agent's key drive every other agent: give tls.serverSecret (agents: serverAuth only) and tls.clientSecret (operator: clientAuth only) instead; hack/k8s/mkcerts.sh --warmserve makes both (docs/security.md)" }}
{{- end }}
{{- if not (and .Values.tls.serverSecret .Values.tls.clientSecret) }}
{{- fail "tls.mode=existingSecret needs tls.serverSecret and tls.clientSecret (hack/k8s/mkcerts.sh --warmserve makes both)" }}
{{- end }}
{{- end }}

{{/* The common name of the operator's client certificate (modes generate and certManager). */}}
{{- define "warmserve.operatorCN" -}}
{{- printf "%s-operator" (include "warmserve.fullname" .) }}
{{- end }}

{{/* The client identities every agent accepts for all calls (--allow-client-id): tls.clientIdentities,
or the operator certificate's common name. */}}
{{- define "warmserve.clientIdentities" -}}
{{- $ids := .Values.tls.clientIdentities }}
{{- if not $ids }}
{{- $ids = list (printf "CN=%s" (include "warmserve.operatorCN" .)) }}
{{- end }}
{{- toJson $ids }}
{{- end }}

{{/* TLS settings values.schema.json cannot express (tls.mode itself is an enum there). */}}
{{- define "warmserve.validateTLS" -}}
{{- if .Values.tls.enabled }}
{{- if and (eq .Values.tls.mode "certManager") (not .Values.tls.certManager.issuerRef.name) }}
{{- fail "tls.certManager.issuerRef.name is required when tls.mode is certManager" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Pod annotations: the TLS checksum (generated certificates only, so a new certificate restarts
the pods), Prometheus scrape annotations when metrics.scrapeAnnotations is on and the pod serves
metrics, then the user's podAnnotations, which win on a clash. Call with
(dict "ctx" $ "metricsPort" PORT "user" PODANNOTATIONS); renders nothing when there are none.
*/}}
{{- define "warmserve.podAnnotations" -}}
{{- $ctx := .ctx }}
{{- $ann := dict }}
{{- if and $ctx.Values.tls.enabled (eq $ctx.Values.tls.mode "generate") }}
{{- $_ := set $ann "checksum/tls" (include (print $ctx.Template.BasePath "/tls.yaml") $ctx | sha256sum) }}
{{- end }}
{{- if and $ctx.Values.metrics.scrapeAnnotations .metricsPort }}
{{- $_ := set $ann "prometheus.io/scrape" "true" }}
{{- $_ := set $ann "prometheus.io/port" (toString .metricsPort) }}
{{- $_ := set $ann "prometheus.io/path" "/metrics" }}
{{- end }}
{{- $ann = merge (deepCopy (default (dict) .user)) $ann }}
{{- with $ann }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* Port clashes inside one pod, which values.schema.json cannot express. */}}
{{- define "warmserve.validatePorts" -}}
{{- $op := .Values.operator }}
{{- if and $op.metricsPort (eq (int $op.metricsPort) (int $op.healthPort)) }}
{{- fail "operator.metricsPort and operator.healthPort must differ" }}
{{- end }}
{{- $ag := .Values.agent }}
{{- if and $ag.enabled $ag.metricsPort (eq (int $ag.metricsPort) (int $ag.grpcPort)) }}
{{- fail "agent.metricsPort and agent.grpcPort must differ" }}
{{- end }}
{{- $gw := .Values.gateway }}
{{- if and $gw.enabled (eq (int $gw.port) (int $gw.adminPort)) }}
{{- fail "gateway.port and gateway.adminPort must differ" }}
{{- end }}
{{- end }}

{{/* The tracing flags every component takes (values: tracing), or nothing when it is off. */}}
{{- define "warmserve.tracingArgs" -}}
{{- with .Values.tracing }}
{{- if .enabled }}
{{- if not .endpoint }}
{{- fail "tracing.enabled needs tracing.endpoint (the collector's OTLP/HTTP URL, e.g. http://otel-collector:4318)" }}
{{- end }}
- --otlp-traces-endpoint={{ .endpoint }}
- --trace-sample-ratio={{ .sampleRatio }}
{{- end }}
{{- end }}
{{- end }}

{{/*
TCP port ranges [from, to] of networkPolicy.enginePorts without the agent's own ports (gRPC,
metrics), which only the operator and Prometheus may reach; renders NetworkPolicyPort items.
*/}}
{{- define "warmserve.enginePortRanges" -}}
{{- $lo := int .Values.networkPolicy.enginePorts.from }}
{{- $hi := int .Values.networkPolicy.enginePorts.to }}
{{- $a := int .Values.agent.grpcPort }}
{{- $b := int .Values.agent.metricsPort }}
{{- if not $b }}{{ $b = $a }}{{ end }}
{{- $skip := ternary (list $a $b) (list $b $a) (le $a $b) }}
{{- $cur := $lo }}
{{- range $p := $skip }}
{{- if and (ge $p $cur) (le $p $hi) }}
{{- if lt $cur $p }}
- {protocol: TCP, port: {{ $cur }}{{ if lt $cur (sub $p 1) }}, endPort: {{ sub $p 1 }}{{ end }}}
{{- end }}
{{- $cur = add1 $p }}
{{- end }}
{{- end }}
{{- if le $cur $hi }}
- {protocol: TCP, port: {{ $cur }}{{ if lt $cur $hi }}, endPort: {{ $hi }}{{ end }}}
{{- end }}
{{- end }}

{{/* The Prometheus pods allowed to scrape metrics ports: one NetworkPolicyPeer. */}}
{{- define "warmserve.prometheusPeer" -}}
{{- $p := .Values.networkPolicy.prometheus }}
- namespaceSelector: {{ toJson (default (dict) $p.namespaceSelector) }}
  podSelector: {{ toJson (default (dict) $p.podSelector) }}
{{- end }}
