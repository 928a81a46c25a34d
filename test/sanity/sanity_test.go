// Package sanity runs csi-sanity (kubernetes-csi/csi-test/v5) against the
// real plugin binary in node mode, the mode the kubelet talks to; its
// subpackages run the controller and all modes.
//
// csi-sanity's targets are <TargetPath>/target, never the kubelet's
// pods/<uid>/volumes/kubernetes.io~csi/<name>/mount layout, so the specs that
// publish with a valid request are refused as InvalidArgument before they
// could mount anything: the ones that run check argument validation, which
// cowvol answers before it looks at the target.
package sanity

import (
	"testing"

	"github.com/concourse/cowvol/internal/sanitytest"
)

func TestSanity(t *testing.T) {
	sanitytest.Run(t, "node", sanitytest.Merge(
		map[string]string{`\[Controller Server\]`: sanitytest.NoController},
		sanitytest.NodeSpecsNeedingCreateVolume))
}
