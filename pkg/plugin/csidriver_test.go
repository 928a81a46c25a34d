package plugin

import (
	"testing"

	"github.com/stretchr/testify/require"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/concourse/cowvol/pkg/driver"
)

func TestCheckCSIDriver(t *testing.T) {
	yes, no := true, false
	csiDriver := func(podInfo *bool, modes ...storagev1.VolumeLifecycleMode) *storagev1.CSIDriver {
		return &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: driver.DefaultDriverName},
			Spec: storagev1.CSIDriverSpec{PodInfoOnMount: podInfo, VolumeLifecycleModes: modes}}
	}
	tests := []struct {
		name, want string
		d          *storagev1.CSIDriver
	}{
		{"right", "", csiDriver(&yes, storagev1.VolumeLifecycleEphemeral)},
		{"missing", "does not exist", nil},
		{"podInfoOnMount unset", "podInfoOnMount", csiDriver(nil, storagev1.VolumeLifecycleEphemeral)},
		{"podInfoOnMount false", "podInfoOnMount", csiDriver(&no, storagev1.VolumeLifecycleEphemeral)},
		{"persistent", "volumeLifecycleModes", csiDriver(&yes, storagev1.VolumeLifecyclePersistent)},
		{"both modes", "volumeLifecycleModes", csiDriver(&yes, storagev1.VolumeLifecycleEphemeral, storagev1.VolumeLifecyclePersistent)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := checkCSIDriver(tc.d)
			if tc.want == "" {
				require.Empty(t, got)
			} else {
				require.Contains(t, got, tc.want)
			}
		})
	}
}
