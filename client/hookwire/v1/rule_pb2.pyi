from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TopKMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOP_K_MODE_UNSPECIFIED: _ClassVar[TopKMode]
    TOP_K_MODE_KEEP: _ClassVar[TopKMode]
    TOP_K_MODE_ZERO: _ClassVar[TopKMode]

class SaeEdit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAE_EDIT_UNSPECIFIED: _ClassVar[SaeEdit]
    SAE_EDIT_CLAMP: _ClassVar[SaeEdit]
    SAE_EDIT_SCALE: _ClassVar[SaeEdit]
    SAE_EDIT_ZERO: _ClassVar[SaeEdit]

class Comparison(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPARISON_UNSPECIFIED: _ClassVar[Comparison]
    COMPARISON_GT: _ClassVar[Comparison]
    COMPARISON_GE: _ClassVar[Comparison]
    COMPARISON_LT: _ClassVar[Comparison]
    COMPARISON_LE: _ClassVar[Comparison]
    COMPARISON_EQ: _ClassVar[Comparison]
    COMPARISON_NE: _ClassVar[Comparison]

class SignalReduce(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIGNAL_REDUCE_UNSPECIFIED: _ClassVar[SignalReduce]
    SIGNAL_REDUCE_NONE: _ClassVar[SignalReduce]
    SIGNAL_REDUCE_MAX: _ClassVar[SignalReduce]
    SIGNAL_REDUCE_LAST: _ClassVar[SignalReduce]

class OnError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ON_ERROR_UNSPECIFIED: _ClassVar[OnError]
    ON_ERROR_FAIL_CALL: _ClassVar[OnError]
    ON_ERROR_DISABLE_HOOK: _ClassVar[OnError]

class CaptureStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURE_STAGE_UNSPECIFIED: _ClassVar[CaptureStage]
    CAPTURE_STAGE_AFTER_RULES: _ClassVar[CaptureStage]
    CAPTURE_STAGE_BEFORE_RULES: _ClassVar[CaptureStage]
TOP_K_MODE_UNSPECIFIED: TopKMode
TOP_K_MODE_KEEP: TopKMode
TOP_K_MODE_ZERO: TopKMode
SAE_EDIT_UNSPECIFIED: SaeEdit
SAE_EDIT_CLAMP: SaeEdit
SAE_EDIT_SCALE: SaeEdit
SAE_EDIT_ZERO: SaeEdit
COMPARISON_UNSPECIFIED: Comparison
COMPARISON_GT: Comparison
COMPARISON_GE: Comparison
COMPARISON_LT: Comparison
COMPARISON_LE: Comparison
COMPARISON_EQ: Comparison
COMPARISON_NE: Comparison
SIGNAL_REDUCE_UNSPECIFIED: SignalReduce
SIGNAL_REDUCE_NONE: SignalReduce
SIGNAL_REDUCE_MAX: SignalReduce
SIGNAL_REDUCE_LAST: SignalReduce
ON_ERROR_UNSPECIFIED: OnError
ON_ERROR_FAIL_CALL: OnError
ON_ERROR_DISABLE_HOOK: OnError
CAPTURE_STAGE_UNSPECIFIED: CaptureStage
CAPTURE_STAGE_AFTER_RULES: CaptureStage
CAPTURE_STAGE_BEFORE_RULES: CaptureStage

class Rule(_message.Message):
    __slots__ = ("target", "index", "heads", "scale", "add", "set", "zero", "clamp", "noise", "project_out", "patch", "save", "affine", "loreft", "norm_add", "top_k", "conditional", "signal", "sae", "stop")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    CLAMP_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    PROJECT_OUT_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    AFFINE_FIELD_NUMBER: _ClassVar[int]
    LOREFT_FIELD_NUMBER: _ClassVar[int]
    NORM_ADD_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    SAE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    target: str
    index: str
    heads: _containers.RepeatedScalarFieldContainer[int]
    scale: ScaleOp
    add: AddOp
    set: SetOp
    zero: ZeroOp
    clamp: ClampOp
    noise: NoiseOp
    project_out: ProjectOutOp
    patch: PatchOp
    save: SaveOp
    affine: AffineOp
    loreft: LoreftOp
    norm_add: NormAddOp
    top_k: TopKOp
    conditional: ConditionalOp
    signal: SignalOp
    sae: SaeOp
    stop: StopOp
    def __init__(self, target: _Optional[str] = ..., index: _Optional[str] = ..., heads: _Optional[_Iterable[int]] = ..., scale: _Optional[_Union[ScaleOp, _Mapping]] = ..., add: _Optional[_Union[AddOp, _Mapping]] = ..., set: _Optional[_Union[SetOp, _Mapping]] = ..., zero: _Optional[_Union[ZeroOp, _Mapping]] = ..., clamp: _Optional[_Union[ClampOp, _Mapping]] = ..., noise: _Optional[_Union[NoiseOp, _Mapping]] = ..., project_out: _Optional[_Union[ProjectOutOp, _Mapping]] = ..., patch: _Optional[_Union[PatchOp, _Mapping]] = ..., save: _Optional[_Union[SaveOp, _Mapping]] = ..., affine: _Optional[_Union[AffineOp, _Mapping]] = ..., loreft: _Optional[_Union[LoreftOp, _Mapping]] = ..., norm_add: _Optional[_Union[NormAddOp, _Mapping]] = ..., top_k: _Optional[_Union[TopKOp, _Mapping]] = ..., conditional: _Optional[_Union[ConditionalOp, _Mapping]] = ..., signal: _Optional[_Union[SignalOp, _Mapping]] = ..., sae: _Optional[_Union[SaeOp, _Mapping]] = ..., stop: _Optional[_Union[StopOp, _Mapping]] = ...) -> None: ...

class StopOp(_message.Message):
    __slots__ = ("when",)
    WHEN_FIELD_NUMBER: _ClassVar[int]
    when: Condition
    def __init__(self, when: _Optional[_Union[Condition, _Mapping]] = ...) -> None: ...

class Operand(_message.Message):
    __slots__ = ("scalar", "tensor")
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    scalar: float
    tensor: _tensor_pb2.Tensor
    def __init__(self, scalar: _Optional[float] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ScaleOp(_message.Message):
    __slots__ = ("factor",)
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    factor: float
    def __init__(self, factor: _Optional[float] = ...) -> None: ...

class AddOp(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: Operand
    def __init__(self, value: _Optional[_Union[Operand, _Mapping]] = ...) -> None: ...

class SetOp(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: Operand
    def __init__(self, value: _Optional[_Union[Operand, _Mapping]] = ...) -> None: ...

class ZeroOp(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClampOp(_message.Message):
    __slots__ = ("min", "max")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    min: float
    max: float
    def __init__(self, min: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class NoiseOp(_message.Message):
    __slots__ = ("std", "seed")
    STD_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    std: float
    seed: int
    def __init__(self, std: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ProjectOutOp(_message.Message):
    __slots__ = ("direction",)
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    direction: _tensor_pb2.Tensor
    def __init__(self, direction: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PatchOp(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: str
    def __init__(self, slot: _Optional[str] = ...) -> None: ...

class SaveOp(_message.Message):
    __slots__ = ("slot",)
    SLOT_FIELD_NUMBER: _ClassVar[int]
    slot: str
    def __init__(self, slot: _Optional[str] = ...) -> None: ...

class AffineOp(_message.Message):
    __slots__ = ("weight", "bias")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    weight: _tensor_pb2.Tensor
    bias: _tensor_pb2.Tensor
    def __init__(self, weight: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LoreftOp(_message.Message):
    __slots__ = ("rotation", "weight", "bias")
    ROTATION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    rotation: _tensor_pb2.Tensor
    weight: _tensor_pb2.Tensor
    bias: _tensor_pb2.Tensor
    def __init__(self, rotation: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weight: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class NormAddOp(_message.Message):
    __slots__ = ("direction", "alpha")
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    direction: _tensor_pb2.Tensor
    alpha: float
    def __init__(self, direction: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., alpha: _Optional[float] = ...) -> None: ...

class TopKOp(_message.Message):
    __slots__ = ("directions", "sae", "k", "mode")
    DIRECTIONS_FIELD_NUMBER: _ClassVar[int]
    SAE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    directions: _tensor_pb2.Tensor
    sae: Sae
    k: int
    mode: TopKMode
    def __init__(self, directions: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sae: _Optional[_Union[Sae, _Mapping]] = ..., k: _Optional[int] = ..., mode: _Optional[_Union[TopKMode, str]] = ...) -> None: ...

class Sae(_message.Message):
    __slots__ = ("w_enc", "b_enc", "w_dec", "b_dec", "architecture", "threshold", "k", "normalize_activations", "apply_b_dec_to_input", "operand")
    W_ENC_FIELD_NUMBER: _ClassVar[int]
    B_ENC_FIELD_NUMBER: _ClassVar[int]
    W_DEC_FIELD_NUMBER: _ClassVar[int]
    B_DEC_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    APPLY_B_DEC_TO_INPUT_FIELD_NUMBER: _ClassVar[int]
    OPERAND_FIELD_NUMBER: _ClassVar[int]
    w_enc: _tensor_pb2.Tensor
    b_enc: _tensor_pb2.Tensor
    w_dec: _tensor_pb2.Tensor
    b_dec: _tensor_pb2.Tensor
    architecture: str
    threshold: _tensor_pb2.Tensor
    k: int
    normalize_activations: str
    apply_b_dec_to_input: bool
    operand: str
    def __init__(self, w_enc: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., b_enc: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., w_dec: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., b_dec: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., architecture: _Optional[str] = ..., threshold: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ..., normalize_activations: _Optional[str] = ..., apply_b_dec_to_input: _Optional[bool] = ..., operand: _Optional[str] = ...) -> None: ...

class SaeOp(_message.Message):
    __slots__ = ("sae", "features", "edit", "value")
    SAE_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    EDIT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    sae: Sae
    features: _containers.RepeatedScalarFieldContainer[int]
    edit: SaeEdit
    value: float
    def __init__(self, sae: _Optional[_Union[Sae, _Mapping]] = ..., features: _Optional[_Iterable[int]] = ..., edit: _Optional[_Union[SaeEdit, str]] = ..., value: _Optional[float] = ...) -> None: ...

class SaeFeatureSignal(_message.Message):
    __slots__ = ("sae", "feature")
    SAE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    sae: Sae
    feature: int
    def __init__(self, sae: _Optional[_Union[Sae, _Mapping]] = ..., feature: _Optional[int] = ...) -> None: ...

class Signal(_message.Message):
    __slots__ = ("norm", "projection", "probe", "stored", "sae_feature", "token_id")
    NORM_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    SAE_FEATURE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    norm: NormSignal
    projection: _tensor_pb2.Tensor
    probe: ProbeSignal
    stored: str
    sae_feature: SaeFeatureSignal
    token_id: TokenIdSignal
    def __init__(self, norm: _Optional[_Union[NormSignal, _Mapping]] = ..., projection: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., probe: _Optional[_Union[ProbeSignal, _Mapping]] = ..., stored: _Optional[str] = ..., sae_feature: _Optional[_Union[SaeFeatureSignal, _Mapping]] = ..., token_id: _Optional[_Union[TokenIdSignal, _Mapping]] = ...) -> None: ...

class TokenIdSignal(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NormSignal(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ProbeSignal(_message.Message):
    __slots__ = ("weight", "bias", "sigmoid")
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    SIGMOID_FIELD_NUMBER: _ClassVar[int]
    weight: _tensor_pb2.Tensor
    bias: float
    sigmoid: bool
    def __init__(self, weight: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., bias: _Optional[float] = ..., sigmoid: _Optional[bool] = ...) -> None: ...

class Condition(_message.Message):
    __slots__ = ("signal", "cmp", "threshold")
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    CMP_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    signal: Signal
    cmp: Comparison
    threshold: float
    def __init__(self, signal: _Optional[_Union[Signal, _Mapping]] = ..., cmp: _Optional[_Union[Comparison, str]] = ..., threshold: _Optional[float] = ...) -> None: ...

class ConditionalOp(_message.Message):
    __slots__ = ("when", "then")
    WHEN_FIELD_NUMBER: _ClassVar[int]
    THEN_FIELD_NUMBER: _ClassVar[int]
    when: Condition
    then: Rule
    def __init__(self, when: _Optional[_Union[Condition, _Mapping]] = ..., then: _Optional[_Union[Rule, _Mapping]] = ...) -> None: ...

class SignalOp(_message.Message):
    __slots__ = ("name", "signal", "reduce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    REDUCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    signal: Signal
    reduce: SignalReduce
    def __init__(self, name: _Optional[str] = ..., signal: _Optional[_Union[Signal, _Mapping]] = ..., reduce: _Optional[_Union[SignalReduce, str]] = ...) -> None: ...
