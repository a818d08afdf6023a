"""A test engine behind the engine seam that packs (issue 23's proof of the seam, before
vLLM): it runs Infer calls of a transformers causal LM with every call's token
sequences side by side in one ``[1, tokens]`` pass, as a paged-KV engine lays out a
step: no padding, a block-diagonal causal attention mask that confines each sequence
to its own tokens, positions restarting per sequence. Hooks, rules and delivery are
the server's own; the engine only tells them, through a ``PackedBatch``, which tokens
are whose (hookwire_server/engine/packed.py).

It refuses what it does not run — backward, MODE_TRAIN, Generate, inputs other than
``input_ids`` (plus an all-ones ``attention_mask``) — with UNIMPLEMENTED naming itself.
"""

from __future__ import annotations

from typing import Any

import torch

from hookwire.wire import codec
from hookwire_server.engine import infer_pass
from hookwire_server.engine.batching import Shape
from hookwire_server.engine.packed import PackedBatch, PackedSegment
from hookwire_server.engine.pass_runner import call_model, run_joined, running
from hookwire_server.engine.seam import INFER, Plan
from hookwire_server.errors import InvalidArgument, Unimplemented
from hookwire_server.models.model_registry import ModelHost


class PackedEngine:
    """See the module docstring. ``passes`` records the request ids of each pass it ran."""

    name = "packed"
    refused = {
        "backward": "the packed test engine runs in inference mode",
        "train": "the packed test engine runs in inference mode",
        "generate": "the packed test engine runs Infer only",
    }

    def __init__(self, host: ModelHost) -> None:
        self.host = host
        self.passes: list[list[str]] = []

    def infer_shape(self, request: Any) -> Shape | None:
        """Any token call joins any other: packing needs no common length."""
        ids = request.kwargs["input_ids"] if "input_ids" in request.kwargs else (request.args[0] if request.args else None)
        if ids is None or ids.WhichOneof("kind") != "tensor" or len(ids.tensor.shape) != 2:
            return None
        return Shape(("packed",), int(ids.tensor.shape[0]), None, frozenset())

    def generate_key(self, call: Any) -> None:
        return None  # it refuses Generate

    def execute(self, plan: Plan) -> list[Any]:
        if plan.kind != INFER:
            return [Unimplemented(f"the {self.name} engine does not run {plan.kind}")] * len(plan.items)
        return run_joined(self.host, plan.items, self._pass, lambda call: self._pass([call])[0], what="packed pass")

    def _tokens(self, call: infer_pass.InferCall) -> torch.Tensor:
        """The call's ``[sequences, length]`` token ids; UNIMPLEMENTED for what it cannot run."""
        if call.backward is not None or call.train:
            raise Unimplemented(f"the {self.name} engine runs no backward or MODE_TRAIN calls")
        request = call.request
        names = set(request.kwargs) - {"input_ids", "attention_mask"}
        if names or len(request.args) > 1 or (len(request.args) == 1) == ("input_ids" in request.kwargs):
            raise Unimplemented(f"the {self.name} engine runs calls of input_ids (and attention_mask) only")
        ids = codec.decode_value(request.args[0] if request.args else request.kwargs["input_ids"])
        if "attention_mask" in request.kwargs:
            mask = codec.decode_value(request.kwargs["attention_mask"])
            if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape or not bool((mask == 1).all()):
                raise Unimplemented(f"the {self.name} engine packs unpadded sequences (an all-ones attention_mask)")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise InvalidArgument("input_ids: a [sequences, length] matrix")
        return ids.to(torch.long)

    def _pass(self, calls: list[infer_pass.InferCall]) -> list[Any]:
        matrices = [self._tokens(call) for call in calls]
        segments, spans, start = [], [], 0
        for call, ids in zip(calls, matrices):
            mine = []
            for _ in range(ids.shape[0]):
                mine.append((start, start + ids.shape[1]))
                start += ids.shape[1]
            spans += mine
            segments.append(PackedSegment.of(call.p, mine))
        total = start
        tokens = torch.cat([ids.reshape(-1) for ids in matrices])[None]
        positions = torch.cat([torch.arange(b - a) for a, b in spans])[None]
        allowed = torch.zeros(total, total, dtype=torch.bool)
        for a, b in spans:
            allowed[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        dtype = next(self.host.module.parameters()).dtype
        mask = torch.zeros(1, 1, total, total, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        batch = PackedBatch(segments, dim=1, tokens=total)
        self.passes.append([c.p.request_id for c in calls])
        model = self.host.module
        with running(self.host, batch, [r for c in calls for r in c.records]), torch.no_grad():
            output = call_model(self.host, "forward", lambda: model(
                input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False, return_dict=True,
            ))
            logits = [batch.take(output.logits, seg, "the logits").clone() for seg in segments]
        results: list[Any] = []
        for call, mine in zip(calls, logits):
            codec.encode_value_into({"logits": mine}, call.p.response.output)
            results.append(infer_pass.delivered(call, call.p.response))
        return results
