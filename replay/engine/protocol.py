"""OpenAI request validation and response shapes for the reference engine.

Every bad input becomes an :class:`ApiError` with an OpenAI-style body
(``{"error": {"message", "type", "param", "code"}}``): 400 for a body that is not a JSON object,
404 for an unknown model, 422 for a JSON object whose fields are wrong. Nothing here raises anything
else on client input.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from replay.engine.tokens import count_chat_tokens, count_text_tokens

MAX_TOKENS_LIMIT = 32768
MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A client error with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
                413: "BadRequestError", 422: "UnprocessableEntityError"}.get(self.status, "BadRequestError")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.status}}


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What the engine needs from a validated request."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_text: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    stop_words: frozenset[str]
    temperature: float | None
    top_p: float | None
    n: int


def parse_body(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(422, f"{name} must be a number", param=name)
    if not low <= value <= high:
        raise ApiError(422, f"{name} must be between {low} and {high}, got {value}", param=name)
    return float(value)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(422, f"{name} must be an integer", param=name)
    if not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ApiError(422, f"{name} must be between 1 and {MAX_TOKENS_LIMIT}, got {value}", param=name)
    return value


def _stop_words(body: dict[str, Any]) -> frozenset[str]:
    stop = body.get("stop")
    if stop is None:
        return frozenset()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s.strip() for s in stop):
        raise ApiError(422, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return frozenset(s.strip() for s in stop)


def _message_text(message: Any, index: int) -> tuple[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(422, f"{param} must be an object with role and content", param=param)
    role = message.get("role")
    if role not in _ROLES:
        raise ApiError(422, f"{param}.role must be one of {', '.join(_ROLES)}", param=f"{param}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(422, f"{param}.content parts must be {{\"type\": \"text\", \"text\": ...}}",
                               param=f"{param}.content")
            texts.append(part["text"])
        return role, "\n".join(texts)
    raise ApiError(422, f"{param}.content must be a string or a list of text parts", param=f"{param}.content")


def _common(body: dict[str, Any], served_model: str) -> dict[str, Any]:
    model = body.get("model", served_model)
    if not isinstance(model, str):
        raise ApiError(422, "model must be a string", param="model")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served_model}`",
                       param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(422, "stream must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(422, "stream_options must be an object", param="stream_options")
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(422, "only n=1 is supported", param="n")
    return {
        "model": model,
        "stream": stream,
        "include_usage": bool(stream and options and options.get("include_usage")),
        "stop_words": _stop_words(body),
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "n": 1,
    }


def parse_chat(body: dict[str, Any], served_model: str) -> GenerationRequest:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(422, "messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(422, "messages must be a non-empty list", param="messages")
    pairs = [_message_text(message, i) for i, message in enumerate(messages)]
    common = _common(body, served_model)
    return GenerationRequest(
        kind="chat", prompt_text="\n".join(f"{role}: {text}" for role, text in pairs),
        prompt_tokens=count_chat_tokens(pairs),
        max_tokens=_max_tokens(body, DEFAULT_CHAT_MAX_TOKENS), **common)


def parse_completion(body: dict[str, Any], served_model: str) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        text, count = prompt, count_text_tokens(prompt)
    elif (isinstance(prompt, list) and prompt
          and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        text, count = " ".join(str(t) for t in prompt), len(prompt)
    elif prompt is None:
        raise ApiError(422, "prompt is required", param="prompt")
    else:
        raise ApiError(422, "prompt must be a string, a list of one string, or a list of token ids",
                       param="prompt")
    if count == 0:
        raise ApiError(422, "prompt is empty", param="prompt")
    common = _common(body, served_model)
    return GenerationRequest(kind="completion", prompt_text=text, prompt_tokens=count,
                             max_tokens=_max_tokens(body, DEFAULT_COMPLETION_MAX_TOKENS), **common)


def chunk(kind: str, request_id: str, model: str, created: int, text: str | None,
          finish_reason: str | None, *, first: bool = False) -> dict[str, Any]:
    """One streaming chunk in OpenAI's format."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def full_response(kind: str, request_id: str, model: str, created: int, text: str, finish_reason: str,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def now_created() -> int:
    return int(time.time())
