// Package sanitytest runs csi-sanity (kubernetes-csi/csi-test/v5) against
// the real plugin binary in one mode, with the specs cowvol cannot run
// skipped, each for a written reason. Ginkgo runs its specs once per
// process, so each mode is its own test package under test/sanity/. It is test
// support only and never imported by the plugin.
package sanitytest

import (
	"path/filepath"
	"testing"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/gomega"

	"github.com/concourse/cowvol/internal/plugintest"
	"github.com/concourse/cowvol/internal/testfs"
)

// Reasons shared by the modes.
const (
	// NoController: the node plugin serves no CSI controller; inline
	// volumes never reach one.
	NoController = "node mode serves no CSI controller: inline volumes never reach one"
	// NoNode: the controller serves no CSI node.
	NoNode = "controller mode serves no CSI node: the kubelet talks to the node plugins"
	// NeedsCreateVolume: cowvol's volumes are inline; NodePublishVolume
	// alone makes them, and nothing creates one through a controller.
	// What such specs check is covered on inline volumes by cowvol's own
	// tests (test/contract_test.go, test/controller_test.go).
	NeedsCreateVolume = "needs CreateVolume, which inline volumes do not have (covered by cowvol's own tests)"
)

// NodeSpecsNeedingCreateVolume are the node specs that make their volume
// with CreateVolume first.
var NodeSpecsNeedingCreateVolume = map[string]string{
	"should remove target path":                                    NeedsCreateVolume,
	"should fail when volume does not exist on the specified path": NeedsCreateVolume,
	// The node's whole lifecycle, which csi-sanity runs only where a
	// controller is served, starts with CreateVolume.
	"Node Service should work":          NeedsCreateVolume,
	"Node Service should be idempotent": NeedsCreateVolume,
}

// ControllerSpecsNeedingCreateVolume are the controller specs that make
// their volume with CreateVolume first, though cowvol does not advertise it.
var ControllerSpecsNeedingCreateVolume = map[string]string{
	"ListVolumes check the presence of new volumes":                                   NeedsCreateVolume,
	"ValidateVolumeCapabilities should fail when no volume capabilities are provided": NeedsCreateVolume,
	"ValidateVolumeCapabilities should return appropriate values":                     NeedsCreateVolume,
}

// Run starts the plugin in mode and runs csi-sanity against it.
func Run(t *testing.T, mode string, skipped map[string]string) {
	testfs.Need(t)
	dir := t.TempDir()
	p := plugintest.Start(t, plugintest.Config{StateDir: t.TempDir(), Backend: "auto", Mode: mode, KubeletDir: dir})
	cfg := sanity.NewTestConfig()
	cfg.Address = "unix://" + p.Sock
	cfg.TargetPath = filepath.Join(dir, "target")
	cfg.StagingPath = filepath.Join(dir, "staging")
	cfg.IdempotentCount = 3
	sc := sanity.GinkgoTest(&cfg)
	gomega.RegisterFailHandler(ginkgo.Fail)
	suite, reporter := ginkgo.GinkgoConfiguration()
	for spec, reason := range skipped {
		t.Logf("skipping sanity spec %q: %s", spec, reason)
		suite.SkipStrings = append(suite.SkipStrings, spec)
	}
	ginkgo.RunSpecs(t, "cowvol csi-sanity, "+mode+" mode", suite, reporter)
	sc.Finalize()
}

// Merge joins skip lists.
func Merge(lists ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, l := range lists {
		for k, v := range l {
			out[k] = v
		}
	}
	return out
}
