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

{{- define "sleuth.serviceAccount" -}}
{{- .Values.serviceAccount.name | default (include "sleuth.fullname" .) -}}
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

{{/* The volume at /var/lib/sleuth of a stateful singleton (orchestrator, learner). */}}
{{- define "sleuth.dataVolume" -}}
{{- $root := index . 0 -}}{{- $key := index . 1 -}}
{{- $c := index $root.Values.components $key -}}
{{- if not $root.Values.persistence.enabled -}}
emptyDir: {}
{{- else if and (eq $key "learner") $root.Values.persistence.learnerExistingClaim -}}
persistentVolumeClaim:
  claimName: {{ $root.Values.persistence.learnerExistingClaim }}
{{- else if and (eq $key "learner") (gt (int $c.replicas) 1) -}}
{{- /* Ranks keep nothing locally: checkpoints on S3, metrics in PostgreSQL (sleuth.checkValues). */ -}}
emptyDir: {}
{{- else -}}
persistentVolumeClaim:
  claimName: {{ include "sleuth.fullname" $root }}-{{ $c.binary }}-data
{{- end -}}
{{- end -}}

{{/* Combinations of values that cannot work, refused with what to change. */}}
{{- define "sleuth.checkValues" -}}
{{- $v := .Values -}}
{{- $learner := $v.components.learner -}}
{{- if and (gt (int $learner.replicas) 1) (not $v.persistence.learnerExistingClaim) -}}
{{- if not (hasPrefix "s3://" $learner.checkpointUri) -}}
{{- fail (printf "components.learner.replicas %d with checkpointUri %q: the ranks of one learner share their checkpoints; set checkpointUri to s3://bucket/prefix or persistence.learnerExistingClaim to a ReadWriteMany claim" (int $learner.replicas) $learner.checkpointUri) -}}
{{- end -}}
{{- if not (or $v.database.existingSecret $v.trial.postgresql.enabled) -}}
{{- fail (printf "components.learner.replicas %d without database.existingSecret: ranks on several nodes cannot share a SQLite file; use PostgreSQL or persistence.learnerExistingClaim (ReadWriteMany)" (int $learner.replicas)) -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- fail "tls.enabled needs tls.secretName: a Secret with tls.crt, tls.key and ca.crt (a cert-manager Certificate's)" -}}
{{- end -}}
{{- if and $v.trial.redis.enabled $v.redis.existingSecret -}}
{{- fail "trial.redis.enabled and redis.existingSecret: the trial Redis runs in the release; choose one" -}}
{{- end -}}
{{- if and $v.trial.postgresql.enabled $v.database.existingSecret -}}
{{- fail "trial.postgresql.enabled and database.existingSecret: the trial PostgreSQL runs in the release; choose one" -}}
{{- end -}}
{{- if gt (int $v.components.rolloutOrchestrator.replicas) 1 -}}
{{- fail (printf "components.rolloutOrchestrator.replicas %d: the orchestrator keeps its reports (and its SQLite file) on a ReadWriteOnce volume; run one (a restarted orchestrator resumes every run)" (int $v.components.rolloutOrchestrator.replicas)) -}}
{{- end -}}
{{- if and $v.keda.enabled $v.components.agent.autoscaling.enabled -}}
{{- fail "keda.enabled and components.agent.autoscaling.enabled: KEDA makes the agents' autoscaler; enable one of them" -}}
{{- end -}}
{{- range $key := list "agent" "toolGateway" -}}
{{- $c := index $v.components $key -}}
{{- if and $c.autoscaling.enabled (not ((($c.resources | default dict).requests | default dict).cpu)) -}}
{{- fail (printf "components.%s.autoscaling.enabled needs components.%s.resources.requests.cpu (CPU utilisation is measured against it)" $key $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Secret of the trial stores' passwords, made by the install hook. */}}
{{- define "sleuth.trialSecret" -}}
{{- include "sleuth.fullname" . }}-trial
{{- end -}}

{{/* Whether the install hook has a Secret to make. */}}
{{- define "sleuth.hookNeeded" -}}
{{- if or (and .Values.auth.enabled (not .Values.auth.existingSecret)) .Values.trial.redis.enabled .Values.trial.postgresql.enabled -}}true{{- end -}}
{{- end -}}
