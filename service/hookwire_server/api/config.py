"""Operator settings from flags, ``HOOKWIRE_*`` environment variables and the TOML
config's ``[server]`` table, in that order of precedence."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Mapping

from ..models.model_loading import ConfigError
from .server import ServerSettings

ENV_PREFIX = "HOOKWIRE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(name: str, kind: str, raw: Any, where: str) -> Any:
    if raw is None:
        return None
    try:
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {raw!r} is not a valid {kind} for {name}") from None


def _kinds() -> dict[str, str]:
    hints = typing.get_type_hints(ServerSettings)
    kinds = {}
    for field in dataclasses.fields(ServerSettings):
        hint = str(hints[field.name])
        kinds[field.name] = next((k for k in ("bool", "int", "float", "str") if k in hint), "str")
    return kinds


def resolve_settings(
    flags: Mapping[str, Any], env: Mapping[str, str], file_table: Mapping[str, Any],
) -> tuple[ServerSettings, dict[str, str]]:
    """The settings, and where each non-default one came from ("flag", "env", "config")."""
    kinds = _kinds()
    unknown = set(file_table) - set(kinds)
    if unknown:
        raise ConfigError(f"[server] has unknown keys {sorted(unknown)}; known: {sorted(kinds)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, kind in kinds.items():
        env_name = ENV_PREFIX + name.upper()
        if flags.get(name) is not None:
            values[name], sources[name] = _convert(name, kind, flags[name], "flag"), "flag"
        elif env_name in env:
            values[name], sources[name] = _convert(name, kind, env[env_name], env_name), "env"
        elif name in file_table:
            values[name], sources[name] = _convert(name, kind, file_table[name], "config [server]"), "config"
    return ServerSettings(**values), sources


def pick(name: str, flag: Any, env: Mapping[str, str], file_table: Mapping[str, Any], default: Any) -> Any:
    """One CLI-level option (log format, config path, ...) with the same precedence."""
    if flag is not None:
        return flag
    if ENV_PREFIX + name.upper() in env:
        return env[ENV_PREFIX + name.upper()]
    return file_table.get(name, default)
