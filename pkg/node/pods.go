package node

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"time"

	"k8s.io/klog/v2"

	"github.com/concourse/cowvol/pkg/volume"
)

// Pods is what the engine asks the cluster about a step's pod. Without an
// API server it is nil: every pod is taken to share the host's users, and
// no capture says how its step ended.
type Pods interface {
	// UserNamespace says whether the pod runs in a user namespace of its
	// own (spec.hostUsers: false), whose runtime idmaps every volume
	// mount.
	UserNamespace(ctx context.Context, pod volume.Pod) (bool, error)
	// StepResult says how the pod's containers ended; false when that
	// cannot be told (the pod is gone, or its status never settled).
	StepResult(ctx context.Context, pod volume.Pod) (volume.StepResult, bool)
	// Controller is the object that controls the pod (its owner reference
	// with controller: true), false if none does.
	Controller(ctx context.Context, pod volume.Pod) (volume.Owner, bool, error)
}

// ErrPodUnknown: the API server could not say what the engine needs to
// know of a step's pod (retryable).
var ErrPodUnknown = errors.New("the pod could not be read from the API server")

// ErrNoOwner: a volume asked to belong to its pod's controller, and the pod
// has none (or there is no API server to ask).
var ErrNoOwner = errors.New("the pod has no controller to own the captured volume")

// podTimeout bounds a question to the API server on a publish's path.
const podTimeout = 10 * time.Second

// userNamespace says whether a step's pod runs in a user namespace of its
// own, where that changes its view: an empty volume is a plain bind on
// every backend, so only a view of a source asks (and an API server that
// cannot answer never holds up an output volume).
func (e *Engine) userNamespace(r PublishRequest) (bool, error) {
	if e.pods == nil || r.Source.IsZero() {
		return false, nil
	}
	pod := r.Pod
	ctx, cancel := context.WithTimeout(e.bgCtx, podTimeout)
	defer cancel()
	userns, err := e.pods.UserNamespace(ctx, pod)
	if err != nil {
		return false, fmt.Errorf("pod %s: %w: %w", klog.KRef(pod.Namespace, pod.Name), ErrPodUnknown, err)
	}
	return userns, nil
}

// ownerProperties are a publish's properties with, for a volume owned by
// its pod's controller, those recording that owner.
func (e *Engine) ownerProperties(r PublishRequest) (map[string]string, error) {
	if !r.OwnedByController {
		return r.Properties, nil
	}
	if e.pods == nil {
		return nil, fmt.Errorf("owner: controller needs the plugin to reach the API server: %w", ErrNoOwner)
	}
	ctx, cancel := context.WithTimeout(e.bgCtx, podTimeout)
	defer cancel()
	owner, ok, err := e.pods.Controller(ctx, r.Pod)
	switch {
	case err != nil:
		return nil, fmt.Errorf("pod %s: %w: %w", klog.KRef(r.Pod.Namespace, r.Pod.Name), ErrPodUnknown, err)
	case !ok:
		return nil, fmt.Errorf("pod %s asks with owner: controller: %w (no ownerReference with controller: true)",
			klog.KRef(r.Pod.Namespace, r.Pod.Name), ErrNoOwner)
	}
	props := maps.Clone(r.Properties)
	if props == nil {
		props = map[string]string{}
	}
	maps.Copy(props, owner.Properties())
	return props, nil
}

// stepResult is the property saying how a capture's step ended, if that
// can be told.
func (e *Engine) stepResult(pod volume.Pod) map[string]string {
	if e.pods == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(e.bgCtx, podTimeout)
	defer cancel()
	result, ok := e.pods.StepResult(ctx, pod)
	if !ok {
		klog.InfoS("Capturing without saying how the step ended: its pod's status did not tell", "pod", klog.KRef(pod.Namespace, pod.Name))
		return nil
	}
	return map[string]string{volume.PropertyStepResult: string(result)}
}
