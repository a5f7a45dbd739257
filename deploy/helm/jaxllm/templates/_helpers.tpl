{{/*
Names, labels, and the pod template shared by the Deployment and both templates of the
LeaderWorkerSet. The pod template takes (dict "root" $ "role" ROLE), ROLE one of
  server  the Deployment's pod: serves HTTP
  leader  a multi-host group's pod 0 (host 0): serves HTTP, schedules, runs the coordinator
  worker  a multi-host group's other pods: the same command, no HTTP; they follow host 0
*/}}

{{- define "jaxllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name (the release name alone when it contains the chart's name). */}}
{{- define "jaxllm.fullname" -}}
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

{{/*
The LeaderWorkerSet's name: not the Service's, since LeaderWorkerSet makes a headless Service of
its own name. Short enough for its pods' names (NAME-GROUP-INDEX) to stay DNS labels.
*/}}
{{- define "jaxllm.lwsName" -}}
{{- printf "%s-slice" (include "jaxllm.fullname" . | trunc 50 | trimSuffix "-") }}
{{- end }}

{{- define "jaxllm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "jaxllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "jaxllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "jaxllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "jaxllm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "jaxllm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "jaxllm.claimName" -}}
{{- default (printf "%s-data" (include "jaxllm.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{/* preStop pause + draining (--shutdown-timeout) + stopping the engine core (up to 20 s) + slack. */}}
{{- define "jaxllm.terminationGracePeriodSeconds" -}}
{{- add .Values.server.preStopSleepSeconds .Values.server.shutdownTimeout 35 }}
{{- end }}

{{/*
`jaxllm serve` and its flags. Every host of a multi-host group runs this same list: hosts must
build the same engine (host 0 checks a fingerprint of it). $(VAR) is expanded by Kubernetes from
the LWS_* variables LeaderWorkerSet gives each pod: the leader's DNS name, the pods in the group,
and this pod's index (0 on the leader).
*/}}
{{- define "jaxllm.serveArgs" -}}
- serve
- {{ .Values.model.path | quote }}
- --served-model-name
- {{ .Values.model.servedModelName | quote }}
- --host
- 0.0.0.0
- --port
- {{ include "jaxllm.enginePort" . | quote }}
- --max-num-seqs
- {{ .Values.engine.maxNumSeqs | int | quote }}
- --max-num-batched-tokens
- {{ .Values.engine.maxNumBatchedTokens | int | quote }}
- --max-queued-requests
- {{ .Values.server.maxQueuedRequests | int | quote }}
- --shutdown-timeout
- {{ .Values.server.shutdownTimeout | int | quote }}
- --compilation-cache-dir
- /data/cache/xla
{{- with .Values.engine.maxModelLen }}
- --max-model-len
- {{ . | int | quote }}
{{- end }}
{{- with .Values.engine.tensorParallelSize }}
- --tensor-parallel-size
- {{ . | int | quote }}
{{- end }}
{{- with .Values.engine.dataParallelSize }}
- --data-parallel-size
- {{ . | int | quote }}
{{- end }}
{{- if .Values.kvEvents.enabled }}
- --kv-events-config
- {{ include "jaxllm.kvEventsConfig" . | quote }}
- --prefix-caching-hash-algo
- {{ .Values.kvEvents.hashAlgo | quote }}
{{- end }}
{{- if .Values.disaggregation.role }}
- --kv-transfer-config
- {{ include "jaxllm.kvTransferConfig" . | quote }}
{{- end }}
{{- if .Values.multiHost.enabled }}
- --coordinator-address
- {{ printf "$(LWS_LEADER_ADDRESS):%d" (.Values.multiHost.coordinatorPort | int) | quote }}
- --num-processes
- $(LWS_GROUP_SIZE)
- --process-id
- $(LWS_WORKER_INDEX)
{{- end }}
{{- range .Values.engine.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* The port `jaxllm serve` listens on: server.port, or behind a routing sidecar its own. */}}
{{- define "jaxllm.enginePort" -}}
{{- if .Values.disaggregation.sidecar.enabled }}{{ .Values.disaggregation.sidecar.serverPort | int }}{{ else }}{{ .Values.server.port | int }}{{ end }}
{{- end }}

{{/* vLLM's --kv-events-config JSON. */}}
{{- define "jaxllm.kvEventsConfig" -}}
{{- $c := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" .Values.kvEvents.endpoint "topic" .Values.kvEvents.topic }}
{{- with .Values.kvEvents.replayEndpoint }}{{ $_ := set $c "replay_endpoint" . }}{{ end }}
{{- toJson $c }}
{{- end }}

{{/* vLLM's --kv-transfer-config JSON: blocks served on every interface of the pod. */}}
{{- define "jaxllm.kvTransferConfig" -}}
{{- $roles := dict "prefill" "kv_producer" "decode" "kv_consumer" "both" "kv_both" }}
{{- toJson (dict "kv_connector" .Values.disaggregation.connector "kv_role" (get $roles .Values.disaggregation.role) "kv_ip" "0.0.0.0" "kv_port" (.Values.disaggregation.port | int)) }}
{{- end }}

{{/* llm-d's pod labels. */}}
{{- define "jaxllm.llmdLabels" -}}
llm-d.ai/inferenceServing: "true"
llm-d.ai/model: {{ .Values.llmd.model | default (.Values.model.servedModelName | replace "/" "-" | trunc 63 | trimSuffix "-") | quote }}
llm-d.ai/role: {{ .Values.disaggregation.role | default "both" | quote }}
{{- end }}

{{/* The pod template (metadata and spec) of ROLE; see the top of this file. */}}
{{- define "jaxllm.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $serves := ne $role "worker" }}
{{- with $root }}
{{- $sidecar := and $serves .Values.disaggregation.sidecar.enabled }}
{{- /* Behind a sidecar the server's port is "engine", and the sidecar's "http". */}}
{{- $port := ternary "engine" "http" $sidecar }}
{{- $annotations := dict }}
{{- if and $serves .Values.metrics.podAnnotations }}
{{- $_ := set $annotations "prometheus.io/scrape" "true" }}
{{- $_ := set $annotations "prometheus.io/port" (.Values.server.port | int | toString) }}
{{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
{{- end }}
{{- $annotations = merge $annotations (.Values.podAnnotations | default dict) -}}
metadata:
  labels:
    {{- include "jaxllm.selectorLabels" . | nindent 4 }}
    {{- if and $serves .Values.llmd.enabled }}
    {{- include "jaxllm.llmdLabels" . | nindent 4 }}
    {{- end }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "jaxllm.serviceAccountName" . }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  terminationGracePeriodSeconds: {{ include "jaxllm.terminationGracePeriodSeconds" . }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .Values.model.gcsUri }}
  initContainers:
    # Copies the HF checkpoint from GCS onto the volume (only what changed). In a multi-host
    # group every host copies it onto its own volume.
    - name: fetch-model
      image: {{ .Values.model.syncImage | quote }}
      command:
        - sh
        - -c
        - |
          set -e
          mkdir -p "$JAXLLM_MODEL"
          gcloud storage rsync --recursive "$MODEL_GCS_URI" "$JAXLLM_MODEL"
      env:
        - name: MODEL_GCS_URI
          value: {{ .Values.model.gcsUri | quote }}
        - name: JAXLLM_MODEL
          value: {{ .Values.model.path | quote }}
        - name: HOME
          value: /tmp
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: data
          mountPath: /data
  {{- end }}
  containers:
    - name: jaxllm
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      {{- if eq $role "worker" }}
      # A worker (--process-id above 0) serves no HTTP: it builds the same engine on its chips,
      # replays host 0's steps until host 0 stops, then exits.
      {{- end }}
      args:
        {{- include "jaxllm.serveArgs" . | nindent 8 }}
      env:
        - name: JAXLLM_CACHE_DIR
          value: /data/cache
        {{- if or .Values.kvEvents.enabled .Values.disaggregation.role }}
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        {{- end }}
        {{- if .Values.disaggregation.role }}
        # The address decoders are told to pull this pod's blocks from.
        - name: VLLM_NIXL_SIDE_CHANNEL_HOST
          value: $(POD_IP)
        {{- end }}
        {{- if .Values.kvEvents.enabled }}
        - name: PYTHONHASHSEED
          value: {{ .Values.kvEvents.hashSeed | quote }}
        {{- end }}
        {{- if and $serves .Values.apiKey.secretName }}
        - name: JAXLLM_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ .Values.apiKey.secretName | quote }}
              key: {{ .Values.apiKey.secretKey | quote }}
              optional: true
        {{- end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if $serves }}
      ports:
        - name: {{ $port }}
          containerPort: {{ include "jaxllm.enginePort" . }}
        {{- if has .Values.disaggregation.role (list "prefill" "both") }}
        - name: kv-transfer
          containerPort: {{ .Values.disaggregation.port | int }}
        {{- end }}
        {{- if eq $role "leader" }}
        - name: coordinator
          containerPort: {{ .Values.multiHost.coordinatorPort | int }}
        - name: lockstep
          containerPort: {{ add .Values.multiHost.coordinatorPort 1 }}
        {{- end }}
      startupProbe:
        httpGet: {path: /health, port: {{ $port }}}
        {{- toYaml .Values.probes.startup | nindent 8 }}
      readinessProbe:
        httpGet: {path: /health, port: {{ $port }}}
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      livenessProbe:
        httpGet: {path: /health, port: {{ $port }}}
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      lifecycle:
        # Let the endpoints controller take the pod out of the Service before SIGTERM closes
        # the listening socket; SIGTERM then drains in-flight requests.
        preStop:
          exec:
            command: [sleep, {{ .Values.server.preStopSleepSeconds | int | quote }}]
      {{- else }}
      lifecycle:
        # The pods of a group are stopped together, but the leader's drain still runs steps on
        # every host: a worker holds SIGTERM back for the leader's pause and drain and its engine
        # core's stop, and exits before that when host 0 stops.
        preStop:
          exec:
            command: [sleep, {{ add .Values.server.preStopSleepSeconds .Values.server.shutdownTimeout 20 | quote }}]
      {{- end }}
      {{- with .Values.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: data
          mountPath: /data
    {{- if $sidecar }}
    # The routing sidecar (scripts/pd_proxy.py): the pod's HTTP port; a request goes to a
    # prefiller first, then to the server beside it; every other path (/health, /metrics)
    # straight to the server.
    - name: routing-sidecar
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command: [python, /opt/jaxllm/scripts/pd_proxy.py]
      args:
        - --decode
        - {{ printf "http://127.0.0.1:%d" (.Values.disaggregation.sidecar.serverPort | int) | quote }}
        {{- with .Values.disaggregation.sidecar.prefill }}
        - --prefill
        - {{ . | quote }}
        {{- end }}
        - --host
        - 0.0.0.0
        - --port
        - {{ .Values.server.port | int | quote }}
      ports:
        - name: http
          containerPort: {{ .Values.server.port | int }}
      {{- with .Values.disaggregation.sidecar.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
  {{- /* With multiHost and persistence, the LeaderWorkerSet's claim template makes "data". */}}
  {{- if not (and .Values.multiHost.enabled .Values.persistence.enabled) }}
  volumes:
    - name: data
      {{- if .Values.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ include "jaxllm.claimName" . }}
      {{- else }}
      emptyDir: {}
      {{- end }}
  {{- end }}
{{- end }}
{{- end }}

{{/* Settings that cannot work together fail the render, with what to change. */}}
{{- define "jaxllm.validate" -}}
{{- if and .Values.model.gcsUri (not (hasPrefix "/data/" .Values.model.path)) }}
{{- fail (printf "model.path (%s) must be under /data, the volume model.gcsUri is copied onto" .Values.model.path) }}
{{- end }}
{{- with .Values.disaggregation.role }}
{{- if not (has . (list "prefill" "decode" "both")) }}
{{- fail (printf "disaggregation.role must be prefill, decode or both (or empty), not %s" .) }}
{{- end }}
{{- end }}
{{- if .Values.disaggregation.sidecar.enabled }}
{{- if not (has .Values.disaggregation.role (list "decode" "both")) }}
{{- fail "disaggregation.sidecar runs on decode pods: set disaggregation.role to decode or both" }}
{{- end }}
{{- if eq (int .Values.disaggregation.sidecar.serverPort) (int .Values.server.port) }}
{{- fail "disaggregation.sidecar.serverPort must differ from server.port, which the sidecar takes" }}
{{- end }}
{{- end }}
{{- if .Values.multiHost.enabled }}
{{- if .Values.disaggregation.role }}
{{- fail "disaggregation is not served across hosts: leave multiHost.enabled off for a prefill or decode release" }}
{{- end }}
{{- if .Values.engine.dataParallelSize }}
{{- fail "engine.dataParallelSize runs engine cores on one host: not with multiHost" }}
{{- end }}
{{- if lt (int .Values.multiHost.hosts) 2 }}
{{- fail "multiHost.hosts must be 2 or more; for one host leave multiHost.enabled off" }}
{{- end }}
{{- if .Values.persistence.existingClaim }}
{{- fail "multiHost gives every host a volume of its own: leave persistence.existingClaim empty" }}
{{- end }}
{{- /* A TPU slice's chips (the topology's product) are its hosts' chips. */}}
{{- $topology := index .Values.nodeSelector "cloud.google.com/gke-tpu-topology" }}
{{- $chips := index (.Values.resources.limits | default dict) "google.com/tpu" }}
{{- if and $topology $chips }}
{{- $total := 1 }}
{{- range splitList "x" (toString $topology) }}
{{- $total = mul $total (atoi .) }}
{{- end }}
{{- if ne (int $total) (int (mul (int $chips) (int .Values.multiHost.hosts))) }}
{{- fail (printf "multiHost.hosts (%d) x google.com/tpu per host (%d) is not the %d chips of topology %s" (int .Values.multiHost.hosts) (int $chips) (int $total) $topology) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
