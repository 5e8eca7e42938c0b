{{/* Names, labels and the checks every template relies on. */}}

{{- define "kvrelay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvrelay.fullname" -}}
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

{{- define "kvrelay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvrelay.commonLabels" -}}
helm.sh/chart: {{ include "kvrelay.chart" . }}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvrelay.labels" -}}
{{ include "kvrelay.commonLabels" . }}
app.kubernetes.io/component: proxy
{{- end }}

{{- define "kvrelay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: proxy
{{- end }}

{{- define "kvrelay.redis.fullname" -}}
{{- printf "%s-redis" (include "kvrelay.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvrelay.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrelay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "kvrelay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvrelay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* True ("true") when the conversation map is shared Redis, from any of the three sources. */}}
{{- define "kvrelay.sharedMap" -}}
{{- if or .Values.redis.enabled .Values.redis.existingSecret (regexMatch "^(rediss?|unix)://" (toString .Values.config.map_url)) -}}
true
{{- end -}}
{{- end }}

{{/* Refuse values that cannot run correctly. Included by the Deployment. */}}
{{- define "kvrelay.validate" -}}
{{- $shared := include "kvrelay.sharedMap" . }}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.autoscaling.enabled) (not $shared) }}
{{- fail "replicaCount > 1 needs the shared Redis conversation map: set redis.enabled, config.map_url: redis://..., or redis.existingSecret" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not $shared) }}
{{- fail "autoscaling.enabled needs the shared Redis conversation map: set redis.enabled, config.map_url: redis://..., or redis.existingSecret" }}
{{- end }}
{{- if and (gt (int .Values.config.workers) 1) (not $shared) }}
{{- fail "config.workers > 1 needs the shared Redis conversation map: set redis.enabled, config.map_url: redis://..., or redis.existingSecret" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- if and (not (kindIs "invalid" .Values.terminationGracePeriodSeconds)) (le (float64 .Values.terminationGracePeriodSeconds) (float64 .Values.config.total_timeout)) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed config.total_timeout (%v), the longest a stream may run" .Values.terminationGracePeriodSeconds .Values.config.total_timeout) }}
{{- end }}
{{- range $name, $ref := .Values.secrets }}
{{- if hasKey $.Values.config $name }}
{{- fail (printf "%s is a secret: set secrets.%s.existingSecret, not config.%s" $name $name $name) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Grace period: explicit, or the longest stream plus the preStop pause plus drain slack. */}}
{{- define "kvrelay.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add (ceil .Values.config.total_timeout | int) (int .Values.preStopSleepSeconds) 30 }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* The proxy container's env list: secret settings, the Redis map URL, extras. */}}
{{- define "kvrelay.env" -}}
{{- range $name, $ref := .Values.secrets }}
{{- if $ref.existingSecret }}
- name: KVRELAY_{{ upper $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.existingSecret }}
      key: {{ $ref.key }}
{{- end }}
{{- end }}
{{- if .Values.redis.existingSecret }}
- name: KVRELAY_MAP_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.existingSecretKey }}
{{- else if .Values.redis.enabled }}
- name: KVRELAY_MAP_URL
  value: "redis://{{ include "kvrelay.redis.fullname" . }}:6379/0"
{{- end }}
{{- with .Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- with .Values.otel.serviceName }}
- name: OTEL_SERVICE_NAME
  value: {{ . | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{/*
Non-empty when the proxy discovers engines from Kubernetes EndpointSlices.
*/}}
{{- define "kvrelay.kubeDiscovery" -}}
{{- if or .Values.config.prefill_selector .Values.config.decode_selector }}true{{- end }}
{{- end }}
