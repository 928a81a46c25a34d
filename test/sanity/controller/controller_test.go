// Package controller runs csi-sanity against the real plugin in controller
// mode.
package controller

import (
	"testing"

	"github.com/concourse/cowvol/internal/sanitytest"
)

func TestSanityControllerMode(t *testing.T) {
	sanitytest.Run(t, "controller", sanitytest.Merge(
		map[string]string{"Node Service": sanitytest.NoNode},
		sanitytest.ControllerSpecsNeedingCreateVolume))
}
