// Command scheduler runs one CI build through cowvol, as package scheduler
// does: steps from a JSON file (a list of {name, inputs, output, script,
// node, caches}), placed by the controller's Cache API and run as pods by
// the Kubernetes API. It prints each step's node, attempts and output.
//
//	scheduler --kubeconfig ~/.kube/config --controller cowvol.example:7070 --ca-file ca.crt \
//	  --token-file token --namespace ci --image golang:1.26 --build b42 --steps go-build.json
//
// go-build.json, beside this file's package, is a Go build whose module and
// build caches are cowvol caches (docs/caches.md).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/concourse/cowvol/examples/scheduler"
	"github.com/concourse/cowvol/pkg/client"
)

func main() {
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig for the Kubernetes API")
	controller := flag.String("controller", "", "the cowvol controller's host:port")
	caFile := flag.String("ca-file", "", "the controller's CA (empty: plaintext, loopback only)")
	tokenFile := flag.String("token-file", "", "the token to present to the controller")
	namespace := flag.String("namespace", "default", "the namespace the steps run in")
	image := flag.String("image", "", "the image the steps run")
	serviceAccount := flag.String("service-account", "", "the ServiceAccount the steps run as")
	build := flag.String("build", "", "the build's name (its pods' prefix)")
	stepsFile := flag.String("steps", "", "the JSON file of the build's steps")
	attempts := flag.Int("attempts", 3, "runs of a step before the build fails, each on another node")
	timeout := flag.Duration("timeout", 10*time.Minute, "how long one attempt may run")
	flag.Parse()
	if *controller == "" || *image == "" || *build == "" || *stepsFile == "" {
		log.Fatal("--controller, --image, --build and --steps are required")
	}
	raw, err := os.ReadFile(*stepsFile)
	if err != nil {
		log.Fatal(err)
	}
	var steps []scheduler.Step
	if err := json.Unmarshal(raw, &steps); err != nil {
		log.Fatalf("%s: %v", *stepsFile, err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		log.Fatal(err)
	}
	kube, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		log.Fatal(err)
	}
	cache, err := client.Dial(client.Options{Address: *controller, CAFile: *caFile, TokenFile: *tokenFile})
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	r := &scheduler.Runner{Kube: kube, Cache: cache, Namespace: *namespace, Image: *image, ServiceAccount: *serviceAccount,
		Attempts: *attempts, Timeout: *timeout, Logf: log.Printf}
	results, err := r.Run(ctx, *build, steps)
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if eerr := enc.Encode(results); eerr != nil {
		log.Fatal(eerr)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
