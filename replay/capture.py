"""Capture files: a slice of observed traffic as a standalone SQLite store, to replay elsewhere.

A capture holds one row per request that entered the host (the outermost HTTP server span of its
trace: a gateway's hop to the engine is part of the same request, not another one), with its
start offset in the window, route, model, token counts, and, where the client left early, when
and how it left and what the auditor judged then. Prompts are not in spans, so the body replayed
is synthetic: a prompt of the captured length, the captured ``max_tokens``, ``stream`` as the
captured response's content type says (else the export's default).

The file is an auditor store (same schema and migrations), so ``auditor replay`` writes its runs
and verdicts into it, and a later run compares with an earlier one in the same file.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Text, and_, func, select, type_coerce
from sqlalchemy.orm import aliased

from auditor.errors import AuditorError
from auditor.model import NEAR_MINUTES, SpanRole, minutes_around
from auditor.store import (
    CapturedRequestRow,
    CaptureRow,
    SpanRow,
    Store,
    VerdictRow,
    found_near,
    sqlite_database,
)

DEFAULT_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
DEFAULT_PROMPT_TOKENS = 16
DEFAULT_MAX_TOKENS = 64
BATCH = 5000


class CaptureError(AuditorError):
    """A capture file that cannot be read or written; the message says what to do."""


@dataclass(frozen=True, slots=True)
class CapturedRequest:
    offset_s: float  # start, relative to the capture's window start
    path: str
    body: dict[str, Any]
    disconnect_after_s: float | None = None  # from the request's start; None: the client stayed
    disconnect_kind: str | None = None  # "fin" or "rst"
    original_verdict: str | None = None


@dataclass(frozen=True, slots=True)
class Capture:
    id: int
    name: str
    window_start_ns: int
    window_end_ns: int
    source: str
    requests: list[CapturedRequest]


def synthetic_body(path: str, model: str | None, prompt_tokens: int | None, max_tokens: int | None,
                   stream: bool) -> dict[str, Any]:
    """An OpenAI-style body with a prompt of about ``prompt_tokens`` words. Without a model the
    body has none: replay then asks for ``--model`` rather than send a name nobody captured."""
    prompt = " ".join(["token"] * max(1, prompt_tokens or DEFAULT_PROMPT_TOKENS))
    body: dict[str, Any] = {"max_tokens": max_tokens or DEFAULT_MAX_TOKENS, "stream": stream}
    if model:
        body["model"] = model
    if path == CHAT_PATH:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _streamed(attributes: dict[str, Any] | None) -> bool | None:
    for key in ("http.response.header.content_type", "http.response.header.content-type"):
        value = (attributes or {}).get(key)
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, str):
            return "text/event-stream" in value
    return None


# How far an engine span in a trace of its own may start from its request's window.
ENGINE_MARGIN_NS = 600 * 10**9


def _request_id_key(engine_request_id: str) -> str:
    """The X-Request-Id an engine request id came from: vLLM names a request that arrived with
    ``X-Request-Id: <id>`` ``cmpl-<id>`` or ``chatcmpl-<id>`` (as the correlator reads it)."""
    for prefix in ("chatcmpl-", "cmpl-"):
        if engine_request_id.startswith(prefix):
            return engine_request_id[len(prefix):]
    return engine_request_id


def _near(relative: Any, span: Any, *where: Any) -> Any:
    """A ``relative`` (a mapped alias of spans) that meets ``where`` started within a minute of
    ``span`` (the store keys spans by start minute first: auditor/store/spankeys.py)."""
    return found_near(relative.start_minute, span.start_minute, NEAR_MINUTES, *where)


def _engine_by_request_id(session: Any, since_ns: int, until_ns: int) -> dict[str, tuple[Any, ...]]:
    """(model, prompt tokens, max tokens) of the engine spans that are traces of their own (vLLM
    without a client ``traceparent``, as the openai SDK sends), by the X-Request-Id they came from."""
    engine, server = aliased(SpanRow), aliased(SpanRow)
    in_a_request = _near(server, engine, server.trace_id == engine.trace_id, server.role == SpanRole.HTTP_SERVER.value)
    query = (select(engine.request_id, engine.model, engine.prompt_tokens, engine.max_tokens)
             .where(engine.role == SpanRole.ENGINE.value, engine.request_id.is_not(None),
                    engine.start_ns >= since_ns - ENGINE_MARGIN_NS, engine.start_ns < until_ns + ENGINE_MARGIN_NS,
                    ~in_a_request))
    found: dict[str, tuple[Any, ...]] = {}
    for request_id, model, prompt_tokens, max_tokens in session.execute(query).yield_per(BATCH):
        found[_request_id_key(request_id)] = (model, prompt_tokens, max_tokens)
    return found


def _entry_requests(store: Store, since_ns: int, until_ns: int, host: str | None,
                    stream_default: bool) -> Iterator[CapturedRequest]:
    """Every request that entered a host in the window, in start order."""
    server = aliased(SpanRow)
    hop = aliased(SpanRow)
    engine = aliased(SpanRow)
    is_hop = and_(server.parent_span_id.is_not(None),
                  _near(hop, server, hop.trace_id == server.trace_id, hop.span_id == server.parent_span_id,
                        hop.role == SpanRole.HTTP_CLIENT.value))
    # The first engine span of the trace stored in the nearest minute that holds one.
    first_engine = func.coalesce(*(
        select(func.min(engine.id)).where(engine.start_minute == minute, engine.trace_id == server.trace_id,
                                          engine.role == SpanRole.ENGINE.value).correlate(server).scalar_subquery()
        for minute in minutes_around(server.start_minute, NEAR_MINUTES)))
    query = (select(server.trace_id, server.span_id, server.start_ns, server.route, server.model,
                    server.request_id, server.attributes, engine.model.label("engine_model"), engine.prompt_tokens,
                    engine.max_tokens)
             .outerjoin(engine, engine.id == first_engine)
             .where(server.role == SpanRole.HTTP_SERVER.value, server.start_ns >= since_ns,
                    server.start_ns < until_ns, ~is_hop)
             .order_by(server.start_ns))
    if host:
        query = query.where(server.host == host)
    with store.session() as session:
        # Verdicts are few (one per disconnect) and keyed "<host>/<trace>/<server span>": held in memory.
        verdicts = {}
        for v in session.execute(select(VerdictRow.request_key, VerdictRow.trace_id, VerdictRow.verdict,
                                        VerdictRow.disconnect_at_ns, VerdictRow.request_start_ns,
                                        VerdictRow.disconnect_kind)
                                 .where(VerdictRow.request_start_ns >= since_ns - 3600 * 10**9,
                                        VerdictRow.request_start_ns < until_ns)):
            verdicts[(v.trace_id, v.request_key.rsplit("/", 1)[-1])] = v
        apart = _engine_by_request_id(session, since_ns, until_ns)
        for row in session.execute(query).yield_per(BATCH):
            path = row.route if row.route in (DEFAULT_PATH, CHAT_PATH) else DEFAULT_PATH
            streamed = _streamed(row.attributes)
            model, prompt_tokens, max_tokens = row.engine_model, row.prompt_tokens, row.max_tokens
            if model is None and prompt_tokens is None and max_tokens is None and row.request_id:
                model, prompt_tokens, max_tokens = apart.get(row.request_id, (None, None, None))
            body = synthetic_body(path, model or row.model, prompt_tokens, max_tokens,
                                  stream_default if streamed is None else streamed)
            verdict = verdicts.get((row.trace_id, row.span_id))
            after = None
            if verdict is not None:
                after = max(0.0, (verdict.disconnect_at_ns - row.start_ns) / 1e9)
            yield CapturedRequest(
                offset_s=(row.start_ns - since_ns) / 1e9, path=path, body=body, disconnect_after_s=after,
                disconnect_kind=verdict.disconnect_kind if verdict is not None else None,
                original_verdict=verdict.verdict if verdict is not None else None)


def count_server_spans(store: Store, since_ns: int, until_ns: int, host: str | None = None) -> int:
    """HTTP server spans starting in the window: what an export reads (gateway hops included), for
    a progress bar."""
    query = select(func.count()).select_from(SpanRow).where(
        SpanRow.role == SpanRole.HTTP_SERVER.value, SpanRow.start_ns >= since_ns, SpanRow.start_ns < until_ns)
    if host:
        query = query.where(SpanRow.host == host)
    with store.session() as session:
        return int(session.scalar(query) or 0)


def export_capture(store: Store, out: Path, *, since_ns: int, until_ns: int, host: str | None = None,
                   name: str = "", stream_default: bool = True, force: bool = False,
                   on_progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Write the window's requests to a new capture file; returns (capture id, requests).
    ``on_progress`` gets the number of requests written since its last call."""
    check_output(out, force=force, store=store)
    return replace_capture(out, _entry_requests(store, since_ns, until_ns, host, stream_default), name=name,
                           window_start_ns=since_ns, window_end_ns=until_ns, source=store.where(),
                           on_progress=on_progress)


def _store_file(store: Store) -> Path | None:
    """The SQLite file a store reads, or None for a server or an in-memory database."""
    database = sqlite_database(store.url)
    return None if database is None else Path(database.removeprefix("file:"))


def _same_file(a: Path, b: Path) -> bool:
    try:
        if os.path.samefile(a, b):
            return True
    except OSError:
        pass  # one of them does not exist (yet)
    return a.resolve() == b.resolve()


def check_output(out: Path, *, force: bool, store: Store | None = None) -> None:
    """Refuse an output path a capture cannot safely be written to: no name, the store being read
    (writing would destroy what is exported), something that exists without ``force``, or anything
    but a regular file (a device, a directory)."""
    if str(out) == "-":
        raise CaptureError("a capture is a SQLite file, which cannot go to standard output (-o -); "
                           "give the file's name, e.g. -o capture.db")
    if not str(out) or not out.name or out.name == "..":
        raise CaptureError(f"the output path {str(out)!r} is empty or a directory; give the capture file's name, "
                           "e.g. -o capture.db")
    source = _store_file(store) if store is not None else None
    if store is not None and source is not None and _same_file(source, out):
        raise CaptureError(f"{out} is the database being exported ({store.where()}); "
                           "write the capture to another file, e.g. -o capture.db")
    if out.exists() or out.is_symlink():
        if not force:
            raise CaptureError(f"{out} exists; pass --force to replace it, or another -o")
        if not out.is_file():
            raise CaptureError(f"{out} is not a regular file; --force replaces only a file: pass another -o")
        if (reason := _not_a_capture(out)) is not None:
            raise CaptureError(f"{out} {reason}; --force replaces only a capture file: pass another -o, "
                               "or remove it yourself if it is to go")


# Tables a capture file leaves empty: rows there are a daemon's record, which no capture replaces.
_RECORDED_TABLES = ("spans", "verdicts", "conn_event_blocks", "util_samples")


def _not_a_capture(path: Path) -> str | None:
    """Why ``path`` is not a file --force may replace, None where it is: an empty file, or an
    auditor file holding captures and no recorded traffic. Read-only."""
    try:
        if path.stat().st_size == 0:
            return None
        # immutable: no -wal or -shm left beside a file that may stay (a read-only open makes them);
        # what a writer has not checkpointed yet is unseen, which can only refuse more.
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro&immutable=1", uri=True, timeout=5)
    except (OSError, ValueError, sqlite3.Error) as exc:
        return f"cannot be read to tell whether it is a capture ({exc})"
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "captures" not in tables or "alembic_version" not in tables:
            return "holds no capture"
        recorded = [t for t in _RECORDED_TABLES  # whether any row, not how many: a store may be large
                    if t in tables and conn.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone()]
    except sqlite3.DatabaseError:
        return "holds no capture (not a SQLite database)"
    finally:
        conn.close()
    if recorded:
        return f"is an auditor store with recorded traffic (its {', '.join(recorded)}), not a capture"
    return None


def _remove_sqlite_files(path: Path, suffixes: Iterable[str] = ("", "-wal", "-shm", "-journal")) -> None:
    for suffix in suffixes:
        path.with_name(path.name + suffix).unlink(missing_ok=True)


def replace_capture(out: Path, requests: Iterable[CapturedRequest], **kwargs: Any) -> tuple[int, int]:
    """``write_capture`` into a new file beside ``out``, renamed over it only once complete: a failed
    export leaves no half-written capture, and a file it was to replace stays as it was."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as exc:
        raise CaptureError(f"cannot write a capture to {out}: {exc.strerror or exc}; "
                           "check the directory exists and is writable") from exc
    os.close(fd)
    temporary = Path(name)
    try:
        result = write_capture(temporary, requests, name=kwargs.pop("name", "") or out.stem, **kwargs)
        os.chmod(temporary, 0o666 & ~_umask())  # mkstemp makes 0600; a capture file is shared like any other
        _remove_sqlite_files(out, ("-wal", "-shm", "-journal"))  # the old file's companions would corrupt the new one
        os.replace(temporary, out)
    except OSError as exc:
        raise CaptureError(f"cannot write a capture to {out}: {exc.strerror or exc}") from exc
    finally:
        _remove_sqlite_files(temporary)
    return result


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _captured_row(capture_id: int, request: CapturedRequest) -> dict[str, Any]:
    return {"capture_id": capture_id, "offset_ns": round(request.offset_s * 1e9), "route": request.path,
            "model": request.body.get("model"), "stream": bool(request.body.get("stream")),
            "prompt_tokens": None, "max_tokens": request.body.get("max_tokens"),
            "disconnect_after_ns": None if request.disconnect_after_s is None
            else round(request.disconnect_after_s * 1e9),
            "disconnect_kind": request.disconnect_kind, "original_verdict": request.original_verdict,
            "body": request.body}


def write_capture(out: Path, requests: Iterable[CapturedRequest], *, name: str = "", window_start_ns: int = 0,
                  window_end_ns: int | None = None, source: str = "",
                  on_progress: Callable[[int], None] | None = None) -> tuple[int, int]:
    """A capture of ``requests`` (streamed in batches) in ``out``; returns (capture id, requests).
    Without ``window_end_ns`` the window ends just after the last request's start.
    ``on_progress`` gets the number of requests written since its last call."""
    try:
        target = Store(f"sqlite:///{out}")
    except AuditorError as exc:
        raise CaptureError(f"cannot write a capture to {out}: {exc}") from exc
    try:
        with target.session() as session, session.begin():
            capture = CaptureRow(created_ns=time.time_ns(), name=name or out.stem, window_start_ns=window_start_ns,
                                 window_end_ns=window_end_ns or window_start_ns, source=source)
            session.add(capture)
            session.flush()
            count, last_offset_ns = 0, 0
            for batch in _batches(requests):
                rows = [_captured_row(capture.id, r) for r in batch]
                session.execute(CapturedRequestRow.__table__.insert(), rows)
                count += len(rows)
                last_offset_ns = max(last_offset_ns, max(row["offset_ns"] for row in rows))
                if on_progress is not None:
                    on_progress(len(rows))
            if window_end_ns is None:
                capture.window_end_ns = window_start_ns + last_offset_ns + 1
            return capture.id, count
    finally:
        target.close()


def _batches(items: Iterable[CapturedRequest]) -> Iterator[list[CapturedRequest]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, BATCH)):
        yield batch


def open_capture_store(path: Path) -> Store:
    """The capture file as a store, migrated; refuses what is not an auditor capture."""
    if not path.is_file():
        raise CaptureError(f"{path}: no such capture file; make one with `auditor capture export -o {path}`")
    if path.stat().st_size == 0:  # opening it would write a whole schema into whatever file this was
        raise CaptureError(f"{path} is an empty file, not a capture; make one with `auditor capture export -o FILE`")
    try:
        store = Store(f"sqlite:///{path}", create=False)
    except AuditorError as exc:
        # The store's errors speak to --db, which replay has not: here the file is the argument.
        reason = str(exc).replace("pass another --db", "pass another capture file")
        raise CaptureError(f"{path} is not a capture file: {reason}") from exc
    return store


def check_writable(path: Path) -> None:
    """Refuse a capture file the replay could read but not record its run in: the file, and its
    directory, where SQLite keeps the file's write-ahead log."""
    directory = path.parent
    if not os.access(path, os.W_OK):
        raise CaptureError(f"{path} is read-only; the replay records its run and verdicts there: make it "
                           f"writable (e.g. chmod u+w {path}) or replay a writable copy")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CaptureError(f"cannot write in {directory}, where SQLite keeps {path.name}'s journal; make the "
                           "directory writable or replay a copy of the capture elsewhere")


def read_capture(store: Store, capture_id: int | None = None) -> Capture:
    """One capture of the file: the given id, else the newest. Rows that make no sense are refused
    with the row named, never replayed half-understood."""
    with store.session() as session:
        query = select(CaptureRow).order_by(CaptureRow.id.desc())
        if capture_id is not None:
            query = select(CaptureRow).where(CaptureRow.id == capture_id)
        capture = session.scalars(query.limit(1)).first()
        if capture is None:
            known = list(session.scalars(select(CaptureRow.id).order_by(CaptureRow.id)))
            raise CaptureError(f"{store.where()} holds no capture {capture_id}; it has {known}"
                               if capture_id is not None and known else
                               f"{store.where()} holds no capture; make one with `auditor capture export`")
        c = CapturedRequestRow
        rows = session.execute(select(c.id, c.offset_ns, c.route, c.model, c.stream, c.prompt_tokens, c.max_tokens,
                                      c.disconnect_after_ns, c.disconnect_kind, c.original_verdict,
                                      type_coerce(c.body, Text))  # parsed per row: a bad one is named
                               .where(c.capture_id == capture.id).order_by(c.offset_ns, c.id))
        requests = [_request_from_row(row) for row in rows]
        return Capture(capture.id, capture.name, capture.window_start_ns, capture.window_end_ns, capture.source,
                       requests)


def _request_from_row(row: Any) -> CapturedRequest:
    (row_id, offset_ns, route, model, stream, prompt_tokens, max_tokens, after_ns, kind, verdict, body) = row
    problem = None
    if route not in (DEFAULT_PATH, CHAT_PATH):
        problem = f"route {route!r} is not {DEFAULT_PATH} or {CHAT_PATH}"
    elif offset_ns is None or offset_ns < 0:
        problem = f"offset {offset_ns!r} is not a time from the window's start"
    elif after_ns is not None and after_ns < 0:
        problem = f"disconnect_after_ns {after_ns} is negative"
    elif kind not in (None, "fin", "rst"):
        problem = f"disconnect_kind {kind!r} is not fin or rst"
    if problem is None and body is not None:
        try:
            body = json.loads(body)
        except ValueError as exc:
            problem = f"body is not JSON ({exc})"
    if problem is not None:
        raise CaptureError(f"captured request {row_id}: {problem}")
    if not isinstance(body, dict) or not body:
        body = synthetic_body(route, model, prompt_tokens, max_tokens, bool(stream))
    return CapturedRequest(offset_ns / 1e9, route, body, None if after_ns is None else after_ns / 1e9, kind, verdict)


def sample_cancels(count: int, rate: float, seed: int) -> list[bool]:
    """Which of ``count`` requests to cancel: ``rate`` of them, the same ones for the same seed."""
    rng = random.Random(seed)
    chosen = set(rng.sample(range(count), round(count * rate))) if count else set()
    return [i in chosen for i in range(count)]
