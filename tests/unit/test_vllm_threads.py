"""CPU threads for vLLM models (engine/vllm_threads.py): the model's thread runs all cores
but one, other threads keep torch's default, worker processes leave a core to the front.
(Why: docs/vllm.md, "CPU threads"; the figures: docs/benchmarks.md, bench_serving.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from hookwire_server.engine import vllm_threads


@pytest.fixture(autouse=True)
def cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU build's behaviour, also where torch sees a GPU (CUDA: vLLM places threads itself)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_model_gets_every_core_but_the_fronts_and_at_least_one() -> None:
    assert [vllm_threads.model_threads(n) for n in (1, 2, 3, 16)] == [1, 1, 2, 15]


@pytest.mark.parametrize(("ranks", "cores", "binding"), [
    (1, [0, 1], "0"),                  # a lone worker on 2 cores: one for it, one for the front
    (1, [0, 1, 2, 3], "0,1,2"),
    (2, [0, 1], "0|1"),                # as many ranks as cores: one each, none left over
    (2, [0, 1, 2, 3, 4], "0,1|2,3"),   # the last core is the front's
    (1, [5], "5"),
    (3, [0, 1], "0|1|0"),              # more ranks than cores: they share
])
def test_worker_binding_leaves_the_last_core_to_the_front_where_there_are_more_cores_than_ranks(
        ranks: int, cores: list[int], binding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_threads, "_OPERATOR_BIND", None)
    assert vllm_threads.worker_binding(ranks, cores) == binding


def test_an_operators_binding_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_threads, "_OPERATOR_BIND", "0-1")
    assert vllm_threads.worker_binding(1, [0, 1, 2]) is None
    monkeypatch.setattr(vllm_threads, "_OPERATOR_THREADS", "2")
    assert vllm_threads.limit_this_thread(1) is None


def test_limiting_the_model_thread_leaves_other_threads_at_torchs_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_threads, "_OPERATOR_THREADS", None)
    seen: dict[str, int] = {}

    def in_thread(what: str, fn: object) -> None:  # what: for a reader of a failure's traceback
        t = threading.Thread(target=fn)  # type: ignore[arg-type]
        t.start()
        t.join()

    in_thread("default", lambda: seen.update(default=torch.get_num_threads()))
    want = seen["default"] + 1  # a count no thread has by default

    def model_thread() -> None:
        seen["set"] = vllm_threads.limit_this_thread(want) or 0
        torch.ones(64, 64) @ torch.ones(64, 64)  # a parallel op: the count holds past it
        seen["model"] = torch.get_num_threads()

    in_thread("model", model_thread)
    in_thread("other", lambda: seen.update(other=torch.get_num_threads()))
    assert seen["set"] == want and seen["model"] == want
    assert seen["other"] == seen["default"]
    # vLLM's CPU worker turns torch.set_num_threads into a no-op in its process: torch's own is used.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    in_thread("model again", lambda: seen.update(again=vllm_threads.limit_this_thread(want) and torch.get_num_threads()))
    assert seen["again"] == want


@pytest.mark.parametrize(("binding", "cores", "front"), [
    ("0", [0, 1], [1]),
    ("0,1|2,3", [0, 1, 2, 3, 4], [4]),
    ("0|1", [0, 1], []),       # as many ranks as cores: nothing left to the front
    (None, [0, 1], []),        # the operator's binding (or none): the front's threads stay where they are
    ("", [0, 1], []),
])
def test_the_fronts_cores_are_those_the_workers_binding_leaves(binding: str | None, cores: list[int],
                                                                front: list[int]) -> None:
    assert vllm_threads.front_cores(binding, cores) == front


def test_keep_to_binds_the_calling_thread_only_and_refuses_cores_it_cannot_have() -> None:
    mine = sorted(os.sched_getaffinity(0))
    seen: dict[str, object] = {}

    def link_thread() -> None:
        seen["kept"] = vllm_threads.keep_to([mine[-1]])
        seen["affinity"] = sorted(os.sched_getaffinity(0))
        seen["nothing"] = vllm_threads.keep_to([])
        seen["outside"] = vllm_threads.keep_to([max(os.cpu_count() or 1, 1024) + 7])  # no such core

    t = threading.Thread(target=link_thread)
    t.start()
    t.join()
    assert seen == {"kept": True, "affinity": [mine[-1]], "nothing": False, "outside": False}
    assert sorted(os.sched_getaffinity(0)) == mine  # this thread is left where it was


def test_the_engine_core_process_keeps_every_thread_to_the_cores_the_server_set_out() -> None:
    """vLLM's engine-core process (vllm_scheduler) reads FRONT_CORES_ENV when it starts:
    every thread it has, and each it starts after (which inherits it), keeps to them."""
    mine = sorted(os.sched_getaffinity(0))
    script = textwrap.dedent("""
        import os, threading
        from hookwire_server.engine import vllm_threads
        started = threading.Event(); done = threading.Event()
        early = threading.Thread(target=lambda: (started.set(), done.wait()))
        early.start(); started.wait()
        kept = vllm_threads.keep_engine_core()
        late = {}
        t = threading.Thread(target=lambda: late.update(a=sorted(os.sched_getaffinity(0)))); t.start(); t.join()
        tasks = set()
        for tid in os.listdir("/proc/self/task"):
            try:
                tasks.add(tuple(sorted(os.sched_getaffinity(int(tid)))))
            except ProcessLookupError:  # a thread that ended since (joined threads may linger)
                pass
        tasks = sorted(tasks)
        done.set(); early.join()
        print(kept, tasks, late["a"])
    """)
    env = {**os.environ, vllm_threads.FRONT_CORES_ENV: str(mine[-1])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", f"[({mine[-1]},)]", f"[{mine[-1]}]"]
    env.pop(vllm_threads.FRONT_CORES_ENV)  # in-process models: the server sets none, nothing moves
    script = "from hookwire_server.engine import vllm_threads; print(vllm_threads.keep_engine_core())"
    assert subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["False"]
    # The server that set them out is not the engine core (an in-process model's scheduler
    # runs in it): it stays where it was; the process it starts next reads them.
    script = textwrap.dedent(f"""
        import os, subprocess, sys
        from hookwire_server.engine import vllm_threads
        before = sorted(os.sched_getaffinity(0))
        vllm_threads.hand_front_cores([{mine[-1]}])
        child = "from hookwire_server.engine import vllm_threads; print(vllm_threads.keep_engine_core())"
        print(vllm_threads.keep_engine_core(), sorted(os.sched_getaffinity(0)) == before,
              subprocess.run([sys.executable, "-c", child], capture_output=True, text=True).stdout.strip())
        vllm_threads.hand_front_cores([])
        print(vllm_threads.FRONT_CORES_ENV in os.environ)
    """)
    assert subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["False", "True", "True", "False"]
