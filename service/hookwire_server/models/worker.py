"""The model's worker threads: a one-thread executor whose thread is a daemon. Each model
runs its passes on one (ModelHost.run, and the scheduler's plans) and tokenizes on
another (ModelHost.run_tokenizer)."""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from typing import Any, Callable, TypeVar

from ..memory import trim_heap

T = TypeVar("T")

#: Seconds a worker waits without work before it returns freed heap memory to the system
#: (memory.trim_heap): long enough that a steady stream of calls never pays for it.
IDLE_TRIM_SECONDS = 2.0


class DaemonWorker(concurrent.futures.Executor):
    """A one-thread executor whose thread is a daemon.

    ThreadPoolExecutor's threads are joined when the interpreter exits, so a
    forward pass that runs for minutes would hold the process past its grace
    period on SIGTERM; a thread in the middle of a pass cannot be killed, so the
    process must be able to exit without waiting for it.
    """

    def __init__(self, name: str, *, idle_trim: bool = False) -> None:
        self._name = name
        #: After IDLE_TRIM_SECONDS without work following some, trim the heap (a model's
        #: passes free large transient tensors that the allocator would otherwise keep).
        self._idle_trim = idle_trim
        self._work: queue.SimpleQueue[tuple[concurrent.futures.Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        #: True while a submitted function runs.
        self.busy = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        """Queues ``fn(*args, **kwargs)``; RuntimeError after shutdown."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: cannot schedule new work after shutdown")
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._work.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def _loop(self) -> None:
        worked = False
        while True:
            if self._idle_trim and worked:
                try:
                    item = self._work.get(timeout=IDLE_TRIM_SECONDS)
                except queue.Empty:
                    trim_heap()
                    worked = False
                    continue
            else:
                item = self._work.get()
            worked = True
            if item is None:
                return
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            self.busy = True
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting caller, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                self.busy = False
                # Not kept until the next job arrives: the job holds its call (request, response).
                item = future = fn = result = None  # type: ignore[assignment]

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stops the thread after the running function (queued ones are cancelled
        when ``cancel_futures``); ``wait`` joins it."""
        with self._lock:
            self._closed = True
            if cancel_futures:
                while True:
                    try:
                        item = self._work.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
            self._work.put(None)
            thread = self._thread
        if wait and thread is not None:
            thread.join()
