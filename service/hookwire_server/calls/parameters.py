"""Reading a model's parameters (GetParameters): names and globs resolved, limits
checked, each parameter copied on the model's worker thread and streamed.

Off by default per model (``ModelHost.parameters_readable``, the model config's
``parameters_readable``): production weights may be private.

What is read, and when. A model's passes and everything else that touches its
modules run on its worker thread (model_registry), so copying a parameter there,
between two passes, reads it whole and never while a pass runs. (hookwire itself
never changes weights: rules change activations, and backward passes clear the
gradients they make; a model's own forward could, and the copy then sees the
weights as they were between two passes.) Each parameter is copied once, straight
into the wire bytes of the messages that carry it (a Chunker with a Framing, as
Generate's captures are): small ones inline in their ``parameter`` message, large
ones as TensorChunk messages after it (hookwire.wire.framing). Parameters are copied in
groups of at most ``GROUP_BYTES`` (or one larger parameter), and the next group only
once the previous one has been handed to gRPC, so a call holds at most one group's
copy, whatever it asked for; gRPC's flow control holds a call whose client reads
slowly at that point.

Nothing here imports grpc: errors are domain errors (status_mapping maps them).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import torch

from hookwire.wire import codec
from hookwire.wire.framing import GET_PARAMETERS_CHUNK, Framing
from hookwire.v1 import model_service_pb2

from .. import limits
from ..auth import ANONYMOUS, Principal
from ..hooks.capture import compile_cast
from ..errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable, Unimplemented
from ..hooks.event_bus import DEFAULT_MAX_MESSAGE_BYTES, MIN_MAX_MESSAGE_BYTES, chunk_bytes_for
from .admission import Admission
from ..models.model_registry import ModelHost
from ..models.module_patterns import MAX_PATTERN_LENGTH, is_glob

#: Parameters copied in one trip to the model's worker thread, in bytes at most (a larger
#: parameter goes alone): fewer trips for the many small ones (biases, norms), and a call's
#: copy stays this size or one parameter's.
GROUP_BYTES = 16 * 1024 * 1024

#: A parameter message, the Chunker holding its chunk messages, and its tensor's bytes.
Reply = tuple[model_service_pb2.GetParametersResponse, codec.Chunker, int]


def not_readable_message(name: str) -> str:
    """Why GetParameters refuses a model whose config does not allow it, and what to do."""
    return (f"model {name!r} does not allow reading its parameters: its operator sets "
            f"`parameters_readable = true` in the model's [[models]] entry of the server config "
            f"(or serves it with `hookwire serve --model ... --parameters-readable`) to allow it")


@dataclasses.dataclass(frozen=True)
class Selection:
    """The parameters one call reads: their names in named_parameters order, and the bytes
    each takes on the wire (after the cast)."""

    names: list[str]
    sizes: list[int]
    #: How many parameters each pattern matched, in the request's order (before the
    #: union): a refusal says them, since a glob's reach is not obvious from its text.
    matches: list[int] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """The bytes of them all."""
        return sum(self.sizes)

    def groups(self) -> list[list[str]]:
        """The names in order, cut into runs of at most GROUP_BYTES (a larger parameter alone)."""
        out: list[list[str]] = []
        size = 0
        for name, nbytes in zip(self.names, self.sizes):
            if not out or size + nbytes > GROUP_BYTES:
                out.append([])
                size = 0
            out[-1].append(name)
            size += nbytes
        return out


def select_parameters(host: ModelHost, patterns: list[str], cast: torch.dtype | None) -> Selection:
    """The parameters ``patterns`` (exact names or globs) name, each once, in the model's
    named_parameters(remove_duplicate=False) order (the names an engine adds as views of
    them after their source: ModelHost.parameter_names). NotFound naming the first pattern
    that matches nothing (and why, for a name the engine knows it cannot answer to:
    ModelHost.parameter_gaps); InvalidArgument for a glob over the matcher's length;
    Unimplemented for a parameter whose dtype has no wire form. Costs one walk of the
    parameter names per glob: run it off the event loop."""
    index = host.parameter_index
    order = {name: i for i, name in enumerate(index.paths)}
    chosen: set[int] = set()
    matches = []
    for i, pattern in enumerate(patterns):
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise InvalidArgument(f"names[{i}]: a parameter pattern is at most {MAX_PATTERN_LENGTH} characters")
        found = index.match(pattern)
        if not found:
            if is_glob(pattern):
                raise NotFound(f"names[{i}]: pattern {pattern!r} matches no parameter of model {host.name!r}")
            gap = host.parameter_gaps.get(pattern)
            if gap is not None:
                raise NotFound(f"names[{i}]: model {host.name!r} cannot answer to parameter {pattern!r}: {gap}")
            raise NotFound(f"names[{i}]: model {host.name!r} has no parameter {pattern!r} (GetModel lists them "
                           "per module; a glob such as '**' matches several)")
        chosen.update(order[name] for name in found)
        matches.append(len(found))
    names = [index.paths[i] for i in sorted(chosen)]
    sizes = []
    for name in names:
        param = host.parameter(name)
        dtype = cast if cast is not None and param.is_floating_point() else param.dtype
        try:
            code = codec.wire_dtype_of(dtype)
        except codec.CodecError:
            raise Unimplemented(f"parameter {name!r} of model {host.name!r} is {param.dtype}, which has no wire form") from None
        sizes.append(param.numel() * codec.ITEMSIZE[code])
    return Selection(names, sizes, matches)


#: Patterns a refusal lists one by one (more are counted), and the characters of a
#: pattern it quotes (a longer one is cut, with its length said).
SHOWN_PATTERNS = 4
SHOWN_PATTERN_CHARS = 48


def describe_matches(patterns: list[str], selection: Selection) -> str:
    """``the names match 12 parameters ('encoder.*.weight': 12)``: how many parameters a
    request's names matched in all (each counted once) and per name."""
    def shown(pattern: str) -> str:
        if len(pattern) <= SHOWN_PATTERN_CHARS:
            return repr(pattern)
        return f"{pattern[:SHOWN_PATTERN_CHARS]!r}... ({len(pattern)} characters)"

    count = len(selection.names)
    what = f"the names match {count} parameter{'s' if count != 1 else ''}"
    if len(patterns) > SHOWN_PATTERNS:
        return f"{what} ({len(patterns)} names)"
    return f"{what} ({'; '.join(f'{shown(p)}: {k}' for p, k in zip(patterns, selection.matches))})"


def copy_parameters(host: ModelHost, names: list[str], cast: torch.dtype | None, framing: Framing) -> list[Reply]:
    """One ``parameter`` message per name, and the Chunker holding the chunk messages of
    its tensor when it does not travel inline: the one copy of each parameter, cast
    first when ``cast`` is set and it is floating-point. Blocks: run it on the model's
    worker thread (``host.run``), between passes."""
    out: list[Reply] = []
    with torch.no_grad():
        for name in names:
            t = host.parameter_value(name)
            if cast is not None and t.is_floating_point():
                t = t.to(cast)
            msg = model_service_pb2.GetParametersResponse()
            msg.parameter.name = name
            chunker = codec.Chunker(snapshot=True, framing=framing)
            nbytes = codec.encode_tensor_into(t, msg.parameter.tensor, chunker)
            out.append((msg, chunker, nbytes))
    return out


class Parameters:
    """GetParameters calls: checks, limits, the copies on the model's thread, the stream."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._state = admission.state
        self.limits = admission.state.limits
        #: Running calls by principal name.
        self._by_principal: dict[str, int] = {}

    def running(self, principal: str) -> int:
        """GetParameters calls of ``principal`` running now."""
        return self._by_principal.get(principal, 0)

    async def read(
        self, request: model_service_pb2.GetParametersRequest, principal: Principal = ANONYMOUS,
    ) -> AsyncIterator[model_service_pb2.GetParametersResponse | bytes]:
        """Runs one GetParameters call, yielding its stream's messages (chunk messages as
        their wire bytes). Everything the request can be refused for is raised before the
        first message: PermissionDenied (role), InvalidArgument, NotFound (model, name),
        Unavailable (loading, shutting down), FailedPrecondition (failed to load; not
        readable), ResourceExhausted (a limit, named), Unimplemented (a dtype with no
        wire form). Unavailable later too, when the server starts shutting down."""
        host = self._admission.enter("GetParameters", principal, request.model)
        if not host.parameters_readable:
            raise FailedPrecondition(not_readable_message(host.name))
        cast = compile_cast(request.dtype, "dtype")
        patterns = list(request.names)
        if not patterns:
            raise InvalidArgument("names: no parameter named; give exact names or globs ('**' for every parameter)")
        if len(patterns) > self.limits.max_parameter_names:  # (the request bounds count them before the parse)
            raise limits.exceeded("names", f"{len(patterns)} names", self.limits.max_parameter_names,
                                  "max_parameter_names")
        max_message = request.max_response_message_bytes
        if max_message and max_message < MIN_MAX_MESSAGE_BYTES:
            raise InvalidArgument(f"max_response_message_bytes: {max_message} is below the minimum "
                                  f"{MIN_MAX_MESSAGE_BYTES} (0 for 4 MiB)")
        mine = self.running(principal.name)
        limits.check(mine, self.limits.max_parameter_calls_per_principal,
                     f"{principal.name!r} has {mine} GetParameters calls running", "max_parameter_calls_per_principal",
                     "name several parameters in one call instead")
        # Counted from here: the awaits below let other calls in, which must see this one.
        self._by_principal[principal.name] = mine + 1
        try:
            loop = asyncio.get_running_loop()
            selection = await loop.run_in_executor(None, select_parameters, host, patterns, cast)
            if selection.nbytes > self.limits.max_parameter_bytes:
                as_cast = f" as {codec.dtype_name(request.dtype)}" if cast is not None else ""
                or_cast = "" if cast is not None else " or cast them (dtype)"
                raise limits.exceeded(
                    describe_matches(patterns, selection), f"they take {selection.nbytes} bytes{as_cast}",
                    self.limits.max_parameter_bytes, "max_parameter_bytes", f"name fewer per call{or_cast}",
                )
            chunk_bytes = chunk_bytes_for(max_message or DEFAULT_MAX_MESSAGE_BYTES)
            framing = Framing(GET_PARAMETERS_CHUNK, chunk_bytes)
            sent = self._state.metrics.parameter_bytes.labels(host.name)
            for group in selection.groups():
                if self._state.draining:
                    raise Unavailable("the server is shutting down")
                try:
                    replies = await host.run(copy_parameters, host, group, cast, framing)
                except RuntimeError as exc:  # the model's thread was stopped: the server is stopping
                    raise Unavailable(f"the server is shutting down ({exc})") from None
                replies.reverse()
                while replies:
                    msg, chunker, nbytes = replies.pop()  # each copy goes once it is sent
                    yield msg
                    for frame in chunker.frames(GET_PARAMETERS_CHUNK, chunk_bytes):  # wire bytes (see hookwire.wire.framing)
                        yield frame
                    sent.inc(nbytes)
                    del msg, chunker
        finally:
            self._by_principal[principal.name] -= 1
            if not self._by_principal[principal.name]:
                del self._by_principal[principal.name]
