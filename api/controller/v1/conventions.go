package controllerv1

import "github.com/concourse/cowvol/pkg/volume"

// RefOf is a volume reference as the API says it: nil for none. Every side
// of the API (the controller's answers, a node's reports, a scheduler's
// requests) converts through it, so "none" means one thing on the wire.
func RefOf(r volume.Ref) *VolumeRef {
	if r.IsZero() {
		return nil
	}
	return &VolumeRef{Namespace: r.Namespace, Handle: r.Handle}
}

// RefsOf is RefOf over a list; an empty list is nil.
func RefsOf(refs []volume.Ref) []*VolumeRef {
	if len(refs) == 0 {
		return nil
	}
	out := make([]*VolumeRef, len(refs))
	for i, r := range refs {
		out[i] = RefOf(r)
	}
	return out
}

// ReportKindHeader is the metadata key a node sets to ReportKindFull on a
// report carrying its whole inventory, and ReportNodeHeader to its node
// ID, so that the controller can admit such reports a few at a time, and
// the one it kept room for, before it reads them (a report is read whole
// before any handler runs).
const (
	ReportKindHeader = "cowvol-report-kind"
	ReportKindFull   = "full"
	ReportNodeHeader = "cowvol-report-node"
)
