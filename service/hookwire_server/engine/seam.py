"""The engine seam: what hookwire needs from an engine that runs a model.

Calls (Infer, Generate, harvest jobs), hooks, rules, delivery and the contract do not
know which engine runs a model. They hand the engine *work items* — plain data: an
Infer call (infer_pass.InferCall), one step of a Generate call (decoding.StepCall), a
harvest batch (harvest_pass.HarvestBatch) — and the model's scheduler decides which
items run together (scheduler.Scheduler.schedule returns a Plan: data, never code). The
engine executes a plan on the model's worker thread and returns one result (or
exception) per item; one pass runner (pass_runner.py) owns the pass protocol that every
engine's passes go through.

An engine provides:

- ``host``: the model as hookwire sees it (models.model_registry.ModelHost): its module
  tree and hook points (the paths a HookSpec's glob matches, the modules torch hooks are
  registered on), its tokenizer, its parameters (GetParameters), its worker thread;
- ``infer_shape(request)``: how an Infer request may share a pass, read from its
  dtypes and shapes only (batching.Shape: a join key, its rows, what sizes a joined
  pass must avoid), or None when it runs alone: the torch engine joins calls it can
  stack and pad along a batch dimension; a packing engine joins any;
- ``execute(plan)``: runs one plan, with hookwire's hooks firing for each call
  on that call's rows only (``host.current_batch`` names the calls and their rows:
  batching.Batch), and returns a result or exception per item, in order;
- ``start_generate`` / ``finish_generate``: a Generate call's decoding state, made
  before its first step and freed after its last (the torch engine: transformers'
  generate() prepares it; decoding.py); engines that refuse "generate" need neither;
- ``refused``: the features it does not support, each with the reason a client is told
  (UNIMPLEMENTED naming the engine and the feature). The torch engine refuses nothing;
  an engine that runs in inference mode (vLLM) refuses backward hooks, gradients and
  MODE_TRAIN, and attention probabilities its fused kernels never form.

What an engine may do differently inside: lay a batch out as it likes (the torch
engine stacks calls along a batch dimension; a paged-KV engine packs every call's
tokens into one ``[tokens, hidden]`` tensor — tests/integration/test_engine_seam.py runs such
an engine behind this seam), keep its own KV cache, run the model in other processes.
What it must keep: each call sees exactly its own rows in every hook, in the layout a
call alone would have; a rule edits only its call's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

#: Kinds of work item, one executor each (and the scheduler's metrics label).
INFER = "infer"
GENERATE = "generate"
HARVEST = "harvest"
KINDS = (INFER, GENERATE, HARVEST)

#: Features an engine may refuse (Engine.refused keys; the wire's RefusedFeature.feature):
#: backward hooks and InferRequest.backward; MODE_TRAIN; Infer; Generate; harvest jobs;
#: attention modules' probabilities (fused kernels never form them).
FEATURES = ("backward", "train", "infer", "generate", "harvest", "attention_probabilities")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the scheduler decided: ``items`` of one ``kind`` run together in one pass
    (or, when that shared pass fails, each alone: pass_runner.run_joined)."""

    kind: str
    items: list[Any]


class DecodingState(Protocol):
    """A Generate call's decoding state, as the call side reads it (Engine.start_generate
    makes it; decoding.Decoder on the torch engine)."""

    #: Whether the call samples.
    do_sample: bool
    #: Each sequence's new tokens, up to the one that ended it.
    tokens: list[list[int]]
    #: Why each sequence ended ("" while it runs).
    reasons: list[str]
    #: Steps run so far.
    step_index: int
    #: The prompt ids, [sequences, length] (its rows count the call's rows in a pass).
    input_ids: Any

    def end(self, reason: str) -> None:
        """Ends the sequences still running with ``reason``."""

    def join_key(self) -> Any:
        """Whether its next step may share a pass (equal keys join), or None: alone."""


class Engine(Protocol):
    """An engine that runs one model (see the module docstring)."""

    #: "torch", or another engine's name (reported to clients).
    name: str
    #: Features the engine refuses: feature -> why (empty: none).
    refused: Mapping[str, str]

    @property
    def host(self) -> Any:
        """The model as hookwire sees it: module tree, hook points, tokenizer, parameters,
        worker thread (models.model_registry.ModelHost)."""

    def infer_shape(self, request: Any) -> Any:
        """How an InferRequest may share a pass (batching.Shape), or None: alone. Event loop."""

    def execute(self, plan: Plan) -> list[Any]:
        """Runs ``plan`` on the model's worker thread: one result or exception per item."""

    def start_generate(self, records: list[Any], ids: Any, mask: Any, options: Any, stop_criteria: Any) -> DecodingState:
        """Prepares a Generate call on the worker thread (prompt ``ids`` left-padded, with
        ``mask``; decoding.GenerateOptions; the request-scoped hook ``records`` to attach
        for the call's lifetime) and returns its decoding state: the payload of its steps
        (decoding.StepCall.decoder), which reports ``do_sample``, ``tokens``, ``reasons``,
        ``step_index``, ``end(reason)`` and ``join_key()`` as decoding.Decoder does."""

    def finish_generate(self, p: Any, records: list[Any], decoder: Any) -> None:
        """Ends a Generate call on the worker thread, after its last step: detaches its
        hooks, ends its events (Pass.finish), frees its state (``decoder`` may be None)."""
