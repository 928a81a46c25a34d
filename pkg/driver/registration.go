package driver

import (
	"context"

	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// registrationService is the kubelet's plugin-registration API: the kubelet's
// plugin watcher finds its socket under plugins_registry, asks GetInfo, and
// from then on calls the CSI endpoint it was told. It lets cowvol register
// itself where the node-driver-registrar sidecar cannot be run.
type registrationService struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
}

// supportedCSIVersions are the CSI spec versions the node service speaks.
var supportedCSIVersions = []string{"1.0.0"}

func (s *registrationService) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type: registerapi.CSIPlugin, Name: s.name, Endpoint: s.endpoint, SupportedVersions: supportedCSIVersions,
	}, nil
}

func (s *registrationService) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.PluginRegistered {
		klog.InfoS("Registered with the kubelet", "driver", s.name, "endpoint", s.endpoint)
	} else {
		klog.ErrorS(nil, "The kubelet refused the registration", "driver", s.name, "error", st.Error)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
