from hookwire.v1 import hook_pb2 as _hook_pb2
from hookwire.v1 import hook_service_pb2 as _hook_service_pb2
from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_FAILED: _ClassVar[ModelState]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_EVAL: _ClassVar[Mode]
    MODE_TRAIN: _ClassVar[Mode]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_LOADING: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_FAILED: ModelState
MODE_UNSPECIFIED: Mode
MODE_EVAL: Mode
MODE_TRAIN: Mode

class InferStreamRequest(_message.Message):
    __slots__ = ("request", "chunk", "max_response_message_bytes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    request: InferRequest
    chunk: _tensor_pb2.TensorChunk
    max_response_message_bytes: int
    def __init__(self, request: _Optional[_Union[InferRequest, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., max_response_message_bytes: _Optional[int] = ...) -> None: ...

class InferStreamResponse(_message.Message):
    __slots__ = ("response", "chunk")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    response: InferResponse
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, response: _Optional[_Union[InferResponse, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "description", "training_allowed", "modules", "state", "state_message", "can_generate", "has_tokenizer", "batching", "parameters_readable", "device_map", "tokenizer_ids", "engine", "refused_features", "tap_points", "compiled")
    class DeviceMapEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TRAINING_ALLOWED_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CAN_GENERATE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_READABLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAP_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TAP_POINTS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    training_allowed: bool
    modules: _containers.RepeatedCompositeFieldContainer[ModuleInfo]
    state: ModelState
    state_message: str
    can_generate: bool
    has_tokenizer: bool
    batching: Batching
    parameters_readable: bool
    device_map: _containers.ScalarMap[str, str]
    tokenizer_ids: TokenizerIds
    engine: str
    refused_features: _containers.RepeatedCompositeFieldContainer[RefusedFeature]
    tap_points: _containers.RepeatedScalarFieldContainer[str]
    compiled: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., training_allowed: _Optional[bool] = ..., modules: _Optional[_Iterable[_Union[ModuleInfo, _Mapping]]] = ..., state: _Optional[_Union[ModelState, str]] = ..., state_message: _Optional[str] = ..., can_generate: _Optional[bool] = ..., has_tokenizer: _Optional[bool] = ..., batching: _Optional[_Union[Batching, _Mapping]] = ..., parameters_readable: _Optional[bool] = ..., device_map: _Optional[_Mapping[str, str]] = ..., tokenizer_ids: _Optional[_Union[TokenizerIds, _Mapping]] = ..., engine: _Optional[str] = ..., refused_features: _Optional[_Iterable[_Union[RefusedFeature, _Mapping]]] = ..., tap_points: _Optional[_Iterable[str]] = ..., compiled: _Optional[bool] = ...) -> None: ...

class RefusedFeature(_message.Message):
    __slots__ = ("feature", "reason")
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    feature: str
    reason: str
    def __init__(self, feature: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenizerIds(_message.Message):
    __slots__ = ("bos_token_id", "eos_token_id", "pad_token_id", "cls_token_id", "sep_token_id")
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CLS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SEP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    cls_token_id: int
    sep_token_id: int
    def __init__(self, bos_token_id: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., pad_token_id: _Optional[int] = ..., cls_token_id: _Optional[int] = ..., sep_token_id: _Optional[int] = ...) -> None: ...

class Batching(_message.Message):
    __slots__ = ("enabled", "max_batch_size", "max_batch_delay_ms", "batch_dim", "reducing_inputs", "pads_tokens")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_DELAY_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_DIM_FIELD_NUMBER: _ClassVar[int]
    REDUCING_INPUTS_FIELD_NUMBER: _ClassVar[int]
    PADS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_batch_size: int
    max_batch_delay_ms: float
    batch_dim: int
    reducing_inputs: _containers.RepeatedScalarFieldContainer[str]
    pads_tokens: bool
    def __init__(self, enabled: _Optional[bool] = ..., max_batch_size: _Optional[int] = ..., max_batch_delay_ms: _Optional[float] = ..., batch_dim: _Optional[int] = ..., reducing_inputs: _Optional[_Iterable[str]] = ..., pads_tokens: _Optional[bool] = ...) -> None: ...

class ModuleInfo(_message.Message):
    __slots__ = ("path", "type", "parameters")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ...) -> None: ...

class ParameterInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "requires_grad")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_GRAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _tensor_pb2.DType
    requires_grad: bool
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., requires_grad: _Optional[bool] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("model", "args", "kwargs", "mode", "session_id", "hooks", "backward", "seed", "tags")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Value, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    model: str
    args: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Value]
    kwargs: _containers.MessageMap[str, _tensor_pb2.Value]
    mode: Mode
    session_id: str
    hooks: _containers.RepeatedCompositeFieldContainer[_hook_pb2.HookSpec]
    backward: Backward
    seed: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., args: _Optional[_Iterable[_Union[_tensor_pb2.Value, _Mapping]]] = ..., kwargs: _Optional[_Mapping[str, _tensor_pb2.Value]] = ..., mode: _Optional[_Union[Mode, str]] = ..., session_id: _Optional[str] = ..., hooks: _Optional[_Iterable[_Union[_hook_pb2.HookSpec, _Mapping]]] = ..., backward: _Optional[_Union[Backward, _Mapping]] = ..., seed: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class Backward(_message.Message):
    __slots__ = ("output_path", "grad", "return_input_grads")
    OUTPUT_PATH_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    RETURN_INPUT_GRADS_FIELD_NUMBER: _ClassVar[int]
    output_path: str
    grad: _tensor_pb2.Tensor
    return_input_grads: bool
    def __init__(self, output_path: _Optional[str] = ..., grad: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., return_input_grads: _Optional[bool] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("request_id", "output", "events", "input_grads", "input_kwargs_grads", "hook_ids", "hook_modules")
    class InputKwargsGradsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Value, _Mapping]] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_GRADS_FIELD_NUMBER: _ClassVar[int]
    INPUT_KWARGS_GRADS_FIELD_NUMBER: _ClassVar[int]
    HOOK_IDS_FIELD_NUMBER: _ClassVar[int]
    HOOK_MODULES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: _tensor_pb2.Value
    events: _containers.RepeatedCompositeFieldContainer[_hook_pb2.InterceptEvent]
    input_grads: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.Value]
    input_kwargs_grads: _containers.MessageMap[str, _tensor_pb2.Value]
    hook_ids: _containers.RepeatedScalarFieldContainer[str]
    hook_modules: _containers.RepeatedCompositeFieldContainer[_hook_pb2.ModuleList]
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[_Union[_tensor_pb2.Value, _Mapping]] = ..., events: _Optional[_Iterable[_Union[_hook_pb2.InterceptEvent, _Mapping]]] = ..., input_grads: _Optional[_Iterable[_Union[_tensor_pb2.Value, _Mapping]]] = ..., input_kwargs_grads: _Optional[_Mapping[str, _tensor_pb2.Value]] = ..., hook_ids: _Optional[_Iterable[str]] = ..., hook_modules: _Optional[_Iterable[_Union[_hook_pb2.ModuleList, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "texts", "add_special_tokens", "padding_side")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDING_SIDE_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_special_tokens: bool
    padding_side: str
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., add_special_tokens: _Optional[bool] = ..., padding_side: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("input_ids", "attention_mask", "tokens")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _tensor_pb2.Tensor
    attention_mask: _tensor_pb2.Tensor
    tokens: _containers.RepeatedCompositeFieldContainer[TokenPieces]
    def __init__(self, input_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tokens: _Optional[_Iterable[_Union[TokenPieces, _Mapping]]] = ...) -> None: ...

class TokenPieces(_message.Message):
    __slots__ = ("pieces",)
    PIECES_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pieces: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompts", "input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop", "session_id", "hooks", "tags", "max_response_message_bytes", "stream_interval", "logprobs", "top_logprobs", "prompt_logprobs", "ignore_eos", "min_new_tokens", "n")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    input_ids: _tensor_pb2.Tensor
    attention_mask: _tensor_pb2.Tensor
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    session_id: str
    hooks: _containers.RepeatedCompositeFieldContainer[_hook_pb2.HookSpec]
    tags: _containers.RepeatedScalarFieldContainer[str]
    max_response_message_bytes: int
    stream_interval: int
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: int
    ignore_eos: bool
    min_new_tokens: int
    n: int
    def __init__(self, model: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., input_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., session_id: _Optional[str] = ..., hooks: _Optional[_Iterable[_Union[_hook_pb2.HookSpec, _Mapping]]] = ..., tags: _Optional[_Iterable[str]] = ..., max_response_message_bytes: _Optional[int] = ..., stream_interval: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., n: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("started", "tokens", "event", "chunk", "notice", "done", "batch", "steps")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    started: GenerateStarted
    tokens: GeneratedTokens
    event: _hook_pb2.InterceptEvent
    chunk: _tensor_pb2.TensorChunk
    notice: _hook_service_pb2.Notice
    done: GenerateDone
    batch: _hook_service_pb2.EventBatch
    steps: GeneratedSteps
    def __init__(self, started: _Optional[_Union[GenerateStarted, _Mapping]] = ..., tokens: _Optional[_Union[GeneratedTokens, _Mapping]] = ..., event: _Optional[_Union[_hook_pb2.InterceptEvent, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., notice: _Optional[_Union[_hook_service_pb2.Notice, _Mapping]] = ..., done: _Optional[_Union[GenerateDone, _Mapping]] = ..., batch: _Optional[_Union[_hook_service_pb2.EventBatch, _Mapping]] = ..., steps: _Optional[_Union[GeneratedSteps, _Mapping]] = ...) -> None: ...

class GeneratedSteps(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[GeneratedTokens]
    def __init__(self, steps: _Optional[_Iterable[_Union[GeneratedTokens, _Mapping]]] = ...) -> None: ...

class GenerateStarted(_message.Message):
    __slots__ = ("request_id", "input_ids", "attention_mask", "hook_ids", "seed", "do_sample", "hook_modules")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_MASK_FIELD_NUMBER: _ClassVar[int]
    HOOK_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    HOOK_MODULES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    input_ids: _tensor_pb2.Tensor
    attention_mask: _tensor_pb2.Tensor
    hook_ids: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    do_sample: bool
    hook_modules: _containers.RepeatedCompositeFieldContainer[_hook_pb2.ModuleList]
    def __init__(self, request_id: _Optional[str] = ..., input_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., attention_mask: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hook_ids: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ..., do_sample: _Optional[bool] = ..., hook_modules: _Optional[_Iterable[_Union[_hook_pb2.ModuleList, _Mapping]]] = ...) -> None: ...

class GeneratedTokens(_message.Message):
    __slots__ = ("step", "token_ids", "texts", "logprobs", "prompt_logprobs")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[SequenceLogprobs]
    def __init__(self, step: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., texts: _Optional[_Iterable[str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[SequenceLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceLogprobs(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class GenerateDone(_message.Message):
    __slots__ = ("sequences", "steps")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[GeneratedSequence]
    steps: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[GeneratedSequence, _Mapping]]] = ..., steps: _Optional[int] = ...) -> None: ...

class GeneratedSequence(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stopped_by")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stopped_by: RuleStop
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stopped_by: _Optional[_Union[RuleStop, _Mapping]] = ...) -> None: ...

class RuleStop(_message.Message):
    __slots__ = ("hook_id", "module", "step")
    HOOK_ID_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    hook_id: str
    module: str
    step: int
    def __init__(self, hook_id: _Optional[str] = ..., module: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class GetParametersRequest(_message.Message):
    __slots__ = ("model", "names", "dtype", "max_response_message_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_RESPONSE_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    names: _containers.RepeatedScalarFieldContainer[str]
    dtype: _tensor_pb2.DType
    max_response_message_bytes: int
    def __init__(self, model: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., max_response_message_bytes: _Optional[int] = ...) -> None: ...

class GetParametersResponse(_message.Message):
    __slots__ = ("parameter", "chunk")
    PARAMETER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    parameter: Parameter
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, parameter: _Optional[_Union[Parameter, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class Parameter(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
