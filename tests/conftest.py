from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator

import pytest
import torch

import hookwire
from hookwire_server import ServerSettings
from support import ServerThread, build_test_registry


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    """One real server for the session, on a free loopback port."""
    srv = ServerThread(build_test_registry()).start()
    yield srv
    srv.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerThread]]:
    """Starts a real server on the test registry, on a free loopback port, with the given
    ServerSettings fields (e.g. a tight limit); each is stopped after the test."""
    started: list[ServerThread] = []

    def start(**settings: Any) -> ServerThread:
        srv = ServerThread(build_test_registry(), ServerSettings(port=0, **settings)).start()
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
async def client(server: ServerThread) -> AsyncIterator[hookwire.Client]:
    """A connected SDK client; closing it ends its session (and its hooks)."""
    async with hookwire.connect(server.target) as c:
        yield c


@pytest.fixture
async def other_client(server: ServerThread) -> AsyncIterator[hookwire.Client]:
    """A second, independent client."""
    async with hookwire.connect(server.target) as c:
        yield c


@pytest.fixture
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded transformer inputs: input_ids (2, 6) and an attention mask with padding."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return ids, mask
