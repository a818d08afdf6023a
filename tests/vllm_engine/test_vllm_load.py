"""Loading a vLLM model: sizes from the folder, a model that cannot run is FAILED at load
(never READY), and under ``--log-format json`` every line is JSON, vLLM's and its
processes' included. Two engine start-ups in all: one that fails its warm-up (in this
process) and one in worker processes under a real ``hookwire serve``."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import hookwire

from conftest import save_llama

TESTS = pathlib.Path(__file__).resolve().parent.parent


def test_a_model_vllm_starts_but_cannot_run_fails_at_load_with_vllms_reason(tmp_path, monkeypatch) -> None:
    """Head size 16: vLLM's CPU build starts the model and fails only in its first step
    ("Unsupported CPU attention configuration"), which used to fail the first call and
    the engine after the model was READY. The check before start-up is taken away here,
    so the warm-up step at load is what fails it, with vLLM's reason."""
    from hookwire_server.engine import vllm_engine
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ConfigError, ModelConfig

    folder = save_llama(tmp_path / "heads16", num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    monkeypatch.setattr(vllm_engine, "_check_cpu_attention", lambda *args: None)
    with pytest.raises(ConfigError, match=r"model 'heads16': vLLM started but could not run the model \(a one-token "
                                          r"warm-up failed\): RuntimeError: Unsupported CPU attention configuration: "
                                          r"head_dim=16"):
        build_host(ModelConfig(name="heads16", transformers=str(folder), engine="vllm",
                               vllm={"kv_cache_bytes": 16 << 20, "worker_processes": False, "enforce_eager": True}))


def _reader(stream: Any, lines: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_json_logs_of_a_vllm_model_in_worker_processes_and_its_sizes_from_the_folder(tmp_path) -> None:
    """``hookwire serve --log-format json`` serving a 512-position Llama in vLLM's worker
    processes with no size settings (it used to ask vLLM for max_model_len 2048, which vLLM
    refuses), beside a head-size-16 Llama (refused before vLLM starts, naming the head size):
    the first serves with max_model_len 512, the second is FAILED with the reason, and
    every line on stdout and stderr is JSON, the server's own, vLLM's engine process's and
    its worker's included (they say which process they come from)."""
    long = save_llama(tmp_path / "long", max_position_embeddings=512)
    heads = save_llama(tmp_path / "heads16", num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    config = tmp_path / "models.toml"
    config.write_text(
        f'[[models]]\nname = "long"\ntransformers = "{long}"\nengine = "vllm"\n'
        # Worker processes, and a KV cache the suite's bound allows: no length, budget or sequences set.
        # Eager: the suite's compiled start-ups are the two servers of conftest.MODES.
        '[models.vllm]\nworker_processes = true\nkv_cache_bytes = 33554432\nenforce_eager = true\n\n'
        f'[[models]]\nname = "heads16"\ntransformers = "{heads}"\nengine = "vllm"\n'
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), *env.get("PYTHONPATH", "").split(os.pathsep)] if p)
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "hookwire._cli", "serve", "--port", "0", "--log-format", "json",
                             "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    out: list[str] = []
    err: list[str] = []
    readers = [_reader(proc.stdout, out), _reader(proc.stderr, err)]
    try:
        target = _wait_for_target(proc, out, err)
        asyncio.run(_check_models(target))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        for reader in readers:
            reader.join(30)
    not_json = [line for line in out + err if line.strip() and not _is_json_object(line)]
    assert not not_json, "\n".join(not_json[:20])
    records = [json.loads(line) for line in out + err if line.strip()]
    vllm = [r for r in records if str(r.get("logger", "")).startswith("vllm")]
    processes = {str(r.get("vllm_process_name", "")) for r in vllm}
    assert any(p.startswith("EngineCore") for p in processes), processes
    assert any(p.startswith("Worker") or p.startswith("VllmWorker") for p in processes), processes
    assert any("heads16" in r.get("message", "") and "head size 16" in r.get("message", "") for r in records), (
        "no line says why heads16 failed")


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _wait_for_target(proc: subprocess.Popen[str], out: list[str], err: list[str]) -> str:
    """The server's address, from its "serving" line (text or JSON) once it serves."""
    deadline = time.monotonic() + 600  # vLLM's start-up on a busy 2-core machine, generously
    while time.monotonic() < deadline:
        for line in list(out):
            message = json.loads(line).get("message", "") if _is_json_object(line) else line
            if "serving" in message and " on " in message:
                return message.rsplit(" ", 1)[-1].strip()
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {out[-20:]} {err[-40:]}")
        time.sleep(0.5)
    raise AssertionError(f"server did not start: {out[-20:]} {err[-40:]}")


async def _check_models(target: str) -> None:
    async with hookwire.connect(target) as client:
        listed = {m.name: m for m in await client.list_models()}
        assert listed["long"].state == "ready", listed["long"]
        assert listed["heads16"].state == "failed"
        assert "head size 16" in listed["heads16"].state_message and "CPU attention" in listed["heads16"].state_message
        model = client.model("long")
        # Serving at all is the check of its length (vLLM refuses one past the folder's 512);
        # the position check before the engine's own says the same limit.
        with pytest.raises(hookwire.InvalidArgumentError, match=r"pass the 512 positions|max_model_len 512"):
            await model.generate(["hello"], 600)
        assert (await model.generate(["hello"], 2)).steps == 2



def test_the_ray_executor_is_refused_before_vllm_starts_where_it_cannot_serve(llama_folder: pathlib.Path) -> None:
    """vllm.distributed_executor_backend "ray": vLLM's CPU build refuses Ray, and says so
    only inside its engine process ("Engine core initialization failed"): hookwire refuses
    it at once with vLLM's reason; an executor vLLM does not have is a config error."""
    from hookwire_server.engine.core import build_host
    from hookwire_server.models.model_loading import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match=r"model 'r': vllm.distributed_executor_backend \"ray\": vLLM's CPU build "
                                          r"does not run Ray \(\"current platform cpu does not support ray\"\)"):
        build_host(ModelConfig(name="r", transformers=str(llama_folder), engine="vllm",
                               vllm={"distributed_executor_backend": "ray", "link_address": "127.0.0.1:0"}))
    with pytest.raises(ConfigError, match=r"vllm.distributed_executor_backend must be one of mp, ray, not 'slurm'"):
        ModelConfig(name="r", transformers=str(llama_folder), engine="vllm",
                    vllm={"distributed_executor_backend": "slurm"}).check()


def test_worker_processes_are_the_default_and_a_taken_link_address_is_refused_before_vllm_starts(
        llama_folder, monkeypatch) -> None:
    """A model without ``worker_processes`` runs in vLLM's processes (tensor parallel and
    Ray always do); the link listens before vLLM starts, so a port in use is a ConfigError
    naming the setting before vLLM is started at all (it would take minutes)."""
    import socket

    from hookwire_server.engine import vllm_engine
    from hookwire_server.engine.core import build_host
    from hookwire_server.engine.vllm_engine import uses_worker_processes
    from hookwire_server.models.model_loading import ConfigError, ModelConfig

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("vLLM was started")

    monkeypatch.setattr(vllm_engine, "_start_llm", never)
    assert uses_worker_processes({}) and not uses_worker_processes({"worker_processes": False})
    assert uses_worker_processes({"worker_processes": False, "tensor_parallel_size": 2})
    assert uses_worker_processes({"worker_processes": False, "distributed_executor_backend": "ray"})
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"model 'x': the link to vLLM's workers cannot listen on "
                                              rf"vllm.link_address '127.0.0.1:{port}': Address already in use"):
            build_host(ModelConfig(name="x", transformers=str(llama_folder), engine="vllm",
                                   vllm={"link_address": f"127.0.0.1:{port}", "kv_cache_bytes": 16 << 20,
                                         "enforce_eager": True}))
    finally:
        taken.close()
