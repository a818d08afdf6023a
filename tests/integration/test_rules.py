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


def _sae(d_in: int, d_sae: int = 8) -> rules.Sae:
    return rules.Sae.of(torch.zeros(d_in, d_sae), torch.zeros(d_sae), torch.zeros(d_sae, d_in), torch.zeros(d_in))


# hook spec with an operand of the wrong width -> what the refusal names (tiny-lm is 64 wide,
# its heads 16; mlp's fc2 is Linear(32, 32)). Each module states its width: a decoder layer
# by the config's hidden_size, a projection by nn.Linear, a norm by its weight, an embedding.
WRONG_WIDTHS: dict[str, tuple[str, hookwire.HookSpec, str]] = {
    "steering vector on a decoder layer": ("tiny-lm", hookwire.HookSpec(
        "model.layers.0", posthook=[rules.add("output", torch.ones(63))]),
        r"posthook.rules\[0\].add.value.tensor: shape \[63\] does not fit module 'model.layers.0': rule 0 \(add on "
        r"output\) edits output, and its output is 64 wide \(the model config's hidden_size\), so the operand's last "
        r"dimension must be 64 \(or 1, to broadcast\)"),
    "direction on a projection": ("tiny-lm", hookwire.HookSpec(
        "model.layers.0.self_attn.k_proj", posthook=[rules.project_out("output", torch.ones(64))]),
        r"project_out.direction: shape \[64\] does not fit module 'model.layers.0.self_attn.k_proj'.*its output is "
        r"32 wide \(Linear.out_features\)"),
    "affine on a norm": ("tiny-lm", hookwire.HookSpec(
        "model.norm", posthook=[rules.affine("output", torch.eye(32))]),
        r"affine.weight: shape \[32, 32\] does not fit module 'model.norm'.*64 wide \(LlamaRMSNorm.weight's shape\)"),
    "norm_add on the embedding": ("tiny-lm", hookwire.HookSpec(
        "model.embed_tokens", posthook=[rules.norm_add("output", torch.ones(65), 2.0)]),
        r"norm_add.direction: shape \[65\].*'model.embed_tokens'.*64 wide \(Embedding.embedding_dim\)"),
    "probe on a layer's input": ("tiny-lm", hookwire.HookSpec(
        "model.layers.1", prehook=[rules.signal("args.0", "s", rules.probe(torch.ones(32)))]),
        r"prehook.rules\[0\].signal.signal.probe.weight: shape \[32\].*its input is 64 wide"),
    "SAE on a Linear": ("mlp", hookwire.HookSpec("fc2", posthook=[rules.sae("output", _sae(16), [0])]),
                        r"sae.sae.w_enc: shape \[16, 8\] does not fit module 'fc2'.*dimension 0 must be 32"),
    "conditional's operation": ("tiny-lm", hookwire.HookSpec(
        "model.layers.0", posthook=[rules.when(rules.norm() > 1.0, rules.add("output", torch.ones(8)))]),
        r"conditional.then.add.value.tensor: shape \[8\]"),
    "a head's width": ("tiny-lm", hookwire.HookSpec(
        "model.layers.0.self_attn.q_proj", posthook=[rules.add("output", torch.ones(64)).on_heads(1)]),
        r"add.value.tensor: shape \[64\].*each of its heads is 16 wide"),
}


@pytest.mark.parametrize("case", list(WRONG_WIDTHS))
async def test_operands_of_the_wrong_width_are_refused_at_registration(client, case: str) -> None:
    """Where a module states its width, an operand that cannot fit is INVALID_ARGUMENT when
    the hook is registered (and in an Infer request's hooks), naming the field, the
    module, the rule, the operand's shape and the width; nothing runs, nothing stays."""
    name, spec, message = WRONG_WIDTHS[case]
    model = client.model(name)
    with pytest.raises(hookwire.InvalidArgumentError, match=message):
        await model.hook(spec.module, prehook=spec.prehook, posthook=spec.posthook)
    assert await client.list_hooks() == []
    ids = torch.ones(1, 5, dtype=torch.long) if name == "tiny-lm" else X
    with pytest.raises(hookwire.InvalidArgumentError, match=r"^INVALID_ARGUMENT: hooks\[0\]: .*" + message.split(": ", 1)[0]):
        await model.infer(ids, hooks=[spec])


async def test_operands_that_fit_are_accepted_and_unknown_widths_wait_for_the_pass(client) -> None:
    """The width check refuses only what cannot fit: a right-width vector, a size-1 one
    (it broadcasts), one behind an index (the selection may take the last dimension), and
    any operand where the module does not state its width, all register."""
    lm = client.model("tiny-lm")
    ids = torch.ones(1, 5, dtype=torch.long)
    for spec in (
        hookwire.HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(64))]),
        hookwire.HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(1, 1, 1))]),
        hookwire.HookSpec("model.layers.0", posthook=[rules.add("output", torch.ones(8), index="[..., :8]")]),
        hookwire.HookSpec("model.layers.0.mlp.act_fn", posthook=[rules.add("output", torch.ones(128))]),
        hookwire.HookSpec("model.layers.0.self_attn.q_proj", posthook=[rules.add("output", torch.ones(16)).on_heads(1)]),
    ):
        await lm.infer(ids, hooks=[spec])


async def test_a_shape_mismatch_at_run_time_is_worded_in_hookwires_terms(client) -> None:
    """On a module that states no width (mlp's ReLU "act"), a 31-wide steering vector on its
    32-wide output fails in the pass: the message names the hook, the module, the rule and
    both shapes, not torch's broadcasting error."""
    model = client.model("mlp")
    async with model.hook("act", posthook=[rules.add("output", torch.ones(31))]) as hook:
        with pytest.raises(hookwire.InvalidArgumentError) as info:
            await model(X)
    assert info.value.details == (
        f"hook {hook.id} on module 'act' of 'mlp': rule 0 (add on output) failed: add.value.tensor is [31] and the "
        "value it edits, output, is [4, 32]: they do not fit (the operand's width must be 32)"), info.value.details
    assert "size of tensor" not in info.value.details
    # In a request hook too, and for an operation whose operand is multiplied (torch's "mat1 and mat2").
    with pytest.raises(hookwire.InvalidArgumentError, match=(
            r"^INVALID_ARGUMENT: hook hk_\w+ on module 'act' of 'mlp': rule 0 \(affine on output\) failed: affine.weight "
            r"is \[16, 16\] and the value it edits, output, is \[4, 32\]: they do not fit")):
        await model.infer(X, hooks=[hookwire.HookSpec("act", posthook=[rules.affine("output", torch.eye(16))])])
    assert_same(await model(X), local_models()["mlp"](X).detach())
