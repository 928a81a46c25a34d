package driver

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/controller"
)

// followNodes keeps the controller's view in step with the cluster's Node
// objects until ctx ends: a cordoned Node is landing (no placements, no
// captures), and a deleted one is forgotten at once.
func followNodes(ctx context.Context, kube kubernetes.Interface, view *controller.View) error {
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
