// Package tb names what the test harness's helpers (testfs, netlab,
// plugintest, test/localcluster) need of a testing.TB, so that a program
// can run them too: make cluster's command (test/localcluster/cmd) brings
// up a cluster with the code the e2e uses, with no go test around it. It
// owns that interface and nothing else.
package tb

// TB is the part of testing.TB the harness uses; a *testing.T, a
// *testing.B and the local cluster's command satisfy it. A program's
// Fatal and Skip end what it is doing as they end a test: they do not
// return.
type TB interface {
	Helper()
	// Cleanup registers fn to run when the test, or the program, ends:
	// last registered, first run.
	Cleanup(fn func())
	Log(args ...any)
	Logf(format string, args ...any)
	Error(args ...any)
	Errorf(format string, args ...any)
	Fatal(args ...any)
	Fatalf(format string, args ...any)
	FailNow()
	Failed() bool
	Skip(args ...any)
	Skipf(format string, args ...any)
	// TempDir is a directory of its own, removed when it ends.
	TempDir() string
}
