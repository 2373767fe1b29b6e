{{/* Engine pods (issue 11): names and settings shared by engines.yaml and engines-prestop.yaml. */}}

{{/* The ConfigMap holding files/prestop-drain.py. */}}
{{- define "handoff.prestopConfigMap" -}}
{{- printf "%s-prestop" (include "handoff.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The routers the preStop drain asks: engines.drain.routerUrls, else the -admin Service's admin port. */}}
{{- define "handoff.drainRouterUrls" -}}
{{- if .Values.engines.drain.routerUrls }}
{{- join "," .Values.engines.drain.routerUrls }}
{{- else }}
{{- printf "http://%s-admin.%s.svc:%d" (include "handoff.fullname" .) .Release.Namespace (int .Values.router.adminPort) }}
{{- end }}
{{- end }}

{{/* The routers the agents follow: engines.agent.routerUrls, else the -admin Service's agent port. */}}
{{- define "handoff.agentRouterUrls" -}}
{{- if .Values.engines.agent.routerUrls }}
{{- join "," .Values.engines.agent.routerUrls }}
{{- else }}
{{- printf "http://%s-admin.%s.svc:%d" (include "handoff.fullname" .) .Release.Namespace (int .Values.router.agentPort) }}
{{- end }}
{{- end }}

{{/*
The equality terms (k=v, k==v) of a Kubernetes label selector string, as a YAML map: what the
engine checks and the NetworkPolicies can match on.
*/}}
{{- define "handoff.selectorEqualities" -}}
{{- $labels := dict }}
{{- range $term := splitList "," . }}
{{- $term = trim $term }}
{{- if regexMatch "^[^=!()\\s]+==?[^=!()\\s]*$" $term }}
{{- $kv := splitList "=" $term }}
{{- $_ := set $labels (first $kv) (last $kv) }}
{{- end }}
{{- end }}
{{- toYaml $labels }}
{{- end }}

{{/* Selector labels of one role's engines; context: dict "root" $ "role" "prefill". */}}
{{- define "handoff.engineSelectorLabels" -}}
app.kubernetes.io/name: {{ include "handoff.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}-engine
{{- end }}

{{/*
Render-time checks for one enabled role (context as above): the pods must be what the
router's discovery selects, on the port it dials, and leave the drain a positive deadline.
Only equality terms of the selector (k=v, k==v) are checked.
*/}}
{{- define "handoff.engineChecks" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $e := index $root.Values.engines $role }}
{{- if lt (int $e.terminationGracePeriodSeconds) (add (int $root.Values.engines.drain.marginSeconds) 1) }}
{{- fail (printf "engines.%s.terminationGracePeriodSeconds must exceed engines.drain.marginSeconds: the preStop drain's deadline is their difference" $role) }}
{{- end }}
{{- if $root.Values.discovery.enabled }}
{{- $d := index $root.Values.discovery $role }}
{{- if not $d }}
{{- fail (printf "engines.%s.enabled needs discovery.%s: the router would never find these pods" $role $role) }}
{{- end }}
{{- if ne (int $e.port) (int $d.port) }}
{{- fail (printf "engines.%s.port (%d) must equal discovery.%s.port (%d): the router dials that port" $role (int $e.port) $role (int $d.port)) }}
{{- end }}
{{- range $k, $v := fromYaml (include "handoff.selectorEqualities" $d.selector) }}
{{- if or (not (hasKey (default (dict) $e.labels) $k)) (ne (toString (index $e.labels $k)) (toString $v)) }}
{{- fail (printf "engines.%s.labels must include %s=%s: discovery.%s.selector is %q" $role $k $v $role $d.selector) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not (has (toString $root.Values.engines.connector) (list "nixl" "handoff")) }}
{{- fail (printf "engines.connector must be nixl (vLLM's NixlConnector) or handoff (handoff's connector, in the engine image: pip install ./transfer-agent/vllm); got %q" (toString $root.Values.engines.connector)) }}
{{- end }}
{{- if and (eq (toString $root.Values.engines.connector) "handoff") (not $root.Values.secrets.agentToken) (not $root.Values.secrets.existingSecret) }}
{{- fail "engines.connector=handoff needs secrets.agentToken: the connector follows the routers' agent event stream, which the token guards" }}
{{- end }}
{{- if and (eq (toString $root.Values.engines.connector) "handoff") $root.Values.engines.agent.enabled }}
{{- fail "engines.connector=handoff and engines.agent.enabled are two followers of the same events for one engine: pick one (vLLM engines: the connector)" }}
{{- end }}
{{- range $k := keys (default (dict) $e.podSpec) | sortAlpha }}
{{- if has $k (list "containers" "initContainers" "volumes" "terminationGracePeriodSeconds" "automountServiceAccountToken" "enableServiceLinks" "imagePullSecrets" "nodeSelector" "affinity" "tolerations") }}
{{- fail (printf "engines.%s.podSpec.%s: the chart sets it; use engines.%s's own value for it (volumes, nodeSelector, affinity, tolerations...)" $role $k $role) }}
{{- end }}
{{- end }}
{{- if and $root.Values.engines.simulator.enabled $root.Values.engines.agent.enabled }}
{{- fail "engines.simulator with engines.agent.enabled is not wired: the simulator moves no KV through an agent in a pod (run it without the agent)" }}
{{- end }}
{{- if not (has (toString $root.Values.engines.modelCache.type) (list "" "pvc" "hostPath")) }}
{{- fail (printf "engines.modelCache.type must be \"\", pvc or hostPath; got %q" (toString $root.Values.engines.modelCache.type)) }}
{{- end }}
{{- if has "--kv-transfer-config" (default (list) $e.args) }}
{{- fail (printf "engines.%s.args must not carry --kv-transfer-config: the chart builds it from engines.kvTransferConfig, with kv_lease_duration = engines.leaseSeconds" $role) }}
{{- end }}
{{- if and $root.Values.engines.agent.enabled (not $root.Values.secrets.agentToken) (not $root.Values.secrets.existingSecret) }}
{{- fail "engines.agent.enabled needs secrets.agentToken: the agent listens on the pod IP, so its API and the router's agent endpoints need the token" }}
{{- end }}
{{- if and $root.Values.engines.agent.enabled (not $root.Values.secrets.existingSecret) (lt (len $root.Values.secrets.peerSecret) 16) }}
{{- fail "engines.agent.enabled needs secrets.peerSecret (at least 16 characters, not the agent token): agents prove it to each other in every handshake, so a leaked agent token does not open other agents' KV metadata" }}
{{- end }}
{{- if and $root.Values.secrets.peerSecret (eq $root.Values.secrets.peerSecret $root.Values.secrets.agentToken) }}
{{- fail "secrets.peerSecret must differ from secrets.agentToken: one leaked secret must not open both the router's agent endpoints and the agents' handshakes" }}
{{- end }}
{{- end }}

{{/* Labels of engine objects; context: dict "root" $ "role" "prefill" (role "drain" for the ConfigMap). */}}
{{- define "handoff.engineLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "handoff.engineSelectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{/*
The engines' --kv-transfer-config (JSON): engines.kvTransferConfig with
kv_connector_extra_config.kv_lease_duration set to engines.leaseSeconds, vLLM 0.32's lease
(D heartbeats every lease/6). One lease length everywhere: the router's leases.leaseSeconds
and the agents' --lease-seconds come from the same value (issue 17 item 3).
*/}}
{{- define "handoff.kvTransferConfig" -}}
{{- $kv := deepCopy (default (dict) .Values.engines.kvTransferConfig) }}
{{- $extra := deepCopy (default (dict) $kv.kv_connector_extra_config) }}
{{- if and (hasKey $extra "kv_lease_duration") (ne (float64 $extra.kv_lease_duration) (float64 .Values.engines.leaseSeconds)) }}
{{- fail (printf "engines.kvTransferConfig.kv_connector_extra_config.kv_lease_duration (%v) must equal engines.leaseSeconds (%v): set engines.leaseSeconds only" $extra.kv_lease_duration .Values.engines.leaseSeconds) }}
{{- end }}
{{- $_ := set $extra "kv_lease_duration" .Values.engines.leaseSeconds }}
{{- if eq (toString .Values.engines.connector) "handoff" }}
{{- /* handoff's connector (transfer-agent/vllm): vLLM's NIXL pull connector that follows the routers' events. */}}
{{- $_ := set $kv "kv_connector" "HandoffNixlConnector" }}
{{- $_ := set $kv "kv_connector_module_path" "handoff_vllm.connector" }}
{{- $_ := set $extra "handoff_router_urls" (splitList "," (include "handoff.agentRouterUrls" .)) }}
{{- $_ := set $extra "handoff_token_file" "/etc/handoff-connector/agent-token" }}
{{- end }}
{{- $_ := set $kv "kv_connector_extra_config" $extra }}
{{- toJson $kv }}
{{- end }}

{{- /*
vLLM's --kv-events-config (the simulator takes the same JSON): the PUB socket and the replay
socket bound on every interface at engines.kvEvents' ports, which the pod's annotations publish
for the router's discovery.
*/}}
{{- define "handoff.kvEventsConfig" -}}
{{- $k := .Values.engines.kvEvents }}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%v" $k.port) "replay_endpoint" (printf "tcp://*:%v" $k.replayPort) | toJson }}
{{- end }}
