"""Every disconnect behaviour of the reference engine, with real clients over loopback.

Each behaviour runs in its own engine process (batch of one, so a second request queues). A raw
socket client sends a request and closes the connection while the request is queued, during
prefill, or mid-decode, streaming and not; the engine's ground-truth log must then show what the
behaviour promises.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from replay.engine.launch import EngineProcess, running_engine

pytestmark = pytest.mark.slow

STEP_MS = 5.0
LATE_SECONDS = 0.3
# Long enough that a late abort (LATE_SECONDS after a disconnect 0.1 s in) lands well before the
# victim's last token even when the calibrated step runs fast: 100 tokens once ended 0.3 s after
# the disconnect, with the abort still pending.
VICTIM_TOKENS = 200
BLOCKER_TOKENS = 160
LONG_PROMPT = list(range(800))  # 50 prefill chunks of 16 tokens
SECOND = 1_000_000_000
# An abort lands between steps, but the event loop that issues it competes for the CPU with the
# engine thread (and, on a shared host, with everything else): a few steps may pass first.
PROMPT_ABORT_TOKENS = 10


def send_request(port: int, path: str, body: dict[str, Any], request_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: {request_id}\r\nContent-Length: {len(payload)}\r\n\r\n")
    sock.sendall(head.encode() + payload)
    return sock


def read_events(sock: socket.socket, count: int) -> bytes:
    received = b""
    while received.count(b"data: ") < count:
        piece = sock.recv(65536)
        assert piece, f"connection closed after {received!r}"
        received += piece
    return received


def read_to_end(sock: socket.socket) -> bytes:
    received = b""
    while b"[DONE]" not in received and not received.rstrip().endswith(b"}"):
        piece = sock.recv(65536)
        if not piece:
            break
        received += piece
    return received


def wait_record(engine: EngineProcess, request_id: str, timeout: float = 15.0) -> dict[str, Any]:
    return engine.truth_of(request_id, timeout)


def wait_until_running(engine: EngineProcess, count: int, timeout: float = 10.0) -> None:
    """Wait until the batch holds ``count`` requests (read from the engine's own /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = httpx.get(engine.url + "/metrics", timeout=5).text
        if f"ref_engine_num_requests_running {float(count)}" in metrics:
            return
        time.sleep(0.01)
    raise AssertionError(f"the batch never held {count} requests")


def run_case(engine: EngineProcess, phase: str, stream: bool) -> tuple[dict[str, Any], int]:
    """Disconnect one request in ``phase``; returns its truth record and its client port."""
    name = f"{phase}-{'stream' if stream else 'plain'}"
    blocker = None
    if phase == "queued":
        blocker = send_request(engine.port, "/v1/completions",
                               {"prompt": "block the batch", "max_tokens": BLOCKER_TOKENS}, f"blocker-{name}")
        wait_until_running(engine, 1)
    if phase == "prefill":
        body: dict[str, Any] = {"prompt": LONG_PROMPT, "max_tokens": VICTIM_TOKENS, "stream": stream}
        path, prefix = "/v1/completions", "cmpl-"
    else:
        body = {"messages": [{"role": "user", "content": f"tell me about {name}"}],
                "max_tokens": VICTIM_TOKENS, "stream": stream}
        path, prefix = "/v1/chat/completions", "chatcmpl-"
    victim = send_request(engine.port, path, body, name)
    client_port = victim.getsockname()[1]
    if phase == "decode" and stream:
        read_events(victim, 3)
    else:
        time.sleep(0.1)
    victim.close()
    if blocker is not None:
        assert b"length" in read_to_end(blocker)
        blocker.close()
    return wait_record(engine, prefix + name), client_port


def check(behavior: str, phase: str, stream: bool, record: dict[str, Any]) -> None:
    after = record["tokens_after_disconnect"]
    lag = record["finished_at"] - record["disconnect_at"]
    stops_promptly = (behavior == "abort"
                      or (behavior == "queued-leak" and phase != "queued")
                      or (behavior == "no-check" and stream))
    if stops_promptly:
        assert record["finish_reason"] == "abort" and after <= PROMPT_ABORT_TOKENS
        if behavior == "no-check" and phase != "decode":
            # Nothing is written while queued or prefilling, so only the first token reveals the
            # loss: the request waits its turn and prefills for nobody, then stops.
            assert record["first_token_at"] is not None and after >= 1
            assert record["finished_at"] - record["first_token_at"] < SECOND // 2
        else:
            assert lag < SECOND // 2
        if behavior != "no-check" and phase == "queued":
            assert record["scheduled_at"] is None and record["tokens_generated"] == 0
    elif behavior == "late":
        assert record["finish_reason"] == "abort"
        assert LATE_SECONDS * SECOND <= lag < (LATE_SECONDS + 0.5) * SECOND
        if phase == "decode":
            assert after >= 5
    else:  # detached, no-check without streaming, queued-leak while queued: runs to the end
        assert record["finish_reason"] == "length"
        assert record["tokens_generated"] == VICTIM_TOKENS and after >= 1
        if phase == "queued":
            assert after == VICTIM_TOKENS


@pytest.mark.parametrize("behavior", ["abort", "detached", "no-check", "late", "queued-leak"])
def test_behavior_on_disconnect(behavior: str, tmp_path: Path) -> None:
    truth = tmp_path / "truth.jsonl"
    args = ["--prefill-chunk", "16", "--late-seconds", str(LATE_SECONDS)]
    failures = []
    with running_engine(behavior=behavior, truth_log=truth, step_ms=STEP_MS, max_batch=1, extra_args=args) as engine:
        for phase in ("queued", "prefill", "decode"):
            for stream in (False, True):
                record, client_port = run_case(engine, phase, stream)
                try:
                    assert record["disconnect_at"] is not None, "disconnect not recorded"
                    assert record["phase_at_disconnect"] == phase
                    assert (record["client_addr"], record["client_port"]) == ("127.0.0.1", client_port)
                    assert record["stream"] is stream and record["behavior"] == behavior
                    check(behavior, phase, stream, record)
                except AssertionError as exc:
                    failures.append(f"{phase} stream={stream}: {exc}\n  {record}")
    assert not failures, "\n".join(failures)


def test_a_reset_is_a_disconnect_too(tmp_path: Path) -> None:
    with running_engine(truth_log=tmp_path / "truth.jsonl", step_ms=STEP_MS) as engine:
        victim = send_request(engine.port, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "reset me"}], "max_tokens": VICTIM_TOKENS,
                               "stream": True}, "reset")
        read_events(victim, 2)
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN, as a proxy timeout does.
        victim.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        victim.close()
        record = wait_record(engine, "chatcmpl-reset")
    assert record["finish_reason"] == "abort" and record["phase_at_disconnect"] == "decode"
    assert record["tokens_generated"] < VICTIM_TOKENS


def test_an_engine_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    """A launcher killed outright (SIGKILL: no clean-up of its own) leaves no engine running: a
    detached engine would generate on, a core's worth, with nobody to stop it."""
    import os
    import signal
    import subprocess
    import sys

    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from replay.engine.launch import running_engine\n"
         "with running_engine(behavior='detached') as engine:\n"
         "    print(engine.pid, flush=True)\n"
         "    time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    assert launcher.stdout is not None
    engine_pid = int(launcher.stdout.readline())
    os.kill(engine_pid, 0)  # running
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{engine_pid}/stat") as stat:
            if stat.read().split(") ")[1].startswith("Z"):  # exited, not yet reaped by init
                return
        time.sleep(0.1)
    os.kill(engine_pid, signal.SIGKILL)
    raise AssertionError("the engine outlived its launcher by 10 s")
