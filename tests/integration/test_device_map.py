"""Models loaded with a device map (#15), without a GPU: MiniLM (real weights) and the demo
causal LM split between the CPU and disk offload by accelerate, served by a real server
and read by a real client. Captures, rules, slots moved between modules, backward and
generation are bit-identical to the same device map in-process with torch hooks; offloaded
weights read through GetParameters; GetModel shows the map; events name their device.
Also the config keys' checks."""

from __future__ import annotations

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
from hookwire import rules
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.model_loading import ConfigError, ModelConfig, build_host, load_config_file, load_failure
from hookwire_server.models.model_registry import ModelRegistry
from support import ServerThread, minilm_folder, serving

SENTENCES = ["The cat sat on the mat.", "Hello world"]
#: Layers 0-2 and the embeddings in memory, layers 3-5 and the pooler on disk.
MINILM_MAP = {"embeddings": "cpu", **{f"encoder.layer.{i}": "cpu" if i < 3 else "disk" for i in range(6)},
              "pooler": "disk"}
#: The LM's first layer on disk: its hooks fire on weights loaded around its forward.
LM_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
          "model.rotary_emb": "cpu", "lm_head": "disk"}


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo causal LM saved as a transformers folder (weights and tokenizer)."""
    folder = tmp_path_factory.mktemp("tiny-lm")
    tiny_lm().save_pretrained(folder)
    tiny_lm_tokenizer().save_pretrained(folder)
    return str(folder)


def _load(folder: str, device_map: Any, offload: pathlib.Path, **kwargs: Any) -> Any:
    """The oracle: the same folder with the same device map, in-process."""
    auto = transformers.AutoModelForCausalLM if "tiny-lm" in folder else transformers.AutoModel
    return auto.from_pretrained(folder, local_files_only=True, device_map=device_map,
                                offload_folder=str(offload), **kwargs).eval()


@pytest.fixture(scope="module")
def local(lm_folder: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    minilm = _load(str(minilm_folder()), MINILM_MAP, tmp_path_factory.mktemp("offload-local-minilm"))
    lm = _load(lm_folder, LM_MAP, tmp_path_factory.mktemp("offload-local-lm"), attn_implementation="eager")
    return {"minilm": minilm, "lm": lm,
            "tokenizer": transformers.AutoTokenizer.from_pretrained(str(minilm_folder()), local_files_only=True)}


@pytest.fixture(scope="module")
def server(lm_folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    hosts = [
        build_host(ModelConfig(name="minilm", transformers=str(minilm_folder()), device_map=MINILM_MAP,
                               offload_folder=str(tmp_path_factory.mktemp("offload-minilm")),
                               parameters_readable=True)),
        build_host(ModelConfig(name="lm", transformers=lm_folder, device_map=LM_MAP, attn_implementation="eager",
                               offload_folder=str(tmp_path_factory.mktemp("offload-lm")), parameters_readable=True)),
        # accelerate computes the split: the CPU budget leaves most of the layers to disk.
        build_host(ModelConfig(name="minilm-auto", transformers=str(minilm_folder()), device_map="auto",
                               max_memory={"cpu": "70MB"}, torch_dtype="float32",
                               offload_folder=str(tmp_path_factory.mktemp("offload-auto")))),
    ]
    with serving(ModelRegistry(hosts)) as srv:
        yield srv


def _batch(local: dict[str, Any]) -> Any:
    return local["tokenizer"](SENTENCES, padding=True, return_tensors="pt")


def _hooked(model: Any, pattern: str, edit: Any = None, pre: bool = False) -> tuple[dict[str, Any], list[Any]]:
    """Torch hooks on the modules matching ``pattern``: what they saw (cloned), and their
    handles; ``edit(name, value)`` returns a replacement output (or args for ``pre``)."""
    seen: dict[str, Any] = {}
    handles = []
    for name, module in model.named_modules():
        if not re.fullmatch(pattern, name):
            continue
        if pre:
            def prehook(m: Any, args: Any, name: str = name) -> Any:
                seen[name] = tuple(a.detach().clone() for a in args if isinstance(a, torch.Tensor))
                return edit(name, args) if edit is not None else None
            handles.append(module.register_forward_pre_hook(prehook))
        else:
            def hook(m: Any, args: Any, out: Any, name: str = name) -> Any:
                new = edit(name, out) if edit is not None else None
                value = out if new is None else new
                seen[name] = value[0].detach().clone() if isinstance(value, tuple) else value.detach().clone()
                return new
            handles.append(module.register_forward_hook(hook))
    return seen, handles


def _first(value: Any) -> Any:
    """A module output's hidden states (transformers' layers return a tensor or a tuple)."""
    return value[0] if isinstance(value, tuple) else value


def _unhook(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


async def test_captures_are_bit_identical_to_the_same_map_in_process(server: ServerThread,
                                                                     local: dict[str, Any]) -> None:
    batch = _batch(local)
    seen, handles = _hooked(local["minilm"], r"encoder\.layer\.\d+")
    pre, pre_handles = _hooked(local["minilm"], r"encoder\.layer\.4\.attention\.self\.query", pre=True)
    try:
        with torch.no_grad():
            expected = local["minilm"](**batch).last_hidden_state
    finally:
        _unhook(handles + pre_handles)
    async with hookwire.connect(server.target) as client:
        model = client.model("minilm")
        out, cache = await model.run_with_cache(batch["input_ids"], attention_mask=batch["attention_mask"],
                                                modules="encoder.layer.*")
        result = await model.infer(batch["input_ids"], attention_mask=batch["attention_mask"], hooks=[
            hookwire.HookSpec("encoder.layer.4.attention.self.query", prehook=hookwire.capture("args")),
            hookwire.HookSpec("encoder.layer.1", posthook=hookwire.capture("output")),
        ])
    assert torch.equal(out["last_hidden_state"], expected)
    for i in range(6):
        assert torch.equal(_first(cache[f"encoder.layer.{i}"]), seen[f"encoder.layer.{i}"]), i
    layer1, query = result.events  # in firing order
    assert (layer1.module, query.module) == ("encoder.layer.1", "encoder.layer.4.attention.self.query")
    assert torch.equal(query.args[0], pre["encoder.layer.4.attention.self.query"][0])
    # Without a GPU every device in the map executes on the CPU: events say so.
    assert query.devices == ("cpu",) and layer1.devices == ("cpu",)


async def test_rules_and_a_slot_moved_across_the_map_equal_in_process_edits(server: ServerThread,
                                                                            local: dict[str, Any]) -> None:
    """A steering vector added on a disk-offloaded layer, a scale on an in-memory one, and
    layer 1's output (CPU) saved in a slot and patched into layer 4 (disk) at position 2."""
    batch = _batch(local)
    steer = torch.randn(384, generator=torch.Generator().manual_seed(3))
    model = local["minilm"]
    with torch.no_grad():
        saved, handles = _hooked(model, r"encoder\.layer\.1")
        model(**batch)
        _unhook(handles)
        source = saved["encoder.layer.1"]

        def edit(name: str, out: Any) -> Any:
            if name == "encoder.layer.2":
                return out * 0.5
            new = out + steer
            new[:, 2] = source[:, 2]
            return new

        seen, handles = _hooked(model, r"encoder\.layer\.(2|4)", edit)
        try:
            expected = model(**batch).last_hidden_state
        finally:
            _unhook(handles)
    async with hookwire.connect(server.target) as client:
        await client.session()
        remote = client.model("minilm")
        await remote.infer(batch["input_ids"], attention_mask=batch["attention_mask"], hooks=[
            hookwire.HookSpec("encoder.layer.1", posthook=[rules.save("output", slot="clean")])])
        result = await remote.infer(batch["input_ids"], attention_mask=batch["attention_mask"], hooks=[
            hookwire.HookSpec("encoder.layer.2", posthook=[rules.scale("output", 0.5)]),
            hookwire.HookSpec("encoder.layer.4", posthook=hookwire.edit(
                rules.add("output", steer), rules.patch("output", slot="clean", index="[:, 2]"),
                capture=("output",))),
        ])
    assert torch.equal(result.output["last_hidden_state"], expected)
    assert torch.equal(_first(result.events[0].output), seen["encoder.layer.4"])


async def test_backward_through_offloaded_layers_equals_in_process(server: ServerThread,
                                                                  local: dict[str, Any]) -> None:
    batch = _batch(local)
    model = local["minilm"]
    grads: dict[str, torch.Tensor] = {}
    handle = model.encoder.layer[4].register_full_backward_hook(
        lambda m, gi, go: grads.__setitem__("out", go[0].detach().clone()))
    try:
        embeds = model.embeddings.word_embeddings(batch["input_ids"]).detach().requires_grad_(True)
        out = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"]).last_hidden_state
        out.backward(torch.ones_like(out))
    finally:
        handle.remove()
    async with hookwire.connect(server.target) as client:
        result = await client.model("minilm").infer(
            inputs_embeds=embeds.detach(), attention_mask=batch["attention_mask"],
            backward=hookwire.Backward("last_hidden_state", return_input_grads=True),
            hooks=[hookwire.HookSpec("encoder.layer.4", backward_hook=hookwire.capture("grad_output"))])
    assert embeds.grad is not None
    assert torch.equal(result.input_kwargs_grads["inputs_embeds"], embeds.grad)
    assert torch.equal(result.events[0].grad_output[0], grads["out"])


async def test_offloaded_weights_read_and_the_map_shown(server: ServerThread, local: dict[str, Any]) -> None:
    plain = transformers.AutoModel.from_pretrained(str(minilm_folder()), local_files_only=True)
    names = ["encoder.layer.4.attention.self.query.weight", "encoder.layer.0.output.dense.bias", "pooler.dense.weight"]
    async with hookwire.connect(server.target) as client:
        model = client.model("minilm")
        weights = await model.parameters(*names)
        info = await model.info()
        auto = await client.model("minilm-auto").info()
    assert local["minilm"].encoder.layer[4].attention.self.query.weight.device.type == "meta"  # really offloaded
    for name in names:
        assert torch.equal(weights[name], plain.get_parameter(name).detach()), name
    assert info.device_map == MINILM_MAP
    # accelerate's own split under the CPU budget: some modules in memory, the rest on disk.
    assert set(auto.device_map.values()) == {"cpu", "disk"}, auto.device_map


def test_inspect_shows_the_map(server: ServerThread) -> None:
    """hookwire inspect (a real CLI process) marks the mapped modules and counts the devices."""
    out = subprocess.run([sys.executable, "-m", "hookwire._cli", "inspect", "minilm", "--target", server.target],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "device map: cpu 4, disk 4 (modules marked @ below" in out
    assert "[encoder.layer.3]  @disk" in out and "[embeddings]  @cpu" in out
    assert "[encoder.layer.3.attention]" in out and "[encoder.layer.3.attention]  @" not in out


async def test_auto_map_with_a_memory_budget_is_exact(server: ServerThread, local: dict[str, Any]) -> None:
    batch = _batch(local)
    plain = transformers.AutoModel.from_pretrained(str(minilm_folder()), local_files_only=True).eval()
    with torch.no_grad():
        expected = plain(**batch).last_hidden_state
    async with hookwire.connect(server.target) as client:
        out = await client.model("minilm-auto")(batch["input_ids"], attention_mask=batch["attention_mask"])
    assert torch.equal(out["last_hidden_state"], expected)


async def test_generation_with_an_offloaded_layer_equals_in_process_generate(server: ServerThread,
                                                                             local: dict[str, Any]) -> None:
    """Greedy decoding steered on the disk-offloaded layer 0, against transformers'
    generate() on the same map with the same torch hook; layer 0's events name the CPU."""
    lm = local["lm"]
    tokenizer = tiny_lm_tokenizer()
    prompt = tokenizer(["Once upon a time"], return_tensors="pt")
    steering = 4.0 * torch.randn(64, generator=torch.Generator().manual_seed(1))
    handle = lm.model.layers[0].register_forward_hook(lambda m, a, out: out + steering)
    try:
        with torch.no_grad():
            expected = lm.generate(**prompt, max_new_tokens=8, do_sample=False)
    finally:
        handle.remove()
    async with hookwire.connect(server.target) as client:
        result = await client.model("lm").generate(
            "Once upon a time", 8, do_sample=False,
            hooks=[hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(
                rules.add("output", steering), capture=("output",)))])
    new = expected[0, prompt["input_ids"].shape[1]:].tolist()
    assert list(result.token_ids[0])[:len(new)] == new
    assert result.events and all(e.devices == ("cpu",) for e in result.events)


# --- the config keys ------------------------------------------------------------------------


@pytest.mark.parametrize("entry, match", [
    ('transformers = "m"\ndevice_map = "everywhere"', r"model 'mine': device_map must be one of auto, balanced, "
                                                      r"balanced_low_0, sequential or a table"),
    ('transformers = "m"\ndevice_map = 3', r"device_map must be a strategy name or a non-empty table, not 3"),
    ('transformers = "m"\ndevice_map = {}', r"device_map must be a strategy name or a non-empty table"),
    ('transformers = "m"\ndevice_map = { encoder = "meta" }', r"device_map\['encoder'\] must be a GPU index, "
                                                              r"\"cpu\", \"disk\" or a device name"),
    ('transformers = "m"\ndevice_map = { encoder = -1 }', r"a GPU index must be >= 0, not -1"),
    ('transformers = "m"\ndevice_map = { encoder = true }', r"device_map\['encoder'\] must be a device"),
    ('transformers = "m"\ndevice_map = { encoder = "disk" }', r"sends modules to \"disk\": set offload_folder"),
    ('transformers = "m"\nmax_memory = { cpu = "1GiB" }', r"max_memory needs a device_map"),
    ('transformers = "m"\noffload_folder = "off"', r"offload_folder needs a device_map"),
    ('transformers = "m"\ndevice_map = "auto"\nmax_memory = { gpu = "1GiB" }',
     r"max_memory\['gpu'\] must be an accelerator index \(0, \"cuda:1\"\), \"cpu\", \"mps\" or \"disk\""),
    ('transformers = "m"\ntorch_dtype = ["bfloat16"]', r"torch_dtype must be one of"),
    ('transformers = "m"\ndevice_map = "auto"\noffload_folder = 5', r"offload_folder must be a path, not 5"),
    ('transformers = "m"\ndevice_map = "auto"\nmax_memory = { cpu = 0 }', r"max_memory\['cpu'\] must be bytes"),
    ('transformers = "m"\ndevice_map = "auto"\nmax_memory = { cpu = 1.5 }', r"max_memory\['cpu'\] must be bytes"),
    ('transformers = "m"\ntorch_dtype = "int8"', r"torch_dtype must be one of auto, float32, float16, bfloat16"),
    ('transformers = "m"\ndevice_map = "auto"\nkwargs = { device_map = "auto" }', r"device_map is set twice"),
    ('transformers = "m"\ntorch_dtype = "float16"\nkwargs = { dtype = "auto" }', r"torch_dtype is set twice"),
    ('factory = "hookwire_server.demo_models:mlp"\ndevice_map = "auto"',
     r"model 'mine': device_map applies to transformers folders only"),
    ('transformers = "m"\ndevice_map = "auto"\ndevice = "cpu"', r"set device or device_map, not both"),
    ('transformers = "m"\ndevice = "cpu"\nkwargs = { device_map = "auto" }', r"set device or device_map, not both"),
    ('factory = "hookwire_server.demo_models:mlp"\ndevice = "gpu7"', r"device must be a device name such as"),
    ('factory = "hookwire_server.demo_models:mlp"\ndevice = "meta"', r"device must be a device name such as"),
])
def test_config_refuses_bad_placement_keys(tmp_path: pathlib.Path, entry: str, match: str) -> None:
    path = tmp_path / "hookwire.toml"
    path.write_text(f'[[models]]\nname = "mine"\n{entry}\n')
    with pytest.raises(ConfigError, match=match):
        load_config_file(path)


@pytest.mark.parametrize("entry, match", [
    ('torch_dtype = ["float32"]', r"model 'mine': torch_dtype must be one of"),
    ('torch_dtype = { a = 1 }', r"model 'mine': torch_dtype must be one of"),
    ('device_map = "auto"\noffload_folder = 5', r"model 'mine': offload_folder must be a path"),
    ('device_map = "auto"\noffload_folder = ["x"]', r"model 'mine': offload_folder must be a path"),
])
def test_config_refuses_wrong_types_with_a_config_error(tmp_path: pathlib.Path, entry: str, match: str) -> None:
    """TOML gives any type: a list or table for torch_dtype, a number or list for
    offload_folder is a ConfigError naming the model and key (never a TypeError from
    comparing or joining it)."""
    path = tmp_path / "hookwire.toml"
    path.write_text(f'[[models]]\nname = "mine"\ntransformers = "m"\n{entry}\n')
    with pytest.raises(ConfigError, match=match):
        load_config_file(path)


def test_a_max_memory_device_name_reaches_accelerate_in_a_form_it_takes(tmp_path: pathlib.Path) -> None:
    """max_memory keys may be device names ("cuda:0", as ModelConfig documents), but
    accelerate takes only GPU indices, "mps", "cpu" and "disk" ("Device cuda:0 is not
    recognized"): the config turns "cuda:N" into N, and accelerate takes the result."""
    from accelerate.utils import get_max_memory

    path = tmp_path / "hookwire.toml"
    path.write_text('[[models]]\nname = "mine"\ntransformers = "m"\ndevice_map = "auto"\n'
                    'max_memory = { "cuda:0" = "1GiB", cpu = "1GiB" }\n')
    _, (config,) = load_config_file(path)
    max_memory = dict(config.placement_kwargs()["max_memory"])
    assert max_memory == {0: "1GiB", "cpu": "1GiB"}
    assert get_max_memory(max_memory) == {0: 1 << 30, "cpu": 1 << 30}  # accelerate's own check passes


def test_config_reads_placement_keys(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "hookwire.toml"
    path.write_text('[[models]]\nname = "big"\ntransformers = "m"\noffload_folder = "offload"\n'
                    'torch_dtype = "bfloat16"\nmax_memory = { 0 = "20GiB", "cuda:1" = 1000, cpu = "64GiB" }\n'
                    'device_map = { "model.embed_tokens" = 0, "model.layers.0" = "cuda:1", lm_head = "disk" }\n')
    _, (config,) = load_config_file(path)
    assert config.placement_kwargs() == {
        "device_map": {"model.embed_tokens": 0, "model.layers.0": "cuda:1", "lm_head": "disk"},
        "max_memory": {0: "20GiB", 1: 1000, "cpu": "64GiB"},  # TOML's string keys and "cuda:1" become indices
        "dtype": torch.bfloat16,
        "offload_folder": str(tmp_path / "offload"),  # relative to the config file
    }


def test_a_factory_model_on_a_named_device() -> None:
    host = build_host(ModelConfig(name="mine", factory="hookwire_server.demo_models:mlp", device="cpu"))
    assert host.device == torch.device("cpu") and host.device_map == {}


def test_a_device_that_is_not_there_fails_the_load_with_a_reason(lm_folder: str, tmp_path: pathlib.Path) -> None:
    """A map naming a GPU on a machine without one: the model fails to load (FAILED, with
    torch's or accelerate's reason), the config itself being well-formed."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(Exception) as failure:
        build_host(ModelConfig(name="mine", transformers=lm_folder, device_map={"": "cuda:0"}))
    assert load_failure(failure.value)
