"""Remote hooks behave like in-process torch hooks: same tensors, same order, same gating."""

from __future__ import annotations

import asyncio

import pytest
import torch

import hookwire
from support import Recorder, assert_same, collect, local_models


async def test_posthook_captures_are_bit_identical_with_nested_structure(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    oracle = Recorder()
    for path in ("encoder.layers.0.attn", "encoder.layers.1.attn"):
        oracle.hook(local, path, "forward", with_kwargs=True)
    with torch.no_grad():
        local(ids, attention_mask=mask)
    model = client.model("tiny-transformer")
    async with model.hook("encoder.layers.*.attn", posthook=hookwire.capture("args", "kwargs", "output"),
                          posthook_kwargs={"with_kwargs": True}) as hook:
        assert hook.modules == ("encoder.layers.0.attn", "encoder.layers.1.attn")
        result = await model.infer(ids, attention_mask=mask)
        events = await collect(hook, 2)
    for event, expected in zip(events, oracle.events):
        assert event.module == expected["module"] and event.phase == "forward"
        assert event.request_id == result.request_id and event.training is False
        assert_same(event.args, expected["args"], "args")
        assert_same(event.kwargs, expected["kwargs"], "kwargs")
        assert_same(event.output, expected["output"], "output")  # a tuple (output, weights)
    assert [e.seq for e in events] == [1, 2]


async def test_prehook_sees_args_and_kwargs_only_with_with_kwargs(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    oracle = Recorder()
    oracle.hook(local, "encoder.layers.0", "forward_pre", with_kwargs=True)
    with torch.no_grad():
        local(ids, attention_mask=mask)
    model = client.model("tiny-transformer")
    async with model.hook("encoder.layers.0", prehook=hookwire.capture("args", "kwargs"),
                          prehook_kwargs={"with_kwargs": True}) as hook:
        await model(ids, attention_mask=mask)
        (event,) = await collect(hook, 1)
    assert event.phase == "forward_pre" and event.output is None
    assert_same(event.args, oracle.events[0]["args"])
    assert_same(event.kwargs, oracle.events[0]["kwargs"])
    assert list(event.kwargs) == ["attention_mask"]

    async with model.hook("encoder.layers.0", prehook=hookwire.capture("args")) as hook:
        await model(ids, attention_mask=mask)
        (event,) = await collect(hook, 1)
    assert event.kwargs == {} and len(event.args) == 1
    with pytest.raises(hookwire.InvalidArgumentError, match="with_kwargs"):
        await model.hook("encoder.layers.0", prehook=hookwire.capture("kwargs"))


async def test_prepend_orders_hooks_like_torch(client, other_client) -> None:
    x = torch.randn(2, 8)
    local = local_models()["mlp"]
    oracle = Recorder()
    oracle.hook(local, "fc1", "forward", tag="first")
    oracle.hook(local, "fc1", "forward", tag="second", prepend=True)
    oracle.hook(local, "fc1", "forward", tag="third")
    local(x)
    expected_order = [e["tag"] for e in oracle.events]
    assert expected_order == ["second", "first", "third"]

    model = client.model("mlp")
    specs = {
        "first": hookwire.HookSpec("fc1", posthook=hookwire.capture("output")),
        "second": hookwire.HookSpec("fc1", posthook=hookwire.capture("output"), posthook_kwargs={"prepend": True}),
        "third": hookwire.HookSpec("fc1", posthook=hookwire.capture("output")),
    }
    # Request-scoped hooks: events come back in firing order.
    result = await model.infer(x, hooks=list(specs.values()))
    name_of = dict(zip(result.hook_ids, specs))
    assert [name_of[e.hook_id] for e in result.events] == expected_order
    for event in result.events:
        assert_same(event.output, oracle.events[0]["output"])

    # Session hooks, registered one after the other: a subscription to all three
    # receives their events in firing order on one stream.
    handles = {name: await client.register_hook(spec, model="mlp") for name, spec in specs.items()}
    name_of = {h.id: name for name, h in handles.items()}
    try:
        async with other_client.subscribe(name_of) as sub:
            await model(x)
            fired = []
            async for event in sub:
                fired.append(name_of[event.hook_id])
                if len(fired) == 3:
                    break
    finally:
        for handle in handles.values():
            await handle.remove()
    assert fired == expected_order


async def test_always_call_fires_when_forward_raises(client) -> None:
    model = client.model("mlp")
    bad = torch.randn(2, 3)  # fc1 wants 8 features
    async with model.hook("fc1", posthook=hookwire.capture("output"), posthook_kwargs={"always_call": True}) as always, \
            model.hook("fc1", posthook=hookwire.capture("output")) as plain:
        with pytest.raises(hookwire.InvalidArgumentError, match=r"module 'fc1' \(Linear\).*mat1 and mat2"):
            await model(bad)
        (event,) = await collect(always, 1)
        assert event.output is None and event.raw.output.WhichOneof("kind") == "null_value"
        good = await model.infer(torch.randn(2, 8))
        (event,) = await collect(plain, 1)
        assert event.request_id == good.request_id  # nothing from the failed call
        (event,) = await collect(always, 1)
        assert event.request_id == good.request_id


@pytest.mark.parametrize("train_update,eval_update", [(True, False), (False, True), (False, False)])
async def test_train_eval_gating(client, train_update: bool, eval_update: bool) -> None:
    model = client.model("mlp")
    x = torch.randn(2, 8)
    async with model.hook("drop", posthook=hookwire.capture("output"), prehook=hookwire.capture("args"),
                          train_update=train_update, eval_update=eval_update) as hook:
        r_train = await model.infer(x, mode="train", seed=1)
        r_eval = await model.infer(x)
        marker = await model.hook("out", posthook=hookwire.capture())  # removal notice ends the stream below
        await hook.remove()
        seen = [e async for e in hook.events()]
        await marker.remove()
    expected = ([r_train.request_id] * 2 if train_update else []) + ([r_eval.request_id] * 2 if eval_update else [])
    assert [e.request_id for e in seen] == expected
    assert all(e.training == (e.request_id == r_train.request_id) for e in seen)


async def test_gating_reads_the_hooked_modules_flag(client) -> None:
    local = local_models()["mlp"]
    oracle = Recorder()
    oracle.hook(local, "drop", "forward")
    local.train()
    x = torch.randn(3, 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        local(x)
    result = await client.model("mlp").infer(
        x, mode="train", seed=5, hooks=[hookwire.HookSpec("drop", posthook=hookwire.capture("output"), eval_update=False)]
    )
    (event,) = result.events
    assert event.training is True
    assert_same(event.output, oracle.events[0]["output"])


async def test_module_called_twice_fires_twice_with_call_index(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    oracle = Recorder()
    oracle.hook(local, "norm", "forward")
    with torch.no_grad():
        local(ids, attention_mask=mask)
    result = await client.model("tiny-transformer").infer(
        ids, attention_mask=mask,
        hooks=[hookwire.HookSpec("norm", prehook=hookwire.capture("args"), posthook=hookwire.capture("output"))],
    )
    assert [(e.phase, e.call_index) for e in result.events] == [
        ("forward_pre", 0), ("forward", 0), ("forward_pre", 1), ("forward", 1)
    ]
    assert [e.seq for e in result.events] == [1, 2, 3, 4]
    assert_same(result.events[1].output, oracle.events[0]["output"])
    assert_same(result.events[3].output, oracle.events[1]["output"])


async def test_glob_patterns(client) -> None:
    model = client.model("tiny-transformer")
    async with model.hook("encoder.**.qkv", posthook=hookwire.capture()) as h:
        assert h.modules == ("encoder.layers.0.attn.qkv", "encoder.layers.1.attn.qkv")
    async with model.hook("encoder.layers.?.norm*", posthook=hookwire.capture()) as h:
        assert h.modules == tuple(f"encoder.layers.{i}.norm{j}" for i in (0, 1) for j in (1, 2))
    async with model.hook("", posthook=hookwire.capture()) as h:
        assert h.modules == ("",)


async def test_capture_nothing_counts_but_sends_nothing(client) -> None:
    result = await client.model("mlp").infer(torch.randn(1, 8), hooks=[hookwire.HookSpec("fc1", posthook=hookwire.capture())])
    assert result.events == ()


async def test_unencodable_capture_is_a_notice_not_a_failed_call(client, other_client) -> None:
    model = client.model("odd")
    with pytest.raises(hookwire.UnimplementedError, match="device"):
        await model(torch.zeros(1))
    async with other_client.model("odd").hook("", posthook=hookwire.capture("output"), scope="all") as hook:
        with pytest.raises(hookwire.UnimplementedError):
            await model(torch.zeros(1))  # fails for its own output, not because of the hook
        session = await other_client.session()
        for _ in range(1200):  # up to 60 s: a hang guard
            if any(n.kind == "capture_failed" and n.hook_id == hook.id for n in session.router.notices):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("no capture_failed notice")
