"""The engine seam: what hookwire needs from an engine that runs a model.

Calls (Infer, Generate, harvest jobs), hooks, rules, delivery and the contract do not
know which engine runs a model. They hand the engine *work items* — plain data: an
Infer call (infer_pass.InferCall), a Generate call (GenerateCall, below: submitted once,
for all its steps), a harvest batch (harvest_pass.HarvestBatch) — and the model's
scheduler decides which items run together (scheduler.Scheduler.schedule returns a
Plan: data, never code). The engine executes a plan on the model's worker thread and
returns one result (or exception) per item; one pass runner (pass_runner.py) owns the
pass protocol that every engine's passes go through.

A Generate call is one work item for its whole life, as a request is in vLLM's v1
engine core: the scheduler keeps it while the engine returns ``Running`` for it and
puts it in a plan whenever its stream has taken the step before (``GenerateCall.step``
<= ``allowed``: the reader's back-pressure, a flag the scheduler reads) or its caller
ended it (``ended``). The engine starts the call in its first plan (prepares its
decoding state, attaches its hooks), runs a step in each plan after, pushes what each
step produced into the call's mailbox (``put``: the events, "step" with a StepResult),
and finishes the call (detaches its hooks, ends its events, frees its state) in the
plan that ends it, telling the mailbox why ("ended") unless its last step did; the call
side only reads the mailbox.

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
- for a plan of Generate calls (GenerateCall), per call: ``Running(key)`` while it goes
  on (``key``: whether its next step may share a pass), or None once the engine ended
  it (after its last step, or when its caller ended it), or the exception that ended it
  (the engine finished it first: hooks detached, events ended); engines that refuse
  "generate" never see one;
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
from collections.abc import Callable, Hashable, Mapping
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
    """A Generate call's decoding state (GenerateCall.decoder: the engine makes it when it
    starts the call; decoding.Decoder on the torch engine, vllm_engine.VllmCall on vLLM).
    Everything else in it is the engine's own: the call side reads only ``do_sample``."""

    #: Whether the call samples (GenerateStarted.do_sample).
    do_sample: bool


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

    def generate_key(self, call: GenerateCall) -> Any:
        """What a new Generate call's first plan may share (a join key, as a running call's
        ``Running`` gives), or None: it starts alone. Event loop."""

    def execute(self, plan: Plan) -> list[Any]:
        """Runs ``plan`` on the model's worker thread: one result or exception per item."""


#: GeneratedTokens.token_ids entry of a sequence that has already finished.
FINISHED = -1


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    """A validated GenerateRequest's decoding settings."""

    max_new_tokens: int
    #: Overrides of the model's generation_config (only the fields the request set).
    overrides: dict[str, Any]
    seed: int
    stop: tuple[str, ...]
    #: Each chosen token's log-probability and this many most likely tokens beside it
    #: (StepResult.logprobs); None: none (GenerateRequest.logprobs unset).
    logprobs: int | None = None
    #: Each prompt token's log-probability (after the first) and this many most likely
    #: tokens beside it (StepResult.prompt_logprobs, step 0); None: none.
    prompt_logprobs: int | None = None
    #: An end-of-sequence token does not end a sequence (GenerateRequest.ignore_eos).
    ignore_eos: bool = False
    #: No EOS token or stop string ends a sequence before it has this many new tokens;
    #: 0: the model's generation_config.
    min_new_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The log-probabilities at one position of a sequence: its token's (the chosen one,
    or the prompt's own) and the ``top`` most likely tokens', most likely first, as
    (token id, log-probability); float32 log-softmax of the model's raw logits (before
    temperature, top-k, top-p and the other processors)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step chose, as it stood at the end of that step (the "step" message an
    engine puts in a Generate call's mailbox)."""

    #: The new token per sequence (FINISHED for one that had already ended).
    tokens: list[int]
    #: Why each sequence has ended so far ("" while it runs).
    reasons: tuple[str, ...]
    #: Whether every sequence has ended.
    finished: bool
    #: Sequences a stop rule ended so far (finish reason "rule"): row -> (hook id,
    #: module, step).
    stopped: Mapping[int, tuple[str, str, int]] = dataclasses.field(default_factory=dict)
    #: With GenerateOptions.logprobs: per sequence, the chosen token's log-probabilities
    #: (None for a sequence that had already ended); None otherwise.
    logprobs: list[TokenLogprobs | None] | None = None
    #: With GenerateOptions.prompt_logprobs, at step 0 only: per sequence, one entry per
    #: prompt token after the first (padding skipped); None otherwise.
    prompt_logprobs: list[list[TokenLogprobs]] | None = None


@dataclasses.dataclass(frozen=True)
class Running:
    """An engine's result for a Generate call that goes on: the scheduler keeps it, and
    its next step may share a pass with works of an equal ``key`` (None: alone)."""

    key: Hashable | None


@dataclasses.dataclass(eq=False)
class GenerateCall:
    """One Generate call as the engine runs it: the payload of its one scheduler Work.
    The call side makes it and then only sets ``allowed`` and ``ended`` (event loop);
    the engine sets ``decoder`` and ``step`` (worker thread); the scheduler reads both."""

    #: Its Pass (events, delivery, step numbers).
    p: Any
    #: Its request-scoped hooks (attached by the engine when it starts the call, detached
    #: when it finishes it).
    records: list[Any]
    #: Prompt ids, left-padded, [sequences, length], and their attention mask.
    ids: Any
    mask: Any
    options: GenerateOptions
    #: transformers stopping criteria for its stop strings (built by the call side), or None.
    stop_criteria: Any
    #: Its mailbox: ("event", ...), ("notice", ...), ("step", StepResult) at the end of
    #: each step, and ("ended", exception or None) when the engine ends it other than by
    #: its last step (a failure; its caller ended it; the model shut down), in order; any
    #: thread, never waits.
    put: Callable[[tuple[Any, ...]], None]
    #: Its session when the session's hooks use slots: calls of one group never share a pass.
    group: str | None = None
    #: Its decoding state, once the engine started it (DecodingState): set before anything
    #: of the call reaches its mailbox (the call side reads ``do_sample`` from it).
    decoder: Any = None
    #: The next step the engine runs: steps whose "step" message it has put.
    step: int = 0
    #: The last step its caller wants run now: its stream took the step before (the
    #: engine runs at most one step ahead of the reader).
    allowed: int = 0
    #: Why its caller ended it ("cancelled", "shutdown", "timeout", "error"), or None:
    #: the engine finishes it in its next plan, without another step.
    ended: str | None = None
    #: Set by the engine once it finished the call (its hooks detached, its events
    #: ended): a finish runs once.
    finished: bool = False
    #: Wakes the scheduler after ``allowed`` or ``ended`` changed (set by Scheduler.enqueue).
    wake: Callable[[], None] = lambda: None
