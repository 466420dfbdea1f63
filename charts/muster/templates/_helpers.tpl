{{/* Chart name, shortened to the 63 characters of a label value. */}}
{{- define "muster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: the release name, with the chart name appended
unless the release name already contains it.
*/}}
{{- define "muster.fullname" -}}
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

{{- define "muster.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "muster.labels" -}}
helm.sh/chart: {{ include "muster.chart" . }}
{{ include "muster.selectorLabels" . }}
app.kubernetes.io/version: {{ include "muster.imageTag" . | trunc 63 | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: muster
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator's pods. */}}
{{- define "muster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "muster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "muster.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "muster.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "muster.imageTag" -}}
{{- default .Chart.AppVersion .Values.image.tag }}
{{- end }}

{{/* "true" when the operator runs with leader election: asked for, or more than one replica. */}}
{{- define "muster.leaderElect" -}}
{{- if or .Values.leaderElection.enabled (gt (int .Values.replicaCount) 1) }}true{{ end }}
{{- end }}

{{/* Name of the webhook's Service, configuration and (with "-tls") certificate Secret. */}}
{{- define "muster.webhookName" -}}
{{- printf "%s-webhook" (include "muster.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
