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
	"sort"
	"strings"

	"github.com/concourse/cowvol/internal/ociimage"
)

func main() {
	binaries := flag.String("binary", "bin/cowvol-plugin",
		"the static plugin binary, or ARCH=PATH,... one per architecture (GOARCH names)")
	providers := flag.String("credential-provider", "bin/cowvol-credential-provider",
		"the static cowvol-credential-provider binary, or ARCH=PATH,... one per architecture, as -binary")
	name := flag.String("name", "cowvol-plugin:dev", "the image reference")
	version := flag.String("version", "dev", "the version the image is labelled with")
	ca := flag.String("ca-certificates", "/etc/ssl/certs/ca-certificates.crt", "the CA bundle to carry")
	out := flag.String("out", "bin/cowvol-plugin-image.tar", "the OCI layout tar to write")
	flag.Parse()
	if err := run(*binaries, *providers, *ca, *name, *version, *out); err != nil {
		fmt.Fprintln(os.Stderr, "build-image:", err)
		os.Exit(1)
	}
}

func run(binaries, providers, ca, name, version, out string) error {
	certs, err := os.ReadFile(ca)
	if err != nil {
		return fmt.Errorf("%w (install ca-certificates)", err)
	}
	plugins, err := byArch(binaries)
	if err != nil {
		return err
	}
	credentialProviders, err := byArch(providers)
	if err != nil {
		return err
	}
	var images []ociimage.Image
	var archs []string
	for _, arch := range sortedKeys(plugins) {
		provider, ok := credentialProviders[arch]
		if !ok {
			return fmt.Errorf("no -credential-provider for %s", arch)
		}
		img := ociimage.Plugin(name, version, plugins[arch], provider, certs)
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

// byArch reads ARCH=PATH,... (or one PATH, for this machine's
// architecture) into the checked binaries by architecture.
func byArch(list string) (map[string][]byte, error) {
	bins := map[string][]byte{}
	for _, b := range strings.Split(list, ",") {
		arch, path, ok := strings.Cut(b, "=")
		if !ok {
			arch, path = runtime.GOARCH, b
		}
		if err := checkBinary(path, arch); err != nil {
			return nil, err
		}
		bin, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		bins[arch] = bin
	}
	return bins, nil
}

func sortedKeys(m map[string][]byte) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
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
