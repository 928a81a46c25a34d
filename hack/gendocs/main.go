// Command gendocs writes the reference pages that must never drift from the
// code: docs/options.md from the plugin's flag definitions
// (plugin.Options.AddFlags) and docs/metrics.md from the metrics' definitions
// in pkg/ (their Prometheus options and descriptors, read from the source).
// `make docs` runs it; its test fails when a checked-in page is stale.
//
// It reads the code and writes docs/; it changes nothing else.
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

func main() {
	root := flag.String("root", ".", "the repository's root")
	flag.Parse()
	pages, err := render(*root)
	if err != nil {
		fmt.Fprintln(os.Stderr, "gendocs:", err)
		os.Exit(1)
	}
	for name, text := range pages {
		if err := os.WriteFile(filepath.Join(*root, name), []byte(text), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "gendocs:", err)
			os.Exit(1)
		}
	}
}

// render returns each generated page's text by its path under root.
func render(root string) (map[string]string, error) {
	metrics, err := findMetrics(filepath.Join(root, "pkg"))
	if err != nil {
		return nil, err
	}
	return map[string]string{
		"docs/options.md": optionsPage(),
		"docs/metrics.md": metricsPage(metrics),
	}, nil
}
