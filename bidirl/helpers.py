"""Helper processes beside the main one, for pure-Python work another core can do: the planner's
candidate splits (each one a whole simulation) and the plots of finished simulations (matplotlib's
import alone is about 0.4 s, paid while the simulator still runs).

Opt-in per command: the CLI wraps what it runs in ``with helper_processes():``; everywhere else, and
always once torch is loaded, the work runs here, in this process, as before. The helpers are forked,
so nothing is imported again -- and that is also why never beside torch (a process forked from one
with torch's thread pools can deadlock). Every task is deterministic and its results are used in the
order they were asked for, so a result is the same with helpers or without.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

_pool: Optional[ProcessPoolExecutor] = None
_workers = 0


@contextmanager
def helper_processes(limit: int = 2) -> Iterator[int]:
    """Up to ``limit`` helper processes (no more than the cores) for the block; yields how many (0: none,
    on one core, beside torch, or inside another such block, whose helpers are used)."""
    global _pool, _workers
    workers = min(limit, os.cpu_count() or 1)
    if _pool is not None or workers < 2 or "torch" in sys.modules:
        yield 0
        return
    _pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_helper)
    _workers = workers
    # forked now, every one (a forking pool starts them all at its first task), while this is the only
    # thread: forked later from a thread of ``side_by_side``, a helper could inherit a lock another held
    list(_pool.map(int, range(workers)))
    try:
        yield workers
    finally:
        pool, _pool, _workers = _pool, None, 0
        pool.shutdown(wait=True, cancel_futures=True)


def _start_helper() -> None:
    """A helper gives way to the main process: work ahead of time (an import) must not slow its
    simulation, and when the main process waits for the helpers, they have the cores anyway. Its own
    tasks run their helper work inline: the pool it was forked with is the main process's (a copy whose
    threads did not survive the fork), and a task handed to it would never run."""
    global _pool, _workers
    os.nice(5)
    _pool, _workers = None, 0


def map_in_helpers(fn: Callable[[Any], Any], items: Sequence[Any]) -> List[Any]:
    """``[fn(x) for x in items]``, computed in the helper processes if there are any (``fn`` and the items
    picklable); the first error is raised here."""
    return list(each_in_helpers(fn, items))


def each_in_helpers(fn: Callable[[Any], Any], items: Sequence[Any]) -> Iterator[Any]:
    """``fn(x)`` for each of ``items`` in order, each yielded as soon as it is ready (so a caller can show
    progress), computed as :func:`map_in_helpers` computes them; the first error is raised here."""
    if _pool is None or (len(items) < 2 and threading.current_thread() is threading.main_thread()):
        return (fn(x) for x in items)  # (one item, and nothing else to do meanwhile: here costs no pickling)
    return _pool.map(fn, items)  # (all submitted now; in a thread of ``side_by_side`` even one: the threads share a core)


def side_by_side(fn: Callable[[Any], Any], items: Sequence[Any]) -> List[Any]:
    """``[fn(x) for x in items]``, each in a thread of this process where there are helpers, so that the
    helper work each one asks for (``map_in_helpers``, which from such a thread sends even one item to the
    helpers) queues beside the others' instead of after them: searches that ask for a few simulations a
    round keep the helpers busy together. The threads mostly wait for the helpers (the pure-Python work
    they do themselves, between rounds, takes the GIL in turn); the results are the same, in order. An
    error, or Ctrl-C, reaches the caller once every thread has ended."""
    if _pool is None or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(len(items)) as threads:
        return list(threads.map(fn, items))


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` in a helper process if there is one, else now; ``.result()`` returns its value or
    raises its error."""
    if _pool is not None:
        return _pool.submit(fn, *args)
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except Exception as exc:  # (re-raised by .result(), as a helper's error would be)
        done.set_exception(exc)
    return done


def warm_up(fn: Callable[[], Any]) -> None:
    """Run ``fn`` (an import) in each helper ahead of the work that needs it; nothing without helpers."""
    for _ in range(_workers):
        _pool.submit(fn)
