package plugin

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

// kubePods answers the node engine's questions about step pods from the API
// server: a watch of this node's pods answers most from memory, and a pod
// it has not seen yet (or not in the state asked about) is read directly.
type kubePods struct {
	client kubernetes.Interface
	lister corelisters.PodLister
	// settleWait and settlePoll bound how long a capture waits for its
	// pod's status to say how the step ended: the kubelet posts it
	// asynchronously, around the time it tears volumes down.
	settleWait, settlePoll time.Duration
}

// watchPods starts following the pods bound to node until ctx ends.
func watchPods(ctx context.Context, client kubernetes.Interface, node string) *kubePods {
	factory := informers.NewSharedInformerFactoryWithOptions(client, 10*time.Minute,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
		}))
	lister := factory.Core().V1().Pods().Lister()
	factory.Start(ctx.Done())
	return &kubePods{client: client, lister: lister, settleWait: 5 * time.Second, settlePoll: 250 * time.Millisecond}
}

// get reads the pod, from the watch if it has the very pod (by UID), else
// from the API server when fresh is set or the watch lacks it. A pod of
// another UID under the same name is another pod: not found.
func (k *kubePods) get(ctx context.Context, pod volume.Pod, fresh bool) (*corev1.Pod, error) {
	if !fresh {
		if p, err := k.lister.Pods(pod.Namespace).Get(pod.Name); err == nil && p.UID == types.UID(pod.UID) {
			return p, nil
		}
	}
	p, err := k.client.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	if p.UID != types.UID(pod.UID) {
		return nil, apierrors.NewNotFound(corev1.Resource("pods"), pod.Name)
	}
	return p, nil
}

// UserNamespace implements node.Pods.
func (k *kubePods) UserNamespace(ctx context.Context, pod volume.Pod) (bool, error) {
	p, err := k.get(ctx, pod, false)
	if err != nil {
		return false, fmt.Errorf("reading pod %s (uid %s): %w", klog.KRef(pod.Namespace, pod.Name), pod.UID, err)
	}
	return p.Spec.HostUsers != nil && !*p.Spec.HostUsers, nil
}

// Controller implements node.Pods.
func (k *kubePods) Controller(ctx context.Context, pod volume.Pod) (volume.Owner, bool, error) {
	p, err := k.get(ctx, pod, false)
	if err != nil {
		return volume.Owner{}, false, fmt.Errorf("reading pod %s (uid %s): %w", klog.KRef(pod.Namespace, pod.Name), pod.UID, err)
	}
	return controllerOf(p)
}

// controllerOf is the object that controls a pod, as an Owner, if one does.
func controllerOf(p *corev1.Pod) (volume.Owner, bool, error) {
	ref := metav1.GetControllerOf(p)
	if ref == nil {
		return volume.Owner{}, false, nil
	}
	gv, err := schema.ParseGroupVersion(ref.APIVersion)
	if err != nil {
		return volume.Owner{}, false, fmt.Errorf("pod %s: its controller's apiVersion: %w", klog.KObj(p), err)
	}
	o := volume.Owner{Group: gv.Group, Kind: ref.Kind, Name: ref.Name, UID: string(ref.UID)}
	if err := o.Validate(); err != nil {
		return volume.Owner{}, false, fmt.Errorf("pod %s: its controller: %w", klog.KObj(p), err)
	}
	return o, true, nil
}

// StepResult implements node.Pods: it waits (up to settleWait) for the
// pod's status to settle.
func (k *kubePods) StepResult(ctx context.Context, pod volume.Pod) (volume.StepResult, bool) {
	deadline := time.Now().Add(k.settleWait)
	fresh := false
	for {
		p, err := k.get(ctx, pod, fresh)
		if err != nil {
			klog.V(2).InfoS("Cannot tell how a step ended: reading its pod failed", "pod", klog.KRef(pod.Namespace, pod.Name), "err", err)
			return "", false
		}
		if result, settled := stepResult(p); settled {
			return result, true
		}
		if time.Now().After(deadline) {
			return "", false
		}
		select {
		case <-ctx.Done():
			return "", false
		case <-time.After(k.settlePoll):
		}
		fresh = true
	}
}

// stepResult says how a pod's containers ended, and whether its status has
// settled enough to tell: a pod still running, or one whose containers the
// status shows waiting while it is neither finished nor being deleted
// (its status lags the kubelet), has not.
func stepResult(p *corev1.Pod) (volume.StepResult, bool) {
	finished := p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed
	if !finished && p.DeletionTimestamp == nil {
		return "", false
	}
	statuses := append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...)
	ran, failed, missing := false, false, false
	for _, cs := range statuses {
		t := cs.State.Terminated
		if t == nil && cs.State.Running == nil {
			t = cs.LastTerminationState.Terminated // waiting to restart: how it last ended
		}
		switch {
		case cs.State.Running != nil:
			return "", false // the kubelet has not posted its end yet
		case t == nil, t.Reason == "StartError", t.Reason == "ContainerCannotRun", t.StartedAt.IsZero():
			missing = true // it never ran, or the runtime could not start it
		default:
			ran = true
			failed = failed || t.ExitCode != 0
		}
	}
	switch {
	case failed, ran && missing:
		return volume.StepFailed, true
	case !ran:
		return volume.StepNotStarted, true
	}
	return volume.StepSucceeded, true
}
