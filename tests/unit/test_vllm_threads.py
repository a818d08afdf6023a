"""CPU threads for vLLM models (engine/vllm_threads.py): the model's thread runs all cores
but one, other threads keep torch's default, worker processes leave a core to the front.
(Why: docs/vllm.md, "CPU threads"; the figures: docs/benchmarks.md, bench_serving.)"""

from __future__ import annotations

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
