// Command euid prints the effective user ID it runs with. The e2e makes it
// setuid-root in a volume and runs it as a non-root step: busybox cannot
// serve, since it drops setuid privileges itself for most applets.
//
// With -setuid it first asks to become root (setuid(0)), which a file
// capability of cap_setuid allows a non-root user; with -setcap FILE it
// gives FILE that capability instead of printing, as setcap cap_setuid+ep
// would (busybox has no setcap).
package main

import (
	"fmt"
	"os"
	"syscall"
)

// capSetuid is a security.capability xattr: VFS_CAP_REVISION_2 with the
// effective flag, permitting CAP_SETUID (7).
var capSetuid = []byte{0x01, 0, 0, 0x02, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

func main() {
	switch {
	case len(os.Args) == 3 && os.Args[1] == "-setcap":
		if err := syscall.Setxattr(os.Args[2], "security.capability", capSetuid, 0); err != nil {
			fmt.Fprintln(os.Stderr, "setcap:", err)
			os.Exit(1)
		}
		return
	case len(os.Args) == 2 && os.Args[1] == "-setuid":
		_ = syscall.Setuid(0) // refused without the capability: the euid tells
	}
	fmt.Println(os.Geteuid())
}
