"""The hookwire server: hosts PyTorch models and lets gRPC clients hook them.

Layers, each importing only those below it (docs/architecture.md):

- ``api``: the gRPC server and its servicers, which only translate protobuf to calls;
- ``calls``: one module per kind of call (Infer, Generate, Tokenize, GetParameters,
  harvest), which never import grpc;
- ``engine``: what runs the models (scheduler, batching);
- ``hooks``: hook specs and records, rules, captures, slots, sessions, event delivery;
- ``models``: the model registry, loading, module patterns;
- at the root: errors, limits, auth (principals and roles), metrics, logging, and
  ``demo_models`` (the demo factories configs name as ``hookwire_server.demo_models:NAME``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .models.model_loading import ModelConfig, build_registry, demo_configs
    from .models.model_registry import ModelHost, ModelRegistry
    from .api.server import HookwireServer, ServerSettings, serve


def __getattr__(name: str) -> Any:
    # The names in __all__ are imported on first use, not with the package: they import
    # torch (seconds), and `hookwire token new` needs only the torch-free .auth module,
    # which Python imports after this package's __init__.
    module: Any
    if name in ("ModelConfig", "build_registry", "demo_configs"):
        from .models import model_loading as module
    elif name in ("ModelHost", "ModelRegistry"):
        from .models import model_registry as module
    elif name in ("HookwireServer", "ServerSettings", "serve"):
        from .api import server as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # once: later reads skip this function
    return value


__all__ = [
    "HookwireServer",
    "ModelConfig",
    "ModelHost",
    "ModelRegistry",
    "ServerSettings",
    "build_registry",
    "demo_configs",
    "serve",
]
