package fill

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Every event from every state: where it leads, or that it does not take
// effect there.
func TestFillTransitions(t *testing.T) {
	type to struct {
		state fillState
		ok    bool
	}
	refused := func(s fillState) to { return to{s, false} }
	table := map[fillState]map[fillEvent]to{
		stub: {
			claim: {filling, true}, claimAhead: {claimedAhead, true}, reach: {stub, true},
			fillOK: {filled, true}, fillFailed: {failed, true},
		},
		claimedAhead: {
			claim: refused(claimedAhead), claimAhead: refused(claimedAhead), reach: {filling, true},
			fillOK: {filledAhead, true}, fillFailed: {failed, true},
		},
		filling: {
			claim: refused(filling), claimAhead: refused(filling), reach: {filling, true},
			fillOK: {filled, true}, fillFailed: {failed, true},
		},
		filledAhead: {
			claim: refused(filledAhead), claimAhead: refused(filledAhead), reach: {filled, true},
			fillOK: refused(filledAhead), fillFailed: refused(filledAhead),
		},
		filled: {
			claim: refused(filled), claimAhead: refused(filled), reach: {filled, true},
			fillOK: refused(filled), fillFailed: refused(filled),
		},
		failed: {
			claim: refused(failed), claimAhead: refused(failed), reach: {failed, true},
			fillOK: refused(failed), fillFailed: refused(failed),
		},
	}
	require.Len(t, table, len(fillStateNames), "every state")
	for from, events := range table {
		require.Len(t, events, len(fillEventNames), "every event from %s", from)
		for e, want := range events {
			t.Run(from.String()+"/"+e.String(), func(t *testing.T) {
				next, ok := advance(from, e)
				require.Equal(t, want, to{next, ok})
			})
		}
	}
}

// What the states say of a file, for those who ask.
func TestFillStatePredicates(t *testing.T) {
	for s := range fillState(len(fillStateNames)) {
		require.Equal(t, s == filledAhead || s == filled || s == failed, s.ended(), "%s ended", s)
		require.Equal(t, s == filledAhead || s == filled, s.inPlace(), "%s in place", s)
		require.Equal(t, s == claimedAhead || s == filledAhead, s.ahead(), "%s ahead", s)
	}
}

// take claims only a stub, and gives the claimer the fill's channel.
func TestTakeClaimsOnce(t *testing.T) {
	f := &file{}
	require.True(t, take(f, claimAhead))
	require.Equal(t, claimedAhead, f.state)
	require.NotNil(t, f.filling)
	ch := f.filling
	require.False(t, take(f, claim), "one fill at a time")
	require.Equal(t, ch, f.filling, "the running fill's channel stays")
	require.True(t, f.on(reach))
	require.Equal(t, filling, f.state, "a reader's read-ahead file is an ordinary fill")
	require.True(t, f.on(fillOK))
	require.False(t, f.on(fillFailed), "how a fill ended is recorded once")
	require.Equal(t, filled, f.state)
}
