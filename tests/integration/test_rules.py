"""Modification rules equal the same out-of-place edit done by an in-process torch hook:
outputs and gradients are torch.equal, in every phase where an operation applies."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import hookwire
from hookwire import rules
from support import assert_same, local_models

G = torch.Generator().manual_seed(11)
X = torch.randn(4, 8, generator=G)
VEC = torch.randn(32, generator=G)
GRAD = torch.randn(4, 4, generator=G)

# op name -> (SDK rule builder, in-process op on the selected tensor)
OPS: dict[str, tuple[Any, Any]] = {
    "scale": (lambda t, i: rules.scale(t, 0.5, index=i), lambda x: x * 0.5),
    "add_scalar": (lambda t, i: rules.add(t, 1.25, index=i), lambda x: x + 1.25),
    "add_vector": (lambda t, i: rules.add(t, VEC[:8] if i else VEC, index=i),
                   lambda x: x + (VEC[:8] if x.shape[-1] == 8 else VEC)),
    "set_scalar": (lambda t, i: rules.set(t, -2.0, index=i), lambda x: torch.full_like(x, -2.0)),
    "set_tensor": (lambda t, i: rules.set(t, VEC[:8] if i else VEC, index=i),
                   lambda x: (VEC[:8] if x.shape[-1] == 8 else VEC).expand(x.shape).clone()),
    "zero": (lambda t, i: rules.zero(t, index=i), torch.zeros_like),
    "clamp": (lambda t, i: rules.clamp(t, min=-0.1, max=0.2, index=i), lambda x: x.clamp(min=-0.1, max=0.2)),
    "clamp_min": (lambda t, i: rules.clamp(t, min=0.05, index=i), lambda x: x.clamp(min=0.05)),
    "noise": (lambda t, i: rules.noise(t, 0.3, seed=5, index=i),
              lambda x: x + 0.3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=x.dtype)),
    "project_out": (lambda t, i: rules.project_out(t, VEC[:8] if i else VEC, index=i), None),
}


def _project(x: torch.Tensor) -> torch.Tensor:
    d = VEC[:8] if x.shape[-1] == 8 else VEC
    d = d / torch.linalg.vector_norm(d)
    return x - (x @ d).unsqueeze(-1) * d


OPS["project_out"] = (OPS["project_out"][0], _project)

# phase -> (HookSpec field, module, target, local hook installer)
PHASES = {
    "prehook": ("fc2", "args.0"),
    "posthook": ("fc1", "output"),
    "backward_prehook": ("fc2", "grad_output.0"),
    "backward_hook": ("fc2", "grad_input.0"),
}
INDEXES = {None: None, "[:, 4:12]": (slice(None), slice(4, 12))}


def _edit(op: Any, t: torch.Tensor, index: Any) -> torch.Tensor:
    if index is None:
        return op(t)
    new = t.clone()
    new[index] = op(t[index])
    return new


def _local(phase: str, op: Any, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
    model = local_models()["mlp"]
    module_path, _ = PHASES[phase]
    module = model.get_submodule(module_path)
    if phase == "prehook":
        module.register_forward_pre_hook(lambda m, args: (_edit(op, args[0], index),))
    elif phase == "posthook":
        module.register_forward_hook(lambda m, args, out: _edit(op, out, index))
    elif phase == "backward_prehook":
        module.register_full_backward_pre_hook(lambda m, go: (_edit(op, go[0], index),))
    else:
        module.register_full_backward_hook(lambda m, gi, go: (_edit(op, gi[0], index),))
    x = X.clone().requires_grad_(True)
    out = model(x)
    out.backward(GRAD)
    return out.detach(), x.grad


@pytest.mark.parametrize("index_text", list(INDEXES))
@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("op_name", list(OPS))
async def test_every_op_in_every_phase_equals_torch(client, op_name: str, phase: str, index_text: str | None) -> None:
    build, op = OPS[op_name]
    module, target = PHASES[phase]
    expected_out, expected_grad = _local(phase, op, INDEXES[index_text])
    result = await client.model("mlp").infer(
        X, hooks=[hookwire.HookSpec(module, **{phase: [build(target, index_text)]})],
        backward=hookwire.Backward(grad=GRAD, return_input_grads=True),
    )
    assert_same(result.output, expected_out)
    assert_same(result.input_grads[0], expected_grad)
    if phase in ("prehook", "posthook") and op_name not in ("add_scalar",):
        plain = local_models()["mlp"](X)
        assert not torch.equal(result.output, plain), "the rule should change the output"


async def test_kwargs_and_nested_output_targets_equal_torch(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    keep_first = torch.zeros_like(mask)
    keep_first[:, :2] = True
    local.encoder.layers[0].register_forward_pre_hook(
        lambda m, a, k: (a, {**k, "attention_mask": keep_first.clone()}), with_kwargs=True)

    def edit_attn(m, a, out):
        attended = out[0].clone()
        attended[:, -1] = 0
        return (attended, out[1] * 2)

    local.encoder.layers[1].attn.register_forward_hook(edit_attn)
    with torch.no_grad():
        expected = local(ids, attention_mask=mask)
    model = client.model("tiny-transformer")
    result = await model.infer(ids, attention_mask=mask, hooks=[
        hookwire.HookSpec("encoder.layers.0", prehook=[rules.set("kwargs.attention_mask", keep_first)],
                          prehook_kwargs={"with_kwargs": True}),
        hookwire.HookSpec("encoder.layers.1.attn", posthook=[
            rules.zero("output.0", index="[:, -1]"), rules.scale("output.1", 2.0)]),
    ])
    assert_same(result.output, expected)


async def test_dict_output_key_target(client, tokens) -> None:
    ids, mask = tokens
    local = local_models()["tiny-transformer"]
    local.register_forward_hook(lambda m, a, out: {**out, "logits": out["logits"].clamp(max=0.0)})
    with torch.no_grad():
        expected = local(ids, attention_mask=mask)
    result = await client.model("tiny-transformer").infer(
        ids, attention_mask=mask, hooks=[hookwire.HookSpec("", posthook=[rules.clamp("output.logits", max=0.0)])])
    assert_same(result.output, expected)


async def test_rules_apply_in_order_and_prepend_orders_hooks(client) -> None:
    local = local_models()["mlp"]
    local.fc1.register_forward_hook(lambda m, a, out: out + 1.0)
    local.fc1.register_forward_hook(lambda m, a, out: out * 3.0, prepend=True)
    expected = local(X)
    local2 = local_models()["mlp"]
    local2.fc1.register_forward_hook(lambda m, a, out: (out * 3.0).clamp(max=0.5))
    expected2 = local2(X)
    model = client.model("mlp")
    result = await model.infer(X, hooks=[
        hookwire.HookSpec("fc1", posthook=[rules.add("output", 1.0)]),
        hookwire.HookSpec("fc1", posthook=[rules.scale("output", 3.0)], posthook_kwargs={"prepend": True}),
    ])
    assert_same(result.output, expected)
    result = await model.infer(X, hooks=[
        hookwire.HookSpec("fc1", posthook=[rules.scale("output", 3.0), rules.clamp("output", max=0.5)])])
    assert_same(result.output, expected2)


async def test_captures_before_or_after_rules(client) -> None:
    plain = local_models()["mlp"].fc1(X)
    model = client.model("mlp")
    zero = rules.zero("output", index="[:, :5]")
    after = await model.infer(X, hooks=[hookwire.HookSpec("fc1", posthook=hookwire.edit(zero, capture=("output",)))])
    before = await model.infer(X, hooks=[hookwire.HookSpec(
        "fc1", posthook=hookwire.edit(zero, capture=("output",), capture_before_rules=True))])
    assert_same(before.events[0].output, plain.detach())
    edited = plain.detach().clone()
    edited[:, :5] = 0
    assert_same(after.events[0].output, edited)


async def test_session_rules_change_only_the_owners_calls_under_concurrency(client, other_client) -> None:
    plain = local_models()["mlp"](X).detach()
    steered = local_models()["mlp"]
    steered.fc1.register_forward_hook(lambda m, a, out: out + VEC)
    expected = steered(X).detach()
    mine, theirs = client.model("mlp"), other_client.model("mlp")
    async with mine.hook("fc1", posthook=[rules.add("output", VEC)]):
        results = await asyncio.gather(*[
            (mine if i % 2 == 0 else theirs).infer(X) for i in range(20)
        ])
    for i, r in enumerate(results):
        assert_same(r.output, expected if i % 2 == 0 else plain)
    assert_same(await mine(X), plain)  # gone with the hook


async def test_request_rules_change_only_their_call(client, other_client) -> None:
    plain = local_models()["mlp"](X).detach()
    spec = hookwire.HookSpec("fc1", posthook=[rules.zero("output")])
    results = await asyncio.gather(
        client.model("mlp").infer(X, hooks=[spec]), other_client.model("mlp").infer(X),
        client.model("mlp").infer(X), other_client.model("mlp").infer(X, hooks=[spec]),
    )
    assert not torch.equal(results[0].output, plain)
    assert_same(results[1].output, plain)
    assert_same(results[2].output, plain)
    assert_same(results[3].output, results[0].output)


async def test_noise_is_reproducible(client) -> None:
    spec = hookwire.HookSpec("fc1", posthook=[rules.noise("output", 0.5, seed=9)])
    a = await client.model("mlp").infer(X, hooks=[spec])
    b = await client.model("mlp").infer(X, hooks=[spec])
    other = await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[rules.noise("output", 0.5, seed=10)])])
    assert_same(a.output, b.output)
    assert not torch.equal(a.output, other.output)
