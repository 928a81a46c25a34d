package plugin

import (
	"context"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/restmapper"

	"github.com/concourse/cowvol/pkg/controller/owners"
	"github.com/concourse/cowvol/pkg/volume"
)

// ownersPage is how many objects one request of a listing of owners reads.
const ownersPage = 500

// kubeOwners lists the owners of volumes with the API server's metadata
// API (any kind, names and UIDs only, every namespace in one listing), and
// tells of the volumes of those gone in their namespace's Events.
type kubeOwners struct {
	meta   metadata.Interface
	mapper *restmapper.DeferredDiscoveryRESTMapper
	events *kubeEvents
}

func newKubeOwners(meta metadata.Interface, disc discovery.DiscoveryInterface, events *kubeEvents) *kubeOwners {
	return &kubeOwners{meta: meta, mapper: restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc)), events: events}
}

// mapping is the resource of a kind. A kind discovery does not know is
// looked up afresh once (a CRD installed since).
func (k *kubeOwners) mapping(kind owners.Kind) (*meta.RESTMapping, error) {
	gk := schema.GroupKind{Group: kind.Group, Kind: kind.Kind}
	mapping, err := k.mapper.RESTMapping(gk)
	if meta.IsNoMatchError(err) {
		k.mapper.Reset()
		mapping, err = k.mapper.RESTMapping(gk)
	}
	if err != nil {
		return nil, fmt.Errorf("the resource of kind %s: %w", gk, err)
	}
	return mapping, nil
}

// Live implements owners.Objects. A kind the API server does not serve is
// an error: its volumes are kept.
func (k *kubeOwners) Live(ctx context.Context, kind owners.Kind) (map[string]bool, error) {
	mapping, err := k.mapping(kind)
	if err != nil {
		return nil, err
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

// ownerGoneListed is how many of an owner's volumes its Event names.
const ownerGoneListed = 10

// OwnerGone implements owners.Events: an Event on the owner, in its
// namespace, where `kubectl get events` shows it after the owner is gone.
func (k *kubeOwners) OwnerGone(namespace string, o volume.Owner, destroyed []volume.Ref) {
	apiVersion := o.Group
	if mapping, err := k.mapping(owners.Kind{Group: o.Group, Kind: o.Kind}); err == nil {
		apiVersion = mapping.GroupVersionKind.GroupVersion().String()
	}
	names := make([]string, 0, min(len(destroyed), ownerGoneListed))
	for _, r := range destroyed[:min(len(destroyed), ownerGoneListed)] {
		names = append(names, r.Handle)
	}
	more := ""
	if len(destroyed) > ownerGoneListed {
		more = fmt.Sprintf(" and %d more", len(destroyed)-ownerGoneListed)
	}
	k.events.ObjectEvent(corev1.ObjectReference{Kind: o.Kind, APIVersion: apiVersion, Name: o.Name, Namespace: namespace, UID: types.UID(o.UID)},
		corev1.EventTypeNormal, "CachedVolumesDestroyed", fmt.Sprintf("%s (uid %s) is gone: cowvol destroyed the %d cached volumes it owned on every node: %s%s",
			o, o.UID, len(destroyed), strings.Join(names, ", "), more))
}
