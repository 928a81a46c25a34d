package plugintest

import (
	"fmt"
	"os/exec"
	"syscall"
	"time"
)

// Process is a child process a test runs (a plugin, a kubelet, a
// containerd): whether it still runs, waiting for it to end, and stopping
// it with a grace period.
type Process struct {
	Cmd  *exec.Cmd
	done chan error
}

// StartProcess starts cmd and watches for its end; then, if not nil, runs
// ended (to close the files its output went to, say).
func StartProcess(cmd *exec.Cmd, ended func()) (*Process, error) {
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &Process{Cmd: cmd, done: make(chan error, 1)}
	go func() {
		err := cmd.Wait()
		if ended != nil {
			ended()
		}
		p.done <- err
	}()
	return p, nil
}

// PID is the process's ID.
func (p *Process) PID() int { return p.Cmd.Process.Pid }

// Running says whether the process has not ended yet.
func (p *Process) Running() bool {
	_, ended := p.ended(0)
	return !ended
}

// Wait waits up to timeout for the process to end by itself and says how
// it ended; it fails only if the process still runs after timeout.
func (p *Process) Wait(timeout time.Duration) (exit, err error) {
	exit, ended := p.ended(timeout)
	if !ended {
		return nil, fmt.Errorf("%s still running after %s", p.Cmd.Path, timeout)
	}
	return exit, nil
}

// Stop sends sig and waits up to grace for the process to end, then kills
// it; it says how the process ended.
func (p *Process) Stop(sig syscall.Signal, grace time.Duration) error {
	if exit, ended := p.ended(0); ended {
		return exit
	}
	_ = p.Cmd.Process.Signal(sig)
	if exit, ended := p.ended(grace); ended {
		return exit
	}
	_ = p.Cmd.Process.Kill()
	exit, _ := p.ended(time.Hour)
	return exit
}

// ended waits up to timeout (0: not at all) for the end, and leaves it to
// be seen again.
func (p *Process) ended(timeout time.Duration) (exit error, ended bool) {
	if timeout <= 0 {
		select {
		case err := <-p.done:
			p.done <- err
			return err, true
		default:
			return nil, false
		}
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case err := <-p.done:
		p.done <- err
		return err, true
	case <-t.C:
		return nil, false
	}
}
