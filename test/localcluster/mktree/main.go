// Command mktree writes a tree of files for the e2e's large inputs, far
// faster than a shell loop can: mktree DIR FILES BYTES writes FILES files
// of BYTES bytes each, 500 to a directory, each of bytes drawn from a
// generator seeded with its number (so that no two files are alike and
// the stream's compression gains about what it would on a build's
// outputs: nothing), and bin/hello, a copy of itself that prints "hello"
// when run as hello.
package main

import (
	"bufio"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
)

func main() {
	if filepath.Base(os.Args[0]) == "hello" {
		fmt.Println("hello")
		return
	}
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: mktree DIR FILES BYTES")
		os.Exit(2)
	}
	if err := write(os.Args[1], os.Args[2], os.Args[3]); err != nil {
		fmt.Fprintln(os.Stderr, "mktree:", err)
		os.Exit(1)
	}
}

func write(dir, filesArg, bytesArg string) error {
	files, err := strconv.Atoi(filesArg)
	if err != nil {
		return err
	}
	size, err := strconv.ParseInt(bytesArg, 10, 64)
	if err != nil {
		return err
	}
	for i := range files {
		sub := filepath.Join(dir, "data", fmt.Sprintf("d%03d", i/500))
		if i%500 == 0 {
			if err := os.MkdirAll(sub, 0o755); err != nil {
				return err
			}
		}
		if err := writeFile(filepath.Join(sub, fmt.Sprintf("f%05d", i)), uint64(i), size); err != nil {
			return err
		}
	}
	self, err := os.ReadFile("/proc/self/exe")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Join(dir, "bin"), 0o755); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, "bin", "hello"), self, 0o755)
}

func writeFile(path string, seed uint64, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 64<<10)
	rng := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)})
	if _, err := io.CopyN(w, rng, size); err != nil {
		f.Close()
		return err
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
