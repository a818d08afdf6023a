"""Limits are defined once (limits.Limits): docs/security.md's limits table lists exactly
its fields with their defaults, HarvestConfig takes its limits from it, and every limit's
message reads alike (limits.exceeded)."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from hookwire_server.calls.harvest import LIMIT_FIELDS, HarvestConfig, settings_from
from hookwire_server.errors import InvalidArgument, ResourceExhausted
from hookwire_server.limits import Limits, check, exceeded

SECURITY_MD = pathlib.Path(__file__).resolve().parents[2] / "docs" / "security.md"
SUPERSCRIPT = str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹")


def rendered(name: str, value: float) -> str:
    """A default as the table writes it: bytes in KiB/MiB/GiB, seconds in s/h/d,
    milliseconds in ms, powers of two past 2¹⁶ as 2ⁿ, other counts in digits."""
    if name.endswith(("_seconds", "_timeout")):
        for unit, size in (("d", 86400), ("h", 3600)):
            if value % size == 0 and value >= (2 * size if unit == "d" else size):
                return f"{int(value // size)} {unit}"
        return f"{value:g} s"
    if name.endswith("_ms"):
        return f"{value:g} ms"
    value = int(value)
    if "bytes" in name and value:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size} {unit}"
    if value > 1 << 16 and value & (value - 1) == 0:
        return "2" + str(value.bit_length() - 1).translate(SUPERSCRIPT)
    return str(value)


def table_rows() -> dict[str, str]:
    """setting -> default cell, from the table under "## Limits" in docs/security.md."""
    text = SECURITY_MD.read_text(encoding="utf-8")
    section = text.split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] in ("setting", "---") or set(cells[0]) <= set("-:"):
            continue
        match = re.fullmatch(r"`([a-z_0-9]+)`", cells[0])
        assert match, f"a row of the limits table that names no setting: {line!r}"
        assert match.group(1) not in rows, f"{match.group(1)} is listed twice"
        rows[match.group(1)] = cells[1]
    return rows


def test_the_formatter_writes_as_the_table_does() -> None:
    assert rendered("max_message_bytes", 1 << 30) == "1 GiB"
    assert rendered("max_slot_bytes", 256 << 20) == "256 MiB"
    assert rendered("max_ttl_seconds", 86400) == "24 h"
    assert rendered("harvest_retention_seconds", 7 * 86400.0) == "7 d"
    assert rendered("infer_timeout", 600.0) == "600 s"
    assert rendered("max_infer_elements", 1 << 31) == "2³¹"
    assert rendered("max_request_values", 65536) == "65536"
    assert rendered("harvest_max_bytes_per_principal", 0) == "0"


def test_the_docs_limits_table_lists_every_limit_with_its_default() -> None:
    rows = table_rows()
    defaults = {f.name: getattr(Limits(), f.name) for f in dataclasses.fields(Limits)}
    assert sorted(set(defaults) - set(rows)) == [], "Limits fields missing from docs/security.md's table"
    assert sorted(set(rows) - set(defaults)) == [], "the table names settings that are not Limits fields"
    wrong = {}
    for name, value in defaults.items():
        want, cell = rendered(name, value), rows[name]
        if cell != want and not cell.startswith(want + " ("):  # "0 (no limit)": a note may follow
            wrong[name] = (cell, want)
    assert not wrong, f"defaults in the table that differ from the code (table, code): {wrong}"


def test_harvest_config_takes_its_limits_from_limits() -> None:
    harvest = {f.name for f in dataclasses.fields(Limits) if f.name.startswith("harvest_")}
    assert {"harvest_" + name for name in LIMIT_FIELDS} == harvest
    default = HarvestConfig()
    for name in LIMIT_FIELDS:
        assert getattr(default, name) == getattr(Limits(), "harvest_" + name), name
    changed = settings_from(data_root=None, output_root=None, url_prefixes="s3://a/, s3://b/", state_dir=None,
                            limits=Limits(harvest_max_workers=3, harvest_lease_seconds=2.0))
    assert (changed.max_workers, changed.lease_seconds, changed.url_prefixes) == (3, 2.0, ("s3://a/", "s3://b/"))


def test_a_limit_reads_alike_everywhere() -> None:
    error = exceeded("hooks", "65 request-scoped hooks", 64, "max_request_hooks")
    assert isinstance(error, ResourceExhausted)
    assert str(error) == "hooks: 65 request-scoped hooks, over the limit of 64 (max_request_hooks)"
    error = exceeded("stop", "3 stop strings", 2, "max_stop_strings", "send fewer", error=InvalidArgument)
    assert isinstance(error, InvalidArgument)
    assert str(error) == "stop: 3 stop strings, over the limit of 2 (max_stop_strings); send fewer"
    check(63, 64, "'alice' has 63 open sessions", "max_sessions_per_principal")
    with pytest.raises(ResourceExhausted) as info:
        check(64, 64, "'alice' has 64 open sessions", "max_sessions_per_principal")
    assert str(info.value) == ("'alice' has 64 open sessions: 65 with this one, over the limit of 64 "
                               "(max_sessions_per_principal)")
