"""Fixtures shared by the integration tests (plain helpers are in tests/support.py)."""

from __future__ import annotations

from typing import AsyncIterator, Iterator

import pytest

import hookwire
from hookwire_server.models.model_registry import ModelHost
from support import ServerThread, Twice, build_test_registry, serving


@pytest.fixture(scope="session")
def sdk_server() -> Iterator[ServerThread]:
    """The server of the SDK's notebook-facing tests (run_with_cache, event iterators, the
    sync client): the test registry plus "twice" (a module called twice in a pass). Apart
    from the session's ``server``: these tests close clients mid-call and stall readers."""
    registry = build_test_registry()
    registry.add(ModelHost("twice", Twice()))
    with serving(registry) as srv:
        yield srv


@pytest.fixture
async def sdk_client(sdk_server: ServerThread) -> AsyncIterator[hookwire.Client]:
    """A connected SDK client of ``sdk_server``."""
    async with hookwire.connect(sdk_server.target) as c:
        yield c
