"""The harvest command's argument handling and the SDK's request building (no server)."""

from __future__ import annotations

import argparse

import pytest
import torch

import io
import shlex

from hookwire._cli import build_parser, harvest_flags, harvest_options, parse_count
from hookwire._harvest import HarvestProgress, _Bar, format_rate, harvest_request
from hookwire_server.calls.harvest import resume_command
from hookwire.v1 import harvest_service_pb2 as hv
from hookwire.v1 import hook_pb2, tensor_pb2


@pytest.mark.parametrize("text,count", [("500000", 500_000), ("500k", 500_000), ("10M", 10_000_000),
                                        ("1.5G", 1_500_000_000), ("2b", 2_000_000_000), ("1_000", 1000)])
def test_token_counts(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["", "ten", "-5", "1.5", "0.5k1", "M"])
def test_bad_token_counts(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_count(text)


def test_the_request_says_what_the_options_say() -> None:
    rule = hook_pb2.HookSpec(module="model.layers.0", posthook=hook_pb2.HookAction())
    req = harvest_request("m", "model.layers.*", data="d.jsonl", out="o", dtype="bfloat16", part="input",
                          select="[..., :4]", rules=[rule], length=64, batch_size=4, packing="pack", bos=False,
                          skip_first=1, positions=[1, 2], max_tokens=10, shard_tokens=100, shuffle=True,
                          shuffle_buffer=2, seed=3, overwrite=True, worker_index=1, num_workers=2, split="train")
    assert list(req.modules) == ["model.layers.*"] and req.part == hook_pb2.PART_ARGS
    assert req.dtype == tensor_pb2.DTYPE_BFLOAT16 and req.select == "[..., :4]"
    assert req.contexts == hv.HarvestContexts(length=64, batch_size=4, packing=hv.PACKING_PACK, bos=False)
    assert req.positions == hv.HarvestPositions(skip_first=1, only=[1, 2]) and req.max_tokens == 10
    assert req.output.shuffle == hv.HarvestShuffle(enabled=True, buffer_shards=2, seed=3) and req.output.overwrite
    assert req.source.text.path == "d.jsonl" and req.source.text.split == "train"
    assert (req.worker_index, req.num_workers) == (1, 2) and req.rules[0].module == "model.layers.0"
    assert not req.contexts.HasField("bos") or req.contexts.bos is False
    tokens = harvest_request("m", ["a"], tokens=torch.tensor([[1, 2, 0]]), pad_token_id=0, out="o")
    assert list(tokens.source.tokens.input_ids.shape) == [1, 3] and tokens.source.tokens.pad_token_id == 0
    with pytest.raises(ValueError, match="dtype"):
        harvest_request("m", ["a"], data="d", out="o", dtype="int8")
    with pytest.raises(ValueError, match="not both"):
        harvest_request("m", ["a"], out="o")


def test_progress_decodes_the_job() -> None:
    p = HarvestProgress.from_proto(hv.HarvestJob(job_id="hv-1", state=hv.HARVEST_STATE_CANCELLED, tokens_done=5))
    assert p.state == "cancelled" and p.ended and p.tokens_done == 5


def test_the_cli_parses_a_job_line() -> None:
    ns = build_parser().parse_args(["harvest", "m", "--modules", "a.*", "--modules", "b", "--data", "d.jsonl",
                                    "--out", "o", "--tokens", "10M", "--shuffle", "--num-workers", "3"])
    assert ns.words == ["m"] and ns.modules == ["a.*", "b"] and ns.tokens == 10_000_000 and ns.num_workers == 3


def _cli_request(argv: list[str]) -> hv.StartHarvestRequest:
    """The StartHarvestRequest the harvest command sends for ``argv`` (its words after
    ``hookwire``)."""
    ns = build_parser().parse_args(argv)
    return harvest_request(ns.words[0], ns.modules, out=ns.out, data=ns.data, worker_index=ns.worker_index,
                           num_workers=ns.num_workers, **harvest_options(ns))


@pytest.mark.parametrize("flags", [
    [],
    ["--dtype", "bfloat16", "--length", "16", "--batch-size", "2", "--packing", "pack", "--skip-first", "1",
     "--shard-tokens", "300", "--tokens", "200", "--worker-index", "1", "--num-workers", "2"],
    ["--part", "input", "--select", "[..., :4]", "--no-bos", "--shuffle", "--shuffle-buffer", "2", "--seed", "7",
     "--text-field", "body", "--format", "jsonl", "--split", "train", "--modules", "b c"],
])
def test_the_resume_command_sends_the_same_request(flags: list[str]) -> None:
    # An interrupted job's message gives this command: run again, it must send exactly
    # the job's request (without --overwrite, which would start it over).
    argv = ["harvest", "m", "--modules", "a.*", "--data", "my data.jsonl", "--out", "out dir", *flags]
    request = _cli_request(argv)
    command = resume_command(request)
    words = shlex.split(command)
    assert words[:2] == ["hookwire", "harvest"]
    assert _cli_request(words[1:]) == request
    overwriting = _cli_request([*argv, "--overwrite"])
    assert "--overwrite" not in resume_command(overwriting)
    # What the CLI cannot say has no command (the message then says to send the request again).
    assert resume_command(harvest_request("m", ["a"], tokens=torch.tensor([[1, 2]]), out="o")) == ""


def test_interrupted_is_final_for_watching() -> None:
    p = HarvestProgress.from_proto(hv.HarvestJob(job_id="hv-1", state=hv.HARVEST_STATE_INTERRUPTED,
                                                 resume_command="hookwire harvest m", error="interrupted: ..."))
    assert p.state == "interrupted" and p.ended and p.resume_command == "hookwire harvest m"


def test_rate_and_eta_are_the_jobs_own_on_reattach() -> None:
    # A watcher attaching to a job at 9M of 10M tokens, running at 60k tok/s: the bar shows
    # the job's rate and ETA, not the 9M tokens it saw "arrive" at once.
    p = HarvestProgress.from_proto(hv.HarvestJob(
        job_id="hv-1", state=hv.HARVEST_STATE_RUNNING, tokens_done=9_000_000, tokens_total=10_000_000,
        tokens_per_second=60_000.0, eta_seconds=1_000_000 / 60_000.0,
    ))
    assert format_rate(p) == "60.0k tok/s, ETA 0:00:17"
    out = io.StringIO()
    bar = _Bar(True, file=out)
    bar.update(HarvestProgress.from_proto(hv.HarvestJob(job_id="hv-1", state=hv.HARVEST_STATE_RUNNING,
                                                        tokens_total=10_000_000)))
    bar.update(p)
    bar.close()
    shown = out.getvalue().rsplit("\r", 1)[-1]
    assert "60.0k tok/s, ETA 0:00:17" in shown, shown
    assert "Mtok/s" not in shown and "ktok/s" not in shown, shown  # no rate of tqdm's own (9M "in" no time)


@pytest.mark.parametrize("message,said", [
    ("output.path: x holds a finished dataset (set output.overwrite to replace it)",
     "--out: x holds a finished dataset (set --overwrite to replace it)"),
    ("harvest_local with text needs tokenizer= (the model's tokenizer)", "harvest_local with text needs --tokenizer"),
    ("modules[1]: no module matches", "--modules[1]: no module matches"),
    ("the patterns match 300 modules, over the limit", "the patterns match 300 modules, over the limit"),
    ("output.shuffle.buffer_shards: 99 is over the limit", "--shuffle-buffer: 99 is over the limit"),
    ("contexts.batch_size: 99 is over", "--batch-size: 99 is over"),
])
def test_errors_name_the_flags_the_user_typed(message: str, said: str) -> None:
    assert harvest_flags(message).startswith(said)


def test_plain_lines_carry_the_jobs_rate_and_eta(capsys: pytest.CaptureFixture[str]) -> None:
    from hookwire._cli import _print_job

    _print_job(HarvestProgress.from_proto(hv.HarvestJob(
        job_id="hv-1", state=hv.HARVEST_STATE_RUNNING, tokens_done=500, tokens_total=1000, tokens_per_second=250.0,
        eta_seconds=2.0,
    )))
    _print_job(HarvestProgress.from_proto(hv.HarvestJob(job_id="hv-1", state=hv.HARVEST_STATE_SUCCEEDED,
                                                        tokens_done=1000, tokens_total=1000)))
    running, done = capsys.readouterr().out.splitlines()
    assert running.split()[0] == "hv-1" and "250 tok/s, ETA 0:00:02" in running, running
    assert "tok/s" not in done
