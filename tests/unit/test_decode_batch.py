"""The persistent decoding batch (engine/decode_batch.py) on the demo tiny-lm, in
process: calls join and leave without the others' rows moving, and a step over the
batch's block computes what the same step computes over a plain, contiguous
``DynamicCache`` holding the same rows."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

import lm_oracle as oracle
from hookwire_server.engine.decode_batch import HEADROOM, DecodeBatch
from hookwire_server.engine.decoding import cache_argument
from hookwire_server.models.batch_settings import model_dimensions

PLAIN = {"logits_to_keep": 1, "use_cache": True}


def _batch(limit: int = 8) -> DecodeBatch:
    model = oracle.model()
    return DecodeBatch(model, cache_argument(model), dict(PLAIN), model_dimensions(model), limit)


def _prompt(text: list[str]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prompt's pass alone, as generate() runs it: its cache layers, mask, first tokens
    (greedy) and logits."""
    model = oracle.model()
    ids, mask = oracle.batch(text)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_argument(model): DynamicCache()},
                    **PLAIN, return_dict=True)
    cache = getattr(out, cache_argument(model))
    return [(layer.keys, layer.values) for layer in cache.layers], mask, out.logits[:, -1].argmax(-1), out.logits


def test_calls_join_into_holes_and_leave_without_the_others_moving() -> None:
    batch = _batch()
    a, b, c = _prompt(["Hello world, the model"]), _prompt(["the cat", "the dog"]), _prompt(["once upon a time"])
    members = {name: batch.join(name, layers, mask, last) for name, (layers, mask, last, _) in
               {"a": a, "b": b, "c": c}.items()}
    assert [(m.row, m.count) for m in members.values()] == [(0, 1), (1, 2), (3, 1)]
    block = batch.keys[0]
    before = block[[0, 3]].clone()
    pointer = block.data_ptr()

    batch.leave(members["b"])  # a hole: nothing moves, the rows below stay
    assert batch.rows == 4 and [o is None for o in batch.owners] == [False, True, True, False]
    d_layers, d_mask, d_last, _ = _prompt(["data"])
    d = batch.join("d", d_layers, d_mask, d_last)
    assert (d.row, d.count) == (1, 1)  # the first free row of the hole
    assert batch.keys[0].data_ptr() == pointer and torch.equal(batch.keys[0][[0, 3]], before)
    # Its history ends at the write column, like everyone's; its mask covers only its own.
    own = d_mask.shape[1]
    assert torch.equal(batch.keys[0][1, :, batch.end - own:batch.end], d_layers[0][0][0])
    assert int(batch.mask[1].sum()) == own and int(batch.mask[1, batch.end - own:batch.end].sum()) == own

    batch.leave(members["c"])  # the bottom rows go; the hole above them stays for the next call
    assert batch.rows == 2
    batch.leave(members["a"])
    batch.leave(d)
    assert batch.rows == 0 and not batch.keys  # the block is freed with the last member


def _plain_step(rows: list[tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]],
                width: int, last: torch.Tensor, positions: torch.Tensor) -> Any:
    """One step over a contiguous DynamicCache of the rows stacked and padded on the left
    to ``width`` keys (the batch's window), as the same pass in process."""
    model = oracle.model()
    total = sum(int(mask.shape[0]) for _, mask, _ in rows)
    layers = []
    for index in range(len(rows[0][0])):
        kv = []
        for which in (0, 1):
            first = rows[0][0][index][which]
            out = first.new_zeros((total, first.shape[1], width - 1, first.shape[3]))
            start = 0
            for layer_rows, mask, _ in rows:
                mine = layer_rows[index][which]
                out[start:start + mine.shape[0], :, width - 1 - mine.shape[2]:] = mine
                start += mine.shape[0]
            kv.append(out)
        layers.append((kv[0], kv[1]))
    mask = torch.zeros((total, width), dtype=torch.long)
    start = 0
    for _, own, _ in rows:
        mask[start:start + own.shape[0], width - 1 - own.shape[1]:width - 1] = own
        mask[start:start + own.shape[0], -1] = 1
        start += own.shape[0]
    with torch.no_grad():
        return model(input_ids=last[:, None], position_ids=positions[:, None], attention_mask=mask,
                     **{cache_argument(model): DynamicCache(ddp_cache_data=layers)}, **PLAIN, return_dict=True)


def test_a_step_over_the_block_equals_the_step_over_a_plain_cache() -> None:
    prompts = [["Hello world, the model"], ["the cat", "the dog"], ["once upon a time"]]
    done = [_prompt(p) for p in prompts]
    batch = _batch()
    members = [batch.join(i, layers, mask, last) for i, (layers, mask, last, _) in enumerate(done)]
    model = oracle.model()
    inputs, padded, spans = batch.prepare(members)
    with torch.no_grad():
        out = model(**inputs, return_dict=True)
    width = inputs["attention_mask"].shape[1]
    assert spans == [int(mask.shape[1]) + 1 for _, mask, _, _ in done]
    # The longest history plus the new key, 16, is a dimension of tiny-lm: hooks cut each
    # call's own keys, so the window is widened by a masked column.
    assert padded == width == 17
    last = torch.cat([d[2] for d in done])
    positions = torch.cat([mask.sum(-1) for _, mask, _, _ in done])
    want = _plain_step([(layers, mask, last) for layers, mask, last, _ in done], width, last, positions)
    assert torch.equal(out.logits, want.logits)


def test_a_batch_decodes_past_its_columns_and_takes_a_longer_history_as_a_plain_cache_does() -> None:
    # Steps past the block's first columns (it grows), then a call whose history is longer
    # than the columns left of the write column joins (the block moves right). The first
    # call's logits equal those of its own plain DynamicCache bit for bit until then; after
    # it, its row attends over the longer window (the new columns masked for it), which
    # sums in another order: equal up to rounding.
    model, name = oracle.model(), cache_argument(oracle.model())
    layers, mask, last, _ = _prompt(["Hello world, the model"])
    batch = _batch()
    a = batch.join("a", layers, mask, last)
    plain = DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in layers])
    position, token = int(mask.sum()), last
    for step in range(3 * HEADROOM):
        if step == 2 * HEADROOM:  # a history longer than the write column: room is made on the left
            ids = torch.randint(3, 300, (1, batch.end + 5), generator=torch.Generator().manual_seed(1))
            ones = torch.ones_like(ids)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=ones, **{name: DynamicCache()}, **PLAIN, return_dict=True)
            long = batch.join("long", [(layer.keys, layer.values) for layer in getattr(out, name).layers], ones,
                              out.logits[:, -1].argmax(-1))
            assert long.start >= 0 and a.start > HEADROOM
        stepping = [m for m in batch.members]
        inputs, _, _ = batch.prepare(stepping)
        with torch.no_grad():
            out = model(**inputs, return_dict=True)
            want = model(input_ids=token[:, None], position_ids=torch.tensor([[position]]), **{name: plain}, **PLAIN,
                         return_dict=True)
        if step < 2 * HEADROOM:
            assert torch.equal(out.logits[a.row:a.row + a.count], want.logits), step
        else:
            torch.testing.assert_close(out.logits[a.row:a.row + a.count], want.logits, rtol=1e-5, atol=1e-6)
        token = want.logits[:, -1].argmax(-1)
        batch.advance(stepping, [out.logits[m.row:m.row + m.count, -1].argmax(-1) for m in stepping])
        position += 1
    assert batch.mask.shape[1] > HEADROOM + mask.shape[1] + HEADROOM  # it grew


def test_a_row_a_call_left_holds_nothing_of_it_for_the_next_call() -> None:
    # A call whose keys and values hold NaN or Inf (as a rule editing a projection may leave
    # them) leaves; a new call takes its row. Its logits are finite and equal those of the
    # same batch made fresh (the previous occupant's columns are zeroed on join, not only
    # masked: 0 x NaN is NaN in the masked softmax).
    model = oracle.model()
    long = _prompt(["once upon a time there was a very long prompt indeed, longer than all"])
    a = _prompt(["Hello world, the model is here"])
    b = _prompt(["the cat"])
    fresh = _batch()
    fresh_long = fresh.join("long", *long[:3])
    fresh_hole = fresh.join("hole", *a[:3])
    fresh.leave(fresh_hole)
    fresh_b = fresh.join("b", *b[:3])
    with torch.no_grad():
        want = model(**fresh.prepare([fresh_long, fresh_b])[0], return_dict=True).logits[fresh_b.row]
    assert torch.isfinite(want).all()
    for poison in (float("nan"), float("inf")):
        batch = _batch()
        m_long = batch.join("long", *long[:3])
        layers = [(k.clone(), v.clone()) for k, v in a[0]]
        for k, v in layers:
            k[..., :3, :] = poison
            v[..., :3, :] = poison
        m_a = batch.join("a", layers, a[1], a[2])
        batch.leave(m_a)
        m_b = batch.join("b", *b[:3])
        assert m_b.row == m_a.row == fresh_b.row
        with torch.no_grad():
            got = model(**batch.prepare([m_long, m_b])[0], return_dict=True).logits[m_b.row]
        assert torch.isfinite(got).all(), poison
        assert torch.equal(got, want), poison


def test_a_call_joins_only_where_its_rows_fit_within_the_limit() -> None:
    # Eight one-row calls fill the 8 rows; three leave (holes at rows 1, 3, 5: three free
    # rows, no two adjacent). A two-row call has no room here (it would run the pass over
    # 10 rows); a one-row call takes a hole.
    one, two = _prompt(["the cat"]), _prompt(["the cat", "the dog"])
    batch = _batch(limit=8)
    members = [batch.join(i, *one[:3]) for i in range(8)]
    for i in (1, 3, 5):
        batch.leave(members[i])
    assert not batch.has_room(2) and batch.has_room(1)
    try:
        batch.join("g", *two[:3])
    except ValueError:
        pass
    else:
        raise AssertionError("a join past the limit")
    assert batch.rows == 8 and batch.keys[0].shape[0] == 8
    batch.leave(members[2])  # rows 1-3 free: a hole of three
    g = batch.join("g", *two[:3])
    assert (g.row, g.count) == (1, 2) and batch.rows == 8
    batch.leave(members[7])  # the bottom row goes: still no room for two (row 7 and a new row 8)
    assert batch.rows == 7 and not batch.has_room(2) and batch.has_room(1)
    h = batch.join("h", *one[:3])
    assert h.row == 3 and batch.rows <= 8


def test_a_member_that_sits_out_is_evicted_and_the_window_stays_bounded() -> None:
    # 'slow' never steps (its reader lags); 'fast' steps 300 passes, leaving and joining
    # again every 60. Without eviction the window grew to 'slow''s 300 masked columns;
    # with it, 'slow' goes after SIT_OUT_PASSES with its own columns only (its prompt),
    # and the window stays within the longest live history plus the padding hooks need.
    from hookwire_server.engine.decode_batch import SIT_OUT_PASSES

    model, name = oracle.model(), cache_argument(oracle.model())
    batch = _batch()
    slow_layers, slow_mask, slow_last, _ = _prompt(["the cat"])
    slow = batch.join("slow", slow_layers, slow_mask, slow_last)
    fast = batch.join("fast", *_prompt(["Hello world"])[:3])
    evicted = None
    widest = 0
    for step in range(300):
        if step % 60 == 0 and step:
            batch.leave(fast)
            fast = batch.join("fast", *_prompt(["Hello world"])[:3])
        inputs, _, spans = batch.prepare([fast])
        with torch.no_grad():
            out = model(**inputs, return_dict=True)
        batch.advance([fast], [out.logits[fast.row:fast.row + 1, -1].argmax(-1)])
        for member in batch.lagging():
            assert member is slow and step == SIT_OUT_PASSES
            evicted = batch.evict(member)
        widest = max(widest, batch.end - batch.window - spans[0])
    assert evicted is not None and slow not in batch.members
    assert widest <= 16  # the padding past tiny-lm's dimensions, never the sit-outs
    assert batch.mask.shape[1] < 4 * HEADROOM
    # Its own history, without the masked columns: its next step alone equals one over a
    # plain DynamicCache of its prompt, bit for bit (its keys were never written by a pass).
    layers, mask, positions = evicted
    assert torch.equal(mask, slow_mask) and all(torch.equal(k, k0) and torch.equal(v, v0)
                                                 for (k, v), (k0, v0) in zip(layers, slow_layers))
    full = torch.cat([mask, mask.new_ones((1, 1))], -1)
    with torch.no_grad():
        got = model(input_ids=slow_last[:, None], position_ids=positions[:, None], attention_mask=full,
                    **{name: DynamicCache(ddp_cache_data=layers)}, **PLAIN, return_dict=True)
        want = model(input_ids=slow_last[:, None], position_ids=slow_mask.sum(-1)[:, None], attention_mask=full,
                     **{name: DynamicCache(ddp_cache_data=[(k.clone(), v.clone()) for k, v in slow_layers])}, **PLAIN,
                     return_dict=True)
    assert torch.equal(got.logits, want.logits)


def test_an_evicted_call_decodes_what_generate_decodes_alone() -> None:
    # Through decoding: 'a' and 'b' share a decoding batch; 'b' sits out passes until it is
    # evicted (its stepped columns plus its prompt go to a plain cache), then decodes alone
    # and joins a batch again. Its tokens are those of generate() of its prompt alone.
    from hookwire_server.engine import decoding
    from hookwire_server.engine.decode_batch import SIT_OUT_PASSES
    from hookwire_server.engine.seam import GenerateCall, GenerateOptions
    from hookwire_server.hooks.passes import Pass
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")
    n = SIT_OUT_PASSES + 12

    def call(name: str, text: str) -> GenerateCall:
        ids, mask = oracle.batch([text])
        return GenerateCall(Pass(name, "", principal=name, model="tiny-lm"), [], ids, mask,
                            GenerateOptions(max_new_tokens=n, overrides={"do_sample": False}, seed=0, stop=()), None,
                            put=lambda item: None)

    a, b = call("a", "Hello world, the model"), call("b", "once upon a time")
    decoding.run_step_batch(host, [a, b])  # the shared prompt pass: both join one batch
    assert a.decoder.batch is not None and a.decoder.batch is b.decoder.batch
    decoding.run_step_batch(host, [a, b])
    decoding.run_step_batch(host, [a, b])
    for _ in range(SIT_OUT_PASSES + 1):  # b's reader lags
        decoding.run_step_batch(host, [a])
    assert b.decoder.batch is None and b.decoder.member is None  # evicted
    decoding.run_step_batch(host, [a, b])  # the scheduler joined them before: b steps alone
    assert b.decoder.batch is a.decoder.batch  # and joined again after its step
    while not b.decoder.finished and b.step < n:
        decoding.run_step_batch(host, [b] if a.decoder.finished or a.step >= n else [a, b])
    ids, mask = oracle.batch(["once upon a time"])
    want = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
    assert b.decoder.tokens[0] == want[0, ids.shape[1]:].tolist()
    for c in (a, b):
        decoding.finish_call(c)


def test_a_failure_to_enter_the_batch_after_a_shared_prompt_pass_fails_only_that_call(monkeypatch: Any) -> None:
    # After the shared prompt pass chose both calls' first tokens, 'b' cannot enter the
    # decoding batch (out of memory growing the block): 'b' fails with RESOURCE_EXHAUSTED,
    # 'a' goes on (one step, not its prompt pass again alone) and decodes what generate()
    # decodes alone.
    from hookwire_server.engine import decoding
    from hookwire_server.engine.seam import GenerateCall, GenerateOptions, StepResult
    from hookwire_server.errors import ResourceExhausted
    from hookwire_server.hooks.passes import Pass
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")

    def call(name: str, text: str) -> GenerateCall:
        ids, mask = oracle.batch([text])
        return GenerateCall(Pass(name, "", principal=name, model="tiny-lm"), [], ids, mask,
                            GenerateOptions(max_new_tokens=6, overrides={"do_sample": False}, seed=0, stop=()), None,
                            put=lambda item: None)

    real = decoding._enter

    def enter(host: Any, call: Any, *args: Any, **kwargs: Any) -> None:
        if call.p.request_id == "b":
            raise torch.OutOfMemoryError("CUDA out of memory (simulated, growing the block)")
        real(host, call, *args, **kwargs)

    monkeypatch.setattr(decoding, "_enter", enter)
    a, b = call("a", "Hello world, the model"), call("b", "once upon a time")
    results = decoding.run_step_batch(host, [a, b])
    assert isinstance(results[0], StepResult) and isinstance(results[1], ResourceExhausted)
    assert (a.step, b.step) == (1, 0) and a.decoder.member is not None
    monkeypatch.setattr(decoding, "_enter", real)
    decoding.finish_call(b, ended=True, failure=results[1])
    while not a.decoder.finished and a.step < 6:
        decoding.run_step_batch(host, [a])
    ids, mask = oracle.batch(["Hello world, the model"])
    want = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert a.decoder.tokens[0] == want[0, ids.shape[1]:].tolist()
    decoding.finish_call(a)


def test_a_reshape_that_runs_out_of_memory_leaves_the_batch_as_it_was(monkeypatch: Any) -> None:
    # Growing the block for more rows: the allocation of its mask (after every layer's
    # new keys and values) fails. The batch keeps its old tensors, the join fails, and
    # a step afterwards computes what it computed before.
    model = oracle.model()
    batch = _batch()
    first = _prompt(["Hello world, the model"])
    a = batch.join("a", *first[:3])
    with torch.no_grad():
        before = model(**batch.prepare([a])[0], return_dict=True).logits
    keys, values, mask = list(batch.keys), list(batch.values), batch.mask
    state = (batch.rows, batch.end, batch.window, a.start)
    real = torch.Tensor.new_zeros
    calls = {"n": 0}

    def new_zeros(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 2 * len(keys) + 1:  # the mask's, after all keys and values
            raise torch.OutOfMemoryError("out of memory (simulated)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_zeros", new_zeros)
    try:
        batch.join("b", *_prompt(["the cat", "the dog"])[:3])  # 3 rows: past the block's one
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("the join did not fail")
    monkeypatch.setattr(torch.Tensor, "new_zeros", real)
    assert all(x is y for x, y in zip(batch.keys + batch.values, keys + values)) and batch.mask is mask
    assert (batch.rows, batch.end, batch.window, a.start) == state and batch.members == [a]
    with torch.no_grad():
        after = model(**batch.prepare([a])[0], return_dict=True).logits
    assert torch.equal(after, before)


def test_a_batch_that_fails_after_its_pass_is_dropped_and_its_calls_fail(monkeypatch: Any) -> None:
    # The step after the pass (the batch's advance) raises: the calls keep the tokens they
    # chose (one step each, not a second one alone), the batch is dropped, and each
    # member's next step fails with the error.
    from hookwire_server.engine import decoding
    from hookwire_server.engine.seam import GenerateCall, GenerateOptions, StepResult
    from hookwire_server.errors import InvalidArgument
    from hookwire_server.hooks.passes import Pass
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")

    def call(name: str, text: str) -> GenerateCall:
        ids, mask = oracle.batch([text])
        return GenerateCall(Pass(name, "", principal=name, model="tiny-lm"), [], ids, mask,
                            GenerateOptions(max_new_tokens=6, overrides={"do_sample": False}, seed=0, stop=()), None,
                            put=lambda item: None)

    a, b = call("a", "Hello world, the model"), call("b", "once upon a time")
    decoding.run_step_batch(host, [a, b])
    batch = a.decoder.batch
    assert batch is b.decoder.batch

    def advance(*args: Any) -> None:
        raise RuntimeError("advance failed (simulated)")

    monkeypatch.setattr(batch, "advance", advance)
    results = decoding.run_step_batch(host, [a, b])
    assert all(isinstance(r, StepResult) for r in results) and (a.step, b.step) == (2, 2)
    assert batch.broken is not None and not batch.members and not batch.keys
    results = decoding.run_step_batch(host, [a, b])
    assert all(isinstance(r, InvalidArgument) for r in results) and (a.step, b.step) == (2, 2)
    for c, r in zip((a, b), results):
        decoding.finish_call(c, ended=True, failure=r)


def test_only_models_with_generate_s_own_input_preparation_decode_in_a_batch(monkeypatch: Any) -> None:
    # A batch's passes hand the model its inputs directly: a model class that overrides
    # prepare_inputs_for_generation, remote code, or 3-D position ids decode alone.
    from transformers.generation.utils import GenerationMixin

    from hookwire_server.engine import decoding
    from hookwire_server.engine.seam import GenerateOptions
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")
    ids, mask = oracle.batch(["Hello world"])
    options = GenerateOptions(max_new_tokens=4, overrides={"do_sample": False}, seed=0, stop=())
    d = decoding.start_call(host, [], ids, mask, options, None)
    assert d.batch_key() is not None
    cls = type(d.model)

    def custom(self: Any, *args: Any, **kwargs: Any) -> Any:
        return GenerationMixin.prepare_inputs_for_generation(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(cls, "prepare_inputs_for_generation", custom, raising=False)
        assert d.batch_key() is None
    with monkeypatch.context() as m:
        m.setattr(cls, "__module__", "transformers_modules.someone.modeling_custom")
        assert d.batch_key() is None
    assert d.batch_key() is not None
    positions = d.model_kwargs["position_ids"]
    d.model_kwargs["position_ids"] = positions[None].expand(3, *positions.shape)  # rope sections
    assert d.batch_key() is None
    d.model_kwargs["position_ids"] = positions
    assert d.batch_key() is not None


def test_a_lone_call_that_cannot_join_a_batch_decodes_alone(monkeypatch: Any) -> None:
    # After its prompt pass alone, joining a decoding batch runs out of memory: the call
    # keeps its own cache, goes on alone and decodes what generate() decodes.
    from hookwire_server.engine import decoding
    from hookwire_server.engine.decode_batch import DecodeBatch
    from hookwire_server.engine.seam import GenerateCall, GenerateOptions, StepResult
    from hookwire_server.hooks.passes import Pass
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")
    ids, mask = oracle.batch(["Hello world, the model"])
    a = GenerateCall(Pass("a", "", principal="a", model="tiny-lm"), [], ids, mask,
                     GenerateOptions(max_new_tokens=6, overrides={"do_sample": False}, seed=0, stop=()), None,
                     put=lambda item: None)

    def join(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("out of memory (simulated)")

    monkeypatch.setattr(DecodeBatch, "join", join)
    while not (a.decoder is not None and a.decoder.finished) and a.step < 6:
        [result] = decoding.run_step_batch(host, [a])
        assert isinstance(result, StepResult) and a.decoder.member is None
    want = oracle.model().generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert a.decoder.tokens[0] == want[0, ids.shape[1]:].tolist()
    decoding.finish_call(a)


def test_running_out_of_memory_preparing_a_batch_step_is_resource_exhausted(monkeypatch: Any) -> None:
    from hookwire_server.engine import decoding
    from hookwire_server.engine.seam import GenerateCall, GenerateOptions, StepResult
    from hookwire_server.errors import ResourceExhausted
    from hookwire_server.hooks.passes import Pass
    from support import build_test_registry

    host = build_test_registry().get("tiny-lm")
    ids, mask = oracle.batch(["Hello world, the model"])
    a = GenerateCall(Pass("a", "", principal="a", model="tiny-lm"), [], ids, mask,
                     GenerateOptions(max_new_tokens=6, overrides={"do_sample": False}, seed=0, stop=()), None,
                     put=lambda item: None)
    [first] = decoding.run_step_batch(host, [a])
    assert isinstance(first, StepResult) and a.decoder.member is not None

    def prepare(*args: Any) -> Any:
        raise torch.OutOfMemoryError("out of memory growing the block (simulated)")

    monkeypatch.setattr(a.decoder.batch, "prepare", prepare)
    [result] = decoding.run_step_batch(host, [a])
    assert isinstance(result, ResourceExhausted) and a.step == 1
    decoding.finish_call(a, ended=True, failure=result)


def test_prompts_share_a_pass_only_within_the_padding_bound() -> None:
    """A shared prompt pass pads every row to its longest prompt: a call's prompt shares
    one only with prompts at most PROMPT_PAD_FACTOR times longer, so one caller's long
    prompt never costs the others more than that factor of their own."""
    from hookwire_server.engine import decoding
    from hookwire_server.engine.decoding import PROMPT_PAD_FACTOR, _prompt_groups

    class Call:
        def __init__(self, name: str, length: int) -> None:
            self.name, self.ids = name, torch.zeros((1, length), dtype=torch.long)

    calls = [Call("short", 3), Call("long", 3 * PROMPT_PAD_FACTOR + 1), Call("mid", 6), Call("edge", 3 * PROMPT_PAD_FACTOR),
             Call("tiny", 2)]
    groups = [[c.name for c in group] for group in _prompt_groups(calls)]  # type: ignore[arg-type]
    # From the longest down: 'long' (25) takes 'edge' (24) and 'mid' (6, 6 x 8 >= 25);
    # 'short' (3 x 8 = 24 < 25) and 'tiny' start their own group; arrival order within each.
    assert groups == [["long", "mid", "edge"], ["short", "tiny"]]
    assert decoding.PROMPT_PAD_FACTOR == PROMPT_PAD_FACTOR
