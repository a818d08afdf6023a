"""Harvest across server processes, driven by the CLI: a 2-way split by two servers into
one dataset equals a 1-way run; a server killed (SIGKILL) mid-job and started again
resumes to the same dataset as an uninterrupted run; Ctrl-C of the CLI leaves the job
running on the server; list, cancel and --watch. The demo tiny-lm (seeded weights, a
tokenizer built in code) is the same model in every process."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import hookwire
from support import PROCESS_LIVENESS

HOOKWIRE = [sys.executable, "-m", "hookwire._cli"]
TESTS = pathlib.Path(__file__).resolve().parent.parent
WORDS = "the of and to in is it that was for on are with as at be this have from or one by not hook model token layer".split()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS), *env.get("PYTHONPATH", "").split(os.pathsep)] if p)
    return env


class Server:
    """``hookwire serve`` in a process of its own, on the demo models, with harvest roots."""

    def __init__(self, data: pathlib.Path, out: pathlib.Path, config: pathlib.Path | None = None) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        extra = ["--config", str(config)] if config is not None else []
        self.proc = subprocess.Popen(
            [*HOOKWIRE, "serve", "--port", "0", "--harvest-data-root", str(data), "--harvest-output-root", str(out),
             *extra],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=_env(),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(f"server did not start: {line!r} {self.log.read()}")
        self.target = line.rsplit(" ", 1)[-1].strip()

    def cli(self, *args: str, timeout: float = PROCESS_LIVENESS) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*HOOKWIRE, *args, "--target", self.target], capture_output=True, text=True,
                              timeout=timeout, env=_env())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    data, out = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("out")
    g = torch.Generator().manual_seed(0)
    with open(data / "corpus.jsonl", "w") as f:
        for i in range(400):
            n = int(torch.randint(3, 20, (1,), generator=g))
            words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (n,), generator=g)]
            f.write(json.dumps({"text": " ".join(words), "i": i}) + "\n")
    return data, out


@pytest.fixture(scope="module")
def servers(roots: tuple[pathlib.Path, pathlib.Path]) -> Iterator[list[Server]]:
    started = [Server(*roots), Server(*roots)]
    yield started
    for s in started:
        s.stop()


JOB = ["tiny-lm", "--modules", "model.layers.*", "--data", "corpus.jsonl", "--length", "16", "--batch-size", "2",
       "--packing", "pack", "--skip-first", "1", "--shard-tokens", "300", "--dtype", "bfloat16"]


def _tokens(folder: pathlib.Path) -> dict[tuple[int, int], tuple[Any, ...]]:
    ds = hookwire.ActivationDataset(folder)
    rows = ds[:]
    out = {}
    for i in range(len(ds)):
        key = (int(rows["sequence"][i]), int(rows["position"][i]))
        assert key not in out, f"{key} stored twice"
        out[key] = (int(rows["token_ids"][i]),
                    *(rows[m][i].view(torch.int16).tolist() for m in ds.modules))
    return out


def _start(server: Server, *extra: str) -> str:
    """Starts the JOB with the CLI's own argument parsing, through the SDK (a CLI process
    per call would import torch each time); the CLI itself is exercised below."""
    from hookwire._cli import build_parser

    ns = build_parser().parse_args(["harvest", *JOB, *extra])

    async def start() -> str:
        async with hookwire.connect(server.target) as client:
            job = await client.harvest(
                ns.words[0], ns.modules, out=ns.out, data=ns.data, length=ns.length, batch_size=ns.batch_size,
                packing=ns.packing, skip_first=ns.skip_first, shard_tokens=ns.shard_tokens, dtype=ns.dtype,
                max_tokens=ns.tokens or 0, worker_index=ns.worker_index, num_workers=ns.num_workers,
            )
            return job.id

    return asyncio.run(start())


def _wait(server: Server, job_id: str) -> str:
    """The job's final state (followed with WatchHarvest)."""
    async def wait() -> str:
        async with hookwire.connect(server.target) as client:
            last = None
            async for last in client.harvest_job(job_id).watch(interval=0.05):
                pass
            assert last is not None
            return last.state

    return asyncio.run(wait())


def _watch(server: Server, job_id: str) -> subprocess.CompletedProcess[str]:
    return server.cli("harvest", "--watch", job_id, "--plain")


def test_a_two_way_split_over_two_server_processes_equals_a_one_way_run(
    servers: list[Server], roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    data, out = roots
    whole = _start(servers[0], "--out", "one-way")
    first = _start(servers[0], "--out", "two-way", "--worker-index", "0", "--num-workers", "2")
    second = _start(servers[1], "--out", "two-way", "--worker-index", "1", "--num-workers", "2")
    assert [_wait(servers[0], whole), _wait(servers[1], second)] == ["succeeded", "succeeded"]
    watched = _watch(servers[0], first)  # the CLI follows worker 0 to its merge
    assert watched.returncode == 0 and "succeeded" in watched.stdout.splitlines()[-1], watched.stdout + watched.stderr
    one, two = _tokens(out / "one-way"), _tokens(out / "two-way")
    assert len(one) > 1000 and one == two
    manifest = json.loads((out / "two-way" / "manifest.json").read_text())
    assert manifest["num_workers"] == 2 and {s["worker"] for s in manifest["shards"]} == {0, 1}
    files = [s["file"] for s in manifest["shards"]]
    assert len(files) == len(set(files))
    # Job state is in the shared state folder: either server answers for either job.
    listed = servers[1].cli("harvest", "list")
    assert first in listed.stdout and second in listed.stdout, listed.stdout


def test_a_server_killed_mid_job_resumes_elsewhere_to_the_uninterrupted_dataset(
    roots: tuple[pathlib.Path, pathlib.Path], servers: list[Server],
) -> None:
    data, out = roots
    # The reference is the split test's one-way run (the same settings), finished by now.
    assert (out / "one-way" / "manifest.json").exists()
    victim = Server(data, out)
    try:
        _start(victim, "--out", "killed")
        manifest = out / "killed" / "workers" / "w0000-of-0001.json"
        deadline = time.monotonic() + PROCESS_LIVENESS
        while not (manifest.exists() and json.loads(manifest.read_text()).get("tokens_done", 0) > 0):
            assert time.monotonic() < deadline, "no group committed"
            time.sleep(0.005)
        victim.proc.send_signal(signal.SIGKILL)  # mid-job: between any two instructions
        victim.proc.wait(60)
        assert not (out / "killed" / "manifest.json").exists(), "the job finished before it could be killed"
    finally:
        victim.stop()
    # Started again on another replica sharing the storage, it resumes from the manifest.
    job = _start(servers[0], "--out", "killed")
    assert _wait(servers[0], job) == "succeeded"
    a = hookwire.ActivationDataset(out / "one-way")
    b = hookwire.ActivationDataset(out / "killed")
    for key in [*a.modules, "token_ids", "sequence", "position"]:  # same tokens, same order
        assert torch.equal(a[:][key].view(torch.int16) if a[:][key].dtype == torch.bfloat16 else a[:][key],
                           b[:][key].view(torch.int16) if b[:][key].dtype == torch.bfloat16 else b[:][key]), key


def test_ctrl_c_of_the_cli_leaves_the_job_running_and_cancel_stops_one(
    servers: list[Server], roots: tuple[pathlib.Path, pathlib.Path],
) -> None:
    data, out = roots
    server = servers[0]
    # Worker 0 of a 2-way split cannot end before worker 1 has run (it waits to merge):
    # whatever the machine's speed, the job is still running when the CLI is interrupted.
    split = ["--worker-index", "0", "--num-workers", "2", "--tokens", "200"]
    follower = subprocess.Popen(
        [*HOOKWIRE, "harvest", *JOB, *split, "--out", "ctrl-c", "--plain", "--target", server.target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
    )
    assert follower.stdout is not None
    first = follower.stdout.readline()  # the job's first progress line: it is running
    job_id = first.split()[0]
    assert job_id.startswith("hv-"), first
    follower.send_signal(signal.SIGINT)
    _, err = follower.communicate(timeout=120)
    assert follower.returncode == 130 and f"hookwire harvest --watch {job_id}" in err and "Traceback" not in err, err
    _start(servers[1], "--out", "ctrl-c", "--worker-index", "1", "--num-workers", "2", "--tokens", "200")
    watched = _watch(server, job_id)  # it went on without the CLI, to the end (and merged)
    assert watched.returncode == 0 and "succeeded" in watched.stdout.splitlines()[-1], watched.stdout
    assert (out / "ctrl-c" / "manifest.json").exists()

    job = _start(server, "--out", "to-cancel", *split)  # waits for a worker 1 that never comes
    cancelled = server.cli("harvest", "cancel", job)
    assert cancelled.returncode == 0 and job in cancelled.stdout, cancelled.stderr
    assert _wait(server, job) == "cancelled"
    listed = server.cli("harvest", "list")
    assert listed.returncode == 0 and job in listed.stdout
    bad = server.cli("harvest", "tiny-lm", "--modules", "model.norm", "--data", "../etc/passwd", "--out", "x")
    assert bad.returncode == 1 and "--data: " in bad.stderr and "source.text.path" not in bad.stderr, bad.stderr


def _progress(server: Server, job_id: str) -> hookwire.HarvestProgress:
    async def get() -> hookwire.HarvestProgress:
        async with hookwire.connect(server.target) as client:
            return await client.harvest_job(job_id).refresh()

    return asyncio.run(get())


def test_a_killed_servers_job_is_interrupted_with_its_resume_command_and_can_be_cancelled(
    roots: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path,
) -> None:
    # A short lease set through the config: a job whose server was SIGKILLed is seen as
    # INTERRUPTED by the next server within it (the state file alone still says running).
    data, out = roots
    config = tmp_path / "lease.toml"
    config.write_text("[server]\nharvest_lease_seconds = 1.5\n")
    # Worker 0 of a 2-way split waits (running) for a worker 1 that never comes: whatever
    # the machine's speed, the job is running when it is killed.
    split = ["--worker-index", "0", "--num-workers", "2", "--tokens", "200"]
    victim = Server(data, out, config)
    try:
        job = _start(victim, "--out", "leased", *split)
        state = out / ".hookwire-jobs" / f"{job}.json"
        deadline = time.monotonic() + PROCESS_LIVENESS
        while not (state.exists() and json.loads(state.read_text()).get("state") == "HARVEST_STATE_RUNNING"):
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.01)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)
    finally:
        victim.stop()
    assert json.loads(state.read_text())["state"] == "HARVEST_STATE_RUNNING"
    second = Server(data, out, config)
    try:
        deadline = time.monotonic() + PROCESS_LIVENESS
        while (p := _progress(second, job)).state != "interrupted":
            assert p.state == "running" and time.monotonic() < deadline, p
            time.sleep(0.2)
        # The message gives the exact command that resumes it (the same request again).
        assert p.resume_command.startswith("hookwire harvest tiny-lm ") and "--out leased" in p.resume_command
        assert p.resume_command in p.error and p.tokens_per_second == 0 and p.eta_seconds == 0, p
        from hookwire._cli import build_parser
        import shlex

        again = build_parser().parse_args(shlex.split(p.resume_command)[1:])
        original = build_parser().parse_args(["harvest", *JOB, "--out", "leased", *split])
        assert vars(again) == vars(original)
        listed = second.cli("harvest", "list")
        assert listed.returncode == 0 and any(job in line and "interrupted" in line for line in listed.stdout.splitlines())
        active = second.cli("harvest", "list", "--active")
        assert active.returncode == 0 and job not in active.stdout, active.stdout
        # --watch ends on it, non-zero, saying how to resume (it would print its line forever before).
        watched = second.cli("harvest", "--watch", job, "--plain", timeout=120)
        assert watched.returncode == 1 and "interrupted" in watched.stdout, watched.stdout + watched.stderr
        assert p.resume_command in watched.stderr and "Traceback" not in watched.stderr, watched.stderr
        # Starting the same job again says it resumes the interrupted one (and does).
        restarted = second.cli("harvest", *JOB, "--out", "leased", *split, "--detach")
        assert restarted.returncode == 0, restarted.stderr
        assert f"job {job} at leased was interrupted" in restarted.stderr and "resumes it" in restarted.stderr
        resumed = restarted.stdout.strip()
        assert resumed.startswith("hv-") and resumed != job
        # The interrupted job can be cancelled: it ends CANCELLED, in its state file too.
        cancelled = second.cli("harvest", "cancel", job)
        assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout, cancelled.stdout + cancelled.stderr
        assert _progress(second, job).state == "cancelled"
        assert json.loads(state.read_text())["state"] == "HARVEST_STATE_CANCELLED"
        assert second.cli("harvest", "cancel", resumed).returncode == 0
        assert _wait(second, resumed) == "cancelled"
    finally:
        second.stop()


def _stalling_config(path: pathlib.Path, passes: int, stalled: pathlib.Path) -> pathlib.Path:
    """A config serving tiny-lm as "stalling-lm" (support.stalling_tiny_lm: passes after
    its first ``passes`` never return) with a short harvest lease."""
    path.write_text(
        "[server]\nharvest_lease_seconds = 1.5\n\n[[models]]\nname = \"stalling-lm\"\n"
        "factory = \"support:stalling_tiny_lm\"\ntokenizer = \"hookwire_server.demo_models:tiny_lm_tokenizer\"\n"
        f"kwargs = {{ passes = {passes}, stalled = {json.dumps(str(stalled))} }}\n"
    )
    return path


def test_an_interrupted_job_reports_the_tokens_its_shards_commit_not_its_counter(
    roots: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path,
) -> None:
    """A server killed while its job holds batches the model ran but no group has
    committed yet: its state file counts them, the worker manifest does not. The next
    server reports the job INTERRUPTED with the manifest's committed tokens (and shards),
    the number the resumed job starts from, not the counter."""
    data, out = roots
    stalled = tmp_path / "stalled"
    # 6 passes of 2 x 15 kept tokens: groups of 100 tokens commit after the 4th (120
    # tokens), the 5th and 6th stay buffered when the 7th pass stalls.
    request = dict(out="committed", data="corpus.jsonl", length=16, batch_size=2, packing="pack", skip_first=1,
                   shard_tokens=100)
    victim = Server(data, out, _stalling_config(tmp_path / "stall.toml", 6, stalled))
    try:
        async def start() -> str:
            async with hookwire.connect(victim.target) as client:
                return (await client.harvest("stalling-lm", "model.layers.*", **request)).id

        job = asyncio.run(start())
        state = out / ".hookwire-jobs" / f"{job}.json"
        deadline = time.monotonic() + PROCESS_LIVENESS
        while not stalled.exists():
            assert time.monotonic() < deadline, "the job never reached its stalled pass"
            time.sleep(0.02)
        # The next heartbeat's state file holds every batch that ran (written after the stall).
        since = stalled.stat().st_mtime
        while not (state.exists() and json.loads(state.read_text()).get("heartbeat", 0) > since + 0.1):
            assert time.monotonic() < deadline, "no heartbeat after the stall"
            time.sleep(0.05)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)
    finally:
        victim.stop()
    record = json.loads(state.read_text())
    manifest = json.loads((out / "committed" / "workers" / "w0000-of-0001.json").read_text())
    committed = int(manifest["tokens_done"])
    assert record["state"] == "HARVEST_STATE_RUNNING"
    assert int(record["tokens_done"]) > committed > 0, (record["tokens_done"], committed)  # what the bug reported
    second = Server(data, out, _stalling_config(tmp_path / "free.toml", -1, stalled))
    try:
        deadline = time.monotonic() + PROCESS_LIVENESS
        while (p := _progress(second, job)).state != "interrupted":
            assert p.state == "running" and time.monotonic() < deadline, p
            time.sleep(0.2)
        assert p.tokens_done == committed and p.shards_written == len(manifest["shards"]), p
        assert f"with {committed} tokens committed" in p.error, p.error

        async def resume() -> int:
            async with hookwire.connect(second.target) as client:
                again = await client.harvest("stalling-lm", "model.layers.*", **request)
                resumed = (await again.refresh()).resumed_tokens
                await again.cancel()
                return resumed

        assert asyncio.run(resume()) == committed  # where the resumed job starts: the same count
    finally:
        second.stop()


def test_the_cli_names_its_flags_and_the_client_sink_tokenizes_on_the_server(
    servers: list[Server], roots: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path,
) -> None:
    data, out = roots
    server = servers[0]
    budget = ["--tokens", "300"]
    assert _wait(server, _start(server, "--out", "flags-done", *budget)) == "succeeded"
    # The server says output.path / output.overwrite / contexts.length: the CLI says its flags.
    again = server.cli("harvest", *JOB, *budget, "--out", "flags-done")
    assert again.returncode == 1, again.stderr
    assert "--overwrite" in again.stderr and "--out:" in again.stderr, again.stderr
    assert "output.overwrite" not in again.stderr and "output.path" not in again.stderr, again.stderr
    long = server.cli("harvest", *JOB, "--out", "flags-long", "--length", "100000")
    assert long.returncode == 1 and "--length: 100000" in long.stderr and "contexts.length" not in long.stderr, long.stderr
    # The client sink with text and no --tokenizer: the server's Tokenize gives the ids;
    # the dataset equals the server job's. stderr is not a terminal: plain lines, no bar.
    sink = server.cli("harvest", *JOB, *budget, "--sink", "client", "--data", str(data / "corpus.jsonl"),
                      "--out", str(tmp_path / "sink"))
    assert sink.returncode == 0, sink.stderr
    assert "\r" not in sink.stderr and "|" not in sink.stderr, sink.stderr  # no tqdm bar
    lines = sink.stdout.splitlines()
    assert lines[0].startswith("local  running") and "tok/s" in lines[0], sink.stdout
    assert "succeeded" in lines[-1], sink.stdout
    assert _tokens(tmp_path / "sink") == _tokens(out / "flags-done")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_cli_waits_for_a_loading_model(roots: tuple[pathlib.Path, pathlib.Path], tmp_path: pathlib.Path) -> None:
    # `hookwire harvest` right after `hookwire serve`: the model is still loading. The CLI
    # waits (saying so on stderr), bounded by --wait-ready, instead of failing UNAVAILABLE.
    data, out = roots
    port = _free_port()
    target = f"127.0.0.1:{port}"
    gate = tmp_path / "gate"
    env = _env()
    env["HOOKWIRE_TEST_GATE"] = str(gate)
    proc = subprocess.Popen(
        [*HOOKWIRE, "serve", "--port", str(port), "--model", "gated=support:gated_factory",
         "--harvest-data-root", str(data), "--harvest-output-root", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    args = [*HOOKWIRE, "harvest", "gated", "--modules", "", "--data", "corpus.jsonl", "--out", "gated",
            "--target", target]
    try:
        bounded = subprocess.run([*args, "--wait-ready", "3"], capture_output=True, text=True, timeout=PROCESS_LIVENESS,
                                 env=_env())
        assert bounded.returncode == 1, bounded.stderr
        assert "waiting up to 3 s for model 'gated'" in bounded.stderr and "--wait-ready 3" in bounded.stderr
        assert "Traceback" not in bounded.stderr, bounded.stderr
        waiting = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        assert waiting.stderr is not None
        first = waiting.stderr.readline()
        assert "waiting up to 120 s for model 'gated'" in first, first
        gate.touch()
        _, err = waiting.communicate(timeout=PROCESS_LIVENESS)
        # Once loaded, the start goes on and gets the server's answer about the request
        # itself (checked only for a model that is ready), said with the CLI's flags.
        assert waiting.returncode == 1 and "is loading" not in err, err
        assert "INVALID_ARGUMENT: --modules[0]: empty" in err, err
    finally:
        gate.touch()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
