package cache

import (
	"os"
	"syscall"

	"k8s.io/klog/v2"
)

// crashAt names the point at which the process kills itself, read once from
// COWVOL_CRASH_AT. The crash-safety tests use it to stop the real plugin
// binary with SIGKILL exactly between two steps of a publish or capture,
// which a timed kill from outside hits only by luck. Unset, it costs a
// string comparison.
var crashAt = os.Getenv("COWVOL_CRASH_AT")

// CrashPoint kills the process with SIGKILL if COWVOL_CRASH_AT names the
// point: the store and the node engine mark with it the places between
// steps that a crash must never be able to hurt.
func CrashPoint(name string) {
	if crashAt != "" && crashAt == name {
		klog.InfoS("Crashing on purpose", "point", name)
		klog.Flush()
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}
