// Command build-image builds cowvol's plugin image (ociimage.Plugin)
// without a Docker daemon (make image), as an OCI image layout tar that
// `ctr images import` or `skopeo copy --all oci-archive:...` takes: one
// image, or with binaries for several architectures one multi-platform
// image. The same inputs give the same digests.
package main

import (
	"debug/elf"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"

	"github.com/concourse/cowvol/internal/ociimage"
)

func main() {
	binaries := flag.String("binary", "bin/cowvol-plugin",
		"the static plugin binary, or ARCH=PATH,... one per architecture (GOARCH names)")
	name := flag.String("name", "cowvol-plugin:dev", "the image reference")
	version := flag.String("version", "dev", "the version the image is labelled with")
	ca := flag.String("ca-certificates", "/etc/ssl/certs/ca-certificates.crt", "the CA bundle to carry")
	out := flag.String("out", "bin/cowvol-plugin-image.tar", "the OCI layout tar to write")
	flag.Parse()
	if err := run(*binaries, *ca, *name, *version, *out); err != nil {
		fmt.Fprintln(os.Stderr, "build-image:", err)
		os.Exit(1)
	}
}

func run(binaries, ca, name, version, out string) error {
	certs, err := os.ReadFile(ca)
	if err != nil {
		return fmt.Errorf("%w (install ca-certificates)", err)
	}
	var images []ociimage.Image
	var archs []string
	for _, b := range strings.Split(binaries, ",") {
		arch, path, ok := strings.Cut(b, "=")
		if !ok {
			arch, path = runtime.GOARCH, b
		}
		bin, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if err := checkBinary(path, arch); err != nil {
			return err
		}
		img := ociimage.Plugin(name, version, bin, certs)
		img.Arch = arch
		images = append(images, img)
		archs = append(archs, arch)
	}
	if err := ociimage.Write(out, images...); err != nil {
		return err
	}
	fmt.Printf("wrote %s (%s, linux/%s)\n", out, name, strings.Join(archs, ", linux/"))
	return nil
}

// machines are the ELF machines of the architectures cowvol is built for.
var machines = map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}

// checkBinary refuses a binary that would not run in the image on arch:
// one for another machine, or a dynamically linked one (the image has no
// C library).
func checkBinary(path, arch string) error {
	want, ok := machines[arch]
	if !ok {
		return fmt.Errorf("%s: architecture %q: want one of amd64, arm64", path, arch)
	}
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	if f.Machine != want {
		return fmt.Errorf("%s is built for %s, not %s", path, f.Machine, arch)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is dynamically linked: build it with CGO_ENABLED=0", path)
		}
	}
	return nil
}
