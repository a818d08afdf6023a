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

class OperandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERAND_KIND_UNSPECIFIED: _ClassVar[OperandKind]
    OPERAND_KIND_TENSOR: _ClassVar[OperandKind]
    OPERAND_KIND_SAE: _ClassVar[OperandKind]
OPERAND_KIND_UNSPECIFIED: OperandKind
OPERAND_KIND_TENSOR: OperandKind
OPERAND_KIND_SAE: OperandKind

class UploadOperandRequest(_message.Message):
    __slots__ = ("operand", "chunk")
    OPERAND_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    operand: OperandUpload
    chunk: _tensor_pb2.TensorChunk
    def __init__(self, operand: _Optional[_Union[OperandUpload, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class OperandUpload(_message.Message):
    __slots__ = ("name", "session_id", "ttl_seconds", "tensor", "sae")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SAE_FIELD_NUMBER: _ClassVar[int]
    name: str
    session_id: str
    ttl_seconds: int
    tensor: _tensor_pb2.Tensor
    sae: _rule_pb2.Sae
    def __init__(self, name: _Optional[str] = ..., session_id: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sae: _Optional[_Union[_rule_pb2.Sae, _Mapping]] = ...) -> None: ...

class NamedOperand(_message.Message):
    __slots__ = ("name", "kind", "tensor", "sae", "nbytes", "owner", "session_id", "expires", "published", "ended", "used_by")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SAE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    USED_BY_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: OperandKind
    tensor: _tensor_pb2.Tensor
    sae: _rule_pb2.Sae
    nbytes: int
    owner: str
    session_id: str
    expires: _timestamp_pb2.Timestamp
    published: bool
    ended: bool
    used_by: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[OperandKind, str]] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sae: _Optional[_Union[_rule_pb2.Sae, _Mapping]] = ..., nbytes: _Optional[int] = ..., owner: _Optional[str] = ..., session_id: _Optional[str] = ..., expires: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., published: _Optional[bool] = ..., ended: _Optional[bool] = ..., used_by: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteOperandRequest(_message.Message):
    __slots__ = ("name", "owner")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    name: str
    owner: str
    def __init__(self, name: _Optional[str] = ..., owner: _Optional[str] = ...) -> None: ...

class DeleteOperandResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class ListOperandsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListOperandsResponse(_message.Message):
    __slots__ = ("operands", "total_bytes", "max_bytes")
    OPERANDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    operands: _containers.RepeatedCompositeFieldContainer[NamedOperand]
    total_bytes: int
    max_bytes: int
    def __init__(self, operands: _Optional[_Iterable[_Union[NamedOperand, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class PublishOperandRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...
