"""Infer calls on a torch model (worker thread): a call alone, or calls the scheduler
joined into one pass over all their rows, each call's output cut back to its rows. The
pass protocol itself is pass_runner's; what follows a pass (held events released,
events kept for a full stream flushed, CallEnded markers) is the call's Pass's."""

from __future__ import annotations

import contextlib
import dataclasses
import concurrent.futures
import logging
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from hookwire.wire import codec as _codec
from hookwire.wire.codec import Chunker
from hookwire.wire.framing import Splicer
from hookwire.v1 import model_service_pb2

from ..errors import InvalidArgument, ResourceExhausted, Unimplemented
from ..hooks.hook_record import HookRecord
from ..hooks.passes import Pass
from ..models.model_registry import ModelHost
from . import batching
from .pass_runner import model_errors, run_joined, running

log = logging.getLogger("hookwire.infer")


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """A validated Backward request."""

    path: tuple[str, ...]
    grad: model_service_pb2.Backward | None
    return_input_grads: bool


def select_output(output: Any, segments: tuple[str, ...]) -> Any:
    """The item of ``output`` that ``segments`` name; InvalidArgument when absent."""
    current = output
    for depth, seg in enumerate(segments):
        where = ".".join(segments[: depth + 1])
        if isinstance(current, Mapping):
            if seg not in current:
                raise InvalidArgument(f"backward.output_path: no key {seg!r} at {where!r} (keys: {list(current)})")
            current = current[seg]
        elif isinstance(current, (tuple, list)):
            if not (seg.isascii() and seg.isdigit() and len(seg) <= 9) or int(seg) >= len(current):
                raise InvalidArgument(
                    f"backward.output_path: {seg!r} at {where!r} is not an index of a sequence of {len(current)} items"
                )
            current = current[int(seg)]
        else:
            raise InvalidArgument(f"backward.output_path: {where!r} goes inside a {type(current).__name__}")
    return current


def _decode_inputs(
    request: model_service_pb2.InferRequest, chunked: Mapping[int, Any] | None, device: torch.device,
) -> tuple[list[Any], dict[str, Any]]:
    """The call's inputs as torch values, their tensors on ``device`` (the model's input
    device: on the CPU nothing moves)."""
    try:
        args = [_codec.decode_value(v, where=f"args[{i}]", chunked=chunked) for i, v in enumerate(request.args)]
        kwargs = {k: _codec.decode_value(v, where=f"kwargs[{k!r}]", chunked=chunked) for k, v in request.kwargs.items()}
    except _codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None
    if device.type != "cpu":
        args = [to_device(v, device) for v in args]
        kwargs = {k: to_device(v, device) for k, v in kwargs.items()}
    return args, kwargs


def token_ids(args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The call's token ids (``input_ids``, or an integer ``[sequences, positions]`` first
    argument) for rules' token-id signals, or None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        return ids
    return None


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor in it moved to ``device`` (lists, tuples and maps rebuilt)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if type(value) in (list, tuple):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


@dataclasses.dataclass
class InferCall:
    """One Infer call waiting for (or in) a pass: the payload of its scheduler Work."""

    p: Pass
    request: model_service_pb2.InferRequest
    records: list[HookRecord]
    train: bool
    backward: BackwardPlan | None
    seed: int | None
    chunked: Mapping[int, Any] | None
    #: How it joins other calls (None: it runs alone).
    shape: batching.Shape | None
    #: Done once the events its pass left in its backlog (a full stream that blocks for
    #: it) are delivered and the call ended (see deliver); None when nothing was left.
    flushing: concurrent.futures.Future[None] | None = None


def deliver(call: InferCall) -> None:
    """After the call's pass (worker thread): delivers its held events (a shared pass's)
    and ends it; events a full stream cannot take now go out from a thread of their own,
    which then ends the call (Pass.finish): ``call.flushing`` is done once it has. Raises
    ResourceExhausted when the held events pass the principal's byte limit (the call
    fails; what was delivered stays delivered, and it still ends)."""
    p = call.p
    try:
        p.release()
    finally:
        call.flushing = p.finish()


def run_infer_batch(host: ModelHost, calls: list[InferCall]) -> list[Any]:
    """Runs Infer calls that the scheduler joined (worker thread): one pass over all
    their rows, each call's output cut back to its rows; a call alone runs exactly as
    before batching. Returns each call's InferResponse, or the exception it fails with.

    When the shared pass fails (one call's failing hook or rule, a tensor that cannot be
    split), every call runs again alone, so one caller's bad input fails only its call.
    """
    results: list[Any] = [None] * len(calls)
    decoded: dict[int, tuple[list[Any], dict[str, Any]]] = {}
    if len(calls) > 1:
        for i, call in enumerate(calls):
            try:
                decoded[id(call)] = _decode_inputs(call.request, call.chunked, host.device)
                call.p.token_ids = token_ids(*decoded[id(call)])
            except Exception as exc:  # its own bad tensor fails only it
                results[i] = exc
    joined = [call for i, call in enumerate(calls) if results[i] is None]
    if len(joined) == 1:  # a lone call, without the pass runner's call-back into this module
        try:
            lone: list[Any] = [_run_pass(host, joined[0])]
        except Exception as exc:
            lone = [exc]
        outcomes = iter(lone)
    else:
        outcomes = iter(run_joined(
            host, joined, lambda cs: _run_shared(host, cs, [decoded[id(c)] for c in cs]),
            lambda call: _run_pass(host, call), what="batch", logger=log,
        ))
    return [result if result is not None else next(outcomes) for result in results]


def _run_shared(
    host: ModelHost, calls: list[InferCall], inputs: list[tuple[list[Any], dict[str, Any]]],
) -> list[Any]:
    """One pass over several calls' rows; each call's response (or failure). Raises
    when the pass itself fails (the caller then runs the calls alone)."""
    settings = host.batching
    lengths = [c.shape.length if c.shape is not None else None for c in calls]
    padded = None
    if len(set(lengths)) > 1:
        rows = sum(c.shape.rows for c in calls if c.shape is not None)
        # Not the row count either: a [tokens, ...] tensor every row shares would be taken for rows.
        padded = batching.padded_length(
            [n for n in lengths if n is not None], host.dimensions | {rows}, host.positions
        )
        if padded is None:
            raise InvalidArgument("the calls' token inputs cannot be padded to a common length within the model's positions")
    args, kwargs = batching.join_inputs(
        inputs, lengths, dim=settings.batch_dim, padded=padded, pad_token_id=settings.pad_token_id,
    )
    segments, start = [], 0
    for call, length in zip(calls, lengths):
        assert call.shape is not None
        segments.append(batching.Segment(call.p, start, start + call.shape.rows, length if padded is not None else None))
        start += call.shape.rows
    batch = batching.Batch(segments, dim=settings.batch_dim, padded=padded)
    model = host.module
    with running(host, batch, [record for call in calls for record in call.records]):
        with torch.no_grad(), model_errors(host, "forward"):
            output = model(*args, **kwargs)
        outputs = batch.split(output, f"the output of model {host.name!r}")  # Unsplittable: they run alone
    del output, args, kwargs
    results: list[Any] = []
    for call, mine in zip(calls, outputs):
        p = call.p
        try:
            try:
                if p.splicer is not None:
                    p.splicer.snapshot = False  # the pass is over: the output no longer changes
                _codec.encode_value_into(mine, p.response.output, chunker=p.splicer, opaque_caches=True)
            except (_codec.CodecError, RuntimeError, NotImplementedError, TypeError) as exc:
                raise Unimplemented(f"the output of model {host.name!r} cannot be sent: {exc}") from None
        except Exception as exc:
            # As alone: its hooks' events are delivered (they fired), then it fails.
            results.append(delivered(call, exc))
            continue
        results.append(delivered(call, p.response))
    return results


def delivered(call: InferCall, result: Any) -> Any:
    """``result`` once the call's held events are delivered (deliver), or the error
    delivering them failed it with."""
    try:
        deliver(call)
    except ResourceExhausted as exc:
        return exc
    return result


def _run_pass(host: ModelHost, call: InferCall) -> model_service_pb2.InferResponse:
    """One call alone on the model's worker thread."""
    p, request, records, train, backward, seed, chunked = (
        call.p, call.request, call.records, call.train, call.backward, call.seed, call.chunked
    )
    args, kwargs = _decode_inputs(request, chunked, host.device)
    p.token_ids = token_ids(args, kwargs)
    model = host.module
    if p.splicer is not None:
        p.splicer.snapshot = True  # captures during the pass (see below for the output)
    try:
        with running(host, batching.Batch.alone(p), records):
            if train:
                model.train(True)
            try:
                rng = contextlib.nullcontext() if seed is None else torch.random.fork_rng(devices=_rng_devices())
                with rng, torch.set_grad_enabled(backward is not None):
                    if seed is not None:
                        torch.manual_seed(seed)
                    if backward is not None and backward.return_input_grads:
                        for leaf in _tensors(args, kwargs):
                            if leaf.is_floating_point():
                                leaf.requires_grad_(True)
                    with model_errors(host, "forward"):
                        output = model(*args, **kwargs)
                    if backward is not None:
                        _backward(host, output, backward, chunked)
                        if backward.return_input_grads:
                            _encode_grads(p.response, args, kwargs, p.chunker or p.splicer)
            finally:
                if train:
                    model.eval()
        large = p.chunker or p.splicer
        if large is not None:
            large.snapshot = False  # the pass is over: the output no longer changes
        try:
            _codec.encode_value_into(output, p.response.output, chunker=large, opaque_caches=True)
        except (_codec.CodecError, RuntimeError, NotImplementedError, TypeError) as exc:
            # e.g. a type with no wire form, a sparse or meta tensor
            raise Unimplemented(f"the output of model {host.name!r} cannot be sent: {exc}") from None
    finally:
        # CallEnded on the session streams that had its events, after the events a full
        # stream could not take during the pass (delivered off this thread: the model goes on).
        deliver(call)
    return p.response


def _backward(host: ModelHost, output: Any, plan: BackwardPlan, chunked: Mapping[int, Any] | None) -> None:
    target = select_output(output, plan.path)
    where = ".".join(plan.path) or "the output"
    if not isinstance(target, torch.Tensor) or not target.is_floating_point():
        raise InvalidArgument(f"backward.output_path: {where!r} is not a floating-point tensor")
    if not target.requires_grad:
        raise InvalidArgument(f"backward.output_path: {where!r} does not depend on anything that requires grad")
    if plan.grad is not None:
        grad = _codec.decode_tensor(plan.grad.grad, where="backward.grad", chunked=chunked)
        if tuple(grad.shape) != tuple(target.shape):
            raise InvalidArgument(
                f"backward.grad: shape {list(grad.shape)} does not match {where!r}'s shape {list(target.shape)}"
            )
        grad = grad.to(dtype=target.dtype, device=target.device)
    else:
        grad = torch.ones_like(target)
    params = [param for param in host.module.parameters() if param.requires_grad]
    # .grad belongs to no caller: every call starts and ends without it.
    for param in params:
        param.grad = None
    try:
        with model_errors(host, "backward"):
            torch.autograd.backward(target, grad_tensors=grad)
    finally:
        for param in params:
            param.grad = None


def _tensors(*values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _tensors(*value)
        elif isinstance(value, Mapping):
            yield from _tensors(*value.values())


def _grads_of(value: Any) -> Any:
    """``value`` with every tensor replaced by its gradient (None where it has none)."""
    if isinstance(value, torch.Tensor):
        return value.grad
    if isinstance(value, (tuple, list)):
        return type(value)(_grads_of(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _grads_of(v) for k, v in value.items()}
    return None


def _encode_grads(
    response: model_service_pb2.InferResponse, args: list[Any], kwargs: dict[str, Any],
    chunker: Chunker | Splicer | None,
) -> None:
    for arg in args:
        _codec.encode_value_into(_grads_of(arg), response.input_grads.add(), chunker=chunker)
    for key, value in kwargs.items():
        _codec.encode_value_into(_grads_of(value), response.input_kwargs_grads[key], chunker=chunker)


def _rng_devices() -> list[int]:
    """The devices whose random state a seeded call forks (and puts back after)."""
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
