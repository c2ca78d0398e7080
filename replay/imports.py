"""Benchmark files as captures: what a team's AIPerf run or trace produced, replayed as is.

Two formats, both JSON Lines:

- AIPerf's ``profile_export.jsonl``: one record per request with ``metadata`` (``request_start_ns``,
  ``was_cancelled``, ``cancellation_time_ns``, ``benchmark_phase``) and ``metrics``
  (``input_sequence_length``, ``output_sequence_length``, ``error_isl`` for failed ones). Its
  cancelled requests become captured disconnects, after the delay AIPerf waited, closed with FIN
  like AIPerf's client, so ``auditor replay --as-captured`` repeats the benchmark's cancellation plan.
  Warm-up records are left out, as AIPerf leaves them out of its results.
- A mooncake-style trace: ``timestamp`` (ms from the trace's start), ``input_length``,
  ``output_length`` and optional ``hash_ids`` (prefix-cache blocks). Requests sharing a block id
  get the same words in that block, so prefix caching sees the sharing the trace had.

Neither format names the model (AIPerf keeps it in another file), so the caller gives it: a
capture never gets an invented model.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from replay.capture import (
    CHAT_PATH,
    DEFAULT_MAX_TOKENS,
    CapturedRequest,
    CaptureError,
    check_output,
    replace_capture,
    synthetic_body,
)

FORMATS = ("aiperf", "mooncake")
# Each format as errors name it, with its article.
KINDS = {"aiperf": "an AIPerf profile_export.jsonl", "mooncake": "a mooncake trace"}
# A prompt or output length beyond the largest context windows is a broken line, not a request:
# its synthetic prompt alone would take gigabytes.
MAX_TOKENS = 1 << 20
# Offsets are kept as 64-bit nanoseconds: a trace spans at most 9e12 ms (285 years).
MAX_TIMESTAMP_MS = 9e12
MAX_NANOS = 2**63 - 1


def _json_kind(value: Any) -> str:
    """What a JSON value is, with its article: "an array", "a string", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {list: "an array", str: "a string", int: "a number", float: "a number"}.get(type(value), "a value")


def _lines(path: Path, fmt: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; anything else is refused with its line."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise CaptureError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CaptureError(f"{path} line {number}: not UTF-8 text; is this {fmt} file "
                                   "(JSON Lines, one object per line)?") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CaptureError(f"{path} line {number}: not JSON ({exc}); is this {fmt} file "
                                   "(JSON Lines, one object per line)?") from None
            if not isinstance(record, dict):
                raise CaptureError(f"{path} line {number}: {_json_kind(record)}, not an object; "
                                   f"is this {fmt} file?")
            yield number, record


def _metric(metrics: Any, *names: str) -> float | None:
    """A metric's value in AIPerf's ``{"value": v, "unit": u}`` form (or a bare number)."""
    for name in names:
        entry = metrics.get(name) if isinstance(metrics, dict) else None
        value = entry.get("value") if isinstance(entry, dict) else entry
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _length(value: float | None, name: str, where: str) -> float | None:
    """A token count read from a metric, refused by line and name when no request has it."""
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_TOKENS):
        raise CaptureError(f"{where}: metrics.{name} {value!r} is not a token count from 0 to {MAX_TOKENS}")
    return value


def _nanos(metadata: dict[str, Any], key: str, where: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_NANOS:
        raise CaptureError(f"{where}: metadata.{key} {value!r} is not a time in nanoseconds")
    return value


def read_aiperf(path: Path, *, model: str, path_route: str, stream: bool) -> list[CapturedRequest]:
    """The profiling records of an AIPerf profile export, in start order."""
    found: list[tuple[int, CapturedRequest, bool]] = []  # (start ns, request, output length known)
    for number, record in _lines(path, KINDS["aiperf"]):
        where = f"{path} line {number}"
        metadata = record.get("metadata")
        if not isinstance(metadata, dict):
            raise CaptureError(f"{where}: no \"metadata\" object; AIPerf's per-request records have one "
                               "(use profile_export.jsonl, not profile_export_aiperf.json)")
        if str(metadata.get("benchmark_phase") or metadata.get("credit_phase") or "profiling") != "profiling":
            continue
        start = _nanos(metadata, "request_start_ns", where) or _nanos(metadata, "timestamp_ns", where)
        if start is None:
            raise CaptureError(f"{where}: no metadata.request_start_ns; without it the request cannot be "
                               "placed in time")
        after_s = None
        if metadata.get("was_cancelled"):
            cancelled_at = _nanos(metadata, "cancellation_time_ns", where) or _nanos(metadata, "request_end_ns", where)
            if cancelled_at is None or cancelled_at < start:
                raise CaptureError(f"{where}: was_cancelled without a cancellation_time_ns after "
                                   "request_start_ns; the cancel's delay is unknown")
            after_s = (cancelled_at - start) / 1e9
        prompt = _length(_metric(record.get("metrics"), "input_sequence_length", "error_isl"),
                         "input_sequence_length", where)
        output = _length(_metric(record.get("metrics"), "output_sequence_length"), "output_sequence_length", where)
        body = synthetic_body(path_route, model, round(prompt) if prompt else None,
                              max(1, round(output)) if output else None, stream)
        found.append((start, CapturedRequest(0.0, path_route, body, after_s, "fin" if after_s is not None else None),
                      output is not None))
    if not found:
        raise CaptureError(f"{path} holds no profiling records; is it AIPerf's profile_export.jsonl?")
    # A cancelled request never learnt its output length: give it the run's typical one.
    known = [r.body["max_tokens"] for _, r, has_output in found if has_output]
    typical = round(statistics.median(known)) if known else DEFAULT_MAX_TOKENS
    first = min(start for start, _, _ in found)
    return [replace(request, offset_s=(start - first) / 1e9,
                    body=request.body if has_output else {**request.body, "max_tokens": typical})
            for start, request, has_output in sorted(found, key=lambda item: item[0])]


def _count(record: dict[str, Any], key: str, where: str, minimum: int) -> int:
    value = record.get(key)
    # "not minimum <= value <= MAX": nan fails it too, where "value < minimum" lets it through.
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not minimum <= value <= MAX_TOKENS:
        raise CaptureError(f"{where}: {key} {value!r} is not a number from {minimum} to {MAX_TOKENS}; a mooncake "
                           "trace line has timestamp (ms), input_length and output_length")
    return int(value)


def _block_prompt(hash_ids: list[Any], input_length: int) -> str:
    """A prompt of ``input_length`` words whose blocks follow the trace's prefix-cache block ids."""
    block = max(1, -(-input_length // len(hash_ids)))
    words = [f"b{block_id}w{i}" for block_id in hash_ids for i in range(block)]
    return " ".join(words[:max(1, input_length)])


def read_mooncake(path: Path, *, model: str, path_route: str, stream: bool) -> list[CapturedRequest]:
    """The requests of a mooncake-style trace, in arrival order."""
    found = []
    for number, record in _lines(path, KINDS["mooncake"]):
        where = f"{path} line {number}"
        timestamp_ms = record.get("timestamp")
        if timestamp_ms is None:
            raise CaptureError(f"{where}: no timestamp field (its arrival in milliseconds); is this {KINDS['mooncake']} "
                               "file?")
        if (not isinstance(timestamp_ms, (int, float)) or isinstance(timestamp_ms, bool)
                or not 0 <= timestamp_ms <= MAX_TIMESTAMP_MS):  # nan and 1e400 (inf) included
            raise CaptureError(f"{where}: timestamp {timestamp_ms!r} is not milliseconds from 0 to "
                               f"{MAX_TIMESTAMP_MS:.0e}")
        input_length = _count(record, "input_length", where, 0)
        body = synthetic_body(path_route, model, input_length, _count(record, "output_length", where, 1), stream)
        hash_ids = record.get("hash_ids")
        if hash_ids is not None and not isinstance(hash_ids, list):
            raise CaptureError(f"{where}: hash_ids {hash_ids!r} is not a list of block ids")
        if hash_ids:
            prompt = _block_prompt(hash_ids, input_length)
            if path_route == CHAT_PATH:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
        found.append(CapturedRequest(timestamp_ms / 1000, path_route, body))
    if not found:
        raise CaptureError(f"{path} holds no requests")
    first = min(r.offset_s for r in found)
    return sorted((replace(r, offset_s=r.offset_s - first) for r in found), key=lambda r: r.offset_s)


def import_benchmark(source: Path, fmt: str, out: Path, *, model: str | None, path_route: str = CHAT_PATH,
                     stream: bool = True, name: str = "", force: bool = False) -> tuple[int, int]:
    """Write the requests of an AIPerf export or a mooncake trace to a new capture file; returns
    (capture id, requests)."""
    if fmt not in FORMATS:
        raise CaptureError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if not model:
        raise CaptureError(f"{KINDS[fmt]} does not name the model; pass --model NAME, the model the "
                           "target engine serves")
    check_output(out, force=force)
    reader = read_aiperf if fmt == "aiperf" else read_mooncake
    requests = reader(source, model=model, path_route=path_route, stream=stream)
    return replace_capture(out, requests, name=name or source.stem, source=f"{fmt}:{source.name}")
