"""Trace and span ids as what the correlator keeps for its 15-minute horizon holds them.

An id kept for the horizon is kept once per request, tens of thousands of times at a steady rate;
as text, 32 hex digits take 81 bytes and a tuple of a trace and a span id 202. As the number the
digits spell they take 44 and 52. Only ids that come back exactly from their number are held so
(``int`` also reads upper case, signs, spaces and underscores, which would make two texts one key):
anything else is held as it came, so no two ids ever share a key.
"""

from __future__ import annotations

TRACE_DIGITS, SPAN_DIGITS = 32, 16

HexKey = int | str
SpanKey = int | tuple[str, str]


def hex_key(text: str, digits: int = TRACE_DIGITS) -> HexKey:
    """``text`` as the number its ``digits`` lowercase hex digits spell, or ``text`` itself."""
    if len(text) == digits:
        try:
            number = int(text, 16)
        except ValueError:
            return text
        if f"{number:0{digits}x}" == text:
            return number
    return text


def hex_text(key: HexKey, digits: int = TRACE_DIGITS) -> str:
    """The text a ``hex_key`` was made from."""
    return f"{key:0{digits}x}" if isinstance(key, int) else key


def span_key(trace_id: str, span_id: str) -> SpanKey:
    """A span as one number (its trace id's digits, then its span id's), or the pair of texts."""
    if len(trace_id) == TRACE_DIGITS and len(span_id) == SPAN_DIGITS:
        key = hex_key(trace_id + span_id, TRACE_DIGITS + SPAN_DIGITS)
        if isinstance(key, int):
            return key
    return trace_id, span_id
