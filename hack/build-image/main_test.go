package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
)

// A binary is taken only for the architecture it is built for, and only
// statically linked: the image has no C library.
func TestCheckBinary(t *testing.T) {
	if _, ok := machines[runtime.GOARCH]; !ok {
		t.Skipf("cowvol's images are for amd64 and arm64, not this machine's %s", runtime.GOARCH)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	require.NoError(t, os.WriteFile(src, []byte("package main\nfunc main() {}\n"), 0o644))
	static := filepath.Join(dir, "static")
	build := exec.Command("go", "build", "-o", static, src)
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)
	other := "arm64"
	if runtime.GOARCH == "arm64" {
		other = "amd64"
	}
	dynamic, err := exec.LookPath("ls")
	require.NoError(t, err)
	tests := []struct {
		name, path, arch, wantErr string
	}{
		{"a static binary for its arch", static, runtime.GOARCH, ""},
		{"another arch's", static, other, "not " + other},
		{"an arch cowvol is not built for", static, "riscv64", "want one of amd64, arm64"},
		{"a dynamic binary", dynamic, runtime.GOARCH, "dynamically linked"},
		{"not a binary", src, runtime.GOARCH, "bad magic"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := checkBinary(tc.path, tc.arch)
			if tc.wantErr == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorContains(t, err, tc.wantErr)
		})
	}
}
