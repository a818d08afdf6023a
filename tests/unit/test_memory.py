"""memory.trim_heap, and the model worker's trim once it is idle after some work."""

from __future__ import annotations

import threading
import time

from hookwire_server import memory
from hookwire_server.models import worker as worker_mod


def test_trim_heap_calls_malloc_trim_where_glibc_has_it() -> None:
    assert memory.trim_heap() is (memory._malloc_trim() is not None)


def test_an_idle_worker_trims_once_after_work_and_not_while_it_waits_without_any(monkeypatch) -> None:
    trims = threading.Semaphore(0)
    calls: list[None] = []

    def counting() -> bool:
        calls.append(None)
        trims.release()
        return True

    monkeypatch.setattr(worker_mod, "trim_heap", counting)
    monkeypatch.setattr(worker_mod, "IDLE_TRIM_SECONDS", 0.05)
    worker = worker_mod.DaemonWorker("test", idle_trim=True)
    try:
        assert worker.submit(lambda: 42).result(timeout=60) == 42
        assert trims.acquire(timeout=60)  # once idle after the job
        time.sleep(0.3)  # idle without new work: no further trims
        assert len(calls) == 1
        worker.submit(lambda: None).result(timeout=60)
        assert trims.acquire(timeout=60)
        assert len(calls) == 2
    finally:
        worker.shutdown()
    plain = worker_mod.DaemonWorker("plain")
    try:
        plain.submit(lambda: None).result(timeout=60)
        time.sleep(0.2)
        assert len(calls) == 2  # a worker without idle_trim never trims
    finally:
        plain.shutdown()


def test_no_malloc_trim_is_a_no_op(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    assert memory.trim_heap() is False
