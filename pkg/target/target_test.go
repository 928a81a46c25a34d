package target

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParse(t *testing.T) {
	l := Layout{KubeletDir: "/var/lib/kubelet"}
	const uid = "0b4a8c1e-3f2d-4c5b-9a6e-7d8f9a0b1c2d"
	good := "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/repo/mount"
	tests := []struct {
		name, path, wantErr string
	}{
		{"kubelet layout", good, ""},
		{"static pod UID", "/var/lib/kubelet/pods/0123456789abcdef0123456789abcdef/volumes/kubernetes.io~csi/repo/mount", ""},
		{"outside the kubelet dir", "/etc/cron.d/mount", "not the kubelet's"},
		{"another plugin's dir", strings.Replace(good, "kubernetes.io~csi", "kubernetes.io~empty-dir", 1), "not the kubelet's"},
		{"not the mount dir", strings.TrimSuffix(good, "/mount") + "/vol_data.json", "not the kubelet's"},
		{"deeper", good + "/x", "not the kubelet's"},
		{"dot-dot", "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/../../../../etc/mount", "not the kubelet's"},
		{"bad UID", "/var/lib/kubelet/pods/..x/volumes/kubernetes.io~csi/repo/mount", "UID"},
		{"bad volume name", "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/Repo_1/mount", "volume name"},
		{"kubelet dir prefix only", "/var/lib/kubelet2/pods/" + uid + "/volumes/kubernetes.io~csi/repo/mount", "not the kubelet's"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := l.Parse(tc.path)
			if tc.wantErr != "" {
				require.ErrorContains(t, err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.path, p.Full)
			require.Equal(t, "repo", p.VolumeName)
		})
	}
}
