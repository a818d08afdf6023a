"""Taps: hook points compiled into a model (``hookwire::tap``, a ``torch.library`` op).

torch hooks fire in ``nn.Module.__call__``, which a compiled model never runs: torch.compile
traces the modules' code into one graph (vLLM's compiled mode, inductor), and hooks
registered after the trace silently never fire. A tap is the hook call moved into the
graph: ``install`` gives each chosen module a ``forward`` that, while it is being traced,
passes the module's input tensors, and then its output tensors, through the custom op
``hookwire::tap``. The op is opaque to the compiler (it stays a call in the compiled
code; on CUDA it is one of vLLM's splitting ops, so it runs eagerly between CUDA graph
pieces) and functional as the module sees it: it writes what the module goes on with
(the same values unless a hook edited them) into buffers the traced code made for them,
and the tensors it was given stay as they were. When the op runs it fires the module's
registered torch hooks as ``nn.Module.__call__`` would (global hooks first,
``with_kwargs``, a non-None result replacing the input or output; the exceptions are
below), so whatever registers plain torch hooks (hookwire's hook records in the front,
the workers' hook runtime) works unchanged in a compiled model.

- With no hook on the module, the op copies its tensors into the buffers and returns: a
  compiled model without hooks pays one call and one copy per tap (measured:
  docs/benchmarks.md, "Hooks that survive compilation").
- Run eagerly (no compiler: ``torch.compiler.is_compiling()`` is false), a tapped module is
  the module as it was: ``__call__`` fires its hooks itself.
- What the graph can carry: tensors, at the top level of the arguments (positional and
  keyword) and of the output (a tensor, or a tuple or list of them). ``None`` and plain
  numbers are passed to hooks as they were traced; anything else (nested structures,
  objects, symbolic sizes) reaches hooks as ``None``. An edit must keep each tensor's
  shape, dtype and device (the compiled code was specialized on them) and leave the
  traced constants as they were: ``TapError`` says which. A module's hooks fire as
  ``__call__`` fires them, except that ``always_call`` hooks do not run when the
  compiled step raises.

Each tap is named in the graph by a string constant (``"<model>/<path>|<phase>|<layout>"``,
the model's name percent-encoded) that the op resolves through ``install``'s table in the
running process, so a compiled graph loaded from vLLM's cache in a fresh process finds
the same modules.
"""

from __future__ import annotations

import functools
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

#: The op's qualified name, as vLLM's ``splitting_ops`` lists it.
OP_NAME = "hookwire::tap"

#: The tapped modules of each model in this process: tag -> path -> module.
_MODULES: dict[str, dict[str, nn.Module]] = {}

#: Attribute of a tapped module: its tap's name (``<tag>/<path>``).
_ATTRIBUTE = "_hookwire_tap"


class TapError(RuntimeError):
    """A hook at a tap returned what the compiled model cannot take (a changed shape,
    dtype or device, a tensor where there was None, a changed traced constant, another
    number of items)."""


def _define() -> Any:
    """The op's library (defined once per process: importing this module again under
    another name must not define it twice)."""
    namespace = getattr(torch.ops, "hookwire", None)
    if namespace is not None and hasattr(namespace, "tap"):
        return None
    # torch.library.Library rather than torch.library.custom_op: the latter's Python
    # wrapper costs about ten times more per call (measured: 40 against 4 microseconds).
    lib = torch.library.Library("hookwire", "DEF")
    # The results go into buffers the traced code made (``out``, mutated), as vLLM's own
    # splitting ops write theirs: on CUDA the pieces around a tap are CUDA graphs that
    # replay on the addresses they were captured with, which a tensor the op allocated
    # would not keep.
    lib.define("tap(str name, Tensor[] tensors, Tensor(a!)[] out) -> ()")
    lib.impl("tap", _run, "CompositeExplicitAutograd")
    torch.library.register_fake("hookwire::tap", lib=lib)(_fake)
    return lib


def _fake(name: str, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    return None


# ------------------------------------------------------------------ layouts
#
# A layout says which top-level items of a module's arguments or output are tensors
# (``T``), None (``N``), plain numbers (``i<int>``, ``f<float>``, ``b0``/``b1``), or
# something else (``?``: hooks see None). Arguments: positional items, then ``;``, then
# keyword items as ``key=item``, all comma-separated. Outputs: one item, or ``(`` items
# ``)`` for a tuple, ``[`` items ``]`` for a list. It is built while tracing (constant
# strings: the compiler folds them) and parsed once per tap when the op first runs.


def _item(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "T"
    if value is None:
        return "N"
    if isinstance(value, bool):
        return "b1" if value else "b0"
    if isinstance(value, int):
        return "i" + str(value)
    if isinstance(value, float):
        return "f" + repr(value)
    return "?"


def _constant(item: str) -> Any:
    if item == "N" or item == "?":
        return None
    if item[0] == "b":
        return item == "b1"
    if item[0] == "i":
        return int(item[1:])
    if item[0] == "f":
        return float(item[1:])
    raise ValueError(f"unknown tap layout item {item!r}")


def _inputs_layout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    positional = ",".join(_item(a) for a in args)
    keywords = ",".join(k + "=" + _item(v) for k, v in kwargs.items())
    return positional + ";" + keywords


def _output_layout(output: Any) -> str:
    if isinstance(output, tuple):
        return "(" + ",".join(_item(o) for o in output) + ")"
    if isinstance(output, list):
        return "[" + ",".join(_item(o) for o in output) + "]"
    return _item(output)


def _quoted(tag: str) -> str:
    """``tag`` as a tap's name carries it (a model's name may hold ``/`` or ``|``)."""
    return urllib.parse.quote(tag, safe="")


def _split(items: str) -> list[str]:
    return items.split(",") if items else []


@functools.lru_cache(maxsize=None)
def _parse(name: str) -> tuple[str, str, str, list[str], list[tuple[str, str]], str]:
    """(tag, path, phase, positional items, keyword items, output layout)."""
    where, phase, inputs, output = (name.split("|") + [""])[:4]
    quoted, _, path = where.partition("/")
    tag = urllib.parse.unquote(quoted)
    positional, _, keywords = inputs.partition(";")
    pairs = [tuple(kv.split("=", 1)) for kv in _split(keywords)]
    return tag, path, phase, _split(positional), [(k, v) for k, v in pairs], output


def _rebuild(items: list[str], tensors: Iterable[torch.Tensor]) -> list[Any]:
    it = iter(tensors)
    return [next(it) if item == "T" else _constant(item) for item in items]


def _output_items(layout: str) -> tuple[str, list[str]]:
    if layout[:1] in ("(", "["):
        return layout[0], _split(layout[1:-1])
    return "", [layout]


# ------------------------------------------------------------------ the op


def _run(name: str, tensors: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
    """The op: fire the module's hooks on ``tensors`` (a pre tap: the module's input
    tensors; a post tap: its input tensors, then its output tensors) and write what the
    module goes on with (the input, or the output; edited or not) into ``out``, buffers
    the traced code made for them (see the module docstring)."""
    tag, path, phase, positional, keywords, out_layout = _parse(name)
    module = _MODULES.get(tag, {}).get(path)
    given = list(tensors)
    mine = given[len(given) - len(out):]
    if module is None or not _listened(module, phase):
        for o, t in zip(out, mine):  # nothing listens: the tap costs one copy
            o.copy_(t)
        return
    inputs = given[:len(given) - len(out)] if phase == "post" else given
    values = _rebuild(positional + [v for _, v in keywords], inputs)
    args = tuple(values[:len(positional)])
    kwargs = {k: v for (k, _), v in zip(keywords, values[len(positional):])}
    if phase == "pre":
        args, kwargs = _fire_pre(module, args, kwargs)
        if set(kwargs) != {k for k, _ in keywords}:
            raise TapError(f"a hook on {path!r} (compiled in: a tap) changed the names of its keyword arguments "
                           f"({', '.join(k for k, _ in keywords) or 'none'}) to {', '.join(kwargs) or 'none'}: "
                           "the compiled model cannot take them")
        new = _flatten(positional, list(args), path, "input") + _flatten(
            [v for _, v in keywords], [kwargs[k] for k, _ in keywords], path, "input")
        _write(new, mine, out, path)
        return
    kind, items = _output_items(out_layout)
    rebuilt = _rebuild(items, mine)
    output: Any = tuple(rebuilt) if kind == "(" else rebuilt if kind == "[" else rebuilt[0]
    output = _fire_post(module, args, kwargs, output)
    if kind and not isinstance(output, (tuple, list)):
        raise TapError(f"a hook on {path!r} (compiled in: a tap) replaced its output's "
                       f"{'tuple' if kind == '(' else 'list'} by {type(output).__name__}")
    new_items = list(output) if kind else [output]
    _write(_flatten(items, new_items, path, "output"), mine, out, path)


def _listened(module: nn.Module, phase: str) -> bool:
    """Whether ``module`` has hooks of ``phase`` (its own or global ones)."""
    if phase == "pre":
        return bool(module._forward_pre_hooks or nn.modules.module._global_forward_pre_hooks)
    return bool(module._forward_hooks or nn.modules.module._global_forward_hooks)


def _fire_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``nn.Module.__call__``'s forward pre-hooks, in its order and with its rules."""
    hooks: list[tuple[int | None, Any]] = [(None, h) for h in nn.modules.module._global_forward_pre_hooks.values()]
    hooks += list(module._forward_pre_hooks.items())
    for hook_id, hook in hooks:
        if hook_id is not None and hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError("forward pre-hook must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result}.")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _fire_post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """``nn.Module.__call__``'s forward hooks, in its order and with its rules (global
    hooks first; those registered ``with_kwargs`` get the keyword arguments). Hooks
    registered ``always_call`` run as the others: a forward that raises inside a compiled
    model raises out of the whole compiled step."""
    module_globals = nn.modules.module
    hooks: list[tuple[bool, Any]] = [
        (hook_id in module_globals._global_forward_hooks_with_kwargs, h)
        for hook_id, h in module_globals._global_forward_hooks.items()]
    hooks += [(hook_id in module._forward_hooks_with_kwargs, h) for hook_id, h in module._forward_hooks.items()]
    for with_kwargs, hook in hooks:
        result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
        if result is not None:
            output = result
    return output


def _flatten(items: list[str], values: list[Any], path: str, what: str) -> list[torch.Tensor]:
    """The tensors among ``values`` where ``items`` (their layout) has tensors; TapError
    where a hook changed what the compiled code cannot take: the number of items, a
    tensor into something else or back, a traced constant (a number, None)."""
    if len(values) != len(items):
        raise TapError(f"a hook on {path!r} (compiled in: a tap) changed the number of its {what}'s items "
                       f"from {len(items)} to {len(values)}")
    out = []
    for i, (item, value) in enumerate(zip(items, values)):
        if item == "T":
            if not isinstance(value, torch.Tensor):
                raise TapError(f"a hook on {path!r} (compiled in: a tap) replaced tensor {i} of its {what} "
                               f"by {type(value).__name__}")
            out.append(value)
        elif isinstance(value, torch.Tensor):
            raise TapError(f"a hook on {path!r} (compiled in: a tap) put a tensor where its {what} had "
                           f"{'None' if item == 'N' else 'no tensor'} (item {i}): the compiled model cannot take it")
        elif not (value is None if item in ("N", "?") else value == _constant(item)):
            raise TapError(f"a hook on {path!r} (compiled in: a tap) changed item {i} of its {what}, which the model "
                           f"was compiled with as a constant ({_constant(item)!r}), to {value!r}")
    return out


def _write(new: list[torch.Tensor], old: list[torch.Tensor], out: Sequence[torch.Tensor], path: str) -> None:
    """Each value the module goes on with into its buffer, once it fits what the graph
    was compiled for (an edit of another shape, dtype or device is refused: ``copy_``
    would broadcast or cast it; strides need not match, the copy lays it out)."""
    for n, o in zip(new, old):
        if n is not o and (n.shape != o.shape or n.dtype != o.dtype or n.device != o.device):
            raise TapError(f"a hook on {path!r} (compiled in: a tap) returned a tensor of shape {tuple(n.shape)}, "
                           f"{n.dtype} on {n.device} where the model has {tuple(o.shape)}, {o.dtype} on {o.device}: "
                           "an edit in a compiled model keeps each tensor's shape, dtype and device")
    for n, buffer in zip(new, out):
        buffer.copy_(n)


_LIBRARY = _define()


# ------------------------------------------------------------------ installing


def _tapped_forward(base: Any) -> Any:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.compiler.is_compiling():
            return base(self, *args, **kwargs)  # eagerly, __call__ fires the hooks itself
        name = getattr(self, _ATTRIBUTE)
        layout = _inputs_layout(args, kwargs)
        inputs = [a for a in args if isinstance(a, torch.Tensor)] + [
            v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        if inputs:
            buffers = [torch.empty_like(t) for t in inputs]
            torch.ops.hookwire.tap(name + "|pre|" + layout, inputs, buffers)
            new = iter(buffers)
            args = tuple(next(new) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: next(new) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            inputs = [a for a in args if isinstance(a, torch.Tensor)] + [
                v for v in kwargs.values() if isinstance(v, torch.Tensor)]
        output = base(self, *args, **kwargs)
        out_layout = _output_layout(output)
        parts = list(output) if isinstance(output, (tuple, list)) else [output]
        mine = [p for p in parts if isinstance(p, torch.Tensor)]
        if not mine:
            return output
        buffers = [torch.empty_like(t) for t in mine]
        torch.ops.hookwire.tap(name + "|post|" + layout + "|" + out_layout, inputs + mine, buffers)
        got = iter(buffers)
        parts = [next(got) if isinstance(p, torch.Tensor) else p for p in parts]
        if isinstance(output, tuple):
            # A named tuple stays one (its class takes the items as arguments).
            return type(output)(*parts) if hasattr(output, "_fields") else tuple(parts)
        if isinstance(output, list):
            return parts
        return parts[0]
    return forward


#: Each module class's tapped subclass.
_CLASSES: dict[type, type] = {}


def _tapped_class(cls: type[nn.Module]) -> type:
    """``cls`` with a tapped forward (one subclass per module class, keeping its name:
    what describes a module by its class name sees the same)."""
    tapped = _CLASSES.get(cls)
    if tapped is None:
        tapped = _CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": _tapped_forward(cls.forward), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_hookwire_tapped": True})
    return tapped


def install(tag: str, model: nn.Module, paths: Sequence[str], prefix: str = "") -> list[str]:
    """Taps each module of ``model`` at ``paths`` (before the model is compiled: a graph
    traced earlier has no taps), registered under ``tag`` (one model of this process; a
    graph's tap names carry it) with ``prefix`` + path as its name. Returns the paths
    tapped. A module tapped already keeps its tap."""
    modules = dict(model.named_modules())
    table = _MODULES.setdefault(tag, {})
    done = []
    for path in paths:
        module = modules[path]
        name = prefix + path
        table[name] = module
        if not getattr(type(module), "_hookwire_tapped", False):
            module.__class__ = _tapped_class(type(module))
        object.__setattr__(module, _ATTRIBUTE, f"{_quoted(tag)}/{name}")
        done.append(path)
    return done


def forget(tag: str) -> None:
    """Drops ``tag``'s table (its model went away)."""
    _MODULES.pop(tag, None)


def tapped(module: nn.Module) -> bool:
    """Whether ``module`` has a tap."""
    return bool(getattr(type(module), "_hookwire_tapped", False))
