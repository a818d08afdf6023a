"""The raw-bytes request scan: bounds checked before a request is parsed."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from hookwire.v1 import (
    harvest_service_pb2, hook_pb2, hook_service_pb2, model_service_pb2, operand_service_pb2, rule_pb2, tensor_pb2,
)
from hookwire_server.errors import InvalidArgument, ResourceExhausted
from hookwire_server.limits import Limits
from hookwire_server.api.request_bounds import (
    NAME_FIELD_NAMES,
    NAME_FIELDS,
    PATH_FIELDS,
    UNBOUNDED_FIELDS,
    RequestBounds,
    check,
)

REQUESTS = [m.DESCRIPTOR for s in (model_service_pb2, hook_service_pb2, harvest_service_pb2, operand_service_pb2)
            for name, m in vars(s).items() if name.endswith("Request") and hasattr(m, "DESCRIPTOR")]


def _string_fields() -> set[str]:
    seen, out, todo = set(), set(), list(REQUESTS)
    while todo:
        d = todo.pop()
        if d.full_name in seen:
            continue
        seen.add(d.full_name)
        for f in d.fields:
            if f.type == FieldDescriptor.TYPE_STRING:
                out.add(f.full_name)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                todo.append(f.message_type)
    return out


def test_every_request_string_is_classified() -> None:
    # A new string field in a request must be given a bound on purpose: a name by the
    # contract's naming (model, session_id, ...), or listed as a name, a path or data.
    fields = _string_fields()
    conventional = {f for f in fields if f.rsplit(".", 1)[1] in NAME_FIELD_NAMES}
    assert fields == conventional | NAME_FIELDS | PATH_FIELDS | UNBOUNDED_FIELDS
    assert not (conventional & (PATH_FIELDS | UNBOUNDED_FIELDS))


def _list_request(n: int) -> bytes:
    request = model_service_pb2.InferRequest(model="m")
    request.args.add().list.items.extend([tensor_pb2.Value()] * n)
    return request.SerializeToString()


def test_values_are_counted_with_early_exit() -> None:
    bounds = RequestBounds(Limits(max_request_values=100))
    check(_list_request(99), model_service_pb2.InferRequest.DESCRIPTOR, bounds)  # 99 items + the argument
    with pytest.raises(ResourceExhausted, match=r"^args.list.items: 101 or more Values and map entries in the request, over the limit of 100 \(max_request_values\)$"):
        check(_list_request(100), model_service_pb2.InferRequest.DESCRIPTOR, bounds)
    # Map entries count too (an entry and its Value: two).
    request = model_service_pb2.InferRequest(model="m")
    for i in range(51):
        request.kwargs[f"k{i}"].SetInParent()
    with pytest.raises(ResourceExhausted, match="max_request_values"):
        check(request.SerializeToString(), model_service_pb2.InferRequest.DESCRIPTOR, bounds)


def test_fields_bound_repeated_singular_and_packed_fields() -> None:
    bounds = RequestBounds(Limits(max_request_fields=1000))
    repeated_int = b"\x0a\x01m\x12" + bytes([0x80 | (4000 & 0x7F), 4000 >> 7]) + b"\x28\x00" * 2000
    with pytest.raises(ResourceExhausted, match=r"\(max_request_fields\)"):
        check(repeated_int, model_service_pb2.InferRequest.DESCRIPTOR, bounds)
    tensor = tensor_pb2.Value(tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[1] * 2000))
    with pytest.raises(ResourceExhausted, match=r"args.tensor.shape.*\(max_request_fields\)"):
        check(model_service_pb2.InferRequest(args=[tensor]).SerializeToString(),
              model_service_pb2.InferRequest.DESCRIPTOR, bounds)


def test_strings_are_bounded_by_kind() -> None:
    bounds = RequestBounds(Limits(max_name_length=8, max_path_length=16))
    ok = model_service_pb2.InferRequest(model="12345678")
    ok.args.add().string_value = "data is not bounded" * 100
    check(ok.SerializeToString(), model_service_pb2.InferRequest.DESCRIPTOR, bounds)
    with pytest.raises(InvalidArgument, match=r"^model: 9 bytes, over the limit of 8 \(max_name_length\)$"):
        check(model_service_pb2.InferRequest(model="123456789").SerializeToString(),
              model_service_pb2.InferRequest.DESCRIPTOR, bounds)
    long_select = model_service_pb2.InferRequest()
    long_select.hooks.add().posthook.select = "[" + "1" * 20 + "]"
    with pytest.raises(InvalidArgument, match=r"^hooks.posthook.select: 22 bytes, over the limit of 16 \(max_path_length\)$"):
        check(long_select.SerializeToString(), model_service_pb2.InferRequest.DESCRIPTOR, bounds)


def test_request_hooks_and_rules_are_capped() -> None:
    request = model_service_pb2.InferRequest(model="m")
    request.hooks.add().posthook.rules.add().zero.SetInParent()
    request.hooks[0].posthook.rules.add().zero.SetInParent()
    bounds = RequestBounds(Limits(max_request_hooks=1, max_rules_per_action=1))
    with pytest.raises(InvalidArgument, match=r"^hooks.posthook.rules: 2 or more rules, over the limit of 1 \(max_rules_per_action\)$"):
        check(request.SerializeToString(), model_service_pb2.InferRequest.DESCRIPTOR, bounds)
    request.hooks.add()
    del request.hooks[0].posthook.rules[1]
    with pytest.raises(ResourceExhausted, match=r"hooks: 2 or more hooks, over the limit of 1 \(max_request_hooks\)"):
        check(request.SerializeToString(), model_service_pb2.InferRequest.DESCRIPTOR, bounds)


@pytest.mark.parametrize("data", [b"\x0b", b"\x12\x05ab", b"\x0a", b"\x08\xff\xff", b"\x0d\x00"])
def test_malformed_bytes(data: bytes) -> None:
    with pytest.raises(InvalidArgument, match="not a valid hookwire.v1.InferRequest message"):
        check(data, model_service_pb2.InferRequest.DESCRIPTOR, RequestBounds())


def test_nesting_past_protobufs_limit_is_malformed() -> None:
    deep = b"\x12\x00"
    for _ in range(60):  # Value.list -> ValueList.items -> ...: two messages per level
        inner = b"\x0a" + _len(deep) + deep
        deep = b"\x12" + _len(inner) + inner
    data = b"\x12" + _len(deep) + deep
    with pytest.raises(InvalidArgument, match="nest deeper than 100"):
        check(data, model_service_pb2.InferRequest.DESCRIPTOR, RequestBounds())


def _len(b: bytes) -> bytes:
    n, out = len(b), bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_tokenize_texts_are_counted_before_the_parse() -> None:
    bounds = RequestBounds(Limits(max_tokenize_texts=3, max_name_length=8))
    descriptor = model_service_pb2.TokenizeRequest.DESCRIPTOR
    long_text = "x" * 10_000  # texts are data: only their number is bounded here
    check(model_service_pb2.TokenizeRequest(model="m", texts=[long_text] * 3).SerializeToString(), descriptor, bounds)
    with pytest.raises(ResourceExhausted, match=r"texts: 4 or more texts, over the limit of 3 \(max_tokenize_texts\)"):
        check(model_service_pb2.TokenizeRequest(model="m", texts=["a"] * 4).SerializeToString(), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"padding_side: 9 bytes.*\(max_name_length\)"):
        check(model_service_pb2.TokenizeRequest(model="m", padding_side="x" * 9).SerializeToString(), descriptor, bounds)


def test_generate_requests_are_bounded_before_the_parse() -> None:
    bounds = RequestBounds(Limits(max_tokenize_texts=3, max_stop_strings=2, max_request_hooks=1, max_name_length=8,
                           max_path_length=16))
    descriptor = model_service_pb2.GenerateRequest.DESCRIPTOR

    def request(**fields: object) -> bytes:
        base: dict[str, object] = dict(model="m", prompts=["x" * 10_000] * 3, stop=["12345678"] * 2,
                                       hooks=[hook_pb2.HookSpec(module="model.layers.*", steps=hook_pb2.StepRange(first=1))],
                                       session_id="s", tags=["12345678"])
        base.update(fields)
        return model_service_pb2.GenerateRequest(**base).SerializeToString()  # type: ignore[arg-type]

    check(request(), descriptor, bounds)  # at every bound; prompts are data: only their number is bounded here
    with pytest.raises(ResourceExhausted, match=r"^prompts: 4 or more prompts, over the limit of 3 \(max_tokenize_texts\)$"):
        check(request(prompts=["a"] * 4), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^stop: 3 or more stop, over the limit of 2 \(max_stop_strings\)$"):
        check(request(stop=["a"] * 3), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^stop: 9 bytes, over the limit of 8 \(max_name_length\)$"):
        check(request(stop=["123456789"]), descriptor, bounds)
    with pytest.raises(ResourceExhausted, match=r"^hooks: 2 or more hooks, over the limit of 1 \(max_request_hooks\)$"):
        check(request(hooks=[hook_pb2.HookSpec(), hook_pb2.HookSpec()]), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^hooks.module: 17 bytes, over the limit of 16 \(max_path_length\)$"):
        check(request(hooks=[hook_pb2.HookSpec(module="m" * 17)]), descriptor, bounds)
    for field in ("model", "session_id"):
        with pytest.raises(InvalidArgument, match=rf"^{field}: 9 bytes, over the limit of 8 \(max_name_length\)$"):
            check(request(**{field: "x" * 9}), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^tags: 9 bytes.*\(max_name_length\)$"):
        check(request(tags=["x" * 9]), descriptor, bounds)


def test_get_parameters_requests_are_bounded_before_the_parse() -> None:
    bounds = RequestBounds(Limits(max_parameter_names=3, max_name_length=8, max_path_length=16))
    descriptor = model_service_pb2.GetParametersRequest.DESCRIPTOR

    def request(**fields: object) -> bytes:
        base: dict[str, object] = dict(model="12345678", names=["encoder.layer.*."] * 3)
        base.update(fields)
        return model_service_pb2.GetParametersRequest(**base).SerializeToString()  # type: ignore[arg-type]

    check(request(), descriptor, bounds)  # at every bound
    with pytest.raises(ResourceExhausted, match=r"^names: 4 or more names, over the limit of 3 \(max_parameter_names\)$"):
        check(request(names=["a"] * 4), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^names: 17 bytes, over the limit of 16 \(max_path_length\)$"):
        check(request(names=["encoder.layer.*.w"]), descriptor, bounds)
    with pytest.raises(InvalidArgument, match=r"^model: 9 bytes, over the limit of 8 \(max_name_length\)$"):
        check(request(model="123456789"), descriptor, bounds)


def test_the_bounds_are_the_limits_fields() -> None:
    # RequestBounds repeats no default: each bound is read from the Limits it is given,
    # so changing a Limits field changes the bound the scan applies (and its message).
    from hookwire_server.api.request_bounds import SETTINGS

    assert set(SETTINGS) <= {f.name for f in dataclasses.fields(Limits)}
    assert RequestBounds().max_fields == Limits().max_request_fields
    assert RequestBounds.of(Limits(max_request_fields=7)).max_fields == 7
    assert RequestBounds.of(Limits(max_request_fields=7)).within(4096).max_fields == 7
    assert RequestBounds.of(Limits(max_request_fields=10_000)).within(4096).max_fields == 4096
    infer = model_service_pb2.InferRequest.DESCRIPTOR
    hooks = model_service_pb2.InferRequest(model="m")
    for _ in range(3):
        hooks.hooks.add().posthook.rules.add().zero.SetInParent()
    rules = model_service_pb2.InferRequest(model="m")
    rules.hooks.add().posthook.rules.extend([rule_pb2.Rule()] * 3)
    stops = model_service_pb2.GenerateRequest(model="m", stop=["a", "b", "c"])
    select = model_service_pb2.InferRequest(model="m")
    select.hooks.add().posthook.select = "[1:]"
    # One request per setting that passes the bound of 2 (and none of the defaults).
    cases: dict[str, tuple[bytes, Any]] = {
        "max_request_fields": (model_service_pb2.InferRequest(model="m", tags=["a", "b"]).SerializeToString(), infer),
        "max_request_values": (_list_request(2), infer),
        "max_request_hooks": (hooks.SerializeToString(), infer),
        "max_rules_per_action": (rules.SerializeToString(), infer),
        "max_name_length": (model_service_pb2.InferRequest(model="abc").SerializeToString(), infer),
        "max_path_length": (select.SerializeToString(), infer),
        "max_tokenize_texts": (model_service_pb2.TokenizeRequest(texts=["a", "b", "c"]).SerializeToString(),
                               model_service_pb2.TokenizeRequest.DESCRIPTOR),
        "max_stop_strings": (stops.SerializeToString(), model_service_pb2.GenerateRequest.DESCRIPTOR),
        "max_parameter_names": (model_service_pb2.GetParametersRequest(names=["a", "b", "c"]).SerializeToString(),
                                model_service_pb2.GetParametersRequest.DESCRIPTOR),
    }
    assert set(cases) == set(SETTINGS)
    for setting, (data, descriptor) in cases.items():
        check(data, descriptor, RequestBounds.of(Limits()))  # within the defaults
        with pytest.raises((InvalidArgument, ResourceExhausted), match=rf"over the limit of 2 \({setting}\)$"):
            check(data, descriptor, RequestBounds.of(Limits(**{setting: 2})))
