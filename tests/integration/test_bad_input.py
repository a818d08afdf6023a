"""Bad input gets a clear status naming what was wrong; the server stays healthy after each."""

from __future__ import annotations

import re

import grpc
import pytest
import torch

import hookwire
from hookwire.wire import codec
from hookwire.v1 import hook_pb2, hook_service_pb2, model_service_pb2, rule_pb2, tensor_pb2

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
            model="tiny-transformer", args=[codec.encode_value(torch.zeros(1, 3, dtype=torch.int64))],
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
            model="tiny-transformer", args=[codec.encode_value(torch.zeros(1, 3, dtype=torch.int64))],
            backward=model_service_pb2.Backward(output_path="hidden")),
        grpc.StatusCode.INVALID_ARGUMENT, "no key 'hidden'",
    ),
    "grad shape": (
        model_service_pb2.InferRequest(model="mlp", args=[GOOD], backward=model_service_pb2.Backward(
            grad=codec.encode_tensor(torch.ones(3)))),
        grpc.StatusCode.INVALID_ARGUMENT, r"backward.grad: shape \[3\] does not match",
    ),
    "integer output backward": (
        model_service_pb2.InferRequest(model="scale", args=[codec.encode_value(torch.ones(2, dtype=torch.int64))],
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
    # Token inputs past the model's positions are refused before the pass (rotary positions
    # would quietly run past them; a learned table fails inside the forward).
    "token ids past the config's positions": (
        model_service_pb2.InferRequest(model="tiny-lm", args=[codec.encode_value(torch.ones(1, 1000, dtype=torch.int64))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"^args\[0\]: 1000 positions pass the 512 positions of model 'tiny-lm' \(its config's max_position_embeddings\)$",
    ),
    "input_ids keyword past the config's positions": (
        model_service_pb2.InferRequest(model="tiny-lm", kwargs={
            "input_ids": codec.encode_value(torch.ones(2, 513, dtype=torch.int64))}),
        grpc.StatusCode.INVALID_ARGUMENT, r"^kwargs\['input_ids'\]: 513 positions pass the 512 positions of model 'tiny-lm'",
    ),
    "token ids past a plain model's own positions": (
        model_service_pb2.InferRequest(model="tiny-transformer", args=[codec.encode_value(torch.ones(1, 40, dtype=torch.int64))]),
        grpc.StatusCode.INVALID_ARGUMENT,
        r"^args\[0\]: 40 positions pass the 32 positions of model 'tiny-transformer' \(its max_positions\)$",
    ),
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


# ------------------------------------------------------------------ over-long strings and huge integers

HUGE_INT = "[" + "1" * 4301 + "]"  # past Python's int-string limit: int() raises its own ValueError
NAME = "n" * 257  # max_name_length is 256 (UTF-8 bytes)
PATH = "p" * 1025  # max_path_length is 1024


def _infer(**fields) -> model_service_pb2.InferRequest:
    return model_service_pb2.InferRequest(**{"model": "mlp", "args": [GOOD], **fields})


def _hooked(**action_fields) -> model_service_pb2.InferRequest:
    return _infer(hooks=[hook_pb2.HookSpec(module="fc1", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT], **action_fields))])


def _rule(**fields) -> rule_pb2.Rule:
    return rule_pb2.Rule(**{"target": "output", **fields})


def _value_map(key: str, *, in_keys: bool = False) -> tensor_pb2.Value:
    if in_keys:
        return tensor_pb2.Value(map=tensor_pb2.ValueMap(keys=[key]))
    return tensor_pb2.Value(map=tensor_pb2.ValueMap(entries={key: tensor_pb2.Value()}))


# (rpc, request, field named in the message, limit setting)
LONG_STRING_CASES = {
    "GetModel.name": ("GetModel", model_service_pb2.GetModelRequest(name=NAME), "name", "max_name_length"),
    "Infer.model": ("Infer", _infer(model=NAME), "model", "max_name_length"),
    "Infer.session_id": ("Infer", _infer(session_id=NAME), "session_id", "max_name_length"),
    "Infer.tags": ("Infer", _infer(tags=["ok", NAME]), "tags", "max_name_length"),
    "Infer.kwargs key": ("Infer", _infer(kwargs={NAME: GOOD}), "kwargs.key", "max_name_length"),
    "Infer map key": ("Infer", _infer(args=[_value_map(NAME)]), "args.map.entries.key", "max_name_length"),
    "Infer map keys": ("Infer", _infer(args=[_value_map(NAME, in_keys=True)]), "args.map.keys", "max_name_length"),
    "Infer.backward.output_path": ("Infer", _infer(backward=model_service_pb2.Backward(output_path=PATH)),
                                   "backward.output_path", "max_path_length"),
    "hooks.model": ("Infer", _infer(hooks=[hook_pb2.HookSpec(model=NAME, module="fc1", posthook=OUTPUT)]),
                    "hooks.model", "max_name_length"),
    "hooks.module": ("Infer", _infer(hooks=[hook_pb2.HookSpec(module="*" * 1025, posthook=OUTPUT)]),
                     "hooks.module", "max_path_length"),
    "hooks.tags": ("Infer", _infer(hooks=[hook_pb2.HookSpec(module="fc1", posthook=OUTPUT, tags=[NAME])]),
                   "hooks.tags", "max_name_length"),
    "hooks select": ("Infer", _hooked(select=PATH), "hooks.posthook.select", "max_path_length"),
    "hooks huge-integer select": ("Infer", _hooked(select=HUGE_INT), "hooks.posthook.select", "max_path_length"),
    "hooks rule target": ("Infer", _hooked(rules=[_rule(target="output." + "0" * 1100, zero=rule_pb2.ZeroOp())]),
                          "hooks.posthook.rules.target", "max_path_length"),
    "hooks huge-integer rule index": ("Infer", _hooked(rules=[_rule(index=HUGE_INT, zero=rule_pb2.ZeroOp())]),
                                      "hooks.posthook.rules.index", "max_path_length"),
    "hooks patch slot": ("Infer", _hooked(rules=[_rule(patch=rule_pb2.PatchOp(slot=NAME))]),
                         "hooks.posthook.rules.patch.slot", "max_name_length"),
    "hooks save slot": ("Infer", _hooked(rules=[_rule(save=rule_pb2.SaveOp(slot=NAME))]),
                        "hooks.posthook.rules.save.slot", "max_name_length"),
    "RegisterHook.session_id": ("RegisterHook", hook_service_pb2.RegisterHookRequest(session_id=NAME, spec=_spec(posthook=OUTPUT)),
                                "session_id", "max_name_length"),
    "RegisterHook huge-integer select": (
        "RegisterHook", hook_service_pb2.RegisterHookRequest(spec=_spec(posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT], select=HUGE_INT))),
        "spec.posthook.select", "max_path_length"),
    "RegisterHook huge-integer rule index": (
        "RegisterHook", hook_service_pb2.RegisterHookRequest(spec=_spec(posthook=hook_pb2.HookAction(rules=[_rule(index=HUGE_INT, zero=rule_pb2.ZeroOp())]))),
        "spec.posthook.rules.index", "max_path_length"),
    "RegisterHook.spec.module": ("RegisterHook", hook_service_pb2.RegisterHookRequest(spec=_spec(module="fc1." + "a" * 1100, posthook=OUTPUT)),
                                 "spec.module", "max_path_length"),
    "DeregisterHook.hook_id": ("DeregisterHook", hook_service_pb2.DeregisterHookRequest(hook_id=NAME), "hook_id", "max_name_length"),
    "ListHooks.model": ("ListHooks", hook_service_pb2.ListHooksRequest(model=NAME), "model", "max_name_length"),
    "ListHooks.session_id": ("ListHooks", hook_service_pb2.ListHooksRequest(session_id=NAME), "session_id", "max_name_length"),
    "GetSlot.session_id": ("GetSlot", hook_service_pb2.GetSlotRequest(session_id=NAME, name="s"), "session_id", "max_name_length"),
    "GetSlot.name": ("GetSlot", hook_service_pb2.GetSlotRequest(session_id="ses_x", name=NAME), "name", "max_name_length"),
    "ListSlots.session_id": ("ListSlots", hook_service_pb2.ListSlotsRequest(session_id=NAME), "session_id", "max_name_length"),
}


@pytest.mark.parametrize("case", list(LONG_STRING_CASES))
async def test_over_long_strings_are_invalid_argument(client, case: str) -> None:
    rpc, request, field, setting = LONG_STRING_CASES[case]
    stub = client.model_stub if rpc in ("GetModel", "Infer") else client.hook_stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, rpc)(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert f"{field}: " in info.value.details() and f"({setting})" in info.value.details(), info.value.details()
    out = await client.model("mlp")(torch.ones(1, 8))
    assert out.shape == (1, 4)


async def test_over_long_strings_in_streams(client) -> None:
    call = client.hook_stub.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=["hk_x", NAME]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hook_ids: 257 bytes, over the limit of 256 (max_name_length)" in info.value.details()
    call = client.model_stub.InferStream()
    await call.write(model_service_pb2.InferStreamRequest(request=_infer(model=NAME)))
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request.model: 257 bytes, over the limit of 256 (max_name_length)" in info.value.details()


@pytest.fixture(scope="module")
def roomy():
    """A server whose path bound admits huge integers, so they reach the selection parser."""
    from support import serving

    with serving(max_path_length=1 << 20) as srv:
        yield srv


async def test_huge_integers_reach_the_parser_as_invalid_argument(roomy) -> None:
    huge_spec = _spec(posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT], select=HUGE_INT))
    huge_rule = _spec(posthook=hook_pb2.HookAction(rules=[_rule(index="[" + "9" * 5000 + ":]", zero=rule_pb2.ZeroOp())]))
    async with hookwire.connect(roomy.target) as c:
        session = await c.session()
        cases = [
            (c.hook_stub.RegisterHook, hook_service_pb2.RegisterHookRequest(session_id=session.session_id, spec=huge_spec),
             "posthook.select: item 0 of .*4301 digits is out of range"),
            (c.hook_stub.RegisterHook, hook_service_pb2.RegisterHookRequest(session_id=session.session_id, spec=huge_rule),
             r"posthook.rules\[0\].index: item 0 of .*5000 digits is out of range"),
            (c.model_stub.Infer, _hooked(select=HUGE_INT), r"hooks\[0\]: posthook.select: .*4301 digits is out of range"),
        ]
        for call, request, message in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert re.search(message, info.value.details()), info.value.details()
        assert await c.list_hooks(session_id=session.session_id) == []
        assert (await c.model("mlp")(torch.ones(1, 8))).shape == (1, 4)
