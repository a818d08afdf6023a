"""CPU threads for a vLLM model on vLLM's CPU build: how many intra-op (OpenMP) threads
the model runs, and which cores its worker processes are bound to.

Why it matters (measured with tests/bench/bench_serving.py, docs/benchmarks.md): torch's
default gives the model one OpenMP thread per core. On a 2-core host that shares them
with the gRPC event loop and vLLM's scheduler, and with any neighbour (the clients, a
harvest job, a metrics scraper), every parallel region of the model then waits for a
thread the OS has descheduled; libgomp's waiting threads spin meanwhile, taking the core
the others need. In-process throughput fell from ~400 to ~32 tokens/s with one busy core
beside it, while ``vllm serve``, whose worker runs one thread per core it keeps after
reserving one for its scheduler, lost a quarter. hookwire does what vLLM does: the model
runs on all cores but one (at least one thread), the core left over is the front's (the
event loop, vLLM's scheduler or engine-core process).

With worker processes the front's own threads that a worker's step wakes (the link's
threads, which take its step messages) and vLLM's engine-core process (which polls for
the workers' results) keep to that leftover core (``keep_to``): woken on the worker's
core, they took it from the worker mid-step. The server tells the engine-core process
which cores are the front's through HOOKWIRE_VLLM_FRONT_CORES (``FRONT_CORES_ENV``).

The operator decides where they set it: ``OMP_NUM_THREADS`` (in-process: the model's
thread count) or ``VLLM_CPU_OMP_THREADS_BIND`` (worker processes: vLLM's binding) are
then left alone.
"""

from __future__ import annotations

import os
import threading

import torch

#: torch's own setter: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op
#: in the process it runs in (in-process: the server's), once it has started.
_SET_NUM_THREADS = torch._C.set_num_threads

#: The intra-op threads a new thread of this process gets (torch's default, or the
#: operator's OMP_NUM_THREADS), as limit_this_thread found it; None until it ran.
process_default: int | None = None

#: What the operator set, as the server found it (None: unset).
_OPERATOR_THREADS = os.environ.get("OMP_NUM_THREADS")
_OPERATOR_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0))


def model_threads(count: int | None = None) -> int:
    """The intra-op threads of a model that shares ``count`` cores (default: this
    process's) with the front: all but one, at least one."""
    count = len(cores()) if count is None else count
    return max(1, count - 1)


def limit_this_thread(threads: int | None = None) -> int | None:
    """Makes the calling thread (the model's worker thread, where vLLM steps run
    in-process) run ``threads`` intra-op threads (default ``model_threads()``), unless
    the operator set OMP_NUM_THREADS; returns the count set (None: left alone). Other
    threads keep torch's default: torch reads a new thread's count from a process-wide
    value when that thread first runs a parallel op, which this sets back."""
    if _OPERATOR_THREADS is not None or torch.cuda.is_available():
        return None
    global process_default
    threads = model_threads() if threads is None else threads
    default: list[int] = []
    _in_fresh_thread(lambda: default.append(torch.get_num_threads()))
    process_default = default[0]
    torch.get_num_threads()  # this thread takes its count now, so that the restore below leaves it
    _SET_NUM_THREADS(threads)
    _in_fresh_thread(lambda: _SET_NUM_THREADS(default[0]))
    return threads


def _in_fresh_thread(fn: object) -> None:
    t = threading.Thread(target=fn, name="hookwire-threads")  # type: ignore[arg-type]
    t.start()
    t.join()


def worker_binding(ranks: int, available: list[int] | None = None) -> str | None:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` worker processes: each rank its
    share of this process's cores, one core left to the front and vLLM's engine-core
    process where there are more cores than ranks (vLLM's own binding reserves one too,
    but wants a NUMA node per rank and refuses otherwise). None where the operator set it
    or on CUDA (vLLM's own placement)."""
    if _OPERATOR_BIND is not None or torch.cuda.is_available():
        return None
    available = cores() if available is None else available
    usable = available[:-1] if len(available) > ranks else available
    share = max(1, len(usable) // ranks)
    parts = []
    for rank in range(ranks):
        mine = usable[rank * share:(rank + 1) * share] or [usable[rank % len(usable)]]
        parts.append(",".join(str(c) for c in mine))
    return "|".join(parts)


#: The cores a vLLM model's worker processes leave to the front (``front_cores``), for its
#: engine-core process, which reads it when vLLM starts it (vllm_scheduler).
FRONT_CORES_ENV = "HOOKWIRE_VLLM_FRONT_CORES"

#: The process that set FRONT_CORES_ENV (the server): its own threads are not the
#: engine core's, whatever the variable says.
_front_pid: int | None = None


def front_cores(binding: str | None, available: list[int] | None = None) -> list[int]:
    """The cores of ``available`` (default: this process's) that ``binding`` (a
    ``worker_binding``) leaves to the front; [] when it leaves none, or without one."""
    if not binding:
        return []
    available = cores() if available is None else available
    taken = {int(c) for part in binding.split("|") for c in part.split(",") if c.strip()}
    return [c for c in available if c not in taken]


def keep_to(cores_: list[int], *, process: bool = False) -> bool:
    """Binds the calling thread (``process``: every thread of this process) to
    ``cores_``; False where it could not (the cores are not this process's to use), and
    nothing for [].

    Why (measured with tests/bench/bench_serving.py, docs/benchmarks.md): a worker's
    step sends the front its step messages; the thread they wake (the link's) was placed
    by the kernel on the core it was woken from, the worker's, and took that core from
    the worker mid-step, as vLLM's engine-core process did, which polls for the
    worker's results (py-spy: 14% of a steering step's worker time in the send that
    woke it). On 2 cores with a slow, shared host, keeping the whole front and the
    engine core off the worker's core raised S3 / S1 (a steering rule on every call)
    from 0.80 to 0.94; on the same host quiet, keeping the link threads and the engine
    core to it measured the same as not (0.89 both, medians of 9). It is kept for the
    first case and costs nothing in the second (docs/benchmarks.md, the fifth round)."""
    if not cores_:
        return False
    threads = [int(t) for t in os.listdir("/proc/self/task")] if process else [0]
    done = False
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores_)
            done = True
        except OSError:  # a thread that ended meanwhile, or cores outside the cpuset
            pass
    return done


def hand_front_cores(cores_: list[int]) -> None:
    """Sets out ``cores_`` (the front's) for the engine-core process of the vLLM model
    that starts next, in FRONT_CORES_ENV; [] takes them back (a model without worker
    processes, or whose workers leave none)."""
    global _front_pid
    if cores_:
        os.environ[FRONT_CORES_ENV] = ",".join(str(c) for c in cores_)
        _front_pid = os.getpid()
    else:
        os.environ.pop(FRONT_CORES_ENV, None)


def keep_engine_core() -> bool:
    """In vLLM's engine-core process (its scheduler): binds every thread of the process
    to the cores the front set out in FRONT_CORES_ENV; False when none are set, and in
    the process that set them (an in-process model's scheduler runs in the server)."""
    if _front_pid == os.getpid():
        return False
    raw = os.environ.get(FRONT_CORES_ENV, "")
    cores_ = [int(c) for c in raw.split(",") if c.strip().isdigit()]
    return keep_to(cores_, process=True)


def operator_binding() -> str | None:
    """The operator's VLLM_CPU_OMP_THREADS_BIND (None: unset)."""
    return _OPERATOR_BIND
