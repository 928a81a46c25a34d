package node

import "github.com/concourse/cowvol/pkg/volume"

// PodEvents tells people what became of volumes where they look first
// (Kubernetes Events): a step pod's people about its captures, which happen
// at teardown where no error reaches anyone else, and the node's operators
// about its cache filling up.
type PodEvents interface {
	Event(pod volume.Pod, eventType, reason, message string)
	NodeEvent(eventType, reason, message string)
}

// NoEvents is the sink where nobody is told.
type NoEvents struct{}

// Event implements PodEvents.
func (NoEvents) Event(volume.Pod, string, string, string) {}

// NodeEvent implements PodEvents.
func (NoEvents) NodeEvent(string, string, string) {}

// Event types, as Kubernetes spells them.
const (
	EventNormal  = "Normal"
	EventWarning = "Warning"
)
