from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
ON_ERROR_UNSPECIFIED: OnError
ON_ERROR_FAIL_CALL: OnError
ON_ERROR_DISABLE_HOOK: OnError
CAPTURE_STAGE_UNSPECIFIED: CaptureStage
CAPTURE_STAGE_AFTER_RULES: CaptureStage
CAPTURE_STAGE_BEFORE_RULES: CaptureStage

class Rule(_message.Message):
    __slots__ = ("target", "index", "scale", "add", "set", "zero", "clamp", "noise", "project_out", "patch", "save")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    CLAMP_FIELD_NUMBER: _ClassVar[int]
    NOISE_FIELD_NUMBER: _ClassVar[int]
    PROJECT_OUT_FIELD_NUMBER: _ClassVar[int]
    PATCH_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    target: str
    index: str
    scale: ScaleOp
    add: AddOp
    set: SetOp
    zero: ZeroOp
    clamp: ClampOp
    noise: NoiseOp
    project_out: ProjectOutOp
    patch: PatchOp
    save: SaveOp
    def __init__(self, target: _Optional[str] = ..., index: _Optional[str] = ..., scale: _Optional[_Union[ScaleOp, _Mapping]] = ..., add: _Optional[_Union[AddOp, _Mapping]] = ..., set: _Optional[_Union[SetOp, _Mapping]] = ..., zero: _Optional[_Union[ZeroOp, _Mapping]] = ..., clamp: _Optional[_Union[ClampOp, _Mapping]] = ..., noise: _Optional[_Union[NoiseOp, _Mapping]] = ..., project_out: _Optional[_Union[ProjectOutOp, _Mapping]] = ..., patch: _Optional[_Union[PatchOp, _Mapping]] = ..., save: _Optional[_Union[SaveOp, _Mapping]] = ...) -> None: ...

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
