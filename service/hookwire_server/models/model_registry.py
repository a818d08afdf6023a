"""The hosted models: one ModelHost per model, each with its own worker thread.

A model's forward passes, and every change to its torch hooks, run on that
model's single worker thread: train/eval mode and the hook dictionaries are
module state, so one thread owning them makes them race-free, while other
models and the event loop carry on.

The registry also knows the models that are still loading or failed to load
(ModelState), so callers learn why a configured model cannot run yet.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import logging
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import torch
from torch import nn

from hookwire.wire import codec as _codec
from hookwire.v1 import model_service_pb2

from .batch_settings import BatchSettings, model_dimensions
from ..errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, Unimplemented
from .module_patterns import PathIndex
from .positions import position_limit
from .worker import DaemonWorker

log = logging.getLogger("hookwire.models")
T = TypeVar("T")
#: Patterns a model remembers the resolution of (oldest forgotten first).
RESOLVED_PATTERNS = 256


def _wire_dtype_or_unspecified(dtype: Any) -> int:
    try:
        return _codec.wire_dtype_of(dtype)
    except _codec.CodecError:
        return 0  # DTYPE_UNSPECIFIED: a parameter dtype the wire cannot carry (e.g. complex)


def is_causal_lm(module: nn.Module) -> bool:
    """Whether ``module`` generates text token by token: a transformers model whose
    ``can_generate()`` is true and that is not an encoder-decoder (GPT-2, Llama and
    every other ``*ForCausalLM``; not BertModel, not T5). Duck-typed, so that this
    module never imports transformers."""
    can_generate = getattr(module, "can_generate", None)
    if not callable(can_generate) or not callable(getattr(module, "generate", None)):
        return False
    try:
        generates = bool(can_generate())
    except Exception:  # a custom can_generate that fails: it does not generate
        return False
    return generates and not getattr(getattr(module, "config", None), "is_encoder_decoder", False)


def _copy_or_none(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception as exc:  # a tokenizer that cannot be copied: texts are left empty
        log.warning("the tokenizer cannot be copied for decoding (%r); Generate's texts stay empty", exc)
        return None


#: When captures copy to the host asynchronously (hooks/deferred.py), the model config's
#: ``async_captures``.
ASYNC_CAPTURE_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """A model config's batching keys; None takes the server's default."""

    batching: bool | None = None
    max_batch_size: int | None = None
    max_batch_delay_ms: float | None = None
    batch_dim: int | None = None
    batch_reducing_inputs: tuple[str, ...] | None = None
    pad_token_id: int | None = None
    batch_padding: bool | None = None

    def resolve(self, defaults: BatchSettings, host: ModelHost | None = None) -> BatchSettings:
        """The settings in force: these keys over ``defaults``; the pad token from the
        config, else the model's tokenizer, else its transformers config."""
        pad = self.pad_token_id
        if pad is None and host is not None:
            pad = _pad_token_id(host)
        return BatchSettings(
            enabled=defaults.enabled if self.batching is None else self.batching,
            max_batch_size=defaults.max_batch_size if self.max_batch_size is None else self.max_batch_size,
            max_batch_delay_ms=(
                defaults.max_batch_delay_ms if self.max_batch_delay_ms is None else self.max_batch_delay_ms
            ),
            batch_dim=defaults.batch_dim if self.batch_dim is None else self.batch_dim,
            reducing_inputs=(
                defaults.reducing_inputs if self.batch_reducing_inputs is None else tuple(self.batch_reducing_inputs)
            ),
            pad_token_id=pad,
            padding=defaults.padding if self.batch_padding is None else self.batch_padding,
        )


def _pad_token_id(host: ModelHost) -> int | None:
    for owner in (host.tokenizer, getattr(host.module, "config", None)):
        value = getattr(owner, "pad_token_id", None)
        if isinstance(value, int) and value >= 0:
            return value
    return None


def _log_job_failure(future: concurrent.futures.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a job on a model's worker thread failed: %r", future.exception())


@dataclasses.dataclass(frozen=True)
class OutputView:
    """How hooks see a module's output (ModelHost.output_views): ``show(output)`` is what
    they see; ``put(output, edited)`` the module's output once a rule edited the view."""

    show: Callable[[Any], Any]
    put: Callable[[Any, Any], Any]
    #: Its name in runtime.views, by which a worker's hook runtime applies the same view
    #: ("" for one that exists only here).
    name: str = ""


@dataclasses.dataclass(frozen=True)
class ParameterView:
    """A parameter name that answers with part of another parameter (ModelHost.parameter_views):
    ``length`` entries of parameter ``source`` from ``start`` along ``dim``, a view of its
    tensor (``narrow``), never a copy. An engine that fuses or pads weights names the
    parts by the names the transformers model has (vLLM's ``qkv_proj.weight`` holds
    ``q_proj.weight``'s rows, engine/vllm_names.py)."""

    source: str
    dim: int
    start: int
    length: int

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor`` (the source's value), as a view."""
        return tensor.narrow(self.dim, self.start, self.length)


class ModelHost:
    """One hosted model, the thread that runs it, and its tokenizer if it has one."""

    def __init__(
        self, name: str, module: nn.Module, *, description: str = "", training_allowed: bool = True,
        tokenizer: Any = None, tokenizer_problem: str = "", batching: BatchConfig | None = None,
        parameters_readable: bool = False, async_captures: str = "auto",
        memory_bytes_per_input_element: float | None = None,
    ) -> None:
        if not name:
            raise ValueError("a model needs a name")
        self.name = name
        self.module = module.eval()
        self.description = description
        self.training_allowed = training_allowed
        #: Whether GetParameters may read its weights (the model config's parameters_readable).
        self.parameters_readable = parameters_readable
        #: When captures copy to the host asynchronously (deferred.py): "auto" (tensors on
        #: an accelerator), "on" (CPU tensors too, cloned), "off".
        if async_captures not in ASYNC_CAPTURE_MODES:
            raise ValueError(f"async_captures must be one of {', '.join(ASYNC_CAPTURE_MODES)}, not {async_captures!r}")
        self.async_captures = async_captures
        #: A call's peak memory per element of its input tensors, when its config sets it
        #: (models/memory_estimate.py); None: estimated from its config or a probe pass.
        self.memory_bytes_per_input_element = memory_bytes_per_input_element
        #: Captures that were made asynchronously (worker thread adds; tests and operators read).
        self.deferred_captures = 0
        #: Its parameters by every name they have (named_parameters(remove_duplicate=False):
        #: a tied weight, e.g. GPT-2's lm_head.weight, answers to each of its names), in
        #: that order; GetParameters' glob index over them is built when first needed.
        self.parameters: dict[str, nn.Parameter] = dict(module.named_parameters(remove_duplicate=False))
        #: Names GetParameters also answers to, each a part of one of ``parameters``
        #: (ParameterView); a view whose name is a parameter's own answers for it (e.g. an
        #: embedding's rows past the vocabulary trimmed). Set with add_parameter_views.
        self.parameter_views: dict[str, ParameterView] = {}
        #: Names the engine knows the model's own framework has but it cannot answer to,
        #: and why (GetParameters' NotFound says it). Set with add_parameter_views.
        self.parameter_gaps: dict[str, str] = {}
        self._parameter_index: PathIndex | None = None
        #: The model's tokenizer (a transformers tokenizer, prepared by
        #: tokenization.prepare_tokenizer), or None: callers then send input_ids.
        self.tokenizer = tokenizer
        #: Why a tokenizer that was looked for is missing ("" when there is one, or none was looked for).
        self.tokenizer_problem = tokenizer_problem
        #: A copy of the tokenizer that only the event loop uses, to turn generated tokens into
        #: text (a few tokens per step, microseconds): a fast tokenizer must not be used by two
        #: threads at once, and a trip to the tokenizer thread per step would cost more.
        self.detokenizer = _copy_or_none(tokenizer)
        #: Whether the model generates (a causal LM, see is_causal_lm): Tokenize pads on the
        #: left for it by default, as generation needs.
        self.can_generate = is_causal_lm(module)
        # Tokenizing runs on a thread of its own: a fast tokenizer is not safe to call from
        # two threads at once, and a forward pass must not hold it up (nor it a pass).
        self._tokenizer_worker = DaemonWorker(f"tokenizer:{name}") if tokenizer is not None else None
        self.modules: dict[str, nn.Module] = dict(module.named_modules())
        self.paths: list[str] = list(self.modules)
        self._index = PathIndex(self.paths)
        #: Patterns already resolved (module paths never change): most calls repeat theirs.
        self._resolved: dict[str, list[str]] = {}
        self._resolved_lock = threading.Lock()
        self._path_of: dict[int, str] = {id(m): p for p, m in self.modules.items()}
        #: Where its modules live when it was loaded with a device map (accelerate's
        #: hf_device_map: module path -> "cpu", "disk", "cuda:1", ...), else {}.
        self.device_map: dict[str, str] = placement_of(module)
        #: Where inputs and rule operands are decoded to: the device the model's first
        #: module runs on (under a device map, accelerate moves what each module receives to
        #: its own device, and rule operands are cast once per device they edit on).
        self.device = input_device(module, self.device_map)
        #: Whether captures may be deferred at all: "on", or "auto" for a model with weights
        #: on an accelerator (a model wholly on the CPU then pays no check per capture).
        self.defers = async_captures == "on" or (async_captures == "auto" and on_accelerator(module, self.device_map))
        #: The engine that runs it (engine/seam.py: "torch", or another engine's name) and
        #: what that engine refuses (feature -> why); set by whoever makes its engine.
        self.engine = "torch"
        self.refused: Mapping[str, str] = {}
        #: Module path -> how hooks see its output when the engine's module returns it
        #: otherwise than the transformers module does (OutputView); {}: as it is.
        self.output_views: dict[str, OutputView] = {}
        #: Module path -> the module whose torch hooks stand for it, where the engine runs
        #: that module's work inside another (vLLM: lm_head inside logits_processor); {}.
        self.hook_targets: dict[str, nn.Module] = {}
        #: Called (with why) when the model's engine can serve no more calls: the registry
        #: marks it FAILED (set by ModelRegistry.add; None: nobody is told).
        self.on_failure: Callable[[str], None] | None = None
        #: The engine that loaded the model, when one did (engine/vllm_engine.py); None:
        #: the engine layer makes the torch engine on first use.
        self.loaded_engine: Any = None
        #: Where a parameter on the meta device gets its value when the model's weights
        #: live in other processes (vLLM's workers): name -> tensor; None: none do.
        self.parameter_source: Callable[[str], torch.Tensor] | None = None
        #: (module path, hook phase) -> why rules may not edit there on this engine (vLLM's
        #: modules whose values are one rank's shard under tensor parallel); {}: anywhere.
        self.unedited: dict[tuple[str, int], str] = {}
        #: module path -> why no hook may be registered there on this engine (the modules
        #: every vLLM pipeline stage runs); {}: any module.
        self.unhooked: dict[str, str] = {}
        #: The modules hooks may go on inside a compiled model (vLLM's taps: Model.tap_points);
        #: None: the model runs eagerly, every module takes hooks.
        self.tap_points: list[str] | None = None
        #: module path -> the pipeline stage that runs it (vLLM under pipeline parallel);
        #: {}: one stage runs them all.
        self.stage_of: dict[str, int] = {}
        #: Held while hooks are attached, synced or detached on the worker thread: an engine
        #: whose passes run elsewhere (vLLM's worker processes) makes hook changes wait for
        #: the end of a pass; a no-op lock otherwise.
        self.hooks_lock: Any = contextlib.nullcontext()
        #: The hooks whose torch hooks are installed on its modules (hook_record: a live hook
        #: that edits or is listened to), changed under hooks_lock: an engine that decides at
        #: a call's admission whether any hook can touch it (vLLM) reads it.
        self.live_hooks: set[Any] = set()
        #: Called once at shutdown (an engine's processes stop).
        self.closers: list[Callable[[], None]] = []
        self._executor = DaemonWorker(f"model:{name}", idle_trim=True)
        #: Hook firings on this model that passed scope and gating (the hook_fires metric):
        #: a plain counter only the worker thread adds to, as a metric increment per firing
        #: would cost as much as the firing itself.
        self.fires = 0
        #: The calls of the pass running on the worker thread (engine.batching.Batch), read
        #: by hooks as they fire; set and cleared by the engine's pass runner.
        self.current_batch: Any = None
        #: The model config's batching keys (unset ones take the server's defaults).
        self.batch_config = batching or BatchConfig()
        #: The batching settings in force (see ModelRegistry.configure_batching).
        self.batching = self.batch_config.resolve(BatchSettings(), self)
        #: Where the scheduler reports each pass (model, kind, calls, rows, queue delays).
        self.observe_batch: Callable[[str, str, int, int, list[float]], None] | None = None
        self._dimensions: frozenset[int] | None = None

    @property
    def dimensions(self) -> frozenset[int]:
        """Sizes a padded token length avoids (batching.model_dimensions), computed once."""
        if self._dimensions is None:
            self._dimensions = model_dimensions(self.module)
        return self._dimensions

    @property
    def positions(self) -> int | None:
        """The longest sequence the model takes (models.positions: its config's
        n_positions or max_position_embeddings, or its own max_positions), or None."""
        limit = position_limit(self.module)
        return limit.positions if limit is not None else None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs ``fn(*args)`` on the model's worker thread, after what is queued there."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queues ``fn()`` on the model's worker thread without waiting for it (after what
        is queued there, before what comes later); a failure is logged. Any thread."""
        try:
            future = self._executor.submit(fn)
        except RuntimeError:  # shut down: nothing runs any more
            return
        future.add_done_callback(_log_job_failure)

    async def run_tokenizer(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Runs ``fn(*args, **kwargs)`` on the model's tokenizer thread, after what is
        queued there; RuntimeError when the model has no tokenizer."""
        if self._tokenizer_worker is None:
            raise RuntimeError(f"model {self.name!r} has no tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_worker, functools.partial(fn, *args, **kwargs))

    def resolve(self, pattern: str) -> list[str]:
        """The module paths ``pattern`` names; NotFound when none."""
        found = self._resolved.get(pattern)
        if found is None:
            try:
                found = self._index.match(pattern)
            except ValueError as exc:
                raise InvalidArgument(f"module: {exc}") from None
            with self._resolved_lock:  # called from the loop and from compile threads
                if len(self._resolved) >= RESOLVED_PATTERNS:
                    self._resolved.pop(next(iter(self._resolved)))
                self._resolved[pattern] = found
        if not found:
            if "*" in pattern or "?" in pattern:
                raise NotFound(f"pattern {pattern!r} matches no module of model {self.name!r}")
            raise NotFound(f"model {self.name!r} has no module {pattern!r}")
        return list(found)

    def add_parameter_views(self, views: Mapping[str, ParameterView], gaps: Mapping[str, str] | None = None) -> None:
        """Adds names GetParameters answers to with a part of a parameter (see
        ``parameter_views``), and names it cannot answer to with why (``parameter_gaps``).
        ValueError for a view of no parameter or past its source's shape. Before the
        model serves (the glob index is rebuilt)."""
        for name, view in views.items():
            source = self.parameters.get(view.source)
            if source is None:
                raise ValueError(f"parameter view {name!r}: model {self.name!r} has no parameter {view.source!r}")
            if not (0 <= view.dim < source.dim() and view.start >= 0 and view.length >= 0
                    and view.start + view.length <= source.shape[view.dim]):
                raise ValueError(f"parameter view {name!r}: [{view.start}, {view.start + view.length}) along dim "
                                 f"{view.dim} is past {view.source!r}'s shape {list(source.shape)}")
        self.parameter_views.update(views)
        for name in views:
            self.parameter_gaps.pop(name, None)
        self.parameter_gaps.update({k: v for k, v in (gaps or {}).items() if k not in self.parameter_views})
        self._parameter_index = None

    @property
    def parameter_names(self) -> list[str]:
        """Every name GetParameters answers to: ``parameters``' in their order, each
        followed by the views of it that have names of their own, in the order added."""
        parts: dict[str, list[str]] = {}
        for name, view in self.parameter_views.items():
            if name not in self.parameters:
                parts.setdefault(view.source, []).append(name)
        out: list[str] = []
        for name in self.parameters:
            out.append(name)
            out.extend(parts.get(name, ()))
        return out

    @property
    def parameter_index(self) -> PathIndex:
        """The parameter names (see ``parameter_names``) in a PathIndex, for globs. Any
        thread: two threads that build it at once build equal ones."""
        index = self._parameter_index
        if index is None:
            index = self._parameter_index = PathIndex(self.parameter_names)
        return index

    def parameter(self, name: str) -> torch.Tensor:
        """What name ``name`` answers with, for its shape and dtype: the parameter, or the
        view of it (on the meta device when a device map offloaded it: see
        ``parameter_value``). KeyError for a name GetParameters does not answer to."""
        view = self.parameter_views.get(name)
        if view is not None:
            return view.of(self.parameters[view.source])
        return self.parameters[name]

    def parameter_value(self, name: str) -> torch.Tensor:
        """Parameter ``name``'s value (a view's: that part of its source's), also when a
        device map offloaded it (accelerate then leaves a tensor on the meta device in the
        module and keeps the weight on the CPU or on disk, loading it around each forward):
        read from accelerate's weights map. Worker thread (between passes: a pass swaps
        offloaded weights in and out)."""
        view = self.parameter_views.get(name)
        if view is not None:
            return view.of(self._own_value(view.source))
        return self._own_value(name)

    def _own_value(self, name: str) -> torch.Tensor:
        param = self.parameters[name]
        if param.device.type != "meta":
            return param.detach()
        if self.parameter_source is not None:
            return self.parameter_source(name)
        module_path, _, local = name.rpartition(".")
        hook = getattr(self.modules.get(module_path), "_hf_hook", None)
        weights = getattr(hook, "weights_map", None)
        if weights is None:
            raise FailedPrecondition(f"parameter {name!r} of model {self.name!r} is on the meta device "
                                     "and no offload map holds its value")
        return torch.as_tensor(weights[local]).detach()

    def failed(self, reason: str) -> None:
        """The model's engine can serve no more calls (e.g. vLLM failed inside a step):
        the model is marked FAILED with ``reason`` (on_failure). Any thread."""
        if self.on_failure is not None:
            self.on_failure(reason)

    def refuse(self, feature: str, what: str) -> None:
        """Unimplemented when the model's engine refuses ``feature`` (engine/seam.py
        FEATURES); ``what`` names what the caller asked for, in its words."""
        reason = self.refused.get(feature)
        if reason is not None:
            raise Unimplemented(
                f"{what}: model {self.name!r} runs on the {self.engine} engine, which does not support {feature} ({reason})"
            )

    def path_of(self, module: nn.Module) -> str | None:
        """The path of one of this model's modules, or None."""
        return self._path_of.get(id(module))

    def describe(self, *, with_modules: bool) -> model_service_pb2.Model:
        """The model as the wire describes it."""
        msg = model_service_pb2.Model(
            name=self.name, description=self.description, training_allowed=self.training_allowed,
            can_generate=self.can_generate, has_tokenizer=self.tokenizer is not None,
            batching=self.batching.to_proto(), parameters_readable=self.parameters_readable,
            device_map=self.device_map, engine=self.engine, tap_points=self.tap_points or [],
            compiled=self.tap_points is not None,
        )
        for feature, reason in sorted(self.refused.items()):
            msg.refused_features.add(feature=feature, reason=reason)
        if self.tokenizer is not None:  # the ids a Tokenize client needs to form a harvest's contexts
            for name in ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id"):
                value = getattr(self.tokenizer, name, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(msg.tokenizer_ids, name, value)
            msg.tokenizer_ids.SetInParent()
        if with_modules:
            for path, mod in self.modules.items():
                info = msg.modules.add(path=path, type=type(mod).__name__)
                for pname, param in mod.named_parameters(recurse=False):
                    full = f"{path}.{pname}" if path else pname
                    info.parameters.add(
                        name=pname,
                        # A view under the parameter's own name (a padded embedding trimmed) is what GetParameters reads.
                        shape=list(self.parameter(full).shape if full in self.parameter_views else param.shape),
                        dtype=_wire_dtype_or_unspecified(param.dtype),
                        requires_grad=param.requires_grad,
                    )
        return msg

    @property
    def busy(self) -> bool:
        """Whether a pass (or hook change) is running on the worker thread now."""
        return self._executor.busy

    def shutdown(self) -> None:
        """Stops the worker thread after the running pass; queued work is cancelled.
        Does not wait: the thread is a daemon and does not keep the process alive."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        closers, self.closers = self.closers, []
        for close in closers:
            try:
                close()
            except Exception:
                log.exception("closing model %r failed", self.name)
        if self._tokenizer_worker is not None:
            self._tokenizer_worker.shutdown(wait=False, cancel_futures=True)


class ModelState(enum.Enum):
    """Where a configured model is in its life (the wire's ModelState)."""

    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


_WIRE_STATE = {
    ModelState.LOADING: model_service_pb2.MODEL_STATE_LOADING,
    ModelState.READY: model_service_pb2.MODEL_STATE_READY,
    ModelState.FAILED: model_service_pb2.MODEL_STATE_FAILED,
}


@dataclasses.dataclass
class ModelEntry:
    """A configured model: loading, ready (with its host) or failed (with the reason)."""

    name: str
    description: str = ""
    training_allowed: bool = True
    state: ModelState = ModelState.LOADING
    #: Why it failed (FAILED only).
    reason: str = ""
    host: ModelHost | None = None
    parameters_readable: bool = False

    def describe(self, *, with_modules: bool) -> model_service_pb2.Model:
        """The model as the wire describes it; modules only once it is ready."""
        if self.host is not None:
            msg = self.host.describe(with_modules=with_modules)
        else:
            msg = model_service_pb2.Model(
                name=self.name, description=self.description, training_allowed=self.training_allowed,
                parameters_readable=self.parameters_readable,
            )
        msg.state = _WIRE_STATE[self.state]
        msg.state_message = self.reason
        return msg


class ModelRegistry:
    """Models by name, with the state of each configured one (loading, ready, failed)."""

    def __init__(self, hosts: Iterable[ModelHost] = ()) -> None:
        self._entries: dict[str, ModelEntry] = {}
        self._batch_defaults = BatchSettings()
        self._observe: Callable[[str, str, int, int, list[float]], None] | None = None
        self._listeners: list[Callable[[ModelEntry], None]] = []
        for host in hosts:
            self.add(host)

    def configure_batching(
        self, defaults: BatchSettings, observe: Callable[[str, str, int, int, list[float]], None] | None = None,
    ) -> None:
        """The server's batching defaults, for every model (those loaded later too) whose
        config leaves a key unset, and where each model's scheduler reports its passes
        (model, kind, calls, rows, queue delays)."""
        self._batch_defaults = defaults
        self._observe = observe
        for host in self:
            self._configure(host)

    def listen(self, on_change: Callable[[ModelEntry], None]) -> Callable[[], None]:
        """Calls ``on_change(entry)`` after each change of a model's state (listed, READY,
        FAILED), on the thread that made it: the event loop, or an engine's own thread when
        a model fails while serving (ModelHost.failed), so a listener that touches the event
        loop must hand over (call_soon_threadsafe). Returns a function that stops the calls."""
        self._listeners.append(on_change)
        return lambda: self._listeners.remove(on_change) if on_change in self._listeners else None

    def _changed(self, entry: ModelEntry) -> None:
        for listener in list(self._listeners):
            try:
                listener(entry)
            except Exception:  # a listener's failure must not undo the state change
                log.exception("a model state listener failed")

    def _configure(self, host: ModelHost) -> None:
        host.batching = host.batch_config.resolve(self._batch_defaults, host)
        host.observe_batch = self._observe

    def expect(
        self, name: str, *, description: str = "", training_allowed: bool = True, parameters_readable: bool = False,
    ) -> None:
        """Lists a model that is about to load (LOADING); ValueError on a duplicate name."""
        if not name:
            raise ValueError("a model needs a name")
        if name in self._entries:
            raise ValueError(f"two models are named {name!r}")
        entry = self._entries[name] = ModelEntry(name, description, training_allowed, parameters_readable=parameters_readable)
        self._changed(entry)

    def add(self, host: ModelHost) -> None:
        """Hosts one more model, or the loaded one that expect() announced (READY);
        ValueError on a duplicate name."""
        entry = self._entries.get(host.name)
        if entry is not None and entry.state is not ModelState.LOADING:
            raise ValueError(f"two models are named {host.name!r}")
        self._configure(host)
        entry = self._entries[host.name] = ModelEntry(
            host.name, host.description, host.training_allowed, ModelState.READY, host=host,
            parameters_readable=host.parameters_readable,
        )
        host.on_failure = lambda reason: self._failed_while_serving(entry, reason)
        self._changed(entry)

    def _failed_while_serving(self, entry: ModelEntry, reason: str) -> None:
        """A ready model whose engine can serve no more (ModelHost.failed): FAILED with the
        reason; calls are refused from now on (FailedPrecondition naming it). Any thread:
        two plain attribute writes, read by the event loop."""
        entry.reason, entry.state = reason, ModelState.FAILED
        self._changed(entry)

    def fail(self, name: str, reason: str) -> None:
        """Marks a model that expect() announced as FAILED to load, with the reason."""
        entry = self._entries[name]
        entry.state, entry.reason = ModelState.FAILED, reason
        self._changed(entry)

    def get(self, name: str, refuse: Sequence[tuple[str, str]] = ()) -> ModelHost:
        """The ready model named ``name``. InvalidArgument for an empty name, NotFound
        for an unknown one, Unavailable while it loads (retry later),
        FailedPrecondition when it failed to load (it will not become ready);
        Unimplemented when its engine refuses one of the features of ``refuse``
        ((feature, what the caller asked for) pairs: ModelHost.refuse)."""
        if not name:
            raise InvalidArgument("no model named: the model field is empty")
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no model {name!r} (hosted: {', '.join(sorted(self._entries)) or 'none'})")
        if entry.state is ModelState.LOADING:
            raise Unavailable(f"model {name!r} is loading")
        if entry.state is ModelState.FAILED:
            if entry.host is not None:  # it was ready: its engine failed while serving
                raise FailedPrecondition(f"model {name!r} failed while serving: {entry.reason}")
            raise FailedPrecondition(f"model {name!r} failed to load: {entry.reason}")
        assert entry.host is not None
        for feature, what in refuse:
            entry.host.refuse(feature, what)
        return entry.host

    def entry(self, name: str) -> ModelEntry:
        """The configured model named ``name``, in any state; NotFound otherwise."""
        if not name:
            raise InvalidArgument("no model named: the name field is empty")
        entry = self._entries.get(name)
        if entry is None:
            raise NotFound(f"no model {name!r} (hosted: {', '.join(sorted(self._entries)) or 'none'})")
        return entry

    def entries(self) -> list[ModelEntry]:
        """Every configured model, in configuration order, whatever its state."""
        return list(self._entries.values())

    def __iter__(self) -> Iterator[ModelHost]:
        """The ready models."""
        return iter([e.host for e in self._entries.values() if e.host is not None])

    def __len__(self) -> int:
        """How many models are ready."""
        return sum(e.host is not None for e in self._entries.values())

    def shutdown(self) -> None:
        """Stops every model's worker thread (without waiting for a running pass)."""
        for host in self:
            host.shutdown()


def placement_of(module: nn.Module) -> dict[str, str]:
    """A device-mapped model's placement (accelerate's ``hf_device_map``) as names:
    accelerator indices become "cuda:N" (or the machine's accelerator type: "xpu:N", ...);
    {} for a model loaded without a device map."""
    mapping = getattr(module, "hf_device_map", None)
    if not isinstance(mapping, dict):
        return {}
    accelerator = torch.accelerator.current_accelerator()
    kind = accelerator.type if accelerator is not None else "cuda"
    return {str(path): f"{kind}:{device}" if isinstance(device, int) else str(device) for path, device in mapping.items()}


def input_device(module: nn.Module, device_map: dict[str, str]) -> torch.device:
    """Where a model's inputs go: under a device map, the device of its first mapped
    module that holds its weights on an accelerator (modules kept on the CPU or disk take
    CPU inputs: accelerate moves them on); else the device of the first parameter that is
    not on the meta device; else the CPU."""
    if device_map:
        for device in device_map.values():
            if device not in ("cpu", "disk"):
                return torch.device(device)
        return torch.device("cpu")
    for param in module.parameters():
        if param.device.type != "meta":
            return param.device
    return torch.device("cpu")



def on_accelerator(module: nn.Module, device_map: dict[str, str]) -> bool:
    """Whether any of a model's parameters or buffers (or device-map entries) is on an
    accelerator (not the CPU, disk or meta)."""
    if any(device not in ("cpu", "disk") for device in device_map.values()):
        return True
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.device.type not in ("cpu", "meta") for t in tensors)


def forward_parameters(module: Any) -> frozenset[str]:
    """The names the model's forward takes (transformers models take ``attention_mask``
    and, causal LMs, ``use_cache``; the KV cache as ``past_key_values`` or ``cache``)."""
    try:
        return frozenset(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()
