"""bcc's view of the probe's kernel event record, for fast batch decoding; the decoding itself is
``auditor.kernelrecord``'s (the store decodes the same records)."""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

from auditor.kernelrecord import (  # noqa: F401  the probe's names for them
    _FIELDS,
    AF_INET,
    AF_INET6,
    COOKIE_MASK,
    KIND_BY_CODE,
    RECORD,
    EventBuilder,
)


def struct_format(event_class: Any) -> struct.Struct:
    """A struct.Struct equal to bcc's view of ``struct event``, for fast batch decoding."""
    codes = {ctypes.c_ulonglong: "Q", ctypes.c_ulong: "Q", ctypes.c_uint: "I", ctypes.c_ushort: "H",
             ctypes.c_ubyte: "B", ctypes.c_longlong: "q", ctypes.c_int: "i", ctypes.c_short: "h"}
    fmt = "="  # native byte order, no implicit padding: gaps are spelled out below
    position = 0
    for name, ctype in event_class._fields_:
        field = getattr(event_class, name)
        if field.offset > position:
            fmt += f"{field.offset - position}x"
        if getattr(ctype, "_length_", None):  # u8[16] arrives as bytes
            fmt += f"{field.size}s"
        else:
            fmt += codes[ctype]
        position = field.offset + field.size
    if ctypes.sizeof(event_class) > position:
        fmt += f"{ctypes.sizeof(event_class) - position}x"
    return struct.Struct(fmt)


def is_stored_layout(record: struct.Struct) -> bool:
    """Whether bcc's record is ``auditor.kernelrecord.RECORD`` on a little-endian machine: then
    the store can keep records as the ring buffer holds them."""
    return sys.byteorder == "little" and record.size == RECORD.size and \
        struct.Struct("<" + record.format.lstrip("=@<>!")).format == RECORD.format
