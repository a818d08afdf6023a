"""Backward hooks and gradients equal torch.autograd's on the same computation."""

from __future__ import annotations

import torch

import hookwire
from support import Recorder, assert_same, collect, local_models


async def test_backward_hooks_match_autograd_mlp(client) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    local = local_models()["mlp"]
    oracle = Recorder()
    for path in ("fc1", "fc2", "out"):
        oracle.hook(local, path, "backward_pre")
        oracle.hook(local, path, "backward")
    xl = x.clone().requires_grad_(True)
    local(xl).backward(grad)

    result = await client.model("mlp").infer(
        x,
        hooks=[hookwire.HookSpec("*", backward_prehook=hookwire.capture("grad_output"),
                                 backward_hook=hookwire.capture("grad_input", "grad_output"))],
        backward=hookwire.Backward(grad=grad, return_input_grads=True),
    )
    remote = [e for e in result.events if e.module in ("fc1", "fc2", "out")]
    assert [(e.module, e.phase) for e in remote] == [(e["module"], e["phase"]) for e in oracle.events]
    for event, expected in zip(remote, oracle.events):
        assert_same(event.grad_output, expected["grad_output"], f"{event.module} grad_output")
        if event.phase == "backward":
            assert_same(event.grad_input, expected["grad_input"], f"{event.module} grad_input")
    assert_same(result.input_grads[0], xl.grad)


async def test_backward_through_dict_output_and_session_hooks(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    oracle = Recorder()
    oracle.hook(local, "encoder.layers.1", "backward")
    oracle.hook(local, "encoder.layers.0", "backward")
    embeds = local.embed(ids).detach()
    leaf = embeds.clone().requires_grad_(True)
    local(attention_mask=mask, inputs_embeds=leaf)["logits"].backward(torch.ones(2, 3))

    model = client.model("tiny-transformer")
    async with model.hook("encoder.layers.*", backward_hook=hookwire.capture("grad_input", "grad_output")) as hook:
        result = await model.infer(
            attention_mask=mask, inputs_embeds=embeds,
            backward=hookwire.Backward("logits", return_input_grads=True),
        )
        events = await collect(hook, 2)
    assert [e.module for e in events] == ["encoder.layers.1", "encoder.layers.0"]
    for event, expected in zip(events, oracle.events):
        assert event.phase == "backward" and event.call_index == 0
        assert_same(event.grad_input, expected["grad_input"])
        assert_same(event.grad_output, expected["grad_output"])
    assert result.input_grads == ()
    assert_same(result.input_kwargs_grads["inputs_embeds"], leaf.grad)
    assert result.input_kwargs_grads["attention_mask"] is None  # bool: no gradient


async def test_module_used_twice_backward_call_index(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    oracle = Recorder()
    oracle.hook(local, "norm", "backward")
    local(ids, attention_mask=mask)["last_hidden_state"].sum().backward()
    result = await client.model("tiny-transformer").infer(
        ids, attention_mask=mask,
        hooks=[hookwire.HookSpec("norm", backward_hook=hookwire.capture("grad_output"))],
        backward=hookwire.Backward("last_hidden_state"),
    )
    assert [e.call_index for e in result.events] == [0, 1]
    for event, expected in zip(result.events, oracle.events):
        assert_same(event.grad_output, expected["grad_output"])


async def test_parameter_grads_never_leak_between_calls(client, server) -> None:
    x = torch.randn(2, 8)
    model = client.model("mlp")
    first = await model.infer(x, backward=hookwire.Backward(return_input_grads=True))
    second = await model.infer(x, backward=hookwire.Backward(return_input_grads=True))
    assert_same(second.input_grads[0], first.input_grads[0])
    module = server.server.registry.get("mlp").module
    assert all(p.grad is None for p in module.parameters())
    hooked = await model.infer(
        x, hooks=[hookwire.HookSpec("fc1", backward_hook=hookwire.capture("grad_output"))],
        backward=hookwire.Backward(),
    )
    again = await model.infer(
        x, hooks=[hookwire.HookSpec("fc1", backward_hook=hookwire.capture("grad_output"))],
        backward=hookwire.Backward(),
    )
    assert_same(again.events[0].grad_output, hooked.events[0].grad_output)


async def test_backward_hooks_do_not_fire_without_backward(client) -> None:
    result = await client.model("mlp").infer(
        torch.randn(1, 8), hooks=[hookwire.HookSpec("fc1", backward_hook=hookwire.capture("grad_input"))]
    )
    assert result.events == ()
