"""What the engine does when a client disconnects: the correct abort and four known failure modes.

| behaviour     | on disconnect                                                               |
|---------------|-----------------------------------------------------------------------------|
| ``abort``     | abort at once: a queued request is removed by id, a running one stops between steps (vLLM) |
| ``detached``  | nothing: generation runs on to ``max_tokens`` as a background task            |
| ``no-check``  | the handler never listens for the disconnect; a stream stops when it next writes a token to the closed connection; a non-streaming request runs to the end |
| ``late``      | abort ``late_seconds`` after the disconnect (a delayed abort, as SGLang had)  |
| ``queued-leak``| a running request is aborted; the abort of a queued one is lost, so it still runs when its turn comes |

In every behaviour the moment the disconnect reached the server is recorded as ground truth.
"""

from __future__ import annotations

import asyncio

from replay.engine.core import Engine, Phase, RequestHandle

BEHAVIORS = ("abort", "detached", "no-check", "late", "queued-leak")


def handler_stops_on_disconnect(behavior: str) -> bool:
    """Whether the HTTP handler returns as soon as the disconnect arrives (all but ``no-check``)."""
    return behavior != "no-check"


def react_to_disconnect(behavior: str, engine: Engine, request: RequestHandle,
                        late_seconds: float) -> None:
    """Apply ``behavior`` to a request whose client just left (call on the event loop)."""
    if behavior == "abort":
        engine.abort(request.request_id)
    elif behavior == "late":
        asyncio.get_running_loop().call_later(late_seconds, engine.abort, request.request_id)
    elif behavior == "queued-leak" and engine.phase_of(request) is not Phase.QUEUED:
        engine.abort(request.request_id)
    # detached and no-check do nothing here: that is their bug.
