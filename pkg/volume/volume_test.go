package volume

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestRefs(t *testing.T) {
	r, err := ParseRef("ci/res-7f3a")
	require.NoError(t, err)
	require.Equal(t, Ref{Namespace: "ci", Handle: "res-7f3a"}, r)
	require.Equal(t, "ci/res-7f3a", r.String())
	for _, bad := range []string{"res", "ci/", "/res", "CI/res", "ci/../x", "ci/.hidden", "ci/a/b"} {
		_, err := ParseRef(bad)
		require.Error(t, err, bad)
	}
}

func TestPodValidate(t *testing.T) {
	good := Pod{Namespace: "ci", Name: "build-42.step", UID: "0b4a8c1e-3f2d-4c5b-9a6e-7d8f9a0b1c2d"}
	require.NoError(t, good.Validate())
	for name, p := range map[string]Pod{
		"newline in name":   {Namespace: "ci", Name: "a\nb", UID: good.UID},
		"escape in name":    {Namespace: "ci", Name: "a\x1b[31m", UID: good.UID},
		"long name":         {Namespace: "ci", Name: strings.Repeat("a", 254), UID: good.UID},
		"upper namespace":   {Namespace: "CI", Name: "a", UID: good.UID},
		"long namespace":    {Namespace: strings.Repeat("a", 64), Name: "a", UID: good.UID},
		"path in UID":       {Namespace: "ci", Name: "a", UID: "../x"},
		"empty":             {},
		"uppercase hex UID": {Namespace: "ci", Name: "a", UID: strings.ToUpper(good.UID)},
	} {
		require.Error(t, p.Validate(), name)
	}
	require.Equal(t, `"a\nb"`, Quote("a\nb"))
	require.Contains(t, Quote(strings.Repeat("x", 1000)), "(1000 bytes)")
}

// The hand-written checks accept exactly what the grammars say (as
// regexps), over random strings of the characters that matter and every
// length around the bounds.
func TestHandAndNamespaceCheckersMatchTheirGrammars(t *testing.T) {
	handle := regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)
	label := regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	common, rare := []byte("az09-"), []byte("Z._/ \n\x00\xc3\xa9")
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200_000 {
		b := make([]byte, rng.IntN(132))
		for i := range b {
			if rng.IntN(50) == 0 {
				b[i] = rare[rng.IntN(len(rare))]
			} else {
				b[i] = common[rng.IntN(len(common))]
			}
		}
		s := string(b)
		require.Equal(t, handle.MatchString(s), isHandle(s), "handle %q", s)
		require.Equal(t, label.MatchString(s), isDNS1123Label(s), "label %q", s)
	}
	for n := range 131 {
		s := strings.Repeat("a", n)
		require.Equal(t, handle.MatchString(s), isHandle(s), "handle of %d", n)
		require.Equal(t, label.MatchString(s), isDNS1123Label(s), "label of %d", n)
	}
}
