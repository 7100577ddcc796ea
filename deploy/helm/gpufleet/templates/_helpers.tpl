{{/*
Labels helm adds to every object, beside the base's own (app.kubernetes.io/name, part-of):
never in a selector, so an upgrade of the chart never has to replace a Deployment.
*/}}
{{- define "gpufleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* An image by version: [registry/]repository:tag, the tag defaulting to the package version. */}}
{{- define "gpufleet.image" -}}
{{- $images := .root.Values.images -}}
{{- $name := required (printf "images.%s.repository is required" .image) (index $images .image "repository") -}}
{{- with $images.registry }}{{ $name = printf "%s/%s" (trimSuffix "/" .) $name }}{{ end -}}
{{ $name }}:{{ $images.tag | default .root.Chart.AppVersion }}
{{- end }}

{{/* image, and imagePullPolicy where one is set. */}}
{{- define "gpufleet.imageFields" -}}
image: {{ include "gpufleet.image" . }}
{{- with .root.Values.images.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{- define "gpufleet.podSpecExtras" -}}
{{- with .Values.images.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the Temporal connection is an API key, "" for mutual TLS; neither set: refused. */}}
{{- define "gpufleet.temporalApiKey" -}}
{{- $t := .Values.temporal -}}
{{- if and (not $t.apiKey.secretName) (not $t.tls.clientSecret) -}}
{{- fail "temporal: set temporal.tls.clientSecret (mutual TLS) or temporal.apiKey.secretName (an API key): there is no plaintext mode" -}}
{{- end -}}
{{- if $t.apiKey.secretName }}true{{ end -}}
{{- end }}

{{/*
The Temporal connection, as the standard TEMPORAL_* variables, for the control plane and the
node gateway (the same settings: the gateway forwards nodes' calls on the control plane's own
connection). Mutual TLS from the Secret mounted at /etc/gpufleet/temporal, or an API key.
*/}}
{{- define "gpufleet.temporalEnv" -}}
{{- $t := .Values.temporal -}}
- name: TEMPORAL_ADDRESS
  value: {{ required "temporal.address is required (host:port of the frontend)" $t.address | quote }}
- name: TEMPORAL_NAMESPACE
  value: {{ required "temporal.namespace is required" $t.namespace | quote }}
{{- if include "gpufleet.temporalApiKey" . }}
- name: TEMPORAL_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ $t.apiKey.secretName | quote }}, key: {{ required "temporal.apiKey.key is required" $t.apiKey.key | quote }}}
{{- else }}
- name: TEMPORAL_TLS_SERVER_NAME
  value: {{ $t.tls.serverName | default (regexReplaceAll ":[0-9]+$" $t.address "") | quote }}
- name: TEMPORAL_TLS_SERVER_CA_CERT_PATH
  value: /etc/gpufleet/temporal/ca.crt
- name: TEMPORAL_TLS_CLIENT_CERT_PATH
  value: /etc/gpufleet/temporal/tls.crt
- name: TEMPORAL_TLS_CLIENT_KEY_PATH
  value: /etc/gpufleet/temporal/tls.key
{{- end }}
{{- end }}

{{/*
The pods' annotations: a changed inline sites.yaml rolls them; the control plane's ("ipxe"), a
changed own-rack iPXE template too (the seed server reads it when it starts).
*/}}
{{- define "gpufleet.podAnnotations" -}}
{{- $values := .root.Values -}}
{{- with $values.sites.config }}
annotations:
  gpufleet.io/sites-config-sha256: {{ sha256sum . }}
  {{- if and $.ipxe $values.ownRacks.seedServer.enabled $values.ownRacks.seedServer.ipxeTemplate }}
  gpufleet.io/own-rack-ipxe-sha256: {{ sha256sum $values.ownRacks.seedServer.ipxeTemplate }}
  {{- end }}
{{- end }}
{{- end }}

{{/*
Own racks' seed server (ownRacks.seedServer), checked, as JSON: the control-plane pod's second
container, as deploy/own-racks renders it. With `sites.config` the account must be an own-dc
account of it whose seed_dir is `seedDir` (the worker writes there, the server reads there), and
its iPXE template, a file of the config's ConfigMap, comes from `ipxeTemplate`.
*/}}
{{- define "gpufleet.ownRackSeeds" -}}
{{- $seeds := .Values.ownRacks.seedServer -}}
{{- if $seeds.enabled -}}
{{- $_ := required "ownRacks.seedServer.url is required: the URL your racks reach the seed server at (the control-plane host's address on the provisioning network and the port)" $seeds.url -}}
{{- if gt (int .Values.controlPlane.replicas) 1 -}}
{{- fail "ownRacks.seedServer.enabled: controlPlane.replicas must be 1 (or 0): the worker that writes the seeds and the server that hands them out share one pod's in-memory volume, and the server holds its host's port" -}}
{{- end -}}
{{- with .Values.sites.config -}}
{{- $config := fromYaml . -}}
{{- $account := dict -}}
{{- range $config.accounts -}}
{{- if eq (toString .name) $seeds.account }}{{ $account = . }}{{ end -}}
{{- end -}}
{{- if ne (toString $account.provider) "own-dc" -}}
{{- fail (printf "ownRacks.seedServer.account: sites.config has no own-dc account %q" $seeds.account) -}}
{{- end -}}
{{- $seedDir := dig "options" "seed_dir" "" $account -}}
{{- if ne (toString $seedDir) $seeds.seedDir -}}
{{- fail (printf "ownRacks.seedServer.seedDir: %s, but sites.config's account %s has seed_dir %q: the worker writes the seeds there and the server must read the same directory" $seeds.seedDir $seeds.account (toString $seedDir)) -}}
{{- end -}}
{{- with dig "options" "ipxe_template" "" $account -}}
{{- if ne (dir .) "/etc/gpufleet" -}}
{{- fail (printf "sites.config: accounts.%s.options.ipxe_template: %s: the seed server reads it from the config's ConfigMap, mounted at /etc/gpufleet (e.g. /etc/gpufleet/own-rack.ipxe)" $seeds.account .) -}}
{{- end -}}
{{- if not $seeds.ipxeTemplate -}}
{{- fail (printf "ownRacks.seedServer.ipxeTemplate is required: sites.config's account %s names the iPXE template %s, which the chart puts into its ConfigMap (--set-file ownRacks.seedServer.ipxeTemplate=own-rack.ipxe)" $seeds.account .) -}}
{{- end -}}
{{- end -}}
{{- else -}}
{{- if $seeds.ipxeTemplate -}}
{{- fail "ownRacks.seedServer.ipxeTemplate goes into the chart's ConfigMap, which it makes only from sites.config: set sites.config too, or put the template into the ConfigMap you create" -}}
{{- end -}}
{{- end -}}
{{- else if $seeds.ipxeTemplate -}}
{{- fail "ownRacks.seedServer.ipxeTemplate is set but ownRacks.seedServer.enabled is not" -}}
{{- end -}}
{{- toJson $seeds -}}
{{- end }}

{{/* The key of the own-rack iPXE template in the chart's ConfigMap: the base name sites.config's account gives it. */}}
{{- define "gpufleet.ownRackIpxeKey" -}}
{{- $seeds := .Values.ownRacks.seedServer -}}
{{- range (fromYaml .Values.sites.config).accounts -}}
{{- if eq (toString .name) $seeds.account }}{{ base (dig "options" "ipxe_template" "" .) }}{{ end -}}
{{- end -}}
{{- end }}

{{/*
The Secrets the control plane may get, each by name, as a JSON list: those `sites.config` names
(every `secret:` reference the control plane reads, as providers/credentials.py
control_plane_secrets finds them; node_gateway.ca is read by `gpufleet cluster node-config`, with
your credentials) and `credentials.secrets`. A reference outside `gpufleet` is refused, naming it.
*/}}
{{- define "gpufleet.credentialSecrets" -}}
{{- $refs := list -}}
{{- with .Values.sites.config -}}
{{- $config := fromYaml . -}}
{{- if hasKey $config "Error" -}}
{{- fail (printf "sites.config is not a YAML mapping: %s" $config.Error) -}}
{{- end -}}
{{- with $config.notify_webhook -}}
{{- $refs = append $refs (list "notify_webhook" .) -}}
{{- end -}}
{{- range $name, $store := $config.object_stores -}}
{{- with $store.credentials -}}
{{- $refs = append $refs (list (printf "object_stores.%s.credentials" $name) .) -}}
{{- end -}}
{{- end -}}
{{- range $account := $config.accounts -}}
{{- with $account.credentials -}}
{{- $refs = append $refs (list (printf "accounts.%s.credentials" $account.name) .) -}}
{{- end -}}
{{- end -}}
{{- range $site := $config.sites -}}
{{- with $site.object_store -}}
{{- with .credentials -}}
{{- $refs = append $refs (list (printf "sites.%s.object_store.credentials" $site.name) .) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $names := list -}}
{{- range $refs -}}
{{- $where := index . 0 -}}
{{- with (index . 1).secret -}}
{{- $location := splitn "/" 2 (splitn "#" 2 .)._0 -}}
{{- if or (ne $location._0 "gpufleet") (not $location._1) -}}
{{- fail (printf "sites.config: %s: secret:%s: the control plane reads credentials only as `secret: gpufleet/<name>#<key>` (a Secret in its own namespace)" $where .) -}}
{{- end -}}
{{- $names = append $names $location._1 -}}
{{- end -}}
{{- end -}}
{{- toJson (concat $names (.Values.credentials.secrets | default list) | uniq | sortAlpha) -}}
{{- end }}
