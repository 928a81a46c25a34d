# Multi-stage: the static binaries (the plugin, and the kubelet's credential
# provider the node DaemonSet installs on the host), the CA certificates and a /tmp on an empty
# base: what `make image` builds without Docker (hack/build-image). The
# plugin mounts with syscalls and runs no other program.
# The build stage runs on the builder's platform and cross-compiles for the
# target's (docker buildx build --platform linux/amd64,linux/arm64).
FROM --platform=$BUILDPLATFORM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
ARG TARGETARCH
RUN CGO_ENABLED=0 GOARCH=${TARGETARCH} go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/ ./cmd/cowvol-plugin ./cmd/cowvol-credential-provider \
 && mkdir -p /out/tmp && chmod 1777 /out/tmp

FROM scratch
COPY --from=build /out/cowvol-plugin /cowvol-plugin
COPY --from=build /out/cowvol-credential-provider /cowvol-credential-provider
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/tmp /tmp
ENV PATH=/ SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
ENTRYPOINT ["/cowvol-plugin"]
