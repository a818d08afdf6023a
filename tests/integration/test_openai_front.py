"""The OpenAI-compatible front (api/openai_front.py) on the torch engine, through clients
nobody here wrote: OpenAI's own ``openai`` package (sync and async, streaming and not,
chat and completions, its own exception classes), ``curl -N`` for the raw event stream,
and httpx for a client that goes away mid-stream. The oracle is hookwire's gRPC Generate
on the same server (itself checked against in-process transformers elsewhere): the same
call through either front gives the same tokens, events and log-probabilities."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from google.protobuf import json_format

import hookwire
from hookwire import rules
from hookwire.v1 import hook_pb2, model_service_pb2
from hookwire.wire import codec
from hookwire_server.auth import hash_token
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.model_registry import ModelHost

from certs import make_pki
from support import ServerThread, active_generations, build_test_registry, rpc_count, serving

TOKENS = {name: f"hwt_front_{name}" for name in ("viewer", "alice", "observer", "operator")}
ROLE = {"viewer": "viewer", "alice": "user", "observer": "observer", "operator": "operator"}
LINES = "\n".join(f"{name}:{ROLE[name]}:{hash_token(token)}" for name, token in TOKENS.items())
PROMPT = "Hello world, the model is"
#: A large steering vector on tiny-lm's first layer: it changes greedy tokens.
STEER = [4.0] * 64
LAYER = "model.layers.0"


def _plain_tokenizer() -> Any:
    tokenizer = tiny_lm_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


@pytest.fixture(scope="module")
def front() -> Iterator[ServerThread]:
    registry = build_test_registry()
    # tiny-lm with a tokenizer that has no chat template: /v1/chat/completions says so.
    registry.add(ModelHost("tiny-lm-plain", tiny_lm(), tokenizer=_plain_tokenizer()))
    with serving(registry, tokens=LINES, allow_shared_rules=True, openai_port=0,
                 max_message_bytes=2 << 20) as srv:
        yield srv


def _url(srv: ServerThread) -> str:
    return f"http://127.0.0.1:{srv.server.openai_port}/v1"


def _openai(srv: ServerThread, who: str | None = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=_url(srv), api_key=TOKENS[who] if who else "none", max_retries=0, timeout=120)


def _async_openai(srv: ServerThread, who: str = "alice") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=_url(srv), api_key=TOKENS[who], max_retries=0, timeout=120)


def _grpc(srv: ServerThread, who: str = "alice") -> hookwire.Client:
    return hookwire.connect(srv.target, options=hookwire.ConnectOptions(token=TOKENS[who]))


def _hidden() -> int:
    return int(tiny_lm().config.hidden_size)


async def _grpc_generate(srv: ServerThread, request: model_service_pb2.GenerateRequest,
                         who: str = "alice") -> list[model_service_pb2.GenerateResponse]:
    async with _grpc(srv, who) as client:
        return [message async for message in client.model_stub.Generate(request)]


def _done(messages: list[model_service_pb2.GenerateResponse]) -> model_service_pb2.GenerateDone:
    (done,) = [m.done for m in messages if m.WhichOneof("kind") == "done"]
    return done




# ---------------------------------------------------------------------------- answers


async def test_completions_equal_grpc_generate_streaming_or_not(front: ServerThread) -> None:
    """A greedy completion gives the text gRPC's Generate gives for the same prompt, whole
    or streamed; the response's id, and its x-request-id header, is the hookwire request
    id; the stream's last chunk holds the usage (include_usage); the RPC counts with
    front="http"."""
    grpc_done = _done(await _grpc_generate(front, model_service_pb2.GenerateRequest(
        model="tiny-lm", prompts=[PROMPT], max_new_tokens=8, do_sample=False)))
    expected = grpc_done.sequences[0].text
    before = rpc_count(front, "Generate", "OK", "http")
    client = _openai(front)
    raw = await asyncio.to_thread(lambda: client.completions.with_raw_response.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=8, temperature=0))
    whole = raw.parse()
    assert raw.headers["x-request-id"] == whole.id and whole.id.startswith("req_")
    assert whole.choices[0].text == expected
    assert whole.choices[0].finish_reason == "length"
    prompt_tokens = len(tiny_lm_tokenizer()(PROMPT)["input_ids"])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_tokens, 8)

    def streamed() -> list[Any]:
        return list(client.completions.create(model="tiny-lm", prompt=PROMPT, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))

    chunks = await asyncio.to_thread(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1
    assert rpc_count(front, "Generate", "OK", "http") == before + 2


async def test_chat_uses_the_models_template_and_streams_as_the_async_client_expects(front: ServerThread) -> None:
    """Chat completions format the messages with the tokenizer's own chat template: the
    same tokens as gRPC's Generate on the templated ids; the async client's stream
    concatenates to the whole answer, with the role first and a usage chunk last."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello the cat"}]
    ids = tiny_lm_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
    request = model_service_pb2.GenerateRequest(model="tiny-lm", max_new_tokens=6, do_sample=False)
    codec.encode_tensor_into(torch.tensor([ids]), request.input_ids)
    expected = _done(await _grpc_generate(front, request)).sequences[0].text
    async with _async_openai(front) as client:
        whole = await client.chat.completions.create(model="tiny-lm", messages=messages, max_tokens=6,
                                                     temperature=0)
        stream = await client.chat.completions.create(model="tiny-lm", messages=messages,
                                                      max_completion_tokens=6, temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == 6
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == len(ids) + 6


def test_curl_reads_the_raw_event_stream(front: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    """curl -N: a text/event-stream of `data: {json}` lines, each followed by a blank
    line, ending with `data: [DONE]`. The request's log line names its principal and the
    client's own x-request-id beside hookwire's."""
    caplog.set_level("INFO", logger="hookwire.audit")
    curl = shutil.which("curl")
    assert curl is not None, "curl is on every machine of this project's kind"
    body = json.dumps({"model": "tiny-lm", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True})
    out = subprocess.run(
        [curl, "-sN", "-D", "-", f"{_url(front)}/completions", "-H", "content-type: application/json",
         "-H", f"authorization: Bearer {TOKENS['alice']}", "-H", "x-request-id: my-own-id", "-d", body],
        capture_output=True, timeout=120, check=True,
    ).stdout.decode()
    head, _, stream = out.partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 200")
    assert "content-type: text/event-stream" in head.lower()
    events = stream.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    (ours,) = [line.split(": ", 1)[1] for line in head.lower().split("\r\n") if line.startswith("x-request-id: req_")]
    assert {c["id"] for c in chunks} == {ours}
    audit = [r for r in caplog.records if r.name == "hookwire.audit" and getattr(r, "request_id", "") == ours]
    assert [(r.principal, r.client_request_id, r.front, r.http_status) for r in audit] == [  # type: ignore[attr-defined]
        ("alice", "my-own-id", "http", 200)]


# ---------------------------------------------------------------------------- hookwire in the body


async def test_tagged_steering_via_extra_body_changes_exactly_the_tagged_calls(front: ServerThread) -> None:
    """An operator's SCOPE_TAGGED steering rule applies to the HTTP calls whose
    ``hookwire.tags`` carry its tag, and gives the tokens the same rule gives a gRPC
    call with that tag; untagged HTTP calls keep the plain tokens."""
    def request(tags: list[str]) -> model_service_pb2.GenerateRequest:
        return model_service_pb2.GenerateRequest(model="tiny-lm", prompts=[PROMPT], max_new_tokens=8,
                                                 do_sample=False, tags=tags)

    client = _openai(front)

    def complete(**extra: Any) -> str:
        return client.completions.create(model="tiny-lm", prompt=PROMPT, max_tokens=8, temperature=0,
                                         **extra).choices[0].text

    plain = _done(await _grpc_generate(front, request([]))).sequences[0].text
    async with _grpc(front, "operator") as operator:
        vector = torch.full((_hidden(),), 4.0)
        async with operator.model("tiny-lm").hook(LAYER, posthook=[rules.add("output", vector)], scope="tagged",
                                                  tags=["steer"]):
            steered = _done(await _grpc_generate(front, request(["steer"]))).sequences[0].text
            tagged = await asyncio.to_thread(complete, extra_body={"hookwire": {"tags": ["steer"]}})
            other = await asyncio.to_thread(complete, extra_body={"hookwire": {"tags": ["other"]}})
            untagged = await asyncio.to_thread(complete)
    assert steered != plain, "the steering vector must change tiny-lm's greedy tokens"
    assert tagged == steered
    assert other == plain and untagged == plain


async def test_a_grpc_scope_all_observer_sees_http_calls_with_their_request_ids(front: ServerThread) -> None:
    """A SCOPE_ALL capture registered over gRPC fires for HTTP calls like any other: its
    events carry the HTTP response's id, one per step."""
    async with _grpc(front, "observer") as observer:
        async with observer.model("tiny-lm").hook(LAYER, posthook=hookwire.capture("output", select="[:, -1]"),
                                                  scope="all") as hook:
            answer = await asyncio.to_thread(lambda: _openai(front).completions.create(
                model="tiny-lm", prompt=PROMPT, max_tokens=3, temperature=0))
            events = [e async for e in hook.events(until=answer.id, timeout=60)]
    assert [e.request_id for e in events] == [answer.id] * 3
    assert [e.raw.step for e in events] == [0, 1, 2]


def _tensor_of(value: dict[str, Any]) -> np.ndarray:
    """A tensor in the front's JSON form: dtype, shape and base64 bytes (the proto's JSON mapping)."""
    tensor = value["tensor"]
    assert tensor["dtype"] == "DTYPE_FLOAT32"
    data = np.frombuffer(base64.b64decode(tensor["data"]), dtype=np.float32)
    return data.reshape([int(s) for s in tensor["shape"]])


async def test_request_hooks_in_the_body_stream_their_events_per_chunk_equal_to_grpc(front: ServerThread) -> None:
    """``hookwire.hooks`` (HookSpec JSON): a selected capture's events travel in the chunk
    of their step (``hookwire.events``), equal to the same hook's events over gRPC; the
    whole response carries them all."""
    spec = hookwire.HookSpec(LAYER, posthook=hookwire.capture("output", select="[:, -1]"))
    as_json = json_format.MessageToDict(spec.to_proto(), preserving_proto_field_name=True)
    messages = await _grpc_generate(front, model_service_pb2.GenerateRequest(
        model="tiny-lm", prompts=[PROMPT], max_new_tokens=3, do_sample=False, hooks=[spec.to_proto()]))
    grpc_events = [e for m in messages for e in ([m.event] if m.WhichOneof("kind") == "event" else
                                                 list(m.batch.events) if m.WhichOneof("kind") == "batch" else [])]
    expected = [codec.decode_tensor(e.output.tensor).numpy() for e in grpc_events]
    assert len(expected) == 3

    body = {"model": "tiny-lm", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "hookwire": {"hooks": [as_json]}}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{_url(front)}/completions", json=body,
                               headers={"authorization": f"Bearer {TOKENS['alice']}"}) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
        per_chunk = [[e["step"] if "step" in e else 0 for e in c.get("hookwire", {}).get("events", [])]
                     for c in chunks]
        assert [steps for steps in per_chunk if steps] == [[0], [1], [2]]
        got = [_tensor_of(e["output"]) for c in chunks for e in c.get("hookwire", {}).get("events", [])]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)

        whole = (await http.post(f"{_url(front)}/completions", json={**body, "stream": False},
                                 headers={"authorization": f"Bearer {TOKENS['alice']}"})).json()
        assert [int(e.get("step", 0)) for e in whole["hookwire"]["events"]] == [0, 1, 2]
        for event, b in zip(whole["hookwire"]["events"], expected, strict=True):
            np.testing.assert_array_equal(_tensor_of(event["output"]), b)

        # A capture of whole tensors would not fit a chunk: refused before the call, pointing to gRPC.
        whole_capture = hookwire.HookSpec(LAYER, posthook=hookwire.capture("output"))
        refused = await http.post(
            f"{_url(front)}/completions", headers={"authorization": f"Bearer {TOKENS['alice']}"},
            json={**body, "hookwire": {"hooks": [json_format.MessageToDict(whole_capture.to_proto())]}})
        assert refused.status_code == 400
        assert "a capture of whole tensors does not travel over HTTP" in refused.json()["error"]["message"]
        assert "gRPC" in refused.json()["error"]["message"]
        # A spec gRPC would refuse is refused the same way, with its field path.
        bad = await http.post(
            f"{_url(front)}/completions", headers={"authorization": f"Bearer {TOKENS['alice']}"},
            json={**body, "hookwire": {"hooks": [{"module": "model.nowhere.*", "posthook": as_json["posthook"]}]}})
        # (NOT_FOUND: the module glob matches nothing, as gRPC's status says)
        assert bad.status_code == 404 and bad.json()["error"]["message"].startswith("hookwire.hooks[0]"), bad.json()
        not_json = await http.post(
            f"{_url(front)}/completions", headers={"authorization": f"Bearer {TOKENS['alice']}"},
            json={**body, "hookwire": {"hooks": [{"modul": LAYER}]}})
        assert not_json.status_code == 400 and "hookwire.hooks[0]" in not_json.json()["error"]["message"]


async def test_a_readout_streamed_per_chunk_equals_the_grpc_readout(front: ServerThread) -> None:
    """A probe readout on every layer (rules.probe_scores) in ``hookwire.hooks``: each
    chunk carries its step's readout events, equal field for field (tensor bytes
    included) to the same hook's events over gRPC."""
    probes = torch.randn(3, _hidden(), generator=torch.Generator().manual_seed(37))
    spec = hookwire.HookSpec("model.layers.*", posthook=hookwire.capture(
        "output", select="[:, -1]", readout=rules.probe_scores(probes, sigmoid=True)))
    messages = await _grpc_generate(front, model_service_pb2.GenerateRequest(
        model="tiny-lm", prompts=[PROMPT], max_new_tokens=3, do_sample=False, hooks=[spec.to_proto()]))
    grpc_events = [e for m in messages for e in ([m.event] if m.WhichOneof("kind") == "event" else
                                                 list(m.batch.events) if m.WhichOneof("kind") == "batch" else [])]

    def comparable(event: dict[str, Any]) -> dict[str, Any]:  # what differs between two calls: ids, times
        return {k: v for k, v in event.items() if k not in ("request_id", "hook_id", "time")}

    want = [comparable(json_format.MessageToDict(e, preserving_proto_field_name=True)) for e in grpc_events]
    # One event per layer and step: the probes' 3 scores of the last position, [1, 3].
    assert len(want) == 3 * 2 and all(e["output"]["tensor"]["shape"] == ["1", "3"] for e in want), want
    body = {"model": "tiny-lm", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "hookwire": {"hooks": [json_format.MessageToDict(spec.to_proto(), preserving_proto_field_name=True)]}}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{_url(front)}/completions", json=body,
                               headers={"authorization": f"Bearer {TOKENS['alice']}"}) as response:
            assert response.status_code == 200
            chunks = [json.loads(line.removeprefix("data: ")) async for line in response.aiter_lines()
                      if line.startswith("data: {")]
    got = [c.get("hookwire", {}).get("events", []) for c in chunks]
    assert [len(events) for events in got if events] == [2, 2, 2]  # both layers' readouts, in their step's chunk
    assert [comparable(e) for events in got for e in events] == want


async def test_logprobs_and_echo_equal_grpc_generate(front: ServerThread) -> None:
    """Completions' ``logprobs`` (and ``echo`` with it, as evaluation harnesses score
    prompts) and chat's ``logprobs``/``top_logprobs`` report the values gRPC's Generate
    reports with logprobs / top_logprobs / prompt_logprobs."""
    messages = await _grpc_generate(front, model_service_pb2.GenerateRequest(
        model="tiny-lm", prompts=[PROMPT], max_new_tokens=4, do_sample=False, logprobs=True, top_logprobs=2,
        prompt_logprobs=2))
    steps = [m.tokens for m in messages if m.WhichOneof("kind") == "tokens"]
    chosen = [s.logprobs[0].logprob for s in steps]
    prompt = [t.logprob for t in steps[0].prompt_logprobs[0].tokens]
    client = _openai(front)
    answer = await asyncio.to_thread(lambda: client.completions.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2))
    assert answer.choices[0].logprobs.token_logprobs == pytest.approx(chosen, abs=0)
    assert all(len(top) == 2 for top in answer.choices[0].logprobs.top_logprobs)
    echoed = await asyncio.to_thread(lambda: client.completions.create(
        model="tiny-lm", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True))
    values = echoed.choices[0].logprobs.token_logprobs
    assert values[0] is None
    assert values[1:] == pytest.approx([*prompt, *chosen], abs=0)
    assert echoed.choices[0].text.startswith(PROMPT)
    chat = await asyncio.to_thread(lambda: client.chat.completions.create(
        model="tiny-lm", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=3))
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)


# ---------------------------------------------------------------------------- refusals


async def test_tokens_and_roles(front: ServerThread) -> None:
    """No token or a wrong one: 401; a viewer may list models but not generate: 403;
    /health needs no token. OpenAI's client raises its own classes for each."""
    async with httpx.AsyncClient(timeout=60) as http:  # (OpenAI's client refuses to send no key)
        missing = await http.get(f"{_url(front)}/models")
    assert missing.status_code == 401 and "missing credentials" in missing.json()["error"]["message"]
    assert missing.json()["error"]["code"] == "UNAUTHENTICATED"
    with pytest.raises(openai.AuthenticationError, match="the bearer token is not valid"):
        await asyncio.to_thread(lambda: _openai(front, None).completions.create(model="tiny-lm", prompt="x"))
    viewer = _openai(front, "viewer")
    models = await asyncio.to_thread(lambda: viewer.models.list())
    entries = {m.id: m for m in models.data}
    assert "tiny-lm" in entries and "mlp" not in entries  # models that generate
    entry = entries["tiny-lm"].model_dump()
    assert {k: entry[k] for k in ("id", "object", "owned_by", "root")} == {
        "id": "tiny-lm", "object": "model", "owned_by": "hookwire", "root": "tiny-lm"}
    assert isinstance(entry["created"], int)
    with pytest.raises(openai.PermissionDeniedError, match="needs the user role; 'viewer' has viewer"):
        await asyncio.to_thread(lambda: viewer.completions.create(model="tiny-lm", prompt="x", max_tokens=2))
    async with httpx.AsyncClient() as http:
        health = await http.get(f"http://127.0.0.1:{front.server.openai_port}/health")
    assert health.status_code == 200


async def test_bad_bodies_answer_400_naming_the_field_in_the_bodys_words(front: ServerThread) -> None:
    """Fields hookwire does not serve, values out of range and limits: 400 (or 404, 413,
    501) with OpenAI's error body naming the field as the body named it; no-op values of
    unserved fields pass; a streaming call that fails before its first token answers with
    its status, not a 200 stream; the server stays healthy."""
    client = _openai(front)

    def create(**fields: Any) -> Any:
        return client.completions.create(**{"model": "tiny-lm", "prompt": PROMPT, "max_tokens": 2, **fields})

    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"extra_body": {"bogus": 1}}, openai.BadRequestError, "bogus: hookwire does not serve this field"),
        ({"presence_penalty": 0.5}, openai.BadRequestError, "presence_penalty: hookwire does not serve penalties"),
        ({"logit_bias": {"5": 1.0}}, openai.BadRequestError, "logit_bias: hookwire does not serve logit biases"),
        ({"max_tokens": 5000}, openai.BadRequestError,
         r"max_tokens: 5000 new tokens, over the limit of 4096 \(max_new_tokens\)"),
        ({"n": 17}, openai.BadRequestError, r"n: 17 sequences a prompt, over the limit of 16 \(max_generate_n\)"),
        ({"logprobs": 21}, openai.BadRequestError, "logprobs"),
        ({"temperature": -1}, openai.BadRequestError, "temperature"),
        ({"prompt": [""]}, openai.BadRequestError, r"prompt\[0\]: the prompt is empty"),
        ({"extra_body": {"min_tokens": 5}}, openai.BadRequestError, "min_tokens: 5 is more than the 2 new tokens"),
        ({"best_of": 3}, openai.BadRequestError, "best_of"),
        ({"model": "nope"}, openai.NotFoundError, "no model 'nope'"),
        ({"model": "nope", "stream": True}, openai.NotFoundError, "no model 'nope'"),
        ({"prompt": [[1, 2, 3]], "model": "mlp"}, openai.APIStatusError, "model 'mlp' cannot generate"),
        ({"prompt": "x" * (3 << 20)}, openai.APIStatusError, r"request body: .* \(max_message_bytes\)"),
        ({"max_tokens": 2**32}, openai.BadRequestError, "max_tokens: Input should be less than or equal"),
        ({"prompt": [2**63]}, openai.BadRequestError, "prompt: expected a text, a list of texts, a list of token ids"),
        ({"prompt": [True, False]}, openai.BadRequestError, "prompt: expected a text"),
        # Counted before a row is padded (rows x the longest row would be built otherwise).
        ({"prompt": [[5] * 300] * 300}, openai.RateLimitError, r"prompt: 300 prompts x n 1, .*max_tokenize_texts"),
        ({"prompt": [[5] * 9000]}, openai.RateLimitError, r"prompt: a prompt of 9000 tokens, .*max_prompt_tokens"),
        ({"stop": ""}, openai.BadRequestError, r"stop\[0\]: a stop string cannot be empty"),
        # An event over max_http_event_bytes in the first step: its status, not a 200 stream.
        ({"stream": True, "extra_body": {"hookwire": {"hooks": [
            {"module": LAYER, "posthook": {"capture": ["PART_OUTPUT"], "select": "[:, :]"}}]}},
          "prompt": "word " * 200, "n": 8}, openai.RateLimitError, "max_http_event_bytes"),
    ]
    for fields, error, message in cases:
        with pytest.raises(error, match=message) as raised:
            await asyncio.to_thread(create, **fields)
        if "cannot generate" in message:
            assert raised.value.status_code == 501  # type: ignore[attr-defined]
        if "max_message_bytes" in message:
            assert raised.value.status_code == 413  # type: ignore[attr-defined]
        body = raised.value.body  # type: ignore[attr-defined]
        assert set(body) >= {"message", "type", "code"}, body
    ok = await asyncio.to_thread(create, user="someone", presence_penalty=0, frequency_penalty=0, logit_bias=None)
    assert ok.choices[0].finish_reason == "length"
    assert (await asyncio.to_thread(client.models.retrieve, "tiny-lm")).id == "tiny-lm"
    with pytest.raises(openai.NotFoundError, match="no model 'mlp' that generates"):
        await asyncio.to_thread(client.models.retrieve, "mlp")
    async with httpx.AsyncClient(timeout=60) as http:  # unknown paths and methods: OpenAI's error body too
        nowhere = await http.get(f"{_url(front)}/embeddings")
        wrong = await http.delete(f"{_url(front)}/completions")
    assert nowhere.status_code == 404 and nowhere.json()["error"]["code"] == "NOT_FOUND"
    assert wrong.status_code == 405 and "not allowed" in wrong.json()["error"]["message"]

    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        await asyncio.to_thread(lambda: client.chat.completions.create(
            model="tiny-lm-plain", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    with pytest.raises(openai.BadRequestError, match="tools: hookwire does not call tools"):
        await asyncio.to_thread(lambda: client.chat.completions.create(
            model="tiny-lm", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]))
    async with httpx.AsyncClient(timeout=60) as http:
        garbage = await http.post(f"{_url(front)}/completions", content=b"{not json",
                                  headers={"authorization": f"Bearer {TOKENS['alice']}",
                                           "content-type": "application/json"})
    assert garbage.status_code == 400 and "not valid JSON" in garbage.json()["error"]["message"]
    assert front.call(front.server.health_statuses)[""]
    assert active_generations(front) == 0


async def test_a_client_that_disconnects_mid_stream_cancels_its_call_and_frees_its_slot(
        front: ServerThread) -> None:
    """Closing the connection after the first chunk ends the Generate call (its slot,
    counted against max_active_generations, comes back) long before its 500 tokens.
    (Its hooks make each step cost more: the call's 500 steps take seconds, the client
    closes at once; no buffer holds an unread stream back.)"""
    before = rpc_count(front, "Generate", "CANCELLED", "http")
    hooks = [json_format.MessageToDict(hookwire.HookSpec(module, posthook=hookwire.capture(
        "output", select="[:, -1]")).to_proto()) for module in ("model.layers.*", "model.layers.*.mlp", "model.norm")]
    body = {"model": "tiny-lm", "prompt": "Hi", "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True, "hookwire": {"hooks": hooks}}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{_url(front)}/completions", json=body,
                               headers={"authorization": f"Bearer {TOKENS['alice']}"}) as response:
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            assert active_generations(front) == 1
    for _ in range(6000):  # up to 60 s: a hang guard, not a speed requirement
        if active_generations(front) == 0 and rpc_count(front, "Generate", "CANCELLED", "http") == before + 1:
            break
        await asyncio.sleep(0.01)
    assert active_generations(front) == 0
    assert rpc_count(front, "Generate", "CANCELLED", "http") == before + 1


# ---------------------------------------------------------------------------- HTTPS


def _https_client(srv: ServerThread, pki: dict[str, Any], cert: str | None, token: str = "none") -> openai.OpenAI:
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert is not None:
        context.load_cert_chain(str(pki[f"{cert}_cert"]), str(pki[f"{cert}_key"]))
    return openai.OpenAI(base_url=f"https://127.0.0.1:{srv.server.openai_port}/v1", api_key=token, max_retries=0,
                         timeout=60, http_client=httpx.Client(verify=context, timeout=60))


async def test_https_with_the_servers_certificate_and_mtls_principals(tmp_path: Any) -> None:
    """--tls-cert/--tls-key serve the front over HTTPS too; with --tls-client-ca a client
    certificate is required, and names a principal by itself (cert_subject) as on gRPC."""
    pki = make_pki(tmp_path, ["svc-operator", "stranger"])
    principals = tmp_path / "principals.toml"
    principals.write_text(
        '[[principals]]\nname = "svc-operator"\nroles = ["operator"]\ncert_subject = "CN=svc-operator"\n'
        f'[[principals]]\nname = "alice"\nroles = ["user"]\ntoken_sha256 = "{hash_token("alice-token")}"\n')
    tls = dict(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))

    def complete(client: openai.OpenAI) -> Any:
        return client.completions.create(model="tiny-lm", prompt=PROMPT, max_tokens=2, temperature=0)

    with serving(build_test_registry(), tokens_file=str(principals), openai_port=0, **tls) as srv:
        answer = await asyncio.to_thread(complete, _https_client(srv, pki, None, "alice-token"))
        assert answer.choices[0].finish_reason == "length"
        with pytest.raises(openai.APIConnectionError):  # plain HTTP to an HTTPS port
            await asyncio.to_thread(lambda: openai.OpenAI(
                base_url=f"http://127.0.0.1:{srv.server.openai_port}/v1", api_key="alice-token", max_retries=0,
                timeout=30).models.list())
    with serving(build_test_registry(), tokens_file=str(principals), openai_port=0, tls_client_ca=str(pki["ca"]),
                 **tls) as srv:
        # A certificate alone, without an Authorization header (OpenAI's client always
        # sends one: httpx here).
        body = {"model": "tiny-lm", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        url = f"https://127.0.0.1:{srv.server.openai_port}/v1/completions"
        by_cert = await asyncio.to_thread(lambda: _https_client(srv, pki, "svc-operator")._client.post(url, json=body))
        assert by_cert.status_code == 200 and by_cert.json()["choices"][0]["finish_reason"] == "length"
        nobody = await asyncio.to_thread(lambda: _https_client(srv, pki, "stranger")._client.post(url, json=body))
        assert nobody.status_code == 401 and "certificate" in nobody.json()["error"]["message"]  # valid, of nobody
        assert (await asyncio.to_thread(complete, _https_client(srv, pki, "stranger", "alice-token"))).choices
        with pytest.raises(openai.APIConnectionError):  # the handshake needs a client certificate
            await asyncio.to_thread(complete, _https_client(srv, pki, None, "alice-token"))
