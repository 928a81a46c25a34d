package driver

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type identityService struct {
	csi.UnimplementedIdentityServer
	name, version string
	controller    bool
}

func (s *identityService) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.name, VendorVersion: s.version}, nil
}

func (s *identityService) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	service := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	// Volumes live on one node: say so, so that topology-aware callers
	// place steps where their inputs are.
	caps := []*csi.PluginCapability{service(csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS)}
	if s.controller {
		caps = append(caps, service(csi.PluginCapability_Service_CONTROLLER_SERVICE))
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe answers ready: New returns only after recovery, and no RPC is served
// before that.
func (s *identityService) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
