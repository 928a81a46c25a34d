package test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/driver"
)

// captureIn makes a ready cached volume handle, captured by a pod of ns,
// holding a file that names both.
func (e *env) captureIn(ns, handle string, extra map[string]string) {
	e.t.Helper()
	attrs := map[string]string{driver.AttrCapture: handle}
	for k, v := range extra {
		attrs[k] = v
	}
	v := e.volumeIn(ns, attrs, false)
	require.NoError(e.t, e.publish(v))
	write(e.t, v.Target, "file", ns+"/"+handle)
	e.umount(v)
}

// TestPublishContract drives the real binary over gRPC with every kind of
// request a kubelet (or a confused user) can send, and checks each answer's
// code; every request that succeeds is repeated and must succeed again.
func TestPublishContract(t *testing.T) {
	testfs.Need(t)
	// A source being captured is waited for this long before Unavailable.
	e := newEnv(t, plugintest.Config{Backend: "overlay", Args: []string{"--capture-wait=1s"}})
	e.captureIn("ci", "src-ns", nil)
	e.captureIn("other", "src-cluster", map[string]string{driver.AttrScope: "cluster"})
	e.captureIn("ci", "taken", nil)
	reserving := e.mount(map[string]string{driver.AttrCapture: "reserved"}, false)
	published := e.mount(nil, false)

	base := func(mut func(r *csi.NodePublishVolumeRequest)) *csi.NodePublishVolumeRequest {
		r := e.volume(nil, false).PublishRequest()
		mut(r)
		return r
	}
	fromNS := func(ns string, mut func(r *csi.NodePublishVolumeRequest)) *csi.NodePublishVolumeRequest {
		r := e.volumeIn(ns, nil, false).PublishRequest()
		mut(r)
		return r
	}
	attrs := func(kv ...string) func(r *csi.NodePublishVolumeRequest) {
		return func(r *csi.NodePublishVolumeRequest) {
			for i := 0; i < len(kv); i += 2 {
				r.VolumeContext[kv[i]] = kv[i+1]
			}
		}
	}
	mountCap := func(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	}
	tests := []struct {
		name     string
		req      *csi.NodePublishVolumeRequest
		wantCode codes.Code
		wantMsg  string
	}{
		{"ok: empty volume", base(func(*csi.NodePublishVolumeRequest) {}), codes.OK, ""},
		{"ok: own namespace source", base(attrs("source", "src-ns")), codes.OK, ""},
		{"ok: cluster-scoped source of another namespace, named", base(attrs("source", "src-cluster", "sourceNamespace", "other")), codes.OK, ""},
		{"ok: own namespace named", base(attrs("source", "src-ns", "sourceNamespace", "ci")), codes.OK, ""},
		{"ok: source and capture with properties", base(attrs("source", "src-ns", "capture", "new-out", "property.version", "v1")), codes.OK, ""},
		{"ok: capture with a TTL", base(attrs("capture", "ttl-out", "ttl", "72h")), codes.OK, ""},
		{"bad TTL", base(attrs("capture", "ttl-bad", "ttl", "soon")), codes.InvalidArgument, "ttl"},
		{"TTL without capture", base(attrs("ttl", "1h")), codes.InvalidArgument, "need capture"},
		{"ok: read-only by access mode", base(func(r *csi.NodePublishVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY)
			r.VolumeContext["source"] = "src-ns"
		}), codes.OK, ""},
		{"ok: the same request again", published.PublishRequest(), codes.OK, ""},
		{"no volume ID", base(func(r *csi.NodePublishVolumeRequest) { r.VolumeId = "" }), codes.InvalidArgument, "volume ID"},
		{"no target", base(func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "" }), codes.InvalidArgument, "target"},
		{"relative target", base(func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "pods/x" }), codes.InvalidArgument, "absolute"},
		{"target with ..", base(func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "/var/lib/../../etc" }), codes.InvalidArgument, "clean"},
		{"target outside the kubelet dir", base(func(r *csi.NodePublishVolumeRequest) { r.TargetPath = "/etc/cron.d/mount" }), codes.InvalidArgument, "not the kubelet's"},
		{"target of another pod", base(func(r *csi.NodePublishVolumeRequest) {
			r.TargetPath = e.volume(nil, false).Target
		}), codes.InvalidArgument, "not a volume of pod"},
		{"no capability", base(func(r *csi.NodePublishVolumeRequest) { r.VolumeCapability = nil }), codes.InvalidArgument, "capability"},
		{"block access", base(func(r *csi.NodePublishVolumeRequest) {
			r.VolumeCapability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		}), codes.InvalidArgument, "block"},
		{"multi-node access", base(func(r *csi.NodePublishVolumeRequest) {
			r.VolumeCapability = mountCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)
		}), codes.InvalidArgument, "one node"},
		{"mount flags", base(func(r *csi.NodePublishVolumeRequest) {
			r.VolumeCapability.GetMount().MountFlags = []string{"noexec"}
		}), codes.InvalidArgument, "mount flags"},
		{"unknown attribute", base(attrs("sorce", "src-ns")), codes.InvalidArgument, "source, sourceNamespace, capture, scope, sizeLimit, ttl, copies, owner, readProfile, property.<key>"},
		{"no pod info: podInfoOnMount off", base(func(r *csi.NodePublishVolumeRequest) {
			r.VolumeContext = map[string]string{"source": "src-ns"}
		}), codes.FailedPrecondition, "podInfoOnMount: true"},
		{"forged pod info without the kubelet's ephemeral key", base(func(r *csi.NodePublishVolumeRequest) {
			delete(r.VolumeContext, "csi.storage.k8s.io/ephemeral")
		}), codes.FailedPrecondition, "podInfoOnMount: true"},
		{"a pod name that forges a log line", base(attrs("csi.storage.k8s.io/pod.name", "x\nI1122 08:00:00.000000 1 node.go:1] \"Captured\"\x1b[0m")),
			codes.InvalidArgument, "pod name"},
		{"size limit where nothing enforces it", base(attrs("capture", "x4", "sizeLimit", "1Gi")), codes.FailedPrecondition, "size limits are off"},
		{"traversal in source", base(attrs("source", "../../etc")), codes.InvalidArgument, "invalid"},
		{"slash in capture", base(attrs("capture", "a/b")), codes.InvalidArgument, "invalid"},
		{"dot handle", base(attrs("capture", ".")), codes.InvalidArgument, "invalid"},
		{"hidden handle", base(attrs("source", ".hidden")), codes.InvalidArgument, "invalid"},
		{"empty handle", base(attrs("source", "")), codes.InvalidArgument, "invalid"},
		{"long handle", base(attrs("capture", strings.Repeat("a", 129))), codes.InvalidArgument, "invalid"},
		{"bad scope", base(attrs("capture", "x1", "scope", "global")), codes.InvalidArgument, "scope"},
		{"scope without capture", base(attrs("scope", "cluster")), codes.InvalidArgument, "need capture"},
		{"property without capture", base(attrs("property.k", "v")), codes.InvalidArgument, "need capture"},
		{"bad property key", base(attrs("capture", "x2", "property.", "v")), codes.InvalidArgument, "property key"},
		{"read-only capture", base(func(r *csi.NodePublishVolumeRequest) {
			r.Readonly = true
			r.VolumeContext["capture"] = "x3"
		}), codes.InvalidArgument, "read-only"},
		{"capture equals source", base(attrs("source", "src-ns", "capture", "src-ns")), codes.InvalidArgument, "immutable"},
		{"missing source", base(attrs("source", "nope")), codes.NotFound, `"nope"`},
		{"source being captured", base(attrs("source", "reserved")), codes.Unavailable, "being captured"},
		{"another namespace's source, unnamed, resolves in the pod's own", fromNS("intruder", attrs("source", "src-ns")), codes.NotFound,
			`source volume "src-ns" is not cached on this node`},
		{"another namespace's private source, named", fromNS("intruder", attrs("source", "src-ns", "sourceNamespace", "ci")), codes.NotFound,
			`source volume "src-ns" of namespace "ci" is not cached on this node, or is not shared`},
		{"another namespace's missing source, named: the same answer", fromNS("intruder", attrs("source", "nope", "sourceNamespace", "ci")), codes.NotFound,
			`source volume "nope" of namespace "ci" is not cached on this node, or is not shared`},
		{"another namespace's reservation, named", fromNS("intruder", attrs("source", "reserved", "sourceNamespace", "ci")), codes.NotFound,
			`source volume "reserved" of namespace "ci" is not cached on this node, or is not shared`},
		{"capture handle taken", base(attrs("capture", "taken")), codes.AlreadyExists, "taken"},
		{"capture handle reserved", base(attrs("capture", "reserved")), codes.AlreadyExists, "reserved"},
		{"same ID at another target", func() *csi.NodePublishVolumeRequest {
			r := published.PublishRequest()
			r.TargetPath = filepath.Join(filepath.Dir(filepath.Dir(r.TargetPath)), "elsewhere", "mount")
			return r
		}(), codes.AlreadyExists, "already published"},
		{"same ID with other attributes", func() *csi.NodePublishVolumeRequest {
			r := published.PublishRequest()
			r.VolumeContext["source"] = "src-ns"
			return r
		}(), codes.AlreadyExists, "already published"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.p.Node.NodePublishVolume(context.Background(), tc.req)
			require.Equal(t, tc.wantCode, status.Code(err), "err: %v", err)
			if tc.wantMsg != "" {
				assert.Contains(t, status.Convert(err).Message(), tc.wantMsg)
			}
			if ns := tc.req.VolumeContext["csi.storage.k8s.io/pod.namespace"]; ns == "intruder" {
				noOtherNamespace(t, err, tc.req.VolumeContext["sourceNamespace"])
			}
			if err != nil {
				return
			}
			_, err = e.p.Node.NodePublishVolume(context.Background(), tc.req)
			require.NoError(t, err, "publish must be idempotent")
			if tc.req.VolumeId == published.VolumeID {
				return // later cases need it published
			}
			_, err = e.p.Node.NodeUnpublishVolume(context.Background(),
				&csi.NodeUnpublishVolumeRequest{VolumeId: tc.req.VolumeId, TargetPath: tc.req.TargetPath})
			require.NoError(t, err)
			_, err = e.p.Node.NodeUnpublishVolume(context.Background(),
				&csi.NodeUnpublishVolumeRequest{VolumeId: tc.req.VolumeId, TargetPath: tc.req.TargetPath})
			require.NoError(t, err, "unpublish must be idempotent")
		})
	}
	e.umount(reserving)
	require.NoError(t, e.unpublish(published))
	e.noLeaks(t)
}

func TestUnpublishContract(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	v := e.mount(nil, false)
	tests := []struct {
		name     string
		req      *csi.NodeUnpublishVolumeRequest
		wantCode codes.Code
	}{
		{"no volume ID", &csi.NodeUnpublishVolumeRequest{TargetPath: v.Target}, codes.InvalidArgument},
		{"no target", &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID}, codes.InvalidArgument},
		{"relative target", &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID, TargetPath: "x/y"}, codes.InvalidArgument},
		{"target outside the kubelet dir", &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID, TargetPath: "/tmp/x/mount"}, codes.InvalidArgument},
		{"wrong target", &csi.NodeUnpublishVolumeRequest{VolumeId: v.VolumeID, TargetPath: e.volume(nil, false).Target}, codes.NotFound},
		{"ok", v.UnpublishRequest(), codes.OK},
		{"ok again", v.UnpublishRequest(), codes.OK},
		{"never published", &csi.NodeUnpublishVolumeRequest{VolumeId: "csi-unknown", TargetPath: e.volume(nil, false).Target}, codes.OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.p.Node.NodeUnpublishVolume(context.Background(), tc.req)
			require.Equal(t, tc.wantCode, status.Code(err), "err: %v", err)
		})
	}
	e.noLeaks(t)
}

func TestVolumeStatsContract(t *testing.T) {
	testfs.Need(t)
	e := newEnv(t, plugintest.Config{Backend: "overlay"})
	e.step("", "stats-src", func(dir string) { write(t, dir, "big", strings.Repeat("x", 4<<20)) })
	v := e.mount(map[string]string{driver.AttrSource: "stats-src"}, false)
	require.NoError(t, os.WriteFile(filepath.Join(v.Target, "new"), make([]byte, 1<<20), 0o644))
	tests := []struct {
		name     string
		req      *csi.NodeGetVolumeStatsRequest
		wantCode codes.Code
	}{
		{"no volume ID", &csi.NodeGetVolumeStatsRequest{VolumePath: v.Target}, codes.InvalidArgument},
		{"no path", &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeID}, codes.InvalidArgument},
		{"unknown volume", &csi.NodeGetVolumeStatsRequest{VolumeId: "csi-x", VolumePath: v.Target}, codes.NotFound},
		{"wrong path", &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeID, VolumePath: "/some/path"}, codes.NotFound},
		{"ok", &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeID, VolumePath: v.Target}, codes.OK},
		{"ok again", &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeID, VolumePath: v.Target}, codes.OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := e.p.Node.NodeGetVolumeStats(context.Background(), tc.req)
			require.Equal(t, tc.wantCode, status.Code(err), "err: %v", err)
			if err != nil {
				return
			}
			bytes := resp.Usage[0]
			assert.Positive(t, bytes.Total)
			assert.Positive(t, bytes.Available)
		})
	}
	// What the step holds of its own is measured in the background: a
	// stats call never walks the tree, and soon answers with the writes.
	eventually(t, "the step's own writes to be measured", func() bool {
		resp, err := e.p.Node.NodeGetVolumeStats(context.Background(), &csi.NodeGetVolumeStatsRequest{VolumeId: v.VolumeID, VolumePath: v.Target})
		require.NoError(t, err)
		bytes, inodes := resp.Usage[0], resp.Usage[1]
		require.Less(t, bytes.Used, int64(4<<20), "the source's data never counts")
		return bytes.Used >= 1<<20 && inodes.Used >= 2
	})
	e.umount(v)
}

// noOtherNamespace checks that a refusal says nothing of another namespace
// but what the caller named itself.
func noOtherNamespace(t *testing.T, err error, named string) {
	t.Helper()
	msg := status.Convert(err).Message()
	for _, ns := range []string{"ci", "other"} {
		if ns != named {
			assert.NotContains(t, msg, `"`+ns+`"`, "the answer names another namespace")
		}
	}
	for _, state := range []string{"creating", "ready", "failed", "scope is namespace", "belongs to"} {
		assert.NotContains(t, msg, state, "the answer tells another namespace's state")
	}
}

// A kubelet retry that arrives while the first publish is still copying
// (the copy backend on a large source) is told Aborted, and a later retry
// finds the work done: never a second volume.
func TestInFlightDuplicateIsAborted(t *testing.T) {
	state := testfs.Mount(t, testfs.XFS, 1<<30)
	e := newEnv(t, plugintest.Config{StateDir: state, Backend: "copy"})
	e.step("", "many", func(dir string) {
		for i := range 50 {
			sub := filepath.Join(dir, fmt.Sprintf("d%02d", i))
			require.NoError(t, os.MkdirAll(sub, 0o755))
			for j := range 200 {
				require.NoError(t, os.WriteFile(filepath.Join(sub, fmt.Sprintf("f%03d", j)), []byte("z"), 0o644))
			}
		}
	})
	v := e.volume(map[string]string{driver.AttrSource: "many"}, false)
	first := make(chan error, 1)
	go func() { first <- e.publish(v) }()
	eventually(t, "the first publish to start copying", func() bool {
		entries, _ := os.ReadDir(filepath.Join(state, "views"))
		return len(entries) > 0
	})
	require.Equal(t, codes.Aborted, code(e.publish(v)), "a duplicate during the copy is Aborted")
	require.NoError(t, <-first)
	require.NoError(t, e.publish(v), "the retry after it finds the volume published")
	e.umount(v)
}
