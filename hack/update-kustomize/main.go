// Command update-kustomize writes the kustomize base (deploy/csi/base) from
// the Helm chart (deploy/helm/cowvol): the chart is cowvol's one install
// source, and the base is `helm template` of it with its defaults, one file
// per template, plus the Namespace a Helm install makes with
// --create-namespace. `make manifests` runs it; the e2e's TestManifests
// fails when the checked-in base is not what it writes.
//
// It writes the base dir and nothing else; the kustomize components and
// overlays are patches over the base, kept by hand.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// header starts every file it writes.
const header = "# Generated from deploy/helm/cowvol with its defaults by `make manifests`\n" +
	"# (hack/update-kustomize); do not edit: change the chart.\n"

func main() {
	helm := flag.String("helm", "helm", "the helm binary")
	chart := flag.String("chart", "deploy/helm/cowvol", "the chart")
	out := flag.String("out", "deploy/csi/base", "the base dir to write")
	flag.Parse()
	rendered, err := exec.Command(*helm, "template", "cowvol", *chart, "--namespace", "cowvol").Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			err = fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		fail(err)
	}
	files, err := split(rendered)
	if err != nil {
		fail(err)
	}
	if err := write(*out, files); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "update-kustomize:", err)
	os.Exit(1)
}

// file is one template's objects as helm rendered them.
type file struct {
	name string
	docs []string
}

// split groups helm template's output by the template each object came
// from (its "# Source: chart/templates/x.yaml" line), in the order the
// templates first appear.
func split(rendered []byte) ([]file, error) {
	var files []file
	index := map[string]int{}
	for _, doc := range strings.Split(string(rendered), "\n---\n") {
		doc = strings.TrimPrefix(strings.TrimSpace(doc), "---\n")
		if doc == "" {
			continue
		}
		first, rest, _ := strings.Cut(doc, "\n")
		src, ok := strings.CutPrefix(first, "# Source: ")
		if !ok {
			return nil, fmt.Errorf("an object without a # Source line: %.60q", doc)
		}
		name := filepath.Base(src)
		i, seen := index[name]
		if !seen {
			i = len(files)
			index[name] = i
			files = append(files, file{name: name})
		}
		files[i].docs = append(files[i].docs, rest+"\n")
	}
	return files, nil
}

// write replaces the base in dir with files, a Namespace and the
// kustomization that lists them.
func write(dir string, files []file) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	old, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	for _, f := range old {
		if err := os.Remove(f); err != nil {
			return err
		}
	}
	resources := []string{"namespace.yaml"}
	put := func(name, body string) error {
		return os.WriteFile(filepath.Join(dir, name), []byte(header+body), 0o644)
	}
	if err := put("namespace.yaml", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: cowvol\n"); err != nil {
		return err
	}
	for _, f := range files {
		var b bytes.Buffer
		for i, d := range f.docs {
			if i > 0 {
				b.WriteString("---\n")
			}
			b.WriteString(d)
		}
		if err := put(f.name, b.String()); err != nil {
			return err
		}
		resources = append(resources, f.name)
	}
	k := "# cowvol's base (deploy/csi/kustomization.yaml applies it as is). Overlays\n" +
		"# (deploy/csi/overlays/) set what differs per cluster; components\n" +
		"# (deploy/csi/components/) are choices an overlay includes.\n" +
		"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n"
	for _, r := range resources {
		k += "  - " + r + "\n"
	}
	return put("kustomization.yaml", k)
}
