from __future__ import annotations

import contextlib
from typing import Any, AsyncIterator, Callable, Iterator

import pytest
import torch

import hookwire
from hookwire_server import ModelRegistry
from support import ServerThread, serving, token_batch


@pytest.fixture(scope="session")
def server() -> Iterator[ServerThread]:
    """One real server for the session, on a free loopback port."""
    with serving() as srv:
        yield srv


@pytest.fixture
def make_server() -> Iterator[Callable[..., ServerThread]]:
    """Starts a real server on a free loopback port: on ``registry`` (the test registry
    where none is given), with the given ServerSettings fields (e.g. a tight limit); each
    is stopped after the test."""
    with contextlib.ExitStack() as stack:

        def start(registry: ModelRegistry | None = None, **settings: Any) -> ServerThread:
            return stack.enter_context(serving(registry, **settings))

        yield start


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
    return token_batch(7, 6, padded_from=4)
