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


async def _hooks(ns: argparse.Namespace) -> int:
    async with connect(ns.target) as client:
        if ns.hooks_command == "list":
            hooks = await client.list_hooks(model=ns.model or "", session_id=ns.session or "")
            print(f"{'id':<36} {'model':<18} {'modules':<28} {'scope':<8} {'session':<12} "
                  f"{'fires':>8} {'sent':>8} {'dropped':>8} {'errors':>6}  status")
            for h in hooks:
                status = f"disabled: {h.disabled_reason}" if h.disabled_reason else (
                    f"expires {h.expires:%H:%M:%S}" if h.expires else "active")
                print(f"{h.hook_id:<36} {h.model:<18} {h.module_pattern or '<root>':<28} {h.scope:<8} "
                      f"{(h.session_id or '-')[:12]:<12} {h.fire_count:>8} {h.events_sent:>8} "
                      f"{h.events_dropped:>8} {h.errors:>6}  {status}")
            return 0
        missing = 0
        for hook_id in ns.ids:
            removed = await client.deregister_hook(hook_id)
            print(f"{hook_id}: {'removed' if removed else 'not found'}")
            missing += not removed
        return 1 if missing else 0


def _tap(ns: argparse.Namespace) -> int:
    from ._tap import run_tap

    try:
        return asyncio.run(run_tap(
            ns.target, ns.model, ns.pattern, stats=ns.stats, every=ns.every, scope=ns.scope,
            interval=ns.interval, duration=ns.duration, plain=ns.plain or not sys.stdout.isatty(),
        ))
    except KeyboardInterrupt:
        print("tap stopped; its hooks were removed with its session")
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

    tap = sub.add_parser("tap", help="live view of the matched modules: calls/s, summary statistics, drops")
    tap.add_argument("model")
    tap.add_argument("pattern", help="module path or glob, e.g. 'encoder.layers.*'")
    tap.add_argument("--stats", action="store_true", help="show mean/std/min/max/norm/NaN of each module's output")
    tap.add_argument("--every", type=int, default=1, metavar="N", help="sample every N-th call (cheaper)")
    tap.add_argument("--scope", choices=["all", "session"], default="all", help="watch every caller (default) or only this session")
    tap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tap.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    tap.add_argument("--plain", action="store_true", help="append tables instead of redrawing (default when not a terminal)")
    tap.add_argument("--target", default=target_default, help=f"server host:port (default {target_default})")

    hooks = sub.add_parser("hooks", help="list or remove registered hooks")
    hooks_sub = hooks.add_subparsers(dest="hooks_command", required=True)
    hooks_list = hooks_sub.add_parser("list", help="every hook, with its statistics")
    hooks_list.add_argument("--model", help="only hooks on this model")
    hooks_list.add_argument("--session", help="only hooks of this session")
    hooks_list.add_argument("--target", default=target_default, help=f"server host:port (default {target_default})")
    hooks_rm = hooks_sub.add_parser("rm", help="remove hooks by id")
    hooks_rm.add_argument("ids", nargs="+", metavar="ID")
    hooks_rm.add_argument("--target", default=target_default, help=f"server host:port (default {target_default})")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hookwire`` command; returns the exit status."""
    ns = build_parser().parse_args(argv)
    if ns.command == "serve":
        return _serve(ns)
    if ns.command == "tap":
        try:
            return _tap(ns)
        except HookwireError as exc:
            print(f"hookwire tap: {exc}", file=sys.stderr)
            return 1
    commands = {"models": _models, "inspect": _inspect, "hooks": _hooks}
    try:
        return asyncio.run(commands[ns.command](ns))
    except HookwireError as exc:
        print(f"hookwire {ns.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
