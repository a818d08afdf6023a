"""The hook runtime a vLLM worker runs (service/hookwire_server/runtime/), on its own:
a step's plan as the front packs it, firings on a packed step of two calls, against
the same edits and selections written in plain torch (the oracle)."""

from __future__ import annotations

from typing import Any

import torch

from hookwire import HookSpec, capture, rules
from hookwire_server.runtime import plan
from hookwire_server.runtime.step import StepRunner


def _runner(specs: dict[str, HookSpec], fire: list[list], *, fail_call: bool = True, slots: str = "",
            extra: dict[str, Any] | None = None, more: list[bytes] = (), runner: StepRunner | None = None) -> StepRunner:
    """A runner given a step of two calls packed as [tokens, 4]: call 0 has two sequences
    (tokens 0-2 and 3-4: left-padded to 3), call 1 one (tokens 5-7). ``slots``: the
    session store the hooks keep slots in; ``extra``: more header fields, ``more``: the
    blobs after the specs' (operands', slots'); ``runner``: a runner's next step."""
    metas = [{"key": key, "size": 0, "hook_id": key, "owner": "alice", "fail_call": fail_call,
              "request_scoped": True, "slots": slots} for key in specs]
    blobs = [spec.to_proto().SerializeToString() for spec in specs.values()]
    for meta, blob in zip(metas, blobs):
        meta["size"] = len(blob)
    header = {**(extra or {}), "specs": metas, "run": {
        "model": "m", "vocab": 0, "tokens": 8, "sequences": 3, "shared": True,
        "segments": [[[[0, 3], [3, 5]], [0, 1], "left", None], [[[5, 8]], [2], "left", None]],
        "fire": fire}}
    blobs += list(more)
    header, blobs = plan.unpack(plan.pack(header, blobs))  # as it travels
    runner = runner or StepRunner(torch.device("cpu"))
    runner.configure(header, blobs, lambda: torch.arange(100, 108))
    return runner


def test_a_rule_edits_its_calls_rows_only_and_captures_come_back_selected_and_cast() -> None:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    runner = _runner({"steer": HookSpec("layer", posthook=[rules.add("output", v)]),
                      "look": HookSpec("layer", posthook=capture("output", select="[:, -1]", cast="float16"))},
                     [["layer", "post", [[0, "steer", 0, False, "", "layer"], [1, "look", 0, True, "", "layer"], [2, "look", 1, True, "", "layer"]]]])
    new = runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": x})
    assert new is not None
    want = x.clone()
    want[0:5] += v  # call 0's tokens; call 1's untouched
    assert torch.equal(new["output"], want)
    assert torch.equal(x, torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))  # out of place
    fired, values = runner.results()
    assert [f[0] for f in fired] == [0, 1, 2]
    assert fired[0][2] is None and fired[0][3] is None and fired[0][6] is None  # a rule alone: no capture
    assert fired[1][2] == [[3, "output", None]] and fired[1][4] == ["cpu"]
    # Call 0's layout: [2 sequences, 3 positions], the second left-padded; the last position of each.
    assert torch.equal(values[0], torch.stack([want[2], want[4]]).to(torch.float16))
    assert torch.equal(values[1], want[7:8].to(torch.float16))
    assert not runner.active


def test_a_failing_rule_is_reported_with_its_words_and_changes_nothing() -> None:
    x = torch.randn(8, 4)
    runner = _runner({"bad": HookSpec("layer", posthook=[rules.when(rules.stored("never") > 0.0, rules.zero("output"))])},
                     [["layer", "post", [[0, "bad", 0, False, "", "layer"], [1, "bad", 1, False, "", "layer"]]]], fail_call=False)
    assert runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": x}) is None
    fired, values = runner.results()
    # Not fail_call: the first failure stops the hook for the rest of the step (the front disables it).
    assert len(fired) == 1 and values == []
    stage, kind, message = fired[0][6]
    assert (stage, kind) == ("rule", "FailedPrecondition") and "no signal 'never'" in message
    assert "hook bad on module 'layer' of 'm'" in message


def test_token_id_conditions_read_the_steps_tokens_in_the_calls_layout() -> None:
    x = torch.ones(8, 4)
    runner = _runner({"gate": HookSpec("layer", posthook=[rules.when(rules.token_id().eq(106), rules.zero("output"))])},
                     [["layer", "post", [[0, "gate", 1, False, "", "layer"]]]])
    new = runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": x})
    assert new is not None
    zeroed = [i for i in range(8) if not bool(new["output"][i].any())]
    assert zeroed == [6]  # token 106 sits at packed position 6, in call 1


def test_a_spec_that_cannot_be_compiled_fails_its_firings_not_the_step() -> None:
    header = {"specs": [{"key": "k", "size": 3, "hook_id": "k", "owner": "", "fail_call": True,
                         "request_scoped": True}],
              "run": {"model": "m", "vocab": 0, "tokens": 2, "sequences": 1, "shared": False,
                      "segments": [[[[0, 2]], [0], "left", None]], "fire": [["layer", "post", [[0, "k", 0, True, "", "layer"]]]]}}
    header, blobs = plan.unpack(plan.pack(header, [b"\xff\xff\xff"]))
    runner = StepRunner(torch.device("cpu"))
    runner.configure(header, blobs)
    assert runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": torch.zeros(2, 4)}) is None
    fired, _ = runner.results()
    assert fired[0][6][0] == "rule" and "could not compile hook k" in fired[0][6][2]


def test_named_operands_are_found_anywhere_in_a_spec() -> None:
    from hookwire_server.hooks.rules import names_operands

    assert names_operands(HookSpec("m", posthook=[rules.add("output", rules.operand("v"))]).to_proto())
    assert not names_operands(HookSpec("m", posthook=[rules.add("output", torch.ones(2))]).to_proto())


def test_a_capture_that_cannot_be_made_is_reported_and_the_rules_still_apply() -> None:
    """Only the first tensor-parallel rank captures: a capture that fails there must not
    change the edits, or the ranks would hold different values. The firing's rules apply
    (as in-process), its failure goes to the front, and the hook's next firing runs too."""
    x = torch.zeros(8, 4)
    from hookwire import HookAction

    spec = HookSpec("layer", posthook=HookAction(capture=("output",), rules=(rules.add("output", torch.ones(4)),),
                                                 select="[:, 9]"))
    runner = _runner({"h": spec}, [["layer", "post", [[0, "h", 0, True, "", "layer"], [1, "h", 1, True, "", "layer"]]]],
                     fail_call=False)
    new = runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": x})
    assert new is not None and torch.equal(new["output"], torch.ones(8, 4))
    fired, values = runner.results()
    assert [f[0] for f in fired] == [0, 1] and values == []
    stage, kind, message = fired[0][6]
    assert (stage, kind) == ("capture", "InvalidArgument") and "cannot capture PART_OUTPUT" in message


def test_named_operands_arrive_once_beside_the_specs_that_name_them_and_go_when_dropped() -> None:
    """A plan's ``operands``: a tensor and an SAE, each once, named by key in two specs;
    the rules use them as they would inline; one the worker cannot decode fails only the
    programs naming it (saying why); ``drop_operands`` frees them."""
    from hookwire.rules import Sae
    from hookwire.v1 import rule_pb2, tensor_pb2
    from hookwire.wire import codec

    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    g = torch.Generator().manual_seed(3)
    w_enc, w_dec = torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g)
    sae = Sae.of(w_enc, torch.zeros(6), w_dec, torch.zeros(4))
    sae_msg = rule_pb2.Sae()
    sae_msg.CopyFrom(sae.message)
    vec_msg = tensor_pb2.Tensor()
    codec.encode_tensor_into(v, vec_msg)
    specs = {"a": HookSpec("layer", posthook=[rules.add("output", rules.operand("alice/v@1"))]),
             "b": HookSpec("layer", posthook=[rules.sae("output", Sae.named("alice/s@2"), [1], edit="zero")]),
             "c": HookSpec("layer", posthook=[rules.add("output", rules.operand("alice/bad@3"))]),
             "d": HookSpec("layer", posthook=[rules.affine("output", torch.eye(4), rules.operand("alice/v@1"))])}
    metas = [{"key": k, "size": 0, "hook_id": k, "owner": "alice", "fail_call": True, "request_scoped": True}
             for k in specs]
    blobs = [s.to_proto().SerializeToString() for s in specs.values()]
    for meta, blob in zip(metas, blobs):
        meta["size"] = len(blob)
    operands = [(("alice/v@1", "tensor"), vec_msg.SerializeToString()), (("alice/s@2", "sae"), sae_msg.SerializeToString()),
                (("alice/bad@3", "tensor"), b"\xff\x00")]
    header = {"specs": metas, "operands": [{"key": k, "name": k.split("/")[1].split("@")[0], "kind": kind, "size": len(b)}
                                           for (k, kind), b in operands],
              "run": {"model": "m", "vocab": 0, "tokens": 3, "sequences": 1, "shared": False,
                      "segments": [[[[0, 3]], [0], "left", None]],
                      "fire": [["layer", "post", [[0, "a", 0, False, "", "layer"], [1, "b", 0, False, "", "layer"]]]]}}
    header, unpacked = plan.unpack(plan.pack(header, blobs + [b for _, b in operands]))
    runner = StepRunner(torch.device("cpu"))
    runner.configure(header, unpacked)
    assert set(runner.operands.tensors) == {"alice/v@1"} and set(runner.operands.saes) == {"alice/s@2"}
    assert not any(runner.programs[k].broken for k in "abd")  # "d" shares "a"'s one copy of the vector
    assert "operand 'bad' could not be taken" in runner.programs["c"].broken
    x = torch.randn(3, 4, generator=g)
    new = runner.fire("layer", "post", {"args": (), "kwargs": {}, "output": x})
    assert new is not None
    added = x + v
    want = rules_oracle_sae_zero({"w_enc": w_enc, "b_enc": torch.zeros(6), "w_dec": w_dec, "b_dec": torch.zeros(4)},
                                 added, 1)  # the tensors as sent, not the worker's copy
    torch.testing.assert_close(new["output"], want)
    runner.results()
    runner.configure({"drop": ["a", "b", "c", "d"], "drop_operands": ["alice/v@1", "alice/s@2", "alice/bad@3"]}, [])
    assert not runner.operands.tensors and not runner.operands.saes and not runner.operands.broken


def rules_oracle_sae_zero(sae: Any, t: torch.Tensor, feature: int) -> torch.Tensor:
    """SAELens' edit with the error term, in plain torch: feature ``feature`` zeroed."""
    w_enc, b_enc, w_dec, b_dec = (sae[k] for k in ("w_enc", "b_enc", "w_dec", "b_dec"))
    f = torch.relu((t - b_dec) @ w_enc + b_enc)
    recon = f @ w_dec + b_dec
    edited = f.clone()
    edited[..., feature] = 0.0
    return edited @ w_dec + b_dec + (t - recon)


def test_slots_saved_on_a_rank_are_bounded_reported_patched_and_freed() -> None:
    """A save on the rank keeps the slot there within the budget the plan gives the
    session (one byte short: the save fails as it would in the server, naming
    max_slot_bytes), and the step reports its name, dtype, shape and bytes; a slot the
    front sends with a plan is patched from; a drop frees the session's slots."""
    from hookwire.wire import codec

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    post = {"args": (), "kwargs": {}, "output": x}
    save = {"save": HookSpec("layer", posthook=[rules.save("output", slot="s")])}
    fire = [["layer", "post", [[0, "save", 1, False, "", "layer"]]]]
    short = _runner(save, fire, slots="k", extra={"slot_budget": {"k": [47, 94, 2]}})
    assert short.fire("layer", "post", post) is None
    (fired,), _ = short.results()
    assert fired[6][:2] == ["rule", "ResourceExhausted"] and "max_slot_bytes" in fired[6][2]
    assert short.slots.saved() == []
    runner = _runner(save, fire, slots="k", extra={"slot_budget": {"k": [48, 96, 2]}})
    assert runner.fire("layer", "post", post) is None
    (fired,), _ = runner.results()
    assert fired[6] is None
    assert runner.slots.saved() == [["k", "s", "float32", [1, 3, 4], 48]]
    assert torch.equal(runner.slots.stores["k"].get("s"), x[5:8].reshape(1, 3, 4))
    # A slot the front held comes with the next plan, and call 0's last positions take it.
    held = torch.full((4,), 7.0)
    sent = codec.encode_tensor(held).SerializeToString()
    patch = {"patch": HookSpec("layer", posthook=[rules.patch("output", slot="p", index="[:, -1]")])}
    _runner(patch, [["layer", "post", [[0, "patch", 0, False, "", "layer"]]]], slots="k", runner=runner,
            extra={"slots": [{"key": "k", "name": "p", "size": len(sent)}]}, more=[sent])
    new = runner.fire("layer", "post", post)
    assert new is not None
    want = x.clone()
    want[2] = want[4] = held
    assert torch.equal(new["output"], want)
    runner.results()
    assert runner.slots.held_bytes == 48 + 16
    _runner({}, [], runner=runner, extra={"drop_slots": [["k", None]]})
    assert runner.slots.held_bytes == 0 and runner.slots.stores == {}
