"""hookwire: hook PyTorch models on a remote server, from Python.

    async with hookwire.connect("127.0.0.1:50051") as client:
        model = client.model("tiny-transformer")
        async with model.hook("encoder.layers.*", posthook=hookwire.capture("output")) as hook:
            out = await model(input_ids, attention_mask=mask)
            async for event in hook.events():
                ...
        generation = await client.model("tiny-lm").generate("Once upon a time", 16)

    with hookwire.connect_sync("127.0.0.1:50051") as client:   # blocking: scripts, notebooks
        out, cache = client.model("tiny-transformer").run_with_cache(input_ids, modules="encoder.layers.*")

This package only re-exports; the code lives in private modules.
"""

# First, before anything imports grpc: the hookwire command silences gRPC's C-core log
# (see _cli_env). A program that imports hookwire is left alone.
from ._cli_env import quiet_grpc_logging as _quiet_grpc_logging

_quiet_grpc_logging()

from ._client import (
    DEFAULT_TARGET,
    Client,
    ConnectOptions,
    HookHandle,
    PendingHook,
    RemoteModel,
    Session,
    Subscription,
    connect,
)
from ._cache import ActivationCache
from .wire.codec import CodecError
from ._fleet import FleetClient, FleetHookHandle, FleetModel, FleetNotice, connect_fleet
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    HookwireError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from . import rules
from .dataset import ActivationDataset
from ._harvest import HarvestFailed, HarvestInterrupted, HarvestJob, HarvestProgress
from ._generation import GenerateStream
from ._operands import OperandInfo
from ._sync import (
    SyncClient,
    SyncGenerateStream,
    SyncHarvestJob,
    SyncHookHandle,
    SyncIterator,
    SyncModel,
    SyncSubscription,
    connect_sync,
)
from ._specs import Backward, HookAction, HookSpec, Sampling, StepRange, capture, edit
from ._types import (
    GeneratedTokens,
    GenerateResult,
    HookInfo,
    InferResult,
    InterceptEvent,
    TokenLogprob,
    BatchingInfo,
    ModelInfo,
    ModuleInfo,
    Notice,
    ParameterInfo,
    SlotInfo,
    TensorSummary,
    Tokenized,
)

from .wire import __version__

__all__ = [
    "ActivationCache",
    "ActivationDataset",
    "AlreadyExistsError",
    "HarvestFailed",
    "HarvestInterrupted",
    "HarvestJob",
    "HarvestProgress",
    "DEFAULT_TARGET",
    "Backward",
    "BatchingInfo",
    "CancelledError",
    "Client",
    "CodecError",
    "ConnectOptions",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "FleetClient",
    "FleetHookHandle",
    "FleetModel",
    "FleetNotice",
    "GenerateResult",
    "GenerateStream",
    "GeneratedTokens",
    "HookAction",
    "HookHandle",
    "HookInfo",
    "HookSpec",
    "HookwireError",
    "InferResult",
    "InterceptEvent",
    "InternalError",
    "InvalidArgumentError",
    "ModelInfo",
    "ModuleInfo",
    "NotFoundError",
    "Notice",
    "OperandInfo",
    "ParameterInfo",
    "PendingHook",
    "PermissionDeniedError",
    "RemoteModel",
    "ResourceExhaustedError",
    "Sampling",
    "Session",
    "SlotInfo",
    "StepRange",
    "Subscription",
    "SyncClient",
    "SyncGenerateStream",
    "SyncHarvestJob",
    "SyncHookHandle",
    "SyncIterator",
    "SyncModel",
    "SyncSubscription",
    "TensorSummary",
    "TokenLogprob",
    "Tokenized",
    "UnauthenticatedError",
    "UnavailableError",
    "UnimplementedError",
    "capture",
    "connect",
    "connect_fleet",
    "connect_sync",
    "edit",
    "rules",
]
