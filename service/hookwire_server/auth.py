"""Who may do what: principals, roles, and bearer tokens stored as hashes.

Roles are cumulative: viewer < user < observer < operator.

- viewer: list and inspect models.
- user: Infer; session- and request-scoped hooks and rules on its own calls.
- observer: also SCOPE_ALL / SCOPE_TAGGED captures of other callers' traffic, in a
  session or in a hook that outlives sessions (capture only: no rules, no stop).
- operator: also rules on other callers' traffic and on hooks that outlive sessions,
  seeing and removing anyone's hooks and sessions.

Tokens are configured as ``principal:role[,role...]:sha256hex`` lines (a file, or
the HOOKWIRE_TOKENS variable), or ``[[principals]]`` tables in a TOML file with
``name``, ``roles``, ``token_sha256`` and/or ``cert_subject`` (mTLS). Only hashes
are stored; presented tokens are hashed and compared in constant time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import pathlib
import re
import secrets
import threading
import tomllib
from typing import Iterable

from .errors import HookwireServerError, PermissionDenied

ROLES = ("viewer", "user", "observer", "operator")

#: The least role each RPC needs, by method name. The domain checks it on every call
#: (``principal.require(MINIMUM_ROLE[...], ...)``: the real authority, which also checks
#: what depends on the request, e.g. observer for SCOPE_ALL hooks); the interceptor
#: (security.py) checks the same entry from the call's metadata alone, to refuse a caller
#: before its request is read. One table, so the two cannot disagree; a test pins that
#: every RPC has an entry and that the domain refuses exactly the roles below it.
MINIMUM_ROLE: dict[str, str] = {
    "ListModels": "viewer",
    "GetModel": "viewer",
    "Infer": "user",
    "InferStream": "user",
    "Tokenize": "user",
    "Generate": "user",
    "GetParameters": "user",
    "OpenSession": "user",
    "RegisterHook": "user",
    "DeregisterHook": "user",
    "ListHooks": "user",
    "GetSlot": "user",
    "ListSlots": "user",
    "Subscribe": "user",
    "StartHarvest": "user",
    "CancelHarvest": "user",
    "GetHarvest": "viewer",
    "WatchHarvest": "viewer",
    "ListHarvests": "viewer",
    "UploadOperand": "user",
    "DeleteOperand": "user",
    "ListOperands": "user",
    "PublishOperand": "operator",
}


class Unauthenticated(HookwireServerError):
    """Missing or wrong credentials."""


class AuthConfigError(ValueError):
    """A token file or variable that cannot be used."""


@dataclasses.dataclass(frozen=True)
class Principal:
    """An authenticated caller. Ownership compares names (``owns``), so a role change
    keeps a principal's hooks and sessions its own."""

    name: str
    role: str  # the highest role; lower ones are implied
    #: What authenticated it: "token:<sha256 hex>" or "cert:<subject>" ("" when
    #: authentication is off). Streams end when a reload no longer accepts it
    #: (TokenStore.current); not part of equality, never logged.
    credential: str = dataclasses.field(default="", compare=False, repr=False)

    def owns(self, owner: Principal) -> bool:
        """Whether something owned by ``owner`` is this principal's."""
        return owner.name == self.name

    def has(self, role: str) -> bool:
        """Whether the principal holds ``role`` (or a higher one)."""
        return ROLES.index(self.role) >= ROLES.index(role)

    def require(self, role: str, action: str) -> None:
        """PermissionDenied naming the missing role, unless the principal holds it."""
        if not self.has(role):
            raise PermissionDenied(f"{action} needs the {role} role; {self.name!r} has {self.role}")

    @property
    def is_operator(self) -> bool:
        """Operators see and manage everyone's hooks and sessions."""
        return self.has("operator")


#: The caller when authentication is off (loopback development): may do everything.
ANONYMOUS = Principal("anonymous", "operator")


def hash_token(token: str) -> str:
    """The hex SHA-256 stored for a token."""
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits)."""
    return "hwt_" + secrets.token_urlsafe(32)


@dataclasses.dataclass(frozen=True)
class _Entry:
    principal: Principal
    token_sha256: bytes | None
    cert_subject: str | None


def _highest(roles: Iterable[str], where: str) -> str:
    roles = [r.strip() for r in roles if r.strip()]
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise AuthConfigError(f"{where}: roles {roles} (known: {', '.join(ROLES)})")
    return max(roles, key=ROLES.index)


def _digest(hexdigest: str, where: str) -> bytes:
    if not re.fullmatch(r"[0-9a-f]{64}", hexdigest):
        raise AuthConfigError(f"{where}: token hashes are 64 lowercase hex digits (sha256)")
    return bytes.fromhex(hexdigest)


def parse_lines(text: str, origin: str) -> list[_Entry]:
    """``principal:roles:sha256hex`` entries, one per line or whitespace-separated."""
    entries = []
    uncommented = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    for n, item in enumerate(uncommented.split(), 1):
        parts = item.split(":")
        if len(parts) != 3:
            raise AuthConfigError(f"{origin} entry {n}: expected principal:role[,role]:sha256hex")
        name, roles, digest = parts
        where = f"{origin} entry {n} ({name})"
        entries.append(_Entry(Principal(name, _highest(roles.split(","), where)), _digest(digest, where), None))
    return entries


def parse_toml(text: str, origin: str) -> list[_Entry]:
    """``[[principals]]`` tables with name, roles, token_sha256 and/or cert_subject."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise AuthConfigError(f"{origin}: {exc}") from None
    entries = []
    for n, table in enumerate(data.get("principals", [])):
        where = f"{origin} principals[{n}]"
        name = table.get("name")
        if not name:
            raise AuthConfigError(f"{where}: no name")
        digest = _digest(table["token_sha256"], where) if "token_sha256" in table else None
        subject = table.get("cert_subject")
        if digest is None and subject is None:
            raise AuthConfigError(f"{where}: set token_sha256, cert_subject or both")
        entries.append(_Entry(Principal(name, _highest(table.get("roles", []), where)), digest, subject))
    return entries


class TokenStore:
    """The configured principals; reloadable (SIGHUP) without restarting."""

    def __init__(self, file: str | None = None, env_value: str | None = None) -> None:
        self._file = file
        self._env_value = env_value
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []
        self.reload()
        #: Fixed at start: a reload can change the principals, never turn authentication off.
        self.required = bool(self._entries)
        #: Whether authentication is on (principals were configured at start).
        self.enabled = self.required

    def reload(self) -> int:
        """Reads the file and variable again; returns the number of principals."""
        entries: list[_Entry] = []
        if self._file:
            try:
                text = pathlib.Path(self._file).read_text()
            except OSError as exc:
                raise AuthConfigError(f"token file {self._file}: {exc}") from None
            entries += parse_toml(text, self._file) if "[[principals]]" in text else parse_lines(text, self._file)
        if self._env_value:
            entries += parse_lines(self._env_value, "HOOKWIRE_TOKENS")
        names = [e.principal.name for e in entries]
        if len(set(names)) != len(names):
            raise AuthConfigError("a principal is configured twice")
        if not entries and getattr(self, "required", False):
            raise AuthConfigError("the reload leaves no principal: refusing to turn authentication off")
        with self._lock:
            self._entries = entries
        return len(entries)

    @property
    def principals(self) -> dict[str, Principal]:
        """The configured principals by name."""
        with self._lock:
            return {e.principal.name: e.principal for e in self._entries}

    def authenticate(self, token: str | None, cert_subjects: Iterable[str] = ()) -> Principal:
        """The principal a bearer token or a verified client certificate names.

        Every configured hash is compared, in constant time, so timing says nothing
        about which (if any) matched. Unauthenticated when nothing matches.
        """
        with self._lock:
            entries = self._entries
        if token:
            presented = hashlib.sha256(token.encode()).digest()
            found = None
            for entry in entries:
                if entry.token_sha256 is not None and hmac.compare_digest(presented, entry.token_sha256):
                    found = entry.principal
            if found is not None:
                return dataclasses.replace(found, credential="token:" + presented.hex())
            raise Unauthenticated("the bearer token is not valid")
        subjects = set(cert_subjects)
        for entry in entries:
            if entry.cert_subject is not None and entry.cert_subject in subjects:
                return dataclasses.replace(entry.principal, credential="cert:" + entry.cert_subject)
        raise Unauthenticated("missing credentials: send 'authorization: Bearer <token>' metadata")

    def current(self, principal: Principal) -> Principal | None:
        """``principal`` as the configuration now stands (a reload may have changed its
        role), if the credential it authenticated with still names it; None when that
        token or certificate subject was rotated out or the principal was removed.
        A principal without a credential (authentication off) is returned as is."""
        if not principal.credential:
            return principal
        kind, _, value = principal.credential.partition(":")
        with self._lock:
            entries = self._entries
        for entry in entries:
            if entry.principal.name != principal.name:
                continue
            if kind == "token" and entry.token_sha256 is not None and entry.token_sha256.hex() == value:
                return dataclasses.replace(entry.principal, credential=principal.credential)
            if kind == "cert" and entry.cert_subject == value:
                return dataclasses.replace(entry.principal, credential=principal.credential)
        return None
