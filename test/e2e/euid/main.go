// Command euid prints the effective user ID it runs with. The e2e makes it
// setuid-root in a volume and runs it as a non-root step: busybox cannot
// serve, since it drops setuid privileges itself for most applets.
package main

import (
	"fmt"
	"os"
)

func main() { fmt.Println(os.Geteuid()) }
