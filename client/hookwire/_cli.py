"""The ``hookwire`` command: serve, health, models, inspect, generate, tap, hooks, harvest."""

from __future__ import annotations

import argparse
import asyncio
import collections
import difflib
import importlib
import importlib.util
import ipaddress
import os
import pathlib
import re
import signal
import sys
from typing import Any, Callable

from ._client import DEFAULT_TARGET, ConnectOptions, connect, resolve_target
from ._errors import HookwireError, from_rpc_error
from ._types import GeneratedTokens, InterceptEvent
from .wire.ids import HOOK_ID

#: Exit status when stdout closes early (``hookwire inspect m | head -2``): what a
#: shell reports for a process ended by SIGPIPE (128 + 13).
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


#: The commands of the SDK itself. Other installed packages add commands through the
#: COMMANDS_GROUP entry points (the server: ``serve`` and ``token``), looked for only for
#: ``--help`` and for a command not in this set.
SDK_COMMANDS = frozenset({"models", "inspect", "parameters", "generate", "tap", "health", "harvest", "hooks", "operands"})
#: The entry point group of added commands: each entry point, named after its command, is
#: an ``add_command(subparsers, name)`` function that adds the command's subparser and sets
#: ``command_handler`` (``(argparse.Namespace) -> int``, the exit status) on it.
COMMANDS_GROUP = "hookwire.commands"


def _added_commands() -> list[tuple[str, Callable[[Any, str], None]]]:
    """(name, add_command) of each command another package adds (COMMANDS_GROUP).

    The hookwire distribution declares the server's in pyproject.toml. A source checkout
    whose installed metadata predates them (an older editable install, or PYTHONPATH
    pointing at the checkout) has none installed: the checkout's own pyproject.toml then
    says them. A command whose module does not import is left out."""
    from importlib.metadata import entry_points

    found = [(ep.name, ep.value) for ep in entry_points(group=COMMANDS_GROUP)] or _checkout_commands()
    commands = []
    for name, value in found:
        module_name, _, attr = value.partition(":")
        try:
            module = importlib.import_module(module_name.strip())
        except ImportError:
            continue
        commands.append((name, getattr(module, attr.strip())))
    return commands


def _added_command_names() -> list[str]:
    """The names of the commands other installed packages add (COMMANDS_GROUP), without
    importing them (only the top-level package of each is looked for: the server's
    imports torch): what the usage line lists when they are not loaded."""
    from importlib.metadata import entry_points

    found = [(ep.name, ep.value) for ep in entry_points(group=COMMANDS_GROUP)] or _checkout_commands()
    return [name for name, value in found
            if importlib.util.find_spec(value.partition(":")[0].strip().split(".")[0]) is not None]


class CommandParser(argparse.ArgumentParser):
    """The ``hookwire`` parser. Its usage names every command, also those of other
    packages that this run did not load (see main), and an unrecognized flag gets the
    nearest flag of its command as a suggestion (argparse before 3.14 offers none)."""

    def _commands(self) -> argparse._SubParsersAction | None:  # type: ignore[type-arg]
        return next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)

    def _name_every_command(self) -> None:
        commands = self._commands()
        if commands is None or commands.metavar is not None:
            return
        missing = [name for name in _added_command_names() if name not in commands.choices]
        if missing:
            commands.metavar = "{" + ",".join([*missing, *commands.choices]) + "}"

    def format_usage(self) -> str:
        self._name_every_command()
        return super().format_usage()

    def format_help(self) -> str:
        self._name_every_command()
        return super().format_help()

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = _command_parser(self, ns)
            parser.error(unrecognized(extras, parser))
        return ns


def _command_parser(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command ``ns`` was parsed for (``hookwire hooks rm``'s, say)."""
    while True:
        commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = None if commands is None else commands.choices.get(getattr(ns, commands.dest, None) or "")
        if chosen is None:
            return parser
        parser = chosen


def unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" error, saying for each unknown flag which of
    ``parser``'s flags was meant (``unrecognized argument --temprature; did you mean
    --temperature?``). Words after an unknown flag are taken for its value."""
    flags = [s for action in parser._actions for s in action.option_strings]
    unknown = [e.split("=", 1)[0] for e in extras if e.startswith("-") and e != "-"]
    if not unknown:
        return f"unrecognized arguments: {' '.join(extras)}"
    meant = {flag: difflib.get_close_matches(flag, flags, n=1, cutoff=0.6) for flag in unknown}
    if len(unknown) == 1:
        (flag, close), = meant.items()
        return f"unrecognized argument {flag}; did you mean {close[0]}?" if close else (
            f"unrecognized argument {flag} (see {parser.prog} --help)")
    return "unrecognized arguments: " + ", ".join(
        f"{flag} (did you mean {close[0]}?)" if close else flag for flag, close in meant.items())


def _checkout_commands() -> list[tuple[str, str]]:
    """COMMANDS_GROUP's entries in the pyproject.toml of the checkout this SDK runs from."""
    path = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        import tomllib

        project = tomllib.loads(path.read_text()).get("project", {})
    except (OSError, ValueError):
        return []
    if project.get("name") != "hookwire":
        return []
    return list(project.get("entry-points", {}).get(COMMANDS_GROUP, {}).items())


#: gRPC target URI schemes the command passes on (after checking what it can).
_URI_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:")


def target_problem(target: str, flag: str = "--target") -> str | None:
    """What is wrong with a target the user typed, in the command's words (``--target:
    port 'xx' is not a number``), or None when it reads as one.

    Checked before connecting because gRPC reports a malformed target as a name it
    could not resolve (a DNS failure), which sends the user looking in the wrong
    place. Accepted: ``host:port`` with a port from 1 to 65535, ``[IPv6]:port``,
    http(s):// URLs (see resolve_target), ``dns:[//authority/]host:port``,
    ``ipv4:``/``ipv6:`` address lists, and ``unix:PATH`` / ``unix-abstract:NAME``.
    """
    try:
        resolved, _ = resolve_target(target)
    except ValueError as exc:
        return f"{flag}: {str(exc).removeprefix('target ')}"
    lower = resolved.lower()
    scheme = next((s for s in _URI_SCHEMES if lower.startswith(s)), None)
    if scheme in ("unix:", "unix-abstract:"):
        return None if resolved[len(scheme):] else f"{flag}: {target!r} names no socket ({scheme}PATH)"
    if scheme == "dns:":
        rest = resolved[len(scheme):]
        addresses = [rest.split("/", 3)[-1] if rest.startswith("//") else rest]  # dns://authority/host:port
    elif scheme in ("ipv4:", "ipv6:"):
        addresses = resolved[len(scheme):].split(",")
    else:
        addresses = [resolved]
    for address in addresses:
        problem = _address_problem(address)
        if problem is not None:
            return f"{flag}: {problem}"
    return None


def _address_problem(address: str) -> str | None:
    if not address:
        return "no address: give host:port, e.g. 127.0.0.1:50051"
    if address.startswith("["):
        host, sep, port = address[1:].partition("]")
        if not sep:
            return f"{address!r}: no ']' after the IPv6 address"
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return f"{host!r} in brackets is not an IPv6 address"
        if not port.startswith(":"):
            return f"{address!r} has no port: give [{host}]:PORT"
        port = port[1:]
    else:
        if address.count(":") > 1:
            return f"{address!r}: an IPv6 address goes in brackets, with the port after them: [::1]:50051"
        host, sep, port = address.partition(":")
        if not sep:
            return f"{address!r} has no port: give host:port, e.g. {address}:50051"
        if not host:
            return f"no host before ':{port}': give host:port, e.g. 127.0.0.1:{port}"
    if not port.isdigit() or not port.isascii():
        return f"port {port!r} is not a number" if port else f"no port after {address!r}: give host:port"
    if not 1 <= int(port) <= 65535:
        return f"port {int(port)} is not from 1 to 65535"
    return None


def _client_options(ns: argparse.Namespace) -> ConnectOptions:
    return ConnectOptions(token=ns.token, tls=ns.tls, tls_ca=ns.tls_ca, tls_cert=ns.tls_cert, tls_key=ns.tls_key)


async def _health(ns: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    options = _client_options(ns)
    target, url_tls = resolve_target(ns.target)
    if url_tls or options.tls or options.tls_ca or options.tls_cert:
        from ._credentials import channel_credentials

        channel = grpc.aio.secure_channel(target, channel_credentials(options.tls_ca, options.tls_cert, options.tls_key))
    else:
        channel = grpc.aio.insecure_channel(target)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=ns.service), timeout=ns.timeout)
        except grpc.RpcError as exc:
            message = str(from_rpc_error(exc, target=target))
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                known = [name or '"" (the server)' for name in await _health_services(ns, stub)]
                message = (f"NOT_FOUND: {target} has no health service {ns.service!r}"
                           + (f"; it has: {', '.join(known)}" if known else ""))
            print(f"hookwire health: {message}", file=sys.stderr)
            return 2
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{target}{' ' + ns.service if ns.service else ''}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


#: Health services a hookwire server may have besides its gRPC services' names: liveness,
#: and each model's own (this prefix and the model's name).
_FIXED_HEALTH_SERVICES = ("hookwire.live",)
_MODEL_HEALTH_PREFIX = "hookwire.model."


async def _health_services(ns: argparse.Namespace, stub: Any) -> list[str]:
    """The health services the server answers for ("" is the server itself): of the
    names a hookwire server may have (its hookwire.v1 services, the fixed names above, a
    service per model that ListModels lists), those whose Check answers."""
    import grpc
    from grpc_health.v1 import health_pb2

    from .v1 import harvest_service_pb2, hook_service_pb2, model_service_pb2, operand_service_pb2

    names = ["", *(service.full_name for module in (model_service_pb2, hook_service_pb2, harvest_service_pb2,
                                                    operand_service_pb2)
                   for service in module.DESCRIPTOR.services_by_name.values()), *_FIXED_HEALTH_SERVICES]
    try:
        async with connect(ns.target, options=_client_options(ns)) as client:
            names += [_MODEL_HEALTH_PREFIX + m.name for m in await client.list_models()]
    except (HookwireError, ValueError, OSError):
        pass  # listing models may need a token: the other names still help

    async def answers(name: str) -> bool:
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=ns.timeout)
        except grpc.RpcError:  # NOT_FOUND, or no answer: not one to offer
            return False
        return True

    found = await asyncio.gather(*(answers(name) for name in names))
    return [name for name, ok in zip(names, found) if ok]


async def _models(ns: argparse.Namespace) -> int:
    async with connect(ns.target, options=_client_options(ns)) as client:
        for info in await client.list_models():
            train = "train+eval" if info.training_allowed else "eval only"
            state = f"failed: {info.state_message}" if info.state == "failed" else info.state
            print(f"{info.name}\t{state}\t{train}\t{info.description}")
    return 0


async def _inspect(ns: argparse.Namespace) -> int:
    async with connect(ns.target, options=_client_options(ns)) as client:
        info = await client.model(ns.model).info()
    print(f"{info.name}: {info.description}")
    if info.engine:  # which engine runs it, and what that engine does not do (docs/vllm.md)
        refused = "; refuses " + ", ".join(sorted(info.refused_features)) if info.refused_features else ""
        print(f"engine: {info.engine}{refused}")
    if info.compiled:  # hooks go on its tap points only, inside the compiled graph (docs/vllm.md)
        print(f"compiled: hooks at {len(info.tap_points)} tap points (marked ^ below) and on modules outside the graph")
    placement = info.device_map
    if placement:
        counts = collections.Counter(placement.values())
        print("device map: " + ", ".join(f"{device} {n}" for device, n in sorted(counts.items()))
              + " (modules marked @ below; the rest live where their closest marked parent does)")
    tapped = set(info.tap_points)
    for module in info.modules:
        depth = module.path.count(".") + 1 if module.path else 0
        name = module.path.rsplit(".", 1)[-1] if module.path else "(root)"
        params = ", ".join(f"{p.name} {list(p.shape)} {p.dtype}" for p in module.parameters)
        where = f"  @{placement[module.path]}" if module.path in placement else ""
        where += "  ^" if module.path in tapped else ""
        print(f"{'  ' * depth}{name} ({module.type}){'  ' + params if params else ''}    [{module.path}]{where}")
    return 0


async def _parameters(ns: argparse.Namespace) -> int:
    async with connect(ns.target, options=_client_options(ns)) as client:
        # The bar shows on a terminal only (progress=None), unless --no-progress.
        weights = await client.model(ns.model).parameters(
            *ns.names, dtype=ns.dtype, progress=False if ns.no_progress else None,
        )
    total = 0
    for name, value in weights.items():
        nbytes = int(value.nbytes)
        total += nbytes
        dtype = str(value.dtype).replace("torch.", "")
        print(f"{name}\t{list(value.shape)}\t{dtype}\t{nbytes / 2**20:.2f} MiB")
    if ns.out:
        _save_tensors(weights, ns.out)
        print(f"wrote {len(weights)} tensors, {total / 2**20:.1f} MiB, to {ns.out}", file=sys.stderr)
    return 0


def _save_tensors(tensors: dict[str, Any], path: str) -> None:
    """``tensors`` into one safetensors file (torch tensors or numpy arrays)."""
    first = next(iter(tensors.values()), None)
    if first is not None and type(first).__module__.startswith("torch"):
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
    else:
        from safetensors.numpy import save_file as save_numpy

        save_numpy(dict(tensors), path)


def read_hook_file(path: str) -> Any:
    """A HookSpec (wire form) from a file holding it in protobuf's JSON form, as
    ``google.protobuf.json_format.MessageToJson(spec.to_proto())`` writes it. Parsed as
    data, never run. ValueError naming the file for one it cannot read."""
    from google.protobuf import json_format

    from .v1 import hook_pb2

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return json_format.Parse(text, hook_pb2.HookSpec())
    except (OSError, UnicodeDecodeError, json_format.ParseError) as exc:
        raise ValueError(f"--hook {path}: not a HookSpec in protobuf JSON form: {exc}") from None


async def _generate(ns: argparse.Namespace) -> int:
    hooks = [read_hook_file(path) for path in ns.hook]
    events = 0
    async with connect(ns.target, options=_client_options(ns)) as client:
        stream = client.model(ns.model).generate(
            ns.prompt, ns.max_new_tokens, hooks=hooks, do_sample=ns.do_sample, temperature=ns.temperature,
            top_k=ns.top_k, top_p=ns.top_p, seed=ns.seed, stop=ns.stop, keep_events=False,
        )
        async with stream:  # cancels the call if the output goes away (closed pipe, Ctrl-C)
            async for item in stream:
                if isinstance(item, GeneratedTokens):
                    if item.texts and item.texts[0]:
                        sys.stdout.write(item.texts[0])
                        sys.stdout.flush()  # each step's text as it comes
                elif isinstance(item, InterceptEvent):
                    events += 1
            result = await stream
    sys.stdout.write("\n")
    summary = f"finish: {result.finish_reasons[0]}, {len(result.token_ids[0])} new tokens"
    if result.stopped_by and result.stopped_by[0] is not None:  # a stop rule ended it
        hook_id, module, step = result.stopped_by[0]
        summary += f" (stop rule of hook {hook_id} on {module} at step {step})"
    if result.do_sample:
        summary += f", seed {result.seed}"
    if hooks:
        summary += f", {events} hook events"
    print(summary, file=sys.stderr)
    return 0


async def _hooks(ns: argparse.Namespace) -> int:
    if ns.hooks_command == "rm":
        malformed = [hook_id for hook_id in ns.ids if not HOOK_ID.fullmatch(hook_id)]
        if malformed:  # a typo or a truncated copy: say so rather than report it "gone"
            print(f"hookwire hooks rm: not a hook id: {', '.join(map(repr, malformed))} "
                  "(ids look like hk_ and 32 hex digits; see hookwire hooks list); nothing was removed",
                  file=sys.stderr)
            return 2
    async with connect(ns.target, options=_client_options(ns)) as client:
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
        # Like HookHandle.remove(), removing is idempotent: the goal is "this hook is
        # gone", which holds whether this call removed it or it was already gone.
        for hook_id in ns.ids:
            removed = await client.deregister_hook(hook_id)
            print(f"{hook_id}: {'removed' if removed else 'already gone (no such hook)'}")
        return 0


def read_operand(path: str) -> Any:
    """What ``hookwire operands upload`` sends for ``path``: a folder in SAELens' layout
    (cfg.json and sae_weights.safetensors) is an SAE; a .safetensors file of one tensor or
    a .npy file is a tensor. Never a pickle. Safetensors are read with torch when it is
    installed (bfloat16 included), else with numpy. ValueError naming what does not fit."""
    import json
    import pathlib

    import numpy as np

    from .rules import Sae
    from .wire import codec

    def load_file(file: pathlib.Path) -> dict[str, Any]:
        try:
            if codec.torch_importable():
                from safetensors.torch import load_file as load_torch

                return dict(load_torch(str(file)))
            from safetensors.numpy import load_file as load_numpy

            return dict(load_numpy(str(file)))
        except Exception as exc:  # SafetensorError, a dtype numpy lacks (bfloat16): say which file
            raise ValueError(f"{file}: cannot be read as safetensors: {exc}") from None

    folder = pathlib.Path(path)
    if folder.is_dir():
        cfg_path, weights = folder / "cfg.json", folder / "sae_weights.safetensors"
        if not cfg_path.is_file() or not weights.is_file():
            raise ValueError(f"{path}: a folder needs SAELens' cfg.json and sae_weights.safetensors")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{cfg_path}: not JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_path}: not a JSON object (SAELens' config)")
        tensors = load_file(weights)
        missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k not in tensors]
        if missing:
            raise ValueError(f"{path}: sae_weights.safetensors has no {', '.join(missing)}")
        architecture = cfg.get("architecture", "standard")
        return Sae.of(tensors["W_enc"], tensors["b_enc"], tensors["W_dec"], tensors["b_dec"], architecture=architecture,
                      threshold=tensors.get("threshold") if architecture == "jumprelu" else None,
                      k=cfg.get("k") if architecture == "topk" else None,
                      normalize_activations=cfg.get("normalize_activations") or "none",
                      apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)))
    if folder.suffix == ".npy":
        return np.load(str(folder), allow_pickle=False)
    if folder.suffix == ".safetensors":
        tensors = load_file(folder)
        if len(tensors) != 1:
            raise ValueError(f"{path}: holds {len(tensors)} tensors; a tensor operand is a file of one")
        return next(iter(tensors.values()))
    raise ValueError(f"{path}: not a SAELens folder, a .safetensors file or a .npy file")


async def _operands(ns: argparse.Namespace) -> int:
    async with connect(ns.target, options=_client_options(ns)) as client:
        if ns.operands_command == "list":
            print(f"{'name':<32} {'kind':<7} {'dtype':<9} {'shape':<18} {'MiB':>9} {'owner':<14} {'lifetime':<20} used by")
            for op in await client.list_operands():
                lifetime = ("published" if op.published else "ended" if op.ended
                            else f"until {op.expires:%H:%M:%S}" if op.expires else f"session {op.session_id[:12]}")
                print(f"{op.name:<32} {op.kind:<7} {op.dtype:<9} {str(list(op.shape)):<18} {op.nbytes / 2**20:>9.2f} "
                      f"{op.owner or '-':<14} {lifetime:<20} {', '.join(op.used_by) or '-'}")
            return 0
        if ns.operands_command == "upload":
            if not 0 < ns.ttl < float("inf"):
                print(f"hookwire operands upload: --ttl must be a positive number of seconds, not {ns.ttl}", file=sys.stderr)
                return 2
            try:
                value = read_operand(ns.path)
            except (OSError, ValueError) as exc:
                print(f"hookwire operands upload: {exc}", file=sys.stderr)
                return 2
            info = await client.upload_operand(ns.name, value, ttl=ns.ttl)
            print(f"{info.name}: {info.kind} {list(info.shape)}, {info.nbytes} bytes, until {info.expires:%Y-%m-%d %H:%M:%S} UTC")
            return 0
        if ns.operands_command == "publish":
            info = await client.publish_operand(ns.name, ns.path)
            print(f"{info.name}: {info.kind} {list(info.shape)}, {info.nbytes} bytes, published")
            return 0
        freed = await client.delete_operand(ns.name, owner=ns.owner or "")
        print(f"{ns.name}: deleted ({freed} bytes freed)")
        return 0


def run_interruptible(make: Any) -> Any:
    """``asyncio.run(make())``, where Ctrl-C (SIGINT) cancels the coroutine at its current
    await (its ``finally`` blocks and ``async with`` exits run: hooks are removed) and then
    raises KeyboardInterrupt. Python's own SIGINT handling raises KeyboardInterrupt at
    whatever bytecode runs, which can be inside gRPC's callbacks (the SDK's message readers
    run there), where it is swallowed and the command never stops."""
    async def main() -> Any:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        interrupted = False

        def on_sigint() -> None:
            nonlocal interrupted
            interrupted = True
            task.cancel()

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such support
            pass
        try:
            return await make()
        except asyncio.CancelledError:
            if interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            try:
                loop.remove_signal_handler(signal.SIGINT)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    return asyncio.run(main())


def _tap(ns: argparse.Namespace) -> int:
    from ._tap import run_tap

    try:
        return int(run_interruptible(lambda: run_tap(
            ns.target, ns.model, ns.pattern, options=_client_options(ns), stats=ns.stats, every=ns.every, scope=ns.scope,
            interval=ns.interval, duration=ns.duration, plain=ns.plain or not sys.stdout.isatty(),
        )))
    except KeyboardInterrupt:
        print("tap stopped; its hooks were removed with its session")
        return 0


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def parse_count(text: str) -> int:
    """A token count: 500000, 500k, 10M, 1.5G (argparse type)."""
    value = text.strip().lower().replace("_", "")
    scale = _SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if scale != 1 else value
    try:
        count = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count like 500000, 500k, 10M or 1.5G") from None
    if count < 0 or count != int(count):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole, non-negative count")
    return int(count)


def _print_job(p: Any) -> None:
    from ._harvest import format_rate

    total = f"/{p.tokens_total}" if p.tokens_total else ""
    rate = format_rate(p)
    print(f"{p.job_id}  {p.state:<11} {p.model:<16} {p.output:<24} tokens {p.tokens_done}{total}  "
          f"shards {p.shards_written}{'  ' + rate if rate else ''}{'  committed' if p.committed else ''}"
          f"{'  ' + p.error if p.error else ''}", flush=True)


#: Plain progress lines at most this often (seconds), the last state always.
PLAIN_EVERY = 2.0

#: The harvest API's field names, as servers and the SDK name them in messages, and the
#: flags of ``hookwire harvest`` that set them: a CLI user reads the flags they typed.
#: Longest names first, so that "output.shuffle.buffer_shards" is not read as
#: "output.shuffle" + ".buffer_shards".
HARVEST_FLAGS = {
    "output.shuffle.buffer_shards": "--shuffle-buffer",
    "output.shuffle.seed": "--seed",
    "output.shuffle": "--shuffle",
    "output.overwrite": "--overwrite",
    "output.shard_tokens": "--shard-tokens",
    "output.path": "--out",
    "source.text.path": "--data",
    "source.text.format": "--format",
    "source.text.text_field": "--text-field",
    "source.text.split": "--split",
    "source.text": "--data",
    "source.tokens.input_ids": "--token-file",
    "source.tokens": "--token-file",
    "contexts.length": "--length",
    "contexts.batch_size": "--batch-size",
    "contexts.packing": "--packing",
    "contexts.bos": "--no-bos",
    "positions.skip_first": "--skip-first",
    "max_tokens": "--tokens",
    "worker_index": "--worker-index",
    "num_workers": "--num-workers",
    "tokenizer=": "--tokenizer",
    "tokens=": "--token-file",
    "data=": "--data",
    "modules": "--modules",
    "select": "--select",
    "dtype": "--dtype",
    "part": "--part",
}
#: Plain words among the names ("modules", "select", "dtype", "part") are fields only
#: where a message names a field: followed by ":" or "[" ("modules[0]: empty").
_PLAIN_WORDS = {k for k in HARVEST_FLAGS if re.fullmatch(r"[a-z]+", k)}
_FIELD = re.compile(r"(?<![\w.-])(?:" + "|".join(
    re.escape(k) + (r"(?=[:\[])" if k in _PLAIN_WORDS else r"(?!\w|\.\w)")
    for k in sorted(HARVEST_FLAGS, key=len, reverse=True)
) + ")")


def harvest_flags(message: str) -> str:
    """``message`` with the harvest API's field names replaced by the CLI's flags
    ("output.overwrite" -> "--overwrite", "modules[0]" -> "--modules[0]")."""
    return _FIELD.sub(lambda m: HARVEST_FLAGS[m.group(0)], message)


def _plain_printer() -> Any:
    """A progress callback printing a line at most every PLAIN_EVERY seconds."""
    import time

    last = [0.0]

    def show(p: Any) -> None:
        now = time.monotonic()
        if now - last[0] >= PLAIN_EVERY or p.ended:
            last[0] = now
            _print_job(p)

    return show


async def _follow(client: Any, job: Any, plain: bool) -> int:
    """Shows the job's progress until it ends; Ctrl-C leaves it running on the server.
    Exits 0 when it succeeded, 1 otherwise (an interrupted job: with how to resume it)."""
    from ._harvest import raise_if_failed

    try:
        if plain:
            last = None
            async for last in job.watch(interval=PLAIN_EVERY):
                _print_job(last)
            assert last is not None
        else:
            bar_last = None
            from ._harvest import _Bar

            bar = _Bar(True)
            try:
                async for bar_last in job.watch(interval=0.5):
                    bar.update(bar_last)
            finally:
                bar.close()
            assert bar_last is not None
            last = bar_last
            _print_job(last)
        raise_if_failed(last)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"\nstopped watching; job {job.id} goes on on the server: hookwire harvest --watch {job.id} "
              f"(hookwire harvest cancel {job.id} stops it)", file=sys.stderr)
        return 130
    return 0 if last.state == "succeeded" else 1


async def _interrupted_at(client: Any, out: str, worker_index: int) -> list[Any]:
    """The caller's interrupted jobs that wrote ``out`` (as this worker)."""
    try:
        jobs = await client.harvests()
    except HookwireError:  # listing is a courtesy here: the start itself says what is wrong
        return []
    return [j for j in jobs if j.state == "interrupted" and j.output == out and j.worker_index == worker_index]


async def _wait_for_model(client: Any, model: str, seconds: float) -> None:
    """Waits (at most ``seconds``) for ``model`` to be ready, saying so on stderr once
    when it is not ready at once (a server just started loads its models)."""
    if seconds <= 0:
        return
    quick = min(1.0, seconds)  # a model that is ready answers at once: no message then
    try:
        await client.wait_ready([model], timeout=quick)
        return
    except TimeoutError:
        pass
    print(f"hookwire harvest: waiting up to {seconds:g} s for model {model!r} to be ready on {client.target} "
          "(--wait-ready)", file=sys.stderr, flush=True)
    try:
        await client.wait_ready([model], timeout=max(0.001, seconds - quick))
    except TimeoutError as exc:
        raise HookwireError(f"{exc} (--wait-ready {seconds:g})", code="UNAVAILABLE") from None


def harvest_options(ns: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of ``Client.harvest`` (and ``harvest_local``) that the
    harvest command's flags give (the model, modules, out, data and split aside)."""
    return dict(
        dtype=ns.dtype, part=ns.part, select=ns.select, length=ns.length, batch_size=ns.batch_size,
        packing=ns.packing, bos=False if ns.no_bos else None, skip_first=ns.skip_first, max_tokens=ns.tokens or 0,
        shard_tokens=ns.shard_tokens, shuffle=ns.shuffle, shuffle_buffer=ns.shuffle_buffer, seed=ns.seed,
        overwrite=ns.overwrite, text_field=ns.text_field, format=ns.format, split=ns.split,
    )


async def _harvest(ns: argparse.Namespace) -> int:
    words = list(ns.words)
    plain = ns.plain or not sys.stderr.isatty()
    async with connect(ns.target, options=_client_options(ns)) as client:
        if ns.watch:
            return await _follow(client, client.harvest_job(ns.watch), plain)
        if words and words[0] == "list":
            for p in await client.harvests(model=ns.model_filter, active_only=ns.active):
                _print_job(p)
            return 0
        if words and words[0] == "cancel":
            if len(words) < 2:
                print("hookwire harvest cancel: name the job (hookwire harvest list shows them)", file=sys.stderr)
                return 2
            for job_id in words[1:]:
                _print_job(await client.harvest_job(job_id).cancel())
            return 0
        if len(words) != 1 or not ns.modules or not ns.out or not (ns.data or ns.token_file):
            print("hookwire harvest: give MODEL --modules GLOB --data FILE --out DIR (or: list, cancel JOB, --watch JOB)",
                  file=sys.stderr)
            return 2
        if ns.wait_ready < 0:
            print("hookwire harvest: --wait-ready takes seconds >= 0", file=sys.stderr)
            return 2
        options = harvest_options(ns)
        if ns.sink == "client":
            if ns.worker_index or ns.num_workers > 1:
                print("hookwire harvest: --sink client runs one worker", file=sys.stderr)
                return 2
            if ns.token_file:
                import numpy as np

                options["tokens"] = np.load(ns.token_file)
                options["pad_token_id"] = ns.pad_token_id
            else:
                options["data"] = ns.data
                options["tokenizer"] = ns.tokenizer  # None: the server's tokenizer (Tokenize)
            await _wait_for_model(client, words[0], ns.wait_ready)
            try:
                result = await client.harvest_local(
                    words[0], ns.modules, out=ns.out, progress=not plain,
                    on_progress=_plain_printer() if plain else None, **options,
                )
            except (KeyboardInterrupt, asyncio.CancelledError):
                print(f"\nstopped; run the same command again to resume from {ns.out}", file=sys.stderr)
                return 130
            _print_job(result)
            return 0
        if ns.token_file:
            print("hookwire harvest: --token-file needs --sink client (server jobs read text under their data root)",
                  file=sys.stderr)
            return 2
        await _wait_for_model(client, words[0], ns.wait_ready)
        if not ns.overwrite:
            for old in await _interrupted_at(client, ns.out, ns.worker_index):
                print(f"hookwire harvest: job {old.job_id} at {ns.out} was interrupted at {old.tokens_done} tokens "
                      f"(its server stopped); this command resumes it from its committed shards"
                      f"{' (the same as: ' + old.resume_command + ')' if old.resume_command else ''}",
                      file=sys.stderr, flush=True)
        job = await client.harvest(words[0], ns.modules, out=ns.out, data=ns.data, worker_index=ns.worker_index,
                                   num_workers=ns.num_workers, **options)
        print(f"started {job.id} on {words[0]} into {ns.out}; hookwire harvest --watch {job.id} follows it", file=sys.stderr)
        if ns.detach:
            print(job.id)
            return 0
        return await _follow(client, job, plain)


def _harvest_command(ns: argparse.Namespace) -> int:
    try:
        return int(run_interruptible(lambda: _harvest(ns)))
    except KeyboardInterrupt:
        return 130
    except HookwireError as exc:  # the server's and the SDK's field names, said as this command's flags
        print(f"hookwire harvest: {harvest_flags(str(exc))}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"hookwire harvest: {harvest_flags(str(exc))}", file=sys.stderr)
        return 2


def build_parser(added_commands: bool = True) -> argparse.ArgumentParser:
    """The argument parser of the ``hookwire`` command; with ``added_commands`` (the
    default), also the commands other installed packages add (see _added_commands)."""
    parser = CommandParser(prog="hookwire", description="Remote PyTorch model interception over gRPC.")
    sub = parser.add_subparsers(dest="command", required=True)
    target_default = os.environ.get("HOOKWIRE_TARGET", DEFAULT_TARGET)
    target_help = (f"server host:port (default {target_default}; env HOOKWIRE_TARGET); "
                   "http://host:port is the same, https://host:port means TLS")

    for name, add_command in (_added_commands() if added_commands else []):
        add_command(sub, name)

    models = sub.add_parser("models", help="list the hosted models: name, state (ready, loading, failed: why), modes, description")
    models.add_argument("--target", default=target_default, help=target_help)

    inspect = sub.add_parser("inspect", help="show a model's module tree with types and parameter shapes")
    inspect.add_argument("model")
    inspect.add_argument("--target", default=target_default, help=target_help)

    parameters = sub.add_parser(
        "parameters", help="read a model's weights by name or glob (where its config allows it)",
        description="Reads the parameters NAMES name (exact names or globs: '*' one segment, '**' any) with "
        "GetParameters and prints each one's name, shape, dtype and size; --out also saves them to a "
        "safetensors file. The model's config must set parameters_readable = true (the demo models do; "
        "hookwire serve --model ... --parameters-readable for models given by flag). "
        "A progress bar (bytes, rate) shows on a terminal once 8 MiB have arrived.",
    )
    parameters.add_argument("model")
    parameters.add_argument("names", nargs="+", metavar="NAME")
    parameters.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None,
                            help="cast floating-point parameters on the server first")
    parameters.add_argument("--out", "-o", default=None, help="save them to this .safetensors file")
    parameters.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    parameters.add_argument("--target", default=target_default, help=target_help)

    generate = sub.add_parser(
        "generate", help="generate text with a causal LM, printed as it is produced",
        description="Generates up to -n tokens after PROMPT and prints the new text as it is produced (stdout), "
                    "then why it finished (stderr: length, eos, stop). Unset sampling options keep the model's "
                    "generation_config. --hook FILE adds a hook for this call, e.g. a steering rule: a HookSpec "
                    "in protobuf JSON form, as json_format.MessageToJson(hookwire.HookSpec(...).to_proto()) "
                    "writes it (parsed as data, never run).")
    generate.add_argument("model")
    generate.add_argument("prompt")
    generate.add_argument("-n", "--max-new-tokens", type=int, default=32, metavar="N",
                          help="new tokens at most (default 32)")
    mode = generate.add_mutually_exclusive_group()
    mode.add_argument("--do-sample", dest="do_sample", action="store_true", default=None, help="sample")
    mode.add_argument("--greedy", dest="do_sample", action="store_false", help="take the most likely token")
    generate.add_argument("--temperature", type=float, help="sampling temperature (> 0)")
    generate.add_argument("--top-k", type=int, help="sample from the k most likely tokens (0: all)")
    generate.add_argument("--top-p", type=float, help="sample from the most likely tokens whose probabilities sum to P")
    generate.add_argument("--seed", type=int, help="seed of the sampling, to reproduce a generation (printed when sampling)")
    generate.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="stop once the text ends with TEXT (repeatable)")
    generate.add_argument("--hook", action="append", default=[], metavar="FILE",
                          help="a hook for this call: a HookSpec in protobuf JSON form (repeatable)")
    generate.add_argument("--target", default=target_default, help=target_help)

    tap = sub.add_parser("tap", help="live view of the matched modules: calls/s, summary statistics, drops")
    tap.add_argument("model")
    tap.add_argument("pattern", help="module path or glob, e.g. 'encoder.layers.*'")
    tap.add_argument("--stats", action="store_true", help="show mean/std/min/max/norm/NaN of each module's output")
    tap.add_argument("--every", type=int, default=1, metavar="N", help="sample every N-th call (cheaper)")
    tap.add_argument("--scope", choices=["all", "session"], default="all", help="watch every caller (default) or only this session")
    tap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    tap.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    tap.add_argument("--plain", action="store_true", help="append tables instead of redrawing (default when not a terminal)")
    tap.add_argument("--target", default=target_default, help=target_help)

    health = sub.add_parser("health", help="check a server's gRPC health (exit 0 when SERVING)")
    health.add_argument("target", nargs="?", default=target_default, help=target_help)
    health.add_argument("--service", default="", help="a service name: hookwire.v1.ModelService, hookwire.live, "
                        "hookwire.model.NAME, ... (default: the server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")

    harvest = sub.add_parser(
        "harvest", help="activation datasets: start a harvest job and follow it; list; cancel JOB; --watch JOB",
        description="hookwire harvest MODEL --modules 'encoder.layer.*' --data texts.jsonl --out DIR starts a job on "
                    "the server (paths under its harvest roots) and shows its progress; Ctrl-C stops watching, not the "
                    "job. hookwire harvest list | cancel JOB | --watch JOB. --sink client runs the harvest from here "
                    "into a local DIR instead (docs/harvest.md).")
    harvest.add_argument("words", nargs="*", metavar="MODEL | list | cancel JOB")
    harvest.add_argument("--modules", action="append", help="module path or glob (repeatable)")
    harvest.add_argument("--data", help="text dataset: .jsonl, .parquet, .txt or a save_to_disk folder")
    harvest.add_argument("--text-field", default="text", help="field or column holding the text (default text)")
    harvest.add_argument("--format", choices=["jsonl", "parquet", "text", "hf"], help="the data's format (default: from its name)")
    harvest.add_argument("--split", help="split of a DatasetDict folder (default train)")
    harvest.add_argument("--out", help="output folder (under the server's root; a local folder or URL with --sink client)")
    harvest.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], help="cast stored values")
    harvest.add_argument("--part", choices=["output", "input"], default="output", help="the modules' output (default) or input")
    harvest.add_argument("--select", help="a selection that keeps the first two dims, e.g. '[..., :64]'")
    harvest.add_argument("--tokens", type=parse_count, help="token budget: 500k, 10M, 1G (default: the whole source)")
    harvest.add_argument("--length", type=int, default=128, help="tokens per context (default 128)")
    harvest.add_argument("--batch-size", type=int, default=8, help="contexts per forward pass (default 8)")
    harvest.add_argument("--packing", choices=["truncate", "pack"], default="truncate",
                         help="one document per context (default), or documents packed into full contexts")
    harvest.add_argument("--no-bos", action="store_true", help="contexts without a BOS (CLS) token")
    harvest.add_argument("--skip-first", type=int, default=0, help="do not store each context's first N positions")
    harvest.add_argument("--shard-tokens", type=parse_count, default=65536, help="tokens per shard (default 65536)")
    harvest.add_argument("--shuffle", action="store_true", help="shuffle tokens across a buffer of shards")
    harvest.add_argument("--shuffle-buffer", type=int, default=4, help="shards per shuffle buffer (default 4)")
    harvest.add_argument("--seed", type=int, default=0, help="shuffle seed")
    harvest.add_argument("--overwrite", action="store_true", help="replace a finished dataset at --out")
    harvest.add_argument("--worker-index", type=int, default=0, help="this worker of a split (0-based)")
    harvest.add_argument("--num-workers", type=int, default=1, help="workers of a split (each takes every N-th batch)")
    harvest.add_argument("--sink", choices=["server", "client"], default="server",
                         help="server: a job on the server (default); client: run from here, write --out locally")
    harvest.add_argument("--tokenizer", help="with --sink client and --data: tokenize here with this folder's tokenizer "
                                             "(default: the model's tokenizer on the server, through Tokenize)")
    harvest.add_argument("--token-file", help="with --sink client: a .npy of token ids [contexts, length]")
    harvest.add_argument("--pad-token-id", type=int, help="with --token-file: the id that pads rows")
    harvest.add_argument("--watch", metavar="JOB", help="follow a running job")
    harvest.add_argument("--detach", action="store_true", help="start the job, print its id and exit")
    harvest.add_argument("--active", action="store_true", help="with list: only running and pending jobs")
    harvest.add_argument("--model", dest="model_filter", help="with list: only jobs on this model")
    harvest.add_argument("--plain", action="store_true", help="progress as lines instead of a bar")
    harvest.add_argument("--wait-ready", type=float, default=120.0, metavar="SECONDS",
                         help="wait up to SECONDS for the model to be ready (a server just started loads it; "
                              "default 120)")
    harvest.add_argument("--target", default=target_default, help=target_help)

    hooks = sub.add_parser("hooks", help="list or remove registered hooks")
    hooks_sub = hooks.add_subparsers(dest="hooks_command", required=True)
    hooks_list = hooks_sub.add_parser("list", help="every hook, with its statistics")
    hooks_list.add_argument("--model", help="only hooks on this model")
    hooks_list.add_argument("--session", help="only hooks of this session")
    hooks_list.add_argument("--target", default=target_default, help=target_help)
    hooks_rm = hooks_sub.add_parser(
        "rm", help="remove hooks by id",
        description="Removes each hook (yours, or any as an operator). Idempotent, like HookHandle.remove(): an id "
                    "that names no hook you may remove (already removed, expired, never registered; with tokens, "
                    "also another principal's hook, which the server does not reveal) prints 'already gone' and "
                    "exits 0. An argument that is not a hook id (hk_ and 32 hex digits, as hookwire hooks list "
                    "shows them) exits 2 before anything is removed.")
    hooks_rm.add_argument("ids", nargs="+", metavar="ID")
    hooks_rm.add_argument("--target", default=target_default, help=target_help)
    operands = sub.add_parser("operands", help="named operands: tensors and SAEs kept on the server for rules")
    operands_sub = operands.add_subparsers(dest="operands_command", required=True)
    operands_list = operands_sub.add_parser("list", help="the published operands and yours (an operator's: everyone's)")
    operands_up = operands_sub.add_parser(
        "upload", help="upload a tensor or an SAE under a name",
        description="Uploads PATH under NAME: a folder in SAELens' layout (cfg.json, sae_weights.safetensors) is an "
                    "SAE, a .safetensors file of one tensor or a .npy file a tensor. It lives for --ttl seconds "
                    "(this command's session ends when it exits). Rules name it: rules.operand(NAME), "
                    "rules.Sae.named(NAME).")
    operands_up.add_argument("name", metavar="NAME")
    operands_up.add_argument("path", metavar="PATH")
    operands_up.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS",
                             help="how long it lives on the server (default 3600; at most its max_ttl_seconds)")
    operands_pub = operands_sub.add_parser(
        "publish", help="operators: publish a read-only operand for everyone from the server's operand_root")
    operands_pub.add_argument("name", metavar="NAME")
    operands_pub.add_argument("path", metavar="PATH", help="relative to the server's --operand-root")
    operands_rm = operands_sub.add_parser("rm", help="delete an operand (refused while a hook or harvest job uses it)")
    operands_rm.add_argument("name", metavar="NAME")
    operands_rm.add_argument("--owner", help="operators: delete another principal's operand")
    for command in (operands_list, operands_up, operands_pub, operands_rm):
        command.add_argument("--target", default=target_default, help=target_help)
    for command in (models, inspect, parameters, generate, tap, health, hooks_list, hooks_rm, harvest, operands_list,
                    operands_up, operands_pub, operands_rm):
        command.add_argument("--token", help="bearer token (default: the HOOKWIRE_TOKEN variable)")
        command.add_argument("--tls", action="store_true", help="connect with TLS, verifying the server with the system roots")
        command.add_argument("--tls-ca", help="PEM CA that verifies the server (implies --tls)")
        command.add_argument("--tls-cert", help="PEM client certificate, for mTLS")
        command.add_argument("--tls-key", help="PEM client key, for mTLS")

    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hookwire`` command; returns the exit status.

    Failed calls print one line on stderr (no traceback) and return 1; unusable
    input (a bad target, a malformed hook id) returns 2. When stdout closes early
    (``hookwire inspect m | head -2``) the command stops quietly with status 141,
    as a process ended by SIGPIPE does.
    """
    args = sys.argv[1:] if argv is None else argv
    word = next((a for a in args if not a.startswith("-")), None)
    # The SDK's own commands start without looking for the others (entry points: tens of ms).
    ns = build_parser(added_commands=word not in SDK_COMMANDS).parse_args(args)
    try:
        status = _run(ns)
        sys.stdout.flush()  # output that fit in the buffer meets a closed pipe here
    except BrokenPipeError:
        # Point stdout at /dev/null so that the interpreter's own flush at exit
        # does not raise again ("Exception ignored ... BrokenPipeError").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return status


def _run(ns: argparse.Namespace) -> int:
    handler = getattr(ns, "command_handler", None)
    if handler is not None:  # a command another package adds (the server's serve and token)
        status: int = handler(ns)
        return status
    problem = target_problem(ns.target, "target" if ns.command == "health" else "--target")
    if problem is not None:
        print(f"hookwire {ns.command}: {problem}", file=sys.stderr)
        return 2
    commands = {"models": _models, "inspect": _inspect, "generate": _generate, "hooks": _hooks, "health": _health,
                "parameters": _parameters, "operands": _operands}
    try:
        if ns.command == "tap":
            return _tap(ns)
        if ns.command == "harvest":
            return _harvest_command(ns)
        return asyncio.run(commands[ns.command](ns))
    except HookwireError as exc:
        print(f"hookwire {ns.command}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a target or option the SDK cannot use
        print(f"hookwire {ns.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise
    except (ConnectionError, OSError) as exc:  # e.g. an unreadable --tls-ca file
        print(f"hookwire {ns.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
