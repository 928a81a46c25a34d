package volume

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestOwnerOf(t *testing.T) {
	const uid = "6f1c4d1e-8a55-4c43-9a3e-1d2b3c4d5e6f"
	wf := Owner{Group: "argoproj.io", Kind: "Workflow", Name: "build-x7k2p", UID: uid}
	tests := []struct {
		name   string
		props  map[string]string
		want   Owner
		wantOK bool
	}{
		{name: "a workflow", props: wf.Properties(), want: wf, wantOK: true},
		{name: "the core group", props: Owner{Kind: "ReplicationController", Name: "rc", UID: uid}.Properties(),
			want: Owner{Kind: "ReplicationController", Name: "rc", UID: uid}, wantOK: true},
		{name: "no owner", props: map[string]string{"job": "unit"}},
		{name: "no UID", props: map[string]string{PropertyOwner: "Workflow.argoproj.io/b"}},
		{name: "no name", props: map[string]string{PropertyOwner: "Workflow.argoproj.io", PropertyOwnerUID: uid}},
		{name: "a name with a slash", props: map[string]string{PropertyOwner: "Workflow.argoproj.io/a/b", PropertyOwnerUID: uid}},
		{name: "a bad group", props: map[string]string{PropertyOwner: "Workflow.Argo_Proj/b", PropertyOwnerUID: uid}},
		{name: "a bad UID", props: map[string]string{PropertyOwner: "Workflow.argoproj.io/b", PropertyOwnerUID: "../x"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := OwnerOf(tt.props)
			require.Equal(t, tt.wantOK, ok)
			require.Equal(t, tt.want, got)
		})
	}
	require.Equal(t, "Workflow.argoproj.io/build-x7k2p", wf.String())
}
