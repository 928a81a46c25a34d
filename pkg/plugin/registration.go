package plugin

import (
	"context"
	"sync"

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

	mu sync.Mutex
	// registered says the kubelet took the registration; refusal is
	// what it said when it did not.
	registered bool
	refusal    string
}

// supportedCSIVersions are the CSI spec versions the node service speaks.
var supportedCSIVersions = []string{"1.0.0"}

func (s *registrationService) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type: registerapi.CSIPlugin, Name: s.name, Endpoint: s.endpoint, SupportedVersions: supportedCSIVersions,
	}, nil
}

func (s *registrationService) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	s.mu.Lock()
	s.registered, s.refusal = st.PluginRegistered, st.Error
	s.mu.Unlock()
	if st.PluginRegistered {
		klog.InfoS("Registered with the kubelet", "driver", s.name, "endpoint", s.endpoint)
	} else {
		klog.ErrorS(nil, "The kubelet refused the registration", "driver", s.name, "error", st.Error)
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// notReady says why the plugin is not ready yet: until the kubelet has
// taken the registration, no pod on the node can mount a cowvol volume,
// and a rolling update must not move on to the next node.
func (s *registrationService) notReady() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.registered:
		return ""
	case s.refusal != "":
		return "the kubelet refused the registration: " + s.refusal
	}
	return "not registered with the kubelet yet"
}
