import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from hookwire.v1 import hook_pb2 as _hook_pb2
from hookwire.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TextFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TEXT_FORMAT_UNSPECIFIED: _ClassVar[TextFormat]
    TEXT_FORMAT_JSONL: _ClassVar[TextFormat]
    TEXT_FORMAT_PARQUET: _ClassVar[TextFormat]
    TEXT_FORMAT_TEXT: _ClassVar[TextFormat]
    TEXT_FORMAT_HF_DATASET: _ClassVar[TextFormat]

class Packing(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PACKING_UNSPECIFIED: _ClassVar[Packing]
    PACKING_TRUNCATE: _ClassVar[Packing]
    PACKING_PACK: _ClassVar[Packing]

class HarvestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HARVEST_STATE_UNSPECIFIED: _ClassVar[HarvestState]
    HARVEST_STATE_PENDING: _ClassVar[HarvestState]
    HARVEST_STATE_RUNNING: _ClassVar[HarvestState]
    HARVEST_STATE_SUCCEEDED: _ClassVar[HarvestState]
    HARVEST_STATE_FAILED: _ClassVar[HarvestState]
    HARVEST_STATE_CANCELLED: _ClassVar[HarvestState]
    HARVEST_STATE_INTERRUPTED: _ClassVar[HarvestState]
TEXT_FORMAT_UNSPECIFIED: TextFormat
TEXT_FORMAT_JSONL: TextFormat
TEXT_FORMAT_PARQUET: TextFormat
TEXT_FORMAT_TEXT: TextFormat
TEXT_FORMAT_HF_DATASET: TextFormat
PACKING_UNSPECIFIED: Packing
PACKING_TRUNCATE: Packing
PACKING_PACK: Packing
HARVEST_STATE_UNSPECIFIED: HarvestState
HARVEST_STATE_PENDING: HarvestState
HARVEST_STATE_RUNNING: HarvestState
HARVEST_STATE_SUCCEEDED: HarvestState
HARVEST_STATE_FAILED: HarvestState
HARVEST_STATE_CANCELLED: HarvestState
HARVEST_STATE_INTERRUPTED: HarvestState

class StartHarvestRequest(_message.Message):
    __slots__ = ("model", "modules", "part", "select", "dtype", "rules", "source", "contexts", "positions", "max_tokens", "output", "worker_index", "num_workers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SELECT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTEXTS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    modules: _containers.RepeatedScalarFieldContainer[str]
    part: _hook_pb2.Part
    select: str
    dtype: _tensor_pb2.DType
    rules: _containers.RepeatedCompositeFieldContainer[_hook_pb2.HookSpec]
    source: HarvestSource
    contexts: HarvestContexts
    positions: HarvestPositions
    max_tokens: int
    output: HarvestOutput
    worker_index: int
    num_workers: int
    def __init__(self, model: _Optional[str] = ..., modules: _Optional[_Iterable[str]] = ..., part: _Optional[_Union[_hook_pb2.Part, str]] = ..., select: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ..., rules: _Optional[_Iterable[_Union[_hook_pb2.HookSpec, _Mapping]]] = ..., source: _Optional[_Union[HarvestSource, _Mapping]] = ..., contexts: _Optional[_Union[HarvestContexts, _Mapping]] = ..., positions: _Optional[_Union[HarvestPositions, _Mapping]] = ..., max_tokens: _Optional[int] = ..., output: _Optional[_Union[HarvestOutput, _Mapping]] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ...) -> None: ...

class HarvestSource(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: TextSource
    tokens: TokenSource
    def __init__(self, text: _Optional[_Union[TextSource, _Mapping]] = ..., tokens: _Optional[_Union[TokenSource, _Mapping]] = ...) -> None: ...

class TextSource(_message.Message):
    __slots__ = ("path", "format", "text_field", "split")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    path: str
    format: TextFormat
    text_field: str
    split: str
    def __init__(self, path: _Optional[str] = ..., format: _Optional[_Union[TextFormat, str]] = ..., text_field: _Optional[str] = ..., split: _Optional[str] = ...) -> None: ...

class TokenSource(_message.Message):
    __slots__ = ("input_ids", "pad_token_id")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    input_ids: _tensor_pb2.Tensor
    pad_token_id: int
    def __init__(self, input_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., pad_token_id: _Optional[int] = ...) -> None: ...

class HarvestContexts(_message.Message):
    __slots__ = ("length", "batch_size", "packing", "bos")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    BOS_FIELD_NUMBER: _ClassVar[int]
    length: int
    batch_size: int
    packing: Packing
    bos: bool
    def __init__(self, length: _Optional[int] = ..., batch_size: _Optional[int] = ..., packing: _Optional[_Union[Packing, str]] = ..., bos: _Optional[bool] = ...) -> None: ...

class HarvestPositions(_message.Message):
    __slots__ = ("skip_first", "only")
    SKIP_FIRST_FIELD_NUMBER: _ClassVar[int]
    ONLY_FIELD_NUMBER: _ClassVar[int]
    skip_first: int
    only: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, skip_first: _Optional[int] = ..., only: _Optional[_Iterable[int]] = ...) -> None: ...

class HarvestOutput(_message.Message):
    __slots__ = ("path", "shard_tokens", "overwrite", "shuffle")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    path: str
    shard_tokens: int
    overwrite: bool
    shuffle: HarvestShuffle
    def __init__(self, path: _Optional[str] = ..., shard_tokens: _Optional[int] = ..., overwrite: _Optional[bool] = ..., shuffle: _Optional[_Union[HarvestShuffle, _Mapping]] = ...) -> None: ...

class HarvestShuffle(_message.Message):
    __slots__ = ("enabled", "buffer_shards", "seed")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    buffer_shards: int
    seed: int
    def __init__(self, enabled: _Optional[bool] = ..., buffer_shards: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class HarvestJob(_message.Message):
    __slots__ = ("job_id", "state", "owner", "model", "output", "tokens_done", "tokens_total", "tokens_per_second", "eta_seconds", "shards_written", "bytes_written", "batches_done", "batches_total", "resumed_tokens", "error", "created", "started", "ended", "worker_index", "num_workers", "modules", "committed", "resume_command")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ETA_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DONE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    RESUME_COMMAND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: HarvestState
    owner: str
    model: str
    output: str
    tokens_done: int
    tokens_total: int
    tokens_per_second: float
    eta_seconds: float
    shards_written: int
    bytes_written: int
    batches_done: int
    batches_total: int
    resumed_tokens: int
    error: str
    created: _timestamp_pb2.Timestamp
    started: _timestamp_pb2.Timestamp
    ended: _timestamp_pb2.Timestamp
    worker_index: int
    num_workers: int
    modules: _containers.RepeatedScalarFieldContainer[str]
    committed: bool
    resume_command: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[HarvestState, str]] = ..., owner: _Optional[str] = ..., model: _Optional[str] = ..., output: _Optional[str] = ..., tokens_done: _Optional[int] = ..., tokens_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., eta_seconds: _Optional[float] = ..., shards_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., batches_done: _Optional[int] = ..., batches_total: _Optional[int] = ..., resumed_tokens: _Optional[int] = ..., error: _Optional[str] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., modules: _Optional[_Iterable[str]] = ..., committed: _Optional[bool] = ..., resume_command: _Optional[str] = ...) -> None: ...

class GetHarvestRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class WatchHarvestRequest(_message.Message):
    __slots__ = ("job_id", "interval_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    interval_ms: int
    def __init__(self, job_id: _Optional[str] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class CancelHarvestRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListHarvestsRequest(_message.Message):
    __slots__ = ("model", "active_only")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ONLY_FIELD_NUMBER: _ClassVar[int]
    model: str
    active_only: bool
    def __init__(self, model: _Optional[str] = ..., active_only: _Optional[bool] = ...) -> None: ...

class ListHarvestsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[HarvestJob]
    def __init__(self, jobs: _Optional[_Iterable[_Union[HarvestJob, _Mapping]]] = ...) -> None: ...
