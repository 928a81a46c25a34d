# cowvol: see README.md. Tests and the demo mount filesystems: run as root.
GO        ?= go
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
BIN       := bin/cowvol-plugin
CLI       := bin/kubectl-cowvol
PROVIDER  := bin/cowvol-credential-provider
IMAGE     ?= cowvol-plugin:$(VERSION)
# The architectures make image builds one multi-platform image for.
IMAGE_ARCHS ?= amd64 arm64
IMAGE_TAR   ?= bin/cowvol-plugin-image.tar
comma := ,
space := $(subst ,, )
# Benchmarks: how long each runs, and how many times (benchstat-friendly).
BENCHTIME ?= 1x
BENCHCOUNT ?= 1

# The e2e harness's Kubernetes, built from source (no registry is reachable):
# the newest release by default, or another supported one (K8S_VERSION=v1.35.4),
# each from its own module in test/e2e/tools and cached in its own bin dir.
K8S_VERSION ?= v1.37.2
K8S_MINOR   := $(word 2,$(subst ., ,$(K8S_VERSION)))
K8S_TOOLS   := test/e2e/tools/k8s-1.$(K8S_MINOR)
E2E_BIN     := test/e2e/bin
K8S_BIN     := $(E2E_BIN)/kubernetes-$(K8S_VERSION)
K8S_LDFLAGS := -s -w $(foreach p,k8s.io/component-base/version k8s.io/client-go/pkg/version,\
	-X $(p).gitVersion=$(K8S_VERSION) -X $(p).gitMajor=1 -X $(p).gitMinor=$(K8S_MINOR) -X $(p).gitTreeState=clean)
# Its container runtime, also from source at pinned versions: containerd 2
# with its runc shim and ctr, and runc (cgo, libseccomp).
RUNTIME_TOOLS := test/e2e/tools/runtime
RUNTIME_BIN   := $(E2E_BIN)/runtime
CONTAINERD_VERSION := $(shell sed -n 's|^\tgithub.com/containerd/containerd/v2 \(v[^ ]*\).*|\1|p' $(RUNTIME_TOOLS)/go.mod)

# The upstream node-driver-registrar sidecar, which the base's DaemonSet
# runs, built from its source with vendor/ (the module proxy does not serve
# it) in the shared third_party dir: the e2e imports it under the upstream
# image's name.
REGISTRAR_VERSION := v2.17.0
THIRD_PARTY       ?= $(CURDIR)/../shared/third_party
REGISTRAR_ARCHIVE := $(THIRD_PARTY)/node-driver-registrar/node-driver-registrar-$(REGISTRAR_VERSION).tar.zst
REGISTRAR_BIN     := $(E2E_BIN)/registrar-$(REGISTRAR_VERSION)/csi-node-driver-registrar

# helm, for the chart's render test and its install in the e2e, built
# from its Go module in a tools module of its own.
HELM_TOOLS := test/e2e/tools/helm
HELM_BIN   := $(E2E_BIN)/helm/helm

# Argo Workflows, for make cluster WITH=argo and the fleet's Argo scenario:
# the workflow controller, the executor (argoexec) and the argo CLI (also
# argo server), built from source in a tools module of their own; their
# images are made from these binaries (hack/build-image) under the names
# the release's manifests give them.
ARGO_TOOLS   := test/e2e/tools/argo
ARGO_VERSION := $(shell sed -n 's|^\tgithub.com/argoproj/argo-workflows/v3 \(v[^ ]*\).*|\1|p' $(ARGO_TOOLS)/go.mod)
ARGO_BIN     := $(E2E_BIN)/argo-$(ARGO_VERSION)

# SeaweedFS (weed), whose S3 gateway is the artifact repository of make
# bench-argo, built from its Go module in a tools module of its own.
WEED_TOOLS := test/e2e/tools/seaweedfs
WEED_BIN   := $(E2E_BIN)/seaweedfs/weed

# Code generated from api/*.proto, with pinned generators (and protoc from
# Debian's protobuf-compiler).
PROTOC_GEN_GO      := google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
PROTOC_GEN_GO_GRPC := google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
TOOLS              := $(CURDIR)/bin/tools

.PHONY: build test bench bench-argo demo lint image docker-image clean e2e e2e-deps soak cluster cluster-down generate docs manifests

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/cowvol-plugin
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(CLI) ./cmd/kubectl-cowvol
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(PROVIDER) ./cmd/cowvol-credential-provider

# The whole suite: unit tests, the behavioural suite on every backend, the
# CSI contract and crash tests against the real binary, and csi-sanity.
# The plain run builds as make build does (no cgo, -trimpath), so that it
# reuses build's compiled packages instead of compiling the world again. The
# race run leaves out the two data-fidelity tests over a 256 MiB tree (144 s
# of its 5.5 min, hashing and encoding under the detector), the tar
# reader's comparison with archive/tar over every kind of entry (79 s of
# its streamer package's 116 s, all parsing) and the index's of a layer
# tree with a 256 MiB sparse file (30 s, reading its zeros; the index
# starts no goroutine): the plain run has them, and the copier's and the
# streams' concurrency is raced by the others.
# The plain run's output is kept in bin/test.log: a failed test dumps its
# plugins' and controller's logs after its --- FAIL line, which pushes why
# it failed above the end of the output CI keeps, so a failed run ends by
# repeating why (hack/test-failures).
test: build
	{ COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) COWVOL_KUBECTL_BINARY=$(CURDIR)/$(CLI) CGO_ENABLED=0 $(GO) test -trimpath -count=1 -timeout 12m ./... ; \
		echo $$? > bin/test.status; } 2>&1 | tee bin/test.log
	hack/test-failures bin/test.log bin/test.status
	$(GO) test -count=1 -race -timeout 5m -skip '^(TestCopyTreeIsFaithful|TestRoundTripKeepsALayer|TestTarReaderReadsWhatAPackerWrites|TestIndexIsTheLayer)$$' ./pkg/...
	# The archive extractor against mutated archives, bounded by count (a
	# time bound stalls Go's fuzzer on this machine).
	$(GO) test -run '^$$' -fuzz FuzzUnpack -fuzztime 20000x -parallel 2 ./pkg/streamer
	# The stream's tar writer and reader against archive/tar's.
	$(GO) test -run '^$$' -fuzz FuzzTarWriter -fuzztime 20000x -parallel 2 ./pkg/streamer
	$(GO) test -run '^$$' -fuzz FuzzTarReader -fuzztime 50000x -parallel 2 ./pkg/streamer
	# What a holder finds where it keeps a stub tree: served whole, or nothing sent.
	$(GO) test -run '^$$' -fuzz FuzzServeKept -fuzztime 20000x -parallel 2 ./pkg/streamer
	# A holder's index records, as an index pull learns them.
	$(GO) test -run '^$$' -fuzz FuzzIndexRecords -fuzztime 20000x -parallel 2 ./pkg/streamer
	# The index's EROFS images of random trees against go-erofs's reader.
	$(GO) test -run '^$$' -fuzz FuzzImage -fuzztime 3000x -parallel 2 ./pkg/index
	# A layout read back from an image torn or changed anywhere: read or refused.
	$(GO) test -run '^$$' -fuzz FuzzReadLayout -fuzztime 20000x -parallel 2 ./pkg/index
	# A layer's file of sums changed anywhere, then again under the table read from it.
	$(GO) test -run '^$$' -fuzz FuzzReadTableFile -fuzztime 10000x -parallel 2 ./pkg/filesum
	# The controller's reading of nodes' reports against the generated types'.
	$(GO) test -run '^$$' -fuzz FuzzDecodeReport -fuzztime 20000x -parallel 2 ./pkg/controller

# A real kubelet mounting cowvol volumes into real step pods (see test/e2e).
# The cluster runs the image make image builds (under the e2e's name).
E2E_ENV = PATH=$(CURDIR)/$(RUNTIME_BIN):$$PATH \
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) COWVOL_KUBECTL_BINARY=$(CURDIR)/$(CLI) COWVOL_E2E_REPORT=$(CURDIR)/$(E2E_BIN)/report.txt \
	COWVOL_CREDENTIAL_PROVIDER_BINARY=$(CURDIR)/$(PROVIDER) \
	COWVOL_PLUGIN_IMAGE_TAR=$(CURDIR)/$(E2E_BIN)/plugin-image.tar COWVOL_E2E_KUBE_BIN=$(CURDIR)/$(K8S_BIN) \
	COWVOL_E2E_REGISTRAR_BINARY=$(CURDIR)/$(REGISTRAR_BIN) COWVOL_E2E_HELM_BINARY=$(CURDIR)/$(HELM_BIN) \
	COWVOL_E2E_ARGO_BIN=$(CURDIR)/$(ARGO_BIN)

e2e-deps: build $(K8S_BIN)/kube-proxy $(RUNTIME_BIN)/runc $(REGISTRAR_BIN) $(HELM_BIN) $(ARGO_BIN)/argo
	test/e2e/install-deps.sh
	$(MAKE) image VERSION=e2e IMAGE=cowvol.test/cowvol-plugin:e2e IMAGE_TAR=$(E2E_BIN)/plugin-image.tar

# The run's output is kept in $(E2E_BIN)/e2e.log; a failed run ends by
# repeating why (hack/test-failures).
e2e: e2e-deps
	rm -f $(E2E_BIN)/report.txt $(E2E_BIN)/e2e.status
	{ cd test/e2e && $(E2E_ENV) $(GO) test -tags e2e -count=1 -timeout 40m -v . ; echo $$? > $(CURDIR)/$(E2E_BIN)/e2e.status; } 2>&1 \
		| tee $(E2E_BIN)/e2e.log
	hack/test-failures $(E2E_BIN)/e2e.log $(E2E_BIN)/e2e.status
	@cat $(E2E_BIN)/report.txt 2>/dev/null || true

# A local cluster of real nodes (NODES, default 3) with cowvol installed
# from its chart, to try it on: it stays up, in the background, until make
# cluster-down. The last line make cluster prints is "kubeconfig: PATH".
CLUSTER_DIR ?= $(CURDIR)/.cluster
# The soak: builds without pause on a 3-node fleet while faults are
# injected at random, for SOAK minutes (CI runs 5).
SOAK ?= 30
soak: e2e-deps
	rm -f $(E2E_BIN)/soak-report.txt $(E2E_BIN)/soak.status
	{ cd test/e2e && $(E2E_ENV) COWVOL_E2E_REPORT=$(CURDIR)/$(E2E_BIN)/soak-report.txt COWVOL_SOAK_MINUTES=$(SOAK) \
		$(GO) test -tags e2e -count=1 -timeout $$(( $(SOAK) + 40 ))m -run '^TestSoak$$' -v . ; echo $$? > $(CURDIR)/$(E2E_BIN)/soak.status; } 2>&1 \
		| tee $(E2E_BIN)/soak.log
	hack/test-failures $(E2E_BIN)/soak.log $(E2E_BIN)/soak.status
	@cat $(E2E_BIN)/soak-report.txt

# The cluster is test/localcluster's, run by its command in the background.
LOCALCLUSTER := $(E2E_BIN)/localcluster
NODES ?= 3
cluster: e2e-deps
	$(GO) build -o $(LOCALCLUSTER) ./test/localcluster/cmd/localcluster
	$(E2E_ENV) $(LOCALCLUSTER) -nodes $(NODES) $(if $(WITH),-with $(WITH)) up $(CLUSTER_DIR)

cluster-down:
	$(GO) build -o $(LOCALCLUSTER) ./test/localcluster/cmd/localcluster
	$(LOCALCLUSTER) down $(CLUSTER_DIR)

# kube-proxy routes the fleet's Services (TestFleet's nodes have their own
# network namespaces); the one-node cluster runs without it.
$(K8S_BIN)/kube-proxy: $(K8S_TOOLS)/go.mod
	@test -f $(K8S_TOOLS)/go.mod || { echo "no e2e tools for Kubernetes $(K8S_VERSION) (test/e2e/tools has: $$(ls test/e2e/tools))"; exit 1; }
	@grep -q "k8s.io/kubernetes $(K8S_VERSION)\b" $(K8S_TOOLS)/go.mod || { echo "$(K8S_TOOLS) pins another release than $(K8S_VERSION)"; exit 1; }
	cd $(K8S_TOOLS) && $(GO) build -trimpath -ldflags '$(K8S_LDFLAGS)' -o $(CURDIR)/$(K8S_BIN)/ \
		k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl \
		k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-proxy

$(HELM_BIN): $(HELM_TOOLS)/go.mod
	cd $(HELM_TOOLS) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w' -o $(CURDIR)/$@ helm.sh/helm/v3/cmd/helm

# Built from a copy of the module's source (-modfile with a replace line),
# mended where a module zip differs from the repository: the zip leaves
# out symlinks, and the executor's signal_linux.go is one (to
# signal_darwin.go), put back as a copy; and it has no built web UI (the
# release builds it with yarn, which cannot run here), so a placeholder
# page stands in and `argo server` serves its API and no web UI. The
# release's manifests are kept beside the binaries.
$(ARGO_BIN)/argo: $(ARGO_TOOLS)/go.mod
	rm -rf $(ARGO_BIN) && mkdir -p $(ARGO_BIN)
	cp -r "$$(cd $(ARGO_TOOLS) && $(GO) mod download github.com/argoproj/argo-workflows/v3 && $(GO) list -m -f '{{.Dir}}' github.com/argoproj/argo-workflows/v3)" $(ARGO_BIN)/src
	chmod -R u+w $(ARGO_BIN)/src
	cp $(ARGO_BIN)/src/workflow/executor/osspecific/signal_darwin.go $(ARGO_BIN)/src/workflow/executor/osspecific/signal_linux.go
	mkdir -p $(ARGO_BIN)/src/ui/dist/app && echo 'No web UI was built into this argo server (cowvol e2e).' > $(ARGO_BIN)/src/ui/dist/app/index.html
	cp $(ARGO_TOOLS)/go.mod $(ARGO_BIN)/build.mod && cp $(ARGO_TOOLS)/go.sum $(ARGO_BIN)/build.sum
	cd $(ARGO_TOOLS) && $(GO) mod edit -modfile=$(CURDIR)/$(ARGO_BIN)/build.mod -replace github.com/argoproj/argo-workflows/v3=$(CURDIR)/$(ARGO_BIN)/src && \
		CGO_ENABLED=0 $(GO) build -modfile=$(CURDIR)/$(ARGO_BIN)/build.mod -trimpath \
		-ldflags '-s -w -X github.com/argoproj/argo-workflows/v3.version=$(ARGO_VERSION)' -o $(CURDIR)/$(ARGO_BIN)/ \
		github.com/argoproj/argo-workflows/v3/cmd/workflow-controller github.com/argoproj/argo-workflows/v3/cmd/argoexec \
		github.com/argoproj/argo-workflows/v3/cmd/argo
	mv $(ARGO_BIN)/src/manifests $(ARGO_BIN)/manifests
	rm -rf $(ARGO_BIN)/src $(ARGO_BIN)/build.mod $(ARGO_BIN)/build.sum

$(REGISTRAR_BIN):
	@test -f $(REGISTRAR_ARCHIVE) || { echo "no node-driver-registrar source at $(REGISTRAR_ARCHIVE): set THIRD_PARTY to the dir that holds node-driver-registrar/"; exit 1; }
	rm -rf $(@D)/src && mkdir -p $(@D)/src
	tar --zstd -xf $(REGISTRAR_ARCHIVE) -C $(@D)/src
	cd $(@D)/src/node-driver-registrar-$(REGISTRAR_VERSION) && CGO_ENABLED=0 GOFLAGS=-mod=vendor $(GO) build -trimpath -ldflags '-s -w' -o $(CURDIR)/$@ ./cmd/csi-node-driver-registrar
	rm -rf $(@D)/src

# runc links libseccomp (Debian's libseccomp-dev, which install-deps.sh adds).
$(RUNTIME_BIN)/runc: $(RUNTIME_TOOLS)/go.mod
	test/e2e/install-deps.sh
	cd $(RUNTIME_TOOLS) && CGO_ENABLED=0 $(GO) build -trimpath -tags no_btrfs \
		-ldflags '-s -w -X github.com/containerd/containerd/v2/version.Version=$(CONTAINERD_VERSION)' -o $(CURDIR)/$(RUNTIME_BIN)/ \
		github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
		github.com/containerd/containerd/v2/cmd/ctr
	cd $(RUNTIME_TOOLS) && CGO_ENABLED=1 $(GO) build -trimpath -tags seccomp -ldflags '-s -w' -o $(CURDIR)/$(RUNTIME_BIN)/runc \
		github.com/opencontainers/runc

# BenchmarkCache's comparator is tar to and from SeaweedFS's S3 gateway.
bench: build $(WEED_BIN)
	COWVOL_PLUGIN_BINARY=$(CURDIR)/$(BIN) COWVOL_BENCH_WEED_BINARY=$(CURDIR)/$(WEED_BIN) $(GO) test -run '^$$' -bench . -benchtime $(BENCHTIME) -count $(BENCHCOUNT) -timeout 60m ./bench/

# Argo's S3 artifacts against cowvol volumes on the fleet, side by side in
# one run (BenchmarkArgoArtifacts; figures in bench/RESULTS.md).
bench-argo: e2e-deps $(WEED_BIN)
	{ cd test/e2e && $(E2E_ENV) COWVOL_E2E_WEED_BINARY=$(CURDIR)/$(WEED_BIN) COWVOL_E2E_REPORT=$(CURDIR)/$(E2E_BIN)/bench-argo.txt \
		$(GO) test -tags e2e -count=1 -timeout 60m -run '^$$' -bench '^BenchmarkArgoArtifacts$$' -benchtime 1x -v . ; } 2>&1 \
		| tee $(E2E_BIN)/bench-argo.log

$(WEED_BIN): $(WEED_TOOLS)/go.mod
	cd $(WEED_TOOLS) && CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w' -o $(CURDIR)/$@ github.com/seaweedfs/seaweedfs/weed

demo: build
	$(BIN) demo

# The kustomize base from the Helm chart, cowvol's one install source (the
# e2e's TestManifests fails while the checked-in base differs).
manifests: $(HELM_BIN)
	$(GO) run ./hack/update-kustomize -helm $(HELM_BIN)

# docs/options.md and docs/metrics.md from the code (make test fails while
# either is stale).
docs:
	$(GO) run ./hack/gendocs

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
	$(foreach a,$(IMAGE_ARCHS),CGO_ENABLED=0 GOARCH=$(a) $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/linux-$(a)/ ./cmd/cowvol-plugin ./cmd/cowvol-credential-provider &&) true
	$(GO) run ./hack/build-image -name $(IMAGE) -version $(VERSION) -out $(IMAGE_TAR) \
		-binary $(subst $(space),$(comma),$(foreach a,$(IMAGE_ARCHS),$(a)=bin/linux-$(a)/cowvol-plugin)) \
		-credential-provider $(subst $(space),$(comma),$(foreach a,$(IMAGE_ARCHS),$(a)=bin/linux-$(a)/cowvol-credential-provider))

# The same content through Docker, for those who have it.
docker-image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE) .

clean:
	rm -rf bin $(E2E_BIN)
