{{/* Names, cut to 63 characters (DNS labels). */}}
{{- define "handoff.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "handoff.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "handoff.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "handoff.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "handoff.selectorLabels" -}}
app.kubernetes.io/name: {{ include "handoff.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "handoff.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "handoff.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "handoff.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "handoff.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "handoff.secretName" -}}
{{- default (include "handoff.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{/*
The routers' store URL: store.sentinel when it names hosts, else the bundled Redis
(redis.enabled), else store.redisUrl ("" : each router alone, in memory).
*/}}
{{- define "handoff.storeUrl" -}}
{{- $s := .Values.store.sentinel }}
{{- if $s.hosts }}
{{- $auth := ternary (printf ":%s@" (urlquery $s.password)) "" (ne $s.password "") }}
{{- $q := ternary (printf "?sentinelPassword=%s" (urlquery $s.sentinelPassword)) "" (ne $s.sentinelPassword "") }}
{{- printf "%s://%s%s/%s%s" (ternary "rediss+sentinel" "redis+sentinel" $s.tls) $auth (join "," $s.hosts) (required "store.sentinel.masterName is required with store.sentinel.hosts" $s.masterName) $q }}
{{- else if .Values.redis.enabled }}
{{- $auth := ternary (printf ":%s@" (urlquery .Values.redis.password)) "" (ne .Values.redis.password "") }}
{{- printf "redis://%s%s-redis:6379" $auth (include "handoff.fullname" .) }}
{{- else }}
{{- .Values.store.redisUrl }}
{{- end }}
{{- end }}

{{- define "handoff.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace }}
{{- end }}

{{/*
A role's selector as the router uses it; context: dict "root" $ "selector" "k=v,...".
With discovery.scopeToRelease it also asks for handoff.dev/release=<release>, unless the
selector already names that label: two releases in one namespace must not route to each
other's engines.
*/}}
{{- define "handoff.discoverySelector" -}}
{{- if and .root.Values.discovery.scopeToRelease (not (contains "handoff.dev/release" .selector)) }}
{{- printf "%s,handoff.dev/release=%s" .selector .root.Release.Name }}
{{- else }}
{{- .selector }}
{{- end }}
{{- end }}

{{/*
The router's config file. Chart-owned keys (host, port, logLevel, shutdownGraceMs, discovery,
leases.leaseSeconds) win over router.config; secrets are not here (HANDOFF_* from the Secret).
leases.leaseSeconds is engines.leaseSeconds: a router judging shorter leases than the engines
hold is merely cautious, a longer one hands D blocks the prefiller already freed.
*/}}
{{- define "handoff.routerConfig" -}}
{{- $cfg := deepCopy (default (dict) .Values.router.config) }}
{{- $leases := deepCopy (default (dict) $cfg.leases) }}
{{- if and (hasKey $leases "leaseSeconds") (ne (float64 $leases.leaseSeconds) (float64 .Values.engines.leaseSeconds)) }}
{{- fail (printf "router.config.leases.leaseSeconds (%v) must equal engines.leaseSeconds (%v): set engines.leaseSeconds only, the chart gives it to the router" $leases.leaseSeconds .Values.engines.leaseSeconds) }}
{{- end }}
{{- $_ := set $leases "leaseSeconds" .Values.engines.leaseSeconds }}
{{- $_ := set $cfg "leases" $leases }}
{{- $_ := set $cfg "host" "0.0.0.0" }}
{{- $_ := set $cfg "port" (int .Values.router.port) }}
{{- $_ := set $cfg "adminPort" (int .Values.router.adminPort) }}
{{- $_ := set $cfg "agentPort" (int .Values.router.agentPort) }}
{{- $_ := set $cfg "logLevel" .Values.router.logLevel }}
{{- $_ := set $cfg "shutdownGraceMs" (int .Values.router.shutdownGraceMs) }}
{{- if .Values.discovery.enabled }}
{{- $d := dict "kind" "kubernetes" "namespace" (include "handoff.discoveryNamespace" .) }}
{{- range $role := list "prefill" "decode" "both" }}
{{- with index $.Values.discovery $role }}
{{- $_ := set $d $role (dict "selector" (include "handoff.discoverySelector" (dict "root" $ "selector" .selector)) "port" (int .port)) }}
{{- end }}
{{- end }}
{{- $_ := set $cfg "discovery" $d }}
{{- end }}
{{- toPrettyJson $cfg }}
{{- end }}
