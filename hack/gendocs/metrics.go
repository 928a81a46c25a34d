package main

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// metric is one Prometheus metric as its definition in the code says.
type metric struct {
	name, kind, help, pkg, file string
	labels                      []string
}

// constructors maps prometheus's metric constructors to the kind they make.
var constructors = map[string]string{
	"NewCounter": "counter", "NewCounterVec": "counter",
	"NewGauge": "gauge", "NewGaugeVec": "gauge", "NewGaugeFunc": "gauge", "NewCounterFunc": "counter",
	"NewHistogram": "histogram", "NewHistogramVec": "histogram",
	"NewSummary": "summary", "NewSummaryVec": "summary",
}

// valueKinds maps the value types of const metrics to their kind.
var valueKinds = map[string]string{"GaugeValue": "gauge", "CounterValue": "counter", "UntypedValue": "untyped"}

// findMetrics reads every non-test Go file under dir and returns the metrics
// defined there, by name. A definition it cannot read (a name or help that is
// not a constant string) is an error, not a silent gap in the page.
func findMetrics(dir string) ([]metric, error) {
	var found []metric
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return err
		}
		ms, err := metricsInFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, filepath.Dir(path))
		for i := range ms {
			ms[i].pkg, ms[i].file = filepath.ToSlash(rel), filepath.ToSlash(filepath.Join(rel, d.Name()))
		}
		found = append(found, ms...)
		return nil
	})
	sort.Slice(found, func(i, j int) bool { return found[i].name < found[j].name })
	return found, err
}

func metricsInFile(path string) ([]metric, error) {
	f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
	if err != nil {
		return nil, err
	}
	// The kind of a descriptor-based metric is the value type its
	// collector sends it with: MustNewConstMetric(c.field, prometheus.GaugeValue, ...).
	descKinds := map[string]string{}
	ast.Inspect(f, func(n ast.Node) bool {
		if call, ok := n.(*ast.CallExpr); ok && isPrometheus(call.Fun, "MustNewConstMetric") && len(call.Args) > 1 {
			if sel, ok := call.Args[0].(*ast.SelectorExpr); ok {
				if v, ok := call.Args[1].(*ast.SelectorExpr); ok {
					descKinds[sel.Sel.Name] = valueKinds[v.Sel.Name]
				}
			}
		}
		return true
	})
	var ms []metric
	var bad error
	ast.Inspect(f, func(n ast.Node) bool {
		if bad != nil {
			return false
		}
		switch n := n.(type) {
		case *ast.KeyValueExpr: // field: prometheus.NewDesc(name, help, labels, constLabels)
			call, ok := n.Value.(*ast.CallExpr)
			if !ok || !isPrometheus(call.Fun, "NewDesc") || len(call.Args) < 3 {
				return true
			}
			m := metric{kind: "gauge"}
			if k, ok := n.Key.(*ast.Ident); ok && descKinds[k.Name] != "" {
				m.kind = descKinds[k.Name]
			}
			if m.name, bad = stringOf(call.Args[0]); bad == nil {
				m.help, bad = stringOf(call.Args[1])
			}
			m.labels = stringsOf(call.Args[2])
			if len(call.Args) > 3 {
				m.labels = append(m.labels, labelKeys(call.Args[3])...)
			}
			ms = append(ms, m)
			return false
		case *ast.CallExpr:
			kind := ""
			for name, k := range constructors {
				if isPrometheus(n.Fun, name) {
					kind = k
				}
			}
			if kind == "" || len(n.Args) == 0 {
				return true
			}
			opts, ok := n.Args[0].(*ast.CompositeLit)
			if !ok {
				return true
			}
			m := metric{kind: kind}
			for _, el := range opts.Elts {
				kv, ok := el.(*ast.KeyValueExpr)
				if !ok {
					continue
				}
				switch kv.Key.(*ast.Ident).Name {
				case "Name":
					m.name, bad = stringOf(kv.Value)
				case "Help":
					m.help, bad = stringOf(kv.Value)
				case "ConstLabels":
					m.labels = append(m.labels, labelKeys(kv.Value)...)
				}
			}
			if len(n.Args) > 1 {
				m.labels = append(stringsOf(n.Args[1]), m.labels...)
			}
			if m.name == "" && bad == nil {
				bad = fmt.Errorf("%s: a %s without a constant Name", path, kind)
			}
			ms = append(ms, m)
		}
		return true
	})
	return ms, bad
}

func isPrometheus(fun ast.Expr, name string) bool {
	sel, ok := fun.(*ast.SelectorExpr)
	if !ok || sel.Sel.Name != name {
		return false
	}
	pkg, ok := sel.X.(*ast.Ident)
	return ok && pkg.Name == "prometheus"
}

// stringOf evaluates a string literal or a sum of them.
func stringOf(e ast.Expr) (string, error) {
	switch e := e.(type) {
	case *ast.BasicLit:
		if e.Kind == token.STRING {
			return strconv.Unquote(e.Value)
		}
	case *ast.BinaryExpr:
		if e.Op == token.ADD {
			l, err := stringOf(e.X)
			if err != nil {
				return "", err
			}
			r, err := stringOf(e.Y)
			return l + r, err
		}
	}
	return "", fmt.Errorf("a metric's name or help at %T is not a constant string", e)
}

// stringsOf reads []string{"a", "b"}; anything else (nil) is no labels.
func stringsOf(e ast.Expr) []string {
	lit, ok := e.(*ast.CompositeLit)
	if !ok {
		return nil
	}
	var out []string
	for _, el := range lit.Elts {
		if s, err := stringOf(el); err == nil {
			out = append(out, s)
		}
	}
	return out
}

// labelKeys reads the keys of prometheus.Labels{"k": v}.
func labelKeys(e ast.Expr) []string {
	lit, ok := e.(*ast.CompositeLit)
	if !ok {
		return nil
	}
	var out []string
	for _, el := range lit.Elts {
		if kv, ok := el.(*ast.KeyValueExpr); ok {
			if s, err := stringOf(kv.Key); err == nil {
				out = append(out, s)
			}
		}
	}
	return out
}

// servedBy says which process serves a package's (or a file's) metrics.
var servedBy = map[string]string{
	"plugin":             "every mode",
	"plugin/peerlink.go": "node plugin (a certificate of its own)",
	"report":             "node plugin (with a controller)",
	"node":               "node plugin",
	"streamer":           "node plugin (peers)",
	"pull":               "node plugin (pulls)",
	"registry":           "node plugin (image registry)",
	"controller":         "controller",
	"controller/fleet":   "controller",
}

func metricsPage(ms []metric) string {
	var b strings.Builder
	b.WriteString(generatedBy)
	b.WriteString("# Metrics\n\n")
	b.WriteString("Every cowvol process serves Prometheus metrics on `--metrics-address` (`/metrics`), beside Go's\n")
	b.WriteString("runtime and process metrics (`go_*`, `process_*`) and the probes `/healthz` and `/readyz`\n")
	b.WriteString("(see [operations.md](operations.md)). The Helm chart's ServiceMonitor scrapes them, and its\n")
	b.WriteString("PrometheusRule alerts on them.\n\n")
	b.WriteString("| metric | type | labels | served by | what it counts |\n|---|---|---|---|---|\n")
	for _, m := range ms {
		who := servedBy[m.file]
		if who == "" {
			who = servedBy[m.pkg]
		}
		if who == "" {
			who = m.pkg
		}
		labels := ""
		if len(m.labels) > 0 {
			labels = "`" + strings.Join(m.labels, "`, `") + "`"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", m.name, m.kind, labels, who, cell(m.help))
	}
	return b.String()
}
