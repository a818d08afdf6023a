"""The hookwire command, run as a real process: serve, models, inspect; models from factories and configs."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

from hookwire_server.demo_models import MLP

HOOKWIRE = [sys.executable, "-m", "hookwire._cli"]
TESTS = pathlib.Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


class Served:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*HOOKWIRE, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=_env(),
        )
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            raise AssertionError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.banner = line.strip()
        self.target = line.rsplit(" ", 1)[-1].strip()

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*HOOKWIRE, *args, "--target", self.target], capture_output=True, text=True, timeout=60)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def demo() -> Iterator[Served]:
    served = Served()
    yield served
    assert served.stop() == 0


def test_serve_defaults_to_demo_models_on_loopback(demo: Served) -> None:
    assert "mlp" in demo.banner and "tiny-transformer" in demo.banner
    assert demo.target.startswith("127.0.0.1:")


def test_models_command(demo: Served) -> None:
    out = demo.run("models")
    assert out.returncode == 0, out.stderr
    names = [line.split("\t")[0] for line in out.stdout.splitlines()]
    assert names == ["mlp", "tiny-transformer"]


def test_inspect_command(demo: Served) -> None:
    out = demo.run("inspect", "tiny-transformer")
    assert out.returncode == 0, out.stderr
    assert "qkv (Linear)  weight [96, 32] float32, bias [96] float32    [encoder.layers.0.attn.qkv]" in out.stdout
    missing = demo.run("inspect", "nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_factory_flag_and_config_with_safetensors_weights(tmp_path: pathlib.Path) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(42)
        trained = MLP().eval()
    weights = tmp_path / "mlp.safetensors"
    save_file(trained.state_dict(), str(weights))
    config = tmp_path / "hookwire.toml"
    config.write_text(
        '[[models]]\nname = "mlp42"\nfactory = "hookwire_server.demo_models:MLP"\n'
        'weights = "mlp.safetensors"\ntraining_allowed = false\ndescription = "trained"\n'
    )
    served = Served("--config", str(config), "--model", "scale=support:scale_factory")
    try:
        assert served.banner.startswith("hookwire serving mlp42, scale on")
        listing = served.run("models").stdout
        assert "mlp42\teval only\ttrained" in listing
        import asyncio

        import hookwire

        async def check() -> None:
            async with hookwire.connect(served.target) as client:
                x = torch.randn(2, 8)
                assert torch.equal(await client.model("mlp42")(x), trained(x))
                assert torch.equal(await client.model("scale")(x), x * 2)

        asyncio.run(check())
    finally:
        assert served.stop() == 0


def test_pickled_weights_are_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"fc1.weight": torch.zeros(1), "payload": pathlib.Path("/")}, path)  # not a plain tensor dict
    config = tmp_path / "c.toml"
    config.write_text(f'[[models]]\nname = "m"\nfactory = "hookwire_server.demo_models:MLP"\nweights = "{path}"\n')
    proc = subprocess.run([*HOOKWIRE, "serve", "--port", "0", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert "refused by torch.load(weights_only=True)" in proc.stderr


def test_bad_model_flag_is_reported() -> None:
    proc = subprocess.run([*HOOKWIRE, "serve", "--model", "nonsense"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "NAME=package.module:factory" in proc.stderr
