{{/* Name of the DynamoGraphDeployment and prefix of every object. */}}
{{- define "ppd.fullname" -}}
{{- default .Release.Name .Values.nameOverride | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "ppd.labels" -}}
app.kubernetes.io/part-of: dynamo-ppd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels the PodMonitor selects the router's pods by. */}}
{{- define "ppd.routerSelector" -}}
app.kubernetes.io/name: dynamo-ppd-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Dynamo namespace of the frontend and router: the operator's own "<k8s ns>-<dgd name>". */}}
{{- define "ppd.dynamoNamespace" -}}
{{- default (printf "%s-%s" .Release.Namespace (include "ppd.fullname" .)) .Values.dynamo.namespace -}}
{{- end -}}

{{/* Dynamo namespace of the workers, which the frontend does not see. */}}
{{- define "ppd.workersNamespace" -}}
{{- default (printf "%s-workers" (include "ppd.dynamoNamespace" .)) .Values.dynamo.workersNamespace -}}
{{- end -}}

{{- define "ppd.servedModelName" -}}
{{- default .Values.model.name .Values.model.servedModelName -}}
{{- end -}}

{{/* An engine file of files/engine/, parsed; fails when it is missing. Argument: the file name. */}}
{{- define "ppd.engineFile" -}}
{{- $text := .root.Files.Get (printf "files/engine/%s" .file) -}}
{{- if not $text -}}
{{- fail (printf "engine config files/engine/%s does not exist in the chart" .file) -}}
{{- end -}}
{{- $text -}}
{{- end -}}

{{/* KV block size: tokens_per_block of the engine files, which must agree; the workers'
     --kv-block-size and the router's --block-size follow it. */}}
{{- define "ppd.blockSize" -}}
{{- $p := include "ppd.engineFile" (dict "root" . "file" .Values.prefill.engineConfig) | fromYaml -}}
{{- $d := include "ppd.engineFile" (dict "root" . "file" .Values.decode.engineConfig) | fromYaml -}}
{{- $pb := int (dig "kv_cache_config" "tokens_per_block" 32 $p) -}}
{{- $db := int (dig "kv_cache_config" "tokens_per_block" 32 $d) -}}
{{- if ne $pb $db -}}
{{- fail (printf "kv_cache_config.tokens_per_block differs between %s (%d) and %s (%d); the router needs one block size" .Values.prefill.engineConfig $pb .Values.decode.engineConfig $db) -}}
{{- end -}}
{{- $pb -}}
{{- end -}}

{{/* Labels the PodMonitor selects the picker's pods by. */}}
{{- define "ppd.pickerSelector" -}}
app.kubernetes.io/name: dynamo-ppd-picker
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of the frontend pods: the InferencePool's selector and the headless Service's. */}}
{{- define "ppd.frontendSelector" -}}
app.kubernetes.io/name: dynamo-ppd-frontend
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Where the workers register: their own namespace behind the relay router, the frontend's
     behind the picker (the frontend's KV router serves them). */}}
{{- define "ppd.workersEndpointNamespace" -}}
{{- if eq .Values.routing "relay" -}}
{{- include "ppd.workersNamespace" . -}}
{{- else -}}
{{- include "ppd.dynamoNamespace" . -}}
{{- end -}}
{{- end -}}

{{/* The PPD policy's arguments, the same for the picker and the relay router (one planner, two
     shells), one per line. */}}
{{- define "ppd.policyArgs" -}}
{{- $r := .Values.router -}}
- --mode
- {{ $r.mode | quote }}
- --weights
- {{ $r.weights | quote }}
{{- if eq $r.mode "fraction" }}
- --local-fraction
- {{ $r.localFraction | quote }}
{{- end }}
- --table
{{- if $r.tableJson }}
- /etc/ppd/table.json
{{- else }}
- {{ $r.table | quote }}
{{- end }}
- {{ ternary "--online-correction" "--no-online-correction" $r.onlineCorrection }}
- --profile
- {{ $r.profile | quote }}
- --workers-namespace
- {{ include "ppd.workersEndpointNamespace" . | quote }}
- --prefill-component
- prefill
- --decode-component
- backend
- --model-path
- /model
- --served-model-name
- {{ include "ppd.servedModelName" . | quote }}
- --block-size
- {{ include "ppd.blockSize" . | quote }}
- --default-max-tokens
- {{ $r.defaultMaxTokens | quote }}
- --session-ttl
- {{ $r.sessionTtl | quote }}
- --min-resident-fraction
- {{ $r.minResidentFraction | quote }}
- --etcd-url
- {{ required "platform.etcdUrl is required (sessions live in etcd)" .Values.platform.etcdUrl | quote }}
- --nats-url
- {{ required "platform.natsUrl is required (KV events travel over NATS)" .Values.platform.natsUrl | quote }}
- --metrics-host
- "0.0.0.0"
- --metrics-port
- {{ $r.metricsPort | quote }}
{{- end -}}

{{/* The relay router's arguments (after `python3 -m dynamo_ppd.relay`), one per line. */}}
{{- define "ppd.routerArgs" -}}
{{ include "ppd.policyArgs" . }}
- --namespace
- {{ include "ppd.dynamoNamespace" . | quote }}
{{- range .Values.router.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The endpoint picker's arguments (after `python3 -m dynamo_ppd.picker`), one per line. */}}
{{- define "ppd.pickerArgs" -}}
{{- $p := .Values.picker -}}
{{ include "ppd.policyArgs" . }}
- --grpc-host
- "0.0.0.0"
- --grpc-port
- {{ $p.grpcPort | quote }}
- --health-port
- {{ $p.healthPort | quote }}
{{- if $p.secureServing }}
- --secure-serving
{{- end }}
- --frontend
- {{ printf "%s-frontend-pool.%s.svc.cluster.local:%v" (include "ppd.fullname" .) .Release.Namespace .Values.frontend.httpPort | quote }}
- --frontend-refresh
- {{ $p.frontendRefresh | quote }}
{{- range $p.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The init container that writes the model's tokenizer, chat template and config, plus the
     dynamo_ppd_model.json the picker and the router look for (deploy/prepare_model.py in our
     image), into the "model" volume. */}}
{{- define "ppd.modelInit" -}}
- name: model-init
  image: {{ .Values.images.router | quote }}
  imagePullPolicy: {{ .Values.images.pullPolicy }}
  command: ["python3", "/opt/dynamo-ppd/prepare_model.py"]
  args:
    - --model
    - {{ .Values.model.name | quote }}
    - --out
    - /model
    - --served-model-name
    - {{ include "ppd.servedModelName" . | quote }}
    - --tokenizer-only
  envFrom:
    - secretRef:
        name: {{ .Values.model.hfTokenSecret }}
  volumeMounts:
    - name: model
      mountPath: /model
{{- end -}}

{{/* Discovery and event-plane environment of every process of the graph and of the picker:
     the workers register where the picker and the router read them. */}}
{{- define "ppd.planeEnv" -}}
- name: DYN_EVENT_PLANE
  value: nats
- name: NATS_SERVER
  value: {{ .Values.platform.natsUrl | quote }}
{{- if eq .Values.dynamo.discoveryBackend "etcd" }}
- name: ETCD_ENDPOINTS
  value: {{ .Values.platform.etcdUrl | quote }}
{{- end }}
{{- end -}}

{{/* A TensorRT-LLM worker component. Arguments: root, name (prefill|decode), role (values). */}}
{{- define "ppd.worker" -}}
{{- $root := .root -}}
{{- $v := .values -}}
{{- $component := ternary "prefill" "backend" (eq .name "prefill") -}}
- name: {{ .name }}
  type: {{ .name }}
  replicas: {{ $v.replicas }}
  podTemplate:
    metadata:
      labels:
        {{- include "ppd.labels" $root | nindent 8 }}
        app.kubernetes.io/name: dynamo-ppd-{{ .name }}
    spec:
      {{- with $root.Values.images.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (merge (dict) $v.nodeSelector $root.Values.nodeSelector) }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with (default $root.Values.tolerations $v.tolerations) }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: main
          image: {{ $root.Values.images.runtime | quote }}
          imagePullPolicy: {{ $root.Values.images.pullPolicy }}
          workingDir: /workspace
          command: ["python3", "-m", "dynamo.trtllm"]
          args:
            - --model
            - {{ $root.Values.model.name | quote }}
            - --served-model-name
            - {{ include "ppd.servedModelName" $root | quote }}
            - --disaggregation-mode
            - {{ .name }}
            - --endpoint
            - {{ printf "dyn://%s.%s.generate" (include "ppd.workersEndpointNamespace" $root) $component | quote }}
            - --extra-engine-args
            - {{ printf "/etc/ppd/engine/%s" $v.engineConfig | quote }}
            {{- with $v.engineOverrides }}
            - --override-engine-args
            - {{ toJson . | quote }}
            {{- end }}
            - --kv-block-size
            - {{ include "ppd.blockSize" $root | quote }}
            - --publish-kv-events
            - --publish-metrics
            {{- range $v.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          envFrom:
            - secretRef:
                name: {{ $root.Values.model.hfTokenSecret }}
          env:
            # KV events and forward-pass metrics go over NATS, where the picker or router subscribes.
            {{- include "ppd.planeEnv" $root | nindent 12 }}
            - name: DYN_SYSTEM_USE_ENDPOINT_HEALTH_STATUS
              value: '["generate"]'
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            requests:
              {{- with $v.resources.requests }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              nvidia.com/gpu: {{ $v.gpus | quote }}
            limits:
              {{- with $v.resources.limits }}
              {{- toYaml . | nindent 14 }}
              {{- end }}
              nvidia.com/gpu: {{ $v.gpus | quote }}
          volumeMounts:
            - name: engine-config
              mountPath: /etc/ppd/engine
              readOnly: true
      volumes:
        - name: engine-config
          configMap:
            name: {{ include "ppd.fullname" $root }}-engine
{{- end -}}
