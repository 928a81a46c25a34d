# Multi-stage: the static binary, the CA certificates and a /tmp on an empty
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
RUN CGO_ENABLED=0 GOARCH=${TARGETARCH} go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/cowvol-plugin ./cmd/cowvol-plugin \
 && mkdir -p /out/tmp && chmod 1777 /out/tmp

FROM scratch
COPY --from=build /out/cowvol-plugin /cowvol-plugin
COPY --from=build /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY --from=build /out/tmp /tmp
ENV PATH=/ SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
ENTRYPOINT ["/cowvol-plugin"]
