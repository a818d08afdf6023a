"""Tokenize and the demo causal LM: a real server on loopback, the in-process
transformers tokenizer as the oracle, bit for bit."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
import transformers

import hookwire
from hookwire_server import ModelConfig, ServerSettings, build_registry, demo_configs
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from support import CACHE, ServerThread

TEXTS = ["Hello world, the model is a hook.", "hi", "ünïcødé ✓ 日本語 🙂", "the the the"]


def _oracle(tokenizer: Any, texts: list[str], *, padding_side: str, add_special_tokens: bool | None) -> Any:
    kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    return tokenizer(texts, padding=True, return_tensors="pt", padding_side=padding_side, **kwargs)


def _assert_matches(got: hookwire.Tokenized, tokenizer: Any, texts: list[str], *, padding_side: str,
                    add_special_tokens: bool | None = None) -> None:
    want = _oracle(tokenizer, texts, padding_side=padding_side, add_special_tokens=add_special_tokens)
    assert got.input_ids.dtype == torch.int64 and got.attention_mask.dtype == torch.int64
    assert torch.equal(got.input_ids, want["input_ids"]), (got.input_ids, want["input_ids"])
    assert torch.equal(got.attention_mask, want["attention_mask"])
    assert got.pieces == [
        tokenizer.convert_ids_to_tokens(ids[mask.bool()].tolist())
        for ids, mask in zip(want["input_ids"], want["attention_mask"])
    ]


@pytest.mark.parametrize("add_special_tokens", [None, True, False])
@pytest.mark.parametrize("padding_side", ["", "left", "right"])
async def test_tokenize_equals_the_tokenizer(client: hookwire.Client, add_special_tokens, padding_side) -> None:
    got = await client.model("tiny-lm").tokenize(TEXTS, add_special_tokens=add_special_tokens, padding_side=padding_side)
    # "" means left for a model that generates.
    _assert_matches(got, tiny_lm_tokenizer(), TEXTS, padding_side=padding_side or "left",
                    add_special_tokens=add_special_tokens)
    assert got.raw.input_ids.shape == list(got.input_ids.shape)


async def test_tokenize_one_string_and_empty_texts(client: hookwire.Client) -> None:
    model = client.model("tiny-lm")
    one = await model.tokenize("the cat")
    assert one.pieces == [["<bos>", "the", "Ġcat"]] and one.input_ids.shape == (1, 3)
    empty = await model.tokenize(["", ""], add_special_tokens=False)
    assert empty.input_ids.shape == (2, 0) and empty.pieces == [[], []]
    _assert_matches(await model.tokenize(["", "a b"]), tiny_lm_tokenizer(), ["", "a b"], padding_side="left")


async def test_the_demo_lm_generates_and_infer_runs_it(client: hookwire.Client) -> None:
    local, tokenizer = tiny_lm(), tiny_lm_tokenizer()
    assert isinstance(local, transformers.GenerationMixin) and local.can_generate()
    batch = await client.model("tiny-lm").tokenize(["Hello world", "the"])
    with torch.no_grad():
        generated = local.generate(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                   max_new_tokens=6, do_sample=False)
    assert generated.shape == (2, batch.input_ids.shape[1] + 6)
    assert all(isinstance(t, str) for t in tokenizer.batch_decode(generated))
    # The server's tiny-lm has the same weights: its logits equal the local forward pass.
    out = await client.model("tiny-lm")(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    with torch.no_grad():
        want = local(batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    assert list(out) == ["logits"]
    assert torch.equal(out["logits"], want.logits)


async def test_tokenize_refuses_bad_input(client: hookwire.Client) -> None:
    with pytest.raises(hookwire.FailedPreconditionError, match=r"model 'mlp' has no tokenizer.*input_ids"):
        await client.model("mlp").tokenize(["hi"])
    with pytest.raises(hookwire.NotFoundError, match="nope"):
        await client.model("nope").tokenize(["hi"])
    for side in ("up", "LEFT", " left"):
        with pytest.raises(hookwire.InvalidArgumentError, match="padding_side"):
            await client.model("tiny-lm").tokenize(["hi"], padding_side=side)
    with pytest.raises(hookwire.InvalidArgumentError, match="no texts"):
        await client.model("tiny-lm").tokenize([])


async def test_tokenize_limits() -> None:
    registry = build_registry([c for c in demo_configs() if c.name == "tiny-lm"])
    server = ServerThread(registry, ServerSettings(port=0, max_tokenize_texts=3, max_tokenize_chars=100,
                                                   max_prompt_tokens=10)).start()
    try:
        async with hookwire.connect(server.target) as client:
            model = client.model("tiny-lm")
            ok = await model.tokenize(["a"] * 3)
            assert ok.input_ids.shape == (3, 2)
            with pytest.raises(hookwire.ResourceExhaustedError, match=r"over the limit of 3 \(max_tokenize_texts\)"):
                await model.tokenize(["a"] * 4)
            with pytest.raises(hookwire.ResourceExhaustedError, match=r"101 characters.*\(max_tokenize_chars\)"):
                await model.tokenize(["a" * 50, "b" * 51])
            assert (await model.tokenize(["a" * 9])).input_ids.shape == (1, 10)  # <bos> + 9
            with pytest.raises(hookwire.ResourceExhaustedError, match=r"texts\[1\]: 11 tokens.*\(max_prompt_tokens\)"):
                await model.tokenize(["a", "a" * 10])
    finally:
        server.stop()


def _no_pad_tokenizer() -> Any:
    """A GPT-2-like tokenizer: BOS and EOS, no pad token."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_lm_tokenizer().backend_tokenizer, bos_token="<bos>", eos_token="<eos>",
    )


async def test_causal_lm_and_tokenizer_from_a_local_folder(tmp_path: pathlib.Path) -> None:
    tokenizer = _no_pad_tokenizer()
    assert tokenizer.pad_token is None
    config = transformers.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        local = transformers.GPT2LMHeadModel(config).eval()
    local.save_pretrained(str(tmp_path / "gpt"))
    tokenizer.save_pretrained(str(tmp_path / "gpt"))
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32))
    bert.save_pretrained(str(tmp_path / "bert"))
    bert.save_pretrained(str(tmp_path / "bert-tok"))
    tiny_lm_tokenizer().save_pretrained(str(tmp_path / "bert-tok"))  # pads on the left
    right = tiny_lm_tokenizer()
    right.padding_side = "right"
    right.save_pretrained(str(tmp_path / "bert-tok-right"))
    bert.save_pretrained(str(tmp_path / "bert-tok-right"))

    registry = build_registry([ModelConfig(name=name, transformers=str(tmp_path / name))
                               for name in ("gpt", "bert", "bert-tok", "bert-tok-right")])
    server = ServerThread(registry).start()
    try:
        assert registry.get("gpt").can_generate and not registry.get("bert").can_generate
        async with hookwire.connect(server.target) as client:
            gpt = client.model("gpt")
            assert (await gpt.info()).modules[0].type == "GPT2LMHeadModel"  # with its LM head: it can generate
            got = await gpt.tokenize(TEXTS)
            oracle = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "gpt"), local_files_only=True)
            oracle.pad_token = oracle.eos_token  # what the server does for a tokenizer without one
            _assert_matches(got, oracle, TEXTS, padding_side="left")
            assert (got.input_ids[1, :-3] == oracle.eos_token_id).all()  # "hi" is <bos> h i, after EOS padding
            _assert_matches(await gpt.tokenize(TEXTS, padding_side="right", add_special_tokens=False), oracle, TEXTS,
                            padding_side="right", add_special_tokens=False)
            out = await gpt(got.input_ids, attention_mask=got.attention_mask, use_cache=False)
            with torch.no_grad():
                want = local(got.input_ids, attention_mask=got.attention_mask, use_cache=False)
            assert torch.equal(out["logits"], want.logits)

            with pytest.raises(hookwire.FailedPreconditionError, match=r"model 'bert' has no tokenizer.*input_ids"):
                await client.model("bert").tokenize(["hi"])
            # A model that does not generate pads on its tokenizer's own side by default.
            _assert_matches(await client.model("bert-tok").tokenize(TEXTS), tiny_lm_tokenizer(), TEXTS,
                            padding_side="left")
            _assert_matches(await client.model("bert-tok-right").tokenize(TEXTS), tiny_lm_tokenizer(), TEXTS,
                            padding_side="right")
    finally:
        server.stop()


async def test_a_kv_cache_is_sent_as_null_with_a_marker(client: hookwire.Client) -> None:
    """transformers' DynamicCache has no wire form: outputs and captured kwargs carry it
    as null with Value.opaque_type naming its class, instead of failing the call."""
    model = client.model("tiny-lm")
    batch = await model.tokenize(["Hello world", "the"])
    local = tiny_lm()
    with torch.no_grad():
        want = local(batch.input_ids, attention_mask=batch.attention_mask)
    assert type(want[CACHE]).__name__ == "DynamicCache"
    result = await model.infer(
        batch.input_ids, attention_mask=batch.attention_mask,
        hooks=[hookwire.HookSpec("model.layers.0", prehook=hookwire.capture("args", "kwargs"),
                                 prehook_kwargs={"with_kwargs": True})],
    )
    assert list(result.output) == ["logits", CACHE]
    assert result.output[CACHE] is None
    marker = result.raw.output.map.entries[CACHE]
    assert marker.WhichOneof("kind") == "null_value" and marker.opaque_type == "DynamicCache"
    assert torch.equal(result.output["logits"], want.logits)
    [event] = result.events
    assert event.kwargs[CACHE] is None
    assert event.raw.kwargs[CACHE].opaque_type == "DynamicCache"
    assert all(v.opaque_type == "" for k, v in event.raw.kwargs.items() if k != CACHE)
    # A client never sends one: encoding a cache in a request is still an error.
    from hookwire.wire import codec
    with pytest.raises(codec.CodecError, match="DynamicCache"):
        codec.encode_value(want[CACHE])
