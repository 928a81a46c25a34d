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

// ReportNodeHeader is the metadata key a node sets to its node ID on a
// report in parts (SendReport), so that the controller can admit the
// report, a few at a time, before it reads any part.
const ReportNodeHeader = "cowvol-report-node"

// What the controller reads of one call, so that no caller, authenticated
// or not, can make it hold more than a bounded amount: every message is at
// most MaxMessage bytes (a lookup of 1,000 volumes, a read order and an
// upload's chunk are far smaller); a report larger than ReportPartSize goes
// in parts through SendReport, at most MaxReport bytes in all, naming at
// most MaxReportVolumes volumes and MaxReportProperties properties (a
// node's 10,000 volumes are about 2 MiB).
const (
	MaxMessage          = 4 << 20
	ReportPartSize      = 1 << 20
	MaxReport           = 32 << 20
	MaxReportVolumes    = 200_000
	MaxReportProperties = 4 * MaxReportVolumes
)
