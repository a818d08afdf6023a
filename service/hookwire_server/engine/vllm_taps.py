"""vLLM's worker with taps (runtime.taps): the worker class hookwire starts a compiled
vLLM model with (``worker_cls``), and the tap points of a vLLM model.

vLLM compiles the model's core (the module its ``@support_torch_compile`` decorates: for
Llama, ``model``) when it first runs it, at start-up, after it loaded the weights. The
taps have to be in the modules' code before that trace, so they go in right after
``load_model``: ``TappedWorker`` is the platform's own worker class with that one step
added (vLLM's ``worker_extension_cls`` may only add methods, not override them). What it
taps comes with vLLM's config (``additional_config["hookwire"]``: the model's name and
its ``tap_points`` globs), which vLLM hashes into its compilation cache's key: a graph
cached with other tap points is never reused.

Modules outside the compiled core (the root, the logits processor) run eagerly in either
mode: their torch hooks fire as ever, so they need no tap and stay hookable.
"""

from __future__ import annotations

import hashlib
import logging
import pathlib
from collections.abc import Sequence
from typing import Any

from torch import nn

from ..models.model_loading import ConfigError
from ..models.model_registry import ModelHost
from ..models.module_patterns import match_paths
from ..runtime import taps

log = logging.getLogger("hookwire.vllm")

#: The key of hookwire's part of vLLM's ``additional_config``.
CONFIG_KEY = "hookwire"

#: ``[models.vllm] tap_points`` unset: the default points (``default_points``).
DEFAULT = "default"


def compiled_cores(model: nn.Module) -> list[str]:
    """The paths of ``model``'s modules that vLLM compiles (its ``support_torch_compile``
    modules that compile)."""
    from vllm.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    return [path for path, m in model.named_modules()
            if isinstance(m, TorchCompileWithNoGuardsWrapper) and not getattr(m, "do_not_compile", False)]


def in_core(path: str, cores: Sequence[str]) -> bool:
    """Whether module ``path`` is one of the compiled ``cores`` or runs inside one (vLLM
    calls a core's compiled code without ``nn.Module.__call__``: not even the core's own
    hooks fire)."""
    return any(not core or path == core or path.startswith(core + ".") for core in cores)


def default_points(model: nn.Module) -> list[str]:
    """The default tap points of ``model``, found by shape rather than by name (vLLM's
    models name them differently): in each compiled core, its embeddings (its direct
    children that are embeddings), every decoder layer (the items of its longest module
    list), each layer's attention and MLP (its direct children whose class says so:
    ``...Attention``, ``...MLP`` / ``...MLPBlock`` / ``...FeedForward`` / ``...MoE...`` /
    ``...MoeBlock``), the attention's output
    projection (its last direct child that is a linear layer: its input is where the
    heads are still separate) and the final norm (the core's direct children that are
    norms, after the layers)."""
    found: list[str] = []
    modules = dict(model.named_modules())
    for core in compiled_cores(model):
        top = modules[core]
        prefix = core + "." if core else ""
        lists = [(name, child) for name, child in top.named_children() if isinstance(child, nn.ModuleList)]
        layers_name, layers = max(lists, key=lambda item: len(item[1]), default=("", nn.ModuleList()))
        for name, child in top.named_children():
            if _kind(child) == "embedding":
                found.append(prefix + name)
        for index, layer in enumerate(layers):
            at = f"{prefix}{layers_name}.{index}"
            found.append(at)
            for name, child in layer.named_children():
                kind = _kind(child)
                if kind == "attention":
                    found.append(f"{at}.{name}")
                    linears = [n for n, c in child.named_children() if _kind(c) == "linear"]
                    if linears:
                        found.append(f"{at}.{name}.{linears[-1]}")
                elif kind == "mlp":
                    found.append(f"{at}.{name}")
        after = False
        for name, child in top.named_children():
            after = after or name == layers_name
            if after and _kind(child) == "norm":
                found.append(prefix + name)
    order = {path: i for i, path in enumerate(modules)}
    return sorted(set(found), key=order.__getitem__)


def _kind(module: nn.Module) -> str:
    name = type(module).__name__
    if "Embedding" in name:
        return "embedding"
    if name.endswith("Attention") or name.endswith("SelfAttention"):
        return "attention"
    if name.endswith(("MLP", "MLPBlock")) or "FeedForward" in name or "MoE" in name or "MoeBlock" in name:
        return "mlp"
    if "Norm" in name:
        return "norm"
    if "Linear" in name:
        return "linear"
    return ""


def tap_points(model: nn.Module, patterns: Sequence[str] | str) -> list[str]:
    """The modules of ``model`` that ``patterns`` (module globs as hooks' ``module`` takes
    them: ``*`` within a dotted segment, ``**`` across) name, or the default points
    (``DEFAULT``), that run inside a compiled core but are not a core (the only ones a tap
    is needed for and works on), in the model's order."""
    cores = compiled_cores(model)
    paths = [path for path, _ in model.named_modules()]
    if patterns == DEFAULT:
        found = set(default_points(model))
    else:
        found = {path for pattern in patterns for path in match_paths(pattern, paths)}
    return [path for path in paths if path in found and path not in cores and in_core(path, cores)]


def install(model: nn.Module, config: dict[str, Any]) -> list[str]:
    """Taps ``model`` as ``config`` (``additional_config["hookwire"]``) says; the paths."""
    points = tap_points(model, config.get("tap_points", DEFAULT))
    return taps.install(str(config["model"]), model, points)


def merge(answers: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Every rank's tap points and compiled cores as one (pipeline stages tap their own
    layers; tensor-parallel ranks the same ones), in the first answer's order; None when
    the ranks run the model eagerly."""
    given = [a for a in answers if a]
    if not given:
        return None
    points: dict[str, None] = {}
    cores: dict[str, None] = {}
    for answer in given:
        points.update(dict.fromkeys(answer.get("points", ())))
        cores.update(dict.fromkeys(answer.get("cores", ())))
    return {"points": list(points), "cores": list(cores)}


#: How many tap points a refusal names before it counts the rest.
NAMED = 12


def refuse_untapped(host: ModelHost, points: Sequence[str], cores: Sequence[str],
                    patterns: Sequence[str] | None = None) -> None:
    """A compiled model's host: its tap points (``ModelHost.tap_points``, what ``Model``
    tells clients), and every module inside a compiled core that is no tap point marked
    as taking no hooks (``ModelHost.unhooked``: a hook there would never fire). A model
    vLLM compiles nothing of stays as an eager one (every module takes hooks).
    ConfigError for a glob of ``patterns`` (the model's ``tap_points``) that names no
    module a tap can go on (a typo, a compiled core, a module outside the graph)."""
    if not cores:
        log.warning("model %r: vLLM compiled no part of it: it runs eagerly, every module takes hooks", host.name)
        return
    tapped = set(points)
    for pattern in patterns or ():
        if not any(path in tapped for path in match_paths(pattern, list(host.modules))):
            raise ConfigError(f"model {host.name!r}: vllm.tap_points {pattern!r} names no module inside vLLM's "
                              f"compiled model ({', '.join(cores)}, not the compiled module itself): modules outside "
                              "it take hooks without a tap")
    host.tap_points = list(points)
    named = ", ".join(list(points)[:NAMED]) + (f", ... ({len(points)} in all)" if len(points) > NAMED else "")
    why = (f"it runs inside vLLM's compiled model, where hooks fire only at the model's tap points ({named or 'none'}; "
           "Model.tap_points lists them); add it to tap_points in [models.vllm], or set enforce_eager = true there "
           "(every module takes hooks, the model runs eagerly)")
    whole = (f"vLLM runs its compiled code without nn.Module.__call__, where hooks fire; hook one of the model's tap "
             f"points inside it ({named or 'none'}; Model.tap_points lists them), or set enforce_eager = true in "
             "[models.vllm]")
    for path in host.modules:
        if path in cores:
            host.unhooked.setdefault(path, whole)
        elif path not in tapped and in_core(path, cores):
            host.unhooked.setdefault(path, why)


def code_version() -> str:
    """A hash of the taps' code (this module and runtime/taps.py), for vLLM's compile
    cache key: a graph traced by other tap code is not reused."""
    digest = hashlib.sha256()
    for path in (pathlib.Path(__file__), pathlib.Path(taps.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _platform_worker() -> type:
    """The worker class vLLM's platform would run (its CPU or CUDA worker)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    if current_platform.is_cuda_alike():
        from vllm.v1.worker.gpu_worker import Worker

        return Worker
    raise RuntimeError(f"hookwire's compiled taps run on vLLM's CPU and CUDA builds, not on {current_platform.device_name!r}: "
                       "set enforce_eager = true in [models.vllm]")


def _tapped_worker() -> type:
    class TappedWorker(_platform_worker()):  # type: ignore[misc]
        """The platform's vLLM worker, which taps the model once it is loaded."""

        def load_model(self, *args: Any, **kwargs: Any) -> None:
            super().load_model(*args, **kwargs)
            config = (self.vllm_config.additional_config or {}).get(CONFIG_KEY)
            if config:
                model = self.model_runner.model
                # What hookwire_describe reports (and the in-process engine reads).
                self.hookwire_taps = {"points": install(model, config), "cores": compiled_cores(model)}

    TappedWorker.__module__, TappedWorker.__qualname__ = __name__, "TappedWorker"
    return TappedWorker


def __getattr__(name: str) -> Any:
    # ``TappedWorker`` (vLLM imports it by name, in its worker processes) is made on first
    # use: it subclasses vLLM's worker, and the server imports this module without vLLM.
    if name == "TappedWorker":
        cls = _tapped_worker()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
