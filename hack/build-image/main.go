// Command build-image builds cowvol's plugin image (ociimage.Plugin)
// without a Docker daemon (make image), as an OCI image layout tar that
// `ctr images import` or `skopeo copy oci-archive:...` takes. The same
// inputs give the same digests.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/concourse/cowvol/internal/ociimage"
)

func main() {
	binary := flag.String("binary", "bin/cowvol-plugin", "the static plugin binary")
	name := flag.String("name", "cowvol-plugin:dev", "the image reference")
	version := flag.String("version", "dev", "the version the image is labelled with")
	ca := flag.String("ca-certificates", "/etc/ssl/certs/ca-certificates.crt", "the CA bundle to carry")
	out := flag.String("out", "bin/cowvol-plugin-image.tar", "the OCI layout tar to write")
	flag.Parse()
	if err := run(*binary, *ca, *name, *version, *out); err != nil {
		fmt.Fprintln(os.Stderr, "build-image:", err)
		os.Exit(1)
	}
}

func run(binary, ca, name, version, out string) error {
	bin, err := os.ReadFile(binary)
	if err != nil {
		return err
	}
	certs, err := os.ReadFile(ca)
	if err != nil {
		return fmt.Errorf("%w (install ca-certificates)", err)
	}
	img := ociimage.Plugin(name, version, bin, certs)
	if err := ociimage.Write(out, img); err != nil {
		return err
	}
	fmt.Printf("wrote %s (%s)\n", out, name)
	return nil
}
