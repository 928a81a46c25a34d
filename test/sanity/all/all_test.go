// Package all runs csi-sanity against the real plugin in all mode: node and
// controller in one process.
package all

import (
	"testing"

	"github.com/concourse/cowvol/internal/sanitytest"
)

func TestSanityAllMode(t *testing.T) {
	sanitytest.Run(t, "all", sanitytest.Merge(
		sanitytest.NodeSpecsNeedingCreateVolume,
		sanitytest.ControllerSpecsNeedingCreateVolume))
}
