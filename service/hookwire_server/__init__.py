"""The hookwire server: hosts PyTorch models and lets gRPC clients hook them.

Layering: ``servicers`` (gRPC only) translate requests into calls on the domain
modules (``model_registry``, ``hook_specs``, ``hook_record``, ``hook_manager``,
``event_bus``, ``inference``, ``tokenization``), which never import grpc.
"""

from .model_loading import ModelConfig, build_registry, demo_configs
from .model_registry import ModelHost, ModelRegistry
from .server import HookwireServer, ServerSettings, serve

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
