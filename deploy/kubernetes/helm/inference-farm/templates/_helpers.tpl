{{/* ---- names and labels ---------------------------------------------------------------------- */}}

{{- define "farm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "farm.fullname" -}}
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

{{- define "farm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "farm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "farm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "farm.labels" -}}
helm.sh/chart: {{ include "farm.chart" . }}
{{ include "farm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: inference-farm
{{- end }}

{{- define "farm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "farm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* A worker entry's model name (model.name, else model.path as in Dynamo's chart) and type (default both). */}}
{{- define "farm.wModel" -}}
{{- $m := .model | default dict }}
{{- $m.name | default $m.path | default "" }}
{{- end }}

{{- define "farm.wType" -}}
{{- .workerType | default "both" }}
{{- end }}

{{/* DNS-1123 form of a name, as farm.planner.actuators.deployment_name does with the model. */}}
{{- define "farm.dnsSlug" -}}
{{- regexReplaceAll "[^a-z0-9-]+" (lower .) "-" | trimAll "-" }}
{{- end }}

{{/* A worker entry's Deployment name. Args: dict "root" $ "w" $worker */}}
{{- define "farm.workerName" -}}
{{- $suffix := .w.name | default (printf "%s-%s" (include "farm.dnsSlug" (include "farm.wModel" .w)) (include "farm.wType" .w)) }}
{{- $full := printf "%s-%s" (include "farm.fullname" .root) $suffix }}
{{- regexReplaceAll "-+" (regexReplaceAll "[^a-z0-9-]+" (lower $full) "-") "-" | trimAll "-" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The Deployment name template the planner formats with {model} and {role}. */}}
{{- define "farm.plannerDeploymentTemplate" -}}
{{- printf "%s-{model}-{role}" (include "farm.fullname" .) }}
{{- end }}

{{/*
The KEDA signal of a worker entry: the requests waiting for its model and role, as the API exports them
(farm.telemetry.prometheus: one API replica exports the farm-wide series, so sum() counts each once). Args: dict "root" $ "w" $worker
*/}}
{{- define "farm.kedaQuery" -}}
{{- $matchers := .root.Values.keda.prometheus.extraMatchers | default (printf "namespace=%q,release=%q" .root.Release.Namespace .root.Release.Name) }}
{{- printf "sum(farm_requests_waiting{model=%q,role=%q,%s})" (include "farm.wModel" .w) (include "farm.wType" .w) $matchers }}
{{- end }}

{{- define "farm.image" -}}
{{- printf "%s:%s" .repository (toString .tag) }}
{{- end }}

{{/* ---- secrets ------------------------------------------------------------------------------------- */}}

{{- define "farm.redisSecretName" -}}
{{- .Values.redis.auth.existingSecret | default (printf "%s-redis" (include "farm.fullname" .)) }}
{{- end }}

{{- define "farm.flowerSecretName" -}}
{{- .Values.flower.auth.existingSecret | default (printf "%s-flower" (include "farm.fullname" .)) }}
{{- end }}

{{- define "farm.farmSecretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-farm" (include "farm.fullname" .)) }}
{{- end }}

{{/* ---- Redis Sentinel (redis.ha) ---------------------------------------------------------------------- */}}

{{/* The headless Service of the Redis pods (stable names: <fullname>-redis-<i>.<this>.<namespace>.svc). */}}
{{- define "farm.redisHeadless" -}}
{{- printf "%s-redis-headless" (include "farm.fullname" .) }}
{{- end }}

{{/* The DNS name of bundled Redis pod <i>. Args: dict "root" $ "i" INDEX */}}
{{- define "farm.redisNodeHost" -}}
{{- printf "%s-redis-%d.%s.%s.svc" (include "farm.fullname" .root) (int .i) (include "farm.redisHeadless" .root) .root.Release.Namespace }}
{{- end }}

{{- define "farm.sentinelHeadless" -}}
{{- printf "%s-redis-sentinel-headless" (include "farm.fullname" .) }}
{{- end }}

{{/*
The sentinels every farm process asks (FARM_REDIS__HA__SENTINELS, host:port comma-separated): the bundled
StatefulSet's pods by their stable names, or redis.ha.externalSentinels.
*/}}
{{- define "farm.sentinelAddresses" -}}
{{- $ha := .Values.redis.ha }}
{{- if .Values.redis.enabled }}
{{- $out := list }}
{{- range $i := until (int $ha.sentinel.replicas) }}
{{- $out = append $out (printf "%s-redis-sentinel-%d.%s.%s.svc:%d" (include "farm.fullname" $) $i (include "farm.sentinelHeadless" $) $.Release.Namespace (int $ha.sentinel.port)) }}
{{- end }}
{{- join "," $out }}
{{- else }}
{{- join "," $ha.externalSentinels }}
{{- end }}
{{- end }}

{{/*
Shell (the redis image's sh): sets $primary to the DNS name of the bundled primary as it is now: what the
sentinels say (after a failover: a promoted replica), else the Redis pod that answers ROLE with master,
else pod 0 (first start). $me (this pod's own name, if a Redis pod) is not asked. Needs REDISCLI_AUTH.
*/}}
{{- define "farm.findPrimaryScript" -}}
{{- $ha := .Values.redis.ha -}}
primary=""
a="$(timeout 5 redis-cli -h {{ include "farm.fullname" . }}-redis-sentinel -p {{ int $ha.sentinel.port }} sentinel get-master-addr-by-name {{ $ha.masterName }} 2>/dev/null | head -n 1)"
case "$a" in *.{{ include "farm.redisHeadless" . }}.*) primary="$a" ;; esac
if [ -z "$primary" ]; then
  for h in{{ range $i := until (int $ha.dataNodes) }} {{ include "farm.redisNodeHost" (dict "root" $ "i" $i) }}{{ end }}; do
    [ "$h" = "${me:-}" ] && continue
    if timeout 3 redis-cli -h "$h" role 2>/dev/null | head -n 1 | grep -qx master; then primary="$h"; break; fi
  done
fi
[ -n "$primary" ] || primary="{{ include "farm.redisNodeHost" (dict "root" . "i" 0) }}"
{{- end }}

{{/*
A secret value: the one given, else the one already in the cluster (so upgrades keep it), else a new
random one. Args: dict "root" $ "secret" NAME "key" KEY "value" GIVEN
*/}}
{{- define "farm.secretValue" -}}
{{- if .value }}
{{- .value }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .secret | default dict }}
{{- $old := dig "data" .key "" $existing }}
{{- if $old }}
{{- b64dec $old }}
{{- else }}
{{- randAlphaNum 32 }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---- pod pieces ---------------------------------------------------------------------------------- */}}

{{/* Environment every farm container gets: configuration, Redis, the shared secret, router mode. */}}
{{- define "farm.commonEnv" -}}
- name: FARM_CONFIG
  value: /etc/farm/farm.yaml
- name: FARM_STATE_DIR
  value: /var/lib/farm
- name: HOME
  value: /var/lib/farm
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- if .Values.redis.enabled }}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "farm.redisSecretName" . }}
      key: {{ .Values.redis.auth.existingSecretKey }}
{{- if .Values.redis.ha.enabled }}
{{- /* with redis.ha only the password and database count: the sentinels say where the primary is */}}
- name: FARM_REDIS__URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s:6379/0" (include "farm.redisNodeHost" (dict "root" . "i" 0)) | quote }}
{{- else }}
- name: FARM_REDIS__URL
  value: {{ printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "farm.fullname" .) | quote }}
{{- end }}
{{- else }}
- name: FARM_REDIS__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "farm.farmSecretName" . }}
      key: redis-url
{{- end }}
{{- with .Values.redis.ha }}
{{- if .enabled }}
{{- /* redis.ha as farm.infra.redis_client reads it: every process finds the primary through the sentinels */}}
- name: FARM_REDIS__HA__ENABLED
  value: "true"
- name: FARM_REDIS__HA__MASTER_NAME
  {{- /* the farm reads FARM_* values as YAML: a name YAML would read as something else goes in quotes */}}
  {{- if and (regexMatch "^[A-Za-z][A-Za-z0-9._-]*$" .masterName) (not (has (lower .masterName) (list "yes" "no" "on" "off" "true" "false" "null"))) }}
  value: {{ .masterName | quote }}
  {{- else }}
  value: {{ toJson (toString .masterName) | quote }}
  {{- end }}
- name: FARM_REDIS__HA__SENTINELS
  value: {{ include "farm.sentinelAddresses" $ | quote }}
- name: FARM_REDIS__HA__QUORUM
  value: {{ int .quorum | toString | quote }}
- name: FARM_REDIS__HA__REPLICA_ACK_TIMEOUT_MS
  value: {{ int .replicaAckTimeoutMs | toString | quote }}
{{- end }}
{{- end }}
- name: FARM_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "farm.farmSecretName" . }}
      key: farm-secret
- name: FARM_ROUTER__MODE
  value: {{ .Values.frontend.routerMode | quote }}
{{- end }}

{{/*
Spread a workload's pods over nodes (topologySpread). Args: dict "root" $ "selector" <matchLabels as YAML>
*/}}
{{- define "farm.topologySpread" -}}
{{- $t := .root.Values.topologySpread }}
{{- if $t.enabled -}}
topologySpreadConstraints:
  - maxSkew: {{ $t.maxSkew }}
    topologyKey: {{ $t.topologyKey }}
    whenUnsatisfiable: {{ $t.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        {{- .selector | nindent 8 }}
{{- end }}
{{- end }}

{{/* The pod selector of a component (api, batch, flower, ...): the chart's selector labels plus the component. */}}
{{- define "farm.componentSelector" -}}
{{ include "farm.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The pod selector of a worker Deployment. Args: dict "root" $ "name" <Deployment name> */}}
{{- define "farm.workerSelector" -}}
{{ include "farm.selectorLabels" .root }}
app.kubernetes.io/component: worker
inference-farm.io/worker: {{ .name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "farm.podSecurityContext" -}}
{{- with .Values.podSecurityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "farm.containerSecurityContext" -}}
{{- with .Values.securityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Volumes of API and worker pods: config, per-pod state, /tmp, models. */}}
{{- define "farm.volumes" -}}
- name: config
  configMap:
    name: {{ include "farm.fullname" . }}-config
- name: state
  emptyDir:
    {{- with .Values.stateVolume.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: tmp
  emptyDir: {}
- name: models
  {{- $ms := .Values.modelStorage }}
  {{- if eq $ms.type "emptyDir" }}
  emptyDir: {}
  {{- else if eq $ms.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ include "farm.fullname" . }}-models
  {{- else if eq $ms.type "existingClaim" }}
  persistentVolumeClaim:
    claimName: {{ required "modelStorage.existingClaim is required with modelStorage.type=existingClaim" $ms.existingClaim }}
  {{- else if eq $ms.type "hostPath" }}
  hostPath:
    path: {{ required "modelStorage.hostPath is required with modelStorage.type=hostPath" $ms.hostPath }}
    type: DirectoryOrCreate
  {{- else }}
  {{- fail (printf "modelStorage.type must be emptyDir, persistentVolumeClaim, existingClaim or hostPath, not %q" $ms.type) }}
  {{- end }}
{{- end }}

{{- define "farm.volumeMounts" -}}
- name: config
  mountPath: /etc/farm
  readOnly: true
- name: state
  mountPath: /var/lib/farm
- name: tmp
  mountPath: /tmp
- name: models
  mountPath: /var/lib/farm/models
  readOnly: true
{{- end }}

{{/*
Init container: `farm prepare` under an exclusive lock on the models volume (pods sharing a claim
convert a builtin model once; the others wait, then find it prepared).
*/}}
{{- define "farm.prepareInitContainer" -}}
{{- if .Values.modelStorage.prepare.enabled -}}
initContainers:
- name: prepare-models
  image: {{ include "farm.image" .Values.images.prepare }}
  imagePullPolicy: {{ .Values.images.prepare.pullPolicy }}
  command:
    - python
    - -c
    - |
      import fcntl, subprocess, sys
      with open("/var/lib/farm/models/.prepare.lock", "w") as lock:
          fcntl.flock(lock, fcntl.LOCK_EX)
          sys.exit(subprocess.call(["farm", "prepare", "--quiet"]))
  env:
    - name: FARM_CONFIG
      value: /etc/farm/farm.yaml
    - name: FARM_STATE_DIR
      value: /var/lib/farm
    - name: HOME
      value: /var/lib/farm
  {{- include "farm.containerSecurityContext" . | nindent 2 }}
  {{- with .Values.modelStorage.prepare.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: config
      mountPath: /etc/farm
      readOnly: true
    - name: state
      mountPath: /var/lib/farm
    - name: tmp
      mountPath: /tmp
    - name: models
      mountPath: /var/lib/farm/models
{{- end }}
{{- end }}

{{/*
The worker heartbeat check (exec probe). Exit 0 when farm:alive:$WORKER_ID exists in Redis. Arg
"strict": a Redis that does not answer fails the check (startup, readiness); otherwise (liveness) it
passes, so a Redis outage does not restart every worker: the worker itself reconnects and
re-registers.
*/}}
{{- define "farm.heartbeatProbe" -}}
exec:
  command:
    - python
    - -c
    - |
      import os, sys, redis
      wid = os.environ["WORKER_ID"]
      {{- if .ha }}
      from farm.config import load_config
      from farm.infra.redis_client import connect
      r = connect(load_config().redis, timeout=3)  # through the sentinels (redis.ha), to the primary
      {{- else }}
      r = redis.Redis.from_url(os.environ["FARM_REDIS__URL"], socket_timeout=3, socket_connect_timeout=3)
      {{- end }}
      try:
          alive = r.exists("farm:alive:" + wid)
      except redis.RedisError as e:
          print("redis unreachable:", e)
          sys.exit(1 if sys.argv[1:] == ["strict"] else 0)
      print(wid, "alive" if alive else "has no heartbeat")
      sys.exit(0 if alive else 1)
    {{- if .strict }}
    - strict
    {{- end }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end }}

{{/*
Environment from an engine settings mapping, e.g. {kv_cache_mb: 4096, kv_tiers: {host_mb: 1}} ->
FARM_ENGINE__KV_CACHE_MB=4096, FARM_ENGINE__KV_TIERS__HOST_MB=1 (the farm parses them as YAML scalars).
*/}}
{{- define "farm.engineEnv" -}}
{{- range $k, $v := . }}
{{- if kindIs "map" $v }}
{{- range $k2, $v2 := $v }}
- name: {{ printf "FARM_ENGINE__%s__%s" (upper $k) (upper $k2) }}
  value: {{ ternary $v2 (toJson $v2) (kindIs "string" $v2) | quote }}
{{- end }}
{{- else }}
- name: {{ printf "FARM_ENGINE__%s" (upper $k) }}
  value: {{ ternary $v (toJson $v) (kindIs "string" $v) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* ---- the farm configuration ------------------------------------------------------------------------ */}}

{{/* Models served by the worker entries, deduplicated by name, as config `models:` entries. */}}
{{- define "farm.models" -}}
{{- $seen := dict }}
{{- $models := list }}
{{- range .Values.workers }}
{{- $name := include "farm.wModel" . }}
{{- if not (hasKey $seen $name) }}
{{- $_ := set $seen $name true }}
{{- $m := dict "name" $name "max_model_len" (int (.model.maxModelLen | default 4096)) }}
{{- if .model.path }}
{{- if hasPrefix "/" .model.path }}
{{- $_ := set $m "path" .model.path }}
{{- else }}
{{- $_ := set $m "path" (printf "/var/lib/farm/models/%s" .model.path) }}
{{- end }}
{{- else }}
{{- $_ := set $m "source" (.model.source | default "builtin:smollm2") }}
{{- end }}
{{- $models = append $models $m }}
{{- end }}
{{- end }}
{{- toYaml $models }}
{{- end }}

{{- define "farm.config" -}}
{{- $models := include "farm.models" . | fromYamlArray }}
{{- $default := .Values.defaultModel | default (include "farm.wModel" (first .Values.workers)) }}
{{- /* the names in-cluster clients reach the API Service by: the API refuses other Host headers (DNS
rebinding); config.api.allowed_hosts replaces them (add an Ingress's host there) */}}
{{- $svc := printf "%s-api" (include "farm.fullname" .) }}
{{- $hosts := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) }}
{{- $cfg := dict
  "redis" (dict "managed" false)
  "api" (dict "host" "0.0.0.0" "port" (int .Values.frontend.port) "worker_connections" (int .Values.frontend.workerConnections) "header_timeout_s" (int .Values.frontend.headerTimeoutSeconds) "body_timeout_s" (int .Values.frontend.bodyTimeoutSeconds) "body_min_rate" (int .Values.frontend.bodyMinRate) "allowed_hosts" $hosts)
  "flower" (dict "enabled" .Values.flower.enabled "host" "0.0.0.0" "port" (int .Values.flower.port))
  "router" (dict "mode" .Values.frontend.routerMode)
  "transfer" (dict "bind_host" "0.0.0.0")
  "batch" (dict "files_backend" "redis")
  "default_model" $default
  "models" $models }}
{{- toYaml (mergeOverwrite $cfg (deepCopy .Values.config)) }}
{{- end }}

{{- define "farm.plannerConfig" -}}
{{- $models := list }}
{{- $roles := list }}
{{- range .Values.workers }}
{{- $models = append $models (include "farm.wModel" .) }}
{{- $roles = append $roles (include "farm.wType" .) }}
{{- end }}
{{- $p := dict
  "enabled" true
  "mode" .Values.planner.mode
  "actuator" "kubernetes"
  "dry_run" .Values.planner.dryRun
  "interval_s" .Values.planner.intervalSeconds
  "models" ($models | uniq)
  "roles" ($roles | uniq)
  "kubernetes" (dict "deployment" (include "farm.plannerDeploymentTemplate" .) "namespace" .Release.Namespace) }}
{{- toYaml (dict "planner" (mergeOverwrite $p (deepCopy .Values.planner.config))) }}
{{- end }}

{{/* ---- checks that fail the render with a clear message ------------------------------------------- */}}
{{- define "farm.validate" -}}
{{- if not .Values.workers }}
{{- fail "workers: at least one worker entry is needed" }}
{{- end }}
{{- $names := dict }}
{{- $roles := dict }}
{{- range $i, $w := .Values.workers }}
{{- $model := include "farm.wModel" $w }}
{{- $role := include "farm.wType" $w }}
{{- if not $model }}
{{- fail (printf "workers[%d]: model.name (or model.path) is required" $i) }}
{{- end }}
{{- if not (has $role (list "prefill" "decode" "both")) }}
{{- fail (printf "workers[%d].workerType must be prefill, decode or both, not %q" $i $role) }}
{{- end }}
{{- $n := include "farm.workerName" (dict "root" $ "w" $w) }}
{{- if hasKey $names $n }}
{{- fail (printf "workers[%d]: Deployment name %s is used twice; give the entries different names" $i $n) }}
{{- end }}
{{- $_ := set $names $n true }}
{{- $_ := set $roles (printf "%s/%s" $model $role) true }}
{{- if $.Values.planner.enabled }}
{{- $expected := include "farm.workerName" (dict "root" $ "w" (omit $w "name")) }}
{{- if ne $n $expected }}
{{- fail (printf "planner.enabled: the planner scales Deployment %s for model %s role %s, but workers[%d] is named %s; leave workers[%d].name empty" $expected $model $role $i $n $i) }}
{{- end }}
{{- end }}
{{- end }}
{{- range .Values.workers }}
{{- $model := include "farm.wModel" . }}
{{- if and (eq (include "farm.wType" .) "prefill") (not (or (hasKey $roles (printf "%s/decode" $model)) (hasKey $roles (printf "%s/both" $model)))) }}
{{- fail (printf "model %s has prefill workers but no decode or both workers: prefill workers hand every request to a decode worker" $model) }}
{{- end }}
{{- end }}
{{- /* the Services, probes and scrape annotations use frontend.port and flower.port: a config that moved the
processes' own would leave every pod unready (the ops audit) */}}
{{- range $section, $keys := dict "api" (list "host" "port") "flower" (list "host" "port") }}
{{- range $keys }}
{{- if hasKey (index ($.Values.config | default dict) $section | default dict) . }}
{{- fail (printf "config.%s.%s is set by the chart (%s): set frontend.port / flower.port instead" $section . (ternary "every pod listens on 0.0.0.0" "the Services, probes and scrape annotations use it" (eq . "host"))) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not (has .Values.frontend.routerMode (list "kv" "round-robin" "random")) }}
{{- fail (printf "frontend.routerMode must be kv, round-robin or random, not %q" (toString .Values.frontend.routerMode)) }}
{{- end }}
{{- if and .Values.keda.enabled .Values.planner.enabled (not .Values.planner.dryRun) }}
{{- fail "keda.enabled and planner.enabled both scale the worker Deployments: enable one (or set planner.dryRun)" }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) (not .Values.secrets.existingSecret) }}
{{- fail "redis.enabled=false needs redis.externalUrl (or secrets.existingSecret with a redis-url key)" }}
{{- end }}
{{- with .Values.redis.ha }}
{{- if .enabled }}
{{- if $.Values.redis.enabled }}
{{- if .externalSentinels }}
{{- fail "redis.ha.externalSentinels is for redis.enabled=false (your own Sentinel deployment); with redis.enabled the chart runs the sentinels" }}
{{- end }}
{{- if gt (int .quorum) (int .sentinel.replicas) }}
{{- fail (printf "redis.ha.quorum %d is more than the %d sentinels (redis.ha.sentinel.replicas)" (int .quorum) (int .sentinel.replicas)) }}
{{- end }}
{{- else }}
{{- if not .externalSentinels }}
{{- fail "redis.ha with redis.enabled=false needs redis.ha.externalSentinels (host:port of each sentinel of your deployment)" }}
{{- end }}
{{- if gt (int .quorum) (len .externalSentinels) }}
{{- fail (printf "redis.ha.quorum %d is more than the %d sentinels in redis.ha.externalSentinels" (int .quorum) (len .externalSentinels)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.keda.enabled (not .Values.keda.prometheus.serverAddress) }}
{{- fail "keda.enabled needs keda.prometheus.serverAddress (the Prometheus that scrapes the API, e.g. http://prometheus-operated.monitoring.svc:9090)" }}
{{- end }}
{{- end }}
