{{- define "weightsync.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "weightsync.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weightsync.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: weightsync
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "weightsync.selectorLabels" . }}
{{- end -}}

{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightsync.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "weightsync.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "weightsync.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Namespaces that get the runtime ServiceAccount and Role, one per line. */}}
{{- define "weightsync.runtimeNamespaces" -}}
{{- if .Values.runtime.namespaces -}}
{{- range .Values.runtime.namespaces }}
{{ . }}
{{- end -}}
{{- else -}}
{{ default .Release.Namespace .Values.watchNamespace }}
{{- end -}}
{{- end -}}

{{/* The operator's rules: exactly what reconcile + kopf use (tests/test_chart.py pins them). */}}
{{- define "weightsync.operatorRules" -}}
- apiGroups: [weightsync.io]
  resources: [weightsyncs]
  verbs: [get, list, watch, patch]
- apiGroups: [weightsync.io]
  resources: [weightsyncs/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
