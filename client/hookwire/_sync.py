"""The synchronous client: the async client's surface with blocking calls, context
managers and iterators, for scripts and notebooks::

    with hookwire.connect_sync("127.0.0.1:50051") as client:
        model = client.model("tiny-transformer")
        out, cache = model.run_with_cache(ids, modules="encoder.layers.*")
        with model.hook("encoder.layers.0", posthook=hookwire.capture("output")) as hook:
            result = model.infer(ids)
            for event in hook.events(until=result):
                ...

One implementation: every call runs the async client's own coroutine on an event loop
that this client keeps on a thread of its own, and the calling thread waits for it. So
it works the same in a plain script and inside a running event loop (a Jupyter kernel,
whose loop stays untouched), and objects the async client returns (HookHandle,
Subscription, GenerateStream, HarvestJob) come back wrapped so that their methods block
too. ``.aio`` on each object is the async one underneath.

Ctrl-C (KeyboardInterrupt) while a call blocks cancels that call on the loop, as
cancelling its task would in async code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

from ._client import Client, ConnectOptions, DEFAULT_TARGET, HookHandle, RemoteModel, Subscription, connect
from ._generation import GenerateStream
from ._harvest import HarvestJob, HarvestProgress
from ._specs import HookSpec
from ._types import GenerateResult, HookInfo, InterceptEvent

T = TypeVar("T")


class _Loop:
    """An event loop running on a daemon thread of its own; ``run`` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hookwire-sync", daemon=True)
        self._thread.start()
        # close() and calls from other threads: once closing, no call is scheduled, and
        # the calls still pending when the loop stops fail instead of waiting forever.
        self._lock = threading.Lock()
        self._closing = False
        self._pending: set[concurrent.futures.Future[Any]] = set()

    @property
    def closed(self) -> bool:
        """Whether close() has begun: calls raise, teardown calls return at once."""
        return self._closing

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the loop and blocks until it is done; its result or exception.
        A KeyboardInterrupt (or any exception) in the waiting thread cancels it."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a synchronous hookwire call was made from its own event loop (a callback?)")
        # Not asyncio.run_coroutine_threadsafe: a Ctrl-C landing inside it, after it has
        # scheduled the coroutine but before it returns the future, would leave the call
        # running with nothing to cancel it. Here the future exists before anything is
        # scheduled, and cancelling it at any point cancels the call.
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                coro.close()
                raise RuntimeError("this hookwire client is closed")
            self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        try:
            self.loop.call_soon_threadsafe(self._start, coro, future)
            return future.result()
        except BaseException:
            future.cancel()  # no-op when it finished; else (Ctrl-C) the call is cancelled on the loop
            raise

    def _start(self, coro: Coroutine[Any, Any, T], future: concurrent.futures.Future[T]) -> None:
        """On the loop: runs ``coro`` as a task whose outcome goes to ``future``, and
        which a cancelled ``future`` cancels."""
        if future.cancelled():
            coro.close()
            return
        task = self.loop.create_task(coro)

        def settle(done: asyncio.Task[T]) -> None:
            try:
                if done.cancelled():
                    if self._closing:  # cancelled by close(), not by its caller: say so
                        future.set_exception(RuntimeError("this hookwire client was closed during the call"))
                    else:
                        future.cancel()
                elif done.exception() is not None:
                    future.set_exception(done.exception())
                else:
                    future.set_result(done.result())
            except concurrent.futures.InvalidStateError:  # the caller cancelled it meanwhile
                pass

        task.add_done_callback(settle)
        future.add_done_callback(lambda f: f.cancelled() and self.loop.call_soon_threadsafe(task.cancel))

    def close(self) -> None:
        """Cancels what still runs on the loop (streams left open), then stops the loop
        and its thread. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if threading.current_thread() is self._thread:
            # Called on the loop itself (a callback, a finalizer run by a collection there):
            # it cannot wait for itself, so a thread of its own closes it.
            threading.Thread(target=self._shut_down, name="hookwire-sync-close", daemon=True).start()
            return
        self._shut_down()

    def _shut_down(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_drain(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        for future in list(self._pending):  # scheduled just before closing began, never run
            if not future.done():
                future.set_exception(RuntimeError("this hookwire client was closed during the call"))


async def _drain() -> None:
    """Cancels the loop's other tasks and waits for them, so that gRPC's calls end
    cleanly instead of being destroyed pending when the loop stops. Again while any
    remain: a call scheduled just before close began starts its task meanwhile."""
    for _ in range(100):
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if not tasks:
            break
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


def _close_unclosed(loop: _Loop, client: Client) -> None:
    """Closes ``client`` on ``loop``, then the loop (SyncClient.close, or its finalizer;
    on the loop's own thread, from a thread of its own)."""
    if threading.current_thread() is loop._thread:
        threading.Thread(target=_close_unclosed, args=(loop, client), name="hookwire-sync-close", daemon=True).start()
        return
    try:
        if not loop.closed:
            loop.run(client.close())
    finally:
        loop.close()


def _teardown(method: Callable[..., Coroutine[Any, Any, T]], closed: T) -> Callable[..., T]:
    """As ``_blocking``, for removing or closing something: returns ``closed`` at once
    once the client is closed (the server side went with it), as the async method does
    once its session is gone, instead of raising (a ``with`` block's exit would otherwise
    mask the exception that ended it)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        if self._loop.closed:
            return closed
        return self._loop.run(method(self.aio, *args, **kwargs))

    return call


def _blocking(method: Callable[..., Coroutine[Any, Any, T]]) -> Callable[..., T]:
    """A blocking method calling the async ``method`` on the wrapped object (``self.aio``)
    on the client's loop. The docstring and signature are the async method's."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> T:
        return self._loop.run(method(self.aio, *args, **kwargs))

    return call


F = TypeVar("F", bound=Callable[..., Any])


def _like(method: Callable[..., Any]) -> Callable[[F], F]:
    """Gives a wrapper the async method's docstring (what it does, sends and raises)."""

    def give(fn: F) -> F:
        fn.__doc__ = method.__doc__
        return fn

    return give


class SyncIterator(Iterator[T]):
    """An async iterator of the client, iterated from synchronous code: each ``next``
    blocks until the next item arrives. ``close()`` (or leaving ``with``) ends it early."""

    def __init__(self, loop: _Loop, items: AsyncIterator[T], owner: Any = None) -> None:
        self._loop = loop
        self._items = items
        self._done = False
        #: What it was made from (a handle, a stream): kept alive, and with it the client,
        #: whose finalizer would otherwise close the client under the iteration.
        self._owner = owner

    def __iter__(self) -> SyncIterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        try:
            return self._loop.run(_anext(self._items))
        except StopAsyncIteration:
            self._done = True
            raise StopIteration from None

    def close(self) -> None:
        """Ends the iteration (runs the async generator's cleanup). Idempotent."""
        if not self._done:
            self._done = True
            aclose = getattr(self._items, "aclose", None)
            if aclose is not None and not self._loop.closed:
                self._loop.run(aclose())

    def __enter__(self) -> SyncIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _anext(items: AsyncIterator[T]) -> T:
    return await items.__anext__()


def connect_sync(target: str = DEFAULT_TARGET, *, options: ConnectOptions | None = None) -> SyncClient:
    """A blocking client for the server at ``target`` (see ``hookwire.connect`` for
    targets and options). Starts the client's own event-loop thread; nothing is sent
    until the first call. Use it as ``with connect_sync(...) as client:``, or call
    ``client.close()`` when done (the thread is a daemon: a forgotten client does not
    keep the process alive). Raises ValueError for a target it cannot read."""
    return SyncClient(connect(target, options=options))


class SyncClient:
    """``hookwire.connect_sync(...)``: the async Client with every call blocking.

    Methods have the async client's names, arguments, docstrings and errors; they
    return once the server answered. Closing ends the session (its hooks are removed)
    and stops the client's loop thread.
    """

    def __init__(self, client: Client) -> None:
        #: The async client underneath (its coroutines must run on ``loop``).
        self.aio = client
        self._loop = _Loop()
        # Collected without close(): the client's session and channel are closed too, then
        # the loop (the finalizer holds the async client and the loop, never this object).
        self._closer = weakref.finalize(self, _close_unclosed, self._loop, self.aio)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the async client runs on (a thread of this client's own)."""
        return self._loop.loop

    @property
    def target(self) -> str:
        """The address dialled."""
        return self.aio.target

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine of the async API on this client's loop and waits for it:
        ``client.run(client.aio.some_call(...))``, for what has no blocking wrapper."""
        return self._loop.run(coro)

    def close(self) -> None:
        """Ends the session, closes the channel and stops the loop thread. Idempotent."""
        self._closer()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    list_models = _blocking(Client.list_models)
    wait_ready = _blocking(Client.wait_ready)
    list_hooks = _blocking(Client.list_hooks)
    deregister_hook = _blocking(Client.deregister_hook)
    get_slot = _blocking(Client.get_slot)
    list_slots = _blocking(Client.list_slots)
    harvests = _blocking(Client.harvests)
    harvest_local = _blocking(Client.harvest_local)
    upload_operand = _blocking(Client.upload_operand)
    delete_operand = _blocking(Client.delete_operand)
    list_operands = _blocking(Client.list_operands)
    publish_operand = _blocking(Client.publish_operand)

    @property
    def session_id(self) -> str:
        """The open session's id, or "" before one is opened."""
        return self.aio.session_id

    def model(self, name: str) -> SyncModel:
        """A handle on a hosted model; nothing is sent until it is used."""
        return SyncModel(self, self.aio.model(name))

    @_like(Client.register_hook)
    def register_hook(self, spec: HookSpec, *, model: str = "") -> SyncHookHandle:
        return SyncHookHandle(self, self._loop.run(self.aio.register_hook(spec, model=model)))

    @_like(Client.subscribe)
    def subscribe(self, hook_ids: Sequence[str], **options: Any) -> SyncSubscription:
        return SyncSubscription(self, self.aio.subscribe(hook_ids, **options))

    @_like(Client.harvest)
    def harvest(self, model: str, modules: Sequence[str] | str, *, out: str, **options: Any) -> SyncHarvestJob:
        return SyncHarvestJob(self, self._loop.run(self.aio.harvest(model, modules, out=out, **options)))

    def harvest_job(self, job_id: str) -> SyncHarvestJob:
        """A handle on an existing harvest job (nothing is sent until it is used)."""
        return SyncHarvestJob(self, self.aio.harvest_job(job_id))


class SyncModel:
    """A hosted model with blocking calls: ``out = model(x, attention_mask=m)``."""

    def __init__(self, client: SyncClient, model: RemoteModel) -> None:
        self._client = client
        self._loop = client._loop
        #: The async RemoteModel underneath.
        self.aio = model

    @property
    def name(self) -> str:
        return self.aio.name

    def __repr__(self) -> str:
        return f"SyncModel({self.name!r})"

    info = _blocking(RemoteModel.info)
    infer = _blocking(RemoteModel.infer)
    tokenize = _blocking(RemoteModel.tokenize)
    run_with_cache = _blocking(RemoteModel.run_with_cache)
    parameters = _blocking(RemoteModel.parameters)
    parameter = _blocking(RemoteModel.parameter)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs forward in eval mode and returns the output; the session's hooks fire. Blocks."""
        return self._loop.run(self.aio(*args, **kwargs))

    @_like(RemoteModel.generate)
    def generate(self, *args: Any, **kwargs: Any) -> SyncGenerateStream:
        return SyncGenerateStream(self._client, self.aio.generate(*args, **kwargs))

    @_like(RemoteModel.hook)
    def hook(self, module: str, **options: Any) -> SyncHookHandle:
        # Registered at once (blocking), unlike the async PendingHook: the handle is also
        # a context manager, so `with model.hook(...) as h:` removes it on exit.
        return SyncHookHandle(self._client, self._loop.run(self.aio.hook(module, **options).__aenter__()))


class SyncHookHandle:
    """A registered hook (blocking). ``with`` removes it on exit; ``remove()`` is idempotent."""

    def __init__(self, client: SyncClient, handle: HookHandle) -> None:
        self._client = client  # kept alive: its finalizer closes the client
        self._loop = client._loop
        #: The async HookHandle underneath.
        self.aio = handle

    @property
    def id(self) -> str:
        """The server's hook id."""
        return self.aio.id

    @property
    def info(self) -> HookInfo:
        return self.aio.info

    @property
    def modules(self) -> tuple[str, ...]:
        """The module paths the pattern resolved to."""
        return self.aio.modules

    def __repr__(self) -> str:
        return f"SyncHookHandle({self.id!r}, modules={len(self.modules)})"

    @_like(HookHandle.events)
    def events(self, **options: Any) -> SyncIterator[InterceptEvent]:
        return SyncIterator(self._loop, self.aio.events(**options), self)

    remove = _teardown(HookHandle.remove, False)

    def __enter__(self) -> SyncHookHandle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()


class SyncSubscription:
    """A Subscribe stream (blocking): ``with client.subscribe(ids) as sub: for e in sub: ...``."""

    def __init__(self, client: SyncClient, subscription: Subscription) -> None:
        self._client = client  # kept alive: its finalizer closes the client
        self._loop = client._loop
        #: The async Subscription underneath.
        self.aio = subscription

    @property
    def notices(self) -> list[Any]:
        """Notices received so far (drops, removed or disabled hooks)."""
        return self.aio.notices

    start = _blocking(Subscription.start)
    close = _teardown(Subscription.aclose, None)

    @_like(Subscription.events)
    def events(self, **options: Any) -> SyncIterator[InterceptEvent]:
        return SyncIterator(self._loop, self.aio.events(**options), self)

    def __iter__(self) -> Iterator[InterceptEvent]:
        return self.events()

    def __enter__(self) -> SyncSubscription:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncGenerateStream:
    """A Generate call (blocking): iterate it for the items as they happen, or call
    ``result()``; see GenerateStream for what it yields, raises and cancels. Leaving
    ``with`` (or ``close()``) cancels the call if it is still running."""

    def __init__(self, client: SyncClient, stream: GenerateStream) -> None:
        self._client = client  # kept alive: its finalizer closes the client
        self._loop = client._loop
        #: The async GenerateStream underneath.
        self.aio = stream

    def __iter__(self) -> Iterator[Any]:
        return SyncIterator(self._loop, self.aio.__aiter__(), self)

    @property
    def request_id(self) -> str:
        return self.aio.request_id

    @property
    def done(self) -> bool:
        return self.aio.done

    def start(self) -> SyncGenerateStream:
        """Sends the request and waits until the server has started the call."""
        self._loop.run(self.aio.start())
        return self

    def result(self) -> GenerateResult:
        """Reads what was not read yet and returns the GenerateResult. Blocks."""
        return self._loop.run(self.aio.result())

    def cancel(self) -> None:
        """Cancels the call (the server stops at the next step boundary)."""
        self._loop.loop.call_soon_threadsafe(self.aio.cancel)

    close = _teardown(GenerateStream.aclose, None)

    def __enter__(self) -> SyncGenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncHarvestJob:
    """A handle on a server-side harvest job (blocking); see HarvestJob."""

    def __init__(self, client: SyncClient, job: HarvestJob) -> None:
        self._client = client  # kept alive: its finalizer closes the client
        self._loop = client._loop
        #: The async HarvestJob underneath.
        self.aio = job

    @property
    def id(self) -> str:
        return self.aio.id

    @property
    def last(self) -> HarvestProgress | None:
        """The last state seen."""
        return self.aio.last

    def __repr__(self) -> str:
        return repr(self.aio)

    refresh = _blocking(HarvestJob.refresh)
    wait = _blocking(HarvestJob.wait)
    cancel = _blocking(HarvestJob.cancel)

    @_like(HarvestJob.watch)
    def watch(self, **options: Any) -> SyncIterator[HarvestProgress]:
        return SyncIterator(self._loop, self.aio.watch(**options), self)


__all__ = [
    "SyncClient", "SyncGenerateStream", "SyncHarvestJob", "SyncHookHandle", "SyncIterator", "SyncModel",
    "SyncSubscription", "connect_sync",
]