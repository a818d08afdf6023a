"""The expressive rules (issue 25's first part): learned and low-rank maps, norm-relative
steering, top-k ablations, conditions, and signals one hook keeps for a later hook of the
same call. Each equals the same edit done by an in-process torch hook, bit for bit, also
with an index and through backward; a condition leaves the positions where it does not
hold untouched; a signal never reaches another call's hooks; bad operands are refused
at registration with INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import hookwire
import lm_oracle as oracle
from hookwire import rules
from support import assert_same, local_models

G = torch.Generator().manual_seed(25)
X = torch.randn(4, 8, generator=G)
GRAD = torch.randn(4, 4, generator=G)
D = 32  # mlp's fc1 output width
W = torch.randn(D, D, generator=G) / D ** 0.5
B = torch.randn(D, generator=G)
R = torch.linalg.qr(torch.randn(D, 4, generator=G)).Q.T.contiguous()  # [4, 32], orthonormal rows
LW = torch.randn(4, D, generator=G)
LB = torch.randn(4, generator=G)
V = torch.randn(D, generator=G)
P = torch.randn(6, D, generator=G)
PROBE = torch.randn(D, generator=G)


def _topk(x: torch.Tensor, k: int, keep: bool) -> torch.Tensor:
    f = x @ P.T
    top = torch.zeros_like(f, dtype=torch.bool).scatter_(-1, f.topk(k, dim=-1).indices, True)
    return x - (f * (~top if keep else top)) @ P


# name -> (SDK rule on "output", the in-process edit of the selected tensor)
OPS: dict[str, tuple[Any, Any]] = {
    "affine": (lambda i: rules.affine("output", W, B, index=i), lambda x: torch.nn.functional.linear(x, W, B)),
    "affine_no_bias": (lambda i: rules.affine("output", W, index=i), lambda x: torch.nn.functional.linear(x, W)),
    "loreft": (lambda i: rules.loreft("output", R, LW, LB, index=i),
               lambda x: x + (torch.nn.functional.linear(x, LW, LB) - torch.nn.functional.linear(x, R)) @ R),
    "norm_add": (lambda i: rules.norm_add("output", V, 0.75, index=i),
                 lambda x: x + 0.75 * torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                 * (V.double() / torch.linalg.vector_norm(V.double())).float()),  # the unit vector made in float64
    "top_k_keep": (lambda i: rules.top_k("output", P, 2, mode="keep", index=i), lambda x: _topk(x, 2, True)),
    "top_k_zero": (lambda i: rules.top_k("output", P, 2, mode="zero", index=i), lambda x: _topk(x, 2, False)),
    "when_norm": (lambda i: rules.when(rules.norm() > 4.0, rules.scale("output", -3.0, index=i)),
                  lambda x: torch.where((torch.linalg.vector_norm(x, dim=-1) > 4.0).unsqueeze(-1), x * -3.0, x)),
    "when_probe": (lambda i: rules.when(rules.probe(PROBE, 0.1, sigmoid=True) >= 0.01, rules.add("output", V, index=i)),
                   lambda x: torch.where((torch.sigmoid(x @ PROBE + 0.1) >= 0.01).unsqueeze(-1), x + V, x)),
    "when_projection": (lambda i: rules.when(rules.projection(V) > 0.0, rules.affine("output", W, index=i)),
                        lambda x: torch.where((x @ (V / torch.linalg.vector_norm(V)) > 0.0).unsqueeze(-1),
                                              torch.nn.functional.linear(x, W), x)),
}
INDEXES = {None: None, "[1:3]": slice(1, 3)}


def _local(edit: Any, index: Any) -> tuple[torch.Tensor, torch.Tensor]:
    model = local_models()["mlp"]

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if index is None:
            return edit(out)
        new = out.clone()
        new[index] = edit(out[index])
        return new

    model.fc1.register_forward_hook(hook)
    x = X.clone().requires_grad_(True)
    out = model(x)
    out.backward(GRAD)
    return out.detach(), x.grad


@pytest.mark.parametrize("index_text", list(INDEXES))
@pytest.mark.parametrize("name", list(OPS))
async def test_each_new_op_equals_the_in_process_edit_with_its_gradients(client, name: str, index_text: str | None) -> None:
    build, edit = OPS[name]
    expected_out, expected_grad = _local(edit, INDEXES[index_text])
    result = await client.model("mlp").infer(
        X, hooks=[hookwire.HookSpec("fc1", posthook=[build(index_text)])],
        backward=hookwire.Backward(grad=GRAD, return_input_grads=True))
    assert_same(result.output, expected_out)
    assert_same(result.input_grads[0], expected_grad)
    assert not torch.equal(result.output, local_models()["mlp"](X).detach()), "the rule should change something"


async def test_a_condition_leaves_the_positions_where_it_fails_untouched_bit_for_bit(client) -> None:
    """Captured after the rule: rows whose norm is at most the threshold are exactly the
    unedited rows (the edit is not computed and mixed back: they are the input's bits)."""
    plain = await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=hookwire.capture("output"))])
    before = plain.events[0].output
    norms = torch.linalg.vector_norm(before, dim=-1)
    threshold = float(norms.median())
    edited = await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=hookwire.edit(
        rules.when(rules.norm() > threshold, rules.noise("output", 5.0, seed=3)), capture=("output",)))])
    after = edited.events[0].output
    held = norms > threshold
    assert 0 < int(held.sum()) < len(held)
    assert torch.equal(after[~held].view(torch.int32), before[~held].view(torch.int32))
    assert not torch.equal(after[held], before[held])


async def test_a_signal_kept_at_one_layer_gates_an_edit_at_a_later_one_in_generate(client) -> None:
    """Detect at layer 0, edit at layer 1, at every step: tokens equal in-process generate()
    with the same two hooks; the signal is kept per step (per sequence: its largest probe
    score over the step's positions)."""
    probe = torch.randn(64, generator=torch.Generator().manual_seed(4))
    vector = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 4
    ids, mask = oracle.batch(["the cat sat", "a"])
    kept: dict[str, torch.Tensor] = {}

    def detect(step: int, out: torch.Tensor) -> None:
        kept["s"] = (out @ probe).amax(dim=-1, keepdim=True)

    def edit(step: int, out: torch.Tensor) -> torch.Tensor:
        return torch.where((kept["s"] > 0.0).expand(out.shape[:-1]).unsqueeze(-1), out + vector, out)

    with oracle.forward_hook("model.layers.0", detect), oracle.forward_hook("model.layers.1", edit):
        want = oracle.generate(ids, mask, 6, do_sample=False)
    plain = oracle.generate(ids, mask, 6, do_sample=False)
    result = await client.model("tiny-lm").generate(["the cat sat", "a"], 6, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0", posthook=[rules.signal("output", "s", rules.probe(probe), reduce="max")]),
        hookwire.HookSpec("model.layers.1", posthook=[rules.when(rules.stored("s") > 0.0, rules.add("output", vector))]),
    ])
    assert [list(t) for t in result.token_ids] == want
    assert want != plain, "the gated edit must change the tokens for this test to mean anything"


async def test_signals_stay_with_their_call_in_a_shared_pass(client, other_client) -> None:
    """Two callers of tiny-transformer at once (their calls share passes): the one whose
    later hook reads a signal it never kept fails, naming the signal; the other, which
    keeps it, is not affected and equals its call alone."""
    ids = torch.randint(1, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    keeps = [hookwire.HookSpec("encoder.layers.0", posthook=[rules.signal("output", "n", rules.norm())]),
             hookwire.HookSpec("encoder.layers.1", posthook=[rules.when(rules.stored("n") > 0.0, rules.scale("output", 0.5))])]
    reads = [keeps[1]]
    alone = await client.model("tiny-transformer").infer(ids, hooks=keeps)
    for _ in range(3):
        good, bad = await asyncio.gather(
            client.model("tiny-transformer").infer(ids, hooks=keeps),
            other_client.model("tiny-transformer").infer(ids, hooks=reads), return_exceptions=True)
        assert_same(good.output, alone.output)
        assert isinstance(bad, hookwire.FailedPreconditionError) and "no signal 'n'" in str(bad), bad


async def test_listing_with_operand_data_returns_every_operand_of_the_new_ops(client) -> None:
    handle = await client.model("mlp").hook("fc1", posthook=[
        rules.loreft("output", R, LW, LB), rules.when(rules.probe(PROBE) > 0, rules.top_k("output", P, 3))])
    try:
        (listed,) = [h for h in await client.list_hooks(include_operand_data=True) if h.hook_id == handle.id]
        first, second = listed.raw.spec.posthook.rules
        from hookwire.wire import codec
        assert torch.equal(torch.as_tensor(codec.decode_tensor(first.loreft.rotation)), R)
        assert torch.equal(torch.as_tensor(codec.decode_tensor(first.loreft.bias)), LB)
        assert torch.equal(torch.as_tensor(codec.decode_tensor(second.conditional.when.signal.probe.weight)), PROBE)
        assert torch.equal(torch.as_tensor(codec.decode_tensor(second.conditional.then.top_k.directions)), P)
        (bare,) = [h for h in await client.list_hooks() if h.hook_id == handle.id]
        assert bare.raw.spec.posthook.rules[0].loreft.rotation.data == b"" and list(bare.raw.spec.posthook.rules[0].loreft.rotation.shape) == [4, D]
    finally:
        await handle.remove()


BAD = [
    (lambda: rules.affine("output", torch.randn(D, 4)), r"posthook.rules\[0\].affine.weight: must be square"),
    (lambda: rules.affine("output", W, torch.randn(3)), r"affine.bias: must be \[32\]"),
    (lambda: rules.loreft("output", torch.randn(4, D), LW), "loreft.rotation: its rows must be orthonormal"),
    (lambda: rules.loreft("output", R, torch.randn(3, D)), r"loreft.weight: must be the rotation's shape \[4, 32\]"),
    (lambda: rules.norm_add("output", torch.zeros(D), 1.0), "norm_add.direction: must be 1-D and not all zeros"),
    (lambda: rules.top_k("output", P, 7), r"top_k.k: 7 is outside 1..6"),
    (lambda: rules.add("output", torch.tensor([float("nan")])), None),  # an add's NaN is the client's business
    (lambda: rules.affine("output", W * float("inf")), "affine.weight: must be finite"),
    (lambda: rules.when(rules.projection(torch.zeros(D)) > 0, rules.zero("output")),
     "conditional.when.signal.projection: must not be all zeros"),
    (lambda: rules.when(rules.norm() > 0, rules.save("output", "s")), "conditional.then: one of scale"),
    (lambda: rules.when(rules.norm() > 0, rules.when(rules.norm() > 1, rules.zero("output"))), "conditional.then: one of"),
    (lambda: rules.signal("output", "s", rules.stored("t")), "signal.signal: compute one"),
]


@pytest.mark.parametrize(("build", "message"), BAD)
async def test_bad_operands_are_refused_at_registration_naming_the_field(client, build: Any, message: str | None) -> None:
    spec = hookwire.HookSpec("fc1", posthook=[build()])
    if message is None:
        await client.model("mlp").infer(X, hooks=[spec])
        return
    with pytest.raises(hookwire.InvalidArgumentError, match=message):
        await client.model("mlp").infer(X, hooks=[spec])


def test_sdk_builders_refuse_what_they_can_tell_is_wrong() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        rules.top_k("output", P, 2, mode="largest")
    with pytest.raises(ValueError, match="not finite"):
        rules.norm() > float("inf")
    with pytest.raises(TypeError, match="comparing a signal"):
        rules.when(rules.norm(), rules.zero("output"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduce must be"):
        rules.signal("output", "s", rules.norm(), reduce="mean")


async def test_a_probe_gated_stop_ends_only_the_sequence_whose_probe_fired(client) -> None:
    """A stop rule on layer 1 (a probe's score at each row's last position above a
    threshold): the sequence it fires for first ends there with finish reason "rule"
    (that step's token not emitted) and GenerateDone names the hook, module and step; the
    other sequence goes on exactly as in-process generate() gives it."""
    prompts = ["the cat sat", "a"]
    ids, mask = oracle.batch(prompts)
    probe = torch.randn(64, generator=torch.Generator().manual_seed(31))
    scores: list[torch.Tensor] = []
    with oracle.forward_hook("model.layers.1", lambda step, out: scores.append((out[:, -1] @ probe).detach())):
        plain = oracle.generate(ids, mask, 8, do_sample=False)
    steps = torch.stack(scores)  # [step, row]: each row's score at its last position
    threshold = 0.09
    result = await client.model("tiny-lm").generate(prompts, 8, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.1", posthook=[rules.stop("output", rules.probe(probe) > threshold)])])
    hook_id = result.hook_ids[0]
    outcomes = set()
    for row in range(2):
        fired = (steps[:, row] > threshold).nonzero().flatten().tolist()
        if fired:
            assert result.finish_reasons[row] == "rule"
            assert list(result.token_ids[row]) == plain[row][:fired[0]]  # the firing step's token not emitted
            assert result.stopped_by[row] == (hook_id, "model.layers.1", fired[0])
            outcomes.add(fired[0])
        else:
            assert list(result.token_ids[row]) == plain[row] and result.stopped_by[row] is None
            outcomes.add(None)
    assert len(outcomes) == 2, "the rows must stop at different steps (or one not at all) to mean anything"


async def test_a_stop_rule_is_refused_with_an_index_or_inside_a_conditional(client) -> None:
    bad = rules.Rule(target="output", op="stop", index="[:, -1]", message=rules.stop("output", rules.norm() > 1).message)
    with pytest.raises(hookwire.InvalidArgumentError, match=r"rules\[0\].index: a stop rule reads whole rows"):
        await client.model("tiny-lm").generate(["a"], 2, hooks=[hookwire.HookSpec("model.layers.0", posthook=[bad])])
    nested = rules.Rule(target="output", op="conditional", message=hookwire.v1.rule_pb2.ConditionalOp(
        when=(rules.norm() > 1).message, then=rules.stop("output", rules.norm() > 2).to_proto()))
    nested.message.then.target = ""
    with pytest.raises(hookwire.InvalidArgumentError, match="conditional.then: one of"):
        await client.model("tiny-lm").generate(["a"], 2, hooks=[hookwire.HookSpec("model.layers.0", posthook=[nested])])


async def test_readouts_stream_small_values_per_step_equal_to_the_same_computation_in_process(client) -> None:
    """Readouts during Generate, on every decoder layer at every step: a probe's scores, a
    logit lens's top-5 tokens (through tiny-lm's own final norm and lm_head) and an SAE's
    top-3 features; each equals the same computation on the in-process layer outputs,
    and the bytes on the wire are fewer than the captured tensors'."""
    from hookwire.rules import Sae
    prompts = ["the cat sat", "a"]
    ids, mask = oracle.batch(prompts)
    probes = torch.randn(3, 64, generator=torch.Generator().manual_seed(51))
    g = torch.Generator().manual_seed(52)
    w_enc, w_dec = torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g)
    sae = Sae.of(w_enc, torch.zeros(32), w_dec, torch.zeros(64))
    layers = ("model.layers.0", "model.layers.1")
    with oracle.recording(*layers) as local:
        oracle.generate(ids, mask, 4, do_sample=False)
    model = oracle.model()
    readouts = {"probe": rules.probe_scores(probes, torch.tensor([0.1, 0.2, 0.3]), sigmoid=True),
                "lens": rules.logit_lens(5), "sae": rules.sae_top_k(sae, 3)}
    for name, readout in readouts.items():
        result = await client.model("tiny-lm").generate(prompts, 4, do_sample=False, hooks=[
            hookwire.HookSpec("model.layers.*", posthook=hookwire.capture("output", readout=readout))])
        assert len(result.events) == 4 * len(layers)
        for event in result.events:
            x = local[event.module][event.step]
            if name == "probe":
                assert torch.equal(event.output, torch.sigmoid(x @ probes.T + torch.tensor([0.1, 0.2, 0.3])))
            elif name == "lens":
                with torch.no_grad():
                    logits = model.lm_head(model.model.norm(x))
                values, tokens = logits.topk(5, dim=-1)
                assert torch.equal(event.output["token_ids"], tokens) and torch.equal(event.output["logits"], values)
            else:
                values, features = torch.relu(x @ w_enc).topk(3, dim=-1)
                assert torch.equal(event.output["features"], features) and torch.equal(event.output["values"], values)
    small = sum(e.raw.ByteSize() for e in result.events)
    full = await client.model("tiny-lm").generate(prompts, 4, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.*", posthook=hookwire.capture("output"))])
    assert small * 3 < sum(e.raw.ByteSize() for e in full.events)  # hidden 64 here; the benchmark measures a wide model


async def test_bad_readouts_are_refused_naming_the_field(client) -> None:
    cases = [(rules.logit_lens(300), r"posthook.readout.logit_lens.k: 300 is outside 1..256"),
             (rules.logit_lens(5, norm="nope"), "posthook.readout.logit_lens.norm: model 'tiny-lm' has no module 'nope'"),
             (rules.probe_scores(torch.zeros(2, 2, 2)), r"probe.weight: must be a finite floating-point \[d\] or \[n, d\]"),
             (rules.probe_scores(torch.zeros(3, 64), torch.zeros(2)), r"probe.bias: must be a floating-point scalar or \[3\]")]
    for readout, message in cases:
        with pytest.raises(hookwire.InvalidArgumentError, match=message):
            await client.model("tiny-lm").generate(["a"], 2, hooks=[
                hookwire.HookSpec("model.layers.0", posthook=hookwire.capture("output", readout=readout))])
    with pytest.raises(hookwire.InvalidArgumentError, match="a readout and summarize both replace the tensor"):
        await client.model("tiny-lm").generate(["a"], 2, hooks=[hookwire.HookSpec("model.layers.0", posthook=hookwire.capture(
            "output", readout=rules.logit_lens(2), summarize=True))])


async def test_heads_by_number_for_rules_and_captures_equal_the_slices_in_process(client) -> None:
    """tiny-lm has 4 attention heads of 16 (2 key/value heads): ablating heads 1 and 3 at
    o_proj's input, scaling key head 1 at k_proj's output, and capturing query heads 0
    and 2 equal the same slices done in process, bit for bit."""
    prompts = ["the cat sat", "a"]
    ids, mask = oracle.batch(prompts)
    model = oracle.model()
    attn = model.model.layers[0].self_attn

    def ablate(module: Any, args: Any) -> Any:
        x = args[0].clone()
        x[..., 16:32] = 0
        x[..., 48:64] = 0
        return (x,)

    def scale_k(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[..., 16:32] = out[..., 16:32] * 2.0
        return new

    seen: list[torch.Tensor] = []
    handles = [attn.o_proj.register_forward_pre_hook(ablate), attn.k_proj.register_forward_hook(scale_k),
               attn.q_proj.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))]
    try:
        want = oracle.generate(ids, mask, 5, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    assert want != oracle.generate(ids, mask, 5, do_sample=False)
    result = await client.model("tiny-lm").generate(prompts, 5, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0.self_attn.o_proj", prehook=[rules.zero("args.0").on_heads(1, 3)]),
        hookwire.HookSpec("model.layers.0.self_attn.k_proj", posthook=[rules.scale("output", 2.0).on_heads(1)]),
        hookwire.HookSpec("model.layers.0.self_attn.q_proj", posthook=hookwire.capture("output", heads=[0, 2])),
    ])
    assert [list(t) for t in result.token_ids] == want
    for event in result.events:
        full = seen[event.step]
        assert torch.equal(event.output, full.unflatten(-1, (4, 16))[..., [0, 2], :])


async def test_a_head_view_where_heads_are_not_separate_is_refused(client) -> None:
    cases = [
        (hookwire.HookSpec("model.layers.0.mlp", posthook=[rules.zero("output").on_heads(0)]),
         r"posthook.rules\[0\].heads: output of module 'model.layers.0.mlp' has no separate attention heads"),
        (hookwire.HookSpec("model.layers.0.self_attn.k_proj", posthook=[rules.zero("output").on_heads(2)]),
         "head 2 of module 'model.layers.0.self_attn.k_proj', which has 2"),
        (hookwire.HookSpec("model.layers.0.self_attn.o_proj", posthook=hookwire.capture("output", heads=[0])),
         "posthook.heads: module 'model.layers.0.self_attn.o_proj' has no separate attention heads in this phase"),
    ]
    for spec, message in cases:
        with pytest.raises(hookwire.InvalidArgumentError, match=message):
            await client.model("tiny-lm").generate(["a"], 2, hooks=[spec])


async def test_a_stop_rule_on_a_shared_hook_needs_shared_rules_allowed(client) -> None:
    """A stop rule ends other callers' sequences: on a SCOPE_ALL hook it is refused like
    any rule that changes other callers' calls. A signal is its owner's (it gates only the
    owner's own rules): a shared hook may keep one."""
    with pytest.raises(hookwire.PermissionDeniedError, match="--allow-shared-rules"):
        await client.model("tiny-lm").hook("model.layers.0", posthook=[rules.stop("output", rules.norm() > 0)],
                                           scope="all")
    async with client.model("tiny-lm").hook("model.layers.0", posthook=[rules.signal("output", "s", rules.norm())],
                                             scope="all"):
        pass


async def test_a_per_sequence_signal_gates_an_edit_of_the_last_position(client) -> None:
    """A signal kept one per sequence ([sequences, 1]) gates a conditional whose index is
    the last position ([sequences, hidden]): each sequence's own detection, no error."""
    prompts = ["the cat sat", "a"]
    ids, mask = oracle.batch(prompts)
    probe = torch.randn(64, generator=torch.Generator().manual_seed(71))
    kept: dict[str, torch.Tensor] = {}

    def detect(step: int, out: torch.Tensor) -> None:
        kept["s"] = (out @ probe).amax(dim=-1, keepdim=True)

    def edit(step: int, out: torch.Tensor) -> torch.Tensor:
        new = out.clone()
        new[:, -1] = torch.where(kept["s"] > 0.0, out[:, -1] * 0.0, out[:, -1])
        return new

    with oracle.forward_hook("model.layers.0", detect), oracle.forward_hook("model.layers.1", edit):
        want = oracle.generate(ids, mask, 5, do_sample=False)
    result = await client.model("tiny-lm").generate(prompts, 5, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0", posthook=[rules.signal("output", "s", rules.probe(probe), reduce="max")]),
        hookwire.HookSpec("model.layers.1", posthook=[
            rules.when(rules.stored("s") > 0.0, rules.scale("output", 0.0, index="[:, -1]"))]),
    ])
    assert [list(t) for t in result.token_ids] == want


async def test_readout_operands_are_kept_once_and_listed_only_with_operand_data(client) -> None:
    probes = torch.randn(3, 64, generator=torch.Generator().manual_seed(72))
    handle = await client.model("tiny-lm").hook("model.layers.0", posthook=hookwire.capture(
        "output", readout=rules.probe_scores(probes)))
    try:
        from hookwire.wire import codec
        (bare,) = [h for h in await client.list_hooks() if h.hook_id == handle.id]
        assert bare.raw.spec.posthook.readout.probe.weight.data == b""
        (full,) = [h for h in await client.list_hooks(include_operand_data=True) if h.hook_id == handle.id]
        assert torch.equal(torch.as_tensor(codec.decode_tensor(full.raw.spec.posthook.readout.probe.weight)), probes)
    finally:
        await handle.remove()


MORE_BAD = [
    (hookwire.HookSpec("model.layers.0", posthook=[rules.stop("output", rules.norm() > 1).on_heads(0)]),
     r"rules\[0\].heads: a stop rule reads whole rows"),
    (hookwire.HookSpec("model.layers.0", posthook=[rules.signal("output", "s", rules.norm(), reduce="max", index="[:, -1]")]),
     "signal.reduce: reducing over positions needs"),
    (hookwire.HookSpec("model.layers.0", posthook=hookwire.capture("output", readout=rules.logit_lens(3, norm="model.layers.0.mlp"))),
     "logit_lens.norm: module model.layers.0.mlp has submodules"),
]


@pytest.mark.parametrize(("spec", "message"), MORE_BAD)
async def test_more_bad_specs_are_refused_naming_the_field(client, spec: Any, message: str) -> None:
    with pytest.raises(hookwire.InvalidArgumentError, match=message):
        await client.model("tiny-lm").generate(["a"], 2, hooks=[spec])


async def test_a_token_id_condition_edits_only_the_positions_of_that_token(client) -> None:
    """Generate: zero layer 0's output wherever the position's token is a given id (in the
    prompt at step 0, and then wherever that token is generated), equal to the same edit in
    process with the ids generate() feeds; and an Infer call without input_ids answers
    FAILED_PRECONDITION for the signal."""
    prompts = ["the cat sat", "a"]
    ids, mask = oracle.batch(prompts)
    plain = oracle.generate(ids, mask, 6, do_sample=False)
    token = int(ids[0, -2])  # a token of the first prompt only
    fed: list[torch.Tensor] = []

    def pre(module: Any, args: Any, kwargs: Any) -> None:
        fed.append(kwargs["input_ids"])

    def edit(step: int, out: torch.Tensor) -> torch.Tensor:
        ids_now = fed[step]
        return torch.where((ids_now == token).unsqueeze(-1), torch.zeros_like(out), out)

    model = oracle.model()
    handle = model.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with oracle.forward_hook("model.layers.0", edit):
            want = oracle.generate(ids, mask, 6, do_sample=False)
    finally:
        handle.remove()
    assert want != plain
    result = await client.model("tiny-lm").generate(prompts, 6, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0", posthook=[rules.when(rules.token_id().eq(token), rules.zero("output"))])])
    assert [list(t) for t in result.token_ids] == want
    infer = await client.model("tiny-lm").infer(ids, attention_mask=mask, hooks=[hookwire.HookSpec(
        "model.layers.0", posthook=hookwire.edit(rules.when(rules.token_id().ne(token), rules.zero("output")),
                                                capture=("output",)))])
    out = infer.events[0].output
    assert bool((out[ids != token] == 0).all()) and bool((out[ids == token] != 0).any())
    with pytest.raises(hookwire.InvalidArgumentError, match="token_id: token ids are per position"):
        await client.model("tiny-lm").generate(["a"], 2, hooks=[hookwire.HookSpec("model.layers.0", posthook=[
            rules.when(rules.token_id().eq(1), rules.zero("output", index="[:, -1]"))])])
    # A model whose input is not token ids (mlp): the signal cannot be known.
    with pytest.raises(hookwire.FailedPreconditionError, match="token ids are not known"):
        await client.model("mlp").infer(X, hooks=[hookwire.HookSpec("fc1", posthook=[
            rules.when(rules.token_id().eq(1), rules.zero("output"))])])
