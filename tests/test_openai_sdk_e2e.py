"""The daemon against the engine's truth log, called by the real openai SDK, the client most users
call an engine with.

The SDK sends no `traceparent` and no `X-Request-Id`, keeps its connections in a pool and reuses
them, and gives up on a request in its own ways: `stream.close()` or leaving a `with` block after a
few chunks (httpx closes that connection, with a reset when answer bytes are still unread), and a
non-streamed request past its timeout. On the weakest signal set (no engine span, vLLM's /metrics)
no request that completed may be judged a zombie, and every request the SDK gave up on gets a
verdict the truth allows: the engine's, or `unconfirmed`.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from replay.engine.launch import running_engine
from tests.e2e import (
    HostWitness,
    leavers_settled,
    running_daemon,
    tally_against_truth,
    verdict_rows,
    wait_for,
)

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow]

MODEL = "ref-llm-1b"
PROMPT = "word word word word"


def call(client: openai.OpenAI, *, chat: bool, stream: bool, max_tokens: int, **options: object) -> object:
    if chat:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=max_tokens, stream=stream, **options)
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=stream, **options)


def sdk_session(url: str) -> tuple[int, int]:
    """One pooled client, as an application holds one: requests that complete (streamed, read to the
    end, and not), and requests it gives up on each way. Returns (completed, given up)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completed = given_up = 0
    for chat in (False, True):
        for _ in call(client, chat=chat, stream=True, max_tokens=20):
            pass
        completed += 1
        stream = call(client, chat=chat, stream=True, max_tokens=200)
        for number, _ in enumerate(stream):
            if number == 4:
                break
        time.sleep(0.1)  # the application looks at what it got, then gives up
        stream.close()
        given_up += 1
        call(client, chat=chat, stream=False, max_tokens=20)
        completed += 1
        with call(client, chat=chat, stream=True, max_tokens=200) as stream:
            for number, _ in enumerate(stream):
                if number == 7:
                    break
        given_up += 1
        with pytest.raises(openai.APITimeoutError):
            call(client, chat=chat, stream=False, max_tokens=200, timeout=0.5)  # 2 s of decode
        given_up += 1
        for _ in call(client, chat=chat, stream=True, max_tokens=20):
            pass
        completed += 1
        time.sleep(0.3)
    client.close()
    return completed, given_up


@pytest.mark.parametrize("source", [pytest.param("bpf", marks=pytest.mark.privileged), "procfs"])
def test_requests_the_openai_sdk_gave_up_on_match_truth(tmp_path: Path, source: str) -> None:
    settings = {"probe.source": source, "probe.poll_hz": 20, "correlate.late_span_seconds": 10.0,
                "engine_metrics.interval_seconds": 0.1}
    with HostWitness() as witness, running_daemon(tmp_path, **settings) as daemon, \
            running_engine(behavior="detached", otlp=f"http://127.0.0.1:{daemon.status.http_port}",
                           truth_log=tmp_path / "truth.jsonl", step_ms=10, max_batch=16,
                           extra_args=["--engine-span", "none", "--metrics-names", "vllm"]) as engine:
        daemon.set_ports({engine.port})
        completed, given_up = sdk_session(engine.url)
        truths = engine.wait_for_truth(completed + given_up, timeout=30)
        assert len(truths) == completed + given_up, truths

        assert wait_for(lambda: leavers_settled(verdict_rows(daemon), truths), timeout_s=40, interval_s=0.25), \
            [(r.client_port, r.verdict, r.details) for r in verdict_rows(daemon)]
        time.sleep(1.0)  # anything that would still change them
        tally, problems = tally_against_truth(verdict_rows(daemon), truths, daemon.store.conn_events(), witness)
    assert tally["completed"] == completed and tally["cancels"] == given_up, (tally, truths)
    assert not problems, (tally, problems)
    assert tally["cancels right"] >= 1, tally  # not all `unconfirmed`: the zombies are found
