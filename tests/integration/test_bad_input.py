"""Bad input gets a clear status naming what was wrong; the server stays healthy after each."""

from __future__ import annotations

import re

import grpc
import pytest
import torch

import hookwire
from hookwire import _codec
from hookwire.v1 import hook_pb2, hook_service_pb2, model_service_pb2, tensor_pb2

OUTPUT = hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT])


def _tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=(1, 8), data=None) -> tensor_pb2.Value:
    if data is None:
        data = torch.zeros(shape).numpy().tobytes()
    return tensor_pb2.Value(tensor=tensor_pb2.Tensor(dtype=dtype, shape=list(shape), data=data))


GOOD = _tensor()

INFER_CASES = {
    "unknown model": (model_service_pb2.InferRequest(model="nope", args=[GOOD]), grpc.StatusCode.NOT_FOUND, "no model 'nope'"),
    "empty model": (model_service_pb2.InferRequest(args=[GOOD]), grpc.StatusCode.INVALID_ARGUMENT, "model field is empty"),
    "bytes vs shape": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(data=b"\0" * 12)]),
        grpc.StatusCode.INVALID_ARGUMENT, r"args\[0\]: 12 bytes of data, but shape \[1, 8\] of DTYPE_FLOAT32 needs 32",
    ),
    "unknown dtype": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(dtype=99, data=b"")]),
        grpc.StatusCode.INVALID_ARGUMENT, "unknown dtype 99",
    ),
    "unspecified dtype": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(dtype=0, data=b"")]),
        grpc.StatusCode.INVALID_ARGUMENT, "DTYPE_UNSPECIFIED is not a valid dtype",
    ),
    "negative dim": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(shape=(-1, 8), data=b"")]),
        grpc.StatusCode.INVALID_ARGUMENT, "negative dimension",
    ),
    "huge claimed shape": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(shape=(1 << 40, 1 << 20), data=b"\0" * 4)]),
        grpc.StatusCode.INVALID_ARGUMENT, "is too large",
    ),
    "overflowing shape with a zero dimension": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(shape=(1 << 40, 1 << 40, 0), data=b"")]),
        grpc.StatusCode.INVALID_ARGUMENT, "is too large",
    ),
    "chunked tensor in unary Infer": (
        model_service_pb2.InferRequest(model="mlp", args=[tensor_pb2.Value(tensor=tensor_pb2.Tensor(
            dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1, 8], chunk_id=1))]),
        grpc.StatusCode.INVALID_ARGUMENT, "travel over InferStream",
    ),
    "non-ascii digit in output_path": (
        model_service_pb2.InferRequest(
            model="tiny-transformer", args=[_codec.encode_value(torch.zeros(1, 3, dtype=torch.int64))],
            backward=model_service_pb2.Backward(output_path="logits.\u00b2")),
        grpc.StatusCode.INVALID_ARGUMENT, "goes inside a Tensor",
    ),
    "malformed output_path": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], backward=model_service_pb2.Backward(output_path="0..1")),
        grpc.StatusCode.INVALID_ARGUMENT, "output_path: '0..1' is malformed",
    ),
    "output_path into a tensor": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], backward=model_service_pb2.Backward(output_path="logits")),
        grpc.StatusCode.INVALID_ARGUMENT, "goes inside a Tensor",
    ),
    "missing key": (
        model_service_pb2.InferRequest(
            model="tiny-transformer", args=[_codec.encode_value(torch.zeros(1, 3, dtype=torch.int64))],
            backward=model_service_pb2.Backward(output_path="hidden")),
        grpc.StatusCode.INVALID_ARGUMENT, "no key 'hidden'",
    ),
    "grad shape": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], backward=model_service_pb2.Backward(
            grad=_codec.encode_tensor(torch.ones(3)))),
        grpc.StatusCode.INVALID_ARGUMENT, r"backward.grad: shape \[3\] does not match",
    ),
    "integer output backward": (
        model_service_pb2.InferRequest(model="scale", args=[_codec.encode_value(torch.ones(2, dtype=torch.int64))],
                                       backward=model_service_pb2.Backward()),
        grpc.StatusCode.INVALID_ARGUMENT, "not a floating-point tensor",
    ),
    "forward raises": (
        model_service_pb2.InferRequest(model="mlp", args=[_tensor(shape=(1, 3))]),
        grpc.StatusCode.INVALID_ARGUMENT, r"forward failed in module 'fc1' \(Linear\): RuntimeError",
    ),
    "unknown mode": (model_service_pb2.InferRequest(model="mlp", args=[GOOD], mode=7), grpc.StatusCode.INVALID_ARGUMENT, "unknown mode 7"),
    "request hook on another model": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], hooks=[hook_pb2.HookSpec(model="scale", module="", posthook=OUTPUT)]),
        grpc.StatusCode.INVALID_ARGUMENT, "hooks.0..model",
    ),
    "request hook with scope all": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], hooks=[hook_pb2.HookSpec(module="fc1", posthook=OUTPUT, scope=hook_pb2.SCOPE_ALL)]),
        grpc.StatusCode.INVALID_ARGUMENT, "SCOPE_ALL needs RegisterHook",
    ),
    "request hook unknown module": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], hooks=[hook_pb2.HookSpec(module="fc9", posthook=OUTPUT)]),
        grpc.StatusCode.NOT_FOUND, "has no module 'fc9'",
    ),
    "unknown session": (model_service_pb2.InferRequest(model="mlp", args=[GOOD], session_id="ses_x"), grpc.StatusCode.NOT_FOUND, "no open session"),
    "output with no wire form": (model_service_pb2.InferRequest(model="odd", args=[GOOD]), grpc.StatusCode.UNIMPLEMENTED, "device"),
}


@pytest.mark.parametrize("case", list(INFER_CASES))
async def test_bad_infer_requests(client, case: str) -> None:
    request, code, message = INFER_CASES[case]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.model_stub.Infer(request)
    assert info.value.code() == code, info.value.details()
    assert re.search(message, info.value.details()), info.value.details()
    # The server and the model stay healthy.
    out = await client.model("mlp")(torch.ones(1, 8))
    assert out.shape == (1, 4)


def _spec(**fields) -> hook_pb2.HookSpec:
    return hook_pb2.HookSpec(model=fields.pop("model", "mlp"), module=fields.pop("module", "fc1"), **fields)


REGISTER_CASES = {
    "empty spec": (_spec(), grpc.StatusCode.INVALID_ARGUMENT, "no action"),
    "unknown model": (_spec(model="nope", posthook=OUTPUT), grpc.StatusCode.NOT_FOUND, "no model 'nope'"),
    "unknown module": (_spec(module="fc9", posthook=OUTPUT), grpc.StatusCode.NOT_FOUND, "has no module 'fc9'"),
    "pattern matching nothing": (_spec(module="enc.*", posthook=OUTPUT), grpc.StatusCode.NOT_FOUND, "matches no module"),
    "output in a prehook": (
        _spec(prehook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT])),
        grpc.StatusCode.INVALID_ARGUMENT, r"prehook.capture\[0\]: PART_OUTPUT is not visible to a prehook",
    ),
    "grad_input in a posthook": (
        _spec(posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT, hook_pb2.PART_GRAD_INPUT])),
        grpc.StatusCode.INVALID_ARGUMENT, r"posthook.capture\[1\]: PART_GRAD_INPUT",
    ),
    "grad_input in a backward prehook": (
        _spec(backward_prehook=hook_pb2.HookAction(capture=[hook_pb2.PART_GRAD_INPUT])),
        grpc.StatusCode.INVALID_ARGUMENT, "not visible to a backward_prehook",
    ),
    "unknown part": (_spec(posthook=hook_pb2.HookAction(capture=[42])), grpc.StatusCode.INVALID_ARGUMENT, "unknown part 42"),
    "kwargs without with_kwargs": (
        _spec(posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_KWARGS])),
        grpc.StatusCode.INVALID_ARGUMENT, "with_kwargs",
    ),
    "unknown scope": (_spec(posthook=OUTPUT, scope=9), grpc.StatusCode.INVALID_ARGUMENT, "unknown scope 9"),
}


@pytest.mark.parametrize("case", list(REGISTER_CASES))
async def test_bad_register_requests(client, case: str) -> None:
    spec, code, message = REGISTER_CASES[case]
    session = await client.session()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.hook_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session.session_id, spec=spec))
    assert info.value.code() == code, info.value.details()
    assert re.search(message, info.value.details()), info.value.details()
    assert await client.list_hooks(session_id=session.session_id) == []  # nothing half-registered
    async with client.model("mlp").hook("fc1", posthook=hookwire.capture("output")) as hook:
        await client.model("mlp")(torch.ones(1, 8))
        assert len([e async for e in _first(hook)]) == 1


async def _first(hook):
    async for event in hook.events():
        yield event
        return


async def test_sdk_maps_status_to_exceptions(client) -> None:
    with pytest.raises(hookwire.NotFoundError) as info:
        await client.model("nope").info()
    assert info.value.code == "NOT_FOUND" and "nope" in info.value.details
    with pytest.raises(hookwire.InvalidArgumentError):
        await client.model("mlp").hook("fc1")
    with pytest.raises(ValueError, match="unknown part"):
        hookwire.capture("outputs")
    with pytest.raises(TypeError, match="unknown option"):
        await client.model("mlp").hook("fc1", posthook=hookwire.capture(), posthook_kwargs={"always": True})


async def test_bad_delivery_options(client) -> None:
    stream = client.hook_stub.OpenSession(hook_service_pb2.OpenSessionRequest(
        delivery=hook_service_pb2.DeliveryOptions(policy=5)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stream.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "policy" in info.value.details()
