package bench

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"testing"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"

	fleetview "github.com/concourse/cowvol/pkg/controller/fleet"
	"github.com/concourse/cowvol/pkg/controller/locality"
	"github.com/concourse/cowvol/pkg/volume"
)

// Locality bench: 1,000 nodes of 200 volumes each, a tenth of them held
// by every node; each pod names 3 inputs.
const (
	localityNodes, localityPerNode, localityPods = 1000, 200, 3000
)

// BenchmarkLocalityWebhook is what the locality webhook adds to a pod's
// create, as the API server calls it (HTTPS, one review at a time), on a
// 1,000-node view: a pod naming three inputs (ranked, patched) against a
// pod naming none (the comparator: a review read and answered, which any
// webhook costs), taking turns, in the same run.
func BenchmarkLocalityWebhook(b *testing.B) {
	for range b.N {
		view := fleetview.NewView(time.Minute, time.Hour)
		r := rand.New(rand.NewPCG(1, 2))
		now := time.Now()
		for n := range localityNodes {
			var held []fleetview.Held
			for i := range localityPerNode {
				h := fmt.Sprintf("own-%d-%d", n, i)
				if i < localityPerNode/10 {
					h = fmt.Sprintf("shared-%d", i)
				}
				held = append(held, fleetview.Held{Ref: volume.Ref{Namespace: "ci", Handle: h}, State: volume.StateReady, SizeBytes: 1 << 30})
			}
			id := fmt.Sprintf("node-%04d", n)
			if _, err := view.Report(fleetview.Report{NodeID: id, StoreID: id, Revision: 1, Full: true, Upserts: held, BytesFree: 100 << 30}, now); err != nil {
				b.Fatal(err)
			}
		}
		srv := httptest.NewTLSServer(locality.Handler(locality.Config{Rank: func(inputs []volume.Ref, namespace string, limit int) []fleetview.Placement {
			return view.Place(inputs, func(ns string) bool { return ns == namespace }, limit, time.Now())
		}}))
		client := srv.Client()
		review := func(inputs int) []byte {
			pod := corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "step"}, Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "busybox"}}}}
			for i := range inputs {
				n, k := r.IntN(localityNodes), localityPerNode/10+r.IntN(localityPerNode*9/10) // a node's own
				pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: fmt.Sprint("in", i), VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{
					Driver: volume.DriverName, VolumeAttributes: map[string]string{volume.AttrSource: fmt.Sprintf("own-%d-%d", n, k)}}}})
			}
			raw, _ := json.Marshal(pod)
			body, _ := json.Marshal(admissionv1.AdmissionReview{TypeMeta: metav1.TypeMeta{APIVersion: "admission.k8s.io/v1", Kind: "AdmissionReview"},
				Request: &admissionv1.AdmissionRequest{UID: "u", Kind: metav1.GroupVersionKind{Version: "v1", Kind: "Pod"}, Operation: admissionv1.Create,
					Namespace: "ci", Object: runtime.RawExtension{Raw: raw}}})
			return body
		}
		post := func(body []byte) (time.Duration, bool) {
			start := time.Now()
			resp, err := client.Post(srv.URL+locality.Path, "application/json", bytes.NewReader(body))
			if err != nil {
				b.Fatal(err)
			}
			var out admissionv1.AdmissionReview
			err = json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			if err != nil || !out.Response.Allowed {
				b.Fatalf("answer: %v %+v", err, out.Response)
			}
			return time.Since(start), out.Response.Patch != nil
		}
		var placed, plain []time.Duration
		for i := range localityPods {
			if i%2 == 0 {
				d, patched := post(review(3))
				if !patched {
					b.Fatal("a pod with inputs on the fleet was not placed")
				}
				placed = append(placed, d)
			} else {
				d, _ := post(review(0))
				plain = append(plain, d)
			}
		}
		srv.Close()
		fmt.Printf("\n%-64s %10s %10s\n", fmt.Sprintf("locality webhook, %d nodes × %d volumes, over HTTPS", localityNodes, localityPerNode), "p50", "p99")
		fmt.Printf("%-64s %10s %10s\n", "a pod naming no cowvol input (any webhook's cost)", ms(p50(plain)), ms(p99(plain)))
		fmt.Printf("%-64s %10s %10s  p99 %.2fx the comparator's\n", "a pod naming 3 inputs: ranked and patched", ms(p50(placed)), ms(p99(placed)),
			float64(p99(placed))/float64(p99(plain)))
		b.ReportMetric(float64(p99(placed).Microseconds())/1000, "placed-p99-ms")
		b.ReportMetric(float64(p99(placed))/float64(p99(plain)), "placed-vs-plain-p99")
	}
}
