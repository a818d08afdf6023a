"""`hookwire serve` as an operator runs it, in a subprocess: a Hugging Face folder from
--model alone, and JSON logs in which every line is JSON and each RPC leaves an audit
line naming the principal and the request ids."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
from typing import Any

import grpc
import pytest
import torch

import hookwire
from hookwire.v1 import model_service_pb2, model_service_pb2_grpc
from support import minilm_folder

HOOKWIRE = [sys.executable, "-m", "hookwire._cli"]
TESTS = pathlib.Path(__file__).resolve().parent.parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOOKWIRE_", "TQDM_", "HF_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


class _Served:
    """A ``hookwire serve`` subprocess: stdout read line by line, stderr into a file."""

    def __init__(self, *args: str, **env: str) -> None:
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([*HOOKWIRE, "serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, env=_env(**env))
        self.out: list[str] = []

    def line(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.err.seek(0)
            raise AssertionError(f"hookwire serve ended (status {self.proc.wait(30)}): {self.err.read()}")
        self.out.append(line)
        return line

    def stop(self) -> tuple[list[str], list[str]]:
        """SIGTERM, then (stdout lines, stderr lines) once it exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        # Through the same text buffer as line(): communicate() reads the pipe itself and
        # would miss what readline() already buffered.
        self.out += self.proc.stdout.read().splitlines(keepends=True)  # type: ignore[union-attr]
        self.err.seek(0)
        return [line.rstrip("\n") for line in self.out], self.err.read().splitlines()


def test_serve_model_flag_serves_a_hugging_face_folder(tmp_path: pathlib.Path) -> None:
    served = _Served("--model", f"mini={minilm_folder()}")
    try:
        banner = served.line()
        assert banner.startswith("hookwire serving mini on 127.0.0.1:"), banner
        target = banner.rsplit(" ", 1)[-1].strip()

        async def use() -> tuple[list[str], Any]:
            async with hookwire.connect(target) as client:
                names = [m.name for m in await client.list_models()]
                ids = torch.tensor([[101, 7592, 2088, 102]])
                out = await client.model("mini")(ids, attention_mask=torch.ones_like(ids))
                return names, out

        names, out = asyncio.run(use())
    finally:
        served.stop()
    assert names == ["mini"]
    assert tuple(out["last_hidden_state"].shape) == (1, 4, 384)
    assert served.proc.returncode == 0


def test_model_flag_tells_folders_from_factories(tmp_path: pathlib.Path) -> None:
    from hookwire_server.models.model_loading import ConfigError, parse_model_flag

    folder = parse_model_flag(f"mini={minilm_folder()}")
    assert folder.transformers == str(minilm_folder().resolve()) and folder.factory is None
    factory = parse_model_flag("m=support:sleeper_factory", parameters_readable=True)
    assert factory.factory == "support:sleeper_factory" and factory.transformers is None and factory.parameters_readable
    with pytest.raises(ConfigError, match=f"the folder {tmp_path} holds no config.json"):
        parse_model_flag(f"x={tmp_path}")
    with pytest.raises(ConfigError, match="expected NAME=package.module:factory or NAME=FOLDER"):
        parse_model_flag(f"x={tmp_path / 'missing'}")


def test_json_logs_are_json_on_every_line_and_name_who_called_what(tmp_path: pathlib.Path) -> None:
    from hookwire_server.auth import hash_token, new_token

    token = new_token()
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(f"alice:user:{hash_token(token)}\n")
    # TRANSFORMERS_VERBOSITY=info: tiny-lm's load logs through transformers' own handler,
    # which must not write text lines of its own.
    served = _Served("--log-format", "json", "--tokens-file", str(tokens), "--metrics-port", "0",
                     TRANSFORMERS_VERBOSITY="info", PYTHONWARNINGS="always")
    try:
        banner = json.loads(served.line())
        target = banner["target"]
        assert banner["message"] == f"hookwire serving mlp, tiny-transformer, tiny-lm on {target}"
        assert banner["models"] == ["mlp", "tiny-transformer", "tiny-lm"] and banner["logger"] == "hookwire.serve"

        async def calls() -> str:
            async with hookwire.connect(target, options=hookwire.ConnectOptions(token=token)) as client:
                result = await client.model("mlp").infer(torch.randn(1, 8))
                await client.model("tiny-lm").generate("Hi", 2)
            async with grpc.aio.insecure_channel(target) as channel:
                stub = model_service_pb2_grpc.ModelServiceStub(channel)
                await stub.ListModels(model_service_pb2.ListModelsRequest(),
                                      metadata=(("authorization", f"Bearer {token}"), ("x-request-id", "trace-42")))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ListModels(model_service_pb2.ListModelsRequest(),
                                          metadata=(("authorization", "Bearer nope"), ("x-request-id", "trace-43")))
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await stub.ListModels(model_service_pb2.ListModelsRequest(),
                                          metadata=(("authorization", f"Bearer {token}"), ("x-request-id", "a b")))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "x-request-id metadata: expected 1 to 128 visible ASCII" in (bad.value.details() or "")
            return result.request_id

        request_id = asyncio.run(calls())
    finally:
        out, err = served.stop()
    assert served.proc.returncode == 0, err
    records = []
    for line in out + err:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise AssertionError(f"a line that is not JSON: {line!r}") from None
    assert {r["message"].split(":")[0] for r in records if r["logger"] == "hookwire.serve"} >= {
        "metrics on http", "also serving grpc.health.v1.Health, reflection; logs", "security", "settings"}
    assert any(r["logger"].startswith("transformers") for r in records), "transformers logged nothing: no check"
    audit = [r for r in records if r["logger"] == "hookwire.audit"]
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in audit:
        by_method.setdefault(r["method"], []).append(r)
        assert {"principal", "request_id", "client_request_id", "code", "duration_ms"} <= set(r), r
    (infer,) = by_method["Infer"]
    assert infer["principal"] == "alice" and infer["code"] == "OK" and infer["request_id"] == request_id
    # The call's own line (and every line of the RPC) names the same principal and id.
    assert any(r["message"] == "infer ok" and r["request_id"] == request_id and r["principal"] == "alice"
               for r in records)
    (generate,) = by_method["Generate"]
    # The SDK reads the stream's status after its result message: the call ends OK, not
    # CANCELLED by the channel closing right after it.
    assert generate["principal"] == "alice" and generate["code"] == "OK"
    assert any(r["message"] == "generate ok" and r["request_id"] == generate["request_id"] for r in records)
    listed = {r["client_request_id"]: r for r in by_method["ListModels"]}
    assert listed["trace-42"]["principal"] == "alice" and listed["trace-42"]["code"] == "OK"
    assert listed["trace-43"]["code"] == "UNAUTHENTICATED" and listed["trace-43"]["principal"] == "(unauthenticated)"
    assert listed[""]["code"] == "INVALID_ARGUMENT"  # the malformed id is not logged as it is
    assert len({r["request_id"] for r in audit}) == len(audit)
