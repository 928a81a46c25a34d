package plugin

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// csiDriverGuard keeps watch on the cluster's CSIDriver object for this
// driver. The pod identity in a publish is the kubelet's word only when that
// object says podInfoOnMount: true: otherwise the kubelet passes the pod
// author's own attributes through, forged namespace included. While the
// object is missing or wrong, publishes are refused.
type csiDriverGuard struct {
	name string
	last atomic.Pointer[string] // "" while the object is right
}

// csiDriverCheckTimeout bounds the start-up check: an API server that
// cannot be reached in this time leaves the plugin unable to serve safely.
const csiDriverCheckTimeout = 30 * time.Second

// checkCSIDriver says what is wrong with a CSIDriver object for cowvol, or
// "" if nothing is.
func checkCSIDriver(d *storagev1.CSIDriver) string {
	if d == nil {
		return "the CSIDriver object does not exist: apply deploy/csi/base/csidriver.yaml (or the whole install: kubectl apply -k deploy/csi/)"
	}
	if d.Spec.PodInfoOnMount == nil || !*d.Spec.PodInfoOnMount {
		return fmt.Sprintf("CSIDriver %s lacks podInfoOnMount: true, so the kubelet does not vouch for the pod's namespace", d.Name)
	}
	if !slices.Equal(d.Spec.VolumeLifecycleModes, []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecycleEphemeral}) {
		return fmt.Sprintf("CSIDriver %s must have volumeLifecycleModes: [Ephemeral] (has %v): cowvol serves inline volumes only",
			d.Name, d.Spec.VolumeLifecycleModes)
	}
	return ""
}

// watchCSIDriver checks the CSIDriver object at start-up, refusing to serve
// if it is missing or wrong, and then follows its changes until ctx ends.
func watchCSIDriver(ctx context.Context, kube kubernetes.Interface, name string) (*csiDriverGuard, error) {
	g := &csiDriverGuard{name: name}
	var problem string
	err := wait.PollUntilContextTimeout(ctx, time.Second, csiDriverCheckTimeout, true, func(ctx context.Context) (bool, error) {
		d, err := kube.StorageV1().CSIDrivers().Get(ctx, name, metav1.GetOptions{})
		switch {
		case apierrors.IsNotFound(err):
			problem = checkCSIDriver(nil)
			return true, nil
		case err != nil:
			problem = fmt.Sprintf("reading CSIDriver %s: %v", name, err)
			klog.InfoS("Cannot read the CSIDriver object yet; retrying", "csidriver", name, "err", err)
			return false, nil
		}
		problem = checkCSIDriver(d)
		return true, nil
	})
	if err != nil || problem != "" {
		return nil, fmt.Errorf("refusing to serve: %s", problem)
	}
	g.set("")
	klog.InfoS("The CSIDriver object makes the kubelet vouch for pods", "csidriver", name)
	lw := toolscache.NewListWatchFromClient(kube.StorageV1().RESTClient(), "csidrivers", "",
		fields.OneTermEqualSelector("metadata.name", name))
	informer := toolscache.NewSharedIndexInformer(lw, &storagev1.CSIDriver{}, 10*time.Minute, toolscache.Indexers{})
	_, err = informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { g.set(checkCSIDriver(obj.(*storagev1.CSIDriver))) },
		UpdateFunc: func(_, obj any) { g.set(checkCSIDriver(obj.(*storagev1.CSIDriver))) },
		DeleteFunc: func(any) { g.set(checkCSIDriver(nil)) },
	})
	if err != nil {
		return nil, err
	}
	go informer.Run(ctx.Done())
	return g, nil
}

func (g *csiDriverGuard) set(problem string) {
	if old := g.last.Swap(&problem); old == nil || *old != problem {
		if problem != "" {
			klog.ErrorS(nil, "Refusing publishes until the CSIDriver object is fixed", "csidriver", g.name, "problem", problem)
		} else if old != nil {
			klog.InfoS("The CSIDriver object is right again: serving publishes", "csidriver", g.name)
		}
	}
}

// problem says why publishes are refused now ("" when they are not). A node
// without an API server has no guard: the operator vouches for the
// CSIDriver object.
func (g *csiDriverGuard) Refusal() string {
	if g == nil {
		return ""
	}
	if p := g.last.Load(); p != nil {
		return *p
	}
	return ""
}
