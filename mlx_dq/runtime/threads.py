"""Worker threads for independent per-tensor work when MLX runs on the CPU.

MLX's CPU backend runs elementwise kernels (the clip search, the group
parameter search, error sums) on one core and only its matmuls on several, so a
layer's tensors measured or quantized one after another leave the other cores
idle. Each tensor's work is independent and deterministic, so running the
tensors in a few threads gives the same numbers sooner. On a GPU the device is
already busy with one tensor at a time, so the work stays on the calling thread.

MLX streams belong to the thread that made them: every array handed to a worker
must be evaluated first, and a worker evaluates everything it returns
(:func:`thread_map` does both for arrays it can see). Workers serving the main
thread are kept for the whole process, since MLX keeps a thread of its own for
every thread that ever ran MLX work.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import queue
import sys
import threading
from collections import deque
from concurrent.futures import Future, wait
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import mlx.core as mx

from mlx_dq.errors import InputError

T = TypeVar("T")
MAX_WORKERS = 4  # beyond this the matmuls' own threads and memory for temporaries gain little
ENV = "MLX_DQ_THREADS"  # set to 1 to keep all work on the calling thread


def env_workers() -> int | None:
    """``$MLX_DQ_THREADS`` as a thread count (None when unset); InputError unless it is a whole number of at most
    :func:`max_env_workers`. The command checks it before any work: a count the system cannot start failed only
    when the first layer's tensors were handed out ("can't start new thread")."""
    env = os.environ.get(ENV)
    if not env:
        return None
    try:
        n = int(env)
    except ValueError:
        raise InputError(f"{ENV} must be a whole number of threads, got {env!r}") from None
    if n > max_env_workers():
        raise InputError(f"{ENV}={n} is more threads than this machine can use: give at most {max_env_workers()} "
                         f"({os.cpu_count() or 1} CPUs here)")
    return max(1, n)


def max_env_workers() -> int:
    """The most threads ``$MLX_DQ_THREADS`` may ask for: four per CPU (at least 16); more only cost memory."""
    return 4 * max(MAX_WORKERS, os.cpu_count() or 1)


def workers() -> int:
    """Threads for per-tensor work: ``$MLX_DQ_THREADS`` if set, else up to the CPU count on the CPU, 1 on a GPU."""
    n = env_workers()
    if n is not None:
        return n
    if mx.default_device() != mx.cpu:
        return 1
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


_M_ARENA_MAX = -8  # glibc's mallopt parameter
_arena_set = False


def _one_malloc_arena() -> None:
    """On glibc, let worker threads allocate from the main malloc arena instead of one arena each.

    Each extra arena keeps freed memory of its own, which raises the peak RSS for no speed; with one arena the
    workers peak as one thread does (docs/cost.md#threads).
    """
    global _arena_set
    if _arena_set or not sys.platform.startswith("linux"):
        return
    _arena_set = True
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, 1)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


_numpy_blas_set = False


def _numpy_blas_one_thread() -> None:
    """On Linux, let numpy's bundled OpenBLAS (its small factorisations in :mod:`mlx_dq.quant.linalg`) run on one thread.

    Its own threads, started per call from each worker, fight the other worker and MLX's matmuls for the cores and
    make small factorisations several times slower (docs/cost.md#threads). MLX's BLAS (a
    different library) keeps its threads. Nothing changes where numpy uses another BLAS (Accelerate on macOS)."""
    global _numpy_blas_set
    if _numpy_blas_set or not sys.platform.startswith("linux"):
        return
    _numpy_blas_set = True
    import glob

    import numpy as np

    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas*")):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads"):
            if hasattr(lib, name):
                getattr(lib, name)(1)
                return


def _arrays(obj: Any, depth: int = 8) -> list[mx.array]:
    """The MLX arrays inside ``obj`` (nested lists, tuples and dicts; objects' ``__dict__``, ``depth`` levels)."""
    if isinstance(obj, mx.array):
        return [obj]
    if depth == 0:
        return []
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        obj = vars(obj)
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [a for x in obj for a in _arrays(x, depth - 1)]
    return []


def evaluated_result(out: T) -> T:
    """``out`` with every MLX array it holds (:func:`_arrays`) evaluated: safe to hand to another thread."""
    mx.eval(_arrays(out))
    return out


class _Workers:
    """``n`` threads that run submitted calls in turn; each clears its MLX streams (``mx.clear_streams``) as it ends.

    Why: threads that ended with their streams in place made short scripts abort at exit ("terminate called without
    an active exception", status 134; ml-explore/mlx#3126). As a context manager, leaving it waits
    for the calls and ends the threads."""

    def __init__(self, n: int, daemon: bool = False) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=f"mlx_dq-{i}", daemon=daemon) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                self._call(*job)
                del job  # an idle worker holds nothing of its last call (its arrays would live until the next)
        finally:
            mx.clear_streams()  # the thread's last MLX call: it cannot make a stream again

    @staticmethod
    def _call(future: Future, fn: Callable[..., Any], args: tuple) -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller by Future.result
                future.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future:
        """A future for ``fn(*args)``, run on the first free thread."""
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def __enter__(self) -> "_Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Cancel the calls not started, wait for the others, then end the threads."""
        with contextlib.suppress(queue.Empty):
            while (job := self._jobs.get_nowait()) is not None:
                job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join()


_main_pools: dict[int, _Workers] = {}


def _close_main_pools() -> None:
    while _main_pools:
        _main_pools.popitem()[1].close()


@contextlib.contextmanager
def _pool(n: int, n_items: int) -> Iterator[_Workers]:
    """``n`` worker threads: for the main thread a set kept for the process (ended at exit), else one for this call.

    Why: MLX never frees the stream thread it starts for each new thread that runs MLX work (mlx 0.32), so a set of
    workers per call would leave ``n`` threads, and their memory, behind each time (docs/cost.md#threads).
    At most ``n_items`` threads for one call."""
    _one_malloc_arena()
    _numpy_blas_one_thread()
    if threading.current_thread() is not threading.main_thread():
        with _Workers(min(n, n_items)) as pool:
            yield pool
        return
    if n not in _main_pools:
        if not _main_pools:
            atexit.register(_close_main_pools)
        _main_pools[n] = _Workers(n, daemon=True)  # daemon: atexit runs only after non-daemon threads end
    yield _main_pools[n]


def _cancel_and_wait(futures: Iterable[Future]) -> None:
    futures = list(futures)
    for f in futures:
        f.cancel()
    wait(futures)


def ahead_workers() -> int:
    """Threads :func:`map_ahead` uses from the calling thread: :func:`workers` on the main thread, else 1."""
    return workers() if threading.current_thread() is threading.main_thread() else 1


def map_ahead(fn: Callable[[Any], T], items: Sequence[Any], n_workers: int | None = None) -> Iterator[T]:
    """``fn(item)`` for each of ``items``, yielded in order, computed on worker threads (default :func:`workers`;
    only from the main thread) at most one per worker ahead of the caller, each result evaluated.

    Why: a long series of independent pieces (a large tensor's blocks of rows) whose results the caller consumes
    one by one; work already on a worker thread shares the cores, so there the items run on its own thread.
    The arrays ``fn`` reads must be evaluated before (no lazy graph crosses threads)."""
    def call(it: Any) -> T:
        return evaluated_result(fn(it))

    n = ahead_workers() if n_workers is None else n_workers
    if n <= 1 or len(items) <= 1 or threading.current_thread() is not threading.main_thread():
        yield from (call(it) for it in items)
        return
    with _pool(n, len(items)) as pool:
        pending = deque(pool.submit(call, it) for it in items[:n])
        try:
            for it in items[n:]:  # one more submitted as each result is taken: at most n ahead
                out = pending.popleft().result()
                pending.append(pool.submit(call, it))
                yield out
            while pending:
                yield pending.popleft().result()
        finally:  # an error, or the caller stopped early: nothing left running for it
            _cancel_and_wait(pending)


def thread_map(fn: Callable[..., T], items: Iterable[Any], n_workers: int | None = None,
               cost: Callable[..., float] | None = None) -> list[T]:
    """``[fn(*item) for item in items]`` on up to ``n_workers`` threads (default :func:`workers`), in order.

    The arrays in the items are evaluated before any thread starts and those in
    each result before it is returned, so no lazy graph crosses threads.
    ``cost(*item)`` (optional) starts the costliest items first, so the threads finish together.
    """
    items = [it if isinstance(it, tuple) else (it,) for it in items]
    n = workers() if n_workers is None else n_workers
    if n <= 1 or len(items) <= 1:
        return [fn(*it) for it in items]
    mx.eval([a for it in items for x in it for a in _arrays(x)])

    def call(it: tuple) -> T:
        return evaluated_result(fn(*it))

    order = sorted(range(len(items)), key=lambda i: -cost(*items[i])) if cost is not None else range(len(items))
    with _pool(n, len(items)) as pool:
        futures = {i: pool.submit(call, items[i]) for i in order}
        try:
            return [futures[i].result() for i in range(len(items))]
        finally:  # after an error, the items not started are dropped and the running ones finish first
            _cancel_and_wait(futures.values())
