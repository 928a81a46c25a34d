// Package driver is cowvol's CSI adapter: the CSI Identity, Node and
// Controller services and the node API, the validation of every request
// and the mapping of every failure to its gRPC code. Each service hands the
// call to what does the work (the node engine, the controller's view) and
// holds nothing of its own. It never touches a volume itself, and knows
// nothing of how a process is put together: pkg/plugin composes the
// services a mode asks for.
package driver

import (
	"github.com/container-storage-interface/spec/lib/go/csi"

	nodev1 "github.com/concourse/cowvol/api/node/v1"
	"github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/node"
	"github.com/concourse/cowvol/pkg/volume"
)

// DefaultDriverName is the CSI driver name pods refer to.
const DefaultDriverName = volume.DriverName

// TopologyKey is the topology segment NodeGetInfo reports.
const TopologyKey = "topology.cowvol.concourse-ci.org/node"

// PublishGate says why publishes must be refused now ("" when they may go
// on): the CSIDriver object is not as cowvol needs it, say.
type PublishGate interface {
	Refusal() string
}

// NewIdentity is the CSI Identity service of a plugin named name; with
// controller it advertises the controller service.
func NewIdentity(name, version string, controller bool) csi.IdentityServer {
	return &identityService{name: name, version: version, controller: controller}
}

// NewNode is the CSI Node service of node nodeID over engine; gate may
// refuse publishes.
func NewNode(nodeID string, engine *node.Engine, gate PublishGate) csi.NodeServer {
	return &nodeService{nodeID: nodeID, engine: engine, gate: gate}
}

// NewController is the CSI Controller service over the controller's view.
func NewController(view *fleet.View) csi.ControllerServer {
	return &controllerService{view: view}
}

// NewNodeAPI is the node API (api/node/v1) over engine.
func NewNodeAPI(engine *node.Engine) nodev1.NodeAPIServer {
	return &nodeAPIService{engine: engine}
}
