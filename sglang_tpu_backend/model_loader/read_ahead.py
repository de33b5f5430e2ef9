"""Reading ahead: the next jobs' host arrays made on a few threads while the caller uses the
current one's.

``ReadAhead(jobs)`` takes ``(nbytes, read)`` pairs in the order the caller will want their
results and runs the ``read``s on a pool of ``WORKERS`` threads, in that order, as far ahead
as ``max_bytes`` (default ``AHEAD_BYTES``) allows: a job starts only while the jobs started
and not yet taken add up to at most that many bytes (``nbytes``: the job's estimate of what
it returns), or when none is pending at all (a job larger than the bound then runs alone). ``take()`` hands out
the results in order, waiting where one is not ready; the caller then holds that one while
the next ones are read. So the host holds at most ``max_bytes`` (or one job's bytes, if
larger) read ahead, plus what the caller keeps of the results it took.

A job's error is raised by the ``take()`` of that job, in the caller's thread, as raised.
``close()`` (or leaving the ``with`` block) cancels the jobs not started and waits for the
running ones, so no thread outlives it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Any, Callable, Iterable

WORKERS = 8  # reading threads (preadv and numpy's casts release the GIL; 4 read 2.1 GB/s on a
# v5e host whose disk gave 2.5)
# The default bound on bytes read ahead and not yet taken; ``sharded_loader`` bounds it
# further to about one layer (its share of the largest one). 512 MiB: half a layer of the
# 397B model at 64 routed experts per chip (1.07 GB), and its largest leaf (one expert
# projection of a layer, 0.54 GB). The loader then holds on the host what is read ahead plus
# the leaf being placed: at most about 1.1 GB there, one such layer.
AHEAD_BYTES = 512 << 20


class ReadAhead:
    """Runs ``jobs`` (``(nbytes, read)``, ``read()`` returning the job's result) on a thread
    pool, ahead of ``take()`` by at most ``max_bytes``; see the module docstring.

    ``wait_seconds``: the time ``take()`` waited for results (the caller's reading time
    not hidden behind its other work). ``reader_seconds``: the time the threads spent in
    ``read``s, summed over threads."""

    def __init__(self, jobs: Iterable[tuple[int, Callable[[], Any]]], *,
                 workers: int | None = None, max_bytes: int | None = None):
        self.max_bytes = AHEAD_BYTES if max_bytes is None else max_bytes
        self.wait_seconds = self.reader_seconds = 0.0
        self._jobs = iter(jobs)
        self._next: tuple[int, Callable[[], Any]] | None = None  # taken from jobs, not started
        self._pending: collections.deque = collections.deque()  # (nbytes, future), in order
        self._held = 0  # bytes of the pending jobs
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            WORKERS if workers is None else workers, thread_name_prefix="read-ahead")
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _run(self, read: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return read()
        finally:
            with self._lock:
                self.reader_seconds += time.perf_counter() - t0

    def _start(self) -> None:
        """Start the next jobs while they fit in the bound (the first of them regardless when
        nothing is pending)."""
        while True:
            if self._next is None:
                self._next = next(self._jobs, None)
                if self._next is None:
                    return
            nbytes, read = self._next
            if self._pending and self._held + nbytes > self.max_bytes:
                return
            self._pending.append((nbytes, self._pool.submit(self._run, read)))
            self._held += nbytes
            self._next = None

    def take(self) -> Any:
        """The next job's result, in the order of ``jobs``; raises that job's error, or
        StopIteration when every job was taken."""
        if not self._pending:
            raise StopIteration("every job was taken")
        nbytes, future = self._pending.popleft()
        self._held -= nbytes
        self._start()  # its bytes are the caller's now: the next jobs may start meanwhile
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.wait_seconds += time.perf_counter() - t0

    def close(self) -> None:
        """Cancel the jobs not started, wait for the running ones, stop the threads."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._held, self._next = 0, None
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
