"""HTTP/1.x serving for the daemon's two small HTTP endpoints: the OTLP/HTTP receiver and ``/metrics``.

Not the standard library's ``http.server``: importing it loads ``http.client``, which loads ``ssl``
(OpenSSL's libcrypto) and the ``email`` package, 6.7 MiB in a fresh interpreter
(bench/import_cost.py), for a daemon that never speaks TLS (docs/footprint.md, forty-fourth pass).
What the two endpoints need is small and here:

- the request line read as ``http.server`` reads it (the same 400 and 505 answers; tests compare
  the two line by line), except that HTTP/0.9's two-word line is refused with 400;
- headers read without the email package, by lower-case name, the first of a repeated one winning;
  a line without a colon, a space before the colon or a folded line refused with 400, more than
  100 headers or a line over 64 KiB with 431;
- keep-alive (HTTP/1.1 unless ``Connection: close``; HTTP/1.0 only with ``keep-alive``) and
  ``Expect: 100-continue``;
- a socket timeout per connection, so a sender that stalls mid-request is cut off instead of
  holding a thread, and a cap on concurrent connections: past it a connection gets 503 at once.

A subclass of :class:`Handler` implements ``do_<METHOD>`` and answers with :meth:`Handler.answer`;
a method it does not implement gets 501.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import socketserver
import threading
import time
from _operator import _compare_digest  # hmac.compare_digest without OpenSSL: hmac loads hashlib
from http import HTTPStatus
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

MAX_REQUEST_LINE = 65536  # as http.server
MAX_HEADER_LINE = 65536  # as http.client
MAX_HEADERS = 100
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class RequestLine(NamedTuple):
    command: str
    path: str
    version: str  # as sent: "HTTP/1.1"
    keep_alive: bool  # the version's default: HTTP/1.1 and later


def parse_request_line(raw: bytes) -> RequestLine | tuple[int, str] | None:
    """One request line (its CRLF included): the request, the status and reason to refuse it with,
    or None for an empty line (the client sent nothing more: close without answering)."""
    text = raw.decode("iso-8859-1").rstrip("\r\n")
    words = text.split()
    if not words:
        return None
    keep_alive = False
    if len(words) >= 3:
        version = words[-1]
        number = _version_number(version)
        if number is None:
            return 400, f"Bad request version ({version!r})"
        if number >= (2, 0):
            return 505, f"Invalid HTTP version ({version.split('/', 1)[1]})"
        keep_alive = number >= (1, 1)
    if len(words) == 2:
        return 400, f"HTTP/0.9 requests are not served ({text[:100]!r}); send HTTP/1.1"
    if len(words) != 3:
        return 400, f"Bad request syntax ({text[:100]!r})"
    command, path, version = words
    if path.startswith("//"):  # as http.server: "//x" would read as a host name to urlsplit
        path = "/" + path.lstrip("/")
    return RequestLine(command, path, version, keep_alive)


def _version_number(version: str) -> tuple[int, int] | None:
    """``HTTP/major.minor`` as http.server takes it: digits only, at most ten a part."""
    if not version.startswith("HTTP/"):
        return None
    parts = version.split("/", 1)[1].split(".")
    if len(parts) != 2 or any(not part.isdigit() or len(part) > 10 for part in parts):
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:  # isdigit() takes digits int() does not ("²")
        return None


class Headers(dict[str, str]):
    """Request headers by lower-case name, the first of a repeated one winning."""

    def get(self, name: str, default: Any = None) -> Any:
        return super().get(name.lower(), default)


def read_headers(rfile: Any) -> Headers | tuple[int, str]:
    """The header block, up to its empty line; or the status and reason to refuse it with."""
    headers = Headers()
    for _ in range(MAX_HEADERS + 1):
        line = rfile.readline(MAX_HEADER_LINE + 1)
        if len(line) > MAX_HEADER_LINE:
            return 431, "Line too long"
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, colon, value = line.decode("iso-8859-1").partition(":")
        # No name, space before the colon, or a folded line (obsolete, RFC 9112 5.2): refused.
        if not colon or not name or name != name.strip() or name[0] in " \t":
            return 400, f"Bad header line {line[:100]!r}"
        headers.setdefault(name.lower(), value.strip())
    return 431, "Too many headers"


def bearer_matches(header: str | None, token: str | None) -> bool:
    """An ``Authorization`` header against ``Bearer <token>`` in time that does not depend on where
    they differ (the C comparison behind ``hmac.compare_digest``); any header matches no token."""
    if token is None:
        return True
    return _compare_digest((header or "").strip().encode("utf-8", "replace"), f"Bearer {token}".encode())


def http_date(now: float | None = None) -> str:
    """An IMF-fixdate (RFC 9110 5.6.7), not by the locale's names."""
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class Server(socketserver.ThreadingTCPServer):
    """A thread a connection, at most ``max_connections`` at once; each socket times out after
    ``socket_timeout_s`` of silence."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: type[Handler], *, max_connections: int = 64,
                 socket_timeout_s: float = 15.0, name: str = "HTTP") -> None:
        self.max_connections = max_connections
        self.socket_timeout_s = socket_timeout_s
        self.name = name
        self._slots = threading.BoundedSemaphore(max_connections)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET  # "::1", "::"
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Bound the threads: a connection storm gets an immediate 503 instead of a thread each.
        if not self._slots.acquire(blocking=False):
            self.refused_busy()
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n"
                                b"Content-Length: 0\r\nConnection: close\r\n\r\n")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def refused_busy(self) -> None:
        """Called for each connection answered 503 for want of a slot."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A broken connection is the client's business; log it quietly instead of a traceback.
        log.debug("%s connection from %s ended with an error", self.name, client_address, exc_info=True)


class Handler(socketserver.StreamRequestHandler):
    """One connection: requests read one after another while it is kept alive."""

    server: Server
    server_name = "auditor"
    disable_nagle_algorithm = True  # an answer is one write, but the 100 Continue before it is another
    command = path = request_version = ""
    headers: Headers
    close_connection = True

    def setup(self) -> None:
        self.request.settimeout(self.server.socket_timeout_s)
        super().setup()

    def handle(self) -> None:
        self.close_connection = True
        self._one_request()
        while not self.close_connection:
            self._one_request()

    def _one_request(self) -> None:
        self.command = self.path = self.request_version = ""
        self.headers = Headers()
        try:
            raw = self.rfile.readline(MAX_REQUEST_LINE + 1)
            if len(raw) > MAX_REQUEST_LINE:
                self.refuse(414, "Request line too long")
                return
            line = parse_request_line(raw) if raw else None
            if line is None:
                self.close_connection = True
                return
            if not isinstance(line, RequestLine):
                self.refuse(*line)
                return
            self.command, self.path, self.request_version, keep_alive = line
            self.close_connection = not keep_alive
            headers = read_headers(self.rfile)
            if isinstance(headers, tuple):
                self.refuse(*headers)
                return
            self.headers = headers
            connection = headers.get("Connection", "").lower()
            if connection == "close":
                self.close_connection = True
            elif connection == "keep-alive":
                self.close_connection = False
            if headers.get("Expect", "").lower() == "100-continue" and keep_alive:
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            method = getattr(self, "do_" + self.command, None)
            if method is None:
                self.refuse(501, f"Unsupported method ({self.command[:40]!r})")
                return
            method()
        except TimeoutError:
            log.debug("%s connection from %s timed out", self.server.name, self.client_address[0])
            self.close_connection = True

    # -- answering --------------------------------------------------------------------------
    def answer(self, status: int, body: bytes, *, content_type: str,
               extra: dict[str, str] | None = None) -> None:
        """Send a complete answer in one write (no body for HEAD); a failed write closes."""
        head = [f"HTTP/1.1 {status} {_phrase(status)}", f"Server: {self.server_name}", f"Date: {http_date()}",
                f"Content-Type: {content_type}", f"Content-Length: {len(body)}"]
        head.extend(f"{name}: {value}" for name, value in (extra or {}).items())
        if self.close_connection:
            head.append("Connection: close")
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        try:
            self.wfile.write(data if self.command == "HEAD" else data + body)
        except OSError:
            self.close_connection = True

    def refuse(self, status: int, reason: str) -> None:
        """An error answer in plain text, then close: where the next request would start is not known."""
        self.close_connection = True
        log.debug("%s %s from %s: %s", self.server.name, status, self.client_address[0], reason)
        self.answer(status, f"{status} {_phrase(status)}: {reason}\n".encode("utf-8", "replace"),
                    content_type="text/plain; charset=utf-8")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"
