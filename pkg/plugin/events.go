package plugin

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

// kubeEvents sends events from a queue, off the RPC path: a slow or absent
// API server must never hold up a capture. A full queue drops events.
type kubeEvents struct {
	client kubernetes.Interface
	driver string
	node   string
	queue  chan *corev1.Event
}

const eventQueue = 256

// KubeClient connects to the API server through kubeconfig, or in-cluster
// when it is empty and the plugin runs in a pod; otherwise it returns nil:
// no API server is configured.
func KubeClient(kubeconfig string) (Kube, error) {
	var cfg *rest.Config
	var err error
	switch {
	case kubeconfig != "":
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	case os.Getenv("KUBERNETES_SERVICE_HOST") != "":
		cfg, err = rest.InClusterConfig()
	default:
		return Kube{}, nil
	}
	if err != nil {
		return Kube{}, fmt.Errorf("configuring the API client: %w", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return Kube{}, err
	}
	meta, err := metadata.NewForConfig(cfg)
	if err != nil {
		return Kube{}, err
	}
	return Kube{Client: client, Metadata: meta}, nil
}

// Kube are the clients of the API server (none: no API server).
type Kube struct {
	Client kubernetes.Interface
	// Metadata reads any kind's names and UIDs (owners of volumes).
	Metadata metadata.Interface
}

func newKubeEvents(client kubernetes.Interface, driver, node string) *kubeEvents {
	return &kubeEvents{client: client, driver: driver, node: node, queue: make(chan *corev1.Event, eventQueue)}
}

// Event implements node.PodEvents.
func (k *kubeEvents) Event(pod volume.Pod, eventType, reason, message string) {
	now := metav1.NewTime(time.Now())
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{GenerateName: pod.Name + ".", Namespace: pod.Namespace},
		InvolvedObject: corev1.ObjectReference{
			Kind: "Pod", APIVersion: "v1", Name: pod.Name, Namespace: pod.Namespace, UID: types.UID(pod.UID),
		},
		Type: eventType, Reason: reason, Message: message,
		Source:         corev1.EventSource{Component: "cowvol", Host: k.node},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: k.driver, ReportingInstance: k.node,
	}
	k.enqueue(ev)
}

// NodeEvent implements node.PodEvents: an event on this node's Node object,
// where an operator watching the node looks.
func (k *kubeEvents) NodeEvent(eventType, reason, message string) {
	k.NodeEventOn(k.node, eventType, reason, message)
}

// noNodeEvents is the controller's sink when no API server is configured.
type noNodeEvents struct{}

func (noNodeEvents) NodeEventOn(string, string, string, string) {}

// NodeEventOn implements controller.NodeEvents: an event on a Node object
// (its UID is its name, as the kubelet records node events).
func (k *kubeEvents) NodeEventOn(node, eventType, reason, message string) {
	k.ObjectEvent(corev1.ObjectReference{Kind: "Node", APIVersion: "v1", Name: node, UID: types.UID(node)}, eventType, reason, message)
}

// ObjectEvent is an event on any object, in its namespace (a cluster-scoped
// one's in default, as the kubelet files node events).
func (k *kubeEvents) ObjectEvent(obj corev1.ObjectReference, eventType, reason, message string) {
	now := metav1.NewTime(time.Now())
	ns := cmp.Or(obj.Namespace, metav1.NamespaceDefault)
	ev := &corev1.Event{
		ObjectMeta:     metav1.ObjectMeta{GenerateName: obj.Name + ".", Namespace: ns},
		InvolvedObject: obj,
		Type:           eventType, Reason: reason, Message: message,
		Source:         corev1.EventSource{Component: "cowvol", Host: k.node},
		FirstTimestamp: now, LastTimestamp: now, Count: 1,
		ReportingController: k.driver, ReportingInstance: k.node,
	}
	k.enqueue(ev)
}

func (k *kubeEvents) enqueue(ev *corev1.Event) {
	select {
	case k.queue <- ev:
	default:
		klog.InfoS("Dropping a Kubernetes Event: the queue is full", "object", klog.KRef(ev.InvolvedObject.Namespace, ev.InvolvedObject.Name), "reason", ev.Reason)
	}
}

// run sends queued events until ctx is done.
func (k *kubeEvents) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case ev := <-k.queue:
			sendCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := k.client.CoreV1().Events(ev.Namespace).Create(sendCtx, ev, metav1.CreateOptions{})
			cancel()
			if err != nil {
				klog.ErrorS(err, "Posting a Kubernetes Event", "pod", klog.KRef(ev.Namespace, ev.InvolvedObject.Name), "reason", ev.Reason)
			}
		}
	}
}
