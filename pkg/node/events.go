package node

import "github.com/concourse/cowvol/pkg/volume"

// PodEvents tells a step pod's people what became of its volumes where they
// look first (Kubernetes Events: kubectl describe pod). Captures happen at
// teardown, where no error reaches anyone else.
type PodEvents interface {
	Event(pod volume.Pod, eventType, reason, message string)
}

// NoEvents is the sink where nobody is told.
type NoEvents struct{}

// Event implements PodEvents.
func (NoEvents) Event(volume.Pod, string, string, string) {}

// Event types, as Kubernetes spells them.
const (
	EventNormal  = "Normal"
	EventWarning = "Warning"
)
