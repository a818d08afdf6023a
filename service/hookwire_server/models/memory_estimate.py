"""A call's peak memory, estimated before it runs (memory_budget.py admits it).

Two ways, by what is known of the model:

- **From the model's config** (a transformers model: ``hidden_size``,
  ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size``, ``vocab_size``):
  a closed form in the call's rows and tokens, O(1) per call. It counts what a forward
  pass without gradients keeps alive at its worst moment — the residual stream and its
  normed copy, one layer's attention (queries, keys, values and, for eager attention, the
  scores, their masked copy and the float32 softmax: rows × heads × tokens² each; the
  4-D mask transformers builds for every layer), one layer's MLP, the logits — plus what
  the response holds (its outputs encoded once and serialized once), the KV cache of a
  Generate call, and the captures the call's hooks hold. It is checked against the probe
  below in tests/unit/test_memory_estimate.py: never below it.
- **By a probe pass** for any other module: the forward runs on *fake* tensors
  (torch's FakeTensorMode: shapes and dtypes, no data, no memory) under a dispatch mode
  that tracks every storage the pass allocates and when it dies, which gives the pass's
  exact peak of live tensor bytes for those shapes. It costs one forward's Python
  overhead (tens of milliseconds), so its results are cached per input signature, with
  each size of an integer input (token ids) and the rows of a floating-point one rounded
  up to a step of at most 1.5× (an upper bound for the sizes in that step; a float
  input's other sizes are features, kept exact). It runs on a thread of its own, beside the model's passes (it never waits for a
  running pass); hookwire's hooks do nothing in it (``probing``), whatever pass runs.
  A model whose forward cannot run on fake tensors (data-dependent control flow) is
  estimated from its inputs' bytes (``FALLBACK_FACTOR``) and its config can set
  ``memory_bytes_per_input_element`` instead.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..memory_budget import Estimate

log = logging.getLogger("hookwire.memory")

#: Inputs' bytes times this estimate a pass whose probe cannot run: an honest guess for
#: small models (activations a few times the input), flagged in the log.
FALLBACK_FACTOR = 8
#: Probe results kept per model (input signatures, sizes rounded up: _bucket).
PROBE_CACHE = 256
#: Copies of a call's outputs the response holds at once: the encoded tensor and the
#: serialized message gRPC sends.
WIRE_COPIES = 2


@dataclasses.dataclass(frozen=True)
class TensorShape:
    """A tensor input of a call, as the request describes it: no data."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Nested:
    """A list or map among a call's inputs: only the bytes of its tensors are known (no
    probe pass for such a call)."""

    nbytes: int


#: A call's top-level inputs: positional ones, then keyword ones by name; each a
#: TensorShape, a Nested list or map, or a plain value (int, float, bool, str, None).
Inputs = tuple[tuple[Any, ...], Mapping[str, Any]]


_PROBING = threading.local()


def probing() -> bool:
    """Whether this thread is running a probe pass: hookwire's torch hooks then return at
    once (the probe's fake tensors are nobody's, and a real pass may be running on the
    model's worker thread at the same time)."""
    return getattr(_PROBING, "on", False)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def inputs_bytes(inputs: Inputs) -> int:
    """Bytes of the tensors among ``inputs``."""
    args, kwargs = inputs
    return sum(v.nbytes for v in (*args, *kwargs.values()) if isinstance(v, (TensorShape, Nested)))


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """What the config says of a transformers model's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    #: Whether the model computes logits over the vocabulary (a head on top).
    logits: bool
    #: "eager" (scores materialized), "sdpa" (a fused kernel that may fall back to the
    #: math path with a mask: counted as one scores tensor), "flash..." (none).
    attention: str
    #: Bytes of the model's floating-point parameters' elements.
    itemsize: int
    #: Longest sequence the model takes (its position limit), or None.
    max_positions: int | None


def decoder_shape(module: nn.Module) -> DecoderShape | None:
    """The sizes of a transformers model (its ``config``), or None for a module without
    such a config."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        hidden = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        heads = int(text.num_attention_heads)
    except (AttributeError, TypeError, ValueError):
        return None
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // max(1, heads))
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    vocab = int(getattr(text, "vocab_size", None) or 0)
    get_output = getattr(module, "get_output_embeddings", None)
    has_head = callable(get_output) and get_output() is not None
    attention = str(getattr(config, "_attn_implementation", None) or "eager")
    floating = [p for p in module.parameters() if p.is_floating_point()]
    itemsize = floating[0].element_size() if floating else 4
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    return DecoderShape(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, has_head, attention,
                        itemsize, int(positions) if positions else None)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers in host memory, each storage once
    (tied weights count once; tensors on an accelerator or the meta device not at all)."""
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if t.device.type != "cpu" or t.is_meta:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def decoder_forward(
    shape: DecoderShape, rows: int, tokens: int, *, past: int = 0, logits_tokens: int | None = None,
) -> dict[str, int]:
    """The peak of one forward pass without gradients over ``rows`` × ``tokens`` new tokens
    attending to ``past`` earlier ones, by part (see the module docstring). ``logits_tokens``:
    the positions whose logits are computed (default all)."""
    e = shape.itemsize
    keys = past + tokens
    bt = rows * tokens
    residual = 3 * bt * shape.hidden * e  # the stream, its normed copy, the layer's output
    qkv = bt * (shape.heads + 2 * shape.kv_heads) * shape.head_dim * e
    repeated = 2 * rows * shape.heads * keys * shape.head_dim * e  # keys/values repeated per head (GQA), rotated copies
    score = rows * shape.heads * tokens * keys
    if shape.attention == "eager":
        scores = score * (2 * e + 4)  # the scores, their masked copy, the float32 softmax
    elif shape.attention.startswith("flash"):
        scores = 0
    else:
        scores = score * e
    mask = rows * tokens * keys * e if not shape.attention.startswith("flash") else 0
    attention = qkv + repeated + 2 * bt * shape.hidden * e + scores
    mlp = 3 * bt * shape.intermediate * e + bt * shape.hidden * e
    parts = {
        "activations": residual + max(attention - scores, mlp),
        "attention scores": scores + mask,
    }
    if shape.logits and shape.vocab:
        parts["logits"] = 2 * rows * (tokens if logits_tokens is None else logits_tokens) * shape.vocab * e
    return parts


def kv_cache_bytes(shape: DecoderShape, rows: int, tokens: int) -> int:
    """Bytes of a KV cache holding ``tokens`` positions of ``rows`` sequences."""
    return 2 * shape.layers * rows * shape.kv_heads * shape.head_dim * tokens * shape.itemsize


def _bucket(n: int) -> int:
    """``n`` rounded up to the next of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (steps of at most 1.5×)."""
    if n <= 4:
        return max(n, 0)
    power = 1 << (n - 1).bit_length()  # the next power of two
    return power * 3 // 4 if n <= power * 3 // 4 else power


def _bucketed(value: TensorShape) -> tuple[int, ...]:
    """The shape a probe runs for ``value``: an integer tensor's sizes (token ids, masks)
    rounded up (_bucket); a floating-point one's first size only (its rows), the others
    exact: they are features a layer expects as they are (a Linear(10, ...) refuses 12)."""
    if value.dtype.is_floating_point or value.dtype.is_complex:
        if len(value.shape) < 2:
            return value.shape
        return (_bucket(value.shape[0]), *value.shape[1:])
    return tuple(_bucket(n) for n in value.shape)


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Tracks the storages the ops under it allocate and when each dies: ``peak`` is the
    most bytes alive at once. A storage first seen as an op's input (a parameter, a call's
    input) was not allocated by the pass and is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[Any, int, bool]] = {}
        self.current = 0
        self.peak = 0

    def _see(self, tensors: Sequence[Any], allocated: bool) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata not in self.live:
                    nbytes = storage.nbytes()
                    self.live[ref.cdata] = (ref, nbytes, allocated)
                    if allocated:
                        self.current += nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        self._see(tree_flatten((args, kwargs))[0], False)
        out = func(*args, **kwargs)
        # A view allocates nothing (a view of a parameter shows a storage of its own here:
        # the fake copy of the parameter's).
        self._see(tree_flatten(out)[0], not getattr(func, "is_view", False))
        self.peak = max(self.peak, self.current)
        for key in [k for k, (ref, _, _) in self.live.items() if ref.expired()]:
            _, nbytes, allocated = self.live.pop(key)
            if allocated:
                self.current -= nbytes
        return out


def probe_forward(module: nn.Module, inputs: Inputs) -> tuple[int, int]:
    """Runs ``module`` on fake tensors of ``inputs``' shapes without gradients; returns
    (the pass's peak of live tensor bytes, the bytes of its outputs). Raises whatever the
    forward raises on fake tensors. Blocks; any thread (hookwire's hooks ignore it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_flatten

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        args = [torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, TensorShape) else v for v in inputs[0]]
        kwargs = {k: torch.zeros(v.shape, dtype=v.dtype) if isinstance(v, TensorShape) else v
                  for k, v in inputs[1].items()}
    tracker = _LiveBytes()
    _PROBING.on = True
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # a forward fake tensors cannot run is ours to report, once
    try:
        with torch.no_grad(), fake, tracker:
            out = module(*args, **kwargs)
            outputs = sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
    finally:
        _PROBING.on = False
        quiet.setLevel(level)
    return tracker.peak, outputs


class Estimator:
    """One model's estimates (see the module docstring). ``infer`` and ``generate`` are
    cheap (the event loop); ``cached``/``probe`` are for models without a config."""

    def __init__(self, module: nn.Module, *, bytes_per_input_element: float | None = None) -> None:
        self._module = module
        self.shape = decoder_shape(module)
        self._per_element = bytes_per_input_element
        self._cache: OrderedDict[Any, tuple[int, int] | None] = OrderedDict()
        self._lock = threading.Lock()
        self._failed_once = False

    def resident_bytes(self) -> int:
        """Bytes of the model's parameters and buffers in host memory (what it keeps)."""
        return weight_bytes(self._module)

    @staticmethod
    def token_shape(inputs: Inputs) -> tuple[int, int] | None:
        """(rows, tokens) of a call's token input (``input_ids`` or ``inputs_embeds``,
        by keyword or as the first argument), or None."""
        args, kwargs = inputs
        for name in ("input_ids", "inputs_embeds"):
            value = kwargs.get(name)
            if isinstance(value, TensorShape):
                break
        else:
            value = args[0] if args and isinstance(args[0], TensorShape) else None
        if value is None or not value.shape:
            return None
        shape = value.shape
        if value.dtype.is_floating_point:  # embeddings: (rows, tokens, hidden) or (tokens, hidden)
            shape = shape[:-1]
        if not shape:
            return None
        if len(shape) == 1:
            return 1, shape[0]
        return math.prod(shape[:-1]), shape[-1]

    def cached(self, inputs: Inputs) -> tuple[bool, Any]:
        """(whether ``infer`` can answer for ``inputs`` without a probe, the probe's key)."""
        if self.shape is not None or self._per_element is not None:
            return True, None
        key = self._key(inputs)
        if key is None:
            return True, None
        with self._lock:
            return key in self._cache, key

    @staticmethod
    def _key(inputs: Inputs) -> Any:
        args, kwargs = inputs
        parts: list[Any] = []
        for name, value in (*enumerate(args), *sorted(kwargs.items())):
            if isinstance(value, TensorShape):
                parts.append((name, value.dtype, _bucketed(value)))
            elif isinstance(value, (int, float, bool, str, type(None))):
                parts.append((name, value))
            else:
                return None  # nested lists and maps: no probe
        return tuple(parts)

    def probe(self, key: Any) -> None:
        """Runs the probe for ``key`` (a ``cached`` key) and caches it. Blocks: call it on a
        thread of its own."""
        with self._lock:
            if key in self._cache:
                return
        positional: list[Any] = []
        named: dict[str, Any] = {}
        for part in key:
            name = part[0]
            value = TensorShape(part[2], part[1]) if len(part) == 3 else part[1]
            if isinstance(name, int):
                positional.append(value)
            else:
                named[name] = value
        try:
            result: tuple[int, int] | None = probe_forward(self._module, (tuple(positional), named))
        except Exception as exc:  # data-dependent control flow, an op fake tensors lack
            result = None
            if not self._failed_once:
                self._failed_once = True
                log.warning("memory estimate: the probe pass cannot run on fake tensors (%s: %s); calls are "
                            "estimated from their inputs' bytes (set memory_bytes_per_input_element in the "
                            "model's config for a better figure)", type(exc).__name__, exc)
        with self._lock:
            self._cache[key] = result
            while len(self._cache) > PROBE_CACHE:
                self._cache.popitem(last=False)

    def infer(self, inputs: Inputs, *, captures: int = 0) -> Estimate:
        """The peak of an Infer call of ``inputs`` whose hooks capture at ``captures``
        module outputs (each counted as one hidden-state tensor of the call, twice: the
        copy and its encoding). For a model without a config, after ``probe`` of its key."""
        input_bytes = inputs_bytes(inputs)
        parts: dict[str, int] = {"inputs": input_bytes}
        if self._per_element is not None:
            elements = sum(math.prod(v.shape) for v in (*inputs[0], *inputs[1].values()) if isinstance(v, TensorShape))
            parts["activations"] = int(elements * self._per_element)
            return _total(parts)
        tokens = self.token_shape(inputs) if self.shape is not None else None
        if self.shape is not None and tokens is not None:
            rows, length = tokens
            forward = decoder_forward(self.shape, rows, length)
            parts.update(forward)
            outputs = forward.get("logits", 0) // 2 + rows * length * self.shape.hidden * self.shape.itemsize
            parts["response"] = WIRE_COPIES * outputs
            parts["captures"] = captures * WIRE_COPIES * rows * length * self.shape.hidden * self.shape.itemsize
            return _total(parts)
        key = self._key(inputs) if self._cache else None
        with self._lock:
            probed = self._cache.get(key) if key is not None else None
        if probed is None:
            parts["activations"] = FALLBACK_FACTOR * input_bytes
            parts["captures"] = captures * WIRE_COPIES * input_bytes
            return _total(parts)
        peak, outputs = probed
        parts["activations"] = peak
        parts["response"] = WIRE_COPIES * outputs
        # A captured module's output is at most about the pass's largest tensor; the probe
        # does not tell which, so each capture counts as the outputs' size (or the inputs').
        parts["captures"] = captures * WIRE_COPIES * max(outputs, input_bytes)
        return _total(parts)

    def generate(self, rows: int, prompt: int, new_tokens: int, *, captures: int = 0) -> Estimate:
        """The peak of a Generate call: ``rows`` sequences of ``prompt`` tokens, up to
        ``new_tokens`` more: its prompt pass and its KV cache at full length. Models
        without a config (no Generate on the torch engine without one) count the KV cache
        only as a zero."""
        if self.shape is None:
            return Estimate(0, {})
        total = prompt + new_tokens
        forward = decoder_forward(self.shape, rows, prompt)
        parts = dict(forward)
        parts["KV cache"] = kv_cache_bytes(self.shape, rows, total)
        parts["captures"] = captures * WIRE_COPIES * rows * prompt * self.shape.hidden * self.shape.itemsize
        return _total(parts)


def _total(parts: dict[str, int]) -> Estimate:
    return Estimate(sum(parts.values()), parts)
