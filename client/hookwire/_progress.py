"""Progress lines for large transfers: bytes so far, total, rate (tqdm, on stderr).

A transfer (a capture arriving in chunks, a parameter, a cache) feeds a
TransferProgress as its data arrives; nothing is shown until it is at least
``threshold`` bytes, so small calls never draw a bar. tqdm is imported when a bar
is first shown, never with this module: ``import hookwire`` stays light.

    bar = TransferProgress("capture", enabled=progress)   # True, False, or None: auto
    for chunk in chunks:
        ...
        bar.update(done, total)
    bar.close()
"""

from __future__ import annotations

import sys
import warnings
from types import TracebackType
from typing import Any, TextIO

#: Transfers smaller than this show no progress (bytes): they end before a bar would say much.
PROGRESS_THRESHOLD = 8 * 2**20

#: tqdm's default line with a total, with the unit on the counts too ("5.00MiB/16.0MiB",
#: not "5.00M/16.0M"). Without a total, tqdm's default already says "5.00MiB".
_WITH_TOTAL = "{l_bar}{bar}| {n_fmt}{unit}/{total_fmt}{unit} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class TransferProgress:
    """A progress bar over one transfer's bytes (or several transfers', fed as one),
    fed as its chunks arrive: bytes so far, total when known, rate.

    ``enabled``: ``False`` shows nothing; ``True`` shows a bar once the transfer
    reaches ``threshold`` bytes, whatever ``file`` is (the SDK's ``progress=True``: a
    notebook's stderr is no terminal); ``None`` (auto, what a command line wants)
    does the same only when ``file`` is a terminal, so that logs and pipes get no
    bar. A transfer "reaches" the threshold when its total does, or, with the total
    unknown, once that many bytes have arrived. ``file``: where the bar is drawn
    (default: ``sys.stderr`` as it is when the bar appears); in a Jupyter kernel with
    ipywidgets, tqdm draws a widget instead.

    Never raises for the transfer's sake: without tqdm installed it shows nothing
    (with a warning when ``enabled=True`` asked for it). Not thread-safe: feed it
    from one thread (the event loop that receives the chunks). Calls cost a few
    comparisons until a bar is shown, and tqdm's own rate limiting after.
    """

    def __init__(
        self, desc: str = "receiving", *, enabled: bool | None = None, threshold: int = PROGRESS_THRESHOLD,
        file: TextIO | None = None, leave: bool = True,
    ) -> None:
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0 bytes, not {threshold}")
        self.desc = desc
        self.enabled = enabled
        self.threshold = threshold
        self.leave = leave
        self._file = file
        #: Bytes arrived so far, and the total when known (as last fed).
        self.done = 0
        self.total: int | None = None
        self._bar: Any = None
        # False once this transfer can show nothing (disabled, not a terminal, no tqdm, closed).
        self._live = enabled is not False

    @property
    def shown(self) -> bool:
        """Whether a bar has been drawn for this transfer."""
        return self._bar is not None

    def update(self, done: int, total: int | None = None) -> None:
        """Records that ``done`` bytes of ``total`` (None: not known) have arrived,
        drawing or refreshing the bar when the transfer is over the threshold."""
        self.done = done
        if total is not None:
            self.total = total
        if not self._live:
            return
        bar = self._bar
        if bar is None:
            size = self.total if self.total is not None else done
            if size < self.threshold:
                return
            bar = self._open()
            if bar is None:
                return
        if self.total is not None and bar.total != self.total:
            bar.total = self.total
            bar.bar_format = _WITH_TOTAL
        if done != bar.n:
            bar.update(done - bar.n)

    def advance(self, nbytes: int, total: int | None = None) -> None:
        """Adds ``nbytes`` to the bytes arrived (see update)."""
        self.update(self.done + nbytes, total)

    def close(self) -> None:
        """Ends the bar (it stays on screen with its final figures when ``leave``);
        later updates draw nothing. Idempotent."""
        self._live = False
        if self._bar is not None:
            bar, self._bar = self._bar, None
            bar.close()

    def __enter__(self) -> TransferProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None,
    ) -> None:
        self.close()

    def _open(self) -> Any:
        """Draws the bar; None (and no more tries) when it may not or cannot be shown."""
        file = self._file if self._file is not None else sys.stderr
        if self.enabled is None and not _is_terminal(file):
            self._live = False
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._live = False
            if self.enabled:
                warnings.warn("progress=True needs tqdm (pip install tqdm); no progress is shown",
                              RuntimeWarning, stacklevel=3)
            return None
        # Binary units (KiB, MiB: tqdm writes "kiB"), as the rest of hookwire reports sizes.
        self._bar = tqdm(
            total=self.total, initial=0, desc=self.desc, unit="iB", unit_scale=True, unit_divisor=1024,
            file=file, leave=self.leave, dynamic_ncols=True, bar_format=_WITH_TOTAL if self.total is not None else None,
        )
        return self._bar


def _is_terminal(file: Any) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or a closed file
        return False


__all__ = ["PROGRESS_THRESHOLD", "TransferProgress"]
