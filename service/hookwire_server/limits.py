"""Resource limits, defined once. Each is configurable (a ServerSettings field of the same
name: a ``[server]`` key and a ``HOOKWIRE_*`` variable) and answers with RESOURCE_EXHAUSTED
or INVALID_ARGUMENT worded alike everywhere by ``exceeded``: "<what>: <count>, over the
limit of <limit> (<setting>)". docs/security.md's limits table lists every field with its
default (tests/unit/test_limits_doc.py checks it against this class)."""

from __future__ import annotations

import dataclasses

from .errors import HookwireServerError, InvalidArgument, ResourceExhausted

# Delivery defaults, sized together: a principal can open max_streams_per_principal
# streams with the default buffer before its byte budget runs out (so the stream limit,
# not the budget, is what a default client meets), and the server's budget holds two
# such principals. Raising max_streams_per_principal alone makes the byte budget the
# binding limit again: raise max_buffered_bytes_per_principal with it.

#: The buffer of one stream whose DeliveryOptions.max_bytes is 0.
DEFAULT_STREAM_BYTES = 32 * 1024 * 1024
#: gRPC's default of 4 MiB is too small for tensors.
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
_DEFAULT_STREAMS_PER_PRINCIPAL = 128


@dataclasses.dataclass
class Limits:
    """Defaults sized for one server on one machine; raise them for big deployments."""

    #: Largest gRPC message sent or received, either way (InferStream chunks larger tensors).
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    #: Bytes of slots each session may keep.
    max_slot_bytes: int = 256 * 1024 * 1024
    #: Longest TTL of a hook without a session, in seconds.
    max_ttl_seconds: int = 24 * 3600
    #: Registered hooks per session.
    max_hooks_per_session: int = 256
    #: Registered hooks per principal (all its sessions and TTL hooks).
    max_hooks_per_principal: int = 1024
    #: Rules per hook action.
    max_rules_per_action: int = 64
    #: Bytes of named operands (OperandService) one principal may keep, uploads in progress included,
    #: with each copy a vLLM worker rank holds (engine/vllm_runtime.py).
    max_operand_bytes_per_principal: int = 1024 * 1024 * 1024
    #: Named operands one principal may keep.
    max_operands_per_principal: int = 64
    #: Bytes of all named operands on the server, published ones included, with the ranks' copies.
    max_operand_bytes: int = 8 * 1024 * 1024 * 1024
    #: Open sessions per principal.
    max_sessions_per_principal: int = 64
    #: Open event streams (sessions and subscriptions) per principal.
    max_streams_per_principal: int = _DEFAULT_STREAMS_PER_PRINCIPAL
    #: Sum of the byte budgets (DeliveryOptions.max_bytes) of all open streams: 8 GiB,
    #: two principals' budgets.
    max_buffered_bytes: int = 2 * _DEFAULT_STREAMS_PER_PRINCIPAL * DEFAULT_STREAM_BYTES
    #: The same for the streams of one principal (so one caller cannot take them all): 4 GiB,
    #: max_streams_per_principal streams of the default size.
    max_buffered_bytes_per_principal: int = _DEFAULT_STREAMS_PER_PRINCIPAL * DEFAULT_STREAM_BYTES
    #: Tensor elements in one Infer request (all inputs together).
    max_infer_elements: int = 1 << 31
    #: Infer calls waiting for one model's thread, beyond the running one.
    max_queued_infers: int = 64
    #: Seconds an Infer call may take (queueing included) before it fails with DEADLINE_EXCEEDED.
    infer_timeout: float = 600.0
    #: Most bytes the chunked tensors of one InferStream request may claim.
    max_request_bytes: int = 2 * 1024 * 1024 * 1024
    #: Bytes the estimated peaks of the calls running at once (Infer, Generate, harvest
    #: batches: activations, attention scores, KV caches, captures held) and what the
    #: models keep (weights, a vLLM engine's KV cache) may add up to (memory_budget.py).
    #: 0: 70% of the memory the process may use (the least of physical memory, the
    #: cgroup's memory.max and RLIMIT_AS).
    memory_budget_bytes: int = 0

    # --- request bounds (issue #9: bad input, wide requests, request-scoped hooks) ---
    #: Protobuf fields on the wire in one request message (each tag, and each element of a
    #: packed repeated field), counted on its raw bytes before it is parsed.
    max_request_fields: int = 1 << 19
    #: Values and map entries in one request message (every list item, dict entry, argument).
    max_request_values: int = 65536
    #: Request-scoped hooks (InferRequest.hooks) in one Infer call.
    max_request_hooks: int = 64
    #: Events the request-scoped hooks of one Infer call may produce; the event past it fails
    #: the call with RESOURCE_EXHAUSTED.
    max_events_per_call: int = 4096
    #: UTF-8 bytes of a name in a request: model, session, hook and slot names, tags, kwargs and map keys.
    max_name_length: int = 256
    #: UTF-8 bytes of a path in a request: module globs, rule targets and indices, selections,
    #: backward.output_path.
    max_path_length: int = 1024
    # -- InferStream (issue #9, auth): a stream that stops sending must not hold memory.
    #: Seconds an InferStream may go without a message from its client before it is
    #: ended (DEADLINE_EXCEEDED) and the chunks it sent are freed.
    infer_stream_idle_timeout: float = 30.0
    #: InferStream calls of one principal still uploading their request (RESOURCE_EXHAUSTED
    #: beyond); a call whose request has arrived no longer counts. As many as max_queued_infers,
    #: so that concurrent SDK calls with large tensors (sent over InferStream) are not refused
    #: before unary ones would be.
    max_infer_streams_per_principal: int = 64

    # --- tokenizing (issue #10: generation); Generate's prompts will meet the same limits ---
    #: Texts in one Tokenize call (TokenizeRequest.texts), counted on the request's bytes
    #: before it is parsed.
    max_tokenize_texts: int = 256
    #: Characters (code points) of all the texts of one Tokenize call together, checked
    #: before the tokenizer runs: this bounds the tokenizer's work.
    max_tokenize_chars: int = 1 << 20
    #: Tokens of the longest sequence of one Tokenize call (the padded length, special
    #: tokens included); with max_tokenize_texts it bounds the response.
    max_prompt_tokens: int = 8192
    #: Tokenize calls waiting for one model's tokenizer thread, beyond the running one.
    max_queued_tokenizes: int = 64

    # --- generation (issue #10). Prompts meet the tokenizing limits above: Generate's
    # prompts (or input_ids rows) count against max_tokenize_texts, their characters against
    # max_tokenize_chars, their tokens against max_prompt_tokens.
    #: GenerateRequest.max_new_tokens at most (INVALID_ARGUMENT beyond).
    max_new_tokens: int = 4096
    #: GenerateRequest.stream_interval at most (INVALID_ARGUMENT beyond): steps whose tokens
    #: one `steps` message carries (the tokens of a group wait for its last step).
    max_stream_interval: int = 64
    #: Stop strings (GenerateRequest.stop) in one call, each at most max_name_length bytes.
    max_stop_strings: int = 16
    #: GenerateRequest.top_logprobs and prompt_logprobs at most (INVALID_ARGUMENT beyond):
    #: the most likely tokens reported per position (OpenAI's own limit for top_logprobs).
    max_top_logprobs: int = 20
    #: An event's JSON size at most, for events the OpenAI-compatible front carries in its
    #: chunks (``hookwire.events``): a call whose hooks make a larger one ends with
    #: RESOURCE_EXHAUSTED (429), and hooks capturing whole tensors are refused there
    #: (gRPC carries those).
    max_http_event_bytes: int = 256 << 10
    #: Bytes of one request body of the OpenAI-compatible front (413 beyond, before more
    #: is read): prompts, messages and hooks as JSON, never bulk tensors (an operand too
    #: large for it is uploaded over gRPC, OperandService, and named). Also at most
    #: max_message_bytes.
    max_http_body_bytes: int = 8 << 20
    #: GenerateRequest.n at most (INVALID_ARGUMENT beyond): sequences per prompt, each
    #: with its KV cache; prompts times n also meet max_tokenize_texts.
    max_generate_n: int = 16
    #: Characters of all the stop strings of one Generate call together: building the
    #: matcher for them costs the vocabulary size times this, on the model's tokenizer thread.
    max_stop_chars: int = 128
    #: Generate calls running at once on one model (RESOURCE_EXHAUSTED beyond): each holds
    #: its KV cache between its steps.
    max_active_generations: int = 64
    #: Generate calls of one principal running at once, on all models (RESOURCE_EXHAUSTED
    #: beyond): a caller who stops reading keeps its calls, not everyone's.
    max_generations_per_principal: int = 16
    #: Seconds a Generate call may wait for its reader: its response stream taking no
    #: message, or one of its own event streams (a full BLOCK stream, its session's stream)
    #: taking nothing while the call's next step waits for room. Past it the call ends with
    #: DEADLINE_EXCEEDED and frees its slot and KV cache.
    generate_idle_timeout: float = 300.0

    # --- parameters (issue #14): GetParameters, on models whose config sets parameters_readable ---
    #: Names and globs in one GetParameters call (GetParametersRequest.names), counted on the
    #: request's bytes before it is parsed; each is a path (max_path_length).
    max_parameter_names: int = 256
    #: Bytes of parameter data (after the call's cast) one GetParameters call may return,
    #: checked before anything is sent: it bounds the time and bandwidth of one call, not the
    #: server's memory (parameters are copied and sent one at a time).
    max_parameter_bytes: int = 2 * 1024 * 1024 * 1024
    #: GetParameters calls of one principal running at once (RESOURCE_EXHAUSTED beyond): a
    #: call whose client stops reading holds the copy of the parameter it is sending.
    max_parameter_calls_per_principal: int = 8

    # --- harvest jobs (HarvestService, docs/harvest.md); HarvestConfig is built from these ---
    #: Harvest jobs one principal may have running (or starting) at once.
    harvest_max_jobs_per_principal: int = 2
    #: Bytes of shards one principal's harvest jobs may write (per server process); 0: no limit.
    harvest_max_bytes_per_principal: int = 0
    #: Seconds of a running harvest job's lease: its server renews it (a heartbeat in the
    #: job's state file) every third of it; a job not renewed for this long (its server was
    #: killed) is INTERRUPTED. At least 1; longer than the replicas' clock skew.
    harvest_lease_seconds: float = 30.0
    #: Seconds finished harvest jobs' state files are kept before they are pruned; 0: forever.
    harvest_retention_seconds: float = 7 * 86400.0
    #: Modules one harvest job stores (StartHarvestRequest.modules, once their globs are expanded).
    harvest_max_modules: int = 256
    #: Tokens of one harvest context (contexts.length), also at most the model's positions.
    harvest_max_context_length: int = 1 << 16
    #: Entries of a harvest's positions.only.
    harvest_max_positions: int = 4096
    #: Workers of one harvest (num_workers).
    harvest_max_workers: int = 1024
    #: Tokens of one harvest shard (output.shard_tokens).
    harvest_max_shard_tokens: int = 1 << 24
    #: Shards a shuffling harvest job holds in memory (output.shuffle.buffer_shards).
    harvest_max_buffer_shards: int = 64
    #: Ended harvest jobs kept in memory (older ones are still found in the state folder).
    harvest_max_ended_jobs: int = 256
    #: Shortest interval (ms) between the states WatchHarvest sends (WatchHarvestRequest.interval_ms).
    harvest_min_watch_ms: int = 50


def exceeded(
    what: str, count: object, limit: object, setting: str, hint: str = "",
    *, error: type[HookwireServerError] = ResourceExhausted,
) -> HookwireServerError:
    """The error for a limit passed, worded alike everywhere:
    "<what>: <count>, over the limit of <limit> (<setting>)[; <hint>]".

    ``what`` names the field or the thing counted ("hooks", "'alice' has 3 open streams");
    ``count`` says how much, with its unit ("65 request-scoped hooks", "257 or more names");
    ``limit`` may carry a unit too ("600 s"); ``setting`` is the Limits field that sets it;
    ``hint`` says what to do instead. ``error`` is ResourceExhausted (too much asked of the
    server) or InvalidArgument (a request that could never be served as it is)."""
    message = f"{what}: {count}, over the limit of {limit} ({setting})"
    return error(f"{message}; {hint}" if hint else message)


def below(what: str, value: object, minimum: object, setting: str) -> InvalidArgument:
    """The error for a value under a minimum: "<what>: <value>, below the minimum of <minimum> (<setting>)"."""
    return InvalidArgument(f"{what}: {value}, below the minimum of {minimum} ({setting})")


def check(count: int, limit: int, what: str, setting: str, hint: str = "") -> None:
    """ResourceExhausted (see ``exceeded``) when one more than ``count`` (the one being
    admitted) would go past ``limit``: "<what>: <count + 1> with this one, over the limit
    of <limit> (<setting>)". ``what`` says what there is ("'alice' has 64 open sessions")."""
    if count >= limit:
        raise exceeded(what, f"{count + 1} with this one", limit, setting, hint)
