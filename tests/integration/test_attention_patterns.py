"""Attention probabilities as module outputs: MiniLM (real weights) loaded with
``attn_implementation = "eager"`` on a real server, captured by a real client, equal to
the bit to in-process transformers with eager attention (``output_attentions=True``, and
an in-process torch hook at the same module); with the default sdpa attention the same
capture point carries none. Also: the config key's checks, and every block of
docs/recipes/attention.md run against the server."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers

import hookwire
from hookwire_server.models.model_loading import ConfigError, ModelConfig, build_host, load_config_file, load_failure
from hookwire_server.models.model_registry import ModelRegistry
from support import ServerThread, minilm_folder, serving

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "docs" / "recipes" / "attention.md"
SENTENCES = ["The cat sat on the mat.", "Hello world"]
ATTENTION = "encoder.layer.*.attention.self"
LAYERS = 6


@pytest.fixture(scope="module")
def local() -> dict[str, Any]:
    """The oracle: in-process transformers, MiniLM loaded with eager attention."""
    folder = str(minilm_folder())
    return {
        "model": transformers.BertModel.from_pretrained(folder, local_files_only=True,
                                                        attn_implementation="eager").eval(),
        "tokenizer": transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True),
    }


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """MiniLM twice: "minilm" as the recipe configures it (eager), "minilm-sdpa" with
    transformers' default attention."""
    folder = str(minilm_folder())
    eager = build_host(ModelConfig(name="minilm", transformers=folder, attn_implementation="eager"))
    default = build_host(ModelConfig(name="minilm-sdpa", transformers=folder))
    assert eager.module.config._attn_implementation == "eager"
    assert default.module.config._attn_implementation == "sdpa"
    with serving(ModelRegistry([eager, default])) as srv:
        yield srv


def _oracle(local: dict[str, Any]) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...], Any]:
    """In-process: the attention modules' outputs seen by torch forward hooks, the model's
    ``attentions`` with output_attentions=True, and the tokenized batch."""
    model, tokenizer = local["model"], local["tokenizer"]
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    seen: dict[str, torch.Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, out))
        for name, module in model.named_modules() if re.fullmatch(r"encoder\.layer\.\d+\.attention\.self", name)
    ]
    try:
        with torch.no_grad():
            out = model(**batch, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return seen, out.attentions, batch


async def test_eager_attention_probabilities_are_captured_bit_identical(
    server: ServerThread, local: dict[str, Any],
) -> None:
    hooked, attentions, batch = _oracle(local)
    async with hookwire.connect(server.target) as client:
        model = client.model("minilm")
        tokens = await model.tokenize(SENTENCES)
        assert torch.equal(tokens.input_ids, batch["input_ids"])
        assert torch.equal(tokens.attention_mask.bool(), batch["attention_mask"].bool())
        out, cache = await model.run_with_cache(tokens.input_ids, attention_mask=tokens.attention_mask,
                                                modules=ATTENTION)
    keys = cache.keys_matching(ATTENTION)
    assert keys == [f"encoder.layer.{i}.attention.self" for i in range(LAYERS)]
    mask = batch["attention_mask"].bool()
    for i, key in enumerate(keys):
        context, probs = cache[key]
        assert probs.shape == (2, 12, mask.shape[1], mask.shape[1])
        assert torch.equal(probs, attentions[i]), key  # output_attentions=True
        assert torch.equal(probs, hooked[key][1]), key  # a torch hook at the same module
        assert torch.equal(context, hooked[key][0]), key
        # Softmax over the keys with the mask applied: rows sum to 1 over the real keys,
        # padded keys get exactly 0.
        for row in range(2):
            real = mask[row]
            sums = probs[row][..., real].double().sum(-1)
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6), (key, row)
            assert torch.all(probs[row][..., ~real] == 0), (key, row)
    assert not mask[0].logical_not().any() and mask[1].logical_not().any()  # the second sentence is padded


async def test_sdpa_attention_carries_no_probabilities(server: ServerThread, local: dict[str, Any]) -> None:
    """transformers' default (sdpa) fuses the softmax: the same capture point returns
    (context, None), as in-process."""
    async with hookwire.connect(server.target) as client:
        model = client.model("minilm-sdpa")
        tokens = await model.tokenize(SENTENCES)
        _, cache = await model.run_with_cache(tokens.input_ids, attention_mask=tokens.attention_mask,
                                              modules=ATTENTION)
    for key in cache.keys_matching(ATTENTION):
        context, probs = cache[key]
        assert probs is None, key
        assert context.shape == (2, tokens.input_ids.shape[1], 384)


# --- the config key ------------------------------------------------------------------------


@pytest.mark.parametrize("entry, match", [
    ('transformers = "m"\nattn_implementation = 3', r"model 'mine': attn_implementation must be a name such as "
                                                     r"\"eager\" or \"sdpa\", not 3"),
    ('transformers = "m"\nattn_implementation = ""', r"model 'mine': attn_implementation must be a name"),
    ('transformers = "m"\nattn_implementation = ["eager"]', r"attn_implementation must be a name"),
    ('factory = "hookwire_server.demo_models:mlp"\nattn_implementation = "eager"',
     r"model 'mine': attn_implementation applies to transformers folders only"),
    ('transformers = "m"\nattn_implementation = "eager"\nkwargs = { attn_implementation = "sdpa" }',
     r"model 'mine': attn_implementation is set twice \(also in kwargs\)"),
])
def test_config_refuses_a_bad_attn_implementation(tmp_path: pathlib.Path, entry: str, match: str) -> None:
    path = tmp_path / "hookwire.toml"
    path.write_text(f'[[models]]\nname = "mine"\n{entry}\n')
    with pytest.raises(ConfigError, match=match):
        load_config_file(path)


def test_config_refuses_it_when_built_directly() -> None:
    with pytest.raises(ConfigError, match="applies to transformers folders only"):
        build_host(ModelConfig(name="mine", factory="hookwire_server.demo_models:mlp", attn_implementation="eager"))


def test_a_name_transformers_does_not_know_fails_the_load_with_its_message() -> None:
    with pytest.raises(ValueError) as failure:
        build_host(ModelConfig(name="mine", transformers=str(minilm_folder()), attn_implementation="nope"))
    assert 'attn_implementation="nope"' in load_failure(failure.value)


# --- the recipe ----------------------------------------------------------------------------


def _blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", RECIPE.read_text(), flags=re.S | re.M)


def test_recipe_config_block_loads(tmp_path: pathlib.Path) -> None:
    (toml,) = _blocks("toml")
    (tmp_path / "models" / "all-MiniLM-L6-v2").mkdir(parents=True)
    (tmp_path / "hookwire.toml").write_text(toml)
    _, (config,) = load_config_file(tmp_path / "hookwire.toml")
    assert (config.name, config.attn_implementation) == ("minilm", "eager")
    assert config.transformers == str(tmp_path / "models" / "all-MiniLM-L6-v2")


def test_recipe_python_blocks_run(server: ServerThread, tmp_path: pathlib.Path) -> None:
    blocks = _blocks("python")
    assert len(blocks) == 2
    env = {**os.environ, "HOOKWIRE_TARGET": server.target}
    outputs = []
    for block in blocks:
        proc = subprocess.run([sys.executable, "-c", block], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    assert "6 layers of (2, 12, 9, 9)" in outputs[0]
    sums = re.search(r"rows sum to (\S+) \.\. (\S+)", outputs[0])
    assert sums is not None and abs(float(sums[1]) - 1) < 1e-5 and abs(float(sums[2]) - 1) < 1e-5
    assert "(1, 12, 9, 9)" in outputs[1]
    for name in ("attention.png", "attention-l5h7.png", "attention-layer3.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG"), name


async def test_heads_by_number_on_real_minilm_attention_and_its_output_projection(
    server: ServerThread, local: dict[str, Any],
) -> None:
    """MiniLM's 12 heads of 32 (from its config): capturing heads 0 and 5 of the attention
    probabilities gives [batch, 2, queries, keys] equal to in-process's slice; ablating
    head 7 at the attention output projection's input equals zeroing its 32 features in
    process, bit for bit (real weights)."""
    model, tokenizer = local["model"], local["tokenizer"]
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        attentions = model(**batch, output_attentions=True).attentions

    def ablate(module: Any, args: Any) -> Any:
        x = args[0].clone()
        x[..., 7 * 32:8 * 32] = 0
        return (x,)

    handle = model.encoder.layer[2].attention.output.dense.register_forward_pre_hook(ablate)
    try:
        with torch.no_grad():
            want = model(**batch).last_hidden_state
    finally:
        handle.remove()
    async with hookwire.connect(server.target) as client:
        minilm = client.model("minilm")
        probs = await minilm.infer(batch["input_ids"], attention_mask=batch["attention_mask"], hooks=[
            hookwire.HookSpec("encoder.layer.1.attention.self", posthook=hookwire.capture("output", heads=[0, 5]))])
        context, kept = probs.events[0].output
        assert torch.equal(kept, attentions[1][:, [0, 5]])
        assert context.shape == (2, batch["input_ids"].shape[1], 384)  # only the probabilities have separate heads
        ablated = await minilm.infer(batch["input_ids"], attention_mask=batch["attention_mask"], hooks=[
            hookwire.HookSpec("encoder.layer.2.attention.output.dense",
                              prehook=[hookwire.rules.zero("args.0").on_heads(7)])])
        assert torch.equal(ablated.output["last_hidden_state"], want)
