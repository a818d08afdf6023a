"""The hookwire server: hosts PyTorch models and lets gRPC clients hook them.

Layering: ``servicers`` (gRPC only) translate requests into calls on the domain
modules (``model_registry``, ``hook_specs``, ``hook_record``, ``hook_manager``,
``event_bus``, ``inference``, ``tokenization``), which never import grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model_loading import ModelConfig, build_registry, demo_configs
    from .model_registry import ModelHost, ModelRegistry
    from .server import HookwireServer, ServerSettings, serve


def __getattr__(name: str) -> Any:
    # The names in __all__ are imported on first use, not with the package: they import
    # torch (seconds), and `hookwire token new` needs only the torch-free .auth module,
    # which Python imports after this package's __init__.
    module: Any
    if name in ("ModelConfig", "build_registry", "demo_configs"):
        from . import model_loading as module
    elif name in ("ModelHost", "ModelRegistry"):
        from . import model_registry as module
    elif name in ("HookwireServer", "ServerSettings", "serve"):
        from . import server as module
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
