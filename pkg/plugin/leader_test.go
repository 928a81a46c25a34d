package plugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
)

// TestLeadershipRefuses: a follower refuses every call; a leader whose view
// still awaits nodes' inventories refuses the Cache API's calls but
// ListNodes, and serves the Registry (through which the inventories come).
func TestLeadershipRefuses(t *testing.T) {
	settling := func() []string { return []string{"node-2", "node-3"} }
	settled := func() []string { return nil }
	tests := []struct {
		name      string
		leading   bool
		unsettled func() []string
		method    string
		wantCode  codes.Code
	}{
		{name: "follower", method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "follower, registry", method: controllerv1.Registry_Report_FullMethodName, wantCode: codes.Unavailable},
		{name: "leader", leading: true, method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.OK},
		{name: "leader without a view to wait for", leading: true, unsettled: nil, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.OK},
		{name: "settling leader, lookup", leading: true, unsettled: settling, method: controllerv1.Cache_LookupVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, destroy", leading: true, unsettled: settling, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, place", leading: true, unsettled: settling, method: controllerv1.Cache_Place_FullMethodName, wantCode: codes.Unavailable},
		{name: "settling leader, list nodes", leading: true, unsettled: settling, method: controllerv1.Cache_ListNodes_FullMethodName, wantCode: codes.OK},
		{name: "settling leader, a node's report", leading: true, unsettled: settling, method: controllerv1.Registry_Report_FullMethodName, wantCode: codes.OK},
		{name: "settled leader", leading: true, unsettled: settled, method: controllerv1.Cache_DestroyVolumes_FullMethodName, wantCode: codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			l := &leadership{self: "controller-0", unsettled: tt.unsettled}
			l.leading.Store(tt.leading)
			err := l.refuse(tt.method)
			assert.Equal(t, tt.wantCode, status.Code(err))
			if tt.unsettled != nil && err != nil {
				assert.Contains(t, err.Error(), "2 node(s) (node-2, node-3)")
			}
		})
	}
}
