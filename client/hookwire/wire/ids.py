"""The formats of the ids a hookwire server hands out.

Every id is a prefix and random bits, unguessable: holding an id is never a
credential (ownership is checked by principal), but a guessable id would still leak
how many there are. Hooks, sessions and requests: ``{prefix}_`` and 128 random bits
in lowercase hex (``hk_0f3a...``, 32 hex digits). Harvest jobs: ``hv-`` and 64 bits
(16 hex digits), shorter because people type them (``hookwire harvest --watch``).

The server generates ids with :func:`new_id` / :func:`new_harvest_job_id`; a client
that takes ids typed by a person checks them with the patterns below before calling
(``hookwire hooks rm`` refuses a malformed id before removing anything).
"""

from __future__ import annotations

import re
import secrets

#: Prefix of hook ids (``RegisterHook``'s ``hook_id``; request-scoped hooks too).
HOOK = "hk"
#: Prefix of session ids (``OpenSession``).
SESSION = "ses"
#: Prefix of request ids (one per Infer / Generate call, in events and logs).
REQUEST = "req"
#: Prefix of harvest job ids (with a dash: ``hv-``).
HARVEST_JOB = "hv"

#: Random bytes of a hook, session or request id (128 bits: 32 hex digits).
ID_BYTES = 16
#: Random bytes of a harvest job id (64 bits: 16 hex digits).
HARVEST_JOB_ID_BYTES = 8


def new_id(prefix: str) -> str:
    """An unguessable id: ``{prefix}_`` and 128 random bits in hex."""
    return f"{prefix}_{secrets.token_hex(ID_BYTES)}"


def new_harvest_job_id() -> str:
    """An unguessable harvest job id: ``hv-`` and 64 random bits in hex."""
    return f"{HARVEST_JOB}-{secrets.token_hex(HARVEST_JOB_ID_BYTES)}"


def id_pattern(prefix: str) -> re.Pattern[str]:
    """What an id with ``prefix`` looks like (use with ``fullmatch``)."""
    return re.compile(rf"{re.escape(prefix)}_[0-9a-f]{{{2 * ID_BYTES}}}")


#: A hook id: ``hk_`` and 32 lowercase hex digits (``HOOK_ID.fullmatch(text)``).
HOOK_ID = id_pattern(HOOK)
#: A session id: ``ses_`` and 32 lowercase hex digits.
SESSION_ID = id_pattern(SESSION)
#: A request id: ``req_`` and 32 lowercase hex digits.
REQUEST_ID = id_pattern(REQUEST)
#: A harvest job id: ``hv-`` and 16 lowercase hex digits.
HARVEST_JOB_ID = re.compile(rf"{HARVEST_JOB}-[0-9a-f]{{{2 * HARVEST_JOB_ID_BYTES}}}")
