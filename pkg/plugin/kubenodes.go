package plugin

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/controller/fleet"
)

// followNodes keeps the controller's view in step with the cluster's Node
// objects until ctx ends: a cordoned Node is landing (no placements, no
// captures), and a deleted one is forgotten at once.
func followNodes(ctx context.Context, kube kubernetes.Interface, view *fleet.View) error {
	factory := informers.NewSharedInformerFactory(kube, 10*time.Minute)
	informer := factory.Core().V1().Nodes().Informer()
	follow := func(obj any) {
		if n, ok := obj.(*corev1.Node); ok {
			view.SetCordoned(n.Name, n.Spec.Unschedulable)
		}
	}
	_, err := informer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    follow,
		UpdateFunc: func(_, obj any) { follow(obj) },
		DeleteFunc: func(obj any) {
			if gone, ok := obj.(toolscache.DeletedFinalStateUnknown); ok {
				obj = gone.Obj
			}
			if n, ok := obj.(*corev1.Node); ok {
				klog.InfoS("The Node was deleted: forgetting it", "node", n.Name)
				view.ForgetNode(n.Name)
			}
		},
	})
	if err != nil {
		return err
	}
	factory.Start(ctx.Done())
	return nil
}

// awaitNodes has the view wait, for up to awaitFor, for a whole
// inventory from every node the plugin is registered on (its CSINode names
// the driver): the view of a controller that begins to lead, or restarts,
// has none of their volumes until they report. If the nodes cannot be
// listed, nothing is waited for.
func awaitNodes(ctx context.Context, kube kubernetes.Interface, view *fleet.View, driverName string, awaitFor time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	csiNodes, err := kube.StorageV1().CSINodes().List(ctx, metav1.ListOptions{})
	if err != nil {
		klog.ErrorS(err, "Listing the nodes cowvol runs on, to wait for their reports: answering with what reaches the view")
		return
	}
	var nodes []string
	for _, n := range csiNodes.Items {
		for _, d := range n.Spec.Drivers {
			if d.Name == driverName {
				nodes = append(nodes, n.Name)
			}
		}
	}
	view.AwaitReports(nodes, time.Now().Add(awaitFor))
	klog.InfoS("Waiting for the nodes' inventories before answering schedulers", "nodes", len(nodes), "atMost", awaitFor)
}
