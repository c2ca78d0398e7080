"""The compiled OTLP byte reader (``collectors/_otlp_wire.c``) against the Python one it mirrors.

``tests/test_otlp_wire.py`` runs every case of the byte reader against upb's message path on each
reader; here the compiled one must give the Python one's answer exactly (the parts' ``repr``, so
value types and order count) on mutated bodies with long varints where tags and lengths were, on
random bytes, and at the edges of its buffers. Skipped, with the reason, where the extension was
not built, unless this host could have built it.
"""

from __future__ import annotations

import os
import shutil
import struct
import sysconfig
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from collectors import otlp_wire
from collectors.otlp_wire import Unusual
from tests.test_otlp_wire import CASES, _body, _field, _mutate, _requests, _span_bytes


def missing_build_tools() -> str | None:
    """What this host lacks to build the project's C extensions at install ("C compiler" or
    "Python headers"), or None where it has both."""
    headers = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
    compiler = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0])
    return None if headers and compiler else "C compiler" if headers else "Python headers"


def test_the_compiled_reader_is_built_where_it_can_be() -> None:
    """Where a C compiler and Python's headers are, the install builds the compiled reader and
    bodies are read by it: a build that fails there must fail this test, not pass unseen."""
    missing = missing_build_tools()
    if missing:
        pytest.skip(f"no {missing} here: the Python reader reads bodies")
    assert "compiled" in otlp_wire.READERS, "the install did not build collectors/_otlp_wire.c"
    assert otlp_wire.reader() == "compiled"


needs_compiled = pytest.mark.skipif("compiled" not in otlp_wire.READERS,
                                    reason="the compiled OTLP reader is not built here")


# What read_request turns into Unusual from the Python reader: reading past the end of the body
# is how it finds a body cut short. The compiled reader raises Unusual itself, and nothing else.
_PYTHON_UNUSUAL = (Unusual, IndexError, struct.error, UnicodeDecodeError, RecursionError)


def _both(body: bytes) -> str:
    """The two readers' answers to ``body``, which must be the same: their parts' repr (so a bool is
    not taken for an int, nor a dict's order ignored), or that both found it Unusual."""
    answers = []
    for name, unusual in (("python", _PYTHON_UNUSUAL), ("compiled", Unusual)):
        try:
            answers.append(repr(otlp_wire.READERS[name](body)))
        except unusual:
            answers.append("Unusual")
    assert answers[0] == answers[1], body
    return answers[0]


@needs_compiled
@CASES
@given(_requests().filter(lambda r: r.ByteSize() > 0), st.data())
def test_the_compiled_reader_answers_as_the_python_one(request: ExportTraceServiceRequest, data: Any) -> None:
    body = bytearray(request.SerializeToString())
    _both(bytes(body))
    for _ in range(data.draw(st.integers(1, 6))):
        _mutate(body, data, long_varints=True)
        if not body:
            return
        _both(bytes(body))


@needs_compiled
@CASES
@given(st.binary(max_size=64))
def test_the_compiled_reader_answers_garbage_as_the_python_one(body: bytes) -> None:
    _both(body)
    _both(_body(body))


@needs_compiled
def test_the_compiled_reader_at_the_edges_of_its_buffers() -> None:
    span = _span_bytes(http_method="POST")
    cases = [
        b"\x0a" + b"\xff" * 9 + b"\x01",  # a length past 64 bits
        b"\x0a" + b"\xff" * 9 + b"\x7f",
        b"\xff" * 9 + b"\x02" + b"\x00",  # a tag past 64 bits: an unknown field of wire type 0
        _body(span + b"\x39\x01\x02"),  # start time cut short at the end of the body
        _body(span + b"\x85"),  # flags' tag cut short
        _body(span + b"\x85\x01\x00"),
        _body(span + _field(9, _field(1, b"d") + _field(2, b"\x21\x00\x00"))),  # a double cut short
        _body(span + _field(9, _field(1, b"k") + _field(2, _field(5, _field(1, _field(5, b""))) * 3))),
        _body(span + _field(9, _field(1, b"k" * 300) + _field(2, _field(1, b"v")))),  # a key cut
        _body(span + _field(9, _field(1, b"b") + _field(2, _field(7, bytes(range(256)) * 10)))),
    ]
    nested = _field(1, b"")
    for _ in range(8):  # deeper than kept
        nested = _field(5, _field(1, nested))
    cases.append(_body(span + _field(9, _field(1, b"n") + _field(2, nested))))
    answers = [_both(body) for body in cases]
    assert answers.count("Unusual") >= 5, answers
    assert "kkk" in answers[8] and "...[truncated]" in answers[8]


@needs_compiled
def test_a_compiled_reader_that_cannot_be_set_up_leaves_the_python_one(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    from collectors import _otlp_wire  # type: ignore[attr-defined]

    def refuse(*_args: Any) -> None:
        raise ValueError("field number 64 is outside 0-63")

    monkeypatch.setattr(_otlp_wire, "configure", refuse)
    assert otlp_wire._compiled() is None
    assert "the compiled OTLP reader could not be set up (field number 64 is outside 0-63)" in caplog.text
