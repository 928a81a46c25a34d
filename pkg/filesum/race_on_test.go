//go:build race

package filesum

// raceDetector says the tests run under the race detector, whose
// sync.Pool drops a share of what is put back, on purpose.
const raceDetector = true
