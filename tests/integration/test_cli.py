"""The hookwire command, run as a real process: serve, models, inspect; models from factories and configs."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Iterator

import pytest
import torch
from safetensors.torch import save_file

import lm_oracle
from hookwire_server.demo_models import MLP

HOOKWIRE = [sys.executable, "-m", "hookwire._cli"]
TESTS = pathlib.Path(__file__).resolve().parent.parent


#: The console script a user runs: unlike ``python -m``, it does not put the working
#: directory on the import path. (-P gives the same where the script is missing.)
SCRIPT = pathlib.Path(sys.executable).with_name("hookwire")
CONSOLE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-P", "-m", "hookwire._cli"]


#: The hookwire command (its main(), as the console script runs it), then on stderr's
#: last line the heavy packages the run imported: issue #14's fast CLI, where commands
#: that move no tensors import no torch (seconds). Checked by sys.modules, never by time.
TRACED = [sys.executable, "-c", (
    "import sys\n"
    "from hookwire._cli import main\n"
    "try:\n"
    "    status = main(sys.argv[1:])\n"
    "finally:\n"
    "    heavy = ('torch', 'transformers', 'datasets', 'pyarrow', 'safetensors', 'fsspec', 'pandas', 'tqdm')\n"
    "    print('imported:', sorted({m.split('.')[0] for m in sys.modules} & set(heavy)), file=sys.stderr)\n"
    "sys.exit(status)\n"
)]


def _imported(stderr: str) -> str:
    """The heavy packages a TRACED run imported, as its last stderr line says them."""
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    assert last.startswith("imported: "), stderr
    return last.removeprefix("imported: ")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # No empty entries: an empty PYTHONPATH entry would put the working directory on the path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), *env.get("PYTHONPATH", "").split(os.pathsep)] if p)
    return env


class Served:
    def __init__(self, *args: str, command: list[str] = HOOKWIRE, cwd: pathlib.Path | None = None) -> None:
        # The log goes to a file: an undrained pipe would fill up and stall the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [*command, "serve", "--port", "0", *args], stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=_env(), cwd=cwd,
        )
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(f"server did not start: {line!r} {self.log.read()}")
        self.banner = line.strip()
        self.target = line.rsplit(" ", 1)[-1].strip()

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*HOOKWIRE, *args, "--target", self.target], capture_output=True, text=True, timeout=300)

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
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    assert [row[0] for row in rows] == ["mlp", "tiny-transformer", "tiny-lm"]
    assert [row[1] for row in rows] == ["ready", "ready", "ready"]


def test_inspect_command(demo: Served) -> None:
    out = demo.run("inspect", "tiny-transformer")
    assert out.returncode == 0, out.stderr
    assert "qkv (Linear)  weight [96, 32] float32, bias [96] float32    [encoder.layers.0.attn.qkv]" in out.stdout
    assert "\nengine: torch\n" in out.stdout  # the torch engine refuses nothing
    missing = demo.run("inspect", "nope")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_parameters_command_prints_and_saves_weights(demo: Served, tmp_path: pathlib.Path) -> None:
    from safetensors.torch import load_file

    from hookwire_server.demo_models import tiny_transformer

    out_file = tmp_path / "w.safetensors"
    out = demo.run("parameters", "tiny-transformer", "encoder.layers.*.attn.qkv.weight", "--out", str(out_file))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].split("\t")[:3] == ["encoder.layers.0.attn.qkv.weight", "[96, 32]", "float32"]
    saved = load_file(str(out_file))
    local = dict(tiny_transformer().named_parameters())
    assert sorted(saved) == ["encoder.layers.0.attn.qkv.weight", "encoder.layers.1.attn.qkv.weight"]
    for name, value in saved.items():
        assert torch.equal(value, local[name])
    cast = demo.run("parameters", "tiny-transformer", "embed.weight", "--dtype", "bfloat16", "--no-progress")
    assert cast.returncode == 0 and "\tbfloat16\t" in cast.stdout
    missing = demo.run("parameters", "tiny-transformer", "no.such.weight")
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
        assert "mlp42\tready\teval only\ttrained" in listing
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


def test_parameters_readable_flag_applies_to_the_model_flags_only(tmp_path: pathlib.Path) -> None:
    config = tmp_path / "hookwire.toml"
    config.write_text('[[models]]\nname = "private"\nfactory = "hookwire_server.demo_models:mlp"\n')
    served = Served("--config", str(config), "--model", "open=hookwire_server.demo_models:mlp", "--parameters-readable")
    try:
        readable = served.run("parameters", "open", "fc1.weight", "--no-progress")
        assert readable.returncode == 0, readable.stderr
        assert readable.stdout.split("\t")[:3] == ["fc1.weight", "[32, 8]", "float32"]
        import asyncio

        import hookwire
        from hookwire_server.demo_models import mlp

        async def check() -> None:
            async with hookwire.connect(served.target) as client:
                assert (await client.model("open").info()).parameters_readable
                weights = await client.model("open").parameters("**")
                assert list(weights) == [name for name, _ in mlp().named_parameters()]
                assert all(torch.equal(weights[n], p) for n, p in mlp().named_parameters())
                with pytest.raises(hookwire.FailedPreconditionError, match=r"--parameters-readable"):
                    await client.model("private").parameters("**")

        asyncio.run(check())
        refused = served.run("parameters", "private", "fc1.weight", "--no-progress")
        assert refused.returncode == 1 and "FAILED_PRECONDITION" in refused.stderr
    finally:
        assert served.stop() == 0
    alone = subprocess.run([*HOOKWIRE, "serve", "--port", "0", "--parameters-readable"], capture_output=True,
                           text=True, timeout=120, env={**_env(), "HOOKWIRE_MODELS": ""})
    assert alone.returncode == 2 and "--parameters-readable applies to the --model" in alone.stderr, alone.stderr


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

    tap = subprocess.Popen(  # TRACED: the tap's events carry summaries, not tensors, so it imports no torch
        [*TRACED, "tap", "tiny-transformer", "encoder.layers.*", "--stats", "--every", "2", "--interval", "0.3",
         "--plain", "--target", demo.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )

    import threading as _threading

    lines: list[str] = []
    reader = _threading.Thread(target=lambda: lines.extend(tap.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()

    def events_shown() -> bool:
        """Whether the tap has drawn a table in which both layers counted events."""
        rows = [line.split() for line in list(lines) if line.startswith("encoder.layers.")]
        seen = {row[0] for row in rows if len(row) > 3 and row[2].isdigit() and int(row[2]) > 0 and row[3] != "-"}
        return {"encoder.layers.0", "encoder.layers.1"} <= seen

    async def traffic() -> list:
        async with hookwire.connect(demo.target) as client:
            for _ in range(600):  # wait for the tap's hook (a liveness bound, not a speed claim)
                if await client.list_hooks(model="tiny-transformer"):
                    break
                await _asyncio.sleep(0.1)
            hooks = await client.list_hooks(model="tiny-transformer")
            ids = torch.randint(0, 64, (2, 6))
            # Calls until the tap has shown their events: however slow the machine, never by the clock alone.
            end = _time.monotonic() + 120
            while not events_shown() and _time.monotonic() < end:
                await client.model("tiny-transformer")(ids)
            return hooks

    try:
        hooks = _asyncio.run(traffic())
        assert len(hooks) == 1 and hooks[0].scope == "all"
        tap.send_signal(signal.SIGINT)
        tap.wait(60)
        reader.join(60)
        err = tap.stderr.read()  # type: ignore[union-attr]
        out = "".join(lines)
    finally:
        tap.kill()
    assert tap.returncode == 0, err
    assert _imported(err) == "[]", err
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
    assert hook_id not in demo.run("hooks", "list").stdout


def test_hooks_rm_is_idempotent_like_handle_remove(demo: Served) -> None:
    import asyncio as _asyncio

    import hookwire

    async def register() -> str:
        async with hookwire.connect(demo.target) as client:
            handle = await client.model("mlp").hook("fc1", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
            return handle.id

    hook_id = _asyncio.run(register())
    assert demo.run("hooks", "rm", hook_id).returncode == 0
    again = demo.run("hooks", "rm", hook_id)  # already removed: the goal holds, so it succeeds
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{hook_id}: already gone" in again.stdout
    never = demo.run("hooks", "rm", "hk_" + "0" * 32)  # well-formed, never registered: the same
    assert never.returncode == 0 and "already gone" in never.stdout

    kept = _asyncio.run(register())
    malformed = demo.run("hooks", "rm", kept, "hk_123")  # a typo is an error, and nothing is removed
    assert malformed.returncode == 2 and "not a hook id: 'hk_123'" in malformed.stderr
    assert kept in demo.run("hooks", "list").stdout
    assert "already gone" in demo.run("hooks", "rm", "--help").stdout
    assert demo.run("hooks", "rm", kept).returncode == 0


def test_commands_that_move_no_tensors_import_no_torch(demo: Served) -> None:
    import asyncio as _asyncio

    import hookwire

    async def register() -> str:
        async with hookwire.connect(demo.target) as client:
            handle = await client.model("mlp").hook("fc2", posthook=hookwire.capture(), scope="all", ttl_seconds=60)
            return handle.id

    hook_id = _asyncio.run(register())

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*TRACED, *args], capture_output=True, text=True, timeout=300, env=_env())
        assert proc.returncode == 0, proc.stderr
        assert _imported(proc.stderr) == "[]", (args, proc.stderr)
        return proc

    assert "SERVING" in run("health", demo.target).stdout
    assert run("models", "--target", demo.target).stdout.startswith("mlp\tready")
    assert "[encoder.layers.0.attn.qkv]" in run("inspect", "tiny-transformer", "--target", demo.target).stdout
    assert hook_id in run("hooks", "list", "--model", "mlp", "--target", demo.target).stdout
    assert f"{hook_id}: removed" in run("hooks", "rm", hook_id, "--target", demo.target).stdout
    assert "usage: hookwire" in run("--help").stdout
    assert "token file line: alice:user:" in run("token", "new", "alice").stdout


def test_generate_prints_the_text_of_in_process_generate(demo: Served) -> None:
    ids, mask = lm_oracle.batch(["Hello world"])
    (greedy,) = lm_oracle.generate(ids, mask, 8)  # the model's generation_config: greedy
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout == lm_oracle.text(greedy) + "\n"
    assert out.stderr.strip() == f"finish: {'eos' if greedy[-1] == lm_oracle.EOS else 'length'}, {len(greedy)} new tokens"

    (sampled,) = lm_oracle.generate(ids, mask, 8, seed=7, do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--do-sample", "--seed", "7",
                   "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9")
    assert out.returncode == 0, out.stderr
    assert out.stdout == lm_oracle.text(sampled) + "\n" and "seed 7" in out.stderr
    assert demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--greedy").stdout == lm_oracle.text(greedy) + "\n"

    # A stop string ends the text (and stays in it).
    (stopped,) = lm_oracle.generate(ids, mask, 8, stop_strings=[" hello"], tokenizer=lm_oracle.tokenizer())
    assert len(stopped) < len(greedy) and lm_oracle.text(stopped).endswith(" hello")
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--stop", " hello", "--stop", "never")
    assert out.stdout == lm_oracle.text(stopped) + "\n" and out.stderr.startswith("finish: stop,"), out.stderr


def test_generate_steers_with_a_hook_from_a_json_file(demo: Served, tmp_path: pathlib.Path) -> None:
    import hookwire
    from google.protobuf import json_format

    vector = torch.randn(64, generator=torch.Generator().manual_seed(1)) * 4
    spec = hookwire.HookSpec("model.layers.0", posthook=[hookwire.rules.add("output", vector)], steps=(1, None))
    path = tmp_path / "steer.json"
    path.write_text(json_format.MessageToJson(spec.to_proto()))
    ids, mask = lm_oracle.batch(["Hello world"])
    with lm_oracle.forward_hook("model.layers.0", lambda step, out: out + vector if step >= 1 else None):
        (steered,) = lm_oracle.generate(ids, mask, 8)
    assert steered != lm_oracle.generate(ids, mask, 8)[0]
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--hook", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout == lm_oracle.text(steered) + "\n" and out.stderr.rstrip().endswith("0 hook events")

    path.write_text('{"module": "model.layers.0", "posthook": {"rules": [{"target": "output", "nope": {}}]}}')
    bad = demo.run("generate", "tiny-lm", "Hello world", "--hook", str(path))
    assert bad.returncode == 2 and f"--hook {path}: not a HookSpec" in bad.stderr and "Traceback" not in bad.stderr
    missing = demo.run("generate", "tiny-lm", "Hello world", "--hook", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "absent.json" in missing.stderr
    wrong = demo.run("generate", "mlp", "Hello world")
    assert wrong.returncode == 1 and "UNIMPLEMENTED: model 'mlp' cannot generate" in wrong.stderr


def test_generate_with_a_probe_gated_stop_from_a_json_file(demo: Served, tmp_path: pathlib.Path) -> None:
    """The CLI takes issue 25's rules as any HookSpec JSON: a stop rule ends the sequence
    where its probe fires, and the summary says which hook, module and step."""
    import hookwire
    from google.protobuf import json_format

    probe = torch.randn(64, generator=torch.Generator().manual_seed(31))
    spec = hookwire.HookSpec("model.layers.1", posthook=[hookwire.rules.stop("output", hookwire.rules.probe(probe) > 0.12)])
    path = tmp_path / "monitor.json"
    path.write_text(json_format.MessageToJson(spec.to_proto()))
    ids, mask = lm_oracle.batch(["Hello world"])
    scores: list[float] = []
    with lm_oracle.forward_hook("model.layers.1", lambda step, out: scores.append(float(out[0, -1] @ probe))):
        (plain,) = lm_oracle.generate(ids, mask, 8)
    fired = [s for s, v in enumerate(scores) if v > 0.12]
    assert fired and fired[0] > 0, "the probe must fire after the prompt for this test to mean anything"
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--hook", str(path))
    assert out.returncode == 0, out.stderr
    assert out.stdout == lm_oracle.text(plain[:fired[0]]) + "\n"
    assert f"finish: rule, {fired[0]} new tokens (stop rule of hook " in out.stderr
    assert f"on model.layers.1 at step {fired[0]})" in out.stderr


def test_generate_streams_while_it_runs_and_stops_when_its_reader_goes(demo: Served) -> None:
    proc = subprocess.Popen([*HOOKWIRE, "generate", "tiny-lm", "Hello world", "-n", "400", "--target", demo.target],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    assert proc.stdout is not None
    first = proc.stdout.read(1)  # the first step's text, long before the 400th token
    proc.stdout.close()  # the reader goes: the next write meets a closed pipe
    _, err = proc.communicate(timeout=120)
    ids, mask = lm_oracle.batch(["Hello world"])
    assert first.decode() == lm_oracle.text(lm_oracle.generate(ids, mask, 1)[0])[:1]
    # 141, not 0: the command was still generating (its text came step by step), and it
    # stopped quietly when its output went.
    assert proc.returncode == 141 and b"Traceback" not in err, err


# Every command that prints, against the demo server. {target} is filled in.
PRINTING = [
    ["models", "--target", "{target}"],
    ["inspect", "tiny-transformer", "--target", "{target}"],
    ["generate", "tiny-lm", "Hello world", "-n", "4", "--target", "{target}"],
    ["hooks", "list", "--target", "{target}"],
    ["health", "{target}"],
    ["token", "new", "alice"],
    ["--help"],
]


@pytest.mark.parametrize("command", PRINTING, ids=lambda c: " ".join(c[:2]))
def test_commands_stop_quietly_when_stdout_closes_early(demo: Served, command: list[str]) -> None:
    # A reader that has already gone (as `| head -2` has, once it has its lines): every
    # write to the pipe fails with EPIPE, deterministically.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([*HOOKWIRE, *(a.format(target=demo.target) for a in command)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120, env=_env())
    finally:
        os.close(write_end)
    assert proc.returncode in (0, 141), proc.stderr
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr and "Exception ignored" not in proc.stderr


def test_inspect_piped_into_head(demo: Served) -> None:
    producer = subprocess.Popen([*HOOKWIRE, "inspect", "tiny-transformer", "--target", demo.target],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    head = subprocess.run(["head", "-2"], stdin=producer.stdout, capture_output=True, text=True, timeout=120)
    assert producer.stdout is not None
    producer.stdout.close()
    _, err = producer.communicate(timeout=120)
    assert len(head.stdout.splitlines()) == 2
    assert producer.returncode in (0, 141) and b"Traceback" not in err, err


def test_tap_stops_quietly_when_its_reader_goes_and_removes_its_hook(demo: Served) -> None:
    tap = subprocess.Popen(
        [*HOOKWIRE, "tap", "mlp", "fc1", "--interval", "0.1", "--plain", "--target", demo.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(),
    )
    assert tap.stdout is not None
    assert tap.stdout.readline().startswith(b"hookwire tap mlp")  # it is running
    tap.stdout.close()  # the reader goes; the next table meets a closed pipe
    _, err = tap.communicate(timeout=120)
    assert tap.returncode == 141 and b"Traceback" not in err, err
    assert "fc1" not in demo.run("hooks", "list").stdout  # its hook went with it


def test_factory_module_in_the_working_directory(tmp_path: pathlib.Path) -> None:
    (tmp_path / "mymodels.py").write_text(
        "from hookwire_server.demo_models import MLP\n\ndef build():\n    return MLP()\n")
    served = Served("--model", "mine=mymodels:build", command=CONSOLE, cwd=tmp_path)
    try:
        assert served.banner.startswith("hookwire serving mine on")
        assert served.run("models").stdout.startswith("mine\t")
    finally:
        assert served.stop() == 0


def test_factory_import_errors_say_what_was_searched(tmp_path: pathlib.Path) -> None:
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n\ndef build():\n    pass\n")

    def serve(model: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CONSOLE, "serve", "--port", "0", "--model", model], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120, env=_env())

    missing = serve("x=no_such_module_xyz:build")
    assert missing.returncode == 2, missing.stderr
    assert "cannot import factory 'no_such_module_xyz:build': no module 'no_such_module_xyz'" in missing.stderr
    assert f"in the working directory {tmp_path}" in missing.stderr and "sys.path: " in missing.stderr
    assert "ModuleNotFoundError: No module named 'no_such_module_xyz'" in missing.stderr

    inner = serve("x=broken:build")
    assert inner.returncode == 2, inner.stderr
    assert "'broken' was found, but importing it failed" in inner.stderr
    assert "No module named 'no_such_dependency_xyz'" in inner.stderr

    attr = serve("x=broken_attr:build")
    assert attr.returncode == 2 and "no module 'broken_attr'" in attr.stderr
    assert "Traceback" not in missing.stderr + inner.stderr


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.mark.parametrize("command", [["models"], ["inspect", "mlp"], ["hooks", "list"], ["hooks", "rm", "hk_" + "1" * 32],
                                     ["generate", "tiny-lm", "hi"]],
                         ids=" ".join)
def test_no_server_is_explained_without_a_traceback(closed_port: int, command: list[str]) -> None:
    target = f"127.0.0.1:{closed_port}"
    proc = subprocess.run([*HOOKWIRE, *command, "--target", target], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 1
    assert f"UNAVAILABLE: no server answers at {target}: nothing listens on that port" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_health_explains_no_server_and_http_targets(closed_port: int, demo: Served) -> None:
    target = f"127.0.0.1:{closed_port}"
    down = subprocess.run([*HOOKWIRE, "health", f"http://{target}"], capture_output=True, text=True, timeout=120, env=_env())
    assert down.returncode == 2 and f"no server answers at {target}" in down.stderr, down.stderr
    up = subprocess.run([*HOOKWIRE, "health", f"http://{demo.target}"], capture_output=True, text=True, timeout=120,
                        env=_env())
    assert up.returncode == 0 and "SERVING" in up.stdout
    listing = demo.run("models")  # --target given as http://
    assert listing.returncode == 0
    via_url = subprocess.run([*HOOKWIRE, "models", "--target", f"http://{demo.target}"], capture_output=True,
                             text=True, timeout=120, env=_env())
    assert via_url.returncode == 0 and via_url.stdout == listing.stdout
    bad = subprocess.run([*HOOKWIRE, "models", "--target", "grpc://127.0.0.1:1"], capture_output=True, text=True,
                         timeout=120, env=_env())
    assert bad.returncode == 2 and "use host:port" in bad.stderr and "Traceback" not in bad.stderr


#: What gRPC's C core prints when it logs (absl format: E1126 13:33:49.465695 3897 add_port.cc:83] ...).
C_CORE_LINE = r"^[EIWD]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\.cc:\d+\]"


@pytest.mark.parametrize(("target", "message"), [
    ("notahost:xx", "--target: port 'xx' is not a number"),
    ("notahost", "--target: 'notahost' has no port: give host:port"),
    ("127.0.0.1:70000", "--target: port 70000 is not from 1 to 65535"),
    ("::1:50051", "an IPv6 address goes in brackets, with the port after them: [::1]:50051"),
    ("[nope]:50051", "--target: 'nope' in brackets is not an IPv6 address"),
    ("dns:///localhost:p", "--target: port 'p' is not a number"),
])
def test_a_malformed_target_is_named_before_connecting(target: str, message: str) -> None:
    proc = subprocess.run([*CONSOLE, "models", "--target", target], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("hookwire models: --target: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "DNS" not in proc.stderr and "resolve" not in proc.stderr


def test_health_names_its_positional_target() -> None:
    proc = subprocess.run([*HOOKWIRE, "health", "notahost:xx"], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2 and proc.stderr == "hookwire health: target: port 'xx' is not a number\n"


def test_grpc_core_log_lines_do_not_precede_the_commands_messages(demo: Served) -> None:
    import re

    env = {k: v for k, v in _env().items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    host, port = demo.target.rsplit(":", 1)
    # A busy port (C core: "E... add_port.cc:83] Failed to add port to server"), and a TLS
    # handshake with a plaintext server (C core: ssl_transport_security.cc, handshake errors).
    busy = subprocess.run([*HOOKWIRE, "serve", "--port", port], capture_output=True, text=True, timeout=300, env=env)
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1] == (
        f"hookwire serve: cannot listen on {host}:{port}: the port is in use (is another server running there?) "
        "or the address is not available on this machine")
    tls = subprocess.run([*CONSOLE, "models", "--tls", "--target", demo.target], capture_output=True, text=True,
                         timeout=120, env=env)
    assert tls.returncode == 1 and tls.stderr.startswith("hookwire models: UNAVAILABLE: the TLS handshake"), tls.stderr
    for proc in (busy, tls):
        assert not re.search(C_CORE_LINE, proc.stderr, re.MULTILINE), proc.stderr
        assert "add_port.cc" not in proc.stderr and "ssl_transport_security" not in proc.stderr
    # A user who asks for the C core's log gets it: the command only fills in variables left unset.
    loud = subprocess.run([*HOOKWIRE, "serve", "--port", port], capture_output=True, text=True, timeout=300,
                          env={**env, "GRPC_VERBOSITY": "ERROR"})
    assert loud.returncode == 2 and re.search(C_CORE_LINE, loud.stderr, re.MULTILINE), loud.stderr


def test_operands_upload_list_and_rm_and_a_hook_file_that_names_one(demo: Served, tmp_path: pathlib.Path) -> None:
    import json

    import numpy as np
    from google.protobuf import json_format
    from safetensors.numpy import save_file

    import hookwire

    vector = (torch.randn(64, generator=torch.Generator().manual_seed(1)) * 4).numpy()
    np.save(tmp_path / "steer.npy", vector)
    sae = tmp_path / "sae"
    sae.mkdir()
    g = np.random.default_rng(0)
    save_file({"W_enc": g.standard_normal((64, 96), dtype=np.float32), "b_enc": np.zeros(96, np.float32),
               "W_dec": g.standard_normal((96, 64), dtype=np.float32), "b_dec": np.zeros(64, np.float32)},
              str(sae / "sae_weights.safetensors"))
    (sae / "cfg.json").write_text(json.dumps({"architecture": "standard", "d_in": 64, "d_sae": 96,
                                              "normalize_activations": "none", "apply_b_dec_to_input": True}))
    for name, path in (("cli-steer", tmp_path / "steer.npy"), ("cli-sae", sae)):
        out = demo.run("operands", "upload", name, str(path), "--ttl", "600")
        assert out.returncode == 0, out.stderr
    listed = demo.run("operands", "list")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:]}
    assert rows["cli-steer"][1:4] == ["tensor", "float32", "[64]"] and rows["cli-sae"][1:3] == ["sae", "float32"]
    # A hook file names the operand: {"operand": "cli-steer"} where a tensor goes.
    spec = hookwire.HookSpec("model.layers.0", posthook=[hookwire.rules.add("output", hookwire.rules.operand("cli-steer"))],
                             steps=(1, None))
    hook = tmp_path / "steer.json"
    hook.write_text(json_format.MessageToJson(spec.to_proto()))
    assert '"operand": "cli-steer"' in hook.read_text()
    ids, mask = lm_oracle.batch(["Hello world"])
    with lm_oracle.forward_hook("model.layers.0", lambda step, out: out + torch.from_numpy(vector) if step >= 1 else None):
        (steered,) = lm_oracle.generate(ids, mask, 8)
    out = demo.run("generate", "tiny-lm", "Hello world", "-n", "8", "--hook", str(hook))
    assert out.returncode == 0, out.stderr
    assert out.stdout == lm_oracle.text(steered) + "\n"
    for name in ("cli-steer", "cli-sae"):
        removed = demo.run("operands", "rm", name)
        assert removed.returncode == 0 and "deleted" in removed.stdout, removed.stderr
    again = demo.run("operands", "rm", "cli-steer")
    assert again.returncode == 1 and "NOT_FOUND" in again.stderr
    bad_ttl = demo.run("operands", "upload", "x", str(tmp_path / "steer.npy"), "--ttl", "0")
    assert bad_ttl.returncode == 2 and "--ttl must be a positive number" in bad_ttl.stderr
    (tmp_path / "w.pt").write_bytes(b"\x80\x04K\x01.")
    pickled = demo.run("operands", "upload", "x", str(tmp_path / "w.pt"))
    assert pickled.returncode == 2 and "not a SAELens folder, a .safetensors file or a .npy file" in pickled.stderr


async def test_a_server_killed_mid_call_says_it_went_away_not_tls() -> None:
    """Regression guard (issue 34): a connection lost while calls ran (the server's process
    killed) was explained as a TLS mismatch ("closed the connection at once: if it serves
    TLS, connect with --tls"). Only a connection dropped while connecting gets that hint."""
    import hookwire

    served = Served("--model", "slow=support:sleeper_factory")
    tap = subprocess.Popen([*HOOKWIRE, "tap", "slow", "inner", "--interval", "0.1", "--plain", "--target", served.target],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert tap.stdout is not None and tap.stdout.readline().startswith("hookwire tap slow")  # it is watching
        async with hookwire.connect(served.target) as client:
            model = client.model("slow")
            hook = await model.hook("", prehook=hookwire.capture("args"))
            call = asyncio.ensure_future(model(torch.tensor(600.0)))  # sleeps in its forward pass
            async for _ in hook.events():
                break  # the pass has started: the call is under way on a working connection
            served.proc.send_signal(signal.SIGKILL)
            served.proc.wait(60)
            for failed in (call, hook.events().__anext__()):
                with pytest.raises(hookwire.UnavailableError) as info:
                    await asyncio.wait_for(failed, 60)
                message = str(info.value)
                assert f"the server at {served.target} went away: it closed the connection mid-call" in message
                assert "--tls" not in message and "TLS" not in message
        _, err = tap.communicate(timeout=120)
        assert tap.returncode == 1, err
        assert f"hookwire tap: UNAVAILABLE: the server at {served.target} went away" in err and "--tls" not in err, err
    finally:
        tap.kill()
        served.proc.kill()


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()) -> Iterator[tuple[list[str], argparse.ArgumentParser]]:
    """Every (sub)command of the hookwire parser: its words and its parser."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        yield list(words), parser
        return
    for name, child in sub.choices.items():
        yield from _commands(child, (*words, name))


def _parse_error(argv: list[str]) -> str:
    """What ``hookwire ARGV`` says on stderr when it refuses its arguments (exit 2)."""
    from hookwire._cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2, argv
    return err.getvalue()


def test_a_misspelled_flag_says_which_flag_was_meant_for_every_command() -> None:
    from hookwire._cli import build_parser

    said = _parse_error(["generate", "tiny-lm", "hi", "--temprature", "0.5"])
    assert said.startswith("usage: hookwire generate")
    assert said.strip().endswith("hookwire generate: error: unrecognized argument --temprature; did you mean --temperature?")
    checked = 0
    for words, parser in _commands(build_parser()):
        positionals = ["x" for a in parser._actions if not a.option_strings and a.nargs not in ("?", "*")]
        for flag in (s for a in parser._actions for s in a.option_strings if s.startswith("--") and len(s) >= 6):
            name = flag[2:]
            typo = "--" + name[:len(name) // 2] + name[len(name) // 2 + 1:]  # a letter left out
            last = _parse_error([*words, *positionals, typo]).strip().splitlines()[-1]
            assert last.endswith(f"unrecognized argument {typo}; did you mean {flag}?"), (words, last)
            checked += 1
    assert checked > 100  # every command's flags, the server's serve and token included
    two = _parse_error(["models", "--taget", "x", "--tsl"]).strip().splitlines()[-1]
    assert two.endswith("unrecognized arguments: --taget (did you mean --target?), --tsl (did you mean --tls?)"), two


@pytest.mark.parametrize("argv", [[], ["--help"], ["bogus"], ["--bogus"]], ids=repr)
def test_the_usage_line_lists_every_command(argv: list[str]) -> None:
    from hookwire._cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(argv)
    usage = (out.getvalue() + err.getvalue()).split("\n\n")[0]
    for command in ("serve", "token", "models", "inspect", "parameters", "generate", "tap", "health", "harvest",
                    "hooks", "operands"):
        assert command in usage, (argv, usage)


def test_an_unknown_health_service_says_which_services_exist(demo: Served) -> None:
    proc = subprocess.run([*HOOKWIRE, "health", demo.target, "--service", "foo"], capture_output=True, text=True,
                          timeout=120, env=_env())
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert line.startswith(f"hookwire health: NOT_FOUND: {demo.target} has no health service 'foo'; it has: "), line
    for service in ('"" (the server)', "hookwire.v1.ModelService", "hookwire.v1.HookService", "hookwire.live",
                    "hookwire.model.mlp", "hookwire.model.tiny-lm"):
        assert service in line, line
    assert "Traceback" not in proc.stderr
