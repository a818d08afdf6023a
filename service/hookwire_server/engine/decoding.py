"""Generate calls on a transformers causal LM (worker thread): a call's start (its
decoding state), its prompt pass (alone, or one pass with the calls that arrived with
it), its steps (in one of the model's decoding batches, decode_batch.py, or alone on its
own cache where the model does not batch), and its end.

How a call decodes
------------------
``transformers``' own ``generate()`` prepares the call — the generation config with the
call's overrides, the attention mask, position ids, the KV cache, the logits processors
and the stopping criteria — through its documented ``custom_generate`` hook, which hands
the prepared state to a callable instead of its own decoding loop (``_hand_over``).
``Decoder`` then runs the loop of transformers' ``_sample`` one step at a time: step 0 is
the prefill over the prompt, each later step one cached pass over the tokens chosen last,
one step per plan the scheduler puts the call in (``run_calls``; the call is one work
item for its whole life: seam.GenerateCall). A call's own choice of tokens (``choose``:
processors, sampling generator, stopping criteria) stays its own in a shared pass. So a
call running alone computes exactly what in-process ``generate()`` computes, and calls
that arrive together compute what in-process ``generate()`` of their prompts as one
batch computes (bit for bit while their decoding batch's window is not widened and no
member sits out a pass; otherwise up to rounding: decode_batch).
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
from .. import wakeups
from .pass_runner import model_error, model_errors, run_joined, running
from .seam import FINISHED, GenerateCall, GenerateOptions, Running, StepResult, TokenLogprobs

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
        mask = prepared.model_kwargs.get("attention_mask")
        #: The prompt's attention mask [sequences, prompt length] (0 on its own left padding).
        self.prompt_mask = mask if isinstance(mask, torch.Tensor) else torch.ones_like(self.input_ids)
        #: Its rows in the model's decoding batch once it joined one (decode_batch.Member,
        #: and that DecodeBatch): from then on its steps are the batch's passes.
        self.member: Any = None
        self.batch: Any = None
        #: What the call reports beside its tokens (GenerateOptions.logprobs,
        #: .prompt_logprobs: top-k counts, None for none) and its min_new_tokens (stop
        #: strings do not end a sequence before it; the EOS logits are masked by
        #: generate()'s own processor). Set by start_call.
        self.logprobs: int | None = None
        self.prompt_logprobs: int | None = None
        self.min_new_tokens = 0
        #: The prefill keeps every position's logits (logits_to_keep 0, for prompt
        #: logprobs): the steps after it go back to the last position's.
        self.full_prefill = False
        #: What the last choose reported (StepResult.logprobs, .prompt_logprobs).
        self.chosen_logprobs: list[TokenLogprobs | None] | None = None
        self.scored_prompt: list[list[TokenLogprobs]] | None = None

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
        """The model inputs of the next cached step (after the prefill), a step alone."""
        kwargs = self.model_kwargs
        assert kwargs is not None, "the decoder was released"
        return self.model.prepare_inputs_for_generation(  # type: ignore[no-any-return]
            self.input_ids, next_sequence_length=1 if kwargs.get("use_cache") else None, **kwargs
        )

    def batch_key(self) -> Any:
        """What decides whether this call's passes may share a model's decoding batch
        (decode_batch: calls of equal keys share its prompt pass and its cache), or None
        when it decodes on its own: a plain ``DynamicCache`` of full attention layers
        (empty before the prompt pass, whose rows the batch copies after it), the
        attention mask and position ids as tensors (each row keeps its own positions),
        every other input a plain value."""
        kwargs = self.model_kwargs
        if kwargs is None or not kwargs.get("use_cache") or not batchable_model(self.model):
            return None
        cache: Any = kwargs.get(self.cache_key)
        if type(cache).__name__ != "DynamicCache" or not cache.layers:
            return None
        for layer in cache.layers:
            if type(layer).__name__ != "DynamicLayer":
                return None
            if self.step_index == 0 and layer.is_initialized and layer.get_seq_length():
                return None  # a prompt pass over a cache that holds something already
        positions = kwargs.get("position_ids")
        if not isinstance(positions, torch.Tensor) or positions.dim() != 2:
            return None  # the model would take positions from the (padded) cache length; or 3-D (rope sections)
        if not isinstance(kwargs.get("attention_mask"), (torch.Tensor, type(None))):
            return None
        return ("batch", self.plain_inputs(), len(cache.layers))

    def plain_inputs(self) -> tuple[tuple[str, Any], ...] | None:
        """The model inputs other than ids, mask, positions and cache (logits_to_keep,
        use_cache, ...), sorted; None when one is not a plain value (e.g. token_type_ids)."""
        assert self.model_kwargs is not None
        plain = []
        for key, value in sorted(self.model_kwargs.items()):
            if key in ("attention_mask", "position_ids", self.cache_key):
                continue
            if not isinstance(value, (bool, int, float, str, type(None))):
                return None
            plain.append((key, value))
        return tuple(plain)

    def advance(self, outputs: Any) -> list[int]:
        """Takes the outputs of a pass of its own (logits, KV cache) and chooses the next
        tokens (``choose``)."""
        model = self.model
        kwargs = self.model_kwargs
        assert kwargs is not None, "the decoder was released"
        with torch.no_grad():
            self.model_kwargs = kwargs = model._update_model_kwargs_for_generation(
                outputs, kwargs, is_encoder_decoder=False
            )
            if self.full_prefill:  # the steps after the prefill need the last position only
                kwargs["logits_to_keep"] = 1
            logits = outputs.logits
            del outputs
        return self.choose(logits)

    def result(self, tokens: list[int]) -> StepResult:
        """The StepResult of the step whose tokens ``choose`` returned."""
        prompt, self.scored_prompt = self.scored_prompt, None
        return StepResult(tokens, tuple(self.reasons), self.finished, dict(self.stopped), self.chosen_logprobs, prompt)

    def choose(self, logits: torch.Tensor) -> list[int]:
        """Chooses the next tokens from a pass's logits of this call's rows (as
        generate()'s ``_sample``: processors, greedy or seeded sampling, the stopping
        criteria); returns them per sequence (FINISHED for one that had already ended)."""
        with torch.no_grad():
            if self.step_index == 0 and self.prompt_logprobs is not None:
                self.scored_prompt = self._score_prompt(logits)
            logits = logits[:, -1].to(copy=True, dtype=torch.float32, device=self.input_ids.device)
            # The raw logits' log-probabilities, before the processors (which may change
            # their input in place) see them: what the contract reports.
            raw = torch.log_softmax(logits, dim=-1) if self.logprobs is not None else None
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
            if self.has_eos_criterion and self.pad_token is not None and any(self.reasons):  # a row has ended
                next_tokens = next_tokens * self.unfinished + self.pad_token * (1 - self.unfinished)
            self.input_ids = torch.cat([self.input_ids, next_tokens[:, None]], dim=-1)
            ended: dict[str, torch.Tensor] = {}
            for criterion in self.stopping_criteria:  # what StoppingCriteriaList does, criterion by criterion
                reason = _REASONS.get(type(criterion).__name__, "length")
                done = criterion(self.input_ids, None).to(torch.bool)
                ended[reason] = done | ended[reason] if reason in ended else done
            if self.min_new_tokens and any(len(seq) + 1 < self.min_new_tokens for seq in self.tokens):
                # Neither an EOS token nor a stop string ends a sequence short of
                # min_new_tokens (generate()'s processor masks the EOS logits already).
                young = torch.tensor([len(seq) + 1 < self.min_new_tokens for seq in self.tokens],
                                     device=next_tokens.device)
                for reason in ("eos", "stop"):
                    if reason in ended:
                        ended[reason] = ended[reason] & ~young
        # Read as lists once: indexing tensors element by element costs a decoding step of
        # many calls more than its model pass (tiny-lm).
        was_running = self.unfinished.bool().tolist()
        chosen = next_tokens.tolist()
        ends = {reason: done.tolist() for reason, done in ended.items()}
        out = []
        ruled = []
        reported = None if raw is None else _token_logprobs(raw, next_tokens, self.logprobs or 0)
        self.chosen_logprobs = None if reported is None else [None] * len(was_running)
        for i, alive in enumerate(was_running):
            if not alive:
                out.append(FINISHED)
                continue
            if i in self.stops:  # a stop rule fired for it in this pass: its token is not emitted
                out.append(FINISHED)
                self.reasons[i] = "rule"
                self.stopped[i] = self.stops[i]
                ruled.append(i)
                continue
            if reported is not None and self.chosen_logprobs is not None:
                self.chosen_logprobs[i] = reported[i]
            out.append(int(chosen[i]))
            self.tokens[i].append(int(chosen[i]))
            for reason in _PRECEDENCE:
                if reason in ends and ends[reason][i]:
                    self.reasons[i] = reason
                    break
        if ruled or any(any(done) for done in ends.values()):
            any_ended = torch.zeros_like(self.unfinished, dtype=torch.bool)
            any_ended[ruled] = True
            for done in ended.values():
                any_ended |= done
            self.unfinished = self.unfinished & ~any_ended.to(self.unfinished.dtype)
        self.step_index += 1
        return out

    def _score_prompt(self, logits: torch.Tensor) -> list[list[TokenLogprobs]]:
        """Each sequence's prompt tokens after its first, scored by the prefill's logits
        (``logits`` [sequences, positions, vocabulary], the call's own prompt in its last
        ``prompt_length`` positions): per sequence, one TokenLogprobs per token, its own
        left padding skipped."""
        length = self.prompt_length
        if int(logits.shape[1]) < length:
            raise Unimplemented("prompt_logprobs: the model returned the last position's logits only")
        scored: list[list[TokenLogprobs]] = []
        keep = self.prompt_mask.bool().tolist()
        k = self.prompt_logprobs or 0
        for row in range(int(logits.shape[0])):
            # Position j's logits score token j + 1: the tokens after the sequence's first.
            first = keep[row].index(True) if True in keep[row] else length
            if first + 1 >= length:
                scored.append([])
                continue
            raw = torch.log_softmax(logits[row, first - length:-1].to(dtype=torch.float32), dim=-1)
            targets = self.input_ids[row, first + 1:length].to(raw.device)
            scored.append(_token_logprobs(raw, targets, k))
        return scored

    def release(self) -> None:
        """Frees the KV cache and the other tensors the call holds."""
        self.model_kwargs = None
        self.logits_processor = None


def _token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Per row of ``logprobs`` [rows, vocabulary]: the log-probability of its token in
    ``tokens`` [rows] and the ``k`` most likely tokens beside it (most likely first)."""
    own = logprobs.gather(-1, tokens.to(logprobs.device)[:, None].long()).squeeze(-1).tolist()
    if not k:
        return [TokenLogprobs(float(v)) for v in own]
    values, ids = logprobs.topk(min(k, int(logprobs.shape[-1])), dim=-1)
    return [TokenLogprobs(float(v), tuple(zip(map(int, i), map(float, t))))
            for v, i, t in zip(own, ids.tolist(), values.tolist())]


def batchable_model(model: Any) -> bool:
    """Whether a model's decoding steps may run in a decoding batch, whose passes hand
    the model its inputs directly (ids, mask, 2-D position ids, cache) instead of through
    ``prepare_inputs_for_generation``: only a class of transformers itself (no remote
    code, nothing defined elsewhere) that keeps ``GenerationMixin``'s own
    ``prepare_inputs_for_generation``. Other models decode each call alone."""
    from transformers.generation.utils import GenerationMixin

    cls = type(model)
    if cls.__module__.split(".")[0] != "transformers":
        return False
    return getattr(cls, "prepare_inputs_for_generation", None) is GenerationMixin.prepare_inputs_for_generation


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
    if options.min_new_tokens:  # generate()'s processor masks the EOS logits until then
        extra["min_new_tokens"] = options.min_new_tokens
    full_prefill = options.prompt_logprobs is not None and model._supports_logits_to_keep()
    if full_prefill:  # every prompt position's logits (generate() would keep the last one's)
        extra["logits_to_keep"] = 0
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
    if options.ignore_eos:  # an EOS token is a token like any other: no criterion ends on it
        from transformers import StoppingCriteriaList

        prepared.stopping_criteria = StoppingCriteriaList(
            c for c in prepared.stopping_criteria if type(c).__name__ != "EosTokenCriteria")
    generator = torch.Generator(device=prepared.input_ids.device)
    generator.manual_seed(options.seed)
    decoder = Decoder(model, prepared, generator)
    decoder.logprobs, decoder.prompt_logprobs = options.logprobs, options.prompt_logprobs
    decoder.min_new_tokens, decoder.full_prefill = options.min_new_tokens, full_prefill
    return decoder


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
    ended, runs the next step of the others (run_step_batch: new calls start and run
    their prompt pass, together when they may; the others a step of their decoding
    batch), and finishes each call that ended now (its last step, or a failure). Per
    call: seam.Running with its next step's join key while it goes on, None once
    finished, or the exception that ended it."""
    with wakeups.deferred():  # the calls' streams are woken once, when the plan is done
        return _run_calls(host, calls)


def _run_calls(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
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
            batch = call.decoder.batch
            # Members of one batch step together (None: the call decodes on its own).
            results.append(Running(None if batch is None else ("decode", id(batch))))
    return results


def prompt_key(host: ModelHost) -> Any:
    """The join key of a new Generate call (event loop): calls that arrive together may
    share their prompt pass when the model batches (their settings are checked when the
    pass runs: calls that cannot share it run theirs alone)."""
    return ("prompt",) if host.batching.enabled else None


#: Each model's decoding batches (worker thread; dropped with the model).
_BATCHES: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def _run_step(host: ModelHost, call: GenerateCall) -> StepResult:
    """One step of a Generate call alone (worker thread), started first if it is new;
    puts the step's result in its mailbox. The call's hooks stay attached between its
    steps (attached by start_call). A call in a decoding batch steps there, the only
    call of the pass (the other rows run as dummies)."""
    p = call.p
    if call.decoder is None:
        call.decoder = start_call(host, call.records, call.ids, call.mask, call.options, call.stop_criteria)
        call.decoder.stops = p.stops
    decoder = call.decoder
    assert isinstance(decoder, Decoder)
    if decoder.member is not None:
        [result] = _run_batch_step(host, [call])
        if isinstance(result, BaseException):
            raise result
        return result  # type: ignore[no-any-return]
    if call.step:  # step 0 runs on the Pass as it was made
        p.begin_step(call.step)
    # The tokens of the pass's positions, for rules' token-id signals: the prompt, then each new token.
    p.token_ids = decoder.input_ids if decoder.step_index == 0 else decoder.input_ids[:, -1:]
    with running(host, Batch.alone(p)), model_errors(host, "forward"):
        tokens = decoder.step()
    if decoder.member is None and not decoder.finished and call.step + 1 < call.options.max_new_tokens:
        # After its prompt pass alone, or its step alone after it was evicted from a batch
        # (decode_batch.SIT_OUT_PASSES): it joins one as a new call (its history as it is).
        try:
            _join_batch(host, call, decoder)
        except Exception as exc:  # e.g. out of memory: it keeps its own cache and decodes alone
            log.warning("Generate call %s could not join a decoding batch of %s (%s); it decodes alone",
                        p.request_id, host.name, exc)
    result = decoder.result(tokens)
    call.step += 1
    call.put(("step", result))
    return result


def _join_batch(host: ModelHost, call: GenerateCall, decoder: Decoder) -> None:
    """After its prompt pass alone, a call whose model batches moves its KV cache into
    a decoding batch (a copy of its own rows; the batch's others stay where they are)."""
    if not host.batching.enabled or decoder.batch_key() is None:
        return
    kwargs = decoder.model_kwargs
    assert kwargs is not None
    layers = [(layer.keys, layer.values) for layer in kwargs[decoder.cache_key].layers]
    length = int(layers[0][0].shape[2])
    mask = kwargs.get("attention_mask")
    # Its mask over its cache's columns (the prompt's, then 1 a step; the last column is
    # that of the token it feeds next).
    mask = mask[:, :length] if isinstance(mask, torch.Tensor) else torch.ones_like(decoder.input_ids[:, :length])
    with model_errors(host, "forward"):
        _enter(host, call, decoder, layers, mask=mask)


def _evict(batch: Any, member: Any) -> None:
    """Takes a member that sat out too many passes out of its decoding batch
    (decode_batch.SIT_OUT_PASSES): its call gets a plain ``DynamicCache`` of its own
    history (without the masked columns of the passes it sat out) and decodes alone,
    as after a prompt pass alone (it may join a batch again after its next step)."""
    from transformers import DynamicCache

    decoder = member.call.decoder
    assert isinstance(decoder, Decoder)
    layers, mask, positions = batch.evict(member)
    ones = mask.new_ones((mask.shape[0], 1))
    full = torch.cat([mask, ones], dim=-1)  # and the column of the token it feeds next
    position_ids = (full.cumsum(-1) - 1).clamp(min=0)
    position_ids[:, -1] = positions
    kwargs: dict[str, Any] = dict(batch.plain)
    kwargs.update(attention_mask=full, position_ids=position_ids)
    kwargs[decoder.cache_key] = DynamicCache(ddp_cache_data=layers)
    decoder.model_kwargs = kwargs
    decoder.member = decoder.batch = None


def _enter(host: ModelHost, call: GenerateCall, decoder: Decoder, layers: list[tuple[torch.Tensor, torch.Tensor]],
           room: int = 0, mask: torch.Tensor | None = None) -> None:
    """Puts a call that ran its prompt pass into a decoding batch of the model with room
    for its rows and the same inputs and layer shapes (a new one if none has, made for
    ``room`` rows: those of the calls joining with it); its own KV cache and inputs go
    (the batch holds them now)."""
    from .decode_batch import DecodeBatch

    plain = decoder.plain_inputs()
    assert plain is not None
    count = int(decoder.input_ids.shape[0])
    batches = _BATCHES.setdefault(host, [])
    batches[:] = [b for b in batches if b.members]
    for batch in batches:
        # Calls of one slots group never share a pass: in one batch, each would run the
        # other's rows as dummies every step.
        apart = call.group is not None and any(m.call.group == call.group for m in batch.members)
        if batch.plain == dict(plain) and batch.has_room(count) and batch.fits(layers) and not apart:
            break
    else:
        batch = DecodeBatch(decoder.model, decoder.cache_key, dict(plain), host.dimensions,
                            max(count, host.batching.max_batch_size))
        batches.append(batch)
    mask = decoder.prompt_mask if mask is None else mask
    decoder.member = batch.join(call, layers, mask, decoder.input_ids[:, -1], room)
    decoder.batch = batch
    decoder.model_kwargs = {}  # its cache, mask and positions live in the batch now


def run_step_batch(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """Runs the next step of Generate calls that the scheduler joined (worker thread):
    new calls' prompt passes as one pass, left-padded as a batched ``generate()`` pads
    them (``_run_prompts``), or one step of a decoding batch's members (decode_batch:
    one pass over the batch's rows, each call's cache where it lies). Each call keeps
    its own step number, hooks, processors, sampling generator and stopping criteria.
    When the shared pass fails, each call's step runs again alone. Returns a StepResult
    or exception per call."""
    if len(calls) > 1:
        if all(call.decoder is None for call in calls):
            return _run_prompts(host, calls)
        # Calls of one decoding batch step together; a call that left its batch since
        # the scheduler joined it (evicted: decode_batch.SIT_OUT_PASSES) steps alone.
        groups: dict[int | None, list[int]] = {}
        for i, call in enumerate(calls):
            batch = call.decoder.batch if isinstance(call.decoder, Decoder) else None
            groups.setdefault(None if batch is None else id(batch), []).append(i)
        results: list[Any] = [None] * len(calls)
        for key, indices in groups.items():
            group = [calls[i] for i in indices]
            if key is None or len(group) == 1:
                out = [_step_alone(host, call) for call in group]
            else:
                out = run_joined(host, group, lambda cs: _run_batch_step(host, cs), lambda call: _run_step(host, call),
                                 what="batched step", logger=log)
            for i, result in zip(indices, out):
                results[i] = result
        return results
    return [_step_alone(host, calls[0])]


def _step_alone(host: ModelHost, call: GenerateCall) -> Any:
    """A lone call's step (without the pass runner's call-back into this module): its
    StepResult or exception."""
    try:
        return _run_step(host, call)
    except Exception as exc:
        return exc


def _run_prompts(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """New calls that arrived together: each is started (its failure is its own), then
    those whose inputs allow it run their prompt passes as one (``_run_shared_prompt``),
    the others alone."""
    results: list[Any] = [None] * len(calls)
    started: list[int] = []
    for i, call in enumerate(calls):
        try:
            call.decoder = start_call(host, call.records, call.ids, call.mask, call.options, call.stop_criteria)
            call.decoder.stops = call.p.stops
        except Exception as exc:
            results[i] = exc
        else:
            started.append(i)
    position = {id(calls[i]): i for i in started}
    for padded in _prompt_groups([calls[i] for i in started]):
        # Calls of equal inputs share a pass (a call that scores its prompt keeps every
        # position's logits, its own key); the others run theirs alone.
        by_key: dict[Any, list[GenerateCall]] = {}
        for call in padded:
            by_key.setdefault(call.decoder.batch_key(), []).append(call)
        for key, group in by_key.items():
            if len(group) > 1 and key is not None:
                out = run_joined(host, group, lambda cs: _run_shared_prompt(host, cs),
                                 lambda call: _run_step(host, call), what="batched prompt pass", logger=log)
            else:
                out = []
                for call in group:
                    try:
                        out.append(_run_step(host, call))
                    except Exception as exc:
                        out.append(exc)
            for call, result in zip(group, out):
                results[position[id(call)]] = result
    return results


#: Prompts share a pass only with prompts at most this many times longer: a shared pass
#: pads every row to its longest prompt, so this bounds what one caller's long prompt
#: costs the callers who arrived with it (each pays at most this factor of its own length).
PROMPT_PAD_FACTOR = 8


def _prompt_groups(calls: list[GenerateCall]) -> list[list[GenerateCall]]:
    """``calls`` split into the groups whose prompt passes may be one: from the longest
    prompt down, each call joins the first group whose longest prompt is at most
    PROMPT_PAD_FACTOR times its own; each group in arrival order (its rows' order)."""
    groups: list[list[GenerateCall]] = []
    for call in sorted(calls, key=lambda c: -int(c.ids.shape[1])):
        length = int(call.ids.shape[1])
        for group in groups:
            if length * PROMPT_PAD_FACTOR >= int(group[0].ids.shape[1]):
                group.append(call)
                break
        else:
            groups.append([call])
    order = {id(call): i for i, call in enumerate(calls)}
    return [sorted(group, key=lambda c: order[id(c)]) for group in groups]


def _run_shared_prompt(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """The prompt passes of new calls as one pass: their prompts padded on the left to
    the longest (raised past the model's dimensions when some are shorter, so that hooks
    cut each call's own tokens), each with its own mask and position ids, over an empty
    ``DynamicCache``, as a batched ``generate()`` runs its prompts; then each call
    chooses its first tokens and, if it goes on, moves its rows of the cache into a
    decoding batch."""
    from transformers import DynamicCache

    model: Any = host.module
    decoders: list[Decoder] = [call.decoder for call in calls]
    lengths = [d.prompt_length for d in decoders]
    rows = [int(d.input_ids.shape[0]) for d in decoders]
    total = sum(rows)
    width = max(lengths)
    if min(lengths) < width:
        padded = padded_length(lengths, host.dimensions | {total}, None)
        assert padded is not None
        width = padded
    first = decoders[0]
    device = first.input_ids.device
    pad = int(first.pad_token) if first.pad_token is not None and first.pad_token.dim() == 0 else 0
    ids = torch.full((total, width), pad, dtype=first.input_ids.dtype, device=device)
    mask = torch.zeros((total, width), dtype=torch.long, device=device)
    positions = torch.ones((total, width), dtype=torch.long, device=device)  # generate()'s value at padding
    segments, start = [], 0
    for call, d, n, length in zip(calls, decoders, rows, lengths):
        assert d.model_kwargs is not None
        ids[start:start + n, width - length:] = d.input_ids
        mask[start:start + n, width - length:] = d.prompt_mask
        positions[start:start + n, width - length:] = d.model_kwargs["position_ids"]
        segments.append(Segment(call.p, start, start + n, length))
        start += n
    plain = first.plain_inputs()
    assert plain is not None
    inputs: dict[str, Any] = dict(plain)
    inputs.update(input_ids=ids, attention_mask=mask, position_ids=positions)
    inputs[first.cache_key] = DynamicCache()
    batch = Batch(segments, padded=width if min(lengths) < width else None, side="left")
    for call, d in zip(calls, decoders):
        call.p.token_ids = d.input_ids  # its own prompt (hooks see its own positions)
    with running(host, batch), model_errors(host, "forward"), torch.no_grad():
        outputs = model(**inputs, return_dict=True)
    cache = getattr(outputs, first.cache_key)
    results: list[Any] = []
    room = total  # a new decoding batch is made for all of them at once
    # From the first choose on, nothing raises out of here (the pass runner would run the
    # calls' prompt passes again alone): each call's failure is its own.
    for call, d, seg, length in zip(calls, decoders, segments, lengths):
        result: Any
        try:
            tokens = d.choose(outputs.logits[seg.start:seg.stop])
        except Exception as exc:  # e.g. its sampling settings leave no distribution: only it fails
            result = exc
        else:
            result = d.result(tokens)
            if not d.finished and call.options.max_new_tokens > 1:
                try:  # e.g. out of memory growing the batch's block: only it fails (RESOURCE_EXHAUSTED)
                    with model_errors(host, "forward"):
                        _enter(host, call, d, [(layer.keys[seg.start:seg.stop, :, width - length:],
                                                layer.values[seg.start:seg.stop, :, width - length:])
                                               for layer in cache.layers], room)
                except Exception as exc:
                    result = exc
        try:
            call.p.release()  # its events of the pass go out (also when it failed, as a step alone delivers them)
        except Exception as exc:  # e.g. it kept more for a full stream than its principal may: only it fails
            result = exc
        if not isinstance(result, BaseException):
            call.step += 1
            call.put(("step", result))
        results.append(result)
    return results


def _run_batch_step(host: ModelHost, calls: list[GenerateCall]) -> list[Any]:
    """One decoding step of calls in one decoding batch: one pass over the batch's rows
    (those of calls not stepping now run as dummies), each call's hooks on its own rows
    and, when the calls' histories differ in length, its own keys (the window padded on
    the left past the model's dimensions); then each call chooses its tokens from its
    rows' logits."""
    model: Any = host.module
    decoders: list[Decoder] = [call.decoder for call in calls]
    batch = decoders[0].batch
    if batch.broken is not None:  # an earlier step left it in an unknown state: its calls fail
        raise batch.broken
    members = [d.member for d in decoders]
    # e.g. out of memory growing the block: RESOURCE_EXHAUSTED (the batch stays as it was)
    with model_errors(host, "forward"):
        inputs, padded, spans = batch.prepare(members)
    segments = [Segment(call.p, m.row, m.row + m.count, span) for call, m, span in zip(calls, members, spans)]
    shared = Batch(segments, padded=padded, side="left", rows=batch.rows)
    for call, d in zip(calls, decoders):
        call.p.begin_step(call.step)
        call.p.token_ids = d.input_ids[:, -1:]  # a decoding step is after every call's prompt
    with running(host, shared), model_errors(host, "forward"), torch.no_grad():
        outputs = model(**inputs, return_dict=True)
    logits = outputs.logits
    del outputs, inputs
    results: list[Any] = []
    for call, d, m in zip(calls, decoders, members):
        result: Any
        try:
            tokens = d.choose(logits[m.row:m.row + m.count])
        except Exception as exc:  # e.g. its sampling settings leave no distribution: only it fails
            result = exc
        else:
            result = d.result(tokens)
        if len(calls) > 1:
            try:
                call.p.release()  # its events of the pass go out (also when it failed, as a step alone delivers them)
            except Exception as exc:  # e.g. it kept more for a full stream than its principal may: only it fails
                result = exc
        if not isinstance(result, BaseException):
            call.step += 1
            call.put(("step", result))
        results.append(result)
    # The calls chose their tokens: nothing raises out of here now (the pass runner would
    # run their step again alone).
    try:
        batch.advance(members, [d.input_ids[:, -1] for d in decoders])
    except Exception as exc:  # the batch's state is unknown: every member's next step fails
        log.exception("a decoding batch of %s failed after its pass; its calls fail", host.name)
        batch.drop(model_error(host, "forward", exc))
        return results
    for member in batch.lagging():  # its masked columns would hold the window open: it goes on alone
        try:
            _evict(batch, member)
        except Exception:  # e.g. out of memory for its copy: it stays (and is tried again next pass)
            log.exception("evicting a lagging Generate call from a decoding batch of %s failed", host.name)
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
            if call.decoder.member is not None:  # its rows become free: nothing else moves
                call.decoder.batch.leave(call.decoder.member)
                call.decoder.member = call.decoder.batch = None
            call.decoder.release()
        if ended:
            call.put(("ended", failure))
