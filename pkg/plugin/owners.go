package plugin

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/restmapper"

	"github.com/concourse/cowvol/pkg/controller/owners"
)

// ownersPage is how many objects one request of a listing of owners reads.
const ownersPage = 500

// kubeOwners lists the owners of volumes with the API server's metadata
// API: any kind, names and UIDs only, every namespace in one listing.
type kubeOwners struct {
	meta   metadata.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
}

func newKubeOwners(meta metadata.Interface, disc discovery.DiscoveryInterface) *kubeOwners {
	return &kubeOwners{meta: meta, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))}
}

// Live implements owners.Objects. A kind discovery does not know is looked
// up afresh once (a CRD installed since), and then is an error: its
// volumes are kept.
func (k *kubeOwners) Live(ctx context.Context, kind owners.Kind) (map[string]bool, error) {
	gk := schema.GroupKind{Group: kind.Group, Kind: kind.Kind}
	mapping, err := k.mapper.RESTMapping(gk)
	if meta.IsNoMatchError(err) {
		k.mapper.Reset()
		mapping, err = k.mapper.RESTMapping(gk)
	}
	if err != nil {
		return nil, fmt.Errorf("the resource of kind %s: %w", gk, err)
	}
	live := map[string]bool{}
	opts := metav1.ListOptions{Limit: ownersPage}
	for {
		list, err := k.meta.Resource(mapping.Resource).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("listing %s: %w", mapping.Resource.GroupResource(), err)
		}
		for _, o := range list.Items {
			live[string(o.UID)] = true
		}
		if list.Continue == "" {
			return live, nil
		}
		opts.Continue = list.Continue
	}
}
