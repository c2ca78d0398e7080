"""Helpers for end-to-end tests: a daemon in this process, real clients that cancel like users do."""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import select

from auditor.config import apply_overrides, load_config
from auditor.daemon import Daemon
from auditor.model import EngineLoad
from auditor.store import VerdictRow
from replay.engine.truth import expected_verdict as truth_verdict

GRACE_S = 0.5
FINDINGS = ("zombie", "inflight_zombie", "aborted")

# The witness's loop: sleep 20 ms, read both clocks; say where it woke late or the clocks parted.
_WITNESS = """
import sys, time
STALL_NS, STEP_NS = int(sys.argv[1]), int(sys.argv[2])
mono, wall = time.monotonic_ns(), time.time_ns()
while True:
    time.sleep(0.02)
    now_mono, now_wall = time.monotonic_ns(), time.time_ns()
    if now_mono - mono > STALL_NS:
        print("stall", wall, now_wall, flush=True)
    if abs((now_wall - wall) - (now_mono - mono)) > STEP_NS:
        print("step", wall, now_wall, (now_wall - wall) - (now_mono - mono), flush=True)
    mono, wall = now_mono, now_wall
"""


class HostWitness:
    """A process beside an end-to-end test that only sleeps 20 ms at a time and reads both clocks.
    Where it woke ``stall_s`` late, the whole host stalled (a virtual machine paused or starved: a
    sleeping process's wake-up is the scheduler's first duty); where the wall clock moved otherwise
    than the monotonic one, it was stepped. Either breaks what the auditor reads (scrapes seconds
    apart, kernel stamps off against the spans'), so a verdict the truth contradicts at such a
    moment is told apart from one the auditor got wrong on a sound host. A process of its own: the
    daemon under test shares the test's interpreter, and its own stalls must not excuse it."""

    def __init__(self, stall_s: float = 0.5, step_ms: float = 1.0) -> None:
        self._args = [str(int(stall_s * 1e9)), str(int(step_ms * 1e6))]
        self._process: subprocess.Popen[bytes] | None = None
        self._said = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read, then closed, at __exit__)
        self._final: list[tuple[str, int, int, int]] | None = None

    def __enter__(self) -> HostWitness:
        self._process = subprocess.Popen([sys.executable, "-c", _WITNESS, *self._args], stdout=self._said)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        self._process.kill()
        self._process.wait()
        self._final = self.seen()
        self._said.close()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def seen(self) -> list[tuple[str, int, int, int]]:
        """What it saw so far: (``stall`` or ``step``, from, to (wall ns), the step in ns)."""
        if self._final is not None:
            return self._final
        self._said.seek(0)
        seen = []
        for line in self._said.read().splitlines():
            kind, start, end, *step = line.split()
            seen.append((kind, int(start), int(end), int(step[0]) if step else 0))
        return seen

    def near(self, start_ns: int, end_ns: int, margin_s: float = 1.0) -> list[str]:
        """What the host suffered within ``margin_s`` of [start, end] (wall ns), in words."""
        margin = int(margin_s * 1e9)
        return [f"the host stalled {(to - since) / 1e9:.2f} s" if kind == "stall"
                else f"the wall clock stepped {step / 1e6:+.1f} ms"
                for kind, since, to, step in self.seen() if since - margin <= end_ns and to + margin >= start_ns]


class HostDisturbed(UserWarning):
    """A verdict the truth contradicts, where the host stalled or its clock stepped (``HostWitness``)."""


def host_excuses(witness: HostWitness | None, row: VerdictRow, problem: str) -> bool:
    """Whether ``problem``, of ``row``'s verdict, lies where the witness saw the host stalled or
    its clock stepped (from the request's start to a grace after its close or its work's end):
    then it is warned of (``HostDisturbed``, in pytest's summary), not failed on."""
    if witness is None:
        return False
    until = max(row.disconnect_at_ns, row.work_end_ns or 0) + int(GRACE_S * 1e9)
    disturbed = witness.near(row.request_start_ns, until)
    if disturbed:
        warnings.warn(HostDisturbed(f"{problem} [not failed on: {'; '.join(disturbed)}]"), stacklevel=2)
    return bool(disturbed)


@contextmanager
def running_daemon(tmp_path: Path, **overrides: Any) -> Iterator[Daemon]:
    """The whole daemon on ephemeral ports, watching no port until ``set_ports``."""
    config = load_config(environ={})
    apply_overrides(config, {
        "db": f"sqlite:///{tmp_path / 'auditor.db'}", "probe.ports": [1], "otlp.http": "127.0.0.1:0",
        "otlp.grpc": "127.0.0.1:0", "metrics.listen": "127.0.0.1:0", "live.listen": "127.0.0.1:0",
        "correlate.grace_seconds": GRACE_S, "correlate.interval_seconds": 0.2,
        "correlate.late_span_seconds": 3.0, "sampler.nvml": False, **overrides,
    })
    daemon = Daemon(config)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.request_stop()
        daemon.stop()


def send_request(port: int, *, stream: bool, max_tokens: int, request_id: str | None, prompt_words: int = 4,
                 path: str = "/v1/completions", sock: socket.socket | None = None,
                 host: str = "127.0.0.1", user_agent: str | None = None) -> socket.socket:
    """Write one whole OpenAI request (AIPerf's T2: the cancellation timer starts after this).
    ``request_id`` None: no X-Request-Id, as the openai SDK and curl send none; ``user_agent``
    None: no User-Agent."""
    body = {"model": "ref-llm-1b", "max_tokens": max_tokens, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": " ".join(["word"] * prompt_words)}]
    else:
        body["prompt"] = " ".join(["word"] * prompt_words)
    data = json.dumps(body).encode()
    sock = sock or socket.create_connection((host, port))
    named = "" if request_id is None else f"X-Request-Id: {request_id}\r\n"
    named += "" if user_agent is None else f"User-Agent: {user_agent}\r\n"
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                 f"{named}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def disconnect(sock: socket.socket, kind: str) -> None:
    """``fin``: half-close like a browser tab (FIN even with unread data); ``rst``: like a proxy timeout."""
    if kind == "fin":
        sock.shutdown(socket.SHUT_WR)
        threading.Timer(3.0, sock.close).start()
    else:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def read_response(sock: socket.socket, timeout_s: float = 30.0) -> bytes:
    """Read one whole HTTP/1.1 response (Content-Length or chunked SSE ending in [DONE])."""
    sock.settimeout(timeout_s)
    data = b""
    while True:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(rest) >= length:
                return data
            if length is None and rest.endswith(b"0\r\n\r\n"):
                return data
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def cancel_after(port: int, delay_s: float, kind: str, **request: Any) -> threading.Thread:
    """Send a request and disconnect ``delay_s`` after it was fully written, in a thread."""

    def run() -> None:
        sock = send_request(port, **request)
        time.sleep(delay_s)
        disconnect(sock, kind)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def complete(port: int, **request: Any) -> threading.Thread:
    def run() -> None:
        with send_request(port, **request) as sock:
            read_response(sock)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def free_port() -> int:
    """A loopback port free as asked (another process may take it before it is bound)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def verdict_rows(daemon: Daemon) -> list[VerdictRow]:
    with daemon.store.session() as session:
        return list(session.scalars(select(VerdictRow)))


def settled_by_request_id(daemon: Daemon, request_ids: Iterable[str], timeout_s: float = 30.0
                          ) -> dict[str, VerdictRow]:
    """The verdicts by request id, once each of ``request_ids`` has one that is not provisional."""
    wanted = list(request_ids)

    def settled() -> bool:
        rows = {r.request_id: r for r in verdict_rows(daemon)}
        return all(rid in rows and not rows[rid].details.get("provisional") for rid in wanted)

    assert wait_for(settled, timeout_s=timeout_s), [(r.request_id, r.verdict, r.details) for r in verdict_rows(daemon)]
    return {r.request_id: r for r in verdict_rows(daemon)}


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def leavers_settled(rows: Sequence[VerdictRow], truths: Sequence[dict[str, Any]]) -> bool:
    """Every request the truth log says its client left has a verdict on its client port, and no
    verdict is provisional (for plain clients, matched by client port)."""
    judged = {row.client_port for row in rows}
    return (all(truth["client_port"] in judged for truth in truths if truth.get("disconnect_at"))
            and not any(row.details.get("provisional") for row in rows))


def expected_verdict(truth: dict[str, Any], grace_s: float = GRACE_S) -> str:
    """What really happened to a request whose client left, from the engine's own log."""
    return truth_verdict(truth, grace_s)


def settled_by_client_port(daemon: Daemon, engine: Any, requests: int, leavers: int, timeout_s: float = 30.0
                           ) -> tuple[dict[int, dict[str, Any]], set[int], dict[int, VerdictRow]]:
    """For plain clients (no X-Request-Id), matched by client port, the only thing the truth log
    and the verdicts both know: wait for the truth of ``requests`` requests, ``leavers`` of them
    left by their client, and for those leavers' verdicts to settle. The truths, the leavers'
    ports, and the verdict rows, by client port."""
    truths = {t["client_port"]: t for t in engine.wait_for_truth(requests, timeout=30)}
    left = {port for port, t in truths.items() if t.get("disconnect_at")}
    assert len(left) == leavers, truths

    def settled() -> bool:
        rows = {r.client_port: r for r in verdict_rows(daemon)}
        return all(port in rows and not rows[port].details.get("provisional") for port in left)

    assert wait_for(settled, timeout_s=timeout_s), [(r.client_port, r.verdict, r.details) for r in verdict_rows(daemon)]
    time.sleep(1.0)  # anything that would still change them
    return truths, left, {r.client_port: r for r in verdict_rows(daemon)}


def against_truth(rows: dict[int, VerdictRow], truths: dict[int, dict[str, Any]], left: set[int], *,
                  unconfirmed_ok: bool) -> list[str]:
    """Verdicts the truth log contradicts: a finding for a request that completed, and a leaver
    judged otherwise than the truth (or than ``unconfirmed``, where that is allowed)."""
    problems = []
    for port, row in rows.items():
        if port not in left:
            if row.verdict in FINDINGS:
                problems.append(f"{port}: {row.verdict} for a completed request ({row.details})")
            continue
        want = expected_verdict(truths[port])
        if row.verdict != want and not (unconfirmed_ok and row.verdict == "unconfirmed"):
            problems.append(f"{port}: {row.verdict}, truth {want} ({row.details})")
    return problems


def match_to_truth(rows: Sequence[VerdictRow], truths: Sequence[dict[str, Any]]
                   ) -> tuple[dict[int, list[VerdictRow]], list[VerdictRow]]:
    """Each verdict matched to the truth record on its client port that arrived nearest its start
    (on a port no truth names, among those that name none: a request the engine read after its
    client's reset has no client port in the truth): the rows by ``id`` of their truth, and the
    rows no truth could take."""
    by_port: dict[int, list[dict[str, Any]]] = {}
    for truth in truths:
        by_port.setdefault(truth.get("client_port") or 0, []).append(truth)
    matched: dict[int, list[VerdictRow]] = {}
    unmatched: list[VerdictRow] = []
    for row in rows:
        candidates = by_port.get(row.client_port or 0) or by_port.get(0)
        if not candidates:
            unmatched.append(row)
            continue
        nearest = min(candidates, key=lambda truth: abs(truth["arrival_at"] - row.request_start_ns))
        matched.setdefault(id(nearest), []).append(row)
    return matched, unmatched


def timeline(row: VerdictRow, truth: dict[str, Any], events: Sequence[Any] = (),
             scrapes: Sequence[EngineLoad] = ()) -> str:
    """One request's moments as the engine's truth log and the verdict have them, the kernel's
    events on its client port, and the engine's scrapes (``scrapes``, of its port) from 0.4 s before
    its close to 0.3 s after (sent/answered, running, finish and abort counts), in ms from the
    engine's arrival: what a wrong verdict read."""
    arrived = truth["arrival_at"]

    def at(ns: int | None) -> str:
        return "-" if ns is None else f"{(ns - arrived) / 1e6:+.1f}"

    told = " ".join(f"{event.kind.value}@{at(event.ts_ns)}" for event in events
                    if event.client_port == row.client_port and event.server_port == row.server_port)
    near = [load for load in scrapes if load.server_port == row.server_port
            and -400_000_000 < load.ts_ns - row.disconnect_at_ns < 300_000_000]
    read = " ".join(f"{at(load.ts_ns)}/{at(load.answered_ns or load.ts_ns)}:r{load.running}"
                    f"f{load.finished if load.finished is None else f'{load.finished:g}'}"
                    f"a{load.aborted if load.aborted is None else f'{load.aborted:g}'}" for load in near)
    return (f"truth: port {truth.get('client_port')}, first token {at(truth.get('first_token_at'))}, finished "
            f"{at(truth.get('finished_at'))} ({truth.get('finish_reason')}), left {at(truth.get('disconnect_at'))}; "
            f"verdict: port {row.client_port}, start {at(row.request_start_ns)}, {row.disconnect_kind} "
            f"{at(row.disconnect_at_ns)}, work end {at(row.work_end_ns)}; kernel: {told or 'none'}"
            + (f"; scrapes sent/answered:running,finished,aborted {read}" if scrapes else ""))


# A scrape reads the engine's gauges a step or two from its own time, and the clocks agree within
# the clock error: how far outside the end a verdict claims a work end may fall and still be right.
WORK_END_SLACK_NS = 50_000_000


def may_be_earlier_ns(row: VerdictRow) -> float:
    """How much earlier than its work end a verdict says the work may have ended (``lag_at_least_s``)."""
    floor = row.details.get("lag_at_least_s")
    return 0.0 if floor is None or row.lag_seconds is None else (row.lag_seconds - floor) * 1e9


def _tally_work_end(tally: Counter[str], row: VerdictRow, truth: dict[str, Any]) -> None:
    """A zombie the gauges decided: whether the truth's end lies where the verdict says, its
    estimate give or take half its resolution, or as early as ``lag_at_least_s`` after the close."""
    if row.verdict != "zombie" or row.work_end_ns is None or row.details.get("evidence") != "engine_metrics" \
            or truth.get("finished_at") is None:
        return
    half = row.details.get("work_end_resolution_s", 0) / 2 * 1e9 + WORK_END_SLACK_NS
    earlier = may_be_earlier_ns(row)
    off = truth["finished_at"] - row.work_end_ns
    tally["zombie work ends"] += 1
    tally["work ends that may be earlier"] += bool(earlier)
    tally["work ends off the estimate"] += abs(off) > half
    tally["work ends outside the claim"] += not -half - earlier <= off <= half


def work_ends_line(tally: Counter[str]) -> str:
    """The tally's zombie work ends against the truth, as one line."""
    return (f"zombies' work ends from the gauges {tally['zombie work ends']}: off the estimate (beyond half its "
            f"resolution) {tally['work ends off the estimate']}, told they may be earlier "
            f"{tally['work ends that may be earlier']}, outside what the verdict claims {tally['work ends outside the claim']}")


def tally_against_truth(rows: Sequence[VerdictRow], truths: Sequence[dict[str, Any]], events: Sequence[Any] = (),
                        witness: HostWitness | None = None) -> tuple[Counter[str], list[str]]:
    """For plain clients on shared connections (a proxy's upstream pool, an SDK's): each verdict
    matched to its truth record (``match_to_truth``);
    the tally (completed, false findings, cancels, cancels right / unconfirmed / judged otherwise /
    without a verdict / unmatched (the engine read it after its client's reset, and the truth names
    no client port), rows without truth) and a line for each thing the truth contradicts, with its
    ``timeline`` (the kernel's ``events`` among it, where given); with a ``witness``, a line of a
    moment the host was disturbed is warned of instead (``host_excuses``), and tallied as such."""
    matched, unmatched = match_to_truth(rows, truths)
    tally: Counter[str] = Counter()
    problems: list[str] = []
    for row in unmatched:
        tally["rows without truth"] += 1
        problems.append(f"port {row.client_port}: {row.verdict} with no request on that port ({row.details})")
    for truth in truths:
        found = matched.get(id(truth), [])
        port, want = truth.get("client_port"), expected_verdict(truth) if truth.get("disconnect_at") else "completed"
        if want == "completed":
            tally["completed"] += 1
            wrong = [(row, f"port {port}: {row.verdict} for a completed request ({row.details}; "
                           f"{timeline(row, truth, events)})") for row in found if row.verdict in FINDINGS]
            unexcused = [problem for row, problem in wrong if not host_excuses(witness, row, problem)]
            tally["excused: the host disturbed"] += len(wrong) - len(unexcused)
            tally["false findings"] += bool(unexcused)
            problems += unexcused
            continue
        tally["cancels"] += 1
        if not found and port is None:  # reset before the engine read it: the truth names no client port
            tally["cancels unmatched"] += 1
            problems.append(f"{truth['request_id']}: the engine read it after its client's reset (truth {want}, "
                            "no client port to match a verdict by)")
        elif not found:
            tally["cancels without a verdict"] += 1
            problems.append(f"port {port}: no verdict for a request whose client left (truth {want})")
        elif found[0].verdict == want:
            tally["cancels right"] += 1
            _tally_work_end(tally, found[0], truth)
        elif found[0].verdict == "unconfirmed":
            tally["cancels unconfirmed"] += 1
        else:
            problem = (f"port {port}: {found[0].verdict}, truth {want} ({found[0].details}; "
                       f"{timeline(found[0], truth, events)})")
            if host_excuses(witness, found[0], problem):
                tally["excused: the host disturbed"] += 1
            else:
                tally["cancels judged otherwise"] += 1
                problems.append(problem)
    return tally, problems
