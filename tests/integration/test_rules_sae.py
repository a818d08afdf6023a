"""SAE rules against SAELens itself (the oracle: its own StandardSAE, JumpReLUSAE and
TopKSAE classes, seeded weights built in code, ``use_error_term=True``, applied by a plain
torch hook on the same tiny-lm in process; SAELens' HookedSAETransformer needs models
from a hub). A feature edit, a top-k over the SAE's features and a condition on a
feature's activation equal SAELens bit for bit on a prompt pass, and give the same greedy
tokens at every step of a generation."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import hookwire
import lm_oracle as oracle
from hookwire import rules
from hookwire.rules import Sae

D_IN, D_SAE = 64, 96
PROMPTS = ["the cat sat", "a"]


@pytest.fixture(scope="module")
def sae_lens() -> Any:
    return pytest.importorskip("sae_lens")


def make_sae(sae_lens: Any, architecture: str, *, normalize: str = "none", apply_b_dec: bool = True, seed: int = 0) -> Any:
    """A SAELens SAE of tiny-lm's width with seeded weights and biases (and thresholds)."""
    kinds = {"standard": ("StandardSAE", "StandardSAEConfig", {}),
             "jumprelu": ("JumpReLUSAE", "JumpReLUSAEConfig", {}),
             "topk": ("TopKSAE", "TopKSAEConfig", {"k": 8})}
    cls, cfg_cls, extra = kinds[architecture]
    cfg = getattr(sae_lens, cfg_cls)(d_in=D_IN, d_sae=D_SAE, normalize_activations=normalize,
                                     apply_b_dec_to_input=apply_b_dec, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        sae = getattr(sae_lens, cls)(cfg, use_error_term=True)
        with torch.no_grad():
            sae.W_enc.normal_(0, 0.3)
            sae.W_dec.normal_(0, 0.3)
            sae.b_enc.normal_(0, 0.1)
            sae.b_dec.normal_(0, 0.1)
            if architecture == "jumprelu":
                sae.threshold.uniform_(0.0, 0.3)
    return sae.eval()


def _edited(sae: Any, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Any, Any, torch.Tensor], torch.Tensor]:
    """A torch forward hook running ``sae`` with ``edit`` on its features (SAELens'
    hook_sae_acts_post) and its error term: SAELens' own forward."""
    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        handle = sae.hook_sae_acts_post.register_forward_hook(lambda m, a, acts: edit(acts))
        try:
            with torch.no_grad():
                return sae(out)
        finally:
            handle.remove()
    return hook


def _clamp(features: list[int], value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def edit(acts: torch.Tensor) -> torch.Tensor:
        acts = acts.clone()
        acts[..., features] = value
        return acts
    return edit


def _in_process(hook: Any, prompts: list[str], tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of in-process generate() with ``hook`` on layer 0, and layer 0's
    output in the prompt pass (captured after the hook)."""
    ids, mask = oracle.batch(prompts)
    seen: list[torch.Tensor] = []
    model = oracle.model()
    handles = [model.model.layers[0].register_forward_hook(hook),
               model.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))]
    try:
        want = oracle.generate(ids, mask, tokens, do_sample=False)
    finally:
        for h in handles:
            h.remove()
    return want, seen[0]


CASES = [("standard", "none", True), ("jumprelu", "layer_norm", True), ("topk", "none", False)]


@pytest.mark.parametrize(("architecture", "normalize", "apply_b_dec"), CASES)
async def test_clamping_features_equals_saelens_with_its_error_term(client, sae_lens, architecture: str, normalize: str,
                                                                     apply_b_dec: bool) -> None:
    sae = make_sae(sae_lens, architecture, normalize=normalize, apply_b_dec=apply_b_dec)
    want, step0 = _in_process(_edited(sae, _clamp([3, 7], 6.0)), PROMPTS, 6)
    plain = oracle.generate(*oracle.batch(PROMPTS), 6, do_sample=False)
    assert want != plain, "the clamp must change the tokens for this test to mean anything"
    rule = rules.sae("output", Sae.from_sae_lens(sae), [3, 7], edit="clamp", value=6.0)
    result = await client.model("tiny-lm").generate(PROMPTS, 6, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(rule, capture=("output",)))])
    assert [list(t) for t in result.token_ids] == want
    assert torch.equal(result.events_by_step[0][0].output, step0)  # the prompt pass, bit for bit


async def test_scale_and_zero_edits_and_a_top_k_over_the_saes_features(client, sae_lens) -> None:
    sae = make_sae(sae_lens, "standard", seed=1)
    operand = Sae.from_sae_lens(sae)

    def scaled(acts: torch.Tensor) -> torch.Tensor:
        acts = acts.clone()
        acts[..., [1, 2, 5]] = acts[..., [1, 2, 5]] * 3.0
        return acts

    def zeroed(acts: torch.Tensor) -> torch.Tensor:
        acts = acts.clone()
        acts[..., [0, 4]] = 0
        return acts

    def keep_top(acts: torch.Tensor) -> torch.Tensor:
        top = torch.zeros_like(acts, dtype=torch.bool).scatter_(-1, acts.topk(5, dim=-1).indices, True)
        return acts * top

    cases = [(rules.sae("output", operand, [1, 2, 5], edit="scale", value=3.0), scaled),
             (rules.sae("output", operand, [0, 4], edit="zero"), zeroed),
             (rules.top_k("output", operand, 5, mode="keep"), keep_top)]
    for rule, edit in cases:
        _, step0 = _in_process(_edited(sae, edit), PROMPTS, 1)
        result = await client.model("tiny-lm").infer(*oracle.batch(PROMPTS), hooks=[
            hookwire.HookSpec("model.layers.0", posthook=hookwire.edit(rule, capture=("output",)))])
        assert torch.equal(result.events[0].output, step0), rule.op


async def test_a_condition_on_an_sae_features_activation(client, sae_lens) -> None:
    sae = make_sae(sae_lens, "jumprelu", seed=2)
    vector = torch.randn(D_IN, generator=torch.Generator().manual_seed(9)) * 3
    ids, mask = oracle.batch(PROMPTS)
    with torch.no_grad():
        acts = []
        with oracle.forward_hook("model.layers.0", lambda step, out: acts.append(sae.encode(out)[..., 11])):
            oracle.generate(ids, mask, 1, do_sample=False)
    threshold = float(acts[0].flatten().median())

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            held = sae.encode(out)[..., 11] > threshold
        return torch.where(held.unsqueeze(-1), out + vector, out)

    want, _ = _in_process(hook, PROMPTS, 6)
    result = await client.model("tiny-lm").generate(PROMPTS, 6, do_sample=False, hooks=[
        hookwire.HookSpec("model.layers.0", posthook=[
            rules.when(rules.sae_feature(Sae.from_sae_lens(sae), 11) > threshold, rules.add("output", vector))])])
    assert [list(t) for t in result.token_ids] == want


def _sae(**overrides: Any) -> Sae:
    g = torch.Generator().manual_seed(0)
    parts = {"w_enc": torch.randn(D_IN, D_SAE, generator=g), "b_enc": torch.zeros(D_SAE),
             "w_dec": torch.randn(D_SAE, D_IN, generator=g), "b_dec": torch.zeros(D_IN)}
    options = {k: overrides.pop(k) for k in ("architecture", "threshold", "k", "normalize_activations") if k in overrides}
    parts.update(overrides)
    return Sae.of(parts["w_enc"], parts["b_enc"], parts["w_dec"], parts["b_dec"], **options)


BAD = [
    (lambda: rules.sae("output", _sae(architecture="gated"), [1]), "sae.sae.architecture: 'gated' is not one of standard"),
    (lambda: rules.sae("output", _sae(normalize_activations="constant_norm_rescale"), [1]),
     "normalize_activations: 'constant_norm_rescale' is not supported"),
    (lambda: rules.sae("output", _sae(b_dec=torch.zeros(3)), [1]), r"sae.sae.b_dec: must be \[64\]"),
    (lambda: rules.sae("output", _sae(architecture="jumprelu"), [1]), "sae.sae.threshold: missing"),
    (lambda: rules.sae("output", _sae(architecture="topk", k=0), [1]), r"sae.sae.k: 0 is outside 1..96"),
    (lambda: rules.sae("output", _sae(), [96]), "sae.features: feature 96 is not below d_sae 96"),
    (lambda: rules.top_k("output", _sae(), 97), r"top_k.k: 97 is outside 1..96"),
    (lambda: rules.when(rules.sae_feature(_sae(), 200) > 0, rules.zero("output")),
     "sae_feature.feature: 200 is not below d_sae 96"),
]


@pytest.mark.parametrize(("build", "message"), BAD)
async def test_a_bad_sae_operand_is_refused_at_registration_naming_the_field(client, build: Any, message: str) -> None:
    with pytest.raises(hookwire.InvalidArgumentError, match=message):
        await client.model("tiny-lm").infer(*oracle.batch(["a"]), hooks=[
            hookwire.HookSpec("model.layers.0", posthook=[build()])])


async def test_gradients_through_an_sae_edit_equal_saelens(client, sae_lens) -> None:
    """Backward through a zero-edit of SAE features on mlp's fc1 output (32 wide): the
    input gradients equal SAELens' own forward in a torch hook, whose error term carries
    no gradient."""
    from support import local_models

    cfg = sae_lens.StandardSAEConfig(d_in=32, d_sae=48)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        sae = sae_lens.StandardSAE(cfg, use_error_term=True)
        with torch.no_grad():
            sae.b_enc.normal_(0, 0.1)
            sae.b_dec.normal_(0, 0.1)
    sae.eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(7))
    model = local_models()["mlp"]

    def hook(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        handle = sae.hook_sae_acts_post.register_forward_hook(lambda m, a, acts: acts * torch.tensor(
            [0.0 if i in (1, 3) else 1.0 for i in range(48)]))
        try:
            return sae(out)
        finally:
            handle.remove()

    model.fc1.register_forward_hook(hook)
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    out.backward(grad)
    result = await client.model("mlp").infer(x, hooks=[hookwire.HookSpec("fc1", posthook=[
        rules.sae("output", Sae.from_sae_lens(sae), [1, 3], edit="zero")])],
        backward=hookwire.Backward(grad=grad, return_input_grads=True))
    torch.testing.assert_close(result.output, out.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(result.input_grads[0], leaf.grad, rtol=1e-5, atol=1e-6)


def test_from_sae_lens_refuses_what_the_operand_cannot_carry(sae_lens) -> None:
    cfg = sae_lens.TopKSAEConfig(d_in=8, d_sae=16, k=2, rescale_acts_by_decoder_norm=True)
    with pytest.raises(ValueError, match="rescale_acts_by_decoder_norm"):
        Sae.from_sae_lens(sae_lens.TopKSAE(cfg))
