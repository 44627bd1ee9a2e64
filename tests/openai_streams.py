"""What the streaming tests of both OpenAI routes share: read an SSE stream with each event's
arrival time, slow an engine's steps so that a stream's timing is measurable, and the check that
text arrived while tokens were still being generated (not in one piece at the end)."""

from __future__ import annotations

import contextlib
import json
import time

import httpx

from miles_platform.rollout.engine_core import EngineCore


def sse_events(url: str, path: str, body: dict, api_key: str) -> list[tuple[float, dict]]:
    """(seconds since the request, event) of every `data:` event before `[DONE]`, which must come."""
    events, t0 = [], time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"}
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return events
            if line.startswith("data: "):
                events.append((time.monotonic() - t0, json.loads(line.removeprefix("data: "))))
    raise AssertionError(f"the stream ended without [DONE] after {len(events)} events")


@contextlib.contextmanager
def slow_steps(core: EngineCore, seconds: float = 0.01):
    """Every engine step takes at least `seconds` longer (EngineCore.step_hook)."""
    core.step_hook = lambda _core: time.sleep(seconds)
    try:
        yield
    finally:
        core.step_hook = None


def text_of(event: dict) -> str:
    """The text an event adds: a chat delta's content or a completion chunk's text."""
    return "".join(
        (c.get("delta") or {}).get("content") or c.get("text") or "" for c in event.get("choices", [])
    )


def assert_streamed_while_generating(events: list[tuple[float, dict]], tokens: int) -> None:
    """Text came in many events spread over the generation of `tokens` tokens, the first long
    before the last."""
    times = [t for t, e in events if text_of(e)]
    assert len(times) >= tokens // 2, f"{len(times)} text events for {tokens} tokens"
    assert times[0] < 0.5 * times[-1] and times[-1] - times[0] > 0.3, (times[0], times[-1])
