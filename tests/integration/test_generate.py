"""Generate on the raw gRPC contract (hookwire.v1 stubs, no SDK): a real server on
loopback, and as the oracle in-process transformers ``generate()`` on the same seeded
models with real torch hooks cloning what they see (or making the same edits).
Everything a call running alone returns is compared bit for bit (torch.equal)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import random
import re
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import grpc
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models

from hookwire.wire import codec
from hookwire.v1 import (
    hook_pb2,
    hook_service_pb2,
    hook_service_pb2_grpc,
    model_service_pb2,
    model_service_pb2_grpc,
    rule_pb2,
)
from hookwire_server import ModelConfig, ModelHost, ServerSettings, build_registry, demo_configs
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.tokenizers import prepare_tokenizer
from support import CACHE, ServerThread, assert_same, bearer, slow_reader_channel, wait_for

MB = 1 << 20
GenerateRequest = model_service_pb2.GenerateRequest
#: A hang guard for each call, not a speed test.
CALL_TIMEOUT = 120
#: Prompts of different lengths (left padding), none of which makes tiny-lm emit <eos> early.
PROMPTS = ["Hello world, the model is a hook", "the cat", "it was the data"]
#: Prompts for the finish reasons: one ends on an EOS, one on a stop string, one on length.
FINISH_PROMPTS = ["the cat", "this is not", "one"]
FINISH_NEW_TOKENS = 6


def _capture(*parts: int, select: str = "") -> hook_pb2.HookAction:
    return hook_pb2.HookAction(capture=list(parts) or [hook_pb2.PART_OUTPUT], select=select)


def _steps(first: int, last: int | None = None) -> hook_pb2.StepRange:
    steps = hook_pb2.StepRange(first=first)
    if last is not None:
        steps.last = last
    return steps


# --------------------------------------------------------------------------- reading a Generate stream


@dataclasses.dataclass
class Event:
    """An event of a stream with its chunked tensors reassembled."""

    raw: hook_pb2.InterceptEvent
    chunked: dict[int, Any]

    def value(self, part: str = "output") -> Any:
        if part == "output":
            return codec.decode_value(self.raw.output, chunked=self.chunked)
        if part == "args":
            return tuple(codec.decode_value(v, chunked=self.chunked) for v in self.raw.args)
        if part == "kwargs":
            return {k: codec.decode_value(v, chunked=self.chunked) for k, v in self.raw.kwargs.items()}
        raise ValueError(part)


@dataclasses.dataclass
class Generated:
    """A whole Generate stream, checked for its framing while it was read."""

    started: model_service_pb2.GenerateStarted
    kinds: list[str]
    events: list[Event]
    tokens: list[model_service_pb2.GeneratedTokens]
    notices: list[hook_service_pb2.Notice]
    done: model_service_pb2.GenerateDone
    #: The step each event arrived in: how many GeneratedTokens had come before it.
    arrived_in: list[int]
    chunk_sizes: list[int]

    @property
    def token_ids(self) -> list[list[int]]:
        return [list(s.token_ids) for s in self.done.sequences]

    def captures(self, module: str) -> dict[int, Any]:
        """step -> the output a hook captured on ``module`` (one capture per step)."""
        out: dict[int, Any] = {}
        for e in self.events:
            if e.raw.module == module:
                assert e.raw.step not in out, f"two captures of {module} at step {e.raw.step}"
                out[e.raw.step] = e.value()
        return out


def read_stream(messages: Iterable[model_service_pb2.GenerateResponse]) -> Generated:
    """Reads a Generate stream to its end: started first, done last, the chunks of an
    event right after it (reassembled), nothing after done."""
    started = None
    done = None
    kinds: list[str] = []
    events: list[Event] = []
    tokens: list[model_service_pb2.GeneratedTokens] = []
    notices: list[hook_service_pb2.Notice] = []
    arrived_in: list[int] = []
    chunk_sizes: list[int] = []
    assembler: codec.ChunkAssembler | None = None
    for message in messages:
        kind = message.WhichOneof("kind")
        kinds.append(kind)
        assert done is None, f"{kind} after done"
        if assembler is not None and not assembler.done:
            assert kind == "chunk", f"{kind} before the chunks of the previous event were complete"
        if kind == "started":
            assert started is None and not kinds[:-1], "started must come first, once"
            started = message.started
            continue
        assert started is not None, f"{kind} before started"
        if kind == "event":
            assembler = codec.ChunkAssembler(message.event)
            events.append(Event(message.event, assembler.tensors))
            arrived_in.append(len(tokens))
        elif kind == "batch":  # small events sent together: exactly as if sent one by one
            assert len(message.batch.events) > 1
            for event in message.batch.events:
                assert codec.ChunkAssembler(event).done, "a batched event has chunked tensors"
                events.append(Event(event, {}))
                arrived_in.append(len(tokens))
        elif kind == "chunk":
            assert assembler is not None and not assembler.done, "a chunk without an event waiting for it"
            assembler.feed(message.chunk)
            chunk_sizes.append(message.ByteSize())
        elif kind == "tokens":
            assert message.tokens.step == len(tokens), "GeneratedTokens out of order"
            tokens.append(message.tokens)
        elif kind == "notice":
            notices.append(message.notice)
        elif kind == "done":
            done = message.done
    assert started is not None and done is not None, f"the stream ended without done: {kinds}"
    assert assembler is None or assembler.done
    return Generated(started, kinds, events, tokens, notices, done, arrived_in, chunk_sizes)


def generate(stub: model_service_pb2_grpc.ModelServiceStub, request: GenerateRequest) -> Generated:
    return read_stream(stub.Generate(request, timeout=CALL_TIMEOUT))


def expect_error(stub: model_service_pb2_grpc.ModelServiceStub, request: GenerateRequest,
                 metadata: Any = None) -> grpc.RpcError:
    """The status a call fails with, after whatever messages came before it."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(request, timeout=CALL_TIMEOUT, metadata=metadata):
            pass
    return info.value


# --------------------------------------------------------------------------- the oracle


def _clone(value: Any) -> Any:
    """A deep copy of what a hook sees; transformers' KV caches become None (as on the wire)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if codec.is_opaque_cache(value):
        return None
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_clone(v) for v in value)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


@dataclasses.dataclass
class Oracle:
    """What in-process generate() did: its new tokens and what the hooks saw at each step."""

    new_tokens: torch.Tensor
    #: (step, module) -> the module's output (cloned) in that step.
    outputs: dict[tuple[int, str], Any]
    #: (step, module) -> (args, kwargs) a with_kwargs pre hook saw.
    inputs: dict[tuple[int, str], Any]
    steps: int

    def captures(self, module: str) -> dict[int, Any]:
        return {step: v for (step, path), v in self.outputs.items() if path == module}


#: An in-process edit: (step, output) -> the new output, or None to leave it.
Edit = Callable[[int, torch.Tensor], Any]


def run_oracle(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, *,
    capture: Iterable[str] = (), capture_inputs: Iterable[str] = (), edits: dict[str, Edit] | None = None,
    seed: int | None = None, **settings: Any,
) -> Oracle:
    """generate() with real torch hooks: a root pre hook numbers the passes (steps), the
    edits run as forward hooks (before the captures on the same module), and the captures
    clone what they see."""
    step = [-1]
    outputs: dict[tuple[int, str], Any] = {}
    inputs: dict[tuple[int, str], Any] = {}

    def count(module: Any, args: Any) -> None:
        step[0] += 1

    handles = [model.register_forward_pre_hook(count)]
    for path, edit in (edits or {}).items():
        handles.append(model.get_submodule(path).register_forward_hook(lambda m, a, o, edit=edit: edit(step[0], o)))
    for path in capture:
        handles.append(model.get_submodule(path).register_forward_hook(
            lambda m, a, o, path=path: outputs.__setitem__((step[0], path), _clone(o))))
    for path in capture_inputs:
        handles.append(model.get_submodule(path).register_forward_pre_hook(
            lambda m, a, k, path=path: inputs.__setitem__((step[0], path), (_clone(a), _clone(k))), with_kwargs=True))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings)
    finally:
        for handle in handles:
            handle.remove()
    return Oracle(out[:, ids.shape[1]:], outputs, inputs, step[0] + 1)


def assert_captures_equal(got: dict[int, Any], want: dict[int, Any], where: str) -> None:
    assert sorted(got) == sorted(want), f"{where}: steps {sorted(got)} vs {sorted(want)}"
    for step in want:
        assert_same(got[step], want[step], f"{where} at step {step}")


def assert_tokens_match(result: Generated, oracle: Oracle, pad: int) -> None:
    """The stream's tokens are in-process generate()'s: each sequence's new tokens up to
    the one that ended it, then (as generate() pads) only pad tokens; GeneratedTokens
    carries -1 for a sequence that has ended."""
    want = oracle.new_tokens.tolist()
    assert len(result.tokens) == result.done.steps == oracle.steps == len(want[0])
    for i, (got, row) in enumerate(zip(result.token_ids, want)):
        assert got == row[:len(got)], f"sequence {i}: {got} vs in-process {row}"
        assert all(t == pad for t in row[len(got):]), f"sequence {i} ended at {len(got)} tokens, in-process went on: {row}"
        for step, message in enumerate(result.tokens):
            assert len(message.token_ids) == len(want) and len(message.texts) == len(want)
            assert message.token_ids[i] == (got[step] if step < len(got) else -1), f"step {step}, sequence {i}"


def assert_texts(result: Generated, tokenizer: Any) -> None:
    """Each sequence's text is decode(new tokens, skip_special_tokens=True), and the
    per-step deltas concatenate to it (a finished sequence's later deltas are "")."""
    for i, seq in enumerate(result.done.sequences):
        assert seq.text == tokenizer.decode(list(seq.token_ids), skip_special_tokens=True), f"sequence {i}"
        assert "".join(t.texts[i] for t in result.tokens) == seq.text, f"sequence {i}: deltas"
        assert all(t.texts[i] == "" for t in result.tokens[len(seq.token_ids):])


def batch_of(tokenizer: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the server makes of GenerateRequest.prompts: Tokenize's defaults, left padding."""
    batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    return batch["input_ids"], batch["attention_mask"]


# --------------------------------------------------------------------------- models and the server


def _no_pad_tokenizer() -> Any:
    """A GPT-2-like tokenizer over tiny-lm's vocabulary: BOS and EOS, no pad token."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_lm_tokenizer().backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
    )


def _gpt2(vocab: int) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=128,
                                     bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return transformers.GPT2LMHeadModel(config).eval()


def _eos_token_for_finish_prompts() -> int:
    """A token that greedy tiny-lm picks for FINISH_PROMPTS[0] at step 1 and for no other
    sequence (nor earlier): made the EOS token of "lm-eos", it ends that sequence alone."""
    tokenizer = tiny_lm_tokenizer()
    ids, mask = batch_of(tokenizer, FINISH_PROMPTS)
    rows = run_oracle(tiny_lm(), ids, mask, FINISH_NEW_TOKENS, do_sample=False).new_tokens.tolist()
    eos = rows[0][1]
    assert eos != rows[0][0] and all(eos not in row for row in rows[1:]), f"pick other FINISH_PROMPTS: {rows}"
    return eos


def _eos_lm(eos: int) -> torch.nn.Module:
    model = tiny_lm()
    model.generation_config.eos_token_id = eos
    return model


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
    backend = Tokenizer(tokenizer_models.WordPiece(vocab=vocab, unk_token="<unk>"))
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


@dataclasses.dataclass
class Env:
    srv: ServerThread
    models: model_service_pb2_grpc.ModelServiceStub
    hooks: hook_service_pb2_grpc.HookServiceStub
    channel: grpc.Channel
    lm: torch.nn.Module
    tokenizer: Any
    gpt: torch.nn.Module
    gpt_tokenizer: Any
    eos_lm: torch.nn.Module

    @property
    def tiny_lm_host(self) -> Any:
        return self.srv.server.registry.get("tiny-lm")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """One server for the module: tiny-lm and mlp (demo models), "gpt" (a GPT-2 from a
    local folder with its tokenizer), "gpt-notok" (the same without a tokenizer) and
    "lm-eos" (tiny-lm whose generation_config EOS is a token greedy decoding picks), and
    "letters-60", "letters-4000" (GPT-2s whose WordPiece vocabulary cannot spell "é")."""
    folder = tmp_path_factory.mktemp("generate")
    tokenizer = _no_pad_tokenizer()
    gpt = _gpt2(len(tokenizer))
    gpt.save_pretrained(str(folder / "gpt"))
    tokenizer.save_pretrained(str(folder / "gpt"))
    gpt.save_pretrained(str(folder / "gpt-notok"))
    eos = _eos_token_for_finish_prompts()
    registry = build_registry(
        [c for c in demo_configs() if c.name in ("tiny-lm", "mlp")]
        + [ModelConfig(name=name, transformers=str(folder / name)) for name in ("gpt", "gpt-notok")]
    )
    registry.add(ModelHost("lm-eos", _eos_lm(eos), tokenizer=prepare_tokenizer(tiny_lm_tokenizer(), "lm-eos")))
    registry.add(_letters_lm())
    registry.add(_letters_lm(4000))
    srv = ServerThread(registry).start()
    channel = grpc.insecure_channel(srv.target, options=[("grpc.max_receive_message_length", 64 * MB)])
    oracle_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder / "gpt"), local_files_only=True)
    oracle_tokenizer.pad_token = oracle_tokenizer.eos_token  # what the server does for a tokenizer without one
    yield Env(srv, model_service_pb2_grpc.ModelServiceStub(channel), hook_service_pb2_grpc.HookServiceStub(channel),
              channel, tiny_lm(), tiny_lm_tokenizer(), gpt, oracle_tokenizer, _eos_lm(eos))
    channel.close()
    srv.stop()


def _module_hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def still_works(env: Env) -> None:
    """A Generate after a failure runs and equals in-process greedy generate()."""
    ids, mask = batch_of(env.tokenizer, ["the cat"])
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=["the cat"], max_new_tokens=2))
    assert_tokens_match(result, run_oracle(env.lm, ids, mask, 2, do_sample=False), pad=0)


# --------------------------------------------------------------------------- greedy and sampling


def test_greedy_tokens_and_every_step_capture_equal_in_process_generate(env: Env) -> None:
    layers = ["model.layers.0", "model.layers.1"]
    request = GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=6, seed=5, do_sample=False,
                              hooks=[hook_pb2.HookSpec(module="model.layers.*", posthook=_capture())])
    result = generate(env.models, request)
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 6, capture=layers, do_sample=False)
    assert env.tokenizer.eos_token_id not in oracle.new_tokens  # every sequence runs to length

    started = result.started
    assert started.request_id and list(started.hook_ids) and len(started.hook_ids) == 1
    assert started.seed == 5 and started.do_sample is False
    assert_same(codec.decode_tensor(started.input_ids), ids, "started.input_ids")
    assert_same(codec.decode_tensor(started.attention_mask), mask, "started.attention_mask")
    assert (mask[1] == 0).any(), "the prompts have different lengths: left padding is exercised"

    assert_tokens_match(result, oracle, pad=0)
    assert_texts(result, env.tokenizer)
    assert [s.finish_reason for s in result.done.sequences] == ["length"] * 3
    # Every decoder layer at every step: [b, prompt_len, d] over the prompt, [b, 1, d] after.
    for layer in layers:
        got = result.captures(layer)
        assert_captures_equal(got, oracle.captures(layer), layer)
        assert got[0].shape == (3, ids.shape[1], 64) and all(got[s].shape == (3, 1, 64) for s in range(1, 6))
    # Events come as they fire: those of step s after GeneratedTokens(s - 1), before GeneratedTokens(s).
    assert result.arrived_in == [e.raw.step for e in result.events]
    assert [(e.raw.step, e.raw.module) for e in result.events] == [(s, m) for s in range(6) for m in layers]
    for seq, e in enumerate(result.events, start=1):
        assert e.raw.seq == seq and e.raw.call_index == 0 and e.raw.hook_id == started.hook_ids[0]
        assert e.raw.request_id == started.request_id and e.raw.model == "tiny-lm"
        assert e.raw.phase == hook_pb2.PHASE_FORWARD
    assert result.kinds[0] == "started" and result.kinds[-1] == "done"


def test_greedy_on_a_causal_lm_from_a_local_folder(env: Env) -> None:
    prompts = ["Hello world, the model", "hi"]
    request = GenerateRequest(model="gpt", prompts=prompts, max_new_tokens=5,
                              hooks=[hook_pb2.HookSpec(module="transformer.h.*", posthook=_capture())])
    result = generate(env.models, request)
    ids, mask = batch_of(env.gpt_tokenizer, prompts)
    assert_same(codec.decode_tensor(result.started.input_ids), ids, "started.input_ids")
    oracle = run_oracle(env.gpt, ids, mask, 5, capture=["transformer.h.0", "transformer.h.1"], do_sample=False,
                        pad_token_id=env.gpt_tokenizer.eos_token_id)
    assert_tokens_match(result, oracle, pad=env.gpt_tokenizer.eos_token_id)
    assert_texts(result, env.gpt_tokenizer)
    for layer in ("transformer.h.0", "transformer.h.1"):
        assert_captures_equal(result.captures(layer), oracle.captures(layer), layer)


def test_seeded_sampling_equals_manual_seed_then_generate(env: Env) -> None:
    settings = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9)
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=8, seed=1234,
                                                  **settings))
    assert result.started.seed == 1234 and result.started.do_sample is True
    sampled = run_oracle(env.lm, ids, mask, 8, seed=1234, **settings)
    assert_tokens_match(result, sampled, pad=0)
    greedy = run_oracle(env.lm, ids, mask, 8, do_sample=False)
    assert not torch.equal(sampled.new_tokens, greedy.new_tokens), "the settings must make sampling differ from greedy"
    # Another seed, another generation (the seed is used, not ignored).
    other = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=8, seed=99, **settings))
    assert_tokens_match(other, run_oracle(env.lm, ids, mask, 8, seed=99, **settings), pad=0)
    assert other.token_ids != result.token_ids

    # Unseeded: the call reports the seed it drew, and that seed reproduces it.
    unseeded = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=8, **settings))
    assert_tokens_match(unseeded, run_oracle(env.lm, ids, mask, 8, seed=unseeded.started.seed, **settings), pad=0)
    again = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=8,
                                                 seed=unseeded.started.seed, **settings))
    assert again.token_ids == unseeded.token_ids


# --------------------------------------------------------------------------- rules over steps


def _steering_vector() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randn(64, generator=g) * 4


def test_a_steering_vector_on_the_new_tokens_changes_what_the_in_process_edit_changes(env: Env) -> None:
    vector = _steering_vector()
    steer = hook_pb2.HookSpec(
        module="model.layers.0", steps=_steps(1),
        posthook=hook_pb2.HookAction(rules=[rule_pb2.Rule(
            target="output", add=rule_pb2.AddOp(value=rule_pb2.Operand(tensor=codec.encode_tensor(vector))))]),
    )
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=6, hooks=[steer, watch]))
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 6, capture=["model.layers.1"], do_sample=False,
                        edits={"model.layers.0": lambda step, out: out + vector if step >= 1 else None})
    assert_tokens_match(result, oracle, pad=0)
    got = result.captures("model.layers.1")
    assert_captures_equal(got, oracle.captures("model.layers.1"), "model.layers.1")
    # The rule left the prompt pass alone and changed the steps it covers.
    plain = run_oracle(env.lm, ids, mask, 6, capture=["model.layers.1"], do_sample=False)
    assert_same(got[0], plain.captures("model.layers.1")[0], "step 0 is not steered")
    assert not torch.equal(got[1], plain.captures("model.layers.1")[1])
    assert not torch.equal(oracle.new_tokens, plain.new_tokens), "the vector must be strong enough to change tokens"


def _zero_position_1(steps: hook_pb2.StepRange | None = None, on_error: int = 0) -> hook_pb2.HookSpec:
    spec = hook_pb2.HookSpec(module="model.layers.0", on_error=on_error, posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", index="[:, 1]", zero=rule_pb2.ZeroOp())]))
    if steps is not None:
        spec.steps.CopyFrom(steps)
    return spec


def _zero_position_1_at_step_0(step: int, out: torch.Tensor) -> Any:
    if step != 0:
        return None
    new = out.clone()
    new[:, 1] = 0
    return new


def test_a_prompt_position_rule_on_step_0_alone(env: Env) -> None:
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    request = GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=5,
                              hooks=[_zero_position_1(_steps(0, 0)), watch])
    result = generate(env.models, request)
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 5, capture=["model.layers.1"], do_sample=False,
                        edits={"model.layers.0": _zero_position_1_at_step_0})
    assert_tokens_match(result, oracle, pad=0)
    assert_captures_equal(result.captures("model.layers.1"), oracle.captures("model.layers.1"), "model.layers.1")
    plain = run_oracle(env.lm, ids, mask, 5, capture=["model.layers.1"], do_sample=False)
    assert not torch.equal(result.captures("model.layers.1")[0], plain.captures("model.layers.1")[0])
    assert not result.notices


def test_a_selection_out_of_range_at_a_later_step_fails_the_call(env: Env) -> None:
    # "[:, 1]" fits the prompt pass [b, L, d] but not step 1's [b, 1, d].
    request = GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=5,
                              hooks=[_zero_position_1(on_error=rule_pb2.ON_ERROR_FAIL_CALL)])
    seen: list[str] = []
    with pytest.raises(grpc.RpcError) as info:
        for message in env.models.Generate(request, timeout=CALL_TIMEOUT):
            seen.append(message.WhichOneof("kind"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "model.layers.0" in info.value.details() and "[:, 1]" in info.value.details(), info.value.details()
    assert seen == ["started", "tokens"], "step 0 ran (the selection fits the prompt), step 1 failed"
    wait_for(lambda: _module_hooks(env.tiny_lm_host.module) == 0, "the failed call's hooks are detached")
    still_works(env)


def test_a_selection_out_of_range_with_disable_hook_skips_and_notices(env: Env) -> None:
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    request = GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=5,
                              hooks=[_zero_position_1(on_error=rule_pb2.ON_ERROR_DISABLE_HOOK), watch])
    result = generate(env.models, request)
    [notice] = result.notices
    assert notice.kind == hook_service_pb2.NOTICE_KIND_HOOK_DISABLED
    assert notice.hook_id == result.started.hook_ids[0]
    # The notice comes in step 1, where the rule failed (after GeneratedTokens(0), before GeneratedTokens(1)).
    position = result.kinds.index("notice")
    assert result.kinds[:position].count("tokens") == 1
    # The failing firing changed nothing and the hook stayed off: the rule acted on step 0 alone.
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 5, capture=["model.layers.1"], do_sample=False,
                        edits={"model.layers.0": _zero_position_1_at_step_0})
    assert_tokens_match(result, oracle, pad=0)
    assert_captures_equal(result.captures("model.layers.1"), oracle.captures("model.layers.1"), "model.layers.1")
    assert [s.finish_reason for s in result.done.sequences] == ["length"] * 3


# --------------------------------------------------------------------------- slots across steps and calls


@pytest.fixture
def session(env: Env) -> Iterator[tuple[str, Any]]:
    """An open session (its id and its stream); the stream has a deadline: a hang guard."""
    stream = env.hooks.OpenSession(hook_service_pb2.OpenSessionRequest(), timeout=CALL_TIMEOUT)
    opened = next(stream)
    yield opened.opened.session_id, stream
    stream.cancel()


def _rule_hook(module: str, rule: rule_pb2.Rule, steps: hook_pb2.StepRange | None = None) -> hook_pb2.HookSpec:
    spec = hook_pb2.HookSpec(module=module, posthook=hook_pb2.HookAction(rules=[rule]))
    if steps is not None:
        spec.steps.CopyFrom(steps)
    return spec


def _slot(env: Env, session_id: str, name: str) -> torch.Tensor:
    slot = env.hooks.GetSlot(hook_service_pb2.GetSlotRequest(session_id=session_id, name=name), timeout=CALL_TIMEOUT)
    return codec.decode_tensor(slot.tensor)


def test_save_and_patch_across_steps_and_a_save_keeps_its_latest_firing(env: Env, session) -> None:
    session_id, _ = session
    save = _rule_hook("model.layers.0", rule_pb2.Rule(target="output", save=rule_pb2.SaveOp(slot="step1")), _steps(1, 1))
    patch = _rule_hook("model.layers.0", rule_pb2.Rule(target="output", patch=rule_pb2.PatchOp(slot="step1")), _steps(2))
    latest = _rule_hook("model.layers.1", rule_pb2.Rule(target="output", save=rule_pb2.SaveOp(slot="latest")))
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=6,
                                                  session_id=session_id, hooks=[save, patch, latest, watch]))
    saved: dict[str, torch.Tensor] = {}

    def edit(step: int, out: torch.Tensor) -> Any:
        if step == 1:
            saved["step1"] = out.clone()
        return saved["step1"] if step >= 2 else None

    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 6, capture=["model.layers.0", "model.layers.1"], do_sample=False,
                        edits={"model.layers.0": edit})
    assert_tokens_match(result, oracle, pad=0)
    assert_captures_equal(result.captures("model.layers.1"), oracle.captures("model.layers.1"), "model.layers.1")
    assert_same(_slot(env, session_id, "step1"), saved["step1"], "slot step1")
    # Saved at every step: the slot holds the last step's [b, 1, d] output.
    assert_same(_slot(env, session_id, "latest"), oracle.captures("model.layers.1")[oracle.steps - 1], "slot latest")


def test_patch_a_prompt_activation_saved_by_another_call(env: Env, session) -> None:
    session_id, _ = session
    clean, corrupt = ["the cat is on the data", "hello world"], ["the dog was in the text", "one model"]
    save = _rule_hook("model.layers.0", rule_pb2.Rule(target="output", index="[:, -1]",
                                                      save=rule_pb2.SaveOp(slot="clean_last")), _steps(0, 0))
    generate(env.models, GenerateRequest(model="tiny-lm", prompts=clean, max_new_tokens=2, session_id=session_id,
                                         hooks=[save]))
    patch = _rule_hook("model.layers.0", rule_pb2.Rule(target="output", index="[:, -1]",
                                                       patch=rule_pb2.PatchOp(slot="clean_last")), _steps(0, 0))
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=corrupt, max_new_tokens=5,
                                                  session_id=session_id, hooks=[patch, watch]))

    ids, mask = batch_of(env.tokenizer, clean)
    clean_last = run_oracle(env.lm, ids, mask, 2, capture=["model.layers.0"], do_sample=False
                            ).captures("model.layers.0")[0][:, -1]
    assert_same(_slot(env, session_id, "clean_last"), clean_last, "slot clean_last")

    def edit(step: int, out: torch.Tensor) -> Any:
        if step != 0:
            return None
        new = out.clone()
        new[:, -1] = clean_last
        return new

    ids, mask = batch_of(env.tokenizer, corrupt)
    oracle = run_oracle(env.lm, ids, mask, 5, capture=["model.layers.1"], do_sample=False, edits={"model.layers.0": edit})
    assert_tokens_match(result, oracle, pad=0)
    assert_captures_equal(result.captures("model.layers.1"), oracle.captures("model.layers.1"), "model.layers.1")
    plain = run_oracle(env.lm, ids, mask, 5, do_sample=False)
    assert not torch.equal(plain.new_tokens, oracle.new_tokens), "the patch must change the generation"


# --------------------------------------------------------------------------- several prompts, finish reasons


def _stop_string(rows: list[list[int]], tokenizer: Any) -> str:
    """A stop string for FINISH_PROMPTS[1]: the text of one of its tokens (step >= 1),
    found in no other sequence's text nor earlier in its own."""
    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in rows]
    for step in range(1, len(rows[1])):
        piece = tokenizer.decode([rows[1][step]])
        before = tokenizer.decode(rows[1][:step], skip_special_tokens=True)
        if (len(piece) >= 2 and piece.isascii() and piece.isprintable() and piece not in before
                and piece not in texts[0] and piece not in texts[2]):
            return piece
    raise AssertionError(f"pick other FINISH_PROMPTS: no usable stop string in {texts[1]!r}")


def test_each_sequence_finishes_on_its_own_eos_stop_or_length(env: Env) -> None:
    ids, mask = batch_of(env.tokenizer, FINISH_PROMPTS)
    plain = run_oracle(env.lm, ids, mask, FINISH_NEW_TOKENS, do_sample=False).new_tokens.tolist()
    stop = _stop_string(plain, env.tokenizer)
    watch = hook_pb2.HookSpec(module="model.layers.1", posthook=_capture())
    result = generate(env.models, GenerateRequest(model="lm-eos", prompts=FINISH_PROMPTS, max_new_tokens=FINISH_NEW_TOKENS,
                                                  stop=[stop, "never-generated"], hooks=[watch]))
    oracle = run_oracle(env.eos_lm, ids, mask, FINISH_NEW_TOKENS, capture=["model.layers.1"], do_sample=False,
                        stop_strings=[stop, "never-generated"], tokenizer=env.tokenizer)

    assert [s.finish_reason for s in result.done.sequences] == ["eos", "stop", "length"]
    assert_tokens_match(result, oracle, pad=0)
    eos, length = result.done.sequences[0], result.done.sequences[2]
    assert len(eos.token_ids) == 2 and eos.token_ids[-1] == env.eos_lm.generation_config.eos_token_id
    assert result.done.sequences[1].text.endswith(stop) and len(result.done.sequences[1].token_ids) < FINISH_NEW_TOKENS
    assert len(length.token_ids) == FINISH_NEW_TOKENS == result.done.steps
    assert_texts(result, env.tokenizer)
    # Finished sequences stay in the batch: every step's rows are [3, ...], as in-process.
    got = result.captures("model.layers.1")
    assert all(got[s].shape[0] == 3 for s in got)
    assert_captures_equal(got, oracle.captures("model.layers.1"), "model.layers.1")


def test_a_generation_ends_when_every_sequence_has_finished(env: Env) -> None:
    # Alone, the first prompt ends on the EOS at step 1: two steps, not max_new_tokens.
    result = generate(env.models, GenerateRequest(model="lm-eos", prompts=FINISH_PROMPTS[:1], max_new_tokens=8))
    ids, mask = batch_of(env.tokenizer, FINISH_PROMPTS[:1])
    oracle = run_oracle(env.eos_lm, ids, mask, 8, do_sample=False)
    assert result.done.steps == oracle.steps == 2 and len(result.tokens) == 2
    assert_tokens_match(result, oracle, pad=0)
    assert result.done.sequences[0].finish_reason == "eos"


def test_ignore_eos_runs_past_the_eos_token_and_min_new_tokens_masks_it(env: Env) -> None:
    ids, mask = batch_of(env.tokenizer, FINISH_PROMPTS[:1])
    # ignore_eos: lm-eos's EOS at step 1 is a token like any other; the sequence runs to
    # max_new_tokens as the same weights without that EOS (tiny-lm) decode it.
    plain = run_oracle(env.lm, ids, mask, 8, do_sample=False).new_tokens[0].tolist()
    assert len(plain) == 8 and env.eos_lm.generation_config.eos_token_id in plain
    result = generate(env.models, GenerateRequest(model="lm-eos", prompts=FINISH_PROMPTS[:1], max_new_tokens=8,
                                                  ignore_eos=True))
    assert [s.finish_reason for s in result.done.sequences] == ["length"] and result.done.steps == 8
    assert list(result.done.sequences[0].token_ids) == plain
    # min_new_tokens: the EOS logits are masked until then, as in-process generate(min_new_tokens=...).
    result = generate(env.models, GenerateRequest(model="lm-eos", prompts=FINISH_PROMPTS[:1], max_new_tokens=8,
                                                  min_new_tokens=4))
    oracle = run_oracle(env.eos_lm, ids, mask, 8, do_sample=False, min_new_tokens=4)
    assert_tokens_match(result, oracle, pad=0)
    assert len(result.done.sequences[0].token_ids) >= 4


def test_no_stop_string_ends_a_sequence_before_min_new_tokens(env: Env) -> None:
    ids, mask = batch_of(env.tokenizer, FINISH_PROMPTS)
    plain = run_oracle(env.lm, ids, mask, FINISH_NEW_TOKENS, do_sample=False).new_tokens.tolist()
    stop = _stop_string(plain, env.tokenizer)
    one = batch_of(env.tokenizer, FINISH_PROMPTS[1:2])
    alone = run_oracle(env.eos_lm, *one, FINISH_NEW_TOKENS, do_sample=False).new_tokens[0].tolist()
    request = GenerateRequest(model="lm-eos", prompts=FINISH_PROMPTS[1:2], max_new_tokens=FINISH_NEW_TOKENS, stop=[stop])
    stopped = generate(env.models, request)
    assert stopped.done.sequences[0].finish_reason == "stop"
    short = len(stopped.done.sequences[0].token_ids)
    assert short < FINISH_NEW_TOKENS
    request.min_new_tokens = FINISH_NEW_TOKENS
    result = generate(env.models, request)
    # The stop string completed at token `short` does not end it: it goes on to min_new_tokens.
    assert list(result.done.sequences[0].token_ids) == alone and len(alone) == FINISH_NEW_TOKENS
    # Its last token ends it by length, or by the stop string if its text ends with one there.
    ends = env.tokenizer.decode(alone, skip_special_tokens=True).endswith(stop)
    assert result.done.sequences[0].finish_reason == ("stop" if ends else "length")


def test_min_new_tokens_past_max_new_tokens_is_refused(env: Env) -> None:
    error = expect_error(env.models, GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2, min_new_tokens=3))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_new_tokens" in error.details()


def test_input_ids_with_a_mask_and_no_tokenizer(env: Env) -> None:
    """A model without a tokenizer generates from input_ids: texts are empty."""
    ids, mask = batch_of(env.gpt_tokenizer, ["the cat", "hello world, the"])
    request = GenerateRequest(model="gpt-notok", input_ids=codec.encode_tensor(ids),
                              attention_mask=codec.encode_tensor(mask), max_new_tokens=4)
    result = generate(env.models, request)
    oracle = run_oracle(env.gpt, ids, mask, 4, do_sample=False, pad_token_id=env.gpt_tokenizer.eos_token_id)
    assert_tokens_match(result, oracle, pad=env.gpt_tokenizer.eos_token_id)
    assert all(s.text == "" for s in result.done.sequences)
    assert all(t == "" for message in result.tokens for t in message.texts)
    assert_same(codec.decode_tensor(result.started.attention_mask), mask, "started.attention_mask")


# --------------------------------------------------------------------------- large captures arrive in chunks


def test_large_step_0_captures_arrive_as_chunks_below_the_message_limit(env: Env) -> None:
    # 16 prompts of up to 301 tokens: the MLP's up_proj output at step 0 is [16, 301, 128]
    # float32 (2.4 MB), each decoder layer's [16, 301, 64].
    prompts = [" the" * (300 - 10 * i) for i in range(16)]
    limit = MB  # the smallest the server accepts; the client channel refuses anything larger
    channel = grpc.insecure_channel(env.srv.target, options=[("grpc.max_receive_message_length", limit)])
    try:
        hooks = [hook_pb2.HookSpec(module="model.layers.*.mlp.up_proj", posthook=_capture(), steps=_steps(0, 0)),
                 hook_pb2.HookSpec(module="model.layers.*", posthook=_capture())]
        request = GenerateRequest(model="tiny-lm", prompts=prompts, max_new_tokens=3, hooks=hooks,
                                  max_response_message_bytes=limit)
        result = read_stream(model_service_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=CALL_TIMEOUT))
    finally:
        channel.close()
    ids, mask = batch_of(env.tokenizer, prompts)
    modules = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj", "model.layers.0", "model.layers.1"]
    oracle = run_oracle(env.lm, ids, mask, 3, capture=modules, do_sample=False)
    up = result.captures("model.layers.0.mlp.up_proj")
    assert list(up) == [0] and up[0].numel() * 4 > 2 * limit, "the capture needs several chunks"
    assert len(result.chunk_sizes) >= 2 * 3 and max(result.chunk_sizes) < limit
    for module in modules:
        want = oracle.captures(module)
        if module.endswith("up_proj"):
            want = {0: want[0]}
        assert_captures_equal(result.captures(module), want, module)
    assert_tokens_match(result, oracle, pad=0)


# --------------------------------------------------------------------------- session streams, tags, caches


def _read_session_call(stream: Any, request_id: str) -> list[Event]:
    """A session stream's events up to the CallEnded naming ``request_id``; every event
    must belong to that call (the stream carries nothing else in these tests)."""
    events: list[Event] = []
    assembler: codec.ChunkAssembler | None = None
    for message in stream:
        kind = message.WhichOneof("kind")
        batch = list(message.batch.events) if kind == "batch" else [message.event] if kind == "event" else []
        for event in batch:
            assembler = codec.ChunkAssembler(event)
            events.append(Event(event, assembler.tensors))
        if kind == "chunk":
            assert assembler is not None
            assembler.feed(message.chunk)
        elif kind == "call_ended":
            assert message.call_ended.request_id == request_id, "a CallEnded of another call"
            assert assembler is None or assembler.done
            assert all(e.raw.request_id == request_id for e in events), [e.raw.request_id for e in events]
            return events
        elif kind == "notice":
            pytest.fail(f"unexpected notice: {message.notice}")
    pytest.fail("the session stream ended before CallEnded")


def test_session_hooks_fire_on_generate_and_infer_and_each_call_ends_with_a_marker(env: Env, session) -> None:
    session_id, stream = session
    env.hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="tiny-lm", module="model.layers.1", posthook=_capture())), timeout=CALL_TIMEOUT)
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=4,
                                                  session_id=session_id))
    assert not result.events  # session hooks deliver on their session stream, not in the call
    events = _read_session_call(stream, result.started.request_id)
    assert [e.raw.step for e in events] == [0, 1, 2, 3] and [e.raw.seq for e in events] == [1, 2, 3, 4]
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 4, capture=["model.layers.1"], do_sample=False)
    assert_captures_equal({e.raw.step: e.value() for e in events}, oracle.captures("model.layers.1"), "session events")
    assert_tokens_match(result, oracle, pad=0)

    # An Infer call is one pass, step 0, and ends with its own marker too.
    infer = env.models.Infer(model_service_pb2.InferRequest(
        model="tiny-lm", args=[codec.encode_value(ids)], kwargs={"attention_mask": codec.encode_value(mask)},
        session_id=session_id), timeout=CALL_TIMEOUT)
    [event] = _read_session_call(stream, infer.request_id)
    assert event.raw.step == 0 and event.raw.seq == 5
    seen: list[torch.Tensor] = []
    handle = env.lm.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    try:
        with torch.no_grad():
            env.lm(ids, attention_mask=mask)
    finally:
        handle.remove()
    assert_same(event.value(), seen[0], "the Infer call's session event")


def test_a_call_made_in_a_session_ends_with_a_marker_even_without_events(env: Env, session) -> None:
    """A reader waiting for a call of its session must not wait forever when none of
    the session's hooks captured anything from it (here: a steps range it never reaches)."""
    session_id, stream = session
    env.hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="tiny-lm", module="model.layers.1", posthook=_capture(), steps=_steps(100))), timeout=CALL_TIMEOUT)
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=2,
                                                  session_id=session_id))
    assert _read_session_call(stream, result.started.request_id) == []
    infer = env.models.Infer(model_service_pb2.InferRequest(
        model="tiny-lm", args=[codec.encode_value(torch.tensor([[1, 5, 6]]))], session_id=session_id),
        timeout=CALL_TIMEOUT)
    assert _read_session_call(stream, infer.request_id) == []


def test_tagged_hooks_fire_for_tagged_generate_calls_only(env: Env, session) -> None:
    session_id, stream = session
    env.hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="tiny-lm", module="model.layers.0", posthook=_capture(), scope=hook_pb2.SCOPE_TAGGED,
        tags=["probe"])), timeout=CALL_TIMEOUT)
    untagged = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=3, tags=["other"]))
    tagged = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=3,
                                                  tags=["x", "probe"]))
    assert untagged.started.request_id != tagged.started.request_id
    # The untagged call put nothing on the stream: the first marker and events are the tagged call's.
    events = _read_session_call(stream, tagged.started.request_id)
    assert [e.raw.step for e in events] == [0, 1, 2]
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 3, capture=["model.layers.0"], do_sample=False)
    assert_captures_equal({e.raw.step: e.value() for e in events}, oracle.captures("model.layers.0"), "tagged events")


def test_scope_all_hooks_fire_for_everyones_generate_calls(env: Env, session) -> None:
    session_id, stream = session
    env.hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
        model="tiny-lm", module="model.layers.1", posthook=_capture(), scope=hook_pb2.SCOPE_ALL)), timeout=CALL_TIMEOUT)
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=3))  # no session
    events = _read_session_call(stream, result.started.request_id)
    assert [e.raw.step for e in events] == [0, 1, 2]
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 3, capture=["model.layers.1"], do_sample=False)
    assert_captures_equal({e.raw.step: e.value() for e in events}, oracle.captures("model.layers.1"), "scope all events")


def test_a_kv_cache_in_kwargs_and_outputs_is_null_with_a_marker(env: Env) -> None:
    hooks = [hook_pb2.HookSpec(module="model.layers.0", prehook=_capture(hook_pb2.PART_ARGS, hook_pb2.PART_KWARGS),
                               prehook_kwargs=hook_pb2.PreHookOptions(with_kwargs=True)),
             hook_pb2.HookSpec(module="", posthook=_capture())]
    result = generate(env.models, GenerateRequest(model="tiny-lm", prompts=PROMPTS, max_new_tokens=3, hooks=hooks))
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    oracle = run_oracle(env.lm, ids, mask, 3, capture=[""], capture_inputs=["model.layers.0"], do_sample=False)
    layer_events = [e for e in result.events if e.raw.module == "model.layers.0"]
    root_events = [e for e in result.events if e.raw.module == ""]
    assert [e.raw.step for e in layer_events] == [e.raw.step for e in root_events] == [0, 1, 2]
    for e in layer_events:
        marker = e.raw.kwargs[CACHE]
        assert marker.WhichOneof("kind") == "null_value" and marker.opaque_type == "DynamicCache"
        assert all(v.opaque_type == "" for k, v in e.raw.kwargs.items() if k != CACHE)
        args, kwargs = oracle.inputs[(e.raw.step, "model.layers.0")]
        assert_same(e.value("args"), args, f"args at step {e.raw.step}")
        got = e.value("kwargs")  # a protobuf map: its order is not the call's
        assert sorted(got) == sorted(kwargs)
        assert_same({k: got[k] for k in kwargs}, kwargs, f"kwargs at step {e.raw.step}")
    for e in root_events:
        marker = e.raw.output.map.entries[CACHE]
        assert marker.WhichOneof("kind") == "null_value" and marker.opaque_type == "DynamicCache"
        assert_same(e.value()["logits"], oracle.outputs[(e.raw.step, "")]["logits"], f"logits at step {e.raw.step}")
    assert_tokens_match(result, oracle, pad=0)


# --------------------------------------------------------------------------- other calls, cancellation


#: Captures of every module's inputs and outputs: ~1 MB over 16 steps of 3 prompts of 10
#: tokens, far more than a flow-control window, so a call nobody reads waits.
EVERYTHING = hook_pb2.HookSpec(module="**", posthook=_capture(), prehook=_capture(hook_pb2.PART_ARGS))
#: Prompts and a capture whose per-step events (lm_head's [8, 1, vocab] logits, 11 KB a
#: step, far more over a call than a flow-control window holds) stall a call nobody reads.
HEAVY_PROMPTS = [f"the cat {'is ' * i}on the data" for i in range(8)]
HEAVY_HOOK = hook_pb2.HookSpec(module="lm_head", posthook=_capture())


def test_infer_runs_while_a_generate_waits_for_its_reader(env: Env) -> None:
    channel = slow_reader_channel(env.srv.target, aio=False)
    try:
        request = GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=64, hooks=[HEAVY_HOOK])
        stream = model_service_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=CALL_TIMEOUT)
        first = next(stream)
        assert first.WhichOneof("kind") == "started"
        ids, mask = batch_of(env.tokenizer, ["the cat", "hello world"])
        out = env.models.Infer(model_service_pb2.InferRequest(
            model="tiny-lm", args=[codec.encode_value(ids)], kwargs={"attention_mask": codec.encode_value(mask)}),
            timeout=CALL_TIMEOUT)
        with torch.no_grad():
            want = env.lm(ids, attention_mask=mask).logits
        assert_same(codec.decode_value(out.output)["logits"], want, "Infer's logits")
        # The generation could not have finished: it waits for its reader.
        assert env.srv.call(lambda: env.srv.server.generation._active.get("tiny-lm", 0)) == 1
        result = read_stream(_chain([first], stream))
    finally:
        channel.close()
    hids, hmask = batch_of(env.tokenizer, HEAVY_PROMPTS)
    oracle = run_oracle(env.lm, hids, hmask, 64, capture=["lm_head"], do_sample=False)
    assert_tokens_match(result, oracle, pad=0)
    assert_captures_equal(result.captures("lm_head"), oracle.captures("lm_head"), "lm_head")


def _chain(*parts: Iterable[Any]) -> Iterator[Any]:
    for part in parts:
        yield from part


def test_cancelling_a_generate_frees_the_model_and_removes_its_hooks(env: Env) -> None:
    host = env.tiny_lm_host
    wait_for(lambda: _module_hooks(host.module) == 0, "earlier tests' hooks are gone")
    channel = slow_reader_channel(env.srv.target, aio=False)
    steer = hook_pb2.HookSpec(module="model.layers.0", posthook=hook_pb2.HookAction(rules=[rule_pb2.Rule(
        target="output", add=rule_pb2.AddOp(value=rule_pb2.Operand(tensor=codec.encode_tensor(_steering_vector())))),
    ]))
    try:
        request = GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=200, hooks=[steer, HEAVY_HOOK])
        stream = model_service_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=CALL_TIMEOUT)
        kinds = [next(stream).WhichOneof("kind") for _ in range(4)]
        assert kinds == ["started", "event", "tokens", "event"]
        assert _module_hooks(host.module) == 2  # the steering rule and the capture, attached
        stream.cancel()
    finally:
        channel.close()
    wait_for(lambda: env.srv.call(lambda: env.srv.server.generation._active.get("tiny-lm", 0)) == 0,
             "the cancelled call ends")
    wait_for(lambda: _module_hooks(host.module) == 0, "the cancelled call's torch hooks are removed")
    # The model is free, and nothing of the cancelled call (its steering) is left in it.
    still_works(env)
    ids, mask = batch_of(env.tokenizer, PROMPTS)
    out = env.models.Infer(model_service_pb2.InferRequest(
        model="tiny-lm", args=[codec.encode_value(ids)], kwargs={"attention_mask": codec.encode_value(mask)}),
        timeout=CALL_TIMEOUT)
    with torch.no_grad():
        want = env.lm(ids, attention_mask=mask).logits
    assert_same(codec.decode_value(out.output)["logits"], want, "Infer's logits after the cancel")


# --------------------------------------------------------------------------- shutdown


def test_a_server_stop_ends_a_running_generation_with_shutdown() -> None:
    srv = ServerThread(build_registry([c for c in demo_configs() if c.name == "tiny-lm"])).start()
    stopping: threading.Thread | None = None
    channel = slow_reader_channel(srv.target, aio=False)
    try:
        request = GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=400, hooks=[HEAVY_HOOK])
        stream = model_service_pb2_grpc.ModelServiceStub(channel).Generate(request, timeout=CALL_TIMEOUT)
        head = []
        while sum(m.WhichOneof("kind") == "tokens" for m in head) < 3:
            head.append(next(stream))
        # The call cannot finish while nobody reads: stop the server now, then read on.
        stopping = threading.Thread(target=srv.stop, kwargs={"grace": 60.0})
        stopping.start()
        result = read_stream(_chain(head, stream))
    finally:
        if stopping is None:
            srv.stop()
        channel.close()
    stopping.join(90)
    assert not stopping.is_alive(), "the server did not stop within its grace period"
    assert 3 <= result.done.steps < 400
    tokenizer = tiny_lm_tokenizer()
    ids, mask = batch_of(tokenizer, HEAVY_PROMPTS)
    oracle = run_oracle(tiny_lm(), ids, mask, result.done.steps, do_sample=False)
    assert_tokens_match(result, oracle, pad=0)  # every step up to the stop ran as in-process
    # The sequences still running at the stop end with "shutdown" (one that met its EOS before, with "eos").
    ended = ["eos" if tokenizer.eos_token_id in row else "shutdown" for row in oracle.new_tokens.tolist()]
    assert ended.count("shutdown") >= len(HEAVY_PROMPTS) // 2
    assert [s.finish_reason for s in result.done.sequences] == ended


# --------------------------------------------------------------------------- bad input


def _ids(*rows: list[int], dtype: torch.dtype = torch.int64) -> Any:
    return codec.encode_tensor(torch.tensor(rows, dtype=dtype))


def _hook_with(**fields: Any) -> hook_pb2.HookSpec:
    return hook_pb2.HookSpec(**{"module": "model.layers.0", "posthook": _capture(), **fields})


def _bad_requests() -> list[tuple[str, GenerateRequest, grpc.StatusCode, str]]:
    ok = dict(model="tiny-lm", max_new_tokens=2)
    INVALID, FAILED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    bad_bytes = _ids([1, 2, 3])
    bad_bytes.data = bad_bytes.data[:-1]
    return [
        ("prompts without a tokenizer", GenerateRequest(model="gpt-notok", prompts=["hi"], max_new_tokens=2),
         FAILED, r"gpt-notok.*input_ids"),
        ("stop strings without a tokenizer", GenerateRequest(model="gpt-notok", input_ids=_ids([1, 5]), stop=["x"],
                                                             max_new_tokens=2), FAILED, r"^stop: .*input_ids"),
        ("max_new_tokens 0", GenerateRequest(model="tiny-lm", prompts=["hi"]), INVALID, r"^max_new_tokens"),
        ("max_new_tokens over the limit", GenerateRequest(model="tiny-lm", prompts=["hi"], max_new_tokens=4097),
         INVALID, r"^max_new_tokens: 4097 .*limit of 4096 \(max_new_tokens\)"),
        ("a model that cannot generate", GenerateRequest(model="mlp", prompts=["hi"], max_new_tokens=2),
         grpc.StatusCode.UNIMPLEMENTED, r"'mlp' cannot generate"),
        ("an unknown model", GenerateRequest(model="nope", prompts=["hi"], max_new_tokens=2),
         grpc.StatusCode.NOT_FOUND, "nope"),
        ("an empty prompt", GenerateRequest(prompts=["hi", ""], **ok), INVALID, r"^prompts\[1\]: .*empty"),
        ("prompts and input_ids", GenerateRequest(prompts=["hi"], input_ids=_ids([1, 5]), **ok), INVALID,
         r"^prompts and input_ids"),
        ("no prompt", GenerateRequest(**ok), INVALID, r"^prompts: .*input_ids"),
        ("attention_mask with prompts", GenerateRequest(prompts=["hi"], attention_mask=_ids([1, 1]), **ok), INVALID,
         r"^attention_mask"),
        ("a StepRange with last < first", GenerateRequest(prompts=["hi"], hooks=[_hook_with(steps=_steps(3, 2))], **ok),
         INVALID, r"^hooks\[0\]: steps: last \(2\) is before first \(3\)"),
        ("attention_mask of another shape", GenerateRequest(input_ids=_ids([1, 5, 6]), attention_mask=_ids([1, 1]), **ok),
         INVALID, r"^attention_mask: shape \[1, 2\]"),
        ("attention_mask values", GenerateRequest(input_ids=_ids([1, 5]), attention_mask=_ids([1, 2]), **ok), INVALID,
         r"^attention_mask: values"),
        ("attention_mask of a row without tokens", GenerateRequest(input_ids=_ids([1, 5], [1, 6]),
                                                                   attention_mask=_ids([1, 1], [0, 0]), **ok),
         INVALID, r"^attention_mask: sequence 1"),
        ("a right-padded attention_mask", GenerateRequest(input_ids=_ids([1, 5, 6], [1, 6, 0]),
                                                          attention_mask=_ids([1, 1, 1], [1, 1, 0]), **ok),
         INVALID, r"^attention_mask: sequence 1 has padding \(0\) after a token \(1\).*padded on the left"),
        ("float input_ids", GenerateRequest(input_ids=_ids([1.0, 5.0], dtype=torch.float32), **ok), INVALID,
         r"^input_ids: integer"),
        ("1-D input_ids", GenerateRequest(input_ids=codec.encode_tensor(torch.tensor([1, 5])), **ok), INVALID,
         r"^input_ids: expected .*\[batch, seq\]"),
        ("empty input_ids", GenerateRequest(input_ids=codec.encode_tensor(torch.zeros(1, 0, dtype=torch.int64)), **ok),
         INVALID, r"^input_ids: expected a non-empty"),
        ("input_ids whose bytes do not match", GenerateRequest(input_ids=bad_bytes, **ok), INVALID, r"input_ids"),
        ("a token id past the vocabulary", GenerateRequest(input_ids=_ids([1, 357]), **ok), INVALID,
         r"^input_ids: token id 357 is outside .*\[0, 357\)"),
        ("a negative token id", GenerateRequest(input_ids=_ids([-1, 5]), **ok), INVALID, r"^input_ids: token id -1"),
        ("temperature 0", GenerateRequest(prompts=["hi"], temperature=0, **ok), INVALID, r"^temperature"),
        ("negative temperature", GenerateRequest(prompts=["hi"], temperature=-1, **ok), INVALID, r"^temperature"),
        ("nan temperature", GenerateRequest(prompts=["hi"], temperature=math.nan, **ok), INVALID, r"^temperature"),
        ("infinite temperature", GenerateRequest(prompts=["hi"], temperature=math.inf, **ok), INVALID, r"^temperature"),
        ("top_p 0", GenerateRequest(prompts=["hi"], top_p=0, **ok), INVALID, r"^top_p"),
        ("top_p over 1", GenerateRequest(prompts=["hi"], top_p=1.5, **ok), INVALID, r"^top_p"),
        ("nan top_p", GenerateRequest(prompts=["hi"], top_p=math.nan, **ok), INVALID, r"^top_p"),
        ("an empty stop string", GenerateRequest(prompts=["hi"], stop=["a", ""], **ok), INVALID, r"^stop\[1\]: .*empty"),
        ("too many stop strings", GenerateRequest(prompts=["hi"], stop=[str(i) for i in range(17)], **ok), INVALID,
         r"^stop: .*\(max_stop_strings\)"),
        ("a too long stop string", GenerateRequest(prompts=["hi"], stop=["x" * 257], **ok), INVALID,
         r"^stop: 257 bytes.*\(max_name_length\)"),
        ("a too small max_response_message_bytes", GenerateRequest(prompts=["hi"], max_response_message_bytes=1000, **ok),
         INVALID, r"^max_response_message_bytes"),
        ("an unknown session", GenerateRequest(prompts=["hi"], session_id="nope", **ok), grpc.StatusCode.NOT_FOUND,
         "nope"),
        ("a hook on another model", GenerateRequest(prompts=["hi"], hooks=[_hook_with(model="mlp")], **ok), INVALID,
         r"^hooks\[0\]\.model"),
        ("a hook on no module", GenerateRequest(prompts=["hi"], hooks=[_hook_with(module="nope")], **ok),
         grpc.StatusCode.NOT_FOUND, r"^hooks\[0\]: .*nope"),
        ("a save rule without a session", GenerateRequest(prompts=["hi"], hooks=[_rule_hook(
            "model.layers.0", rule_pb2.Rule(target="output", save=rule_pb2.SaveOp(slot="s")))], **ok), INVALID,
         r"^hooks\[0\]: .*session_id"),
        ("prompt and new tokens past the model's positions", GenerateRequest(prompts=["hi"], model="tiny-lm",
                                                                             max_new_tokens=600),
         INVALID, r"^max_new_tokens: the prompt's 3 tokens and 600 new tokens pass the 512 positions"),
        ("a temperature that leaves nothing to sample", GenerateRequest(prompts=["hi"], do_sample=True,
                                                                        temperature=1e-300, **ok),
         INVALID, r"^sampling failed at step 0: .*temperature"),
        ("too many request hooks", GenerateRequest(prompts=["hi"], hooks=[_hook_with()] * 65, **ok),
         grpc.StatusCode.RESOURCE_EXHAUSTED, r"\(max_request_hooks\)"),
    ]


BAD = _bad_requests()


@pytest.mark.parametrize("name,request_,code,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_field(env: Env, name, request_, code, pattern) -> None:
    error = expect_error(env.models, request_)
    assert error.code() == code, f"{name}: {error.code()}: {error.details()}"
    assert re.search(pattern, error.details()), f"{name}: {error.details()!r} does not match {pattern!r}"
    still_works(env)


@pytest.fixture(scope="module")
def small_limits() -> Iterator[tuple[ServerThread, model_service_pb2_grpc.ModelServiceStub]]:
    """A server with small limits on prompts, new tokens and running generations."""
    settings = ServerSettings(port=0, max_new_tokens=16, max_tokenize_texts=3, max_tokenize_chars=100,
                              max_prompt_tokens=10, max_active_generations=1)
    srv = ServerThread(build_registry([c for c in demo_configs() if c.name == "tiny-lm"]), settings).start()
    channel = grpc.insecure_channel(srv.target)
    yield srv, model_service_pb2_grpc.ModelServiceStub(channel)
    channel.close()
    srv.stop()


EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
LIMITED = [
    ("too many prompts", GenerateRequest(prompts=["a"] * 4), EXHAUSTED, r"^prompts: .*\(max_tokenize_texts\)"),
    ("a too long prompt", GenerateRequest(prompts=["a", "a" * 10]), EXHAUSTED,
     r"^prompts\[1\]: 11 tokens.*\(max_prompt_tokens\)"),
    ("too many characters", GenerateRequest(prompts=["a" * 50, "b" * 51]), EXHAUSTED,
     r"^prompts: 101 characters.*\(max_tokenize_chars\)"),
    ("too many input_ids rows", GenerateRequest(input_ids=_ids(*[[1, 5]] * 4)), EXHAUSTED,
     r"^input_ids: 4 sequences.*\(max_tokenize_texts\)"),
    ("too long input_ids", GenerateRequest(input_ids=_ids([1] * 11)), EXHAUSTED,
     r"^input_ids: 11 tokens.*\(max_prompt_tokens\)"),
    ("max_new_tokens over the limit", GenerateRequest(prompts=["a"], max_new_tokens=17), grpc.StatusCode.INVALID_ARGUMENT,
     r"^max_new_tokens: 17 .*limit of 16 \(max_new_tokens\)"),
]


@pytest.mark.parametrize("name,request_,code,pattern", LIMITED, ids=[c[0] for c in LIMITED])
def test_limits_on_prompts_and_new_tokens(small_limits, name, request_, code, pattern) -> None:
    srv, stub = small_limits
    request = GenerateRequest()
    request.CopyFrom(request_)
    request.model = "tiny-lm"
    request.max_new_tokens = request.max_new_tokens or 2
    error = expect_error(stub, request)
    assert error.code() == code, f"{name}: {error.code()}: {error.details()}"
    assert re.search(pattern, error.details()), f"{name}: {error.details()!r} does not match {pattern!r}"
    # At the limits, the call runs.
    ok = read_stream(stub.Generate(GenerateRequest(model="tiny-lm", prompts=["a" * 9] * 3, max_new_tokens=16),
                                   timeout=CALL_TIMEOUT))
    assert ok.done.steps == 16 and ok.started.input_ids.shape == [3, 10]


def test_max_active_generations_counts_a_call_that_waits_for_its_reader(small_limits) -> None:
    srv, stub = small_limits
    slow = slow_reader_channel(srv.target, aio=False)
    try:
        waiting = model_service_pb2_grpc.ModelServiceStub(slow).Generate(
            GenerateRequest(model="tiny-lm", prompts=["a" * 9] * 3, max_new_tokens=16,
                            hooks=[EVERYTHING]),
            timeout=CALL_TIMEOUT)
        assert next(waiting).WhichOneof("kind") == "started"
        error = expect_error(stub, GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2))
        assert error.code() == EXHAUSTED, error.details()
        assert "(max_active_generations)" in error.details() and "'tiny-lm'" in error.details(), error.details()
        waiting.cancel()
    finally:
        slow.close()
    # Once the call is gone, another one runs.
    wait_for(lambda: srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)) == 0, "the cancelled call ends")
    again = read_stream(stub.Generate(GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2),
                                      timeout=CALL_TIMEOUT))
    assert again.done.steps == 2


def test_max_active_generations_holds_for_calls_arriving_together(small_limits) -> None:
    srv, _ = small_limits
    slow = slow_reader_channel(srv.target, aio=False)
    stub = model_service_pb2_grpc.ModelServiceStub(slow)
    # Calls whose readers never read: the one admitted stays running while the others arrive.
    request = GenerateRequest(model="tiny-lm", prompts=["a" * 9] * 3, max_new_tokens=16,
                              hooks=[EVERYTHING])
    together = threading.Barrier(8)
    outcomes: list[str] = []
    calls: list[Any] = []

    def call() -> None:
        together.wait(60)
        stream = stub.Generate(request, timeout=CALL_TIMEOUT)
        calls.append(stream)
        try:
            outcomes.append(next(stream).WhichOneof("kind"))
        except grpc.RpcError as exc:
            outcomes.append(exc.code().name)

    threads = [threading.Thread(target=call) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(CALL_TIMEOUT)
        assert sorted(outcomes) == ["RESOURCE_EXHAUSTED"] * 7 + ["started"], outcomes
    finally:
        for stream in calls:
            stream.cancel()
        slow.close()
    wait_for(lambda: srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)) == 0, "the cancelled call ends")


# --------------------------------------------------------------------------- a reader that stops


IDLE = 1.0  # generate_idle_timeout of the servers below: short, so the tests do not wait long


def _ends_with(stream: Iterator[Any], code: grpc.StatusCode) -> grpc.RpcError:
    """Reads ``stream`` to its end, which must be an error with ``code``; returns it."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == code, info.value.details()
    return info.value


def test_a_generate_whose_reader_stops_reading_ends_after_generate_idle_timeout(make_server) -> None:
    """A connected client that stops reading its Generate stream: after generate_idle_timeout
    the call ends with DEADLINE_EXCEEDED naming the setting, and its slot and KV cache are
    freed (on main it held them until the client read, cancelled or disconnected)."""
    srv = make_server(generate_idle_timeout=IDLE)
    slow = slow_reader_channel(srv.target, aio=False)
    try:
        request = GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=200, hooks=[HEAVY_HOOK])
        stream = model_service_pb2_grpc.ModelServiceStub(slow).Generate(request, timeout=CALL_TIMEOUT)
        assert next(stream).WhichOneof("kind") == "started"
        wait_for(lambda: srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)) == 0,
                 "the stalled call is ended")
        error = _ends_with(stream, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "(generate_idle_timeout)" in error.details() and "KV cache" in error.details(), error.details()
    finally:
        slow.close()
    with grpc.insecure_channel(srv.target) as channel:
        again = read_stream(model_service_pb2_grpc.ModelServiceStub(channel).Generate(
            GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2), timeout=CALL_TIMEOUT))
    assert again.done.steps == 2


def test_a_generate_whose_own_block_stream_is_not_read_ends_after_generate_idle_timeout(make_server) -> None:
    """A Generate call in a session whose BLOCK stream nobody reads runs no step past the one
    whose events the stream cannot take, and ends with DEADLINE_EXCEEDED after
    generate_idle_timeout, freeing its slot; meanwhile the model serves other calls."""
    srv = make_server(generate_idle_timeout=IDLE)
    slow = slow_reader_channel(srv.target, aio=False)
    fast = grpc.insecure_channel(srv.target)
    try:
        hooks = hook_service_pb2_grpc.HookServiceStub(slow)
        session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_bytes=64 * 1024)), timeout=CALL_TIMEOUT)
        session_id = next(session).opened.session_id  # and never read again
        hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="tiny-lm", module="**", posthook=_capture())), timeout=CALL_TIMEOUT)
        models = model_service_pb2_grpc.ModelServiceStub(fast)
        stream = models.Generate(GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=200,
                                                 session_id=session_id), timeout=CALL_TIMEOUT)
        error = _ends_with(stream, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert "(generate_idle_timeout)" in error.details() and "event streams" in error.details(), error.details()
        wait_for(lambda: srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)) == 0, "the call is ended")
        # Another caller (no session) was never held by that stream.
        again = read_stream(models.Generate(GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2),
                                            timeout=CALL_TIMEOUT))
        assert again.done.steps == 2
        session.cancel()
    finally:
        slow.close()
        fast.close()


def test_a_generate_failing_over_its_byte_limit_gives_its_kept_bytes_back(make_server) -> None:
    """A Generate call whose step keeps more events for its full BLOCK stream than its
    principal may (max_buffered_bytes_per_principal) fails with RESOURCE_EXHAUSTED; what it
    kept is given back to the principal's budget once its session ends."""
    from hookwire_server.auth import ANONYMOUS

    srv = make_server(max_buffered_bytes_per_principal=96 * 1024, generate_idle_timeout=30.0)
    with slow_reader_channel(srv.target, aio=False) as slow, grpc.insecure_channel(srv.target) as fast:
        hooks = hook_service_pb2_grpc.HookServiceStub(slow)
        session = hooks.OpenSession(hook_service_pb2.OpenSessionRequest(delivery=hook_service_pb2.DeliveryOptions(
            policy=hook_service_pb2.DELIVERY_POLICY_BLOCK, max_bytes=64 * 1024)), timeout=CALL_TIMEOUT)
        session_id = next(session).opened.session_id  # never read again
        hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="tiny-lm", module="**", posthook=_capture())), timeout=CALL_TIMEOUT)
        stream = model_service_pb2_grpc.ModelServiceStub(fast).Generate(GenerateRequest(
            model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=20, session_id=session_id), timeout=CALL_TIMEOUT)
        error = _ends_with(stream, grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "(max_buffered_bytes_per_principal)" in error.details(), error.details()
        wait_for(lambda: srv.call(lambda: srv.server.generation._active.get("tiny-lm", 0)) == 0, "the call ended")
        session.cancel()  # the session ends: nothing waits for its stream any more
        wait_for(lambda: srv.call(lambda: srv.server.hooks.held_bytes.held(ANONYMOUS.name)) == 0,
                 "the bytes the failed call kept are given back")


def test_a_session_hook_with_last_before_first_is_refused(env: Env, session) -> None:
    session_id, _ = session
    with pytest.raises(grpc.RpcError) as info:
        env.hooks.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session_id, spec=hook_pb2.HookSpec(
            model="tiny-lm", module="model.layers.0", posthook=_capture(), steps=_steps(1, 0))), timeout=CALL_TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("steps: last (0) is before first (1)"), info.value.details()


def test_max_generations_per_principal_leaves_the_model_to_others() -> None:
    """One caller's stalled generations hold its own slots (max_generations_per_principal),
    not the model's: another caller still generates."""
    from hookwire_server.auth import hash_token

    tokens = f"alice:user:{hash_token('alice-token')}\nbob:user:{hash_token('bob-token')}"
    settings = ServerSettings(port=0, tokens=tokens, max_generations_per_principal=1)
    srv = ServerThread(build_registry([c for c in demo_configs() if c.name == "tiny-lm"]), settings).start()
    slow = slow_reader_channel(srv.target, aio=False)
    fast = grpc.insecure_channel(srv.target)
    alice, bob = bearer("alice-token"), bearer("bob-token")
    try:
        waiting = model_service_pb2_grpc.ModelServiceStub(slow).Generate(
            GenerateRequest(model="tiny-lm", prompts=["a" * 9] * 3, max_new_tokens=16, hooks=[EVERYTHING]),
            metadata=alice, timeout=CALL_TIMEOUT)
        assert next(waiting).WhichOneof("kind") == "started"
        stub = model_service_pb2_grpc.ModelServiceStub(fast)
        error = expect_error(stub, GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2), metadata=alice)
        assert error.code() == EXHAUSTED and "'alice' has 1 Generate calls running" in error.details(), error.details()
        assert "(max_generations_per_principal)" in error.details()
        other = read_stream(stub.Generate(GenerateRequest(model="tiny-lm", prompts=["a"], max_new_tokens=2),
                                          metadata=bob, timeout=CALL_TIMEOUT))
        assert other.done.steps == 2
        waiting.cancel()
    finally:
        slow.close()
        fast.close()
        srv.stop()


# --------------------------------------------------------------------------- what a failed or cancelled call leaves, and bounds on a request's work


def _on_loop(srv: ServerThread, coro: Any) -> Any:
    """Runs ``coro`` on the server's event loop; its result."""
    return asyncio.run_coroutine_threadsafe(coro, srv._loop).result(CALL_TIMEOUT)


def test_a_cancel_while_the_next_step_waits_for_the_model_runs_no_more_passes(env: Env) -> None:
    """protocol §6: cancelling "frees the model for others at once" and only "a step that
    is running completes". A step still waiting in the model's queue must not run."""
    host = env.srv.server.registry.get("tiny-lm")
    passes: list[float] = []
    handle = host.module.register_forward_pre_hook(lambda m, a: passes.append(time.monotonic()))

    gate = threading.Event()

    async def scenario() -> int:
        call = env.srv.server.generation.generate(GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=50))
        other = asyncio.ensure_future(host.run(gate.wait, 60))  # another call's pass holds the model
        await asyncio.sleep(0)  # it is queued first
        # The call's first pass (its start and prefill) is handed to the model's thread,
        # behind the other pass: its `started` never comes.
        following = asyncio.ensure_future(call.__anext__())
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
        ran = _on_loop(env.srv, scenario())
    finally:
        handle.remove()
    assert ran == 0, f"{ran} forward pass(es) of the cancelled call ran after the cancel"


def test_a_plan_that_fails_as_a_whole_ends_its_calls_with_their_status_and_detaches_their_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine's plan that raises as a whole (a bug, not a call's own failure) ends its
    Generate calls with INTERNAL at once (not UNAVAILABLE, which invites retries, and not
    a stream that waits for an end that never comes), and their hooks detach; the same
    when the engine also fails the plan that would finish them."""
    from hookwire_server.engine import decoding

    # A server of its own: the second case's hooks stay attached (its finish failed too).
    srv = ServerThread(build_registry([c for c in demo_configs() if c.name == "tiny-lm"])).start()
    channel = grpc.insecure_channel(srv.target)
    models = model_service_pb2_grpc.ModelServiceStub(channel)
    host = srv.server.registry.get("tiny-lm")
    capture_all = hook_pb2.HookSpec(module="*", posthook=hook_pb2.HookAction(capture=[hook_pb2.PART_OUTPUT]))
    real = decoding.run_calls

    def failing_steps(h: Any, calls: list[Any]) -> list[Any]:  # a step's plan raises; a finish runs
        if any(c.step >= 1 and c.ended is None for c in calls):
            raise RuntimeError("a bug in the plan")
        return real(h, calls)

    def failing_all(h: Any, calls: list[Any]) -> list[Any]:  # every plan past step 0, its finish too
        if any(c.step >= 1 for c in calls):
            raise RuntimeError("the engine is broken")
        return real(h, calls)

    try:
        for name, broken in (("a step's plan", failing_steps), ("every plan past step 0", failing_all)):
            monkeypatch.setattr(decoding, "run_calls", broken)
            kinds: list[str] = []
            with pytest.raises(grpc.RpcError) as info:
                for message in models.Generate(
                        GenerateRequest(model="tiny-lm", prompts=["the cat"], max_new_tokens=5, hooks=[capture_all]),
                        timeout=CALL_TIMEOUT):
                    kinds.append(message.WhichOneof("kind"))
            assert info.value.code() == grpc.StatusCode.INTERNAL, (name, info.value.details())
            assert kinds[0] == "started" and "tokens" in kinds, (name, kinds)
            monkeypatch.setattr(decoding, "run_calls", real)
            if name == "a step's plan":
                wait_for(lambda: srv.call(lambda: sum(len(m._forward_hooks) for m in host.module.modules())) == 0,
                         "the failed call's hooks to detach")
    finally:
        channel.close()
        srv.stop()


def test_a_failed_generate_frees_its_kv_cache(env: Env) -> None:
    """A step that fails (here a request hook's rule, on_error FAIL_CALL) must not leave the
    call's KV cache (and the step's activations) alive: the exception's traceback holds
    Decoder.step's frames, and gRPC keeps the aborted call's exception chain."""
    host = env.srv.server.registry.get("tiny-lm")
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
            for _ in env.models.Generate(GenerateRequest(model="tiny-lm", prompts=HEAVY_PROMPTS, max_new_tokens=5, hooks=[failing]),
                                   timeout=CALL_TIMEOUT):
                pass
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        handle.remove()
    time.sleep(0.5)
    env.srv.call(gc.collect)
    alive = {id(c()) for c in caches if c() is not None}
    assert not alive, f"{len(alive)} KV cache(s) of the failed call still alive after the call ended and gc"


def test_a_stop_string_the_vocabulary_cannot_spell_is_invalid_argument(env: Env) -> None:
    """Bad input is never INTERNAL: a stop string no token can spell (transformers'
    StopStringCriteria raises ValueError for it) is INVALID_ARGUMENT naming the stop."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in env.models.Generate(GenerateRequest(model="letters-60", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                               max_new_tokens=2, stop=["é"]), timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{info.value.code()}: {info.value.details()}"
    assert info.value.details().startswith("stop"), info.value.details()


def test_input_ids_over_the_limits_are_refused_before_they_are_decoded(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_prompt_tokens bounds the work done on a request: the shape of input_ids is in
    the message, and is compared with the limits before the ids are decoded (a copy,
    then widened to int64: 8x for int8 ids, on the event loop)."""
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
        for _ in env.models.Generate(request, timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert [1, n] not in decoded, "the oversized input_ids were decoded before the limit refused them"


def test_stop_strings_at_the_limits_leave_no_table_behind(env: Env) -> None:
    """Building the stop-string matcher costs the vocabulary size times the stop strings'
    characters (a Python loop on the model's tokenizer thread, stalling its Tokenize calls):
    their characters in all are bounded (max_stop_chars), and the [vocab, chars] table that
    transformers keeps in its process-wide cache (9 entries) is not left behind."""
    from transformers.generation import stopping_criteria

    stopping_criteria.STOP_STRING_EMBEDDING_CACHE.clear()
    limit = env.srv.server.settings.max_stop_chars
    at_limit = [chr(ord("a") + i) * (limit // 8) for i in range(8)]
    assert sum(map(len, at_limit)) == limit
    for _ in env.models.Generate(GenerateRequest(model="letters-4000", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                           max_new_tokens=1, stop=at_limit), timeout=CALL_TIMEOUT):
        pass
    assert not stopping_criteria.STOP_STRING_EMBEDDING_CACHE, "a stop-string table was left in transformers' cache"
    over = at_limit[:-1] + [at_limit[-1] + "x"]
    with pytest.raises(grpc.RpcError) as info:
        for _ in env.models.Generate(GenerateRequest(model="letters-4000", input_ids=codec.encode_tensor(torch.tensor([[5, 6]])),
                                               max_new_tokens=1, stop=over), timeout=CALL_TIMEOUT):
            pass
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{limit + 1} characters in all, over the limit of {limit} (max_stop_chars)" in info.value.details()


def test_text_held_back_for_an_incomplete_character_does_not_grow_without_bound() -> None:
    """TextDeltas holds text back while it ends in U+FFFD and re-decodes everything from its
    prefix offset each step. A UTF-8 character is at most 4 bytes: text still ending in
    U+FFFD after that will never complete, so the window must stop growing there (else
    decoding is quadratic, on the event loop, for a generation steered onto a lone
    continuation byte)."""
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


def test_a_failed_infer_frees_its_activations(env: Env) -> None:
    """The same for Infer: a call whose request-scoped rule fails must not keep the
    tensors its pass made alive through the exception gRPC keeps."""
    host = env.srv.server.registry.get("tiny-lm")
    outputs: list[weakref.ref] = []
    handle = host.module.model.layers[0].register_forward_hook(
        lambda m, a, o: outputs.append(weakref.ref(o if isinstance(o, torch.Tensor) else o[0])))
    failing = hook_pb2.HookSpec(module="model.layers.1", posthook=hook_pb2.HookAction(
        rules=[rule_pb2.Rule(target="output", index="[:, 99]", zero=rule_pb2.ZeroOp())]))  # out of range
    try:
        with pytest.raises(grpc.RpcError) as info:
            env.models.Infer(model_service_pb2.InferRequest(
                model="tiny-lm", args=[codec.encode_value(torch.tensor([[1, 5, 6]]))], hooks=[failing]),
                timeout=CALL_TIMEOUT)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        handle.remove()
    env.srv.call(gc.collect)
    assert outputs and not [r for r in outputs if r() is not None], "the failed Infer's activations are still alive"
