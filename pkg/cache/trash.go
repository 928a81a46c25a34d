package cache

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// Trash moves a tree into the trash dir (a rename, so O(1)) for EmptyTrash to
// delete later: unpublish must not wait for a step's gigabytes to be unlinked.
// A missing path is not an error.
func (s *Store) Trash(path string) error {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return err
	}
	err := os.Rename(path, filepath.Join(s.TrashDir(), hex.EncodeToString(b[:])))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("moving %s to the trash: %w", path, err)
	}
	return nil
}

// EmptyTrash deletes everything in the trash dir.
func (s *Store) EmptyTrash(remove Remover) error {
	entries, err := os.ReadDir(s.TrashDir())
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		errs = append(errs, remove(filepath.Join(s.TrashDir(), e.Name())))
	}
	return errors.Join(errs...)
}
