"""The engine's pieces in-process: tokenizer, validation, and the scheduler with real compute."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from replay.engine.compute import ComputeUnavailable, NumpyBackend, make_backend, padded_rows
from replay.engine.core import Engine, Phase, RequestHandle
from replay.engine.protocol import ApiError, parse_body, parse_chat, parse_completion
from replay.engine.tokens import count_chat_tokens, count_text_tokens, pseudo_word, token_text

MODEL = "ref-llm-1b"


def test_tokenizer_counts_word_pieces_and_punctuation() -> None:
    assert count_text_tokens("") == 0
    assert count_text_tokens("hi there") == 1 + 2  # "there" is two pieces
    assert count_text_tokens("internationalization") == 5  # 20 chars in pieces of 4
    assert count_text_tokens("a, b!") == 4
    assert count_chat_tokens([("user", "hi")]) == 3 + 3 + 1 + 1


def test_pseudo_words_are_deterministic_and_wordlike() -> None:
    words = [pseudo_word(42, i) for i in range(50)]
    assert words == [pseudo_word(42, i) for i in range(50)]
    assert words != [pseudo_word(43, i) for i in range(50)]
    assert all(w.isalpha() and " " not in w for w in words)
    assert token_text(42, 0) == words[0] and token_text(42, 1) == " " + words[1]


@pytest.mark.parametrize(("raw", "status", "fragment"), [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"\xff\xfe", 400, "not valid JSON"),
])
def test_malformed_bodies_are_400(raw: bytes, status: int, fragment: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_body(raw)
    assert caught.value.status == status and fragment in caught.value.message
    assert caught.value.body()["error"]["code"] == status


@pytest.mark.parametrize(("body", "status", "param"), [
    ({}, 422, "messages"),
    ({"messages": []}, 422, "messages"),
    ({"messages": "hello"}, 422, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 422, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 422, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "10"}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, 422, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, 422, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, 422, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 422, "stream"),
])
def test_bad_chat_fields_name_the_problem(body: dict[str, object], status: int, param: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat(body, MODEL)
    assert (caught.value.status, caught.value.param) == (status, param)


def test_valid_requests_parse_with_exact_prompt_tokens() -> None:
    chat = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}],
                       "max_completion_tokens": 7, "stream": True,
                       "stream_options": {"include_usage": True}}, MODEL)
    assert (chat.prompt_tokens, chat.max_tokens, chat.stream, chat.include_usage) == (3 + 3 + 1 + 3, 7, True, True)
    completion = parse_completion({"prompt": [1, 2, 3, 4], "model": MODEL}, MODEL)
    assert (completion.prompt_tokens, completion.max_tokens) == (4, 16)
    with pytest.raises(ApiError):
        parse_completion({"prompt": ""}, MODEL)
    with pytest.raises(ApiError):
        parse_completion({"prompt": {"a": 1}}, MODEL)


def test_cuda_without_torch_is_a_clear_error() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ComputeUnavailable, match="--device cuda needs PyTorch"):
            make_backend("cuda", 5)
    else:
        pytest.skip("torch is installed here; the error path cannot be shown")


def test_rows_are_padded_like_cuda_graph_batches() -> None:
    assert [padded_rows(r) for r in (0, 1, 8, 9, 40)] == [8, 8, 8, 16, 40]


class Recorder:
    def __init__(self) -> None:
        self.finished: dict[str, RequestHandle] = {}
        self.tokens: dict[str, list[str]] = {}
        self.done = threading.Condition()

    def on_finish(self, request: RequestHandle) -> None:
        with self.done:
            self.finished[request.request_id] = request
            self.done.notify_all()

    def wait(self, *ids: str, timeout: float = 10.0) -> None:
        with self.done:
            assert self.done.wait_for(lambda: all(i in self.finished for i in ids), timeout), self.finished.keys()

    def request(self, request_id: str, max_tokens: int, prompt_tokens: int = 4, **kw: object) -> RequestHandle:
        self.tokens[request_id] = []
        handle = RequestHandle(request_id=request_id, prompt_tokens=prompt_tokens, max_tokens=max_tokens, seed=7,
                               stream=True, model=MODEL, arrival_at=time.time_ns(), **kw)  # type: ignore[arg-type]
        handle.deliver = lambda kind, text: self.tokens[request_id].append(text) if kind == "token" else None
        return handle


@pytest.fixture(scope="module")
def backend() -> NumpyBackend:
    return NumpyBackend(step_ms=2.0)


@pytest.fixture
def engine_and_recorder(backend: NumpyBackend) -> Iterator[tuple[Engine, Recorder]]:
    recorder = Recorder()
    engine = Engine(backend, max_batch=2, prefill_chunk=8, on_finish=recorder.on_finish)
    engine.start()
    yield engine, recorder
    engine.stop()


def test_continuous_batching_admits_waiting_requests_as_slots_free(engine_and_recorder: tuple[Engine, Recorder]) -> None:
    engine, recorder = engine_and_recorder
    short, long_, third = (recorder.request("short", 3), recorder.request("long", 30), recorder.request("third", 3))
    for handle in (short, long_, third):
        engine.submit(handle)
    recorder.wait("short", "long", "third")
    assert short.finish_reason == long_.finish_reason == third.finish_reason == "length"
    assert [short.tokens_generated, long_.tokens_generated, third.tokens_generated] == [3, 30, 3]
    # The third waited for a free slot, then joined while "long" was still decoding.
    assert third.scheduled_at is not None and short.finished_at is not None and long_.finished_at is not None
    assert third.scheduled_at >= short.finished_at
    assert third.finished_at is not None and third.finished_at < long_.finished_at
    assert "".join(recorder.tokens["short"]) == "".join(token_text(7, i) for i in range(3))


def test_abort_removes_queued_by_id_and_running_between_steps(engine_and_recorder: tuple[Engine, Recorder]) -> None:
    engine, recorder = engine_and_recorder
    a, b, queued = recorder.request("a", 500), recorder.request("b", 500), recorder.request("queued", 5)
    for handle in (a, b, queued):
        engine.submit(handle)
    time.sleep(0.05)
    assert engine.phase_of(queued) is Phase.QUEUED
    engine.note_disconnect(queued, time.time_ns())
    engine.abort("queued")
    recorder.wait("queued")
    assert (queued.finish_reason, queued.scheduled_at, queued.tokens_generated) == ("abort", None, 0)
    assert queued.phase_at_disconnect == "queued" and queued.tokens_after_disconnect == 0
    engine.note_disconnect(a, time.time_ns())
    engine.abort("a")
    engine.abort("no-such-request")  # ignored
    recorder.wait("a")
    assert a.finish_reason == "abort" and a.tokens_after_disconnect is not None and a.tokens_after_disconnect <= 1
    engine.abort("b")
    recorder.wait("b")
    with pytest.raises(KeyError):
        engine.submit(recorder.request("dup", 500))
        engine.submit(recorder.request("dup", 500))
    engine.abort("dup")
    recorder.wait("dup")


def test_long_prompt_prefills_in_chunks_then_stop_word_ends_it(engine_and_recorder: tuple[Engine, Recorder]) -> None:
    engine, recorder = engine_and_recorder
    stop_word = token_text(7, 2).strip()
    handle = recorder.request("prefill", 50, prompt_tokens=40, stop_words=frozenset({stop_word}))
    steps_before = engine.steps
    engine.submit(handle)
    recorder.wait("prefill")
    assert handle.finish_reason == "stop"
    assert handle.tokens_generated == 2  # the stop word itself is not emitted
    assert engine.steps - steps_before >= 40 // 8 + 2  # 5 prefill steps (the last also samples) + decode


def test_stop_ends_requests_in_flight_as_aborted(backend: NumpyBackend) -> None:
    recorder = Recorder()
    engine = Engine(backend, max_batch=1, on_finish=recorder.on_finish)
    engine.start()
    running, queued = recorder.request("running", 10_000), recorder.request("queued", 10)
    engine.submit(running)
    engine.submit(queued)
    time.sleep(0.05)
    engine.stop()
    recorder.wait("running", "queued", timeout=2)
    assert running.finish_reason == queued.finish_reason == "abort"
    assert running.tokens_generated > 0 and queued.tokens_generated == 0
