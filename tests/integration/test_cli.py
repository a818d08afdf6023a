"""The hookwire command, run as a real process: serve, models, inspect; models from factories and configs."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
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
        # The log goes to a file: an undrained pipe would fill up and stall the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [*HOOKWIRE, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=_env(),
        )
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(f"server did not start: {line!r} {self.log.read()}")
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


def test_tap_shows_live_stats_and_removes_its_hook_on_ctrl_c(demo: Served) -> None:
    import asyncio as _asyncio
    import time as _time

    import hookwire

    tap = subprocess.Popen(
        [*HOOKWIRE, "tap", "tiny-transformer", "encoder.layers.*", "--stats", "--every", "2", "--interval", "0.3",
         "--plain", "--target", demo.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )

    async def traffic() -> list:
        async with hookwire.connect(demo.target) as client:
            for _ in range(50):  # wait for the tap's hook
                if await client.list_hooks(model="tiny-transformer"):
                    break
                await _asyncio.sleep(0.1)
            hooks = await client.list_hooks(model="tiny-transformer")
            ids = torch.randint(0, 64, (2, 6))
            end = _time.monotonic() + 2.0
            while _time.monotonic() < end:
                await client.model("tiny-transformer")(ids)
            return hooks

    try:
        hooks = _asyncio.run(traffic())
        assert len(hooks) == 1 and hooks[0].scope == "all"
        _time.sleep(0.8)
        tap.send_signal(signal.SIGINT)
        out, err = tap.communicate(timeout=30)
    finally:
        tap.kill()
    assert tap.returncode == 0, err
    assert "encoder.layers.0" in out and "encoder.layers.1" in out and "calls/s" in out and "mean" in out
    last_table = out.strip().split("\n\n")[-2] if "tap stopped" in out.strip().split("\n\n")[-1] else out
    rows = [line.split() for line in last_table.splitlines() if line.startswith("encoder.layers.")]
    assert rows and all(int(row[2]) > 0 for row in rows), last_table  # events arrived
    assert all(row[3] != "-" for row in rows)  # a mean is shown
    listing = demo.run("hooks", "list")
    assert listing.returncode == 0 and "encoder.layers.*" not in listing.stdout


def test_hooks_list_and_rm(demo: Served) -> None:
    import asyncio as _asyncio

    import hookwire

    async def register() -> str:
        async with hookwire.connect(demo.target) as client:
            handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
            return handle.id

    hook_id = _asyncio.run(register())
    listing = demo.run("hooks", "list", "--model", "mlp")
    assert listing.returncode == 0, listing.stderr
    assert hook_id in listing.stdout and "fc1" in listing.stdout and "expires" in listing.stdout
    removed = demo.run("hooks", "rm", hook_id)
    assert removed.returncode == 0 and f"{hook_id}: removed" in removed.stdout
    again = demo.run("hooks", "rm", hook_id)
    assert again.returncode == 1 and "not found" in again.stdout
    assert hook_id not in demo.run("hooks", "list").stdout
