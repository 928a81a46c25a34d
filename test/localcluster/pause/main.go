// Command pause is the local cluster's pod sandbox binary: it holds a pod's
// namespaces open until it is told to stop, as registry.k8s.io/pause does.
// It is built statically and packed into a local image, since no registry
// is reachable from the test machine.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
