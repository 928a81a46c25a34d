package main

import (
	"fmt"
	"log"
	"os"
	"runtime/debug"
	"sync"
)

// programTB is the tb.TB the harness runs under in this program: it logs
// with timestamps to stderr (the cluster's log), and Fatal and Skip end
// the function run runs, as they end a test, after which every cleanup
// runs, last registered first. As under go test, they may be called only
// from run's goroutine.
type programTB struct {
	mu       sync.Mutex
	failed   bool
	cleanups []func()
	logger   *log.Logger
}

func newProgramTB() *programTB {
	return &programTB{logger: log.New(os.Stderr, "", log.LstdFlags|log.Lmicroseconds)}
}

// stopRun is what Fatal and Skip panic with, for run to recover.
type stopRun struct{}

// run runs fn, then the cleanups it registered; a panic of fn's other
// than Fatal's fails the run, and the cleanups still run.
func (p *programTB) run(fn func()) {
	defer p.runCleanups()
	defer func() {
		if r := recover(); r != nil {
			if _, ok := r.(stopRun); !ok {
				p.Errorf("panic: %v\n%s", r, debug.Stack())
			}
		}
	}()
	fn()
}

// runCleanups runs each cleanup, last first; one that fails or panics
// does not keep the others from running.
func (p *programTB) runCleanups() {
	for {
		p.mu.Lock()
		if len(p.cleanups) == 0 {
			p.mu.Unlock()
			return
		}
		fn := p.cleanups[len(p.cleanups)-1]
		p.cleanups = p.cleanups[:len(p.cleanups)-1]
		p.mu.Unlock()
		p.run(fn)
	}
}

func (p *programTB) Helper() {}

func (p *programTB) Cleanup(fn func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cleanups = append(p.cleanups, fn)
}

func (p *programTB) Log(args ...any) { p.logger.Output(2, fmt.Sprintln(args...)) }
func (p *programTB) Logf(format string, args ...any) {
	p.logger.Output(2, fmt.Sprintf(format, args...))
}

func (p *programTB) Error(args ...any) {
	p.logger.Output(2, "ERROR: "+fmt.Sprintln(args...))
	p.fail()
}

func (p *programTB) Errorf(format string, args ...any) {
	p.logger.Output(2, "ERROR: "+fmt.Sprintf(format, args...))
	p.fail()
}

func (p *programTB) Fatal(args ...any) {
	p.logger.Output(2, "FATAL: "+fmt.Sprintln(args...))
	p.FailNow()
}

func (p *programTB) Fatalf(format string, args ...any) {
	p.logger.Output(2, "FATAL: "+fmt.Sprintf(format, args...))
	p.FailNow()
}

func (p *programTB) FailNow() {
	p.fail()
	panic(stopRun{})
}

func (p *programTB) fail() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.failed = true
}

func (p *programTB) Failed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.failed
}

// Skip fails: the cluster needs what a test would skip without.
func (p *programTB) Skip(args ...any) {
	p.logger.Output(2, "cannot go on: "+fmt.Sprintln(args...))
	p.FailNow()
}

func (p *programTB) Skipf(format string, args ...any) {
	p.logger.Output(2, "cannot go on: "+fmt.Sprintf(format, args...))
	p.FailNow()
}

// TempDir is a new directory, removed with the cluster.
func (p *programTB) TempDir() string {
	dir, err := os.MkdirTemp("", "localcluster-")
	if err != nil {
		p.Fatal(err)
	}
	p.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			p.Error(err)
		}
	})
	return dir
}
