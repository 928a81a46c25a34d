package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/concourse/cowvol/internal/testfs"
	"github.com/concourse/cowvol/pkg/streamer"
)

// genMixedTree writes a tree like a CI volume's: half the files text-like
// (compressible, as sources are), half random (as binaries and archives
// are, each its own), file sizes spread around the mean.
func genMixedTree(b *testing.B, root string, files int, bytes int64) {
	b.Helper()
	mean := bytes / int64(files)
	line := "func main() { fmt.Println(\"cowvol streams volumes\") } // "
	text := []byte(strings.Repeat(line, int(2*mean)/len(line)+1))
	random := make([]byte, 2*mean)
	rng := rand.NewChaCha8([32]byte{7, 11})
	writeTree(b, root, files, bytes, func(i int, size int64) []byte {
		if i%2 == 0 {
			return text[:size]
		}
		_, _ = rng.Read(random[:size]) // each its own: nothing to find across files
		return random[:size]
	})
}

// socketPair is a TCP connection over loopback: what a stream between
// nodes crosses, without the network's own limits.
func socketPair(b *testing.B) (net.Conn, net.Conn) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		accepted <- c
	}()
	client, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	return client, <-accepted
}

// shellStream runs a sender and a receiver pipeline with a loopback
// socket between them, as Concourse streams between workers.
func shellStream(b *testing.B, send, receive string) time.Duration {
	b.Helper()
	out, in := socketPair(b)
	return pipeline(b, out, in, send, receive)
}

// pipeline runs send writing into out and receive reading from in (the two
// ends of one connection), and says how long both took.
func pipeline(b *testing.B, out, in net.Conn, send, receive string) time.Duration {
	b.Helper()
	start := time.Now()
	sender := exec.Command("sh", "-c", send)
	sender.Stdout = out
	receiver := exec.Command("sh", "-c", receive)
	receiver.Stdin = in
	if err := receiver.Start(); err != nil {
		b.Fatal(err)
	}
	if err := sender.Run(); err != nil {
		b.Fatal(err)
	}
	out.Close()
	if err := receiver.Wait(); err != nil {
		b.Fatal(err)
	}
	in.Close()
	return time.Since(start)
}

// BenchmarkStream moves a 50,000-file / 1 GiB volume through cowvol's wire
// format in each encoding over a loopback socket, against Concourse's
// default pipeline (tar | gzip over a socket), a tar | zstd pipe over a
// socket and a local tar | tar pipe, in the same run, on a loop-backed XFS.
func BenchmarkStream(b *testing.B) {
	testfs.Need(b, "tar", "gzip", "zstd")
	for range b.N {
		root := testfs.Mount(b, testfs.XFS, 6<<30)
		src := filepath.Join(root, "src")
		genMixedTree(b, src, treeFiles, treeBytes)
		dst := func(name string) string {
			d := filepath.Join(root, name)
			if err := os.MkdirAll(d, 0o755); err != nil {
				b.Fatal(err)
			}
			b.Cleanup(func() { _ = os.RemoveAll(d) })
			return d
		}
		drop := func(d string) {
			if err := os.RemoveAll(d); err != nil {
				b.Fatal(err)
			}
			exec.Command("sync").Run()
		}
		mbps := func(d time.Duration) float64 { return float64(treeBytes) / d.Seconds() / 1e6 }
		type result struct {
			what string
			took time.Duration
			wire int64
		}
		var results []result

		gz := dst("gzip")
		results = append(results, result{what: "tar | gzip | tar over a socket (Concourse's default)",
			took: shellStream(b, "tar -C "+src+" -cf - . | gzip", "gzip -d | tar -C "+gz+" -xf -")})
		drop(gz)
		zs := dst("zstd-pipe")
		results = append(results, result{what: "tar | zstd | tar over a socket",
			took: shellStream(b, "tar -C "+src+" -cf - . | zstd -q -T1", "zstd -q -d | tar -C "+zs+" -xf -")})
		drop(zs)
		local := dst("local")
		start := time.Now()
		if out, err := exec.Command("sh", "-c", "tar -C "+src+" -cf - . | tar -C "+local+" -xf -").CombinedOutput(); err != nil {
			b.Fatal(err, string(out))
		}
		results = append(results, result{what: "tar -c | tar -x, local pipe", took: time.Since(start)})
		drop(local)

		for _, enc := range []streamer.Encoding{streamer.Raw, streamer.S2, streamer.Zstd, streamer.Gzip} {
			to := dst("cowvol-" + string(enc))
			out, in := socketPair(b)
			counted := &countingWriter{w: out}
			start := time.Now()
			sent := make(chan error, 1)
			go func() {
				_, err := streamer.Pack(context.Background(), src, counted, enc, streamer.SparseTar)
				out.Close()
				sent <- err
			}()
			got, err := streamer.Unpack(context.Background(), in, enc, to, streamer.DefaultLimits)
			if err != nil {
				b.Fatal(err)
			}
			if err := <-sent; err != nil {
				b.Fatal(err)
			}
			took := time.Since(start)
			in.Close()
			if got.Entries < treeFiles {
				b.Fatalf("%s: %d entries arrived", enc, got.Entries)
			}
			results = append(results, result{what: "cowvol " + string(enc) + " over a socket", took: took, wire: counted.n})
			b.ReportMetric(mbps(took), string(enc)+"-MB/s")
			drop(to)
		}

		gzip, zstd, localPipe := results[0].took, results[1].took, results[2].took
		var sb strings.Builder
		fmt.Fprintf(&sb, "\n%-55s %10s %10s %9s  %s\n", "streaming a 50,000-file / 1 GiB volume", "time", "MB/s", "wire MiB", "vs gzip / zstd pipe / local pipe")
		for _, r := range results {
			wire := "-"
			if r.wire > 0 {
				wire = fmt.Sprintf("%d", r.wire>>20)
			}
			fmt.Fprintf(&sb, "%-55s %10s %10.0f %9s  %s / %s / %s\n", r.what, ms(r.took), mbps(r.took), wire,
				ratio(gzip, r.took), ratio(zstd, r.took), ratio(localPipe, r.took))
		}
		fmt.Print(sb.String())
	}
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
