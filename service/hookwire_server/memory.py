"""Giving freed heap memory back to the system.

glibc's allocator keeps memory that was freed in the middle of its heap: a model's
large transient tensors (a batch's activations, an SAE's feature matrix for eight rows)
and gRPC's receive buffers (an upload's few hundred 1 MiB chunk messages) are freed but
stay in the process's RSS until ``malloc_trim`` returns them. A server whose RSS only
grows is one that memory-based autoscaling and OOM killers misjudge, so hookwire trims
after an operand upload (or a failed one), after refusing a large request
(api/status_mapping.py) and when a model's worker has been idle for a while
(models/worker.py), never during a pass.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def trim_heap() -> bool:
    """Returns freed heap memory to the system (glibc's ``malloc_trim(0)``); False where
    the C library has no such call. Costs a walk of the heap: milliseconds for a large
    one, so call it when nothing waits."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
