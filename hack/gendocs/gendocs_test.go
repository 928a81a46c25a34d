package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPagesAreFresh fails when a flag or a metric changed and the generated
// page was not written again.
func TestPagesAreFresh(t *testing.T) {
	pages, err := render("../..")
	require.NoError(t, err)
	for name, want := range pages {
		got, err := os.ReadFile(filepath.Join("../..", name))
		require.NoError(t, err)
		assert.Equal(t, want, string(got), "%s is stale: run make docs", name)
	}
}

func TestFindMetrics(t *testing.T) {
	tests := []struct {
		name    string
		src     string
		want    []metric
		wantErr bool
	}{
		{name: "vec with const labels", src: `c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "a_total", Help: "A " + "thing.",
			ConstLabels: prometheus.Labels{"k": v}}, []string{"x", "y"})`,
			want: []metric{{name: "a_total", kind: "counter", help: "A thing.", labels: []string{"x", "y", "k"}}}},
		{name: "descriptor takes its collector's value type", src: `m := T{d: prometheus.NewDesc("b", "B.", nil, nil)}
			ch <- prometheus.MustNewConstMetric(m.d, prometheus.CounterValue, 1)`,
			want: []metric{{name: "b", kind: "counter", help: "B."}}},
		{name: "histogram", src: `h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: "c_seconds", Help: "C."})`,
			want: []metric{{name: "c_seconds", kind: "histogram", help: "C."}}},
		{name: "a name that is not a constant", src: `g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: "D."})`, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			src := "package p\nfunc f() {\n" + tt.src + "\n}\n"
			require.NoError(t, os.WriteFile(filepath.Join(dir, "m.go"), []byte(src), 0o644))
			got, err := findMetrics(dir)
			if tt.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			for i := range got {
				assert.Equal(t, "m.go", got[i].file, "the file, for servedBy")
				got[i].pkg, got[i].file = "", ""
			}
			assert.Equal(t, tt.want, got)
		})
	}
}
