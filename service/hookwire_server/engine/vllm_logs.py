"""vLLM's logs in the server's log format. vLLM configures its logger "vllm" itself
(its own handler and format, on stdout) in the server's process and again in each
process it starts (its engine core and workers, spawned: they inherit the environment,
not the server's logging). With ``hookwire serve --log-format json`` every line must be
JSON, so the engine gives vLLM a logging config of its own (``VLLM_LOGGING_CONFIG_PATH``,
a ``dictConfig`` file vLLM applies in every one of its processes) whose handler writes
hookwire's JSON lines on stderr; in vLLM's own processes the root logger gets it too (the
other libraries' records there: torch, transformers' warnings). What bypasses Python's
logging (torch's C++ warnings, a library's print, a warning vLLM's processes log before
vLLM configured their logging) is caught where it is written: while vLLM starts, the
process's stdout and stderr are pipes (the processes it starts keep them for their
lives), and a thread writes their lines on the server's own stdout and stderr, JSON
lines as they are and the others as JSON records of the logger "vllm.output". With the
text format vLLM keeps its own lines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator

#: The pid of the server's process, for vLLM's processes (they inherit it): there the
#: root logger is hookwire's already and stays as the server configured it.
SERVER_PID = "HOOKWIRE_SERVER_PID"

_config_path: str | None = None


def server_format() -> str:
    """The server's log format: "json" where the root logger's handler writes hookwire's
    JSON lines (logging_setup.configure), else "text"."""
    from ..logging_setup import JsonFormatter

    handlers = logging.getLogger().handlers
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in handlers) else "text"


def follow_server_format() -> None:
    """Before vLLM starts an engine: in the JSON format, points vLLM (this process and
    the processes it starts) at a logging config that writes hookwire's JSON lines, at the
    server's level. Nothing changes in the text format."""
    global _config_path
    if server_format() != "json":
        return
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        # No "root" here: dictConfig would take the server's own handlers off it (json_handler
        # gives the root logger of vLLM's processes its handler).
        "handlers": {"hookwire": {"()": f"{__name__}.json_handler", "root_level": level}},
        "loggers": {"vllm": {"handlers": ["hookwire"], "level": level, "propagate": False}},
    }
    if _config_path is None:
        fd, _config_path = tempfile.mkstemp(prefix="hookwire-vllm-logging-", suffix=".json")
        os.close(fd)
        import atexit

        atexit.register(_remove, _config_path)
    with open(_config_path, "w") as f:
        json.dump(config, f)
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = _config_path
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ[SERVER_PID] = str(os.getpid())


def json_handler(root_level: str = "INFO") -> logging.Handler:
    """The handler of vLLM's logging config (a dictConfig factory): the root logger's,
    which writes hookwire's JSON lines. In a process vLLM started, its logging is first
    configured as the server's is (logging_setup.configure: JSON on stderr at
    ``root_level``, warnings, transformers' logs); in the server's process the root
    logger keeps the server's own handlers."""
    from ..logging_setup import JsonFormatter, configure

    root = logging.getLogger()
    if os.environ.get(SERVER_PID) != str(os.getpid()):
        configure("json", root_level.lower())
    for handler in root.handlers:
        if isinstance(handler.formatter, JsonFormatter):
            return handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    return handler


@contextlib.contextmanager
def output_as_json() -> Iterator[None]:
    """While vLLM starts (in the JSON format): what is written on this process's stdout
    and stderr, and on those of every process started meanwhile (vLLM's engine and
    workers inherit them), reaches the server's stdout and stderr as JSON lines. Nothing
    changes in the text format."""
    if server_format() != "json":
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    ends = {}
    for fd, level in ((1, logging.INFO), (2, logging.WARNING)):
        read, write = os.pipe()
        ends[fd] = write
        threading.Thread(target=_relay, args=(read, saved[fd], level), name=f"vllm-output-{fd}", daemon=True).start()
        os.dup2(write, fd)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd in (1, 2):
            os.dup2(saved[fd], fd)
            os.close(ends[fd])  # vLLM's processes keep their copies: the relay ends when they do


def _relay(read: int, out: int, level: int) -> None:
    """Writes the lines of pipe ``read`` on ``out``: JSON lines as they are, others as
    hookwire's JSON records (logger "vllm.output", ``level``)."""
    from ..logging_setup import JsonFormatter

    formatter = JsonFormatter()
    with open(read, "rb") as pipe, open(out, "wb", buffering=0) as sink:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line.strip():
                continue
            try:
                json_line = isinstance(json.loads(line), dict)
            except ValueError:
                json_line = False
            if not json_line:
                line = formatter.format(logging.LogRecord("vllm.output", level, __file__, 0, line, None, None))
            try:
                sink.write(line.encode() + b"\n")
            except OSError:
                return


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
