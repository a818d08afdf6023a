"""hookwire._progress.TransferProgress: a tqdm bar over a transfer's bytes (issue #14).

Real tqdm, drawing into a StringIO (no terminal) or a pseudo-terminal (os.openpty).
Nothing here depends on how fast anything runs: the rate's figure is never checked,
only that the line carries one.
"""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import termios

import numpy as np
import pytest

from hookwire.wire import codec
from hookwire._progress import PROGRESS_THRESHOLD, TransferProgress
from hookwire.v1 import tensor_pb2

MiB = 2**20


def _feed(bar: TransferProgress, total: int | None, step: int = MiB, size: int | None = None) -> None:
    size = total if size is None else size
    assert size is not None
    for done in range(step, size + step, step):
        bar.update(min(done, size), total)
    bar.close()


def _last_line(text: str) -> str:
    return re.split(r"[\r\n]+", text.strip())[-1]


def test_a_transfer_over_the_threshold_shows_bytes_total_and_rate() -> None:
    out = io.StringIO()
    bar = TransferProgress("capture", enabled=True, file=out)
    _feed(bar, 16 * MiB)
    line = _last_line(out.getvalue())
    assert line.startswith("capture: 100%"), line
    assert "16.0MiB/16.0MiB" in line, line
    assert re.search(r"[\d.]+[kMGT]?iB/s\]$", line), line  # a rate, whatever its figure
    assert bar.done == bar.total == 16 * MiB and not bar.shown  # closed


def test_a_transfer_under_the_threshold_shows_nothing() -> None:
    out = io.StringIO()
    bar = TransferProgress("capture", enabled=True, file=out)
    _feed(bar, PROGRESS_THRESHOLD - 1, step=256 * 1024)
    assert out.getvalue() == "" and bar.done == PROGRESS_THRESHOLD - 1
    lower = io.StringIO()
    _feed(TransferProgress("capture", enabled=True, threshold=MiB, file=lower), 2 * MiB)
    assert "2.00MiB/2.00MiB" in _last_line(lower.getvalue())


def test_disabled_shows_nothing() -> None:
    out = io.StringIO()
    _feed(TransferProgress("capture", enabled=False, file=out), 64 * MiB)
    assert out.getvalue() == ""


def test_auto_shows_nothing_where_the_file_is_no_terminal() -> None:
    out = io.StringIO()  # a pipe or a log: no bar
    bar = TransferProgress("capture", file=out)
    _feed(bar, 64 * MiB)
    assert out.getvalue() == "" and bar.done == 64 * MiB


def test_auto_draws_on_a_terminal() -> None:
    master, slave = os.openpty()
    # A terminal 120 columns wide (a fresh pty says 0 x 0, where tqdm draws an empty line).
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    try:
        with os.fdopen(slave, "w", closefd=True) as tty:
            assert tty.isatty()
            _feed(TransferProgress("params", file=tty), 12 * MiB)
        received = b""
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not data:
                break
            received += data
    finally:
        os.close(master)
    line = _last_line(received.decode())
    assert line.startswith("params: 100%") and "12.0MiB/12.0MiB" in line, received


def test_unknown_total_shows_bytes_so_far_once_over_the_threshold() -> None:
    out = io.StringIO()
    bar = TransferProgress("events", enabled=True, file=out)
    for _ in range(7):
        bar.advance(MiB)
    assert out.getvalue() == "" and not bar.shown  # 7 MiB: under 8
    for _ in range(3):
        bar.advance(MiB)
    assert bar.shown
    bar.close()
    line = _last_line(out.getvalue())
    assert line.startswith("events: 10.0MiB [") and "%" not in line, line


def test_a_total_learnt_later_turns_into_a_percentage() -> None:
    out = io.StringIO()
    bar = TransferProgress("events", enabled=True, file=out)
    bar.update(9 * MiB)  # shown: over the threshold, total unknown
    bar.update(20 * MiB, 20 * MiB)
    bar.close()
    assert "100%" in _last_line(out.getvalue()) and "20.0MiB/20.0MiB" in _last_line(out.getvalue())


def test_close_is_idempotent_and_later_updates_draw_nothing() -> None:
    out = io.StringIO()
    with TransferProgress("capture", enabled=True, file=out) as bar:
        bar.update(10 * MiB, 10 * MiB)
    drawn = out.getvalue()
    bar.close()
    bar.update(11 * MiB, 12 * MiB)
    assert out.getvalue() == drawn and bar.done == 11 * MiB


def test_bad_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="threshold must be >= 0 bytes"):
        TransferProgress(threshold=-1)


def test_fed_from_a_chunk_assembler_as_the_sdk_would() -> None:
    # The wiring the SDK's chunk assembly uses: after each chunk, (received, nbytes).
    values = np.random.default_rng(1).standard_normal((3, 1024, 1024)).astype("<f4")  # 12 MiB
    chunker = codec.Chunker(snapshot=False)
    msg = tensor_pb2.Value()
    codec.encode_value_into(values, msg, chunker=chunker)
    assembler = codec.ChunkAssembler(msg, as_numpy=True)
    assert assembler.nbytes == values.nbytes and assembler.received == 0
    out = io.StringIO()
    with TransferProgress("capture", enabled=True, file=out) as bar:
        for chunk in chunker.chunks(MiB):
            assembler.feed(chunk)
            bar.update(assembler.received, assembler.nbytes)
    assert assembler.done and assembler.received == values.nbytes
    assert np.array_equal(codec.decode_value(msg, chunked=assembler.result(), as_numpy=True), values)
    assert "12.0MiB/12.0MiB" in _last_line(out.getvalue())
