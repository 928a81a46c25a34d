package snapshotter

import (
	"context"
	"encoding/json"
	"fmt"

	introspection "github.com/containerd/containerd/api/services/introspection/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	cri "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// Name is the snapshotter's name in containerd's config, and the runtime
// handler (and RuntimeClass) whose snapshotter it is.
const Name = "cowvol"

// Check asks the containerd at address whether it runs step images on
// the snapshotter served at socket: a proxy snapshotter plugin named
// cowvol at that socket, and a CRI runtime handler cowvol whose
// snapshotter it is. It returns what is missing, each said so that an
// operator can fix it (nothing: all is there), or an error if containerd
// could not be asked.
func Check(ctx context.Context, address, socket string) ([]string, error) {
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	var missing []string
	plugins, err := introspection.NewIntrospectionClient(conn).Plugins(ctx, &introspection.PluginsRequest{
		Filters: []string{`type=="io.containerd.snapshotter.v1",id=="` + Name + `"`}})
	if err != nil {
		return nil, fmt.Errorf("asking containerd at %s for its snapshotters: %w", address, err)
	}
	switch {
	case len(plugins.Plugins) == 0:
		missing = append(missing, fmt.Sprintf("containerd has no snapshotter %q: add [proxy_plugins.%s] type = \"snapshot\", address = %q to its config",
			Name, Name, socket))
	case plugins.Plugins[0].Exports["address"] != socket:
		missing = append(missing, fmt.Sprintf("containerd's snapshotter %q is at %q, not at %q where this plugin serves it",
			Name, plugins.Plugins[0].Exports["address"], socket))
	}
	status, err := cri.NewRuntimeServiceClient(conn).Status(ctx, &cri.StatusRequest{Verbose: true})
	if err != nil {
		return nil, fmt.Errorf("asking containerd's CRI at %s for its config: %w", address, err)
	}
	var config struct {
		Containerd struct {
			Runtimes map[string]struct {
				Snapshotter string `json:"snapshotter"`
			} `json:"runtimes"`
		} `json:"containerd"`
	}
	if err := json.Unmarshal([]byte(status.Info["config"]), &config); err != nil {
		return nil, fmt.Errorf("containerd's CRI config: %w", err)
	}
	if rt, ok := config.Containerd.Runtimes[Name]; !ok || rt.Snapshotter != Name {
		missing = append(missing, fmt.Sprintf("containerd's CRI has no runtime handler %q whose snapshotter is %q: add "+
			"[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%s] with snapshotter = %q", Name, Name, Name, Name))
	}
	return missing, nil
}

// ContainerdConfig is what a node adds to containerd's config (version 3)
// for the snapshotter served at socket, on platform (linux/amd64): the
// proxy plugin, the transfer service unpacking into it as well as into
// overlayfs (listing unpack_config replaces the defaults), and the CRI
// runtime handler whose snapshotter it is.
func ContainerdConfig(socket, platform string) string {
	return fmt.Sprintf(`[proxy_plugins.%[1]s]
  type = "snapshot"
  address = %[2]q
[plugins.'io.containerd.transfer.v1.local']
  [[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
    platform = %[3]q
    snapshotter = "overlayfs"
    differ = "walking"
  [[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
    platform = %[3]q
    snapshotter = %[1]q
    differ = "walking"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.%[1]s]
  runtime_type = "io.containerd.runc.v2"
  snapshotter = %[1]q
`, Name, socket, platform)
}
