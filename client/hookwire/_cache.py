"""``RemoteModel.run_with_cache``: one call's captures as a mapping, the way
TransformerLens users hold activations (``cache["encoder.layer.3"]``)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from ._specs import CastName, HookAction, HookSpec, PartName, _PARTS
from ._types import InferResult, InterceptEvent

#: Parts a forward hook captures, and those only a backward hook sees.
_FORWARD_PARTS = ("args", "kwargs", "output")
_BACKWARD_PARTS = ("grad_input", "grad_output")


def cache_key(module: str, part: str = "output", call_index: int = 0) -> str:
    """The key of a capture in an ActivationCache: the module path for its output,
    ``path:part`` for another part ("args", "kwargs", "grad_input", "grad_output"),
    and ``#k`` appended for the k-th call (from 0) of a module that runs more than once
    in the pass: ``"encoder.layer.0"``, ``"encoder.layer.0:args"``, ``"shared#1"``."""
    key = module if part == "output" else f"{module}:{part}"
    return key if call_index == 0 else f"{key}#{call_index}"


def _parts(parts: PartName | Sequence[PartName]) -> tuple[PartName, ...]:
    names: tuple[PartName, ...] = (parts,) if isinstance(parts, str) else tuple(parts)
    if not names:
        raise ValueError("parts: name at least one of " + ", ".join(sorted(_PARTS)))
    unknown = [p for p in names if p not in _PARTS]
    if unknown:
        raise ValueError(f"parts: unknown part(s) {unknown}; parts are {sorted(_PARTS)}")
    return tuple(dict.fromkeys(names))


def cache_hooks(
    modules: str | Sequence[str], parts: PartName | Sequence[PartName], *, select: str = "",
    cast: CastName | None = None, backward: bool = False,
) -> list[HookSpec]:
    """The request-scoped hooks ``run_with_cache`` sends: per module pattern, one forward
    hook capturing the forward parts and, for gradient parts, one full backward hook.
    ValueError for no modules, unknown parts, or gradient parts without a backward pass."""
    patterns = [modules] if isinstance(modules, str) else list(modules)
    if not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise ValueError(f"modules: one or more module paths or globs, not {modules!r}")
    names = _parts(parts)
    forward = tuple(p for p in names if p in _FORWARD_PARTS)
    grads = tuple(p for p in names if p in _BACKWARD_PARTS)
    if grads and not backward:
        raise ValueError(f"parts {list(grads)} are gradients: pass backward=hookwire.Backward(...) as well")
    hooks = []
    for pattern in patterns:
        hooks.append(HookSpec(
            module=pattern,
            posthook=HookAction(forward, select=select, cast=cast) if forward else None,
            posthook_kwargs={"with_kwargs": True} if "kwargs" in forward else None,
            backward_hook=HookAction(grads, select=select, cast=cast) if grads else None,
        ))
    return hooks


def _values(event: InterceptEvent, parts: Iterable[str]) -> Iterator[tuple[str, Any]]:
    for part in parts:
        if part == "output" and event.phase == "forward":
            yield part, event.output
        elif part == "args" and event.phase == "forward":
            yield part, event.args
        elif part == "kwargs" and event.phase == "forward":
            yield part, event.kwargs
        elif part in _BACKWARD_PARTS and event.phase == "backward":
            yield part, getattr(event, part)


class ActivationCache(Mapping[str, Any]):
    """What one ``run_with_cache`` call captured: key -> value, in firing order.

    Keys are module paths for outputs (``cache["encoder.layer.3"]``), ``path:part`` for
    other parts (``"encoder.layer.3:args"``, ``"encoder.layer.3:grad_output"``), with
    ``#k`` appended for the k-th call of a module that ran more than once (see
    ``cache_key``). Values are as captured: a tensor, or the tuple / dict the module
    returned (args are a tuple, kwargs a dict, gradients tuples). Tensors are torch
    tensors when torch is installed, else numpy arrays. Everything is in memory already:
    nothing here blocks or talks to the server.
    """

    def __init__(self, entries: Mapping[str, Any], result: InferResult | None = None) -> None:
        self._entries = dict(entries)
        #: The call's InferResult (its events, request id, input gradients); None when
        #: the cache was built by hand.
        self.result = result

    @classmethod
    def from_result(
        cls, result: InferResult, parts: PartName | Sequence[PartName] = "output", *,
        hooks: Collection[int] | None = None,
    ) -> ActivationCache:
        """The cache of a call's events (the parts named), keyed as ``cache_key`` says.

        ``hooks``: only the events of the request's hooks at these positions (1-based, as
        ``InterceptEvent.request_hook_index``); None for every event. A gradient's ``#k``
        is the forward call it belongs to: autograd runs the backward of a module's later
        calls first, so the server's backward call index counts from the last forward
        call (``cache["shared:grad_output"]`` pairs with ``cache["shared"]``). This holds
        when every call of the module reaches what backward starts from; when an earlier
        call's output does not (detached, unused), the module has fewer gradients than
        calls and they are keyed from #0 up in reverse autograd order all the same (the
        server does not know which forward call a gradient belongs to)."""
        names = _parts(parts)
        events = list(result.events)
        # A server older than request_hook_index marks none: then every event is kept.
        if hooks is not None and any(e.request_hook_index for e in events):
            events = [e for e in events if e.request_hook_index in hooks]
        # The server counts calls per hook and module: so does the remap.
        backward_calls: dict[tuple[str, str], int] = {}
        for event in events:
            if event.phase == "backward":
                key = (event.hook_id, event.module)
                backward_calls[key] = backward_calls.get(key, 0) + 1
        entries: dict[str, Any] = {}
        for event in events:
            index = event.call_index
            if event.phase == "backward":
                index = backward_calls[(event.hook_id, event.module)] - 1 - index
            for part, value in _values(event, names):
                entries[cache_key(event.module, part, index)] = value
        return cls(entries, result)

    def __getitem__(self, key: str) -> Any:
        try:
            return self._entries[key]
        except KeyError:
            near = [k for k in self._entries if k.startswith(key)][:5]
            hint = f"; keys starting with it: {near}" if near else f"; {len(self)} keys, e.g. {list(self._entries)[:5]}"
            raise KeyError(f"{key!r} is not in the cache{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def modules(self) -> tuple[str, ...]:
        """The module paths with a capture, in firing order (each once)."""
        return tuple(dict.fromkeys(k.split(":")[0].split("#")[0] for k in self._entries))

    def keys_matching(self, pattern: str) -> list[str]:
        """The keys a glob matches, in firing order: ``*`` is one path segment, ``**``
        any number, ``?`` one character (as module globs on the server), e.g.
        ``"encoder.layer.*"`` or ``"**.attention.self"``."""
        return [k for k in self._entries if _glob(pattern).fullmatch(k)]

    def stack(self, keys: str | Sequence[str], *, dim: int = 0) -> Any:
        """The tensors of ``keys`` (a list, or a glob as ``keys_matching`` takes)
        stacked along a new dimension ``dim``, e.g. ``cache.stack("encoder.layer.*")``
        -> [layers, batch, seq, hidden] for a logit lens or per-layer norms. ValueError
        when nothing matches, a value is not a tensor, or the shapes differ."""
        names = self.keys_matching(keys) if isinstance(keys, str) else list(keys)
        if not names:
            raise ValueError(f"no cache key matches {keys!r}")
        values = [self[k] for k in names]
        bad = [k for k, v in zip(names, values) if not hasattr(v, "shape")]
        if bad:
            raise ValueError(f"not tensors (tuples or dicts; capture with select=...): {bad[:5]}")
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise ValueError(f"shapes differ across {names[:3]}...: {sorted(shapes)}")
        if type(values[0]).__module__.startswith("torch"):
            import torch

            return torch.stack(values, dim=dim)
        import numpy as np

        return np.stack(values, axis=dim)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor in the cache."""
        return sum(_nbytes(v) for v in self._entries.values())

    def __repr__(self) -> str:
        lines = [f"ActivationCache({len(self)} entries, {self.nbytes / 2**20:.1f} MiB)"]
        for key, value in list(self._entries.items())[:40]:
            lines.append(f"  {key}: {_describe(value)}")
        if len(self) > 40:
            lines.append(f"  ... {len(self) - 40} more")
        return "\n".join(lines)


def _glob(pattern: str) -> re.Pattern[str]:
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.:#]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.:#]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _nbytes(value: Any) -> int:
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return int(value.element_size() * value.numel())
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _describe(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    return type(value).__name__
