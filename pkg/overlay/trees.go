package overlay

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
)

// Trees keeps a few empty overlay trees (an upper and a work dir) made
// ahead under a dir of their own, so that a publish renames one into place
// instead of making its dirs on the step's path. What is in the dir when
// Trees opens it is a dead process's and is removed.
type Trees struct {
	dir  string
	want int
	mu   sync.Mutex
	free []string
	made int
}

// OpenTrees empties dir (making it if needed) for a pool of up to want
// trees. What it cannot remove is said in the error, with a pool that works
// anyway: a tree is only ever handed out by the process that made it, so
// a leftover is never one.
func OpenTrees(dir string, want int) (*Trees, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	t := &Trees{dir: dir, want: want}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return t, err
	}
	var errs []error
	for _, e := range entries {
		errs = append(errs, RemoveTree(filepath.Join(dir, e.Name())))
	}
	if err := errors.Join(errs...); err != nil {
		return t, fmt.Errorf("emptying the trees made ahead in %s: %w", dir, err)
	}
	return t, nil
}

// take hands over a tree, which the caller renames away; "" when none is
// ready (or t is nil: no trees are made ahead).
func (t *Trees) take() string {
	if t == nil {
		return ""
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.free) == 0 {
		return ""
	}
	tree := t.free[len(t.free)-1]
	t.free = t.free[:len(t.free)-1]
	return tree
}

// Fill makes trees until as many as wanted are ready. One caller at a time.
func (t *Trees) Fill() error {
	for {
		t.mu.Lock()
		n := len(t.free)
		t.made++
		tree := filepath.Join(t.dir, fmt.Sprintf("t%d", t.made))
		t.mu.Unlock()
		if n >= t.want {
			return nil
		}
		if err := makeTree(tree); err != nil {
			if !errors.Is(err, os.ErrExist) { // a leftover under that name is not ours to remove
				err = errors.Join(err, RemoveTree(tree))
			}
			return err
		}
		t.mu.Lock()
		t.free = append(t.free, tree)
		t.mu.Unlock()
	}
}

// Ready says how many trees are ready.
func (t *Trees) Ready() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.free)
}

// makeTree makes an overlay view's empty upper and work dirs under dir,
// which must not exist: a leftover under its name is never handed out.
func makeTree(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return err
	}
	if err := mkdirMode(filepath.Join(dir, "upper"), 0o700); err != nil {
		return err
	}
	return mkdirMode(filepath.Join(dir, "work"), 0o700)
}
