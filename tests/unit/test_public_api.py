"""The public surface of the hookwire SDK."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
import textwrap

import hookwire

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Copied from client/hookwire/__init__.py, in its order (isort-style: constants first).
EXPECTED_ALL = [
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
RULES_ALL = ["Condition", "Operand", "Readout", "Rule", "Sae", "Signal", "add", "affine", "clamp", "logit_lens", "loreft", "noise",
             "norm", "norm_add", "operand", "patch", "probe", "probe_scores", "project_out", "projection", "sae", "sae_feature",
             "sae_top_k", "save", "scale", "set", "signal", "stop", "stored", "token_id", "top_k", "when", "zero"]


def test_all_is_pinned():
    assert hookwire.__all__ == EXPECTED_ALL
    assert hookwire.rules.__all__ == RULES_ALL
    assert len(set(hookwire.__all__)) == len(hookwire.__all__), "duplicates in __all__"


def test_every_public_name_is_importable():
    module = importlib.import_module("hookwire")
    for name in EXPECTED_ALL:
        assert getattr(module, name, None) is not None, name
    namespace: dict[str, object] = {}
    exec("from hookwire import *", namespace)
    assert sorted(k for k in namespace if not k.startswith("__")) == sorted(EXPECTED_ALL)


def test_codec_error_is_the_codec_modules():
    from hookwire.wire import codec

    assert hookwire.CodecError is codec.CodecError


def test_version():
    assert isinstance(hookwire.__version__, str) and hookwire.__version__


NO_TORCH_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys


    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "torch" or fullname.startswith("torch."):
                raise ImportError(f"blocked import of {fullname}")
            return None


    sys.meta_path.insert(0, BlockTorch())
    for name in list(sys.modules):
        if name == "torch" or name.startswith("torch."):
            del sys.modules[name]

    try:
        import torch  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the torch blocker does not work")

    import numpy as np

    import hookwire
    from hookwire.wire import codec
    from hookwire.v1 import tensor_pb2

    assert "torch" not in sys.modules, "hookwire imported torch"
    assert codec.TORCH_DTYPES == {}

    values = np.array([[1.5, -2.0, 3.25], [0.0, np.inf, -0.5]], dtype="<f4")
    msg = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2, 3], data=values.tobytes())
    wire = tensor_pb2.Tensor.FromString(msg.SerializeToString())
    out = codec.decode_tensor(wire)
    assert isinstance(out, np.ndarray), type(out)
    assert out.dtype == np.float32 and out.shape == (2, 3)
    assert out.tobytes() == values.tobytes()
    assert out.flags.writeable
    out[0, 0] = 9.0

    value = tensor_pb2.Value()
    value.tensor.CopyFrom(msg)
    decoded = codec.decode_value(value)
    assert isinstance(decoded, np.ndarray)
    np.testing.assert_array_equal(decoded, values)

    # Encoding numpy works without torch too.
    assert codec.encode_tensor(values) == msg
    assert "torch" not in sys.modules
    print("OK", len(hookwire.__all__))
    """
)


def test_import_without_torch():
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.stdout.strip() == f"OK {len(EXPECTED_ALL)}"
