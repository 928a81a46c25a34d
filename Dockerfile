# Multi-stage: a static binary on a small base. The node plugin needs no
# userland of its own (it mounts with syscalls), only the binary.
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=${VERSION}" -o /out/cowvol-plugin ./cmd/cowvol-plugin

FROM gcr.io/distroless/static-debian12
COPY --from=build /out/cowvol-plugin /cowvol-plugin
ENTRYPOINT ["/cowvol-plugin"]
