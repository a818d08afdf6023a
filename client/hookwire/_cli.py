"""The ``hookwire`` command: serve, models, inspect."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from ._client import DEFAULT_TARGET, connect
from ._errors import HookwireError


def _serve(ns: argparse.Namespace) -> int:
    try:
        from hookwire_server import ServerSettings, build_registry, demo_configs, serve
        from hookwire_server.model_loading import ConfigError, load_config_file, parse_model_flag
    except ImportError as exc:
        print(f"hookwire serve needs the server extra (pip install 'hookwire[server]'): {exc}", file=sys.stderr)
        return 2
    from hookwire_server.logging_setup import configure

    configure(ns.log_format, ns.log_level)
    settings = ServerSettings()
    models: list[Any] = []
    try:
        if ns.config:
            server_table, models = load_config_file(ns.config)
            for key in ("host", "port", "max_message_bytes", "grace", "allow_shared_rules", "max_slot_bytes",
                        "max_ttl_seconds", "max_request_bytes", "metrics_port"):
                if key in server_table:
                    current = getattr(settings, key)
                    value = server_table[key]
                    setattr(settings, key, value if current is None else type(current)(value))
        models += [parse_model_flag(text) for text in ns.model]
        if ns.demo or not models:
            models = demo_configs() + models
        registry = build_registry(models)
    except (ConfigError, ValueError) as exc:
        print(f"hookwire serve: {exc}", file=sys.stderr)
        return 2
    if ns.host is not None:
        settings.host = ns.host
    if ns.port is not None:
        settings.port = ns.port
    if ns.allow_shared_rules:
        settings.allow_shared_rules = True
    if ns.metrics_port is not None:
        settings.metrics_port = ns.metrics_port

    def ready(server: Any) -> None:
        names = ", ".join(h.name for h in registry)
        print(f"hookwire serving {names} on {server.target}", flush=True)
        if server.metrics_port is not None:
            print(f"metrics on http://{settings.host}:{server.metrics_port}/metrics", flush=True)

    asyncio.run(serve(registry, settings, on_ready=ready))
    return 0


async def _models(ns: argparse.Namespace) -> int:
    async with connect(ns.target) as client:
        for info in await client.list_models():
            train = "train+eval" if info.training_allowed else "eval only"
            print(f"{info.name}\t{train}\t{info.description}")
    return 0


async def _inspect(ns: argparse.Namespace) -> int:
    async with connect(ns.target) as client:
        info = await client.model(ns.model).info()
    print(f"{info.name}: {info.description}")
    for module in info.modules:
        depth = module.path.count(".") + 1 if module.path else 0
        name = module.path.rsplit(".", 1)[-1] if module.path else "(root)"
        params = ", ".join(f"{p.name} {list(p.shape)} {p.dtype}" for p in module.parameters)
        print(f"{'  ' * depth}{name} ({module.type}){'  ' + params if params else ''}    [{module.path}]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``hookwire`` command."""
    parser = argparse.ArgumentParser(prog="hookwire", description="Remote PyTorch model interception over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    target_default = os.environ.get("HOOKWIRE_TARGET", DEFAULT_TARGET)

    serve = sub.add_parser("serve", help="host models (the demo models when none are given)")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 50051; 0 picks a free one)")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=package.module:factory",
                       help="host the nn.Module a factory returns (repeatable)")
    serve.add_argument("--config", help="a TOML config file with [server] settings and [[models]]")
    serve.add_argument("--demo", action="store_true", help="also host the demo models when --model/--config are given")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    serve.add_argument("--log-format", choices=["text", "json"], default="text", help="log lines as text or JSON")
    serve.add_argument("--log-level", default="info", help="debug, info, warning, error")
    serve.add_argument("--allow-shared-rules", action="store_true",
                       help="allow rules that change values on SCOPE_ALL/SCOPE_TAGGED hooks (other callers' results)")

    models = sub.add_parser("models", help="list the hosted models")
    models.add_argument("--target", default=target_default, help=f"server host:port (default {target_default}; env HOOKWIRE_TARGET)")

    inspect = sub.add_parser("inspect", help="show a model's module tree with types and parameter shapes")
    inspect.add_argument("model")
    inspect.add_argument("--target", default=target_default, help=f"server host:port (default {target_default})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hookwire`` command; returns the exit status."""
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        return _serve(ns)
    try:
        return asyncio.run(_models(ns) if ns.command == "models" else _inspect(ns))
    except HookwireError as exc:
        print(f"hookwire {ns.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
