"""The server's subcommands of the ``hookwire`` command: ``serve`` and ``token``.

The SDK's command (``hookwire._cli``) knows nothing of the server: it finds these
through the ``hookwire.commands`` entry point group (pyproject.toml), loaded only for
``hookwire --help`` and for a command the SDK does not have itself. Each entry point is
an ``add_command(subparsers, name)`` function that adds its subparser and sets
``command_handler`` (``(argparse.Namespace) -> int``, the exit status) on it.

This module imports no torch and nothing heavy: ``hookwire serve --help`` and ``hookwire
token new`` stay fast (tests/unit/test_fast_cli.py). ``serve`` imports the server when
it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any


def add_serve(sub: Any, name: str = "serve") -> None:
    """Adds ``hookwire serve``: host models."""
    serve = sub.add_parser(
        name, help="host models (the demo models when none are given)",
        description="Settings come from flags, then HOOKWIRE_* environment variables (HOOKWIRE_PORT, "
                    "HOOKWIRE_METRICS_PORT, HOOKWIRE_CONFIG, HOOKWIRE_MODELS=a=pkg.mod:fn,..., ...), then the "
                    "TOML config's [server] table.")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 50051; 0 picks a free one)")
    serve.add_argument("--model", action="append", default=[], metavar="NAME=package.module:factory|NAME=FOLDER",
                       help="host the nn.Module a factory returns, or a Hugging Face model folder (one holding "
                            "config.json; needs the transformers extra) (repeatable); a factory's module is looked "
                            "for in the working directory first, then in the installed packages")
    serve.add_argument("--parameters-readable", action="store_true",
                       help="let users read the weights of the --model entries (GetParameters, hookwire parameters); "
                            "off by default: production weights may be private. Config models say it per model")
    serve.add_argument("--config", help="a TOML config file with [server] settings and [[models]]")
    serve.add_argument("--demo", action="store_true", help="also host the demo models when --model/--config are given")
    serve.add_argument("--metrics-port", type=int, help="serve Prometheus metrics at http://HOST:PORT/metrics")
    serve.add_argument("--openai-port", type=int,
                       help="serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models, "
                            "/health) at http://HOST:PORT, with the same TLS and tokens (docs/openai.md); also "
                            "HOOKWIRE_OPENAI_PORT, [server] openai_port; off by default; 0 picks a free port")
    serve.add_argument("--log-format", choices=["text", "json"], help="log lines as text (default) or JSON")
    serve.add_argument("--log-level", help="debug, info (default), warning, error")
    serve.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    serve.add_argument("--no-batching", action="store_true",
                       help="run calls alone by default (a model whose config says batching = true still joins them)")
    serve.add_argument("--max-batch-size", type=int,
                       help="most rows in one batched pass, for models whose config does not say (default 32)")
    serve.add_argument("--max-batch-delay-ms", type=float,
                       help="how long the first call of a pass may wait for others when more callers were seen "
                            "lately than wait now (default 10; 0: only calls already waiting)")
    serve.add_argument("--harvest-data-root",
                       help="harvest jobs read text datasets from under this folder (docs/harvest.md)")
    serve.add_argument("--harvest-output-root",
                       help="harvest jobs write datasets under this folder; without it (or URL prefixes) they are refused")
    serve.add_argument("--operand-root",
                       help="operators publish read-only operands (SAEs in SAELens' layout, .safetensors tensors) from "
                            "under this folder (PublishOperand; docs/recipes.md)")
    serve.add_argument("--state-dir",
                       help="save hooks without a session (ttl_seconds) in this folder and register them again, "
                            "with their ids, when the server starts on it again (docs/security.md); "
                            "also HOOKWIRE_STATE_DIR, [server] state_dir")
    serve.add_argument("--tokens-file", help="principals and token hashes (see docs/security.md); also HOOKWIRE_TOKENS")
    serve.add_argument("--tls-cert", help="PEM certificate chain: serve TLS")
    serve.add_argument("--tls-key", help="PEM private key of --tls-cert")
    serve.add_argument("--tls-client-ca", help="PEM CA of client certificates: require them (mTLS)")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback address without authentication")
    serve.add_argument("--allow-shared-rules", action="store_true",
                       help="allow rules that change values on SCOPE_ALL/SCOPE_TAGGED hooks (other callers' results)")
    serve.set_defaults(command_handler=run_serve)


def add_token(sub: Any, name: str = "token") -> None:
    """Adds ``hookwire token new``: a new access token and its token-file line."""
    token = sub.add_parser(name, help="create an access token for a principal")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    token_new = token_sub.add_parser("new", help="print a new random token and its token-file line")
    token_new.add_argument("name", help="the principal")
    token_new.add_argument("--role", default="user", help="viewer, user, observer or operator (default user)")
    token.set_defaults(command_handler=run_token)


def run_serve(ns: argparse.Namespace) -> int:
    try:
        from ..logging_setup import announce, configure
        from ..models.model_loading import ConfigError, demo_configs, load_config_file, parse_model_flag
        from .config import pick, resolve_settings
        from .server import serve
    except ImportError as exc:
        print(f"hookwire serve needs the server extra (from a checkout of this repository: pip install '.[server]'): {exc}", file=sys.stderr)
        return 2
    env = os.environ
    try:
        config_path = pick("config", ns.config, env, {}, None)
        server_table, models = load_config_file(config_path) if config_path else ({}, [])
        cli_keys = {"log_format", "log_level", "models"}
        log_format = pick("log_format", ns.log_format, env, server_table, "text")
        log_level = pick("log_level", ns.log_level, env, server_table, "info")
        flags = {"host": ns.host, "port": ns.port, "metrics_port": ns.metrics_port, "openai_port": ns.openai_port,
                 "allow_shared_rules": True if ns.allow_shared_rules else None,
                 "reflection": False if ns.no_reflection else None,
                 "tokens_file": ns.tokens_file, "tls_cert": ns.tls_cert, "tls_key": ns.tls_key,
                 "tls_client_ca": ns.tls_client_ca, "insecure": True if ns.insecure else None,
                 "batching": False if ns.no_batching else None, "max_batch_size": ns.max_batch_size,
                 "max_batch_delay_ms": ns.max_batch_delay_ms,
                 "harvest_data_root": ns.harvest_data_root, "harvest_output_root": ns.harvest_output_root,
                 "operand_root": ns.operand_root, "state_dir": ns.state_dir}
        settings, sources = resolve_settings(flags, env, {k: v for k, v in server_table.items() if k not in cli_keys})
        model_flags = ns.model or [m for m in env.get("HOOKWIRE_MODELS", "").split(",") if m.strip()]
        if ns.parameters_readable and not model_flags:
            # Config entries say it per model, and the demo models allow it already: a flag
            # that changed nothing would let an operator believe otherwise.
            raise ConfigError("--parameters-readable applies to the --model (or HOOKWIRE_MODELS) entries, and none "
                              "is given; a --config model sets parameters_readable = true in its [[models]] entry")
        models += [parse_model_flag(text, parameters_readable=ns.parameters_readable) for text in model_flags]
        if ns.demo or not models:
            models = demo_configs() + models
        if log_format not in ("text", "json"):
            raise ConfigError(f"log format {log_format!r} is not text or json")
    except (ConfigError, ValueError) as exc:
        print(f"hookwire serve: {exc}", file=sys.stderr)
        return 2
    configure(log_format, log_level)

    def say(message: str, *, error: bool = False, **fields: Any) -> None:
        announce(log_format, message, error=error, **fields)

    def ready(server: Any) -> None:
        # Called once the server serves (health SERVING): every model loaded or failed.
        names = ", ".join(h.name for h in server.registry)
        say(f"hookwire serving {names} on {server.target}", target=server.target,
            models=[h.name for h in server.registry])
        for entry in server.registry.entries():
            if entry.host is None:
                say(f"hookwire serve: model {entry.name!r} failed to load: {entry.reason}", error=True,
                    model=entry.name, reason=entry.reason)
        if server.metrics_port is not None:
            url = f"http://{settings.host}:{server.metrics_port}/metrics"
            say(f"metrics on {url}", metrics_url=url)
        if server.openai_port is not None:
            url = f"{'https' if settings.tls_cert else 'http'}://{settings.host}:{server.openai_port}/v1"
            say(f"OpenAI-compatible API on {url}", openai_url=url)
        extras = ["grpc.health.v1.Health"] + (["reflection"] if settings.reflection else [])
        say(f"also serving {', '.join(extras)}; logs: {log_format}", services=extras, log_format=log_format)
        security = "TLS" if settings.tls_cert else "plaintext"
        if settings.tls_client_ca:
            security += ", client certificates required (mTLS)"
        security += ", tokens required" if server.tokens.enabled else ", NO authentication"
        say(f"security: {security}", security=security)
        secret = {"tokens"}
        shown = {k: "<set>" if k in secret else repr(getattr(settings, k)) for k in sources}
        chosen = ", ".join(f"{k}={shown[k]} ({v})" for k, v in sorted(sources.items()))
        # Every setting's source: the ones listed, else its default.
        say(f"settings: {chosen + '; every other setting' if chosen else 'every setting'} has its default",
            settings={k: {"value": shown[k], "source": v} for k, v in sorted(sources.items())})

    try:
        asyncio.run(serve(settings, models, on_ready=ready))
    except (ConfigError, ValueError, OSError) as exc:  # bad token files, refused binds, busy ports, no model loaded
        say(f"hookwire serve: {exc}", error=True)
        return 2
    return 0


def run_token(ns: argparse.Namespace) -> int:
    from ..auth import ROLES, hash_token, new_token

    if ns.role not in ROLES:
        print(f"hookwire token: role must be one of {', '.join(ROLES)}", file=sys.stderr)
        return 2
    token = new_token()
    print(f"token (give it to {ns.name}; it is shown once): {token}")
    print(f"token file line: {ns.name}:{ns.role}:{hash_token(token)}")
    return 0
