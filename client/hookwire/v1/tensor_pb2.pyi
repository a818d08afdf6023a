from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT64: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT8: DType
DTYPE_INT16: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "chunk_id", "operand")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OPERAND_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    chunk_id: int
    operand: str
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., chunk_id: _Optional[int] = ..., operand: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("chunk_id", "offset", "data")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    offset: int
    data: bytes
    def __init__(self, chunk_id: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorSummary(_message.Message):
    __slots__ = ("dtype", "shape", "numel", "min", "max", "mean", "std", "l2_norm", "nan_count", "inf_count", "histogram", "histogram_min", "histogram_max")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    L2_NORM_FIELD_NUMBER: _ClassVar[int]
    NAN_COUNT_FIELD_NUMBER: _ClassVar[int]
    INF_COUNT_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_MIN_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_MAX_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    numel: int
    min: float
    max: float
    mean: float
    std: float
    l2_norm: float
    nan_count: int
    inf_count: int
    histogram: _containers.RepeatedScalarFieldContainer[int]
    histogram_min: float
    histogram_max: float
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., numel: _Optional[int] = ..., min: _Optional[float] = ..., max: _Optional[float] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., l2_norm: _Optional[float] = ..., nan_count: _Optional[int] = ..., inf_count: _Optional[int] = ..., histogram: _Optional[_Iterable[int]] = ..., histogram_min: _Optional[float] = ..., histogram_max: _Optional[float] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "list", "map", "float_value", "int_value", "bool_value", "string_value", "null_value", "summary", "opaque_type")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_TYPE_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    list: ValueList
    map: ValueMap
    float_value: float
    int_value: int
    bool_value: bool
    string_value: str
    null_value: _struct_pb2.NullValue
    summary: TensorSummary
    opaque_type: str
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., list: _Optional[_Union[ValueList, _Mapping]] = ..., map: _Optional[_Union[ValueMap, _Mapping]] = ..., float_value: _Optional[float] = ..., int_value: _Optional[int] = ..., bool_value: _Optional[bool] = ..., string_value: _Optional[str] = ..., null_value: _Optional[_Union[_struct_pb2.NullValue, str]] = ..., summary: _Optional[_Union[TensorSummary, _Mapping]] = ..., opaque_type: _Optional[str] = ...) -> None: ...

class ValueList(_message.Message):
    __slots__ = ("items", "is_list")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    IS_LIST_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    is_list: bool
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ..., is_list: _Optional[bool] = ...) -> None: ...

class ValueMap(_message.Message):
    __slots__ = ("entries", "keys")
    class EntriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.MessageMap[str, Value]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, entries: _Optional[_Mapping[str, Value]] = ..., keys: _Optional[_Iterable[str]] = ...) -> None: ...
