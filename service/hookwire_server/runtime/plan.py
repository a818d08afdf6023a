"""A step's plan as it travels from the front to a worker, and the firings' results back:
bytes only (JSON and protobuf), nothing pickled, no code.

The plan (``pack``): a JSON header, then the bytes of each ``HookSpec`` it ships. The
header's fields:

- ``taps``: [path, "pre"/"post", roots, edits] of each module phase to tap (as before);
  ``logits``: whether the front wants the step's logits; ``skip``: no hook runs this step.
- ``specs``: one entry per shipped spec, in the blobs' order: ``key`` (the front's name
  for the hook), ``hook_id``, ``owner``, ``fail_call``, ``request_scoped``, ``slots``
  (the key of its session's slots, "" when it keeps none), ``size`` (of its blob); ``drop``: keys of programs the worker may forget.
- ``operands``: one entry per named operand shipped, its blob after the specs': ``key``
  (the name the specs give it: each ``Tensor.operand`` / ``Sae.operand`` in a shipped
  spec is such a key), ``name`` (the operand's, for messages), ``kind`` ("tensor": the
  blob is a ``Tensor`` message; "sae": an ``Sae`` message with its tensors inline),
  ``size``; each is sent once, and every rank
  keeps it until ``drop_operands`` lists its key (no program it keeps names it).
- ``slots``: the sessions' slots sent to the ranks (they lived in the server), one entry
  each, its blob (a ``Tensor`` message) after the operands': ``key`` (the session's
  store: ``HookSpec`` programs name it as their ``slots``), ``name``, ``size``;
  ``slot_budget``: {key: [bytes one rank may hold, the session's max_slot_bytes, the
  ranks whose copies count]} for each session in the step (a save past it fails as in
  the server, ResourceExhausted naming max_slot_bytes);
  ``drop_slots``: [key, names or null (all)] the ranks free before the step;
  ``pull_slots``: [key, name] the first rank sends back at once (a ``slots`` message: one
  ``Value`` frame each, empty when it holds none) and every rank then frees, for a step
  whose hooks run in the front.
- ``run``: present when the worker runs the step's hooks itself (step.StepRunner):
  ``model`` (for messages), ``vocab`` (the lm_head view's width), ``tokens``,
  ``sequences``, ``shared``, ``segments`` ([spans, rows, side, width] per call, as
  engine.packed lays a call out) and ``fire``: [path, phase, entries] per tapped module
  phase, each entry [number, key, segment, capture, view, hook path] in firing order
  (the hook path names the module in messages: lm_head's hooks fire in the logits
  processor).

The results (the worker's ``end`` message): ``fired``, one entry per firing as it ran, in
the order the model ran them: [number, fired_ns, before, after, devices, stops, error],
where before/after list [part, field, key] per value captured before or after the
rules (null: no capture), and error is null or [stage ("rule", "capture", "call"),
error class, message]; ``slots``: [key, name, dtype, shape, bytes] of each slot the step
saved (it lives on the ranks); ``values`` and ``sizes``: how many values the firings
captured and the size of each one's ``Value`` message (0: it could not be encoded, and
``bad`` says why); ``joined``: then, when there are any, one message of those ``Value``
messages back to back, in order (one read for the front, not one per value); false (past
4 MiB in all: no second copy of large captures): one message each.
"""

from __future__ import annotations

import json
import struct
from typing import Any

_LENGTH = struct.Struct("<I")


def pack(header: dict[str, Any], blobs: list[bytes] = ()) -> bytes:  # type: ignore[assignment]
    """The plan's bytes: the header's length, the header (JSON), the blobs."""
    head = json.dumps(header).encode()
    return b"".join([_LENGTH.pack(len(head)), head, *blobs])


def unpack(data: bytes) -> tuple[dict[str, Any], list[bytes]]:
    """``pack``'s header and blobs: the specs', then the operands', then the slots' (their
    sizes are the entries' ``size``)."""
    (n,) = _LENGTH.unpack_from(data, 0)
    header = json.loads(data[_LENGTH.size:_LENGTH.size + n])
    blobs: list[bytes] = []
    at = _LENGTH.size + n
    for meta in [*header.get("specs", ()), *header.get("operands", ()), *header.get("slots", ())]:
        size = int(meta["size"])
        blobs.append(bytes(data[at:at + size]))
        at += size
    return header, blobs
