from hookwire.v1 import hook_pb2 as _hook_pb2
from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeliveryPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_POLICY_UNSPECIFIED: _ClassVar[DeliveryPolicy]
    DELIVERY_POLICY_BLOCK: _ClassVar[DeliveryPolicy]
    DELIVERY_POLICY_DROP_OLDEST: _ClassVar[DeliveryPolicy]
    DELIVERY_POLICY_DROP_NEWEST: _ClassVar[DeliveryPolicy]

class NoticeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTICE_KIND_UNSPECIFIED: _ClassVar[NoticeKind]
    NOTICE_KIND_HOOK_REMOVED: _ClassVar[NoticeKind]
    NOTICE_KIND_CAPTURE_FAILED: _ClassVar[NoticeKind]
    NOTICE_KIND_HOOK_DISABLED: _ClassVar[NoticeKind]
    NOTICE_KIND_DROPS_STARTED: _ClassVar[NoticeKind]
    NOTICE_KIND_DROPS_ENDED: _ClassVar[NoticeKind]
    NOTICE_KIND_HOOK_RESTORED: _ClassVar[NoticeKind]
DELIVERY_POLICY_UNSPECIFIED: DeliveryPolicy
DELIVERY_POLICY_BLOCK: DeliveryPolicy
DELIVERY_POLICY_DROP_OLDEST: DeliveryPolicy
DELIVERY_POLICY_DROP_NEWEST: DeliveryPolicy
NOTICE_KIND_UNSPECIFIED: NoticeKind
NOTICE_KIND_HOOK_REMOVED: NoticeKind
NOTICE_KIND_CAPTURE_FAILED: NoticeKind
NOTICE_KIND_HOOK_DISABLED: NoticeKind
NOTICE_KIND_DROPS_STARTED: NoticeKind
NOTICE_KIND_DROPS_ENDED: NoticeKind
NOTICE_KIND_HOOK_RESTORED: NoticeKind

class GetSlotRequest(_message.Message):
    __slots__ = ("session_id", "name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _tensor_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    tensor: _tensor_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., tensor: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ListSlotsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSlotsResponse(_message.Message):
    __slots__ = ("slots", "total_bytes", "max_bytes")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    total_bytes: int
    max_bytes: int
    def __init__(self, slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class DeliveryOptions(_message.Message):
    __slots__ = ("policy", "max_events", "max_bytes", "max_message_bytes")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    policy: DeliveryPolicy
    max_events: int
    max_bytes: int
    max_message_bytes: int
    def __init__(self, policy: _Optional[_Union[DeliveryPolicy, str]] = ..., max_events: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("delivery",)
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    delivery: DeliveryOptions
    def __init__(self, delivery: _Optional[_Union[DeliveryOptions, _Mapping]] = ...) -> None: ...

class SessionMessage(_message.Message):
    __slots__ = ("opened", "event", "notice", "subscribed", "batch", "chunk", "call_ended")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CALL_ENDED_FIELD_NUMBER: _ClassVar[int]
    opened: SessionOpened
    event: _hook_pb2.InterceptEvent
    notice: Notice
    subscribed: Subscribed
    batch: EventBatch
    chunk: _tensor_pb2.TensorChunk
    call_ended: CallEnded
    def __init__(self, opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., event: _Optional[_Union[_hook_pb2.InterceptEvent, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ..., subscribed: _Optional[_Union[Subscribed, _Mapping]] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., call_ended: _Optional[_Union[CallEnded, _Mapping]] = ...) -> None: ...

class CallEnded(_message.Message):
    __slots__ = ("request_id", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_hook_pb2.InterceptEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[_hook_pb2.InterceptEvent, _Mapping]]] = ...) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Subscribed(_message.Message):
    __slots__ = ("hook_ids",)
    HOOK_IDS_FIELD_NUMBER: _ClassVar[int]
    hook_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, hook_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("kind", "hook_id", "message", "dropped")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOOK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    kind: NoticeKind
    hook_id: str
    message: str
    dropped: int
    def __init__(self, kind: _Optional[_Union[NoticeKind, str]] = ..., hook_id: _Optional[str] = ..., message: _Optional[str] = ..., dropped: _Optional[int] = ...) -> None: ...

class RegisterHookRequest(_message.Message):
    __slots__ = ("session_id", "spec")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: _hook_pb2.HookSpec
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[_hook_pb2.HookSpec, _Mapping]] = ...) -> None: ...

class DeregisterHookRequest(_message.Message):
    __slots__ = ("hook_id",)
    HOOK_ID_FIELD_NUMBER: _ClassVar[int]
    hook_id: str
    def __init__(self, hook_id: _Optional[str] = ...) -> None: ...

class DeregisterHookResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ListHooksRequest(_message.Message):
    __slots__ = ("model", "session_id", "include_operand_data")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_OPERAND_DATA_FIELD_NUMBER: _ClassVar[int]
    model: str
    session_id: str
    include_operand_data: bool
    def __init__(self, model: _Optional[str] = ..., session_id: _Optional[str] = ..., include_operand_data: _Optional[bool] = ...) -> None: ...

class ListHooksResponse(_message.Message):
    __slots__ = ("hooks",)
    HOOKS_FIELD_NUMBER: _ClassVar[int]
    hooks: _containers.RepeatedCompositeFieldContainer[_hook_pb2.Hook]
    def __init__(self, hooks: _Optional[_Iterable[_Union[_hook_pb2.Hook, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("hook_ids", "delivery")
    HOOK_IDS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    hook_ids: _containers.RepeatedScalarFieldContainer[str]
    delivery: DeliveryOptions
    def __init__(self, hook_ids: _Optional[_Iterable[str]] = ..., delivery: _Optional[_Union[DeliveryOptions, _Mapping]] = ...) -> None: ...
