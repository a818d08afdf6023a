"""Bounds on what one request message may hold, checked on its raw bytes before it is parsed.

Parsing is not free: a 38 MB message of 20 million empty Values takes protobuf's
parser seconds and gigabytes, and each Value costs a Python walk microseconds
afterwards. So before a request is parsed, ``check`` walks its wire bytes
(guided by the message's descriptor, reading tags and lengths, skipping tensor
data) and stops at the first bound it passes:

Every bound is a Limits field (RequestBounds reads them from the server's Limits), and
every message names it (``limits.exceeded``):

- the fields it holds (every tag on the wire, and every element of a packed
  repeated field): ``max_request_fields``; this also bounds the scan itself;
- the Values and map entries it holds: ``max_request_values``;
- the request-scoped hooks of an InferRequest (``max_request_hooks``), the
  rules of one hook action (``max_rules_per_action``), the texts of a
  TokenizeRequest (``max_tokenize_texts``) and the names of a
  GetParametersRequest (``max_parameter_names``);
- the length of every string the server parses or looks up: names (model,
  session, hook, slot, tag, keyword and map keys) ``max_name_length``, paths
  (module and parameter globs, rule targets and indices, selections,
  backward.output_path) ``max_path_length``, both in UTF-8 bytes. ``Value.string_value`` is data the
  server hands to the model unread: only ``max_message_bytes`` bounds it;
  ``TokenizeRequest.texts`` are data for the tokenizer (their number is capped
  here, their characters after the parse: ``max_tokenize_chars``).

The scan costs O(min(request, bounds)) and allocates nothing per field.
Nothing here imports grpc: errors are domain errors (status_mapping maps them).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from hookwire.wire.framing import read_varint

from ..errors import HookwireServerError, InvalidArgument, ResourceExhausted
from ..limits import Limits, exceeded

#: protobuf's own parser refuses messages nested deeper than this; so does the scan.
MAX_NESTING = 100

VALUE_TYPE = "hookwire.v1.Value"

#: Request string fields named as the contract names its identifiers are names, whatever
#: message they are in (a new RPC's ``model`` needs no entry below).
NAME_FIELD_NAMES = frozenset({"model", "session_id", "hook_id", "hook_ids", "job_id", "tags"})
#: Other string fields holding names: looked up, compared, or used as keys.
NAME_FIELDS = frozenset({
    "hookwire.v1.GetModelRequest.name",
    "hookwire.v1.InferRequest.KwargsEntry.key",
    "hookwire.v1.ValueMap.EntriesEntry.key",
    "hookwire.v1.ValueMap.keys",
    "hookwire.v1.PatchOp.slot",
    "hookwire.v1.SaveOp.slot",
    "hookwire.v1.SignalOp.name",
    "hookwire.v1.Signal.stored",
    "hookwire.v1.Sae.architecture",
    "hookwire.v1.Sae.normalize_activations",
    "hookwire.v1.GetSlotRequest.name",
    "hookwire.v1.TokenizeRequest.padding_side",
    "hookwire.v1.GenerateRequest.stop",
    "hookwire.v1.Value.opaque_type",
    "hookwire.v1.TextSource.text_field",
    "hookwire.v1.TextSource.split",
    "hookwire.v1.Tensor.operand",
    "hookwire.v1.Sae.operand",
    "hookwire.v1.OperandUpload.name",
    "hookwire.v1.DeleteOperandRequest.name",
    "hookwire.v1.DeleteOperandRequest.owner",
    "hookwire.v1.PublishOperandRequest.name",
})
#: String fields the server parses: globs, dotted paths, selections.
PATH_FIELDS = frozenset({
    "hookwire.v1.HookSpec.module",
    "hookwire.v1.HookAction.select",
    "hookwire.v1.Rule.target",
    "hookwire.v1.Rule.index",
    "hookwire.v1.Backward.output_path",
    "hookwire.v1.StartHarvestRequest.modules",
    "hookwire.v1.StartHarvestRequest.select",
    "hookwire.v1.TextSource.path",
    "hookwire.v1.HarvestOutput.path",
    "hookwire.v1.GetParametersRequest.names",
    "hookwire.v1.LogitLensReadout.norm",
    "hookwire.v1.LogitLensReadout.unembedding",
    "hookwire.v1.PublishOperandRequest.path",
})
#: String fields the server never parses (data for the model).
UNBOUNDED_FIELDS = frozenset({
    "hookwire.v1.Value.string_value", "hookwire.v1.TokenizeRequest.texts", "hookwire.v1.GenerateRequest.prompts",
})

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_PACKED_WIDTH = {
    FieldDescriptor.TYPE_DOUBLE: 8, FieldDescriptor.TYPE_FIXED64: 8, FieldDescriptor.TYPE_SFIXED64: 8,
    FieldDescriptor.TYPE_FLOAT: 4, FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4,
}


#: The Limits fields ``check`` reads (each named in its messages).
SETTINGS = (
    "max_request_fields", "max_request_values", "max_request_hooks", "max_rules_per_action", "max_name_length",
    "max_path_length", "max_tokenize_texts", "max_stop_strings", "max_parameter_names",
)


@dataclasses.dataclass(frozen=True)
class RequestBounds:
    """The bounds ``check`` applies: those of a Limits (or ServerSettings; see Limits for
    each), read from it, never repeated here. ``max_fields`` may scan fewer fields than
    ``limits.max_request_fields`` allows (``within``): a scan that passes it raises
    TooManyFields, and the caller may scan again with the whole bound elsewhere."""

    limits: Limits = dataclasses.field(default_factory=Limits)
    #: The fields this scan reads at most; -1: limits.max_request_fields.
    max_fields: int = -1

    def __post_init__(self) -> None:
        if self.max_fields < 0:
            object.__setattr__(self, "max_fields", self.limits.max_request_fields)

    @classmethod
    def of(cls, limits: Limits) -> RequestBounds:
        """The bounds configured in a Limits (or ServerSettings)."""
        return cls(limits)

    def within(self, max_fields: int) -> RequestBounds:
        """These bounds, scanning at most ``max_fields`` fields (never more than the limit)."""
        return dataclasses.replace(self, max_fields=min(self.max_fields, max_fields))


class TooManyFields(ResourceExhausted):
    """The scan passed max_fields (a caller may scan again with a larger bound elsewhere)."""


class _Malformed(Exception):
    """The bytes are not a valid protobuf encoding (the caller says so)."""


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: str  # "message", "string", "bytes", "scalar"
    message: Optional[Descriptor] = None
    counts_as_value: bool = False
    #: (limit setting, error class) for a repeated field whose occurrences are capped.
    cap: Optional[tuple[str, type[HookwireServerError]]] = None
    string_bound: Optional[str] = None  # "max_name_length" or "max_path_length"
    packed_width: int = 1

    def plan(self) -> dict[int, _Field]:
        """The plan of the message type this field holds."""
        assert self.message is not None
        return _plan(self.message)


_CAPS = {
    "hookwire.v1.InferRequest.hooks": ("max_request_hooks", ResourceExhausted),
    "hookwire.v1.HookAction.rules": ("max_rules_per_action", InvalidArgument),
    "hookwire.v1.TokenizeRequest.texts": ("max_tokenize_texts", ResourceExhausted),
    "hookwire.v1.GenerateRequest.hooks": ("max_request_hooks", ResourceExhausted),
    "hookwire.v1.GenerateRequest.prompts": ("max_tokenize_texts", ResourceExhausted),
    "hookwire.v1.GenerateRequest.stop": ("max_stop_strings", InvalidArgument),
    "hookwire.v1.StartHarvestRequest.rules": ("max_request_hooks", ResourceExhausted),
    "hookwire.v1.StartHarvestRequest.modules": ("max_request_hooks", ResourceExhausted),
    "hookwire.v1.GetParametersRequest.names": ("max_parameter_names", ResourceExhausted),
}


@functools.lru_cache(maxsize=None)
def _plan(descriptor: Descriptor) -> dict[int, _Field]:
    plan = {}
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            counts = f.message_type.full_name == VALUE_TYPE or f.message_type.GetOptions().map_entry
            plan[f.number] = _Field(f.name, "message", f.message_type, counts, _CAPS.get(f.full_name))
        elif f.type == FieldDescriptor.TYPE_STRING:
            if f.full_name in UNBOUNDED_FIELDS:
                bound = None
            elif f.full_name in PATH_FIELDS:
                bound = "max_path_length"
            else:  # names, and any string field added later that nobody classified: the tighter bound
                bound = "max_name_length"
            plan[f.number] = _Field(f.name, "string", string_bound=bound, cap=_CAPS.get(f.full_name))
        elif f.type == FieldDescriptor.TYPE_BYTES:
            plan[f.number] = _Field(f.name, "bytes")
        else:
            plan[f.number] = _Field(f.name, "scalar", packed_width=_PACKED_WIDTH.get(f.type, 1))
    return plan


class _Scan:
    __slots__ = ("data", "bounds", "fields", "values")

    def __init__(self, data: bytes, bounds: RequestBounds) -> None:
        self.data = data
        self.bounds = bounds
        self.fields = 0
        self.values = 0

    def varint(self, i: int, end: int) -> tuple[int, int]:
        """The varint at data[i:] and the index after it."""
        if i >= end:
            raise _Malformed("truncated varint")
        value, i = read_varint(self.data, i, end)
        if value < 0:
            raise _Malformed("truncated or overlong varint")
        return value, i

    def too_many_fields(self, where: Any) -> TooManyFields:
        limit = self.bounds.max_fields
        error = exceeded(_path(where), f"{limit + 1} or more protobuf fields in the request", limit, "max_request_fields",
                         error=TooManyFields)
        assert isinstance(error, TooManyFields)
        return error

    def message(self, start: int, end: int, plan: dict[int, _Field], depth: int, where: Any) -> None:
        """Scans one message's fields in data[start:end]. ``where`` is a (parent, name)
        chain, turned into a dotted path only for an error message."""
        if depth > MAX_NESTING:
            raise _Malformed(f"messages nest deeper than {MAX_NESTING} levels")
        data, bounds, varint = self.data, self.bounds, self.varint
        limits = bounds.limits
        max_fields, max_values = bounds.max_fields, limits.max_request_values
        caps: dict[int, int] | None = None
        i = start
        # The hot loop: single-byte tags and lengths are read inline.
        while i < end:
            key = data[i]
            i += 1
            if key >= 0x80:
                key, i = varint(i - 1, end)
            self.fields += 1
            if self.fields > max_fields:
                raise self.too_many_fields(where)
            wire = key & 7
            if wire == _VARINT:
                while True:
                    if i >= end:
                        raise _Malformed("truncated varint")
                    i += 1
                    if data[i - 1] < 0x80:
                        break
                continue
            if wire == _I64 or wire == _I32:
                i += 8 if wire == _I64 else 4
                if i > end:
                    raise _Malformed("a fixed-width field runs past its message")
                continue
            if wire != _LEN:
                raise _Malformed(f"wire type {wire} (groups are not part of proto3)")
            if i < end and data[i] < 0x80:
                length = data[i]
                i += 1
            else:
                length, i = varint(i, end)
            stop = i + length
            if stop > end:
                raise _Malformed("a length-delimited field runs past its message")
            field = plan.get(key >> 3)
            if field is None or field.kind == "bytes":
                i = stop
                continue
            if field.cap is not None:  # a repeated message or string field whose occurrences are capped
                caps = caps if caps is not None else {}
                seen = caps[key] = caps.get(key, 0) + 1
                setting, error = field.cap
                cap = getattr(limits, setting)
                if seen > cap:
                    raise exceeded(_path(where, field.name), f"{seen} or more {field.name}", cap, setting, error=error)
            if field.kind == "message":
                if field.counts_as_value:
                    self.values += 1
                    if self.values > max_values:
                        raise exceeded(_path(where, field.name), f"{self.values} or more Values and map entries in the "
                                       "request", max_values, "max_request_values")
                if length:
                    self.message(i, stop, field.plan(), depth + 1, (where, field.name))
            elif field.kind == "string":
                if field.string_bound is not None:
                    limit = getattr(limits, field.string_bound)
                    if length > limit:
                        raise exceeded(_path(where, field.name), f"{length} bytes", limit, field.string_bound,
                                       error=InvalidArgument)
            else:  # a packed repeated scalar field: each element counts as a field
                self.fields += length // field.packed_width
                if self.fields > max_fields:
                    raise self.too_many_fields((where, field.name))
            i = stop
        if i != end:
            raise _Malformed("a field runs past its message")


def _path(where: Any, name: str | None = None) -> str:
    names = [name] if name else []
    while where:
        where, part = where
        names.append(part)
    return ".".join(reversed(names)) or "the request"


def check(data: bytes, descriptor: Descriptor, bounds: RequestBounds) -> None:
    """Raises ResourceExhausted or InvalidArgument (naming the field and the limit) when
    the encoded ``data`` of a ``descriptor`` message passes a bound, and InvalidArgument
    when it is not a valid encoding. Costs O(min(len(data), bounds)); never parses."""
    scan = _Scan(data, bounds)
    try:
        scan.message(0, len(data), _plan(descriptor), 1, None)
    except _Malformed as exc:
        raise InvalidArgument(f"the request is not a valid {descriptor.full_name} message: {exc}") from None
