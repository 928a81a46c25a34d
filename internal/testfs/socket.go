package testfs

import (
	"os"
	"strings"
)

// soAcceptCon is the flag /proc/net/unix shows on a socket that listens.
const soAcceptCon = "00010000"

// Listening says whether a unix socket in this network namespace listens
// at path. The socket's file appears when it is bound, a moment before it
// listens, and a connect between the two is refused: a test waits for
// this, not for the file.
func Listening(path string) bool {
	table, err := os.ReadFile("/proc/net/unix")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(table), "\n") {
		// Num RefCount Protocol Flags Type St Inode Path
		if fields := strings.Fields(line); len(fields) == 8 && fields[7] == path && fields[3] == soAcceptCon {
			return true
		}
	}
	return false
}
