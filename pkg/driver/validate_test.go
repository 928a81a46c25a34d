package driver

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"

	"github.com/concourse/cowvol/pkg/client"
	"github.com/concourse/cowvol/pkg/volume"
)

const testUID = "0b4a8c1e-3f2d-4c5b-9a6e-7d8f9a0b1c2d"

// kubeletContext is what the kubelet sends for a pod of namespace ci, plus
// the pod author's attributes.
func kubeletContext(kv ...string) map[string]string {
	vc := map[string]string{volume.KeyEphemeral: "true", volume.KeyPodNamespace: "ci", volume.KeyPodName: "step-1", volume.KeyPodUID: testUID,
		volume.KeyServiceAccount: "default"}
	for i := 0; i < len(kv); i += 2 {
		vc[kv[i]] = kv[i+1]
	}
	return vc
}

func without(vc map[string]string, keys ...string) map[string]string {
	for _, k := range keys {
		delete(vc, k)
	}
	return vc
}

// Every refusal of parseVolumeContext, with no root and no plugin.
func TestParseVolumeContext(t *testing.T) {
	tests := []struct {
		name     string
		vc       map[string]string
		wantCode codes.Code
		wantMsg  string
		want     volumeRequest
	}{
		{"empty volume", kubeletContext(), codes.OK, "", volumeRequest{}},
		{"own source", kubeletContext("source", "res"), codes.OK, "", volumeRequest{Source: volume.Ref{Namespace: "ci", Handle: "res"}}},
		{"shared source", kubeletContext("source", "res", "sourceNamespace", "team-b"), codes.OK, "",
			volumeRequest{Source: volume.Ref{Namespace: "team-b", Handle: "res"}}},
		{"capture with limit", kubeletContext("capture", "out", "sizeLimit", "10Mi"), codes.OK, "",
			volumeRequest{Capture: "out", SizeLimit: 10 << 20}},
		{"a property of cowvol's own (a forged step result)", kubeletContext("capture", "out", "property."+volume.PropertyStepResult, "succeeded"),
			codes.InvalidArgument, "reserved", volumeRequest{}},
		{"no ephemeral key", without(kubeletContext(), volume.KeyEphemeral), codes.FailedPrecondition, "podInfoOnMount: true", volumeRequest{}},
		{"ephemeral false", kubeletContext(volume.KeyEphemeral, "false"), codes.FailedPrecondition, "Ephemeral", volumeRequest{}},
		{"no namespace", without(kubeletContext(), volume.KeyPodNamespace), codes.FailedPrecondition, "pod.namespace", volumeRequest{}},
		{"no pod name", without(kubeletContext(), volume.KeyPodName), codes.FailedPrecondition, "pod.name", volumeRequest{}},
		{"no pod UID", without(kubeletContext(), volume.KeyPodUID), codes.FailedPrecondition, "pod.uid", volumeRequest{}},
		{"forged namespace alone", map[string]string{volume.KeyPodNamespace: "ci", "source": "res"}, codes.FailedPrecondition, "podInfoOnMount", volumeRequest{}},
		{"bad namespace", kubeletContext(volume.KeyPodNamespace, "CI/../x"), codes.InvalidArgument, "namespace", volumeRequest{}},
		{"pod name with a newline", kubeletContext(volume.KeyPodName, "a\nI1122 forged log line\x1b[31m"), codes.InvalidArgument, `\n`, volumeRequest{}},
		{"bad UID", kubeletContext(volume.KeyPodUID, "../../etc"), codes.InvalidArgument, "UID", volumeRequest{}},
		{"unknown attribute", kubeletContext("sorce", "x"), codes.InvalidArgument, knownKeys, volumeRequest{}},
		{"bad source", kubeletContext("source", "../x"), codes.InvalidArgument, "source", volumeRequest{}},
		{"bad source namespace", kubeletContext("source", "x", "sourceNamespace", "A_B"), codes.InvalidArgument, "sourceNamespace", volumeRequest{}},
		{"source namespace without source", kubeletContext("sourceNamespace", "team-b"), codes.InvalidArgument, "needs source", volumeRequest{}},
		{"capture with a TTL", kubeletContext("capture", "out", "ttl", "72h"), codes.OK, "", volumeRequest{Capture: "out", TTL: 72 * time.Hour}},
		{"bad TTL", kubeletContext("capture", "out", "ttl", "-1h"), codes.InvalidArgument, "ttl", volumeRequest{}},
		{"TTL without capture", kubeletContext("ttl", "1h"), codes.InvalidArgument, "need capture", volumeRequest{}},
		{"capture kept on three nodes", kubeletContext("capture", "out", "copies", "3"), codes.OK, "", volumeRequest{Capture: "out", Copies: 3}},
		{"no copies", kubeletContext("capture", "out", "copies", "0"), codes.InvalidArgument, "copies", volumeRequest{}},
		{"more copies than allowed", kubeletContext("capture", "out", "copies", "6"), codes.InvalidArgument, "1 to 5", volumeRequest{}},
		{"copies that are no number", kubeletContext("capture", "out", "copies", "two"), codes.InvalidArgument, "copies", volumeRequest{}},
		{"copies without capture", kubeletContext("source", "in", "copies", "2"), codes.InvalidArgument, "need capture", volumeRequest{}},
		{"capture owned by the pod's controller", kubeletContext("capture", "out", "owner", "controller"), codes.OK, "",
			volumeRequest{Capture: "out", OwnedByController: true}},
		{"an owner named by the pod", kubeletContext("capture", "out", "owner", "Workflow/other"), codes.InvalidArgument, "want controller", volumeRequest{}},
		{"owner without capture", kubeletContext("source", "in", "owner", "controller"), codes.InvalidArgument, "need capture", volumeRequest{}},
		{"owner's properties set by the pod", kubeletContext("capture", "out", "property."+volume.PropertyOwnerUID, "6f1c4d1e-8a55-4c43-9a3e-1d2b3c4d5e6f"),
			codes.InvalidArgument, "reserved", volumeRequest{}},
		{"bad size limit", kubeletContext("sizeLimit", "lots"), codes.InvalidArgument, "sizeLimit", volumeRequest{}},
		{"zero size limit", kubeletContext("sizeLimit", "0"), codes.InvalidArgument, "positive", volumeRequest{}},
		{"negative size limit", kubeletContext("sizeLimit", "-1Gi"), codes.InvalidArgument, "positive", volumeRequest{}},
		{"source with a read profile", kubeletContext("source", "res", "readProfile", "main/unit:test/repo"), codes.OK, "",
			volumeRequest{Source: volume.Ref{Namespace: "ci", Handle: "res"}, ReadProfile: "main/unit:test/repo"}},
		{"read profile without source", kubeletContext("readProfile", "main/unit"), codes.InvalidArgument, "needs source", volumeRequest{}},
		{"read profile with a newline", kubeletContext("source", "res", "readProfile", "a\nb"), codes.InvalidArgument, "readProfile", volumeRequest{}},
		{"read profile starting with a dot", kubeletContext("source", "res", "readProfile", "../x"), codes.InvalidArgument, "readProfile", volumeRequest{}},
		{"read profile too long", kubeletContext("source", "res", "readProfile", strings.Repeat("a", volume.MaxReadProfile+1)), codes.InvalidArgument, "readProfile", volumeRequest{}},
		{"scope without capture", kubeletContext("scope", "cluster"), codes.InvalidArgument, "need capture", volumeRequest{}},
		{"capture equals own source", kubeletContext("source", "x", "capture", "x"), codes.InvalidArgument, "immutable", volumeRequest{}},
		{"capture equals a shared source's handle", kubeletContext("source", "x", "sourceNamespace", "b", "capture", "x"), codes.OK, "",
			volumeRequest{Source: volume.Ref{Namespace: "b", Handle: "x"}, Capture: "x"}},
		{"a cache", kubeletContext("cache", "go-build/linux-amd64"), codes.OK, "", volumeRequest{Cache: volume.Cache{Key: "go-build/linux-amd64"}}},
		{"a cache promoted always, capped, with a TTL and a size limit",
			kubeletContext("cache", "m2", "cachePromote", "always", "cacheMaxSize", "20Gi", "ttl", "168h", "sizeLimit", "1Gi"), codes.OK, "",
			volumeRequest{Cache: volume.Cache{Key: "m2", PromoteAlways: true, MaxBytes: 20 << 30}, TTL: 168 * time.Hour, SizeLimit: 1 << 30}},
		{"a cache promoted on success, said so", kubeletContext("cache", "m2", "cachePromote", "success"), codes.OK, "",
			volumeRequest{Cache: volume.Cache{Key: "m2"}}},
		{"a cache key starting with a slash", kubeletContext("cache", "/etc"), codes.InvalidArgument, "cache key", volumeRequest{}},
		{"a cache key with a newline", kubeletContext("cache", "a\nb"), codes.InvalidArgument, "cache key", volumeRequest{}},
		{"a cache key too long", kubeletContext("cache", strings.Repeat("k", volume.MaxCacheKey+1)), codes.InvalidArgument, "cache key", volumeRequest{}},
		{"an empty cache key", kubeletContext("cache", ""), codes.InvalidArgument, "cache key", volumeRequest{}},
		{"a cache forked from the node's own version", kubeletContext("cache", "m2", "cacheFrom", "node"), codes.OK, "",
			volumeRequest{Cache: volume.Cache{Key: "m2", FromNode: true}}},
		{"a cache forked from the fleet's, said so", kubeletContext("cache", "m2", "cacheFrom", "fleet"), codes.OK, "",
			volumeRequest{Cache: volume.Cache{Key: "m2"}}},
		{"cacheFrom of another word", kubeletContext("cache", "m2", "cacheFrom", "peer"), codes.InvalidArgument, "cacheFrom", volumeRequest{}},
		{"cacheFrom without cache", kubeletContext("source", "res", "cacheFrom", "node"), codes.InvalidArgument, "need cache", volumeRequest{}},
		{"cachePromote of another word", kubeletContext("cache", "m2", "cachePromote", "never"), codes.InvalidArgument, "cachePromote", volumeRequest{}},
		{"cacheMaxSize of zero", kubeletContext("cache", "m2", "cacheMaxSize", "0"), codes.InvalidArgument, "cacheMaxSize", volumeRequest{}},
		{"cacheMaxSize without cache", kubeletContext("capture", "out", "cacheMaxSize", "1Gi"), codes.InvalidArgument, "need cache", volumeRequest{}},
		{"cachePromote without cache", kubeletContext("cachePromote", "always"), codes.InvalidArgument, "need cache", volumeRequest{}},
		{"a cache with a source", kubeletContext("cache", "m2", "source", "res"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache with a capture", kubeletContext("cache", "m2", "capture", "out"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache shared with the cluster", kubeletContext("cache", "m2", "scope", "cluster"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache with copies", kubeletContext("cache", "m2", "copies", "2"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache owned by the controller", kubeletContext("cache", "m2", "owner", "controller"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache with a property", kubeletContext("cache", "m2", "property.job", "unit"), codes.InvalidArgument, "do not go with it", volumeRequest{}},
		{"a cache version named as a source", kubeletContext("source", "cache.0123456789abcdef01234567.0123456789abcdef"),
			codes.InvalidArgument, "a cache's versions", volumeRequest{}},
		{"another namespace's cache version named as a source",
			kubeletContext("source", "cache.0123456789abcdef01234567.0123456789abcdef", "sourceNamespace", "team-b"),
			codes.InvalidArgument, "a cache's versions", volumeRequest{}},
		{"a capture into a cache version's handle", kubeletContext("capture", "cache.0123456789abcdef01234567.0123456789abcdef"),
			codes.InvalidArgument, "a cache's versions", volumeRequest{}},
		{"huge value is cut in the message", kubeletContext("scope", strings.Repeat("z", 5000)), codes.InvalidArgument, "(5000 bytes)", volumeRequest{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseVolumeContext(tc.vc)
			require.Equal(t, tc.wantCode, status.Code(err), "err: %v", err)
			if tc.wantMsg != "" {
				assert.Contains(t, status.Convert(err).Message(), tc.wantMsg)
			}
			assert.NotContains(t, status.Convert(err).Message(), "\n", "a caller's string never breaks a line")
			if err != nil {
				return
			}
			tc.want.Scope = volume.ScopeNamespace
			tc.want.Pod = volume.Pod{Namespace: "ci", Name: "step-1", UID: testUID}
			require.Equal(t, tc.want, got)
		})
	}
}

// Every attribute a pod may set has its parser, and a refusal of an
// unknown one names each of them once, and the properties.
func TestEveryAttributeHasItsParser(t *testing.T) {
	listed := strings.Split(knownKeys, ", ")
	require.ElementsMatch(t, append(slices.Collect(maps.Keys(attrParsers)), AttrPropertyPrefix+"<key>"), listed)
	for _, k := range []string{AttrSource, AttrSourceNamespace, AttrCapture, AttrScope, AttrSizeLimit, AttrTTL, AttrCopies,
		AttrReadProfile, AttrOwner, AttrCache, AttrCachePromote, AttrCacheMaxSize, AttrCacheFrom} {
		require.Contains(t, attrParsers, k)
	}
}

func TestValidateCapability(t *testing.T) {
	mount := func(mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
		return &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{MountFlags: flags}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode}}
	}
	tests := []struct {
		name         string
		c            *csi.VolumeCapability
		wantCode     codes.Code
		wantReadOnly bool
	}{
		{"writer", mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER), codes.OK, false},
		{"reader", mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY), codes.OK, true},
		{"nil", nil, codes.InvalidArgument, false},
		{"block", &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}, codes.InvalidArgument, false},
		{"multi-node", mount(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER), codes.InvalidArgument, false},
		{"mount flags (suid)", mount(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, "suid"), codes.InvalidArgument, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ro, err := validateCapability(tc.c)
			require.Equal(t, tc.wantCode, status.Code(err), "err: %v", err)
			require.Equal(t, tc.wantReadOnly, ro)
		})
	}
}

// What pkg/client builds for a scheduler is what this driver accepts: the
// two sides of the attribute contract cannot drift apart.
func TestClientVolumesParse(t *testing.T) {
	res := volume.Ref{Namespace: "ci", Handle: "res"}
	for _, v := range []corev1.Volume{
		client.Input("in", res, "ci"),
		client.Input("shared", volume.Ref{Namespace: "platform", Handle: "tools"}, "ci"),
		client.OutputVolume("out", client.Output{Capture: "out", Source: &res, Shared: true,
			Properties: map[string]string{"k": "v"}, SizeLimit: 1 << 30, TTL: time.Hour, Copies: 3, OwnedByController: true}, "ci"),
		client.TaskCache("cache", &res, "cache-2", "ci"),
	} {
		vc := kubeletContext()
		for k, val := range v.CSI.VolumeAttributes {
			vc[k] = val
		}
		_, err := parseVolumeContext(vc)
		require.NoError(t, err, "volume %s", v.Name)
	}
}
