"""Review of issue #10 (Generate), server side: each test here fails on e4b6e4b and names
a defect the review report describes. A real server on loopback, raw gRPC stubs."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import weakref
from typing import Any, Iterator

import grpc
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hookwire.wire import codec
from hookwire.v1 import hook_pb2, model_service_pb2, model_service_pb2_grpc, rule_pb2
from hookwire_server import ModelHost, ServerSettings, build_registry, demo_configs
from hookwire_server.models.tokenizers import prepare_tokenizer
from support import CACHE, ServerThread

GenerateRequest = model_service_pb2.GenerateRequest
CALL_TIMEOUT = 120
PROMPTS = [f"the cat {'is ' * i}on the data" for i in range(8)]


def _letters_lm(vocab_size: int = 60) -> ModelHost:
    """A GPT-2 whose tokenizer is a WordPiece over lowercase letters (no byte-level
    alphabet, as BERT-style and some SentencePiece vocabularies): "é" cannot be spelled."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<unk>": 0, "<eos>": 1}
    for c in letters:
        vocab[c] = len(vocab)
        vocab["##" + c] = len(vocab)
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        vocab[word if rng.random() < 0.5 else "##" + word] = len(vocab)
    backend = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    config = transformers.GPT2Config(vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2, n_positions=512,
                                     eos_token_id=1, bos_token_id=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config).eval()
    name = f"letters-{vocab_size}"
    return ModelHost(name, model, tokenizer=prepare_tokenizer(tokenizer, name))


@pytest.fixture(scope="module")
def srv() -> Iterator[ServerThread]:
    registry = build_registry([c for c in demo_configs() if c.name == "tiny-lm"])
    registry.add(_letters_lm())
    registry.add(_letters_lm(4000))
    server = ServerThread(registry, ServerSettings(port=0)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(srv: ServerThread) -> Iterator[model_service_pb2_grpc.ModelServiceStub]:
    channel = grpc.insecure_channel(srv.target, options=[("grpc.max_receive_message_length", 64 << 20)])
    yield model_service_pb2_grpc.ModelServiceStub(channel)
    channel.close()


def _on_loop(srv: ServerThread, coro: Any) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, srv._loop).result(CALL_TIMEOUT)


def test_a_cancel_while_the_next_step_waits_for_the_model_runs_no_more_passes(srv: ServerThread) -> None:
    """protocol §4b: cancelling "frees the model for others at once" and only "a step that
    is running completes". A step still waiting in the model's queue must not run."""
    host = srv.server.registry.get("tiny-lm")
    passes: list[float] = []
    handle = host.module.register_forward_pre_hook(lambda m, a: passes.append(time.monotonic()))

    gate = threading.Event()

    async def scenario() -> int:
        call = srv.server.generation.generate(GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=50))
        assert (await call.__anext__()).WhichOneof("kind") == "started"
        other = asyncio.ensure_future(host.run(gate.wait, 60))  # another call's pass holds the model
        await asyncio.sleep(0)  # it is queued first
        following = asyncio.ensure_future(call.__anext__())  # queues step 0 (the prefill) behind it
        await asyncio.sleep(0.1)
        following.cancel()  # the client goes away while step 0 waits
        with pytest.raises(asyncio.CancelledError):
            await following
        await call.aclose()
        cancelled_at = time.monotonic()
        gate.set()
        await other
        await host.run(lambda: None)  # after whatever was queued behind the other pass
        return sum(t > cancelled_at for t in passes)

    try:
        ran = _on_loop(srv, scenario())
    finally:
        handle.remove()
    assert ran == 0, f"{ran} forward pass(es) of the cancelled call ran after the cancel"


def test_a_failed_generate_frees_its_kv_cache(srv: ServerThread, stub) -> None:
    """A step that fails (here a request hook's rule, on_error FAIL_CALL) must not leave the
    call's KV cache (and the step's activations) alive: the exception's traceback holds
    Decoder.step's frames, and gRPC keeps the aborted call's exception chain."""
    host = srv.server.registry.get("tiny-lm")
    caches: list[weakref.ref] = []

    def watch(module: Any, args: Any, kwargs: Any) -> None:
        cache = kwargs.get(CACHE)
        if cache is not None:
            caches.append(weakref.ref(cache))

    handle = host.module.model.layers[0].register_forward_pre_hook(watch, with_kwargs=True)
    failing = hook_pb2.HookSpec(module="model.layers.0", on_error=rule_pb2.ON_ERROR_FAIL_CALL, posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", index="[:, 1]", zero=rule_pb2.ZeroOp())]))  # fits step 0, not step 1
    try:
        with pytest.raises(grpc.RpcError) as info:
            for _ in stub.Generate(GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=5, hooks=[failing]),
                                   timeout=CALL_TIMEOUT):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        handle.remove()
    time.sleep(0.5)
    srv.call(gc.collect)
    alive = {id(c()) for c in caches if c() is not None}
    assert not alive, f"{len(alive)} KV cache(s) of the failed call still alive after the call ended and gc"


def test_a_stop_string_the_vocabulary_cannot_spell_is_invalid_argument(stub) -> None:
    """Bad input must never be INTERNAL: transformers' StopStringCriteria raises ValueError
    for a stop string no token can spell; _stop_criteria lets it through."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(GenerateRequest(model="letters-60", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                               max_new_tokens=2, stop=["é"]), timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{info.value.code()}: {info.value.details()}"
    assert info.value.details().startswith("stop"), info.value.details()


def test_input_ids_over_the_limits_are_refused_before_they_are_decoded(srv: ServerThread, stub, monkeypatch) -> None:
    """max_prompt_tokens must bound the work done on a request: today input_ids are decoded
    (a copy, then widened to int64: 8x for int8 ids) on the event loop before their shape is
    compared with the limits. The shape is in the message: check it first."""
    decoded: list[list[int]] = []
    real = codec.decode_tensor

    def spy(msg: Any, **kwargs: Any) -> Any:
        decoded.append(list(msg.shape))
        return real(msg, **kwargs)

    monkeypatch.setattr(codec, "decode_tensor", spy)
    n = 5_000_000
    request = GenerateRequest(model="tiny-lm", max_new_tokens=2)
    request.input_ids.dtype = codec.wire_dtype_of(torch.int8)
    request.input_ids.shape.extend([1, n])
    request.input_ids.data = bytes(n)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(request, timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert [1, n] not in decoded, "the oversized input_ids were decoded before the limit refused them"


def test_stop_strings_at_the_limits_leave_no_table_behind(srv: ServerThread, stub) -> None:
    """Building the stop-string matcher costs the vocabulary size times the stop strings'
    characters (a Python loop on the model's tokenizer thread, stalling its Tokenize calls):
    their characters in all are bounded (max_stop_chars), and the [vocab, chars] table that
    transformers keeps in its process-wide cache (9 entries) is not left behind."""
    from transformers.generation import stopping_criteria

    stopping_criteria.STOP_STRING_EMBEDDING_CACHE.clear()
    limit = srv.server.settings.max_stop_chars
    at_limit = [chr(ord("a") + i) * (limit // 8) for i in range(8)]
    assert sum(map(len, at_limit)) == limit
    for _ in stub.Generate(GenerateRequest(model="letters-4000", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                           max_new_tokens=1, stop=at_limit), timeout=CALL_TIMEOUT):
        pass
    assert not stopping_criteria.STOP_STRING_EMBEDDING_CACHE, "a stop-string table was left in transformers' cache"
    over = at_limit[:-1] + [at_limit[-1] + "x"]
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(GenerateRequest(model="letters-4000", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                               max_new_tokens=1, stop=over), timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{limit + 1} characters in all, over the limit of {limit} (max_stop_chars)" in info.value.details()


def test_text_held_back_for_an_incomplete_character_does_not_grow_without_bound() -> None:
    """TextDeltas holds text back while it ends in U+FFFD and re-decodes everything from its
    prefix offset each step. A UTF-8 character is at most 4 bytes: text still ending in
    U+FFFD after that will never complete, yet the window keeps growing (quadratic decoding,
    now on the event loop: a generation steered onto a lone continuation byte, 256 prompts x
    500 steps on tiny-lm, took 131 s instead of 49 s with health checks up to 237 ms)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from hookwire_server.demo_models import tiny_lm_tokenizer
    from hookwire_server.calls.generation import TextDeltas

    tokenizer = tiny_lm_tokenizer()
    continuation = tokenizer.convert_tokens_to_ids(bytes_to_unicode()[0x80])
    windows: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            windows.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    deltas = TextDeltas()
    tokens: list[int] = []
    for _ in range(300):
        tokens.append(continuation)
        deltas.add(Counting(), tokens)
    assert max(windows) <= 8, f"decoded windows grew to {max(windows)} tokens (one decode per step)"


def test_a_failed_infer_frees_its_activations(srv: ServerThread, stub) -> None:
    """The same for Infer: a call whose request-scoped rule fails must not keep the
    tensors its pass made alive through the exception gRPC keeps."""
    host = srv.server.registry.get("tiny-lm")
    outputs: list[weakref.ref] = []
    handle = host.module.model.layers[0].register_forward_hook(
        lambda m, a, o: outputs.append(weakref.ref(o if isinstance(o, torch.Tensor) else o[0])))
    failing = hook_pb2.HookSpec(module="model.layers.1", posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", index="[:, 99]", zero=rule_pb2.ZeroOp())]))  # out of range
    try:
        with pytest.raises(grpc.RpcError) as info:
            stub.Infer(model_service_pb2.InferRequest(
                model="tiny-lm", args=[codec.encode_value(torch.tensor([[1, 5, 6]]))], hooks=[failing]),
                timeout=CALL_TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        handle.remove()
    srv.call(gc.collect)
    assert outputs and not [r for r in outputs if r() is not None], "the failed Infer's activations are still alive"
