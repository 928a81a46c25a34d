package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// controllerService is the CSI controller of a plugin run in controller or
// all mode. Inline volumes never reach a CSI controller (the kubelet calls
// the node directly), so it advertises no CSI capability and every volume RPC
// answers Unimplemented, as the spec asks of a controller without them.
type controllerService struct {
	csi.UnimplementedControllerServer
}

func (s *controllerService) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{}, nil
}
