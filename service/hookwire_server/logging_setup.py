"""Server logging: plain text for people, or one JSON object per line for log pipelines.

Records carry context as ``extra`` fields (request_id, model, session_id, hook_id,
duration_ms, incident); the JSON format emits them as keys. A record emitted while an
RPC runs also carries the RPC's ``principal`` and ``request_id`` (rpc_context).

In JSON mode every line the process writes is JSON: ``hookwire serve``'s own start-up
lines (``announce``), Python warnings, transformers' logs (which has a handler of its
own), and no progress bars (tqdm, Hugging Face's).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any

from .rpc_context import CURRENT

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and every extra field."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """Readable lines with the extra fields appended as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(
            f"{k}={v}" for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
        )
        return f"{line} {extra}" if extra else line


class RpcFields(logging.Filter):
    """Adds the current RPC's ``principal`` and ``request_id`` to a record that has none."""

    def filter(self, record: logging.LogRecord) -> bool:
        rpc = CURRENT.get()
        if rpc is not None:
            if not hasattr(record, "principal") and rpc.principal:
                record.principal = rpc.principal
            if not hasattr(record, "request_id"):
                record.request_id = rpc.request_id
        return True


#: Progress bars a JSON log must not hold: huggingface_hub's and datasets' (read when
#: they are imported, after this), and tqdm's in child processes (vLLM's workers: tqdm
#: reads TQDM_* when it is imported, which in this process it was already).
_NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


def configure(fmt: str = "text", level: str = "info") -> None:
    """Sends the server's logs to stderr in ``fmt`` ("text" or "json"). In JSON mode also
    turns progress bars off, routes Python warnings and transformers' logs through
    these handlers (importing transformers' logging module, when it is installed)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RpcFields())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        for key, value in _NO_PROGRESS_BARS.items():
            os.environ.setdefault(key, value)  # child processes (vLLM's workers) inherit them
        logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger
        _route_transformers_logs()


def _route_transformers_logs() -> None:
    """transformers logs through a stderr handler of its own, with propagation off, set
    up when its logging module is first imported: import it now and send its records to
    the root logger's handlers instead; its progress bars (weight loading) go too."""
    if importlib.util.find_spec("transformers") is None:
        return
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_default_handler()
    transformers_logging.enable_propagation()
    transformers_logging.disable_progress_bar()


def announce(fmt: str, message: str, *, error: bool = False, **fields: Any) -> None:
    """One of the lines ``hookwire serve`` says itself (what it serves, where; a model that
    failed), whatever the log level: as it is in text mode, a JSON record of logger
    ``hookwire.serve`` with ``fields`` as keys in JSON mode; on stdout, or stderr for an
    ``error``."""
    stream = sys.stderr if error else sys.stdout
    if fmt == "json":
        record = logging.getLogger("hookwire.serve").makeRecord(
            "hookwire.serve", logging.ERROR if error else logging.INFO, "(serve)", 0, message, (), None, extra=fields)
        message = JsonFormatter().format(record)
    print(message, file=stream, flush=True)
