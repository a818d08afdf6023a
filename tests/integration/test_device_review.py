"""Review of #15 (device maps, asynchronous captures): a test for each bug it found (each failed before its fix).

Each test compares a model served with ``async_captures = "on"`` (the deferred queue,
exercised on the CPU) with the same model with ``"off"`` (captures made inside the hook,
the behaviour before #15), or checks a config key. Where a test needs copies still in
flight (what a CUDA capture has until its event completes), ``HostCopies.events`` is
replaced by an event that is not done until it is waited for: the queue then behaves as
on a GPU, where ``poll`` finds nothing ready while kernels are queued.
"""

from __future__ import annotations

import copy
import datetime
import pathlib
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import hookwire
from hookwire import rules
from hookwire._generation import generate_request
from hookwire_server import ServerSettings
from hookwire_server.hooks import deferred
from hookwire_server.demo_models import tiny_lm, tiny_lm_tokenizer
from hookwire_server.models.model_loading import ConfigError, load_config_file
from hookwire_server.models.model_registry import ModelHost, ModelRegistry
from support import ServerThread


# --------------------------------------------------------------------------- models


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class PairInner(nn.Module):
    """Returns a NamedTuple (as torch.return_types and many user modules do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Pair:
        y = self.lin(x)
        return Pair(y, y + 1.0)


class PairModel(nn.Module):
    """``inner``'s output is doubled in place after its hooks ran."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = PairInner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.inner(x)
        p.a.mul_(2.0)
        return p.a + p.b


class Nothing(nn.Module):
    """A module whose output holds no tensor (a probe, a logger, a counter)."""

    def forward(self, x: torch.Tensor) -> None:
        return None


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.act = nn.ReLU()
        self.probe = Nothing()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.fc1(x))
        self.probe(y)
        return self.fc2(y)


#: time.time_ns() when each Stamped model's middle ran (server side, in-process).
STAMPS: list[int] = []


class Stamp(nn.Module):
    """Records when it ran, then lets the clock move on by a millisecond."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        now = time.time_ns()
        STAMPS.append(now)
        while time.time_ns() < now + 1_000_000:
            pass
        return x


class Stamped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.stamp = Stamp()
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.stamp(self.fc1(x)))


def _seeded(factory: Any, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return factory().eval()


def _hosts(name: str, model: nn.Module, **kwargs: Any) -> list[ModelHost]:
    return [ModelHost(f"{name}-async", copy.deepcopy(model), async_captures="on", **kwargs),
            ModelHost(f"{name}-sync", copy.deepcopy(model), async_captures="off", **kwargs)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    lm = tiny_lm()
    registry = ModelRegistry(
        _hosts("pair", _seeded(PairModel, 3)) + _hosts("chain", _seeded(Chain, 4))
        + _hosts("lm", lm, tokenizer=tiny_lm_tokenizer()) + _hosts("stamped", _seeded(Stamped, 5))
    )
    # At most 4 request-scoped events per call (max_events_per_call).
    srv = ServerThread(registry, ServerSettings(port=0, max_events_per_call=4)).start()
    yield srv
    srv.stop()


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))


class _InFlight:
    """A CUDA event whose copies have not completed yet (until someone waits for it)."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        return None


@pytest.fixture
def copies_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deferred.HostCopies, "events", lambda self: [_InFlight()])


# --------------------------------------------------------------------------- 1. aliasing


async def test_a_namedtuple_output_is_captured_as_it_was_when_the_hook_ran(server: ServerThread) -> None:
    """HostCopies.copy (deferred.py:135) rebuilds only exact tuple/list types: a NamedTuple
    (or torch.return_types) output is kept as the live object, and the session path's
    Chunker(snapshot=False) / the response's late encode read it after the model changed
    it in place. "off" snapshots it inside the hook."""
    model = _seeded(PairModel, 3)
    seen: list[torch.Tensor] = []
    model.inner.register_forward_hook(lambda m, a, o: seen.append(o.a.detach().clone()))
    with torch.no_grad():
        model(X)
    spec = hookwire.HookSpec("inner", posthook=hookwire.capture("args", "output"))
    async with hookwire.connect(server.target) as client:
        inline = await client.model("pair-sync").infer(X, hooks=[spec])
        deferred_ = await client.model("pair-async").infer(X, hooks=[spec])
    assert torch.equal(inline.events[0].output[0], seen[0])  # "off": the value the hook saw
    assert torch.equal(deferred_.events[0].output[0], seen[0]), "deferred capture read the tensor after mul_"


async def test_events_name_the_device_of_a_namedtuple_output(server: ServerThread) -> None:
    """_devices_of (hook_record.py:528) walks exact tuple/list types only: an output that is
    a NamedTuple of tensors gets InterceptEvent.devices == () (both modes)."""
    spec = hookwire.HookSpec("inner", posthook=hookwire.capture("output"))
    async with hookwire.connect(server.target) as client:
        result = await client.model("pair-sync").infer(X, hooks=[spec])
    assert result.events[0].devices == ("cpu",)


# --------------------------------------------------------------------------- 2. failure point


async def test_a_request_capture_over_the_event_limit_stops_the_pass_where_it_did(server: ServerThread) -> None:
    """A request-scoped capture that cannot be sent (max_events_per_call) failed the call
    inside its hook, before the hook's rules ran. Deferred, the ResourceExhausted comes
    from _send at the next poll/finish: the rules of that firing (and on a GPU the rest of
    the forward) already ran, so a failed call leaves a slot saved that "off" never saves."""
    specs = [
        *[hookwire.HookSpec(m, posthook=hookwire.capture("output")) for m in ("fc1", "act", "probe", "fc2")],
        hookwire.HookSpec("fc2", posthook=hookwire.edit(rules.save("output", slot="after"), capture=("output",),
                                                        capture_before_rules=True)),
    ]
    slots: dict[str, list[str]] = {}
    for name in ("chain-sync", "chain-async"):
        async with hookwire.connect(server.target) as client:
            await client.session()
            with pytest.raises(hookwire.HookwireError, match="max_events_per_call"):
                await client.model(name).infer(X, hooks=specs)
            slots[name] = [s.name for s in await client.list_slots()]
    assert slots["chain-sync"] == []  # the fifth capture failed before its save rule ran
    assert slots["chain-async"] == slots["chain-sync"]


# --------------------------------------------------------------------------- 3. notice order


async def _generate_kinds(client: hookwire.Client, model: str, spec: hookwire.HookSpec) -> list[str]:
    request = generate_request(
        model, "Once upon a time", 3, attention_mask=None, hooks=[spec], do_sample=False, temperature=None,
        top_k=None, top_p=None, seed=None, stop=(), tags=(), session_id="", max_response_message_bytes=1 << 24,
    )
    kinds = []
    async for message in client.model_stub.Generate(request):
        kind = message.WhichOneof("kind")
        if kind == "batch":
            kinds.extend(["event"] * len(message.batch.events))
        elif kind != "chunk":
            kinds.append(kind)
    return kinds


async def test_a_capture_before_a_failing_rule_precedes_its_disable_notice(server: ServerThread) -> None:
    """capture_before_rules with a rule that fails at step 1 (on_error disable_hook): inside
    the hook the event is emitted, then the notice. Deferred (_capture_later queues the
    event, _disable sends the notice at once, hook_record.py:269/278), the notice comes
    first and the hook's event arrives after the notice that says it was disabled."""
    spec = hookwire.HookSpec("model.layers.0", on_error="disable_hook", posthook=hookwire.edit(
        rules.zero("output", index="[:, 1]"), capture=("output",), capture_before_rules=True))
    async with hookwire.connect(server.target) as client:
        inline = await _generate_kinds(client, "lm-sync", spec)
        deferred_ = await _generate_kinds(client, "lm-async", spec)
    assert inline.index("notice") == inline.index("event", inline.index("tokens")) + 1  # step 1: event, notice
    assert deferred_ == inline


# --------------------------------------------------------------------------- 4. overtaking


async def test_a_capture_made_at_once_does_not_overtake_captures_in_flight(
    server: ServerThread, copies_in_flight: None,
) -> None:
    """_capture (hook_record.py:307) sends a capture with no tensor on an accelerator
    ("auto": a None/int output, a CPU tensor, an empty kwargs capture) at once, while
    earlier captures of the pass wait in batch.deferred for their copies: it overtakes
    them: the response (and a session stream) no longer has the events in firing order."""
    specs = [hookwire.HookSpec(m, posthook=hookwire.capture("output")) for m in ("fc1", "probe", "fc2")]
    async with hookwire.connect(server.target) as client:
        inline = await client.model("chain-sync").infer(X, hooks=specs)
        deferred_ = await client.model("chain-async").infer(X, hooks=specs)
    assert [e.module for e in inline.events] == ["fc1", "probe", "fc2"]  # firing order
    assert [e.module for e in deferred_.events] == ["fc1", "probe", "fc2"]


# --------------------------------------------------------------------------- 5. event time


async def test_an_event_is_stamped_when_the_hook_fired(server: ServerThread) -> None:
    """InterceptEvent.time is "when the hook fired (server clock)" (hook.proto:246), but
    _fill_event (hook_record.py:393) stamps it when the event is encoded: a deferred
    capture carries the time it was delivered (on a GPU, up to the end of the pass).
    fc1's hook fires before ``stamp`` runs, so its event's time must not be after it."""
    spec = hookwire.HookSpec("fc*", posthook=hookwire.capture("output"))
    times: dict[str, int] = {}
    async with hookwire.connect(server.target) as client:
        for name in ("stamped-sync", "stamped-async"):
            result = await client.model(name).infer(X, hooks=[spec])
            fc1 = [e for e in result.events if e.module == "fc1"][0]
            fired = (fc1.time - datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)) // datetime.timedelta(
                microseconds=1)
            times[name] = fired - STAMPS[-1] // 1000  # µs from fc1's event time to when stamp ran
    assert times["stamped-sync"] <= 0
    assert times["stamped-async"] <= 0, f"the deferred event is stamped {times['stamped-async']} µs after stamp ran"


# --------------------------------------------------------------------------- 6. config checks


@pytest.mark.parametrize("entry, match", [
    ('torch_dtype = ["float32"]', r"model 'mine': torch_dtype must be one of"),
    ('torch_dtype = { a = 1 }', r"model 'mine': torch_dtype must be one of"),
    ('device_map = "auto"\noffload_folder = 5', r"model 'mine': offload_folder must be a path"),
    ('device_map = "auto"\noffload_folder = ["x"]', r"model 'mine': offload_folder must be a path"),
])
def test_config_refuses_wrong_types_with_a_config_error(tmp_path: pathlib.Path, entry: str, match: str) -> None:
    """TOML gives any type: torch_dtype's ``not in TORCH_DTYPES`` (model_loading.py:183)
    raises TypeError for a list or table, and load_config_file joins offload_folder to the
    config's folder before any check (model_loading.py:334): TypeError for a non-string."""
    path = tmp_path / "hookwire.toml"
    path.write_text(f'[[models]]\nname = "mine"\ntransformers = "m"\n{entry}\n')
    with pytest.raises(ConfigError, match=match):
        load_config_file(path)


def test_a_max_memory_device_name_reaches_accelerate_in_a_form_it_takes(tmp_path: pathlib.Path) -> None:
    """max_memory keys may be "device names" (ModelConfig docs, _placement_device), and
    "cuda:0" passes the check, but accelerate takes only GPU indices, "mps", "cpu" and
    "disk" as max_memory keys: the model then fails to load ("Device cuda:0 is not
    recognized"). Either turn "cuda:N" into N or refuse it in the config."""
    from accelerate.utils import get_max_memory

    path = tmp_path / "hookwire.toml"
    path.write_text('[[models]]\nname = "mine"\ntransformers = "m"\ndevice_map = "auto"\n'
                    'max_memory = { "cuda:0" = "1GiB", cpu = "1GiB" }\n')
    try:
        _, (config,) = load_config_file(path)
    except ConfigError:
        return  # refused in the config: fine
    get_max_memory(dict(config.placement_kwargs()["max_memory"]))  # ValueError today
