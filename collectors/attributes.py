"""OTLP attribute values as plain, bounded Python: the decoding half of span normalization.

A hostile or buggy exporter cannot blow up the database or the daemon's memory through attributes:
counts, string lengths and nesting are bounded here, and typed reads treat a value of the wrong
type as missing instead of failing the span.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from auditor.semconv import GENAI_OPERATION, EngineSpans

if TYPE_CHECKING:  # the message path's types; protobuf is imported where a body needs it
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

# Bounds on what one span may store: enough for any real instrumentation, small enough that a
# hostile exporter cannot blow up the database or the daemon's memory.
MAX_ATTRIBUTES = 128
MAX_STRING_CHARS = 4096
MAX_ARRAY_ITEMS = 64
MAX_DEPTH = 4  # AnyValue array/kvlist nesting kept; deeper values become a marker string
MAX_KEY_CHARS = 256
TRUNCATED_MARK = "...[truncated]"
TOO_DEEP_MARK = "[nested too deep]"
_MAX_PID = 2**31 - 1  # pids are signed 32-bit


def cut_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - len(TRUNCATED_MARK))] + TRUNCATED_MARK


def any_value(value: AnyValue, depth: int = 0) -> Any:
    """Convert an OTLP AnyValue to plain JSON-able Python, bounded in size and depth."""
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return cut_text(value.string_value, MAX_STRING_CHARS)
    if kind == "int_value":
        return value.int_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "double_value":
        number = value.double_value
        # NaN and infinities are not JSON; keep them readable instead of poisoning the row.
        return number if math.isfinite(number) else str(number)
    if kind == "bytes_value":
        return cut_text(value.bytes_value.hex(), MAX_STRING_CHARS)
    if kind == "array_value":
        if depth >= MAX_DEPTH:
            return TOO_DEEP_MARK
        return [any_value(item, depth + 1) for item in value.array_value.values[:MAX_ARRAY_ITEMS]]
    if kind == "kvlist_value":
        if depth >= MAX_DEPTH:
            return TOO_DEEP_MARK
        return {cut_text(kv.key, MAX_KEY_CHARS): any_value(kv.value, depth + 1)
                for kv in kv_slice(value.kvlist_value.values, MAX_ARRAY_ITEMS)}
    return None


def kv_slice(values: Any, limit: int) -> Any:
    return values if len(values) <= limit else values[:limit]


def attributes_dict(values: Any) -> tuple[dict[str, Any], int]:
    """Attributes as a dict (first value of a repeated key wins) and how many were dropped."""
    out: dict[str, Any] = {}
    kept: list[KeyValue] = kv_slice(values, MAX_ATTRIBUTES)
    for kv in kept:
        key = kv.key
        if len(key) > MAX_KEY_CHARS:
            key = cut_text(key, MAX_KEY_CHARS)
        if key in out:
            continue
        # Hot path: most attributes are plain strings and ints; everything else goes the long way.
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "string_value":
            text = value.string_value
            out[key] = text if len(text) <= MAX_STRING_CHARS else cut_text(text, MAX_STRING_CHARS)
        elif kind == "int_value":
            out[key] = value.int_value
        else:
            out[key] = any_value(value)
    return out, len(values) - len(kept)


# -- typed reads of attribute values; anything of the wrong type reads as missing -------------
def first_of(attrs: dict[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        value = attrs.get(key)
        if value is not None and value != "":
            return key, value
    return None, None


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        # ASCII digits only: str.isdigit() also takes "²", which int() refuses, and "١٢".
        if text.isascii() and text.isdigit() and len(text) < 19:
            return int(text)
    return None


def as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
        return number if math.isfinite(number) else None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def as_str(value: Any) -> str | None:
    """A string, or the first string of a list (captured headers and finish reasons are lists)."""
    if type(value) is str:
        return value
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, str):
        return value
    return None


def as_finish(value: Any) -> str | None:
    """A finish reason: ``as_str``'s, and the first of a list sent as JSON text (vLLM sets
    ``gen_ai.response.finish_reasons`` to ``json.dumps(["stop"])``, a string, not an array)."""
    text = as_str(value)
    if text is None or not text.startswith("["):
        return text
    try:
        reasons = json.loads(text)
    except (ValueError, RecursionError):
        return text
    if isinstance(reasons, list) and reasons and isinstance(reasons[0], str):
        return reasons[0]
    return text


def as_port(value: Any) -> int | None:
    port = as_int(value)
    return port if port is not None and 0 <= port <= 65535 else None


def as_pid(value: Any) -> int | None:
    number = as_int(value)
    return number if number is not None and 0 < number <= _MAX_PID else None


def as_count(value: Any) -> int | None:
    number = as_int(value)
    return number if number is not None and 0 <= number < 2**31 else None


def port_from_hostport(text: Any) -> int | None:
    """The port of "host:port", "[v6]:port" or a URL; None when there is none."""
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = urlsplit(text if "://" in text else f"//{text.split(',')[0].strip()}")
        return parsed.port
    except ValueError:
        return None


def take(attrs: dict[str, Any], keys: tuple[str, ...], convert: Any) -> Any:
    """The first of ``keys`` whose value converts, removed from ``attrs`` (it becomes a column).
    Aliases holding the same value (``http/dup``) go too; an alias that disagrees stays."""
    chosen = None
    for key in keys:
        value = attrs.get(key)
        if value is None:
            continue
        converted = convert(value)
        if converted is None:
            continue
        if chosen is None:
            chosen = converted
        if converted == chosen:
            del attrs[key]
    return chosen


def take_one(attrs: dict[str, Any], key: str, convert: Any) -> Any:
    value = attrs.get(key)
    if value is None:
        return None
    converted = convert(value)
    if converted is not None:
        del attrs[key]
    return converted


# -- which spans are engine spans (the daemon sets the configured names at start) ---------------
_engine_spans = EngineSpans()


def configure_engine_spans(names: list[str]) -> None:
    """Engine span names besides vLLM's (``[spans] engine_names``), for every later normalization."""
    global _engine_spans
    _engine_spans = EngineSpans(names)


def is_engine_span(name: str, kind: str, attrs: dict[str, Any], http: bool) -> bool:
    return _engine_spans.matches(name, kind, attrs.get(GENAI_OPERATION), http=http)
