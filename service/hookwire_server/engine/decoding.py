"""Generate calls on a transformers causal LM (worker thread): a call's start (its
decoding state), one step alone or several calls' steps joined into one pass (each
call's KV cache stacked, padded on the left and masked), and its end.

How a call decodes
------------------
``transformers``' own ``generate()`` prepares the call — the generation config with the
call's overrides, the attention mask, position ids, the KV cache, the logits processors
and the stopping criteria — through its documented ``custom_generate`` hook, which hands
the prepared state to a callable instead of its own decoding loop (``_start``).
``Decoder`` then runs the loop of transformers' ``_sample`` one step at a time: step 0 is
the prefill over the prompt, each later step one cached pass over the tokens chosen last,
one step per plan the scheduler puts the call in (``run_calls``; the call is one work
item for its whole life: seam.GenerateCall). So a call running alone computes exactly
what in-process ``generate()`` computes.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch

from ..errors import InvalidArgument, ResourceExhausted, Unimplemented
from ..hooks.hook_record import HookRecord
from ..models.model_registry import ModelHost, forward_parameters
from .batching import Batch, Segment, padded_length
from .pass_runner import model_errors, run_joined, running
from .seam import FINISHED, GenerateCall, GenerateOptions, Running, StepResult

log = logging.getLogger("hookwire.generate")


#: finish_reason of a sequence that a stopping criterion ended, by criterion class name
#: (transformers' classes; anything else, e.g. MaxTimeCriteria, counts as "length").
_REASONS = {"EosTokenCriteria": "eos", "StopStringCriteria": "stop", "MaxLengthCriteria": "length"}


#: When several criteria end a sequence in the same step, the first of these wins.
_PRECEDENCE = ("eos", "stop", "length")


@dataclasses.dataclass
class _Prepared:
    """What transformers' generate() prepared, handed over by its custom_generate hook."""

    input_ids: torch.Tensor
    logits_processor: Any
    stopping_criteria: Any
    generation_config: Any
    model_kwargs: dict[str, Any]


def _hand_over(
    model: Any, input_ids: torch.Tensor, logits_processor: Any = None, stopping_criteria: Any = None,
    generation_config: Any = None, synced_gpus: bool = False, streamer: Any = None, **model_kwargs: Any,
) -> _Prepared:
    """generate()'s custom_generate: instead of decoding, return what it prepared."""
    return _Prepared(input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)


class Decoder:
    """The decoding state of one Generate call: transformers' ``_sample`` loop, one
    ``step()`` per pass. Used on the model's worker thread only."""

    def __init__(self, model: Any, prepared: _Prepared, generator: torch.Generator) -> None:
        self.model = model
        #: The name the model's forward takes its KV cache by (cache_argument).
        self.cache_key = cache_argument(model)
        self.input_ids = prepared.input_ids
        self.prompt_length = int(prepared.input_ids.shape[1])
        self.logits_processor = prepared.logits_processor
        self.stopping_criteria = prepared.stopping_criteria
        self.config = prepared.generation_config
        self.model_kwargs: dict[str, Any] | None = prepared.model_kwargs
        self.generator = generator
        self.do_sample = bool(self.config.do_sample)
        batch = int(self.input_ids.shape[0])
        self.unfinished = torch.ones(batch, dtype=torch.long, device=self.input_ids.device)
        pad = self.config._pad_token_tensor
        self.pad_token = pad.to(self.input_ids.device) if pad is not None else None
        # As _sample: with an EOS criterion, finished sequences continue with the pad token.
        self.has_eos_criterion = any(hasattr(c, "eos_token_id") for c in self.stopping_criteria)
        self.step_index = 0
        #: Why each sequence ended ("" while it runs).
        self.reasons = [""] * batch
        #: Each sequence's new tokens (up to the one that ended it).
        self.tokens: list[list[int]] = [[] for _ in range(batch)]
        #: The rows a stop rule ended in the running pass (the call's Pass.stops: set by
        #: whoever starts the call), and every sequence one ended so far.
        self.stops: dict[int, tuple[str, str, int]] = {}
        self.stopped: dict[int, tuple[str, str, int]] = {}

    @property
    def finished(self) -> bool:
        """Whether every sequence has ended."""
        return all(self.reasons)

    def step(self) -> list[int]:
        """Runs one pass and chooses the next tokens; returns them per sequence
        (FINISHED for a sequence that had already ended)."""
        model = self.model
        kwargs = self.model_kwargs
        assert kwargs is not None, "the decoder was released"
        with torch.no_grad():
            if self.step_index == 0:
                outputs = model._prefill(self.input_ids, self.config, kwargs, is_first_iteration=True)
            else:
                outputs = model(**self.step_inputs(), return_dict=True)
        return self.advance(outputs)

    def step_inputs(self) -> dict[str, Any]:
        """The model inputs of the next cached step (after the prefill)."""
        kwargs = self.model_kwargs
        assert kwargs is not None, "the decoder was released"
        return self.model.prepare_inputs_for_generation(  # type: ignore[no-any-return]
            self.input_ids, next_sequence_length=1 if kwargs.get("use_cache") else None, **kwargs
        )

    def join_key(self) -> Any:
        """What decides whether this call's next step may share a pass with other calls'
        (equal keys join), or None when it must run alone: after the prefill, with a
        plain ``DynamicCache`` (full attention layers) whose rows can be stacked and an
        attention mask and position ids that keep each row's own positions."""
        kwargs = self.model_kwargs
        if self.step_index == 0 or kwargs is None or not kwargs.get("use_cache"):
            return None
        cache: Any = kwargs.get(self.cache_key)
        if type(cache).__name__ != "DynamicCache" or not cache.layers:
            return None
        layers = []
        for layer in cache.layers:
            if type(layer).__name__ != "DynamicLayer" or not layer.is_initialized or layer.keys is None:
                return None
            layers.append((tuple(layer.keys.shape[1:2]), tuple(layer.keys.shape[3:]), tuple(layer.values.shape[1:2]),
                           tuple(layer.values.shape[3:]), layer.keys.dtype, str(layer.keys.device)))
        if not isinstance(kwargs.get("position_ids"), torch.Tensor):
            return None  # the model would take positions from the (padded) cache length
        if not isinstance(kwargs.get("attention_mask"), (torch.Tensor, type(None))):
            return None
        plain = []
        for key, value in sorted(kwargs.items()):
            if key in ("attention_mask", "position_ids", self.cache_key):
                continue
            if not isinstance(value, (bool, int, float, str, type(None))):
                return None  # e.g. token_type_ids: not stacked here
            plain.append((key, value))
        return ("decode", tuple(plain), tuple(layers))

    def cache_length(self) -> int:
        """Tokens in the KV cache now."""
        assert self.model_kwargs is not None
        return int(self.model_kwargs[self.cache_key].layers[0].keys.shape[2])

    def advance(self, outputs: Any) -> list[int]:
        """Takes a pass's outputs (logits, KV cache) and chooses the next tokens; returns
        them per sequence (FINISHED for a sequence that had already ended)."""
        model = self.model
        kwargs = self.model_kwargs
        assert kwargs is not None, "the decoder was released"
        with torch.no_grad():
            self.model_kwargs = kwargs = model._update_model_kwargs_for_generation(
                outputs, kwargs, is_encoder_decoder=False
            )
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=self.input_ids.device)
            del outputs
            scores = self.logits_processor(self.input_ids, logits)
            if self.do_sample:
                probs = torch.nn.functional.softmax(scores, dim=-1)
                try:
                    next_tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
                except RuntimeError as exc:  # e.g. an extreme temperature: no distribution left to sample
                    raise InvalidArgument(
                        f"sampling failed at step {self.step_index}: {exc}; the sampling settings (temperature, "
                        "top_k, top_p) leave no valid distribution"
                    ) from None
            else:
                next_tokens = torch.argmax(scores, dim=-1)
            if self.has_eos_criterion and self.pad_token is not None:
                next_tokens = next_tokens * self.unfinished + self.pad_token * (1 - self.unfinished)
            self.input_ids = torch.cat([self.input_ids, next_tokens[:, None]], dim=-1)
            ended: dict[str, torch.Tensor] = {}
            for criterion in self.stopping_criteria:  # what StoppingCriteriaList does, criterion by criterion
                reason = _REASONS.get(type(criterion).__name__, "length")
                done = criterion(self.input_ids, None).to(torch.bool)
                ended[reason] = done | ended[reason] if reason in ended else done
        was_running = self.unfinished.bool().tolist()
        chosen = next_tokens.tolist()
        out = []
        ruled = torch.zeros_like(self.unfinished, dtype=torch.bool)
        for i, alive in enumerate(was_running):
            if not alive:
                out.append(FINISHED)
                continue
            if i in self.stops:  # a stop rule fired for it in this pass: its token is not emitted
                out.append(FINISHED)
                self.reasons[i] = "rule"
                self.stopped[i] = self.stops[i]
                ruled[i] = True
                continue
            out.append(int(chosen[i]))
            self.tokens[i].append(int(chosen[i]))
            for reason in _PRECEDENCE:
                if reason in ended and bool(ended[reason][i]):
                    self.reasons[i] = reason
                    break
        any_ended = ruled
        for done in ended.values():
            any_ended |= done
        self.unfinished = self.unfinished & ~any_ended.to(self.unfinished.dtype)
        self.step_index += 1
        return out

    def release(self) -> None:
        """Frees the KV cache and the other tensors the call holds."""
        self.model_kwargs = None
        self.logits_processor = None


def start_call(
    host: ModelHost, records: list[HookRecord], ids: torch.Tensor, mask: torch.Tensor, options: GenerateOptions,
    stop_criteria: Any,
) -> Decoder:
    """Attaches the call's hooks and lets generate() prepare the call (worker thread);
    Unimplemented for a transformers without decoding steps."""
    model: Any = host.module
    if not callable(getattr(model, "_prefill", None)):
        raise Unimplemented(
            f"model {host.name!r}: Generate needs transformers 5 (the installed version lacks its decoding steps)"
        )
    for record in records:
        record.attach()
    # One sequence per prompt, decoded greedily or by sampling: beam search and several
    # returned sequences per prompt in a model's generation_config do not apply.
    # stop_strings None: generate() would build them from the model's generation_config but
    # drops the tokenizer they need when custom_generate is a callable; the call's own
    # criteria (built on the tokenizer thread) carry them instead.
    extra: dict[str, Any] = {"num_beams": 1, "num_return_sequences": 1, "stop_strings": None, **options.overrides}
    if stop_criteria is not None:
        extra["stopping_criteria"] = stop_criteria
    device = host.device
    try:
        prepared = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=options.max_new_tokens,
            custom_generate=_hand_over, **extra,
        )
    except (ValueError, TypeError) as exc:  # generate()'s own validation of the settings
        raise InvalidArgument(f"generate() refused the settings: {exc}") from None
    except (torch.OutOfMemoryError, MemoryError) as exc:  # e.g. allocating a static cache
        raise ResourceExhausted(f"preparing the generation on model {host.name!r} ran out of memory: {exc}") from None
    if not isinstance(prepared, _Prepared):  # pragma: no cover - a transformers that ignores custom_generate
        raise Unimplemented(f"model {host.name!r}: this transformers version does not support Generate")
    generator = torch.Generator(device=prepared.input_ids.device)
    generator.manual_seed(options.seed)
    return Decoder(model, prepared, generator)


def cache_argument(model: Any) -> str:
    """The name a transformers model's forward takes its KV cache by, and its outputs
    return it under: "cache" from transformers 5.24 on, "past_key_values" before. Read
    from its forward's signature once per model."""
    name = _CACHE_ARGUMENTS.get(model)
    if name is None:
        names = forward_parameters(model)
        name = _CACHE_ARGUMENTS[model] = "cache" if "cache" in names and "past_key_values" not in names else "past_key_values"
    return name


#: cache_argument of each model seen (dropped with the model).
_CACHE_ARGUMENTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def run_calls(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """Runs a plan of Generate calls (worker thread): finishes the calls their callers
    ended, runs the next step of the others (run_step_batch: a new call starts and runs
    its prefill alone), and finishes each call that ended now (its last step, or a
    failure). Per call: seam.Running with its next step's join key while it goes on,
    None once finished, or the exception that ended it."""
    # Read once: the call side may end a call (event loop) while its step runs here.
    ended = [call.ended is not None for call in calls]
    stepping = [call for call, end in zip(calls, ended) if not end]
    stepped = iter(run_step_batch(host, stepping) if stepping else [])
    results: list[Any] = []
    for call, end in zip(calls, ended):
        if end:
            finish_call(call, ended=True)
            results.append(None)
            continue
        result = next(stepped)
        if isinstance(result, BaseException):
            finish_call(call, ended=True, failure=result)
            results.append(result)
        elif result.finished or call.step >= call.options.max_new_tokens:
            finish_call(call)
            results.append(None)
        else:
            assert isinstance(call.decoder, Decoder)
            results.append(Running(call.decoder.join_key()))
    return results


def _run_step(host: ModelHost, call: GenerateCall) -> StepResult:
    """One step of a Generate call alone (worker thread), started first if it is new;
    puts the step's result in its mailbox. The call's hooks stay attached between its
    steps (attached by start_call)."""
    p = call.p
    if call.decoder is None:
        call.decoder = start_call(host, call.records, call.ids, call.mask, call.options, call.stop_criteria)
        call.decoder.stops = p.stops
    decoder = call.decoder
    assert isinstance(decoder, Decoder)
    if call.step:  # step 0 runs on the Pass as it was made
        p.begin_step(call.step)
    # The tokens of the pass's positions, for rules' token-id signals: the prompt, then each new token.
    p.token_ids = decoder.input_ids if decoder.step_index == 0 else decoder.input_ids[:, -1:]
    with running(host, Batch.alone(p)), model_errors(host, "forward"):
        tokens = decoder.step()
    result = StepResult(tokens, tuple(decoder.reasons), decoder.finished, dict(decoder.stopped))
    call.step += 1
    call.put(("step", result))
    return result


def run_step_batch(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """Runs the next step of Generate calls that the scheduler joined (worker thread):
    one decoding pass over all their rows, each call's KV cache stacked into one cache
    padded on the left (masked), its logits and cache rows cut back after. Each call
    keeps its own step number, hooks, processors, sampling generator and stopping
    criteria; a step alone runs exactly as before batching. When the shared pass
    fails, each call's step runs again alone. Returns a StepResult or exception per call."""
    if len(calls) > 1:
        return run_joined(host, calls, lambda cs: _run_shared_step(host, cs), lambda call: _run_step(host, call),
                          what="batched step", logger=log)
    try:  # a lone call's step, without the pass runner's call-back into this module
        return [_run_step(host, calls[0])]
    except Exception as exc:
        return [exc]


def _run_shared_step(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    from transformers import DynamicCache

    model: Any = host.module
    decoders = [call.decoder for call in calls]
    assert all(isinstance(d, Decoder) for d in decoders)
    torch_decoders: list[Decoder] = decoders  # type: ignore[assignment]  # checked above
    inputs = [d.step_inputs() for d in torch_decoders]
    own = [d.cache_length() + 1 for d in torch_decoders]  # keys each call's step attends to
    rows = [int(i["input_ids"].shape[0]) for i in inputs]
    keys = padded_length(own, host.dimensions | {sum(rows)}, None)
    assert keys is not None
    total = sum(rows)
    segments, start = [], 0
    for call, n, length in zip(calls, rows, own):
        segments.append(Segment(call.p, start, start + n, length))
        start += n
    first = inputs[0]
    cache_key = torch_decoders[0].cache_key
    joined = ("input_ids", "position_ids", "attention_mask", cache_key)
    merged: dict[str, Any] = {k: v for k, v in first.items() if k not in joined}
    for i in inputs[1:]:  # the others must be equal plain values (a tensor would need stacking)
        rest = {k: v for k, v in i.items() if k not in joined}
        if rest.keys() != merged.keys() or any(
            isinstance(v, torch.Tensor) or isinstance(rest[k], torch.Tensor) or rest[k] != v for k, v in merged.items()
        ):
            raise InvalidArgument("the calls' step inputs differ beyond ids, positions, mask and cache: run alone")
    merged["input_ids"] = torch.cat([i["input_ids"] for i in inputs])
    merged["position_ids"] = torch.cat([i["position_ids"] for i in inputs])
    # generate() drops an all-ones mask; joined rows need one (the padding is masked out).
    merged["attention_mask"] = torch.zeros((total, keys), dtype=torch.long, device=merged["input_ids"].device)
    for seg, i, length in zip(segments, inputs, own):
        mask = i.get("attention_mask")
        merged["attention_mask"][seg.start:seg.stop, keys - length:] = 1 if mask is None else mask
    layers = []
    caches = [i[cache_key] for i in inputs]
    for index, layer in enumerate(caches[0].layers):
        stacked = []
        for which in ("keys", "values"):
            t = getattr(layer, which)
            out = t.new_zeros((total, t.shape[1], keys - 1, *t.shape[3:]))
            for seg, cache in zip(segments, caches):
                mine = getattr(cache.layers[index], which)
                out[seg.start:seg.stop, :, keys - 1 - mine.shape[2]:] = mine
            stacked.append(out)
        layers.append((stacked[0], stacked[1]))
    merged[cache_key] = DynamicCache(ddp_cache_data=layers)
    del layers, caches, inputs
    batch = Batch(segments, padded=keys, side="left")
    for call, decoder in zip(calls, torch_decoders):
        call.p.begin_step(call.step)
        call.p.token_ids = decoder.input_ids[:, -1:]  # a shared step is after every call's prompt
    with running(host, batch), model_errors(host, "forward"), torch.no_grad():
        outputs = model(**merged, return_dict=True)
    cache = getattr(outputs, cache_key)
    results: list[Any] = []
    for call, decoder, seg, length in zip(calls, torch_decoders, segments, own):
        mine = DynamicCache(ddp_cache_data=[
            (layer.keys[seg.start:seg.stop, :, keys - length:], layer.values[seg.start:seg.stop, :, keys - length:])
            for layer in cache.layers
        ])
        result: Any
        try:
            tokens = decoder.advance(type(outputs)(logits=outputs.logits[seg.start:seg.stop], **{cache_key: mine}))
        except Exception as exc:  # e.g. its sampling settings leave no distribution: only it fails
            result = exc
        else:
            result = StepResult(tokens, tuple(decoder.reasons), decoder.finished, dict(decoder.stopped))
        try:
            call.p.release()  # its events of the pass go out (also when it failed, as a step alone delivers them)
        except ResourceExhausted as exc:  # it kept more for a full stream than its principal may: only it fails
            result = exc
        if not isinstance(result, BaseException):
            call.step += 1
            call.put(("step", result))
        results.append(result)
    return results


def finish_call(call: GenerateCall, *, ended: bool = False, failure: BaseException | None = None) -> None:
    """The end of a Generate call (worker thread, after its last step, or in the plan
    after its caller ended it): detaches its hooks, ends its events, frees its KV cache.
    ``ended``: it ended other than by its last step; its mailbox gets ("ended",
    ``failure``) last. Runs once."""
    if call.finished:
        return
    call.finished = True
    try:
        for record in call.records:
            record.detach()
        # Its CallEnded markers, after any events a failed or cancelled step kept for a full
        # stream (delivered from a thread of their own; an abandoned call kept none).
        call.p.finish()
    except Exception:  # never the plan's failure: the other calls of the plan go on
        log.exception("finishing Generate call %s failed", call.p.request_id)
    finally:
        if isinstance(call.decoder, Decoder):
            call.decoder.release()
        if ended:
            call.put(("ended", failure))
