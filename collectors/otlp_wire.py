"""OTLP trace bodies read straight from their protobuf bytes: the fast path of span normalization.

upb parses a body in C, but every field read from Python then builds a wrapper object: about
1 us per attribute (iterate, key, value, which member, the member), most of what normalizing a
span cost. This reader walks the wire format itself and hands ``collectors.normalize`` the same
parts the message path reads from a parsed message, so both paths share every rule after that.

It reads the shapes exporters send. Anything else raises :class:`Unusual` and the caller parses
the body with upb as before, so every body gets the message path's answer, garbage included:
a group, a known field with an unexpected wire type or one this reader does not handle, an
AnyValue with two members, a truncated field, invalid UTF-8, more attributes or array items than
normalization keeps, containers nested deeper than it keeps. Sub-messages that normalization
does not keep (events, links, the instrumentation scope) are read through with the same checks
and dropped, so a body this reader takes is one upb takes too.

Neither reader needs protobuf: the field numbers each message defines are written out below, for
the schemas up to ``SCHEMA_VERSION`` (tests/test_otlp_wire.py compares them with the installed
schema's descriptors). A body read here never imports protobuf; the message path imports it when
a body first needs it (about 4 MiB of a daemon's RSS: docs/footprint.md, the forty-sixth pass).

Repeated occurrences of a field follow protobuf's parse rules: the last scalar wins, repeated
fields append, a message field's occurrences merge (here: Status, read field by field in order).
"""

from __future__ import annotations

import logging
import math
import struct
from typing import Any

from collectors.attributes import (
    MAX_ARRAY_ITEMS,
    MAX_ATTRIBUTES,
    MAX_DEPTH,
    MAX_KEY_CHARS,
    MAX_STRING_CHARS,
    cut_text,
)

_U64 = (1 << 64) - 1
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")

# Attribute key-values seen before, by their bytes: (key, value) for values that cannot be changed
# in place. Most attributes repeat exactly from span to span (method, route, model, scheme).
_KV_CACHE: dict[bytes, tuple[str, Any]] = {}
_KV_CACHE_MAX = 4096
_KV_CACHE_BYTES = 256  # longer key-values are rarely repeated; not kept
_KEYS: dict[bytes, str] = {}  # attribute keys by their bytes


log = logging.getLogger(__name__)
_faults = 0  # bodies this reader failed on with an error of its own (a bug): logged once


class Unusual(Exception):
    """The body is not in a shape this reader takes; parse it with upb instead."""


# Field numbers each message defines: a known field this reader does not handle (or one with
# another wire type) is Unusual; an unknown one is skipped, as upb skips it. Each set holds every
# field the schemas up to SCHEMA_VERSION define, so with an older schema a field it lacks is
# Unusual here (the message path reads it, as upb would: an unknown field). A newer schema may
# define fields these sets lack, which this reader would skip where upb checks them: there the
# sets are read from the installed descriptors instead (see _schema_fields).
SCHEMA_VERSION = (1, 45)  # opentelemetry-proto
FIELDS: dict[str, frozenset[int]] = {
    "opentelemetry.proto.collector.trace.v1.ExportTraceServiceRequest": frozenset({1}),
    "opentelemetry.proto.trace.v1.ResourceSpans": frozenset({1, 2, 3}),
    "opentelemetry.proto.resource.v1.Resource": frozenset({1, 2, 3}),
    "opentelemetry.proto.trace.v1.ScopeSpans": frozenset({1, 2, 3}),
    "opentelemetry.proto.trace.v1.Span": frozenset(range(1, 17)),
    "opentelemetry.proto.trace.v1.Status": frozenset({2, 3}),
    "opentelemetry.proto.common.v1.AnyValue": frozenset(range(1, 9)),
    "opentelemetry.proto.common.v1.KeyValue": frozenset({1, 2, 3}),
    "opentelemetry.proto.common.v1.InstrumentationScope": frozenset({1, 2, 3, 4}),
    "opentelemetry.proto.trace.v1.Span.Event": frozenset({1, 2, 3, 4}),
    "opentelemetry.proto.trace.v1.Span.Link": frozenset({1, 2, 3, 4, 5, 6}),
}


def _installed_schema() -> tuple[int, ...] | None:
    """The installed opentelemetry-proto's (major, minor), read without importing protobuf."""
    try:
        from opentelemetry.proto.version import __version__
        return tuple(int(part) for part in __version__.split(".")[:2])
    except (ImportError, ValueError):
        return None


def _schema_fields() -> dict[str, frozenset[int]]:
    """FIELDS, or for a schema newer than SCHEMA_VERSION (or one that does not say), each message's
    field numbers as its descriptor has them."""
    installed = _installed_schema()
    if installed is not None and installed <= SCHEMA_VERSION:
        return FIELDS
    from google.protobuf import symbol_database
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: F401  (registers the schema)
    pool = symbol_database.Default().pool
    return {name: frozenset(field.number for field in pool.FindMessageTypeByName(name).fields) for name in FIELDS}


_fields = _schema_fields()
_KNOWN_REQUEST, _KNOWN_RESOURCE_SPANS, _KNOWN_RESOURCE, _KNOWN_SCOPE_SPANS, _KNOWN_SPAN, _KNOWN_STATUS, \
    _KNOWN_ANY_VALUE, _KNOWN_KEY_VALUE, _KNOWN_SCOPE, _KNOWN_EVENT, _KNOWN_LINK = _fields.values()


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller treats it as Unusual
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise Unusual("varint longer than 10 bytes")


def _length(data: bytes, pos: int, stop: int) -> tuple[int, int]:
    """A length-delimited field's (start, end), checked to lie inside ``stop``."""
    size = data[pos]
    if size < 0x80:
        pos += 1
    else:
        size, pos = _varint(data, pos)
    end = pos + size
    if end > stop:
        raise Unusual("field runs past its message")
    return pos, end


def _skip(data: bytes, pos: int, stop: int, tag: int, known: frozenset[int]) -> int:
    """Past an unknown field; a known one this reader does not handle is Unusual."""
    field, wire = tag >> 3, tag & 7
    if field == 0 or field in known:
        raise Unusual(f"field {field} (wire type {wire})")
    if wire == 0:
        _, pos = _varint(data, pos)
    elif wire == 1:
        pos += 8
    elif wire == 2:
        _, pos = _length(data, pos, stop)
    elif wire == 5:
        pos += 4
    else:
        raise Unusual(f"wire type {wire}")
    if pos > stop:
        raise Unusual("field runs past its message")
    return pos


def _tag(data: bytes, pos: int) -> tuple[int, int]:
    tag = data[pos]
    if tag < 0x80:
        return tag, pos + 1
    return _varint(data, pos)


def _text(data: bytes, start: int, end: int) -> str:
    try:
        return data[start:end].decode()
    except UnicodeDecodeError as exc:
        raise Unusual("invalid UTF-8") from exc


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


# -- the request, its resources, scopes and spans ------------------------------------------------
# A span's parts, in the order normalize.build_span takes them.
SpanParts = tuple[bytes, bytes, bytes, int, int, str, int, "int | None", dict[str, Any]]


def read_request(data: bytes) -> list[tuple[dict[str, Any], list[SpanParts]]]:
    """Every ResourceSpans of a body as (resource attributes, its spans' parts); Unusual when the
    body is not in a shape this reader takes. Read by the compiled reader where it was built (see
    the end of this module), else by the functions below."""
    try:
        return _read(data)
    except Unusual:
        raise
    except (IndexError, struct.error, RecursionError, UnicodeDecodeError) as exc:
        raise Unusual(type(exc).__name__) from exc
    except Exception as exc:  # a fault of this reader must cost speed, never a body
        global _faults
        _faults += 1
        if _faults == 1:
            log.warning("the OTLP byte reader failed (%r); such bodies are parsed with upb instead", exc)
        raise Unusual(type(exc).__name__) from exc


def _request(data: bytes) -> list[tuple[dict[str, Any], list[SpanParts]]]:
    out = []
    pos, stop = 0, len(data)
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            out.append(_resource_spans(data, start, pos))
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_REQUEST)
    return out


def _resource_spans(data: bytes, pos: int, stop: int) -> tuple[dict[str, Any], list[SpanParts]]:
    resource: dict[str, Any] = {}
    resource_count = 0
    spans: list[SpanParts] = []
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x12:  # scope_spans
            start, pos = _length(data, pos, stop)
            _scope_spans(data, start, pos, spans)
        elif tag == 0x0A:  # resource (occurrences merge: their attributes append)
            start, pos = _length(data, pos, stop)
            resource_count = _resource(data, start, pos, resource, resource_count)
        elif tag == 0x1A:  # schema_url
            start, pos = _length(data, pos, stop)
            _text(data, start, pos)
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_RESOURCE_SPANS)
    if pos > stop:
        raise Unusual("field runs past its resource spans")
    return resource, spans


def _resource(data: bytes, pos: int, stop: int, attrs: dict[str, Any], count: int) -> int:
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            count += 1
            if count > MAX_ATTRIBUTES:
                raise Unusual("more attributes than are kept")
            key, value = _key_value(data[start:pos])
            if key not in attrs:
                attrs[key] = value
        elif tag == 0x10:  # dropped_attributes_count
            _, pos = _varint(data, pos)
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_RESOURCE)
    if pos > stop:
        raise Unusual("field runs past its resource")
    return count


def _scope_spans(data: bytes, pos: int, stop: int, spans: list[SpanParts]) -> None:
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x12:
            start, pos = _length(data, pos, stop)
            spans.append(_span(data, start, pos))
        elif tag == 0x0A:  # scope: not kept, but read through
            start, pos = _length(data, pos, stop)
            _scope(data, start, pos)
        elif tag == 0x1A:  # schema_url
            start, pos = _length(data, pos, stop)
            _text(data, start, pos)
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_SCOPE_SPANS)
    if pos > stop:
        raise Unusual("field runs past its scope spans")


def _span(data: bytes, pos: int, stop: int) -> SpanParts:
    trace_id = span_id = parent = b""
    name = ""
    kind = start_ns = end_ns = 0
    status: int | None = None
    attrs: dict[str, Any] = {}
    count = 0
    cache_get = _KV_CACHE.get
    while pos < stop:
        tag = data[pos]
        pos += 1
        if tag & 7 == 2 and tag < 0x80:  # length-delimited: its bounds first, read inline
            size = data[pos]
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(data, pos)
            start = pos
            pos += size
            if pos > stop:
                raise Unusual("field runs past its span")
            if tag == 0x4A:  # attributes, the most frequent field first
                count += 1
                raw = data[start:pos]
                pair = cache_get(raw)
                if pair is None:
                    if count > MAX_ATTRIBUTES:
                        raise Unusual("more attributes than are kept")
                    pair = _key_value(raw)
                key = pair[0]
                if key not in attrs:
                    attrs[key] = pair[1]
            elif tag == 0x0A:
                trace_id = data[start:pos]
            elif tag == 0x12:
                span_id = data[start:pos]
            elif tag == 0x22:
                parent = data[start:pos]
            elif tag == 0x2A:
                name = _text(data, start, pos)
            elif tag == 0x7A:  # status: occurrences merge, field by field
                status = _status(data, start, pos, 0 if status is None else status)
            elif tag == 0x1A:  # trace_state
                _text(data, start, pos)
            elif tag == 0x5A:  # events, links: not kept, but read through
                _span_event(data, start, pos)
            elif tag == 0x6A:
                _span_link(data, start, pos)
            elif tag < 8 or tag >> 3 in _KNOWN_SPAN:  # field 0 is invalid; a known one unhandled
                raise Unusual(f"field {tag >> 3} (wire type 2)")
        elif tag == 0x39:
            start_ns = _FIXED64.unpack_from(data, pos)[0]
            pos += 8
        elif tag == 0x41:
            end_ns = _FIXED64.unpack_from(data, pos)[0]
            pos += 8
        elif tag == 0x30:
            value, pos = _varint(data, pos)
            kind = _signed(value, 32)
        elif tag == 0x50 or tag == 0x60 or tag == 0x70:  # dropped counts
            _, pos = _varint(data, pos)
        elif tag == 0x85 and data[pos] == 0x01:  # flags (field 16, fixed32)
            pos += 5
        else:
            tag, pos = _tag(data, pos - 1)
            pos = _skip(data, pos, stop, tag, _KNOWN_SPAN)
        if pos > stop:
            raise Unusual("field runs past its span")
    if count > MAX_ATTRIBUTES:
        raise Unusual("more attributes than are kept")
    return trace_id, span_id, parent, start_ns, end_ns, name, kind, status, attrs


def _status(data: bytes, pos: int, stop: int, code: int) -> int:
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x18:
            value, pos = _varint(data, pos)
            code = _signed(value, 32)
        elif tag == 0x12:
            start, pos = _length(data, pos, stop)
            _text(data, start, pos)
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_STATUS)
    if pos > stop:
        raise Unusual("field runs past its status")
    return code


# -- the sub-messages not kept: read through with the same checks, then dropped ------------------
# Each one's fields by tag, as what each holds (the kinds are numbered as in _otlp_wire.c).
_AS_TEXT, _AS_BYTES, _AS_KEY_VALUE, _AS_VARINT, _AS_FIXED64, _AS_FIXED32 = range(6)
# InstrumentationScope: name, version, attributes, dropped_attributes_count.
_SCOPE_FIELDS = {0x0A: _AS_TEXT, 0x12: _AS_TEXT, 0x1A: _AS_KEY_VALUE, 0x20: _AS_VARINT}
# Span.Event: time_unix_nano, name, attributes, dropped_attributes_count.
_EVENT_FIELDS = {0x09: _AS_FIXED64, 0x12: _AS_TEXT, 0x1A: _AS_KEY_VALUE, 0x20: _AS_VARINT}
# Span.Link: trace_id, span_id (bytes of any length), trace_state, attributes, dropped_attributes_count, flags.
_LINK_FIELDS = {0x0A: _AS_BYTES, 0x12: _AS_BYTES, 0x1A: _AS_TEXT, 0x22: _AS_KEY_VALUE, 0x28: _AS_VARINT,
                0x35: _AS_FIXED32}


def _scope(data: bytes, pos: int, stop: int) -> None:
    _read_through(data, pos, stop, _SCOPE_FIELDS, _KNOWN_SCOPE, "scope")


def _span_event(data: bytes, pos: int, stop: int) -> None:
    _read_through(data, pos, stop, _EVENT_FIELDS, _KNOWN_EVENT, "event")


def _span_link(data: bytes, pos: int, stop: int) -> None:
    _read_through(data, pos, stop, _LINK_FIELDS, _KNOWN_LINK, "link")


def _read_through(data: bytes, pos: int, stop: int, fields: dict[int, int], known: frozenset[int], what: str) -> None:
    """A message read field by field as ``fields`` says and dropped; its other fields as _skip says."""
    while pos < stop:
        tag, pos = _tag(data, pos)
        kind = fields.get(tag)
        if kind is None:
            pos = _skip(data, pos, stop, tag, known)
        elif kind == _AS_VARINT:
            _, pos = _varint(data, pos)
        elif kind in (_AS_FIXED64, _AS_FIXED32):
            pos += 8 if kind == _AS_FIXED64 else 4
        else:
            start, pos = _length(data, pos, stop)
            if kind == _AS_TEXT:
                _text(data, start, pos)
            elif kind == _AS_KEY_VALUE:
                _read_key_value(data, start, pos)
    if pos > stop:
        raise Unusual(f"field runs past its {what}")


def _read_key_value(data: bytes, pos: int, stop: int) -> None:
    """A key-value read as a kept one is (the same checks, the same limits), then dropped."""
    _, value_at = _kv_parts(data, pos, stop)
    if value_at is not None:
        _any_value(data, value_at[0], value_at[1], 0)


# -- attributes ---------------------------------------------------------------------------------
def _key_value(raw: bytes) -> tuple[str, Any]:
    """A span's or resource's key-value, from its own bytes: (key, value), remembered by those
    bytes when the value cannot be changed in place."""
    hit = _KV_CACHE.get(raw)
    if hit is not None:
        return hit
    pair = _plain_key_value(raw)
    if pair is None:
        key, value_at = _kv_parts(raw, 0, len(raw))
        pair = (key, None if value_at is None else _any_value(raw, value_at[0], value_at[1], 0))
    value = pair[1]
    if type(value) is not list and type(value) is not dict and len(raw) <= _KV_CACHE_BYTES:
        if len(_KV_CACHE) >= _KV_CACHE_MAX:
            _KV_CACHE.clear()
        _KV_CACHE[raw] = pair
    return pair


def _plain_key_value(raw: bytes) -> tuple[str, Any] | None:
    """The usual key-value read by position: a key, then a string, int, double or bool value,
    every length under 128 bytes; None for any other layout (then read field by field)."""
    size = len(raw)
    if size < 5 or raw[0] != 0x0A or raw[1] >= 0x80:
        return None
    key_end = 2 + raw[1]
    if key_end + 3 > size or raw[key_end] != 0x12 or raw[key_end + 1] != size - key_end - 2:
        return None
    key = _key_text(raw[2:key_end])
    value_tag = raw[key_end + 2]
    if value_tag == 0x0A:
        if raw[key_end + 3] != size - key_end - 4:
            return None
        return key, _text(raw, key_end + 4, size)  # under 128 bytes: never cut
    if value_tag == 0x18:
        value, end = _varint(raw, key_end + 3)
        return (key, _signed(value, 64)) if end == size else None
    if value_tag == 0x21 and size - key_end == 11:  # a double: the tag and 8 bytes, nothing else
        number = _DOUBLE.unpack_from(raw, key_end + 3)[0]
        return key, number if math.isfinite(number) else str(number)
    if value_tag == 0x10:
        value, end = _varint(raw, key_end + 3)
        return (key, (value & _U64) != 0) if end == size else None
    return None


def _key_text(raw: bytes) -> str:
    key = _KEYS.get(raw)
    if key is None:
        key = raw.decode()  # UnicodeDecodeError: Unusual, through read_request
        if len(_KEYS) >= _KV_CACHE_MAX:
            _KEYS.clear()
        _KEYS[raw] = key
    return key


def _any_value(data: bytes, pos: int, stop: int, depth: int) -> Any:
    """An AnyValue as plain Python, as ``collectors.attributes.any_value`` makes it."""
    result: Any = None
    seen = False
    while pos < stop:
        tag, pos = _tag(data, pos)
        field = tag >> 3
        if 1 <= field <= 8:
            if seen:
                raise Unusual("an AnyValue with two members")
            seen = True
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            result = _text(data, start, pos)
            if len(result) > MAX_STRING_CHARS:
                result = cut_text(result, MAX_STRING_CHARS)
        elif tag == 0x18:
            value, pos = _varint(data, pos)
            result = _signed(value, 64)
        elif tag == 0x10:
            value, pos = _varint(data, pos)
            result = (value & _U64) != 0
        elif tag == 0x21:
            number = _DOUBLE.unpack_from(data, pos)[0]
            pos += 8
            result = number if math.isfinite(number) else str(number)
        elif tag == 0x3A:
            start, pos = _length(data, pos, stop)
            result = cut_text(data[start:pos].hex(), MAX_STRING_CHARS)
        elif tag == 0x2A or tag == 0x32:
            start, pos = _length(data, pos, stop)
            if depth >= MAX_DEPTH:
                raise Unusual("values nested deeper than are kept")
            result = (_array if tag == 0x2A else _kvlist)(data, start, pos, depth + 1)
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_ANY_VALUE)
    if pos > stop:
        raise Unusual("field runs past its value")
    return result


def _array(data: bytes, pos: int, stop: int, depth: int) -> list[Any]:
    items: list[Any] = []
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            if len(items) == MAX_ARRAY_ITEMS:
                raise Unusual("more array items than are kept")
            items.append(_any_value(data, start, pos, depth))
        else:
            pos = _skip(data, pos, stop, tag, frozenset({1}))
    if pos > stop:
        raise Unusual("field runs past its array")
    return items


def _kvlist(data: bytes, pos: int, stop: int, depth: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    count = 0
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            count += 1
            if count > MAX_ARRAY_ITEMS:
                raise Unusual("more key-values than are kept")
            key, value_at = _kv_parts(data, start, pos)
            out[key] = None if value_at is None else _any_value(data, value_at[0], value_at[1], depth)
        else:
            pos = _skip(data, pos, stop, tag, frozenset({1}))
    if pos > stop:
        raise Unusual("field runs past its key-value list")
    return out


def _kv_parts(data: bytes, pos: int, stop: int) -> tuple[str, tuple[int, int] | None]:
    """A key-value's key (cut) and where its value lies (values are read at their depth)."""
    key = ""
    value_at: tuple[int, int] | None = None
    while pos < stop:
        tag, pos = _tag(data, pos)
        if tag == 0x0A:
            start, pos = _length(data, pos, stop)
            key = _text(data, start, pos)
        elif tag == 0x12:
            if value_at is not None:
                raise Unusual("a key-value with two values")
            value_at = _length(data, pos, stop)
            pos = value_at[1]
        else:
            pos = _skip(data, pos, stop, tag, _KNOWN_KEY_VALUE)
    if pos > stop:
        raise Unusual("field runs past its key-value")
    return (cut_text(key, MAX_KEY_CHARS) if len(key) > MAX_KEY_CHARS else key), value_at


# -- the compiled reader -------------------------------------------------------------------------
# collectors/_otlp_wire.c walks the same format with the same checks, function for function, in C
# (a span normalized, reading included, in about half the CPU: bench/ingest.py --compare-readers);
# the functions above stay the reference, and the reader where the extension was not built (no C
# compiler or Python headers at install). Both give the same answer for every body
# (tests/test_otlp_wire.py runs its cases on each reader; tests/test_otlp_wire_compiled.py
# compares the two on mutated bodies and random bytes).
def _hex_text(raw: bytes) -> str:
    return cut_text(raw.hex(), MAX_STRING_CHARS)


def _compiled() -> Any:
    try:
        from collectors import _otlp_wire  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        _otlp_wire.configure(
            Unusual, cut_text, _hex_text, {},
            (MAX_ATTRIBUTES, MAX_STRING_CHARS, MAX_ARRAY_ITEMS, MAX_DEPTH, MAX_KEY_CHARS, _KV_CACHE_MAX,
             _KV_CACHE_BYTES),
            tuple(_fields.values()))
    except Exception as exc:  # e.g. a schema with field numbers past 63: the Python reader reads
        log.warning("the compiled OTLP reader could not be set up (%s); spans are read in Python", exc)
        return None
    return _otlp_wire.read_request


READERS: dict[str, Any] = {"python": _request}
_compiled_read = _compiled()
if _compiled_read is not None:
    READERS["compiled"] = _compiled_read
_read = READERS.get("compiled", _request)


def reader() -> str:
    """Which reader reads bodies: "compiled" or "python"."""
    return "compiled" if _read is READERS.get("compiled") else "python"


def use_reader(name: str) -> None:
    """Read bodies with the named reader of READERS (tests and benches compare the two)."""
    global _read
    _read = READERS[name]
