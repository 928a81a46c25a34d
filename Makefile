# cowvol: see README.md. Tests and the demo mount filesystems: run as root.
GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
BIN       := bin/cowvol-plugin
IMAGE     ?= cowvol-plugin:$(VERSION)
# Benchmarks: how long each runs, and how many times (benchstat-friendly).
BENCHTIME ?= 1x
BENCHCOUNT ?= 1

.PHONY: build test unit sanity race bench demo lint image clean

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/cowvol-plugin

# The whole suite: unit tests, the behavioural suite on every backend, the
# CSI contract and crash tests against the real binary, and csi-sanity.
test: build
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 12m ./...
	$(GO) test -count=1 -race -timeout 5m ./pkg/...

bench: build
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) $(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count $(BENCHCOUNT) -timeout 60m ./bench/

demo: build
	$(BIN) demo

lint:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...

image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

clean:
	rm -rf bin
