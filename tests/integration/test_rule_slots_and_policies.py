"""Slots (activation patching), tagged scope, shared-rule permission, validation and
run-time failure policies."""

from __future__ import annotations

import asyncio
import re
from typing import AsyncIterator, Iterator

import grpc
import pytest
import torch

import hookwire
from hookwire import rules
from hookwire.v1 import hook_pb2, hook_service_pb2, rule_pb2
from support import ServerThread, assert_same, local_models, serving, take

X = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
VEC = torch.randn(32, generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module")
def shared_server() -> Iterator[ServerThread]:
    """A server that allows shared rules, with a small slot budget (8 KiB per session)."""
    with serving(allow_shared_rules=True, max_slot_bytes=8192) as srv:
        yield srv


@pytest.fixture
async def shared(shared_server: ServerThread) -> AsyncIterator[hookwire.Client]:
    async with hookwire.connect(shared_server.target) as c:
        yield c


@pytest.fixture
async def shared_other(shared_server: ServerThread) -> AsyncIterator[hookwire.Client]:
    async with hookwire.connect(shared_server.target) as c:
        yield c


async def test_activation_patching_between_two_inputs_via_slots(client, tokens) -> None:
    ids, mask = tokens
    corrupted = ids.clone()
    corrupted[:, 1] = (corrupted[:, 1] + 7) % 64
    local = local_models()["tiny-transformer"]
    clean_hidden = {}
    h = local.encoder.layers[0].register_forward_hook(lambda m, a, out: clean_hidden.setdefault("x", out.detach().clone()))
    with torch.no_grad():
        local(ids, attention_mask=mask)
    h.remove()

    def patch_hook(m, a, out):
        new = out.clone()
        new[:, 1] = clean_hidden["x"][:, 1]
        return new

    local.encoder.layers[0].register_forward_hook(patch_hook)
    with torch.no_grad():
        expected = local(corrupted, attention_mask=mask)

    model = client.model("tiny-transformer")
    await client.session()
    async with model.hook("encoder.layers.0", posthook=[rules.save("output", slot="clean")]):
        await model(ids, attention_mask=mask)
    slots = await client.list_slots()
    assert [(s.name, s.dtype, s.shape) for s in slots] == [("clean", "float32", (2, 6, 32))]
    assert_same(await client.get_slot("clean"), clean_hidden["x"])
    result = await model.infer(corrupted, attention_mask=mask, hooks=[
        hookwire.HookSpec("encoder.layers.0", posthook=[rules.patch("output", slot="clean", index="[:, 1]")])])
    assert_same(result.output, expected)


async def test_save_with_selection_and_request_scoped_save(client) -> None:
    await client.session()
    model = client.model("mlp")
    await model.infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[rules.save("output", slot="last", index="[-1]")])])
    assert_same(await client.get_slot("last"), local_models()["mlp"].fc1(X)[-1].detach())


async def test_slot_rules_need_a_session_for_request_hooks(server) -> None:
    async with hookwire.connect(server.target) as fresh:  # no session opened
        with pytest.raises(hookwire.InvalidArgumentError, match="session_id"):
            await fresh.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[rules.save("output", "s")])])


async def test_patch_from_an_empty_slot_fails_the_call_naming_hook_module_and_rule(client) -> None:
    await client.session()
    with pytest.raises(hookwire.FailedPreconditionError) as info:
        await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[
            rules.scale("output", 2.0), rules.patch("output", slot="nothing-here")])])
    assert re.search(r"hook hk_\w+ on module 'fc1' of 'mlp': rule 1 \(patch on output\) failed: slot 'nothing-here' is empty",
                     info.value.details), info.value.details
    assert_same(await client.model("mlp")(X), local_models()["mlp"](X).detach())


async def test_slots_are_bounded_per_session_and_die_with_it(shared_server, shared) -> None:
    await shared.session()
    model = shared.model("scale")
    await model.infer(torch.ones(1000), hooks=[hookwire.HookSpec("", posthook=[rules.save("output", "a")])])  # 4000 B
    await model.infer(torch.ones(1000), hooks=[hookwire.HookSpec("", posthook=[rules.save("output", "a")])])  # replaces
    with pytest.raises(hookwire.ResourceExhaustedError, match=r"slot 'b'.*over the limit of 8192 \(max_slot_bytes\)"):
        await model.infer(torch.ones(1500), hooks=[hookwire.HookSpec("", posthook=[rules.save("output", "b")])])
    assert [s.name for s in await shared.list_slots()] == ["a"]
    session_id = shared.session_id
    await shared.close()
    async with hookwire.connect(shared_server.target) as other:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await other.hook_stub.ListSlots(hook_service_pb2.ListSlotsRequest(session_id=session_id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_get_slot_unknown_is_not_found(client) -> None:
    await client.session()
    with pytest.raises(hookwire.NotFoundError, match="no slot 'zzz'"):
        await client.get_slot("zzz")


async def test_shared_rules_are_refused_unless_allowed(client) -> None:
    model = client.model("mlp")
    for scope, tags in (("all", ()), ("tagged", ("b",))):
        with pytest.raises(hookwire.PermissionDeniedError, match="--allow-shared-rules"):
            await model.hook("fc1", posthook=[rules.zero("output")], scope=scope, tags=tags)
    # Capturing and saving other callers' traffic changes nothing: allowed.
    async with model.hook("fc1", posthook=hookwire.edit(rules.save("output", "seen"), capture=("output",)), scope="all"):
        pass
    assert await client.list_hooks(session_id=client.session_id) == []


async def test_tagged_steering_changes_only_tagged_calls(shared, shared_other) -> None:
    plain = local_models()["mlp"](X).detach()
    steered = local_models()["mlp"]
    steered.fc1.register_forward_hook(lambda m, a, out: out + VEC)
    expected = steered(X).detach()
    async with shared.model("mlp").hook("fc1", posthook=hookwire.edit(rules.add("output", VEC), capture=("output",)),
                                        scope="tagged", tags=["variant-b"]) as hook:
        model = shared_other.model("mlp")
        a = await model.infer(X, tags=["variant-a"])
        b = await model.infer(X, tags=["variant-b", "x"])
        untagged = await model.infer(X)
        (event,) = [e async for e in take(hook, 1)]
    assert_same(a.output, plain)
    assert_same(untagged.output, plain)
    assert_same(b.output, expected)
    assert event.request_id == b.request_id


async def test_shared_hook_failing_at_run_time_is_disabled_with_a_notice(shared, shared_other) -> None:
    plain = local_models()["mlp"](X).detach()
    async with shared.model("mlp").hook("fc1", posthook=[rules.zero("output", index="[:, 40]")], scope="all") as hook:
        first = await shared_other.model("mlp")(X)  # index 40 is out of range for 32 features
        second = await shared_other.model("mlp")(X)
        assert_same(first, plain)
        assert_same(second, plain)
        (info,) = [h for h in await shared.list_hooks() if h.hook_id == hook.id]
        assert "rule 0 (zero on output[:, 40]) failed: IndexError" in info.disabled_reason
        session = await shared.session()
        for _ in range(3000):  # up to 60 s: a hang guard
            if any(n.kind == "hook_disabled" and n.hook_id == hook.id for n in session.router.notices):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("no hook_disabled notice")


async def test_on_error_policies_can_be_chosen(shared, shared_other, client) -> None:
    # On "act" (a ReLU: its width is known only in the pass) a 7-wide operand is accepted
    # at registration and fails when it is applied to the 32-wide value.
    # A session hook that disables itself instead of failing its owner's call.
    model = client.model("mlp")
    async with model.hook("act", posthook=[rules.add("output", torch.ones(7))], on_error="disable_hook"):
        assert_same(await model(X), local_models()["mlp"](X).detach())
    # Default for session scope: the call fails with INVALID_ARGUMENT naming the rule.
    async with model.hook("act", posthook=[rules.add("output", torch.ones(7))]):
        with pytest.raises(hookwire.InvalidArgumentError, match=r"rule 0 \(add on output\) failed: add.value.tensor is \[7\]"):
            await model(X)
    # A shared hook that opts into failing the calls it touches.
    async with shared.model("mlp").hook("act", posthook=[rules.add("output", torch.ones(7))], scope="all",
                                        on_error="fail_call"):
        with pytest.raises(hookwire.InvalidArgumentError):
            await shared_other.model("mlp")(X)
    assert_same(await shared_other.model("mlp")(X), local_models()["mlp"](X).detach())


async def test_backward_rule_failure_fails_the_call_and_the_model_recovers(client) -> None:
    with pytest.raises(hookwire.InvalidArgumentError, match=r"rule 0 \(zero on grad_input.0\[5\]\) failed"):
        await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc2", backward_hook=[rules.zero("grad_input.0", index="[5]")])],
                                        backward=hookwire.Backward())
    result = await client.model("mlp").infer(X, backward=hookwire.Backward(return_input_grads=True))
    assert result.input_grads[0].shape == X.shape


def _raw_rule(**fields) -> rule_pb2.Rule:
    return rule_pb2.Rule(**fields)


BAD_RULES = {
    "unknown target root": (_raw_rule(target="outputs", zero=rule_pb2.ZeroOp()), "posthook", r"posthook.rules\[0\].target: 'outputs': a posthook can change output"),
    "phase cannot see": (_raw_rule(target="args.0", zero=rule_pb2.ZeroOp()), "posthook", r"posthook.rules\[0\].target: 'args.0'"),
    "grad_input in backward prehook": (_raw_rule(target="grad_input.0", zero=rule_pb2.ZeroOp()), "backward_prehook", r"backward_prehook.rules\[0\].target"),
    "args without index": (_raw_rule(target="args", zero=rule_pb2.ZeroOp()), "prehook", r"args is a tuple: name an item"),
    "kwargs without with_kwargs": (_raw_rule(target="kwargs.mask", zero=rule_pb2.ZeroOp()), "prehook", "only with with_kwargs"),
    "malformed target": (_raw_rule(target="output..0", zero=rule_pb2.ZeroOp()), "posthook", "malformed"),
    "no operation": (_raw_rule(target="output"), "posthook", r"posthook.rules\[0\]: no operation"),
    "malformed selection": (_raw_rule(target="output", index="[:, 1", zero=rule_pb2.ZeroOp()), "posthook", r"posthook.rules\[0\].index: .* must be enclosed"),
    "code in selection": (_raw_rule(target="output", index="[__import__('os')]", zero=rule_pb2.ZeroOp()), "posthook", r"rules\[0\].index: .*is not an integer"),
    "zero step": (_raw_rule(target="output", index="[::0]", zero=rule_pb2.ZeroOp()), "posthook", "step 0 must be positive"),
    "negative step": (_raw_rule(target="output", index="[::-1]", zero=rule_pb2.ZeroOp()), "posthook", "step -1 must be positive"),
    "two ellipses": (_raw_rule(target="output", index="[..., ...]", zero=rule_pb2.ZeroOp()), "posthook", r"only one \.\.\."),
    "non-finite factor": (_raw_rule(target="output", scale=rule_pb2.ScaleOp(factor=float("inf"))), "posthook", r"rules\[0\].scale.factor: inf is not finite"),
    "nan factor": (_raw_rule(target="output", scale=rule_pb2.ScaleOp(factor=float("nan"))), "posthook", "scale.factor: nan is not finite"),
    "negative std": (_raw_rule(target="output", noise=rule_pb2.NoiseOp(std=-1)), "posthook", r"rules\[0\].noise.std: -1.0 is negative"),
    "operand bytes": (_raw_rule(target="output", add=rule_pb2.AddOp(value=rule_pb2.Operand(tensor=dict(dtype=1, shape=[4], data=b"\0" * 3)))), "posthook", r"rules\[0\].add.value.tensor: 3 bytes of data, but shape \[4\]"),
    "missing operand": (_raw_rule(target="output", set=rule_pb2.SetOp()), "posthook", r"rules\[0\].set.value: missing"),
    "clamp without bounds": (_raw_rule(target="output", clamp=rule_pb2.ClampOp()), "posthook", "set min, max or both"),
    "clamp min above max": (_raw_rule(target="output", clamp=rule_pb2.ClampOp(min=2, max=1)), "posthook", "min 2.0 is above max 1.0"),
    "zero direction": (_raw_rule(target="output", project_out=rule_pb2.ProjectOutOp(direction=dict(dtype=1, shape=[2], data=b"\0" * 8))), "posthook", "not all zeros"),
    "2-d direction": (_raw_rule(target="output", project_out=rule_pb2.ProjectOutOp(direction=dict(dtype=1, shape=[1, 1], data=b"\0" * 4))), "posthook", "1-D floating-point"),
    "unnamed slot": (_raw_rule(target="output", save=rule_pb2.SaveOp()), "posthook", r"rules\[0\].save.slot: name a slot"),
}


@pytest.mark.parametrize("case", list(BAD_RULES))
async def test_rule_validation_at_registration(client, case: str) -> None:
    rule, field, message = BAD_RULES[case]
    session = await client.session()
    spec = hook_pb2.HookSpec(model="mlp", module="fc1", prehook_kwargs=hook_pb2.PreHookOptions())
    getattr(spec, field).rules.append(rule)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.hook_stub.RegisterHook(hook_service_pb2.RegisterHookRequest(session_id=session.session_id, spec=spec))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, info.value.details()), info.value.details()
    assert await client.list_hooks(session_id=session.session_id) == []


async def test_tag_validation(client) -> None:
    model = client.model("mlp")
    with pytest.raises(hookwire.InvalidArgumentError, match="needs at least one tag"):
        await model.hook("fc1", posthook=hookwire.capture(), scope="tagged")
    with pytest.raises(hookwire.InvalidArgumentError, match="only SCOPE_TAGGED hooks have tags"):
        await model.hook("fc1", posthook=hookwire.capture(), tags=["x"])
