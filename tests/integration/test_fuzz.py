"""Property-based fuzzing of every RPC with random and malformed requests.

Every answer must be OK or a deliberate status (never INTERNAL or UNKNOWN); the server
stays SERVING, its memory stays bounded, and a valid request succeeds afterwards.
CI runs a bounded number of examples; `tests/bench/fuzz_long.py` runs many more
(HOOKWIRE_FUZZ_EXAMPLES=N).
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hookwire.wire import codec
from hookwire.v1 import (
    harvest_service_pb2,
    harvest_service_pb2_grpc,
    hook_pb2,
    hook_service_pb2,
    hook_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    operand_service_pb2,
    operand_service_pb2_grpc,
    rule_pb2,
    tensor_pb2,
)
from hookwire_server import ModelHost, ServerSettings, build_registry, demo_configs
from support import Odd, Scale, ServerThread

EXAMPLES = int(os.environ.get("HOOKWIRE_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=not os.environ.get("HOOKWIRE_FUZZ_RANDOM"))
BAD = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    registry = build_registry(demo_configs())
    registry.add(ModelHost("scale", Scale()))
    registry.add(ModelHost("odd", Odd()))
    data, out = tmp_path_factory.mktemp("fuzz-data"), tmp_path_factory.mktemp("fuzz-out")
    (data / "docs.jsonl").write_text('{"text": "the cat sat on the mat"}\n{"text": "hello world"}\n')
    (data / "docs.txt").write_text("the cat\nhello world\n")
    srv = ServerThread(registry, ServerSettings(port=0, allow_shared_rules=True, max_slot_bytes=1 * MB,
                                                infer_timeout=10.0, harvest_data_root=str(data),
                                                harvest_output_root=str(out),
                                                harvest_max_jobs_per_principal=1000,
                                                openai_port=0)).start()  # test_openai_bodies
    channel = grpc.insecure_channel(srv.target, options=[("grpc.max_receive_message_length", 64 * MB)])
    hooks = hook_service_pb2_grpc.HookServiceStub(channel)
    session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest())
    session_id = next(session).opened.session_id
    def drain_session() -> None:
        try:
            for _ in session:
                pass
        except grpc.RpcError:
            pass  # cancelled at teardown

    drain = threading.Thread(target=drain_session, daemon=True)
    drain.start()
    rss_before = _rss()
    yield {"srv": srv, "channel": channel, "models": model_service_pb2_grpc.ModelServiceStub(channel),
           "hooks": hooks, "session_id": session_id,
           "harvests": harvest_service_pb2_grpc.HarvestServiceStub(channel),
           "operands": operand_service_pb2_grpc.OperandServiceStub(channel)}
    # The server stayed healthy, bounded, and useful.
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert _rss() - rss_before < 400 * MB
    out = model_service_pb2_grpc.ModelServiceStub(channel).Infer(model_service_pb2.InferRequest(
        model="mlp", args=[codec.encode_value(torch.ones(1, 8))]), timeout=10)
    assert list(out.output.tensor.shape) == [1, 4]
    session.cancel()
    channel.close()
    srv.stop()


def _check(call: Any) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{exc.code()}: {exc.details()}"


# ------------------------------------------------------------------ strategies

VALID_DTYPES = [d for d in tensor_pb2.DType.values() if d]
dtypes = st.one_of(st.sampled_from(VALID_DTYPES), st.integers(-3, 40))
dims = st.one_of(st.integers(-2, 5), st.sampled_from([0, 2**31, 2**40, 2**62, 2**63 - 1]))


@st.composite
def tensors(draw: Any) -> tensor_pb2.Tensor:
    shape = draw(st.lists(dims, max_size=4))
    if draw(st.booleans()):  # consistent bytes for a valid dtype: the model may really run
        dtype = draw(st.sampled_from(VALID_DTYPES))
        count = 1
        for d in shape:
            count *= d
        if 0 <= count <= 64 and all(d >= 0 for d in shape):
            data = draw(st.binary(min_size=count * codec.ITEMSIZE[dtype], max_size=count * codec.ITEMSIZE[dtype]))
            return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)
    return tensor_pb2.Tensor(dtype=draw(dtypes), shape=shape, data=draw(st.binary(max_size=64)),
                             chunk_id=draw(st.sampled_from([0, 0, 0, 1, 9])))


leaves = st.one_of(
    tensors().map(lambda t: tensor_pb2.Value(tensor=t)),
    st.floats(allow_nan=True).map(lambda f: tensor_pb2.Value(float_value=f)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: tensor_pb2.Value(int_value=i)),
    st.booleans().map(lambda b: tensor_pb2.Value(bool_value=b)),
    st.text(max_size=8).map(lambda s: tensor_pb2.Value(string_value=s)),
    st.just(tensor_pb2.Value()),
)


def _list(items: list[tensor_pb2.Value]) -> tensor_pb2.Value:
    return tensor_pb2.Value(list=tensor_pb2.ValueList(items=items))


def _map(entries: dict[str, tensor_pb2.Value]) -> tensor_pb2.Value:
    return tensor_pb2.Value(map=tensor_pb2.ValueMap(entries=entries, keys=list(entries)))


values = st.recursive(
    leaves,
    lambda children: st.one_of(st.lists(children, max_size=3).map(_list),
                               st.dictionaries(st.text(max_size=4), children, max_size=3).map(_map)),
    max_leaves=12,
)


@st.composite
def deep_values(draw: Any) -> tensor_pb2.Value:
    """Around the server's depth limit (30), within protobuf's parser limit (100 messages)."""
    value = tensor_pb2.Value(int_value=1)
    levels = draw(st.integers(25, 40))
    maps = draw(st.integers(0, 5))
    for i in range(levels):
        value = _map({"k": value}) if i < maps else _list([value])
    return value


#: Strings around the request bounds (max_name_length 256, max_path_length 1024) and far past them.
long_strings = st.builds(lambda c, n: c * n, st.sampled_from(["a", "*", ".", "\u00e9", "1"]),
                         st.sampled_from([255, 256, 257, 1023, 1024, 1025, 5000]))
#: Integers past int64 and past Python's int-string limit (4300 digits), in every parsed position.
huge_ints = st.builds(lambda sign, n: sign + "9" * n, st.sampled_from(["", "-", "+"]),
                      st.sampled_from([19, 20, 25, 1000, 4301, 5000]))
huge_selections = st.builds(lambda fmt, i: fmt.format(i), st.sampled_from(["[{}]", "[{}:]", "[:{}]", "[::{}]", "[0, {}]"]),
                            huge_ints)
model_names = st.one_of(st.sampled_from(["mlp", "tiny-transformer", "scale", "odd", "", "nope"]), st.text(max_size=8),
                        long_strings)
patterns = st.one_of(st.sampled_from(["fc1", "*", "**", "", "encoder.**", "encoder.layers.?.attn", "head"]),
                     st.text(alphabet="*?.abcfl01[]()\\", max_size=24), long_strings)
parts = st.lists(st.integers(-2, 7), max_size=3)
targets = st.one_of(st.sampled_from(["output", "output.0", "args.0", "kwargs.attention_mask", "grad_input.0",
                                     "grad_output.0", "output.logits", "output.99"]), st.text(max_size=10),
                  long_strings, huge_ints.map(lambda i: "output." + i))
selections = st.one_of(st.sampled_from(["", "[0]", "[:, -1]", "[..., 1:3]", "[::0]", "[None, 5]", "[99]"]),
                       st.text(alphabet="[]:.,-0123456789 None", max_size=16), huge_selections, long_strings)
operands = st.one_of(st.floats().map(lambda f: rule_pb2.Operand(scalar=f)),
                     tensors().map(lambda t: rule_pb2.Operand(tensor=t)), st.just(rule_pb2.Operand()))


@st.composite
def saes(draw: Any) -> rule_pb2.Sae:
    sae = rule_pb2.Sae(architecture=draw(st.one_of(st.sampled_from(["standard", "jumprelu", "topk", "gated", ""]),
                                                   long_strings)),
                       normalize_activations=draw(st.sampled_from(["", "none", "layer_norm", "constant_norm_rescale"])),
                       k=draw(st.integers(0, 2**32 - 1)))
    for field in ("w_enc", "b_enc", "w_dec", "b_dec", "threshold"):
        if draw(st.booleans()):
            getattr(sae, field).CopyFrom(draw(tensors()))
    if draw(st.booleans()):
        sae.apply_b_dec_to_input = draw(st.booleans())
    return sae


@st.composite
def signals(draw: Any) -> rule_pb2.Signal:
    signal = rule_pb2.Signal()
    kind = draw(st.sampled_from(["norm", "projection", "probe", "stored", "sae_feature", "token_id", None]))
    if kind == "token_id":
        signal.token_id.SetInParent()
        return signal
    if kind == "norm":
        signal.norm.SetInParent()
    elif kind == "projection":
        signal.projection.CopyFrom(draw(tensors()))
    elif kind == "probe":
        signal.probe.bias = draw(st.floats())
        signal.probe.sigmoid = draw(st.booleans())
        if draw(st.booleans()):
            signal.probe.weight.CopyFrom(draw(tensors()))
    elif kind == "stored":
        signal.stored = draw(st.one_of(st.sampled_from(["s", ""]), long_strings))
    elif kind == "sae_feature":
        signal.sae_feature.sae.CopyFrom(draw(saes()))
        signal.sae_feature.feature = draw(st.integers(0, 2**32 - 1))
    return signal


@st.composite
def rules(draw: Any, depth: int = 0) -> rule_pb2.Rule:
    rule = rule_pb2.Rule(target=draw(targets), index=draw(selections))
    if draw(st.integers(0, 4)) == 0:
        rule.heads.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    op = draw(st.sampled_from(["scale", "add", "set", "zero", "clamp", "noise", "project_out", "patch", "save", None,
                               "affine", "loreft", "norm_add", "top_k", "conditional", "signal", "sae"]))
    if op == "sae":
        rule.sae.SetInParent()
        if draw(st.booleans()):
            rule.sae.sae.CopyFrom(draw(saes()))
        rule.sae.features.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=4)))
        rule.sae.edit = draw(st.integers(-1, 5))
        rule.sae.value = draw(st.floats())
        return rule
    if op in ("affine", "loreft", "norm_add", "top_k"):
        message = getattr(rule, op)
        message.SetInParent()
        for field in message.DESCRIPTOR.fields:
            if field.message_type is tensor_pb2.Tensor.DESCRIPTOR and draw(st.booleans()):
                getattr(message, field.name).CopyFrom(draw(tensors()))
        if op == "norm_add":
            message.alpha = draw(st.floats())
        elif op == "top_k":
            message.k = draw(st.integers(0, 2**32 - 1))
            message.mode = draw(st.integers(-1, 4))
            if draw(st.booleans()):
                message.sae.CopyFrom(draw(saes()))
        return rule
    if op == "conditional":
        rule.conditional.SetInParent()
        if draw(st.booleans()):
            rule.conditional.when.signal.CopyFrom(draw(signals()))
            rule.conditional.when.cmp = draw(st.integers(-1, 8))
            rule.conditional.when.threshold = draw(st.floats())
        if depth < 2 and draw(st.booleans()):
            rule.conditional.then.CopyFrom(draw(rules(depth + 1)))
        return rule
    if op == "signal":
        rule.signal.name = draw(st.one_of(st.sampled_from(["s", ""]), long_strings))
        rule.signal.reduce = draw(st.integers(-1, 5))
        if draw(st.booleans()):
            rule.signal.signal.CopyFrom(draw(signals()))
        return rule
    if op == "scale":
        rule.scale.factor = draw(st.floats())
    elif op in ("add", "set"):
        getattr(rule, op).value.CopyFrom(draw(operands))
    elif op == "zero":
        rule.zero.SetInParent()
    elif op == "clamp":
        rule.clamp.SetInParent()
        if draw(st.booleans()):
            rule.clamp.min = draw(st.floats())
        if draw(st.booleans()):
            rule.clamp.max = draw(st.floats())
    elif op == "noise":
        rule.noise.std = draw(st.floats())
        rule.noise.seed = draw(st.integers(0, 2**64 - 1))
    elif op == "project_out":
        rule.project_out.direction.CopyFrom(draw(tensors()))
    elif op in ("patch", "save"):
        getattr(rule, op).slot = draw(st.one_of(st.sampled_from(["s", "", "x" * 40]), long_strings))
    return rule


@st.composite
def actions(draw: Any) -> hook_pb2.HookAction:
    action = hook_pb2.HookAction(capture=draw(parts), rules=draw(st.lists(rules(), max_size=2)),
                                 capture_stage=draw(st.integers(-1, 4)), select=draw(selections),
                                 cast=draw(st.integers(-1, 12)),
                                 heads=draw(st.lists(st.integers(0, 2**32 - 1), max_size=2)))
    if draw(st.integers(0, 3)) == 0:
        readout = action.readout
        kind = draw(st.sampled_from(["probe", "logit_lens", "sae_top_k", None]))
        if kind == "probe":
            readout.probe.sigmoid = draw(st.booleans())
            if draw(st.booleans()):
                readout.probe.weight.CopyFrom(draw(tensors()))
            if draw(st.booleans()):
                readout.probe.bias.CopyFrom(draw(tensors()))
        elif kind == "logit_lens":
            readout.logit_lens.k = draw(st.integers(0, 2**32 - 1))
            readout.logit_lens.norm = draw(st.one_of(st.sampled_from(["", "model.norm", "nope"]), long_strings))
        elif kind == "sae_top_k":
            readout.sae_top_k.k = draw(st.integers(0, 300))
            if draw(st.booleans()):
                readout.sae_top_k.sae.CopyFrom(draw(saes()))
        else:
            readout.SetInParent()
        readout.compact = draw(st.booleans())  # stacked per pass: any capture, any layout
    if draw(st.booleans()):
        action.summarize.histogram_bins = draw(st.integers(0, 5000))
    return action


@st.composite
def specs(draw: Any, model: str | None = None) -> hook_pb2.HookSpec:
    spec = hook_pb2.HookSpec(model=draw(model_names) if model is None else model, module=draw(patterns),
                             scope=draw(st.integers(-1, 5)),
                             tags=draw(st.lists(st.one_of(st.text(max_size=3), long_strings), max_size=2)),
                             on_error=draw(st.integers(-1, 4)), ttl_seconds=draw(st.integers(0, 3)))
    for field in ("prehook", "posthook", "backward_prehook", "backward_hook"):
        if draw(st.booleans()):
            getattr(spec, field).CopyFrom(draw(actions()))
    if draw(st.booleans()):
        spec.prehook_kwargs.with_kwargs = draw(st.booleans())
        spec.posthook_kwargs.always_call = draw(st.booleans())
    if draw(st.booleans()):
        spec.train_update = draw(st.booleans())
    if draw(st.booleans()):
        spec.sampling.every_n = draw(st.integers(0, 5))
        if draw(st.booleans()):
            spec.sampling.probability = draw(st.floats())
    if draw(st.booleans()):  # the steps a hook fires in (Generate); last < first is refused
        spec.steps.first = draw(st.one_of(st.integers(0, 3), st.just(2**32 - 1)))
        if draw(st.booleans()):
            spec.steps.last = draw(st.one_of(st.integers(0, 3), st.just(2**32 - 1)))
    return spec


@st.composite
def infer_requests(draw: Any) -> model_service_pb2.InferRequest:
    request = model_service_pb2.InferRequest(
        model=draw(model_names), args=draw(st.lists(st.one_of(values, deep_values()), max_size=3)),
        kwargs=draw(st.dictionaries(st.one_of(st.sampled_from(["attention_mask", "inputs_embeds", "x", ""]), long_strings),
                                    values, max_size=2)),
        mode=draw(st.integers(-1, 4)), hooks=draw(st.lists(specs(model=""), max_size=2)),
        tags=draw(st.lists(st.one_of(st.text(max_size=3), long_strings), max_size=2)),
        session_id=draw(st.one_of(st.just(""), long_strings)),
    )
    if draw(st.booleans()):
        request.backward.output_path = draw(st.one_of(st.sampled_from(["", "0", "logits", "0..1", "\u00b2"]),
                                                      st.text(max_size=6), long_strings, huge_ints))
        if draw(st.booleans()):
            request.backward.grad.CopyFrom(draw(tensors()))
        request.backward.return_input_grads = draw(st.booleans())
    if draw(st.booleans()):
        request.seed = draw(st.integers(0, 2**64 - 1))
    return request


def rarely(odd: Any, usual: Any) -> Any:
    """``odd`` one time in eight, else ``usual``: most fields of a request valid, so that
    the other fields' checks and the decoding steps are reached too."""
    return st.integers(0, 7).flatmap(lambda i: odd if i == 0 else usual)


@st.composite
def token_matrices(draw: Any, values: Any) -> tensor_pb2.Tensor:
    """A [batch, seq] int64 tensor (batch or seq sometimes 0) of ``values``."""
    batch, seq = draw(rarely(st.just(0), st.integers(1, 3))), draw(rarely(st.just(0), st.integers(1, 6)))
    items = draw(st.lists(values, min_size=batch * seq, max_size=batch * seq))
    return codec.encode_tensor(torch.tensor(items, dtype=torch.int64).reshape(batch, seq))


#: Token ids of tiny-lm's vocabulary (357 tokens), and rarely past it.
token_ids = rarely(st.sampled_from([-1, 357, 2**63 - 1, -(2**63)]), st.integers(0, 356))
#: Doubles around the valid ranges of temperature (> 0) and top_p ((0, 1]).
probabilities = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1.0, 1e-300, 1.0000001, 0.5]))


@st.composite
def lm_hooks(draw: Any) -> hook_pb2.HookSpec:
    """Hooks on tiny-lm's modules with captures and rules that mostly run (and sometimes
    fail at some step: a selection past a [b, 1, d] tensor, an empty slot, kwargs)."""
    phase = draw(st.sampled_from(["prehook", "posthook"]))
    usual_part = hook_pb2.PART_ARGS if phase == "prehook" else hook_pb2.PART_OUTPUT
    action = hook_pb2.HookAction(capture=draw(st.lists(rarely(st.sampled_from([1, 2, 3]), st.just(usual_part)), max_size=2)),
                                 select=draw(st.sampled_from(["", "", "[:, -1]", "[0]", "[:, 1]", "[..., :8]"])))
    for _ in range(draw(st.integers(0, 2))):
        target = "args.0" if phase == "prehook" else "output"
        rule = rule_pb2.Rule(target=draw(rarely(st.sampled_from(["output.0", "output.logits", "kwargs.x"]), st.just(target))),
                             index=draw(st.sampled_from(["", "", "[:, 1]", "[:, -1]", "[0, 0, 3]"])))
        op = draw(st.sampled_from(["scale", "add", "zero", "save", "patch", "when", "signal"]))
        if op == "scale":
            rule.scale.factor = draw(st.floats(-2, 2))
        elif op == "add":
            rule.add.value.scalar = draw(st.floats(-2, 2))
        elif op == "zero":
            rule.zero.SetInParent()
        elif op == "when":  # on a norm, or on a signal kept earlier (or never) in the pass
            when = rule.conditional.when
            source = draw(st.sampled_from(["norm", "stored", "token_id"]))
            if source == "norm":
                when.signal.norm.SetInParent()
            elif source == "token_id":
                when.signal.token_id.SetInParent()
            else:
                when.signal.stored = "s"
            when.cmp = draw(st.integers(1, 6))
            when.threshold = draw(st.floats(-2, 10))
            rule.conditional.then.scale.factor = draw(st.floats(-2, 2))
        elif op == "signal":
            rule.signal.name = "s"
            rule.signal.signal.norm.SetInParent()
            rule.signal.reduce = draw(st.integers(0, 3))
        else:
            getattr(rule, op).slot = "s"
        action.rules.append(rule)
    spec = hook_pb2.HookSpec(module=draw(st.sampled_from(["model.layers.*", "lm_head", "", "model.layers.0.mlp",
                                                          "model.norm", "**"])),
                             on_error=draw(st.integers(0, 2)))
    getattr(spec, phase).CopyFrom(action)
    if draw(st.booleans()):
        spec.prehook_kwargs.with_kwargs = spec.posthook_kwargs.with_kwargs = draw(st.booleans())
    if draw(st.booleans()):
        spec.steps.first = draw(st.integers(0, 3))
        if draw(st.booleans()):
            spec.steps.last = draw(rarely(st.integers(0, 3), st.integers(spec.steps.first, 4)))
    return spec


@st.composite
def generate_requests(draw: Any) -> model_service_pb2.GenerateRequest:
    # max_new_tokens is small, or past the server's limit (4096): never a long valid run.
    request = model_service_pb2.GenerateRequest(
        model=draw(rarely(model_names, st.just("tiny-lm"))),
        max_new_tokens=draw(rarely(st.sampled_from([0, 4097, 2**32 - 1]), st.integers(1, 3))),
        stop=draw(rarely(st.lists(st.one_of(st.text(max_size=3), long_strings), max_size=20),
                         st.lists(st.text(min_size=1, max_size=3), max_size=2))),
        tags=draw(rarely(st.lists(st.one_of(st.text(max_size=3), long_strings), max_size=2), st.just([]))),
        hooks=draw(rarely(st.lists(specs(model=draw(st.sampled_from(["", "tiny-lm", "mlp"]))), max_size=2),
                          st.lists(lm_hooks(), max_size=2))),
        max_response_message_bytes=draw(rarely(st.sampled_from([1, MB - 1, 2**32 - 1]), st.sampled_from([0, MB]))),
        session_id=draw(rarely(st.one_of(st.text(max_size=4), long_strings), st.just(""))),
        stream_interval=draw(rarely(st.sampled_from([65, 2**32 - 1]), st.sampled_from([0, 1, 2, 3, 64]))),
    )
    source = draw(rarely(st.sampled_from(["both", "neither"]), st.sampled_from(["prompts", "input_ids"])))
    if source in ("prompts", "both"):
        request.prompts.extend(draw(rarely(st.lists(st.one_of(st.text(max_size=12), long_strings), max_size=300),
                                           st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=4))))
    if source in ("input_ids", "both"):
        request.input_ids.CopyFrom(draw(rarely(tensors(), token_matrices(token_ids))))
    if draw(rarely(st.booleans(), st.just(source == "input_ids"))) and draw(st.booleans()):
        if draw(st.booleans()):  # a mask of the ids' shape, rarely with bad values
            shape = tuple(request.input_ids.shape) if len(request.input_ids.shape) == 2 else (1, 1)
            mask = draw(st.lists(rarely(st.sampled_from([0, 2, -1]), st.just(1)), min_size=math.prod(shape),
                                 max_size=math.prod(shape)))
            request.attention_mask.CopyFrom(codec.encode_tensor(torch.tensor(mask, dtype=torch.int64).reshape(shape)))
        else:
            request.attention_mask.CopyFrom(draw(rarely(tensors(), token_matrices(st.sampled_from([0, 1, 1, 1, 2])))))
    if draw(st.booleans()):
        request.do_sample = draw(st.booleans())
    if draw(st.booleans()):
        request.temperature = draw(rarely(probabilities, st.floats(0.1, 3)))
    if draw(st.booleans()):
        request.top_k = draw(rarely(st.just(2**32 - 1), st.integers(0, 400)))
    if draw(st.booleans()):
        request.top_p = draw(rarely(probabilities, st.floats(0.05, 1)))
    if draw(st.booleans()):
        request.seed = draw(st.integers(0, 2**64 - 1))
    # The fields OpenAI's API maps onto: within the limits (max_top_logprobs 20,
    # max_generate_n 16) or past them, and in combinations the server refuses.
    if draw(st.booleans()):
        request.logprobs = draw(st.booleans())
        request.top_logprobs = draw(rarely(st.sampled_from([21, 2**32 - 1]), st.integers(0, 3)))
    if draw(st.booleans()):
        request.prompt_logprobs = draw(rarely(st.sampled_from([21, 2**32 - 1]), st.integers(0, 3)))
    request.ignore_eos = draw(st.booleans())
    request.min_new_tokens = draw(rarely(st.sampled_from([5, 2**32 - 1]), st.integers(0, 2)))
    request.n = draw(rarely(st.sampled_from([17, 2**32 - 1]), st.integers(0, 3)))
    return request


# ------------------------------------------------------------------ properties


@FUZZ
@given(request=infer_requests(), use_session=st.booleans())
def test_infer(fuzz_server, request, use_session) -> None:
    if use_session:
        request.session_id = fuzz_server["session_id"]
    _check(lambda: fuzz_server["models"].Infer(request, timeout=30))


@FUZZ
@given(request=generate_requests(), use_session=st.booleans())
def test_generate(fuzz_server, request, use_session) -> None:
    if use_session:
        request.session_id = fuzz_server["session_id"]

    def call() -> None:
        messages = list(fuzz_server["models"].Generate(request, timeout=60))
        # A call that succeeds is whole: started first, done last, one GeneratedTokens per step
        # (alone, or stream_interval at a time in a `steps` message).
        kinds = [m.WhichOneof("kind") for m in messages]
        assert kinds[0] == "started" and kinds[-1] == "done" and kinds.count("done") == 1, kinds
        done = messages[-1].done
        steps = [m.tokens.step for m in messages if m.WhichOneof("kind") == "tokens"]
        steps += [t.step for m in messages if m.WhichOneof("kind") == "steps" for t in m.steps.steps]
        assert sorted(steps) == list(range(done.steps)) and 1 <= done.steps <= request.max_new_tokens
        # stream_interval > 1: step 0's tokens alone (as `tokens`), the later steps in `steps` messages.
        assert ("steps" in kinds) == (request.stream_interval > 1 and done.steps > 1), kinds
        assert len(done.sequences) == messages[0].started.input_ids.shape[0]
        generated = [m.tokens for m in messages if m.WhichOneof("kind") == "tokens"]
        generated += [t for m in messages if m.WhichOneof("kind") == "steps" for t in m.steps.steps]
        for tokens in generated:  # logprobs: one entry per sequence in every step, top_logprobs beside each
            assert len(tokens.logprobs) == (len(tokens.token_ids) if request.logprobs else 0)
            for token, entry in zip(tokens.token_ids, tokens.logprobs):
                assert len(entry.top_token_ids) == (request.top_logprobs if token != -1 else 0)

    _check(call)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
                        st.text(max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)


@st.composite
def openai_bodies(draw: Any) -> tuple[str, dict[str, Any]]:
    """A body for the OpenAI-compatible front: mostly well-formed (small max_tokens), with
    fields out of range, of the wrong type, unknown or unserved, and hookwire members
    holding hooks that are HookSpec JSON or not."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": draw(rarely(st.one_of(st.text(max_size=4), json_values), st.just("tiny-lm")))}
    if chat:
        body["messages"] = draw(rarely(json_values, st.lists(st.fixed_dictionaries({
            "role": rarely(st.text(max_size=5), st.sampled_from(["system", "user", "assistant"])),
            "content": rarely(json_values, st.text(max_size=12))}), min_size=1, max_size=3)))
    else:
        body["prompt"] = draw(rarely(json_values, st.one_of(
            st.text(max_size=16), st.lists(st.text(max_size=8), min_size=1, max_size=3),
            st.lists(st.integers(-5, 600), min_size=1, max_size=6))))
    body["max_tokens"] = draw(rarely(st.one_of(st.integers(-3, 2**40), json_values), st.integers(1, 3)))
    optional = {
        "temperature": rarely(st.one_of(st.floats(-2, 1e6), json_values), st.floats(0, 2)),
        "top_p": rarely(st.floats(-1, 2), st.floats(0.1, 1)),
        "top_k": st.integers(-2, 1000),
        "seed": rarely(st.integers(-2, 2**70), st.integers(0, 2**32)),
        "stop": rarely(json_values, st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(max_size=3), max_size=3))),
        "n": rarely(st.integers(-1, 40), st.integers(1, 3)),
        "stream": st.booleans(),
        "stream_options": rarely(json_values, st.fixed_dictionaries({"include_usage": st.booleans()})),
        "logprobs": rarely(st.one_of(st.integers(-1, 40), json_values), st.booleans() if chat else st.integers(0, 3)),
        "top_logprobs": st.integers(-1, 25),
        "echo": st.booleans(),
        "ignore_eos": st.booleans(),
        "min_tokens": st.integers(-1, 5),
        "presence_penalty": st.sampled_from([0, 0.0, 0.5]),
        "logit_bias": st.one_of(st.none(), st.just({"3": 1.0})),
        "user": st.text(max_size=5),
        "hookwire": rarely(json_values, st.fixed_dictionaries({}, optional={
            "tags": st.lists(st.text(max_size=4), max_size=2),
            "session_id": st.text(max_size=4),
            "hooks": st.lists(st.one_of(json_values, st.fixed_dictionaries({
                "module": st.sampled_from(["model.layers.0", "model.layers.*", "nowhere", ""]),
                "posthook": st.one_of(json_values, st.just({"capture": ["PART_OUTPUT"], "select": "[:, -1]"}),
                                      st.just({"capture": ["PART_OUTPUT"]}))})), max_size=2)})),
        draw(st.text(min_size=1, max_size=5)): json_values,  # an unknown member, mostly
    }
    for key, strategy in optional.items():
        if draw(st.integers(0, 3)) == 0:
            body[key] = draw(strategy)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@FUZZ
@given(case=openai_bodies())
def test_openai_bodies(fuzz_server, case) -> None:
    """The OpenAI-compatible front: every body gets a 2xx or 4xx/5xx other than 500 with
    OpenAI's error body; a stream that started ends with [DONE]."""
    import httpx

    path, body = case
    srv = fuzz_server["srv"]
    url = f"http://127.0.0.1:{srv.server.openai_port}{path}"
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", url, json=body) as response:
            text = response.read().decode()
    assert response.status_code != 500, text
    if response.status_code >= 400:
        error = json.loads(text)["error"]
        assert set(error) >= {"message", "type", "code"} and error["message"], error
    elif body.get("stream") is True:
        events = [line for line in text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", text[-400:]
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk or chunk["error"]["code"] not in ("INTERNAL", "UNKNOWN"), chunk
    else:
        assert json.loads(text)["choices"], text


@FUZZ
@given(request=infer_requests())
def test_infer_stream(fuzz_server, request) -> None:
    chunks = [model_service_pb2.InferStreamRequest(chunk=tensor_pb2.TensorChunk(chunk_id=i, offset=o, data=b"\0" * n))
              for i, o, n in [(1, 0, 8), (9, 4, 3)]]
    messages = [model_service_pb2.InferStreamRequest(request=request)] + chunks

    def call() -> None:
        for _ in fuzz_server["models"].InferStream(iter(messages), timeout=30):
            pass

    _check(call)


@FUZZ
@given(spec=specs(), use_session=st.booleans(), junk=st.text(max_size=12))
def test_register_and_deregister(fuzz_server, spec, use_session, junk) -> None:
    hooks = fuzz_server["hooks"]
    request = hook_service_pb2.RegisterHookRequest(session_id=fuzz_server["session_id"] if use_session else junk, spec=spec)
    try:
        hook = hooks.RegisterHook(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{exc.code()}: {exc.details()}"
        return
    # A registered hook must survive a pass (its rules and captures fire) without INTERNAL.
    _check(lambda: fuzz_server["models"].Infer(model_service_pb2.InferRequest(
        model=spec.model, session_id=fuzz_server["session_id"],
        args=[codec.encode_value(torch.ones(1, 8) if spec.model in ("mlp", "scale") else torch.ones(1, 4, dtype=torch.int64))],
        backward=model_service_pb2.Backward() if spec.model == "mlp" else None), timeout=30))
    assert hooks.DeregisterHook(hook_service_pb2.DeregisterHookRequest(hook_id=hook.hook_id), timeout=30).removed


@FUZZ
@given(name=st.one_of(st.text(max_size=12), long_strings),
       hook_ids=st.lists(st.one_of(st.text(max_size=12), long_strings), max_size=3), model=model_names,
       slot=st.one_of(st.text(max_size=6), long_strings), policy=st.integers(-1, 6), max_events=st.integers(0, 2**32 - 1),
       max_bytes=st.integers(0, 2**64 - 1), max_message=st.integers(0, 2**32 - 1), operand_data=st.booleans())
def test_other_rpcs(fuzz_server, name, hook_ids, model, slot, policy, max_events, max_bytes, max_message,
                    operand_data) -> None:
    models, hooks = fuzz_server["models"], fuzz_server["hooks"]
    _check(lambda: models.GetModel(model_service_pb2.GetModelRequest(name=name), timeout=10))
    _check(lambda: models.ListModels(model_service_pb2.ListModelsRequest(), timeout=10))
    _check(lambda: hooks.ListHooks(hook_service_pb2.ListHooksRequest(
        model=model, session_id=name, include_operand_data=operand_data), timeout=10))
    for hook_id in hook_ids:
        _check(lambda: hooks.DeregisterHook(hook_service_pb2.DeregisterHookRequest(hook_id=hook_id), timeout=10))
    for session_id in (name, fuzz_server["session_id"]):
        _check(lambda: hooks.GetSlot(hook_service_pb2.GetSlotRequest(session_id=session_id, name=slot), timeout=10))
        _check(lambda: hooks.ListSlots(hook_service_pb2.ListSlotsRequest(session_id=session_id), timeout=10))
    delivery = hook_service_pb2.DeliveryOptions(policy=policy, max_events=max_events, max_bytes=max_bytes,
                                                max_message_bytes=max_message)

    def first_message(call: Any) -> None:
        try:
            next(call)
        finally:
            call.cancel()

    _check(lambda: first_message(hooks.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=delivery), timeout=10)))
    _check(lambda: first_message(hooks.Subscribe(hook_service_pb2.SubscribeRequest(hook_ids=hook_ids, delivery=delivery),
                                                 timeout=10)))


@FUZZ
@given(request_id=st.one_of(st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12),
                            st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=120,
                                    max_size=300)))
def test_client_request_ids(fuzz_server, request_id) -> None:
    # x-request-id metadata (the audit trail's caller id): at most 128 visible ASCII
    # characters; anything else is INVALID_ARGUMENT, never INTERNAL, and a valid one works.
    metadata = (("x-request-id", request_id),)
    try:
        fuzz_server["models"].ListModels(model_service_pb2.ListModelsRequest(), timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{exc.code()}: {exc.details()}"
        assert not (1 <= len(request_id) <= 128 and request_id.isprintable() and " " not in request_id), request_id


@FUZZ
@given(model=st.one_of(st.sampled_from(["tiny-lm", "tiny-lm", "mlp"]), model_names),
       texts=st.lists(st.one_of(st.text(max_size=40), st.text(alphabet="\x00\ud7ff\U0010ffff \u00e9a", max_size=200)),
                      max_size=6),
       add_special_tokens=st.one_of(st.none(), st.booleans()),
       padding_side=st.one_of(st.sampled_from(["", "left", "right", "LEFT", " left"]), st.text(max_size=6), long_strings))
def test_tokenize(fuzz_server, model, texts, add_special_tokens, padding_side) -> None:
    request = model_service_pb2.TokenizeRequest(model=model, texts=texts, padding_side=padding_side)
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    try:
        reply = fuzz_server["models"].Tokenize(request, timeout=30)
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{exc.code()}: {exc.details()}"
        return
    ids, mask = codec.decode_tensor(reply.input_ids), codec.decode_tensor(reply.attention_mask)
    assert ids.dtype == mask.dtype == torch.int64 and ids.shape == mask.shape and ids.shape[0] == len(texts)
    assert [len(t.pieces) for t in reply.tokens] == mask.sum(dim=1).tolist()


#: Parameter names of the demo models (readable) and globs, mostly valid for some of them;
#: rarely near misses, odd globs and strings around the bounds.
parameter_names = rarely(
    st.one_of(st.sampled_from(["lm_head.weight", "fc1", "fc1.weight.", "", "**.**.*", "nope"]), patterns, long_strings),
    st.sampled_from(["**", "**", "*.weight", "**.bias", "fc1.weight", "out.bias", "fc?.*", "model.layers.*.**",
                     "lm_head.weight"]),
)


@FUZZ
@given(model=rarely(model_names, st.sampled_from(["mlp", "tiny-lm", "tiny-transformer"])),
       names=rarely(st.lists(parameter_names, max_size=4), st.lists(parameter_names, min_size=1, max_size=3)),
       dtype=rarely(st.integers(-1, 12), st.sampled_from([0, 0, 1, 3, 4])),
       max_message=rarely(st.sampled_from([1, MB - 1, 2**32 - 1]), st.sampled_from([0, MB, 4 * MB])))
def test_get_parameters(fuzz_server, model, names, dtype, max_message) -> None:
    request = model_service_pb2.GetParametersRequest(model=model, names=names, dtype=dtype,
                                                     max_response_message_bytes=max_message)
    try:
        messages = list(fuzz_server["models"].GetParameters(request, timeout=30))
    except grpc.RpcError as exc:
        assert exc.code() not in BAD, f"{exc.code()}: {exc.details()}"
        return
    # A call that succeeds sends each parameter once, whole, in named_parameters order.
    params = [m.parameter for m in messages if m.WhichOneof("kind") == "parameter"]
    host = fuzz_server["srv"].server.registry.get(model)
    order = list(host.parameters)
    assert [p.name for p in params] == sorted({p.name for p in params}, key=order.index) and params
    for p in params:
        assert list(p.tensor.shape) == list(host.parameters[p.name].shape)


# ------------------------------------------------------------------ wide requests and many request hooks

WIDE = settings(max_examples=max(4, EXAMPLES // 10), deadline=None, suppress_health_check=list(HealthCheck),
                derandomize=not os.environ.get("HOOKWIRE_FUZZ_RANDOM"))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _wide_value(kind: str, n: int) -> bytes:
    """An encoded Value holding ``n`` empty items: a flat list, or a map with distinct keys."""
    if kind == "list":
        body = b"\x0a\x00" * n
        return b"\x12" + _varint(len(body)) + body
    entries = b"".join(b"\x0a" + _varint(len(e)) + e for e in (b"\x0a" + _varint(len(k)) + k + b"\x12\x00"
                                                             for k in (str(i).encode() for i in range(n))))
    return b"\x1a" + _varint(len(entries)) + entries


@WIDE
@given(kind=st.sampled_from(["list", "map"]), n=st.sampled_from([1000, 32767, 65535, 65536, 65537, 200_000, 1_000_000]),
       streamed=st.booleans())
def test_wide_requests(fuzz_server, kind, n, streamed) -> None:
    value = _wide_value(kind, n)
    request = b"\x0a\x05scale\x12" + _varint(len(value)) + value
    channel = fuzz_server["channel"]
    if streamed:  # InferStreamRequest.request
        message = b"\x0a" + _varint(len(request)) + request

        def call() -> None:
            for _ in channel.stream_stream("/hookwire.v1.ModelService/InferStream")(iter([message]), timeout=60):
                pass
    else:
        def call() -> None:
            channel.unary_unary("/hookwire.v1.ModelService/Infer")(request, timeout=60)
    _check(call)


@WIDE
@given(count=st.integers(0, 100), pattern=st.sampled_from(["**", "*", "fc*", "encoder.**"]),
       model=st.sampled_from(["mlp", "tiny-transformer"]))
def test_many_request_hooks(fuzz_server, count, pattern, model) -> None:
    spec = hook_pb2.HookSpec(module=pattern, posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]),
                             prehook=hook_pb2.HookAction(capture=[hook_pb2.PART_ARGS]))
    x = torch.ones(1, 8) if model == "mlp" else torch.ones(1, 4, dtype=torch.int64)
    request = model_service_pb2.InferRequest(model=model, args=[codec.encode_value(x)], hooks=[spec] * count)
    _check(lambda: fuzz_server["models"].Infer(request, timeout=60))


METHODS = [
    ("/hookwire.v1.ModelService/ListModels", "unary"), ("/hookwire.v1.ModelService/GetModel", "unary"),
    ("/hookwire.v1.ModelService/Infer", "unary"), ("/hookwire.v1.ModelService/InferStream", "bidi"),
    ("/hookwire.v1.HookService/OpenSession", "stream"), ("/hookwire.v1.HookService/RegisterHook", "unary"),
    ("/hookwire.v1.HookService/DeregisterHook", "unary"), ("/hookwire.v1.HookService/ListHooks", "unary"),
    ("/hookwire.v1.HookService/Subscribe", "stream"), ("/hookwire.v1.HookService/GetSlot", "unary"),
    ("/hookwire.v1.HookService/ListSlots", "unary"), ("/hookwire.v1.ModelService/Tokenize", "unary"),
    ("/hookwire.v1.ModelService/Generate", "stream"), ("/hookwire.v1.ModelService/GetParameters", "stream"),
    ("/hookwire.v1.HarvestService/StartHarvest", "unary"), ("/hookwire.v1.HarvestService/GetHarvest", "unary"),
    ("/hookwire.v1.HarvestService/WatchHarvest", "stream"), ("/hookwire.v1.HarvestService/CancelHarvest", "unary"),
    ("/hookwire.v1.HarvestService/ListHarvests", "unary"),
]


HV = harvest_service_pb2
paths = st.one_of(st.sampled_from(["docs.jsonl", "docs.txt", "nope.jsonl", "", "..", "../docs.jsonl", "/etc/passwd",
                                   "a/../../b", "docs.jsonl\x00", "s3://bucket/x", "memory://x"]), st.text(max_size=12))


@st.composite
def harvest_requests(draw: Any) -> harvest_service_pb2.StartHarvestRequest:
    request = HV.StartHarvestRequest(
        model=draw(st.sampled_from(["tiny-lm", "tiny-transformer", "mlp", "nope", ""])),
        modules=draw(st.lists(st.sampled_from(["model.norm", "model.layers.*", "**", "", "nope", "[", "encoder.*"]),
                              max_size=3)),
        part=draw(st.sampled_from([0, hook_pb2.PART_OUTPUT, hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS, 99])),
        select=draw(st.sampled_from(["", "[..., :4]", "[0]", "[:, :, ::0]", "[", "[..., 1000]"])),
        dtype=draw(st.sampled_from([0, tensor_pb2.DTYPE_BFLOAT16, tensor_pb2.DTYPE_INT8, 77])),
        max_tokens=draw(st.sampled_from([0, 1, 5, 2**64 - 1])),
        worker_index=draw(st.sampled_from([0, 1, 2**32 - 1])),
        num_workers=draw(st.sampled_from([0, 1, 2, 2**32 - 1])),
    )
    if draw(st.booleans()):
        request.source.text.path = draw(paths)
        request.source.text.format = draw(st.sampled_from([0, 1, 2, 3, 4, 50]))
        request.source.text.text_field = draw(st.sampled_from(["", "text", "nope"]))
    elif draw(st.booleans()):
        request.source.tokens.input_ids.CopyFrom(draw(tensors()))
        if draw(st.booleans()):
            request.source.tokens.pad_token_id = draw(st.integers(-(2**63), 2**63 - 1))
    request.contexts.length = draw(st.sampled_from([0, 1, 4, 600, 2**32 - 1]))
    request.contexts.batch_size = draw(st.sampled_from([0, 1, 3, 2**32 - 1]))
    request.contexts.packing = draw(st.sampled_from([0, 1, 2, 9]))
    if draw(st.booleans()):
        request.contexts.bos = draw(st.booleans())
    request.positions.skip_first = draw(st.sampled_from([0, 1, 2**32 - 1]))
    request.positions.only.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=3)))
    request.output.path = draw(paths)
    request.output.shard_tokens = draw(st.sampled_from([0, 1, 7, 2**64 - 1]))
    request.output.overwrite = draw(st.booleans())
    request.output.shuffle.enabled = draw(st.booleans())
    request.output.shuffle.buffer_shards = draw(st.sampled_from([0, 1, 2**32 - 1]))
    request.output.shuffle.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        request.rules.append(draw(st.one_of(lm_hooks(), specs())))
    return request


@FUZZ
@given(request=harvest_requests(), interval=st.sampled_from([0, 1, 50, 2**32 - 1]))
def test_harvest(fuzz_server, request, interval) -> None:
    stub = fuzz_server["harvests"]

    def call() -> None:
        job = stub.StartHarvest(request, timeout=30)
        # A job that starts is visible, watchable and cancellable; it ends (it is small or cancelled).
        assert stub.GetHarvest(HV.GetHarvestRequest(job_id=job.job_id), timeout=10).job_id == job.job_id
        stub.CancelHarvest(HV.CancelHarvestRequest(job_id=job.job_id), timeout=10)
        states = list(stub.WatchHarvest(HV.WatchHarvestRequest(job_id=job.job_id, interval_ms=interval), timeout=120))
        assert states[-1].state in (HV.HARVEST_STATE_SUCCEEDED, HV.HARVEST_STATE_CANCELLED, HV.HARVEST_STATE_FAILED)

    _check(call)


@FUZZ
@given(payload=st.binary(max_size=200), method=st.sampled_from(METHODS))
def test_random_bytes_as_messages(fuzz_server, payload, method) -> None:
    path, kind = method
    channel = fuzz_server["channel"]

    def call() -> None:
        if kind == "unary":
            channel.unary_unary(path)(payload, timeout=10)
        elif kind == "stream":
            stream = channel.unary_stream(path)(payload, timeout=10)
            try:
                next(stream, None)
            finally:
                stream.cancel()
        else:
            stream = channel.stream_stream(path)(iter([payload, payload]), timeout=10)
            for _ in stream:
                pass

    _check(call)


# ------------------------------------------------------------------ named operands (OperandService)

OP = operand_service_pb2
#: What OperandService answers a bad request with: a deliberate status, never INTERNAL or UNKNOWN.
OPERAND_STATUSES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
                    grpc.StatusCode.PERMISSION_DENIED}


def _operand_call(call: Any) -> Any:
    """``call()``'s reply, or None when it was refused with one of OPERAND_STATUSES."""
    try:
        return call()
    except grpc.RpcError as exc:
        assert exc.code() in OPERAND_STATUSES, f"{exc.code()}: {exc.details()}"
        return None


def _operands_cleared(fuzz_server: dict[str, Any]) -> None:
    """Deletes what an example uploaded, then checks that nothing is left claimed: every
    refused or cut-short upload gave back the bytes its header claimed."""
    stub = fuzz_server["operands"]
    for op in stub.ListOperands(OP.ListOperandsRequest(), timeout=10).operands:
        if not op.published:
            _operand_call(lambda: stub.DeleteOperand(OP.DeleteOperandRequest(name=op.name), timeout=10))
    listing = stub.ListOperands(OP.ListOperandsRequest(), timeout=10)
    assert [op.name for op in listing.operands if not op.published] == [] and listing.total_bytes == 0


def _field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field: e.g. UploadOperandRequest.operand (1) or .chunk (2) holding ``body``."""
    return _varint(number << 3 | 2) + _varint(len(body)) + body


#: A valid header of a float32 [4] tensor whose 16 bytes come in chunk 1.
CHUNKED_HEADER = OP.UploadOperandRequest(operand=OP.OperandUpload(
    name="fuzz-chunked", ttl_seconds=60,
    tensor=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[4], chunk_id=1))).SerializeToString()


@FUZZ
@given(payload=st.binary(max_size=200),
       how=st.sampled_from(["upload", "upload twice", "as header", "as chunk", "header then raw", "delete", "publish",
                            "list"]))
def test_operand_service_random_bytes(fuzz_server, payload, how) -> None:
    channel = fuzz_server["channel"]
    upload = channel.stream_unary("/hookwire.v1.OperandService/UploadOperand")
    messages = {"upload": [payload], "upload twice": [payload, payload], "as header": [_field(1, payload)],
                "as chunk": [CHUNKED_HEADER, _field(2, payload)], "header then raw": [CHUNKED_HEADER, payload]}
    if how in messages:
        _operand_call(lambda: upload(iter(messages[how]), timeout=10))
    else:
        path = {"delete": "DeleteOperand", "publish": "PublishOperand", "list": "ListOperands"}[how]
        _operand_call(lambda: channel.unary_unary(f"/hookwire.v1.OperandService/{path}")(payload, timeout=10))
    _operands_cleared(fuzz_server)


operand_names = st.one_of(
    st.sampled_from(["v", "steer/layer-1.v2", "a_b-c.d", "../x", "", "/x", ".x", "a//b", "a b", "x/", "x/..", "\u00e9"]),
    st.text(max_size=8), long_strings)


valid_operand_names = st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9_./-]{0,10}", fullmatch=True)
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@st.composite
def finite_tensors(draw: Any, shape: list[int] | None = None, dtype: torch.dtype | None = None) -> tensor_pb2.Tensor:
    """A tensor an upload accepts: finite floats, of ``shape`` (else a small random one)."""
    shape = draw(st.lists(st.integers(0, 4), max_size=3)) if shape is None else shape
    count = math.prod(shape)
    values = draw(st.lists(st.floats(-100, 100, width=16), min_size=count, max_size=count))
    tensor = torch.tensor(values, dtype=torch.float32).reshape(shape)
    return codec.encode_tensor(tensor.to(dtype or draw(st.sampled_from(FLOAT_DTYPES))))


@st.composite
def valid_saes(draw: Any) -> rule_pb2.Sae:
    """An SAE an upload accepts, for d_in 4 (the demo MLP's output)."""
    d_sae = draw(st.integers(1, 6))
    architecture = draw(st.sampled_from(["standard", "topk", "jumprelu"]))
    sae = rule_pb2.Sae(architecture=architecture)
    if architecture == "topk":
        sae.k = draw(st.integers(1, d_sae))
    shapes = {"w_enc": [4, d_sae], "b_enc": [d_sae], "w_dec": [d_sae, 4], "b_dec": [4]}
    if architecture == "jumprelu":
        shapes["threshold"] = [d_sae]
    for field, shape in shapes.items():
        getattr(sae, field).CopyFrom(draw(finite_tensors(shape, torch.float32)))
    return sae


@st.composite
def operand_uploads(draw: Any, session_id: str) -> list[OP.UploadOperandRequest]:
    """An upload: a header (mostly valid: any name, lifetime, tensor or SAE, its tensors
    inline or chunked), then chunk messages: the data of its chunked tensors, cut in
    random steps, and sometimes random ones."""
    header = OP.OperandUpload(name=draw(rarely(operand_names, valid_operand_names)))
    lifetime = draw(rarely(st.sampled_from(["neither", "both", "other session"]), st.sampled_from(["session", "ttl"])))
    if lifetime in ("session", "both"):
        header.session_id = session_id
    if lifetime in ("ttl", "both"):
        header.ttl_seconds = draw(st.sampled_from([60, 2**32 - 1]))
    if lifetime == "other session":
        header.session_id = draw(st.sampled_from(["s_nope", "x" * 300]))
    kind = draw(rarely(st.sampled_from(["random tensor", "random sae", None]), st.sampled_from(["tensor", "sae"])))
    if kind == "tensor":
        header.tensor.CopyFrom(draw(finite_tensors()))
    elif kind == "sae":
        header.sae.CopyFrom(draw(valid_saes()))
    elif kind == "random tensor":
        header.tensor.CopyFrom(draw(tensors()))
        if header.tensor.chunk_id and draw(st.booleans()):
            header.tensor.data = b""  # a well-formed chunked tensor: its data follows (random chunks below)
        if draw(st.booleans()):
            header.tensor.operand = draw(st.sampled_from(["v", "other", ""]))
    elif kind == "random sae":
        header.sae.CopyFrom(draw(saes()))
        if draw(st.booleans()):
            header.sae.operand = "v"
    chunks = []
    if kind in ("tensor", "sae"):
        for i, (_, tensor) in enumerate(codec.iter_tensors(header)):
            if not draw(st.booleans()):
                continue  # inline
            data, tensor.data, tensor.chunk_id = tensor.data, b"", i + 1
            step = draw(st.integers(1, max(1, len(data))))
            chunks.extend(tensor_pb2.TensorChunk(chunk_id=i + 1, offset=offset, data=data[offset:offset + step])
                          for offset in range(0, len(data), step))
        if chunks and draw(st.integers(0, 7)) == 0:
            chunks = draw(st.permutations(chunks))[:draw(st.integers(0, len(chunks)))]  # reordered, or cut short
    if kind not in ("tensor", "sae") or draw(st.integers(0, 7)) == 0:
        for _ in range(draw(st.integers(1, 2))):
            chunks.append(tensor_pb2.TensorChunk(
                chunk_id=draw(st.sampled_from([0, 1, 9, 2**32 - 1])), offset=draw(st.sampled_from([0, 4, 2**63, 2**64 - 1])),
                data=draw(st.binary(max_size=64))))
    return [OP.UploadOperandRequest(operand=header)] + [OP.UploadOperandRequest(chunk=c) for c in chunks]


@FUZZ
@given(data=st.data())
def test_operand_uploads(fuzz_server, data) -> None:
    stub = fuzz_server["operands"]
    messages = data.draw(operand_uploads(fuzz_server["session_id"]))
    header = messages[0].operand
    reply = _operand_call(lambda: stub.UploadOperand(iter(messages), timeout=30))
    if reply is not None:
        # An upload that succeeds is the operand its header described, named as asked ...
        assert reply.name == header.name and reply.owner == "anonymous", reply
        assert reply.kind == (OP.OPERAND_KIND_TENSOR if header.WhichOneof("value") == "tensor" else OP.OPERAND_KIND_SAE)
        if reply.kind == OP.OPERAND_KIND_TENSOR:
            assert (reply.tensor.dtype, list(reply.tensor.shape)) == (header.tensor.dtype, list(header.tensor.shape))
        # ... that a rule naming it uses or refuses cleanly ...
        rule = rule_pb2.Rule(target="output")
        if reply.kind == OP.OPERAND_KIND_TENSOR:
            rule.add.value.tensor.operand = header.name
        else:
            rule.sae.sae.operand = header.name
            rule.sae.features.append(0)
        request = model_service_pb2.InferRequest(model="mlp", args=[codec.encode_value(torch.ones(1, 8))], hooks=[
            hook_pb2.HookSpec(module="out", posthook=hook_pb2.HookAction(rules=[rule]))])
        _check(lambda: fuzz_server["models"].Infer(request, timeout=30))
        # ... and that a second upload under its name is refused.
        again = _operand_call(lambda: stub.UploadOperand(iter(messages), timeout=30))
        assert again is None
    # A delete or publish of the name answers cleanly too.
    _operand_call(lambda: stub.PublishOperand(OP.PublishOperandRequest(name=header.name, path=header.name), timeout=10))
    _operand_call(lambda: stub.DeleteOperand(OP.DeleteOperandRequest(name=header.name, owner="someone"), timeout=10))
    _operands_cleared(fuzz_server)
