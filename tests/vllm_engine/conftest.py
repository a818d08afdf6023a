"""The vLLM engine's tests: they run in an environment of their own with vLLM's pins
(`make test` builds .venv-vllm; vLLM 0.32 pins transformers < 5.20), and are skipped
where vLLM is not installed (the main suite's environment).

One engine start-up serves most of the tests (the session's `vllm_server`): a seeded
Llama (hidden 128, 2 layers, tiny-lm's tokenizer) saved as a transformers folder, built
in code, nothing downloaded. One more engine (256 KiB of KV cache) is started by the
scheduling and fault-injection test, and vLLM refuses a third before it allocates anything; KV caches
of at most 64 MiB (the issue's bound: 3 start-ups, 512 MiB).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Iterator

import pytest

pytest.importorskip("vllm", reason="the vLLM engine's tests run in .venv-vllm (make test)")

import torch  # noqa: E402

from hookwire_server import ModelRegistry, ServerSettings  # noqa: E402
from hookwire_server.demo_models import tiny_lm_tokenizer  # noqa: E402
from hookwire_server.engine.core import build_host  # noqa: E402
from hookwire_server.models.model_loading import ModelConfig  # noqa: E402
from support import ServerThread  # noqa: E402

#: The engine's KV cache in the tests (the issue's bound: at most 512 MiB).
KV_CACHE_BYTES = 64 << 20

#: The two ways vLLM runs a model: eagerly (every module takes hooks) and compiled (hooks
#: at the taps compiled in: engine/vllm_taps.py). The session's server and the worker
#: processes' server run every test of theirs in both: the suite's two compiled engine
#: start-ups. Every other engine a test starts runs eagerly (each compiled start-up costs
#: a cold compilation in CI's clean clone).
MODES = ("eager", "compiled")


def mode_settings(mode: str, tap_points: list[str] | None = None) -> dict[str, Any]:
    """The ``[models.vllm]`` settings of ``mode``: enforce_eager, or compiled with the
    default tap points (or ``tap_points``)."""
    if mode == "eager":
        return {"enforce_eager": True}
    return {"tap_points": tap_points} if tap_points else {}


def save_llama(folder: pathlib.Path, seed: int = 0, **overrides: Any) -> pathlib.Path:
    """A seeded LlamaForCausalLM (float32, 128 hidden, 2 layers, head size 64) with tiny-lm's
    tokenizer, saved with save_pretrained; ``overrides``: LlamaConfig's arguments changed."""
    import transformers

    tokenizer = tiny_lm_tokenizer()
    arguments: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    config = transformers.LlamaConfig(**{**arguments, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def oracle(llama_folder: pathlib.Path) -> Any:
    """The same folder in transformers, in this process (eager attention): the oracle."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(str(llama_folder), attn_implementation="eager").eval()
    return model


#: Texts of the harvest tests' source (harvest_data_root/docs.jsonl).
DOCS = [
    "The cat sat on the mat.",
    "Hooks see every layer of the model, and the data is written to shards.",
    "Hello world",
    "Interpretability researchers harvest activations by the billions of tokens.",
    "A short one.",
    "the of and to in is it that was for on are with as at be this have from or one by not",
]


@pytest.fixture(scope="session")
def harvest_roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    with open(data / "docs.jsonl", "w") as f:
        for doc in DOCS:
            f.write(json.dumps({"text": doc}) + "\n")
    return data, out


@pytest.fixture(scope="session", params=MODES)
def vllm_server(request: pytest.FixtureRequest, llama_folder: pathlib.Path,
                harvest_roots: tuple[pathlib.Path, pathlib.Path]) -> Iterator[ServerThread]:
    """A real server whose model "llama" runs on the vLLM engine (in-process vLLM), eager
    or compiled with the default tap points (``MODES``: each test runs in both), beside
    "llama-torch", the same folder on the torch engine; harvest jobs enabled; both with
    readable parameters; the OpenAI-compatible front on a free port (server.openai_port)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    host = build_host(ModelConfig(
        name="llama", transformers=str(llama_folder), engine="vllm",
        # 32-token KV blocks: a prompt of this small model fills whole blocks, which vLLM's
        # prefix cache shares (calls no hook touches).
        # In-process (worker_processes = false): these tests read the engine's own state.
        vllm={"max_model_len": 128, "max_num_seqs": 8, "kv_cache_bytes": KV_CACHE_BYTES, "block_size": 32,
              "worker_processes": False, **mode_settings(request.param)},
        parameters_readable=True,
    ))
    torch_host = build_host(ModelConfig(name="llama-torch", transformers=str(llama_folder), attn_implementation="eager",
                                        parameters_readable=True))
    data, out = harvest_roots
    # openai_port=0: the OpenAI-compatible front too, on a free port (test_openai_front.py).
    settings = ServerSettings(port=0, harvest_data_root=str(data), harvest_output_root=str(out), openai_port=0)
    srv = ServerThread(ModelRegistry([host, torch_host]), settings).start()
    yield srv
    srv.stop()
