"""ModelService: listing, describing and running models, against in-process torch."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

import hookwire
from support import ServerThread, assert_same, local_models


async def test_list_models(client: hookwire.Client) -> None:
    infos = {m.name: m for m in await client.list_models()}
    assert {"mlp", "tiny-transformer", "mlp-locked"} <= set(infos)
    assert infos["mlp"].training_allowed and not infos["mlp-locked"].training_allowed
    assert infos["mlp"].modules == ()


async def test_get_model_module_tree(client: hookwire.Client) -> None:
    local = local_models()["tiny-transformer"]
    info = await client.model("tiny-transformer").info()
    assert [m.path for m in info.modules] == [p for p, _ in local.named_modules()]
    by_path = {m.path: m for m in info.modules}
    assert by_path[""].type == "TinyTransformer"
    qkv = by_path["encoder.layers.0.attn.qkv"]
    assert qkv.type == "Linear"
    assert {p.name: p.shape for p in qkv.parameters} == {"weight": (96, 32), "bias": (96,)}
    assert all(p.dtype == "float32" and p.requires_grad for p in qkv.parameters)


async def test_infer_matches_local_mlp(client: hookwire.Client) -> None:
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    out = await client.model("mlp")(x)
    assert_same(out, local_models()["mlp"](x))


async def test_infer_matches_local_transformer_dict_output(client: hookwire.Client, tokens) -> None:
    ids, mask = tokens
    out = await client.model("tiny-transformer")(ids, attention_mask=mask)
    with torch.no_grad():
        expected = local_models()["tiny-transformer"](ids, attention_mask=mask)
    assert_same(out, expected)  # a dict, keys in order, bit-identical tensors


async def test_train_mode_is_reproducible_with_seed_and_model_returns_to_eval(client: hookwire.Client) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = client.model("mlp")
    local = local_models()["mlp"]
    r1 = await model.infer(x, mode="train", seed=123)
    r2 = await model.infer(x, mode="train", seed=123)
    local.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        expected = local(x)
    local.eval()
    assert_same(r1.output, expected)
    assert_same(r2.output, expected)
    assert not torch.equal(r1.output, local(x)), "dropout should make train differ from eval"
    assert_same(await model(x), local(x))  # back in eval mode


async def test_train_mode_refused_when_not_allowed(client: hookwire.Client) -> None:
    with pytest.raises(hookwire.FailedPreconditionError, match="MODE_TRAIN"):
        await client.model("mlp-locked").infer(torch.zeros(1, 8), mode="train")
    await client.model("mlp-locked")(torch.zeros(1, 8))


async def test_large_tensor_round_trip_above_4mib(client: hookwire.Client) -> None:
    x = torch.randn(3 * 1024 * 1024)  # 12 MiB of float32
    out = await client.model("scale")(x)
    assert torch.equal(out, x * 2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8])
async def test_dtypes_round_trip(client: hookwire.Client, dtype: torch.dtype) -> None:
    x = (torch.arange(24).reshape(2, 3, 4) % 7).to(dtype)
    assert_same(await client.model("scale")(x), x * 2)


async def test_non_contiguous_input(client: hookwire.Client) -> None:
    x = torch.randn(8, 6).t()[::2]
    assert_same(await client.model("scale")(x), x * 2)


async def test_slow_model_blocks_neither_other_models_nor_other_rpcs(client: hookwire.Client) -> None:
    # No speed test: the other calls must all finish while the slow pass is still running
    # (it sleeps 5 s, far longer than they take even on a loaded machine).
    slow = asyncio.ensure_future(client.model("sleeper")(torch.tensor(5.0)))
    await asyncio.sleep(0.2)
    await client.list_models()
    await client.model("mlp")(torch.zeros(1, 8))
    await client.model("tiny-transformer").info()
    assert not slow.done()
    await slow


async def test_passes_of_one_model_run_one_at_a_time(client: hookwire.Client, server: ServerThread) -> None:
    """Three calls at once: the server's model runs their passes one after the other
    (counted in-process: never two forwards at the same time)."""
    module = server.server.registry.get("sleeper").module
    running, most, passes = [0], [0], [0]

    def enter(m: Any, args: Any) -> None:
        running[0] += 1
        passes[0] += 1
        most[0] = max(most[0], running[0])

    def leave(m: Any, args: Any, out: Any) -> None:
        running[0] -= 1

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        await asyncio.gather(*(client.model("sleeper")(torch.tensor(0.3)) for _ in range(3)))
    finally:
        for h in handles:
            h.remove()
    assert passes[0] == 3 and most[0] == 1, f"{passes[0]} passes, at most {most[0]} at once"
