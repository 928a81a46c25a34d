{{/* The plugin image, repository:tag. */}}
{{- define "cowvol.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}
