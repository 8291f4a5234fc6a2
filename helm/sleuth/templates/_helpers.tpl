{{- define "sleuth.fullname" -}}
{{- printf "%s" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sleuth.labels" -}}
app.kubernetes.io/name: sleuth
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "sleuth.authSecret" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecret }}{{- else -}}{{ include "sleuth.fullname" . }}-auth{{- end -}}
{{- end -}}

{{/* Address of a component's Service inside the cluster. */}}
{{- define "sleuth.address" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}
{{- $c := index $root.Values.components $key -}}
{{- printf "%s-%s:%d" (include "sleuth.fullname" $root) $c.binary (int $c.port) -}}
{{- end -}}

{{/* Where a component's replicas are for the services that spread work over
them (agents, policy servers): with discovery.kubernetes, the ready pods of
its Service, watched through EndpointSlices; else the Service's address. */}}
{{- define "sleuth.replicas" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}
{{- if $root.Values.discovery.kubernetes -}}
{{- $c := index $root.Values.components $key -}}
{{- printf "kube://%s-%s:grpc" (include "sleuth.fullname" $root) $c.binary -}}
{{- else -}}
{{- include "sleuth.address" . -}}
{{- end -}}
{{- end -}}
