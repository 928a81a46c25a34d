# cowvol: see README.md. Tests and the demo mount filesystems: run as root.
GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
BIN       := bin/cowvol-plugin
CLI       := bin/kubectl-cowvol
IMAGE     ?= cowvol-plugin:$(VERSION)
# The architectures make image builds one multi-platform image for.
IMAGE_ARCHS ?= amd64 arm64
IMAGE_TAR   ?= bin/cowvol-plugin-image.tar
comma := ,
space := $(subst ,, )
# Benchmarks: how long each runs, and how many times (benchstat-friendly).
BENCHTIME ?= 1x
BENCHCOUNT ?= 1

# The e2e harness's Kubernetes, built from source (no registry is reachable).
K8S_VERSION := v1.33.13
K8S_BIN     := test/e2e/bin
K8S_LDFLAGS := -s -w $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
	-X $(p).gitVersion=$(K8S_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=33 -X $(p).gitTreeState=clean)

# Code generated from api/*.proto, with pinned generators (and protoc from
# Debian's protobuf-compiler).
PROTOC_GEN_GO      := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
TOOLS              := $(CURDIR)/bin/tools

.PHONY: build test bench demo lint image docker-image clean e2e generate

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/cowvol-plugin
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(CLI) ./cmd/kubectl-cowvol

# The whole suite: unit tests, the behavioural suite on every backend, the
# CSI contract and crash tests against the real binary, and csi-sanity.
test: build
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) COWVOL_KUBECTL_BINARY=$(CURDIR)/$(CLI) $(GO) test -count=1 -timeout 12m ./...
	$(GO) test -count=1 -race -timeout 5m ./pkg/...
	# The archive extractor against mutated archives, bounded by count (a
	# time bound stalls Go's fuzzer on this machine).
	$(GO) test -run '^$$' -fuzz FuzzUnpack -fuzztime 20000x -parallel 2 ./pkg/streamer

# A real kubelet mounting cowvol volumes into real step pods (see test/e2e).
# The cluster runs the image make image builds (under the e2e's name).
e2e: build $(K8S_BIN)/kubelet
	test/e2e/install-deps.sh
	$(MAKE) image VERSION=e2e IMAGE=cowvol.test/cowvol-plugin:e2e IMAGE_TAR=$(K8S_BIN)/plugin-image.tar
	rm -f $(K8S_BIN)/report.txt
	cd test/e2e && COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) COWVOL_KUBECTL_BINARY=$(CURDIR)/$(CLI) COWVOL_E2E_REPORT=$(CURDIR)/$(K8S_BIN)/report.txt \
		COWVOL_PLUGIN_IMAGE_TAR=$(CURDIR)/$(K8S_BIN)/plugin-image.tar \
		$(GO) test -tags e2e -count=1 -timeout 30m -v .
	@cat $(K8S_BIN)/report.txt 2>/dev/null || true

$(K8S_BIN)/kubelet: test/e2e/tools/go.mod
	cd test/e2e/tools && $(GO) build -trimpath -ldflags '$(K8S_LDFLAGS)' -o ../bin/ \
		k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl \
		k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler

bench: build
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) $(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count $(BENCHCOUNT) -timeout 60m ./bench/

demo: build
	$(BIN) demo

generate:
	@command -v protoc >/dev/null || { echo "protoc is missing: apt-get install protobuf-compiler"; exit 1; }
	GOBIN=$(TOOLS) $(GO) install $(PROTOC_GEN_GO)
	GOBIN=$(TOOLS) $(GO) install $(PROTOC_GEN_GO_GRPC)
	PATH=$(TOOLS):$$PATH protoc -I api --go_out=api --go_opt=paths=source_relative \
		--go-grpc_out=api --go-grpc_opt=paths=source_relative api/node/v1/node.proto api/controller/v1/controller.proto api/peer/v1/peer.proto

lint:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); exit 1; }
	$(GO) vet ./...

# The plugin image as an OCI layout tar, without a Docker daemon: load it
# with `ctr images import`, or push it with `skopeo copy oci-archive:...`.
image:
	$(foreach a,$(IMAGE_ARCHS),CGO_ENABLED=0 GOARCH=$(a) $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/linux-$(a)/cowvol-plugin ./cmd/cowvol-plugin &&) true
	$(GO) run ./hack/build-image -name $(IMAGE) -version $(VERSION) -out $(IMAGE_TAR) \
		-binary $(subst $(space),$(comma),$(foreach a,$(IMAGE_ARCHS),$(a)=bin/linux-$(a)/cowvol-plugin))

# The same content through Docker, for those who have it.
docker-image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

clean:
	rm -rf bin $(K8S_BIN)
