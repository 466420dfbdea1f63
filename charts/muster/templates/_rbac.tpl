{{/*
Every permission muster has, in one place. The ClusterRole (clusterrole.yaml) and the
leader-election Role (role.yaml) only wrap these rules.
*/}}

{{/*
Cluster-wide rules. muster reads through watches (list, watch), writes with patches, and
gets single objects only where it must: pods and services after a create conflict or
before a release, claims before changing their finalizers and allocation, templates when
creating claims from them. An e2e test runs the operator with exactly these rules and
fails when one is never used.
*/}}
{{- define "muster.clusterRules" -}}
- apiGroups: ["muster.dev"]
  resources: ["workloads"]
  verbs: ["list", "watch", "patch"]
- apiGroups: ["muster.dev"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- /* Checked, never requested: setting blockOwnerDeletion on pods and claims the
Workload owns, where the OwnerReferencesPermissionEnforcement admission plugin is on. */}}
- apiGroups: ["muster.dev"]
  resources: ["workloads/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
{{- /* A pod of a controller muster cannot suspend gets the DisruptionTarget condition
before muster deletes it, as kube-scheduler's preemption gives it. */}}
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
{{- /* A gang of a Job's, JobSet's or TrainJob's pods is requeued by suspending the job
(its controller takes the pods away without counting a failure) and resuming it once
every device is given back: muster watches what it marked, reads the job just before
its suspend (the write is conditioned on that version), and finds a JobSet's TrainJob by
listing the JobSet. The adoption of labelled jobs uses the same verbs. */}}
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["trainer.kubeflow.org"]
  resources: ["trainjobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims/status"]
  verbs: ["patch"]
{{- if include "muster.resourceClaimBinding" . }}
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims/binding"]
  verbs: ["update", "patch"]
{{- end }}
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["get"]
- apiGroups: ["resource.k8s.io"]
  resources: ["deviceclasses", "resourceslices", "devicetaintrules"]
  verbs: ["list", "watch"]
{{- /* What kube-scheduler reads besides devices, so plans keep to pod (anti-)affinity,
topology spread, host ports and volumes: nodes, namespaces (affinity terms' namespace
selectors), claims, volumes, storage classes and CSI attach limits. */}}
- apiGroups: [""]
  resources: ["nodes", "namespaces", "persistentvolumeclaims", "persistentvolumes"]
  verbs: ["list", "watch"]
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses", "csinodes"]
  verbs: ["list", "watch"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.webhook.enabled }}
{{- /* Labelled JobSets (TrainJobs make JobSets) and Jobs become gangs: muster reads them
(and the Jobs JobSets make, to verify their pods; the verbs on jobs are above), creates
the Workload each one owns, makes it again when the job changes before its gang is
admitted, and suspends or resumes a job whose Workload a user suspended or resumed. */}}
- apiGroups: ["muster.dev"]
  resources: ["workloads"]
  verbs: ["get", "create", "delete"]
{{- if .Values.webhook.namespaceSelector }}
{{- /* Jobs in namespaces the webhook's namespaceSelector leaves out are not muster's. */}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get"]
{{- end }}
{{- if .Values.rbac.kueue }}
{{- /* Kueue charges a job's gang by the job's own pod templates. */}}
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get"]
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get"]
{{- end }}
{{- if not .Values.webhook.certManager.enabled }}
{{- /* muster writes its CA into the caBundle of its own webhook configuration. */}}
- apiGroups: ["admissionregistration.k8s.io"]
  resources: ["mutatingwebhookconfigurations"]
  resourceNames: [{{ include "muster.webhookName" . | quote }}]
  verbs: ["get", "update"]
{{- end }}
{{- end }}
{{- if .Values.rbac.kueue }}
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "patch", "delete"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status", "admissionchecks/status"]
  verbs: ["patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["admissionchecks"]
  verbs: ["list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues", "clusterqueues", "topologies"]
  verbs: ["get"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaimtemplates"]
  verbs: ["create"]
- apiGroups: ["scheduling.k8s.io"]
  resources: ["priorityclasses"]
  verbs: ["get"]
{{- end }}
{{- if .Values.metrics.auth.enabled }}
{{- /* Checking who scrapes /metrics, as kube-rbac-proxy does. */}}
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
- apiGroups: ["authorization.k8s.io"]
  resources: ["subjectaccessreviews"]
  verbs: ["create"]
{{- end }}
{{- end }}

{{/*
Rules in the release namespace: the leader-election Lease. Create cannot be limited to
a name; reading and renewing can.
*/}}
{{- define "muster.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ .Values.leaderElection.id | quote }}]
  verbs: ["get", "update"]
{{- end }}

{{/*
Rules in the release namespace for the webhook's certificate, which muster keeps in a
Secret when cert-manager does not. Create cannot be limited to a name.
*/}}
{{- define "muster.webhookRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: [{{ printf "%s-tls" (include "muster.webhookName" .) | quote }}]
  verbs: ["get", "update"]
{{- end }}

{{/*
"true" when the ClusterRole grants resourceclaims/binding. Capabilities.APIVersions
lists groups and kinds, not subresources, so "auto" goes by the cluster's version:
the subresource exists from Kubernetes 1.36 on.
*/}}
{{- define "muster.resourceClaimBinding" -}}
{{- $v := .Values.rbac.resourceClaimBinding }}
{{- if eq (toString $v) "auto" }}
{{- if semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version }}true{{ end }}
{{- else if eq (toString $v) "true" }}true
{{- else if ne (toString $v) "false" }}
{{- fail (printf "rbac.resourceClaimBinding must be auto, true or false, not %v" $v) }}
{{- end }}
{{- end }}

{{/*
What `muster uninstall` (the pre-delete hook) needs cluster-wide: it reads every pod,
claim, Workload and job muster suspended, gives back or hands over the claims muster
allocated (their status and finalizers), and takes muster's finalizers and marks off.
*/}}
{{- define "muster.uninstallClusterRules" -}}
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["list", "get", "patch"]
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims/status"]
  verbs: ["patch"]
- apiGroups: ["muster.dev"]
  resources: ["workloads"]
  verbs: ["list", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["list", "patch"]
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["list", "patch"]
- apiGroups: ["trainer.kubeflow.org"]
  resources: ["trainjobs"]
  verbs: ["list", "patch"]
{{- end }}

{{/*
What `muster uninstall` needs in the release namespace: it scales the operator to none
and waits for its pods to go.
*/}}
{{- define "muster.uninstallNamespaceRules" -}}
- apiGroups: ["apps"]
  resources: ["deployments"]
  resourceNames: [{{ include "muster.fullname" . | quote }}]
  verbs: ["get", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
{{- end }}
