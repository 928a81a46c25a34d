package bench

import (
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	controllerv1 "github.com/concourse/cowvol/api/controller/v1"
	"github.com/concourse/cowvol/pkg/volume"
)

// fleet is a simulated fleet's caches: a pool of volumes, each encoded
// once as a node reports it, and the pool's volumes each node holds. A
// node's whole inventory is made when sent by copying its volumes'
// encodings: a million decoded summaries kept here, or made anew for every
// report, would make this process's allocator and collector the thing
// measured (they share the machine's two cores with the controller).
type fleet struct {
	name    string
	refs    []*controllerv1.VolumeRef
	encoded [][]byte
	holds   [][]int32
}

func (f *fleet) nodes() int { return len(f.holds) }

func (f *fleet) copies() (n int) {
	for _, h := range f.holds {
		n += len(h)
	}
	return n
}

func (f *fleet) add(namespace, handle string, size int64, version int) {
	f.addAsking(namespace, handle, size, version, 0)
}

// addAsking adds a volume that asked to be kept on copies nodes.
func (f *fleet) addAsking(namespace, handle string, size int64, version int, copies int32) {
	s := &controllerv1.VolumeSummary{
		Ref: &controllerv1.VolumeRef{Namespace: namespace, Handle: handle}, State: "ready", SizeBytes: size, Scope: "namespace", Copies: copies,
		Properties: []*controllerv1.Property{{Key: "resource", Value: "repo"}, {Key: "version", Value: strconv.Itoa(version)}},
	}
	raw, err := proto.Marshal(s)
	if err != nil {
		panic(err)
	}
	f.refs = append(f.refs, s.Ref)
	f.encoded = append(f.encoded, raw)
}

// ownAndShared is the fleet BenchmarkControllerFleet measured first:
// every node holds the same perNode/10 volumes (a resource cache everyone
// holds) and perNode×9/10 of its own.
func ownAndShared(nodes, perNode int) *fleet {
	f := &fleet{name: fmt.Sprintf("%d nodes × %d volumes, a tenth on every node", nodes, perNode), holds: make([][]int32, nodes)}
	shared := perNode / 10
	for i := range shared {
		f.add(fmt.Sprintf("team-%d", i%20), fmt.Sprintf("shared-v%05d", i), 1<<20+int64(i), i)
	}
	for n := range nodes {
		h := make([]int32, 0, perNode)
		for i := range shared {
			h = append(h, int32(i))
		}
		for i := shared; i < perNode; i++ {
			h = append(h, int32(len(f.refs)))
			f.add(fmt.Sprintf("team-%d", i%20), fmt.Sprintf("n%04d-v%05d", n, i), 1<<20+int64(n*i), i)
		}
		f.holds[n] = h
	}
	return f
}

// zipfFleet is issue 39's fleet: each node holds about perNode volumes of
// a pool, the volume of popularity rank k on a node with probability
// min(1, c/(k+1)) (Zipf's law, c chosen so a node holds perNode on
// average). The few hundred most popular are on every node; the least on
// one or two.
func zipfFleet(nodes, perNode, pool int) *fleet {
	f := &fleet{name: fmt.Sprintf("%d nodes × about %d volumes of a %d-volume pool, Zipf popularity", nodes, perNode, pool),
		holds: make([][]int32, nodes)}
	for k := range pool {
		f.add(fmt.Sprintf("team-%d", k%20), fmt.Sprintf("v%07d", k), 1<<20+int64(k), k)
	}
	expected := func(c float64) (sum float64) {
		for k := range pool {
			sum += math.Min(1, c/float64(k+1))
		}
		return sum
	}
	lo, hi := 0.0, float64(perNode)
	for range 60 {
		if mid := (lo + hi) / 2; expected(mid) < float64(perNode) {
			lo = mid
		} else {
			hi = mid
		}
	}
	c := hi
	everywhere := min(pool, int(c)) // p ≥ 1 below it
	for n := range nodes {
		r := rand.New(rand.NewPCG(uint64(n), 39))
		h := make([]int32, 0, perNode+perNode/10)
		for k := range everywhere {
			h = append(h, int32(k))
		}
		// The rest by thinning, block by doubling block, as a coin per
		// volume would choose (5,000 nodes × 2.5 million coins is too
		// many): within [from, 2·from) no volume's chance passes q, the
		// first's; jumps between candidates are geometric at q, and each
		// is kept at its own chance over q.
		for from := everywhere; from < pool; from = max(2*from, 1) {
			to, q := min(max(2*from, 1), pool), c/float64(from+1)
			for k := from; ; k++ {
				k += int(math.Floor(math.Log(1-r.Float64()) / math.Log1p(-q)))
				if k >= to {
					break
				}
				if r.Float64()*q < c/float64(k+1) {
					h = append(h, int32(k))
				}
			}
		}
		f.holds[n] = h
	}
	return f
}

// withCopiesThatFitNowhere adds k volumes that asked for the most copies
// and are bigger than any node's room (4 TiB; the nodes have at most 1),
// spread over the nodes: each lacks copies for good, which the controller
// must not pay for on every report.
func (f *fleet) withCopiesThatFitNowhere(k int) *fleet {
	for i := range k {
		n := i % f.nodes()
		f.holds[n] = append(f.holds[n], int32(len(f.refs)))
		f.addAsking(fmt.Sprintf("team-%d", i%20), fmt.Sprintf("wide-%05d", i), 4<<40, i, volume.MaxCopies)
	}
	f.name += fmt.Sprintf(", %d asking for %d copies that fit on no node", k, volume.MaxCopies)
	return f
}

// report is node n's ReportRequest, encoded: its header fields, then
// (full) each of its volumes as an upsert.
func (f *fleet) report(n int, full bool) []byte {
	req := &controllerv1.ReportRequest{NodeId: fmt.Sprintf("node-%04d", n), StoreId: "store",
		Revision: 1, Full: full, BaseRevision: 1, BytesFree: int64(n%1024) << 30, PeerAddress: fmt.Sprintf("127.0.0.1:%d", 20000+n)}
	raw, err := proto.Marshal(req)
	if err != nil {
		panic(err)
	}
	if !full {
		return raw
	}
	size := len(raw)
	for _, k := range f.holds[n] {
		size += 4 + len(f.encoded[k])
	}
	out := make([]byte, 0, size)
	out = append(out, raw...)
	for _, k := range f.holds[n] {
		out = protowire.AppendTag(out, 6, protowire.BytesType) // ReportRequest.upserts
		out = protowire.AppendBytes(out, f.encoded[k])
	}
	return out
}

// pick is k of the pool's volumes as a scheduler meets them: those of a
// random node, so each as likely as it is common.
func (f *fleet) pick(r *rand.Rand, k int) []*controllerv1.VolumeRef {
	h := f.holds[r.IntN(len(f.holds))]
	out := make([]*controllerv1.VolumeRef, k)
	for i := range out {
		out[i] = f.refs[h[r.IntN(len(h))]]
	}
	return out
}

// encodedReport is a message already encoded, sent as it is.
type encodedReport []byte

// passThrough is the proto codec, but for encodedReports, which it sends
// as they are.
type passThrough struct{}

func (passThrough) Marshal(v any) ([]byte, error) {
	if raw, ok := v.(encodedReport); ok {
		return raw, nil
	}
	return proto.Marshal(v.(proto.Message))
}

func (passThrough) Unmarshal(data []byte, v any) error {
	return proto.Unmarshal(data, v.(proto.Message))
}

func (passThrough) Name() string { return "proto" }
