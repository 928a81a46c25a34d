// Package batch hands items from one goroutine to another in batches: a
// stream's reader passes on what it decoded and moves on, while the work
// on each item (hashing a path, adding an entry to a tree) is done beside
// it, a batch at a time, so that the channel is crossed once per batch,
// not once per item. It owns only the handing over; what is done with
// the items is its callers'.
package batch

// Worker applies a function to the items it is given, in batches, in the
// order given, on a goroutine of its own. Add and Close are called from
// one goroutine. A batch apply is done with is cleared and used again: a
// stream of a million items is not a thousand batches to collect.
type Worker[T any] struct {
	size  int
	batch []T
	work  chan []T
	free  chan []T
	done  chan struct{}
}

// inFlight is how many batches a Worker holds at most: handed over, being
// applied, and being filled.
const inFlight = 4

// Start starts a Worker that hands apply batches of size items (the last
// one shorter). apply must not keep the batch.
func Start[T any](size int, apply func([]T)) *Worker[T] {
	work, free := make(chan []T, inFlight), make(chan []T, inFlight)
	w := &Worker[T]{size: size, batch: make([]T, 0, size), work: work, free: free, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for batch := range work {
			apply(batch)
			clear(batch) // what its items point to is not held by the Worker
			select {
			case free <- batch[:0]:
			default:
			}
		}
	}()
	return w
}

// Add hands item over: to apply once its batch is full.
func (w *Worker[T]) Add(item T) {
	if w.batch = append(w.batch, item); len(w.batch) == w.size {
		w.work <- w.batch
		select {
		case w.batch = <-w.free:
		default:
			w.batch = make([]T, 0, w.size)
		}
	}
}

// Close hands over what is left and returns once apply returned for
// every batch. Twice is once.
func (w *Worker[T]) Close() {
	if w.work == nil {
		return
	}
	if len(w.batch) > 0 {
		w.work <- w.batch
	}
	close(w.work)
	w.work, w.batch = nil, nil
	<-w.done
}
