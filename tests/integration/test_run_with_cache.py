"""run_with_cache on a real server: the cache of every module, of args, kwargs and
gradients, each call of a shared module keyed on its own (forward and backward, with
overlapping module patterns), only what was asked for, select / cast / steering hooks,
and the progress bar; every tensor equal to in-process torch hooks, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookwire
from hookwire.rules import add
from support import Recorder, Twice, assert_same, local_models, token_batch


async def test_run_with_cache_every_module_equals_in_process_hooks(sdk_client: Any) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    local = local_models()["tiny-transformer"].eval()
    recorder = Recorder()
    paths = [p for p, _ in local.named_modules()]  # "**" matches the root ("") too
    for path in paths:
        recorder.hook(local, path, "forward")
    with torch.no_grad():
        expected_out = local(ids, attention_mask=mask)
    recorder.remove()

    out, cache = await sdk_client.model("tiny-transformer").run_with_cache(ids, attention_mask=mask, modules="**")
    assert_same(out, expected_out, "output")
    # The k-th call of a module that runs more than once (dropout here) is key "path#k";
    # containers (a ModuleList) never run and have none.
    calls: dict[str, int] = {}
    expected = {}
    for seen in recorder.events:
        k = calls[seen["module"]] = calls.get(seen["module"], -1) + 1
        expected[seen["module"] + (f"#{k}" if k else "")] = seen["output"]
    assert any(k > 0 for k in calls.values())
    assert list(cache) == list(expected)
    assert list(cache.modules) == list(calls)
    for key, value in expected.items():
        assert_same(cache[key], value, key)
    layers = cache.stack("encoder.layers.*")
    assert layers.shape == (2, *cache["encoder.layers.0"].shape)
    assert torch.equal(layers[1], cache["encoder.layers.1"])
    assert cache.keys_matching("encoder.layers.*") == ["encoder.layers.0", "encoder.layers.1"]
    assert "encoder.layers.0" in repr(cache) and cache.nbytes > 0


async def test_run_with_cache_args_kwargs_and_gradients(sdk_client: Any) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    local = local_models()["tiny-transformer"].eval()
    recorder = Recorder()
    for path in ("encoder.layers.0", "encoder.layers.1"):
        recorder.hook(local, path, "forward", with_kwargs=True)
        recorder.hook(local, path, "backward")
    expected = local(ids, attention_mask=mask)
    expected["logits"].sum().backward()
    recorder.remove()

    _, cache = await sdk_client.model("tiny-transformer").run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.*",
        parts=("output", "args", "kwargs", "grad_output", "grad_input"), backward=hookwire.Backward("logits"),
    )
    for seen in recorder.events:
        path = seen["module"]
        if seen["phase"] == "forward":
            assert_same(cache[path], seen["output"], path)
            assert_same(cache[f"{path}:args"], seen["args"], f"{path}:args")
            assert_same(cache[f"{path}:kwargs"], seen["kwargs"], f"{path}:kwargs")
        else:
            assert_same(cache[f"{path}:grad_output"], seen["grad_output"], f"{path}:grad_output")
            assert_same(cache[f"{path}:grad_input"], seen["grad_input"], f"{path}:grad_input")


async def test_run_with_cache_keys_each_call_of_a_shared_module(sdk_client: Any) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    local = Twice().eval()
    recorder = Recorder()
    recorder.hook(local, "shared", "forward")
    with torch.no_grad():
        local(x)
    recorder.remove()
    _, cache = await sdk_client.model("twice").run_with_cache(x, modules=["shared", "head"])
    assert list(cache) == ["shared", "shared#1", "head"]
    assert_same(cache["shared"], recorder.events[0]["output"])
    assert_same(cache["shared#1"], recorder.events[1]["output"])
    assert cache.modules == ("shared", "head")


async def test_run_with_cache_select_cast_and_steering_hooks(sdk_client: Any) -> None:
    ids, mask = token_batch(3, 7, padded_from=5)
    model = sdk_client.model("tiny-transformer")
    _, plain = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.1")
    _, reduced = await model.run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.1", select="[:, -1]", cast="bfloat16",
    )
    assert torch.equal(reduced["encoder.layers.1"], plain["encoder.layers.1"][:, -1].to(torch.bfloat16))
    # Hooks passed along run first: a steering rule on layer 0 changes what layer 1 caches.
    steer = hookwire.HookSpec("encoder.layers.0", posthook=[add("output", torch.ones(32))])
    _, steered = await model.run_with_cache(ids, attention_mask=mask, modules="encoder.layers.1", hooks=[steer])
    local = local_models()["tiny-transformer"].eval()
    local.encoder.layers[0].register_forward_hook(lambda m, a, o: o + torch.ones(32))
    recorder = Recorder()
    recorder.hook(local, "encoder.layers.1", "forward")
    with torch.no_grad():
        local(ids, attention_mask=mask)
    assert_same(steered["encoder.layers.1"], recorder.events[0]["output"])


async def test_run_with_cache_refuses_bad_arguments_before_sending(sdk_client: Any) -> None:
    model = sdk_client.model("tiny-transformer")
    ids, _ = token_batch(3, 7, padded_from=5)
    with pytest.raises(ValueError, match="unknown part"):
        await model.run_with_cache(ids, parts="outputs")
    with pytest.raises(ValueError, match="backward"):
        await model.run_with_cache(ids, parts="grad_output")
    with pytest.raises(ValueError, match="modules"):
        await model.run_with_cache(ids, modules=[])
    with pytest.raises(hookwire.NotFoundError):
        await model.run_with_cache(ids, modules="no.such.module")
    _, cache = await model.run_with_cache(ids, modules="encoder.layers.0")
    with pytest.raises(KeyError, match="encoder.layers.0"):
        cache["encoder.layers"]
    with pytest.raises(ValueError, match="no cache key"):
        cache.stack("decoder.*")


async def test_progress_shows_a_bar_for_a_large_cache_and_streams(
    sdk_client: Any, capsys: pytest.CaptureFixture[str],
) -> None:
    x = torch.arange(3 * 2**20, dtype=torch.float32).reshape(3, 2**20)  # 12 MiB in, 12 MiB captured
    model = sdk_client.model("scale")
    out, cache = await model.run_with_cache(x, modules="**", progress=True)
    err = capsys.readouterr().err
    assert "scale: reply" in err and "MiB" in err
    assert torch.equal(cache[""], x * 2) and torch.equal(out, x * 2)
    # Small replies draw nothing, and stream=False / True give the same result.
    small = torch.ones(2, 3)
    unary = await model.infer(small, stream=False, hooks=[hookwire.HookSpec("", posthook=hookwire.capture("output"))])
    streamed = await model.infer(small, stream=True, progress=True,
                                 hooks=[hookwire.HookSpec("", posthook=hookwire.capture("output"))])
    assert "reply" not in capsys.readouterr().err
    assert torch.equal(unary.events[0].output, streamed.events[0].output)


async def test_cache_gradient_of_a_shared_module_is_keyed_with_its_forward_call(sdk_client: Any) -> None:
    """Regression guard: the server counts backward call_index in autograd order (the second forward
    call's gradient fires first), and ActivationCache keys it as it comes, so
    cache["shared:grad_output"] is the gradient of the call keyed "shared#1", not of
    the call keyed "shared". activation x gradient (attribution patching) then pairs
    the wrong calls."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    forward, backward = _local_grads(Twice().eval(), x)
    # In-process: the first backward firing is the second forward call's (autograd order).
    assert len(forward) == 2 and len(backward) == 2

    _, cache = await sdk_client.model("twice").run_with_cache(
        x, modules="shared", parts=("output", "grad_output"), backward=hookwire.Backward(),
    )
    assert_same(cache["shared"], forward[0]["output"], "shared")
    # The gradient keyed like the first call must be the first call's gradient.
    assert_same(cache["shared:grad_output"], backward[1]["grad_output"], "shared:grad_output")


async def test_cache_holds_only_what_it_was_asked_to_cache(sdk_client: Any) -> None:
    """Regression guard: ActivationCache.from_result keys every event of the call, the captures of
    the caller's own ``hooks=`` included: a reduced capture of another module lands in
    the cache as if run_with_cache had cached it, and stack() over the layers fails."""
    ids, mask = token_batch(3, 7)
    side = hookwire.HookSpec("encoder.layers.0", posthook=hookwire.capture("output", select="[:, -1]"))
    _, cache = await sdk_client.model("tiny-transformer").run_with_cache(
        ids, attention_mask=mask, modules="encoder.layers.1", hooks=[side],
    )
    assert list(cache) == ["encoder.layers.1"]


def _local_grads(model: nn.Module, x: torch.Tensor) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    recorder = Recorder()
    recorder.hook(model, "shared", "forward")
    recorder.hook(model, "shared", "backward")
    model(x).sum().backward()
    recorder.remove()
    forward = [e for e in recorder.events if e["phase"] == "forward"]
    backward = [e for e in recorder.events if e["phase"] != "forward"]
    return forward, backward


# ---------------------------------------------------------------- run_with_cache gradient keys


async def test_cache_gradient_keys_with_overlapping_module_patterns(sdk_client: Any) -> None:
    """Regression guard (_cache.py from_result): the backward remap counts a module's backward events
    over all the cache's hooks (n), but the server counts call_index per hook. Two
    patterns matching the same module (run_with_cache sends one hook per pattern) give
    n = 2 x calls: Twice's "shared" gradients are keyed #3 and #2, and
    cache["shared:grad_output"] does not exist."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    forward, backward = _local_grads(Twice().eval(), x)
    assert len(forward) == 2 and len(backward) == 2
    _, cache = await sdk_client.model("twice").run_with_cache(
        x, modules=["shared", "*"], parts=("output", "grad_output"), backward=hookwire.Backward(),
    )
    assert_same(cache["shared"], forward[0]["output"], "shared")
    assert_same(cache["shared#1"], forward[1]["output"], "shared#1")
    assert "shared:grad_output#2" not in cache and "shared:grad_output#3" not in cache, list(cache)
    assert_same(cache["shared:grad_output"], backward[1]["grad_output"], "shared:grad_output")
    assert_same(cache["shared:grad_output#1"], backward[0]["grad_output"], "shared:grad_output#1")
