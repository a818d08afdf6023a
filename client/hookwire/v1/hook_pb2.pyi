import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from hookwire.v1 import rule_pb2 as _rule_pb2
from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Part(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PART_UNSPECIFIED: _ClassVar[Part]
    PART_ARGS: _ClassVar[Part]
    PART_KWARGS: _ClassVar[Part]
    PART_OUTPUT: _ClassVar[Part]
    PART_GRAD_INPUT: _ClassVar[Part]
    PART_GRAD_OUTPUT: _ClassVar[Part]

class Scope(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCOPE_UNSPECIFIED: _ClassVar[Scope]
    SCOPE_SESSION: _ClassVar[Scope]
    SCOPE_ALL: _ClassVar[Scope]
    SCOPE_TAGGED: _ClassVar[Scope]

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_FORWARD_PRE: _ClassVar[Phase]
    PHASE_FORWARD: _ClassVar[Phase]
    PHASE_BACKWARD_PRE: _ClassVar[Phase]
    PHASE_BACKWARD: _ClassVar[Phase]
PART_UNSPECIFIED: Part
PART_ARGS: Part
PART_KWARGS: Part
PART_OUTPUT: Part
PART_GRAD_INPUT: Part
PART_GRAD_OUTPUT: Part
SCOPE_UNSPECIFIED: Scope
SCOPE_SESSION: Scope
SCOPE_ALL: Scope
SCOPE_TAGGED: Scope
PHASE_UNSPECIFIED: Phase
PHASE_FORWARD_PRE: Phase
PHASE_FORWARD: Phase
PHASE_BACKWARD_PRE: Phase
PHASE_BACKWARD: Phase

class HookAction(_message.Message):
    __slots__ = ("capture", "rules", "capture_stage", "select", "cast", "summarize", "readout", "heads")
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_STAGE_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    CAST_FIELD_NUMBER: _ClassVar[int]
    SUMMARIZE_FIELD_NUMBER: _ClassVar[int]
    READOUT_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    capture: _containers.RepeatedScalarFieldContainer[Part]
    rules: _containers.RepeatedCompositeFieldContainer[_rule_pb2.Rule]
    capture_stage: _rule_pb2.CaptureStage
    select: str
    cast: _tensor_pb2.DType
    summarize: SummaryOptions
    readout: Readout
    heads: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, capture: _Optional[_Iterable[_Union[Part, str]]] = ..., rules: _Optional[_Iterable[_Union[_rule_pb2.Rule, _Mapping]]] = ..., capture_stage: _Optional[_Union[_rule_pb2.CaptureStage, str]] = ..., select: _Optional[str] = ..., cast: _Optional[_Union[_tensor_pb2.DType, str]] = ..., summarize: _Optional[_Union[SummaryOptions, _Mapping]] = ..., readout: _Optional[_Union[Readout, _Mapping]] = ..., heads: _Optional[_Iterable[int]] = ...) -> None: ...

class Readout(_message.Message):
    __slots__ = ("probe", "logit_lens", "sae_top_k", "compact")
    PROBE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_LENS_FIELD_NUMBER: _ClassVar[int]
    SAE_TOP_K_FIELD_NUMBER: _ClassVar[int]
    COMPACT_FIELD_NUMBER: _ClassVar[int]
    probe: ProbeReadout
    logit_lens: LogitLensReadout
    sae_top_k: SaeTopKReadout
    compact: bool
    def __init__(self, probe: _Optional[_Union[ProbeReadout, _Mapping]] = ..., logit_lens: _Optional[_Union[LogitLensReadout, _Mapping]] = ..., sae_top_k: _Optional[_Union[SaeTopKReadout, _Mapping]] = ..., compact: _Optional[bool] = ...) -> None: ...

class ProbeReadout(_message.Message):
    __slots__ = ("weight", "bias", "sigmoid")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    SIGMOID_FIELD_NUMBER: _ClassVar[int]
    weight: _tensor_pb2.Tensor
    bias: _tensor_pb2.Tensor
    sigmoid: bool
    def __init__(self, weight: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sigmoid: _Optional[bool] = ...) -> None: ...

class LogitLensReadout(_message.Message):
    __slots__ = ("k", "norm", "unembedding")
    K_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    UNEMBEDDING_FIELD_NUMBER: _ClassVar[int]
    k: int
    norm: str
    unembedding: str
    def __init__(self, k: _Optional[int] = ..., norm: _Optional[str] = ..., unembedding: _Optional[str] = ...) -> None: ...

class SaeTopKReadout(_message.Message):
    __slots__ = ("sae", "k")
    SAE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    sae: _rule_pb2.Sae
    k: int
    def __init__(self, sae: _Optional[_Union[_rule_pb2.Sae, _Mapping]] = ..., k: _Optional[int] = ...) -> None: ...

class SummaryOptions(_message.Message):
    __slots__ = ("histogram_bins",)
    HISTOGRAM_BINS_FIELD_NUMBER: _ClassVar[int]
    histogram_bins: int
    def __init__(self, histogram_bins: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("every_n", "probability", "seed", "max_events")
    EVERY_N_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    every_n: int
    probability: float
    seed: int
    max_events: int
    def __init__(self, every_n: _Optional[int] = ..., probability: _Optional[float] = ..., seed: _Optional[int] = ..., max_events: _Optional[int] = ...) -> None: ...

class PreHookOptions(_message.Message):
    __slots__ = ("with_kwargs", "prepend")
    WITH_KWARGS_FIELD_NUMBER: _ClassVar[int]
    PREPEND_FIELD_NUMBER: _ClassVar[int]
    with_kwargs: bool
    prepend: bool
    def __init__(self, with_kwargs: _Optional[bool] = ..., prepend: _Optional[bool] = ...) -> None: ...

class PostHookOptions(_message.Message):
    __slots__ = ("with_kwargs", "prepend", "always_call")
    WITH_KWARGS_FIELD_NUMBER: _ClassVar[int]
    PREPEND_FIELD_NUMBER: _ClassVar[int]
    ALWAYS_CALL_FIELD_NUMBER: _ClassVar[int]
    with_kwargs: bool
    prepend: bool
    always_call: bool
    def __init__(self, with_kwargs: _Optional[bool] = ..., prepend: _Optional[bool] = ..., always_call: _Optional[bool] = ...) -> None: ...

class BackwardHookOptions(_message.Message):
    __slots__ = ("prepend",)
    PREPEND_FIELD_NUMBER: _ClassVar[int]
    prepend: bool
    def __init__(self, prepend: _Optional[bool] = ...) -> None: ...

class HookSpec(_message.Message):
    __slots__ = ("model", "module", "prehook", "posthook", "backward_prehook", "backward_hook", "prehook_kwargs", "posthook_kwargs", "backward_prehook_kwargs", "backward_hook_kwargs", "train_update", "eval_update", "scope", "tags", "on_error", "sampling", "ttl_seconds", "steps")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    PREHOOK_FIELD_NUMBER: _ClassVar[int]
    POSTHOOK_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PREHOOK_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_HOOK_FIELD_NUMBER: _ClassVar[int]
    PREHOOK_KWARGS_FIELD_NUMBER: _ClassVar[int]
    POSTHOOK_KWARGS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_PREHOOK_KWARGS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_HOOK_KWARGS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UPDATE_FIELD_NUMBER: _ClassVar[int]
    EVAL_UPDATE_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    model: str
    module: str
    prehook: HookAction
    posthook: HookAction
    backward_prehook: HookAction
    backward_hook: HookAction
    prehook_kwargs: PreHookOptions
    posthook_kwargs: PostHookOptions
    backward_prehook_kwargs: BackwardHookOptions
    backward_hook_kwargs: BackwardHookOptions
    train_update: bool
    eval_update: bool
    scope: Scope
    tags: _containers.RepeatedScalarFieldContainer[str]
    on_error: _rule_pb2.OnError
    sampling: Sampling
    ttl_seconds: int
    steps: StepRange
    def __init__(self, model: _Optional[str] = ..., module: _Optional[str] = ..., prehook: _Optional[_Union[HookAction, _Mapping]] = ..., posthook: _Optional[_Union[HookAction, _Mapping]] = ..., backward_prehook: _Optional[_Union[HookAction, _Mapping]] = ..., backward_hook: _Optional[_Union[HookAction, _Mapping]] = ..., prehook_kwargs: _Optional[_Union[PreHookOptions, _Mapping]] = ..., posthook_kwargs: _Optional[_Union[PostHookOptions, _Mapping]] = ..., backward_prehook_kwargs: _Optional[_Union[BackwardHookOptions, _Mapping]] = ..., backward_hook_kwargs: _Optional[_Union[BackwardHookOptions, _Mapping]] = ..., train_update: _Optional[bool] = ..., eval_update: _Optional[bool] = ..., scope: _Optional[_Union[Scope, str]] = ..., tags: _Optional[_Iterable[str]] = ..., on_error: _Optional[_Union[_rule_pb2.OnError, str]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., ttl_seconds: _Optional[int] = ..., steps: _Optional[_Union[StepRange, _Mapping]] = ...) -> None: ...

class StepRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class Hook(_message.Message):
    __slots__ = ("hook_id", "spec", "modules", "session_id", "disabled", "disabled_reason", "fire_count", "events_sent", "events_dropped", "errors", "last_fired", "expires")
    HOOK_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIRED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_FIELD_NUMBER: _ClassVar[int]
    hook_id: str
    spec: HookSpec
    modules: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    disabled: bool
    disabled_reason: str
    fire_count: int
    events_sent: int
    events_dropped: int
    errors: int
    last_fired: _timestamp_pb2.Timestamp
    expires: _timestamp_pb2.Timestamp
    def __init__(self, hook_id: _Optional[str] = ..., spec: _Optional[_Union[HookSpec, _Mapping]] = ..., modules: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., disabled: _Optional[bool] = ..., disabled_reason: _Optional[str] = ..., fire_count: _Optional[int] = ..., events_sent: _Optional[int] = ..., events_dropped: _Optional[int] = ..., errors: _Optional[int] = ..., last_fired: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class InterceptEvent(_message.Message):
    __slots__ = ("hook_id", "model", "module", "phase", "seq", "call_index", "request_id", "training", "time", "args", "kwargs", "output", "grad_input", "grad_output", "dropped", "step", "devices", "request_hook_index", "module_indices")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Value, _Mapping]] = ...) -> None: ...
    HOOK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CALL_INDEX_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_INPUT_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HOOK_INDEX_FIELD_NUMBER: _ClassVar[int]
    MODULE_INDICES_FIELD_NUMBER: _ClassVar[int]
    hook_id: str
    model: str
    module: str
    phase: Phase
    seq: int
    call_index: int
    request_id: str
    training: bool
    time: _timestamp_pb2.Timestamp
    args: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Value]
    kwargs: _containers.MessageMap[str, _tensor_pb2.Value]
    output: _tensor_pb2.Value
    grad_input: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Value]
    grad_output: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Value]
    dropped: int
    step: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    request_hook_index: int
    module_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hook_id: _Optional[str] = ..., model: _Optional[str] = ..., module: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., seq: _Optional[int] = ..., call_index: _Optional[int] = ..., request_id: _Optional[str] = ..., training: _Optional[bool] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., args: _Optional[_Iterable[_Union[_tensor_pb2.Value, _Mapping]]] = ..., kwargs: _Optional[_Mapping[str, _tensor_pb2.Value]] = ..., output: _Optional[_Union[_tensor_pb2.Value, _Mapping]] = ..., grad_input: _Optional[_Iterable[_Union[_tensor_pb2.Value, _Mapping]]] = ..., grad_output: _Optional[_Iterable[_Union[_tensor_pb2.Value, _Mapping]]] = ..., dropped: _Optional[int] = ..., step: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., request_hook_index: _Optional[int] = ..., module_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class ModuleList(_message.Message):
    __slots__ = ("modules",)
    MODULES_FIELD_NUMBER: _ClassVar[int]
    modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, modules: _Optional[_Iterable[str]] = ...) -> None: ...
