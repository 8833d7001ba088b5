"""Reading an OpenAI-style server-sent-event stream (vLLM's `/v1/completions` and `/v1/chat/completions` with
`stream: true`) and timing it: when each token arrived, what usage the server reported, whether it finished.

Pure: feed it the lines of the body as they arrive, with the time each arrived. Ask the server for
`STREAM_OPTIONS`: a chunk may carry more than one token (vLLM merges the deltas of a request whose stream fell behind
the engine, e.g. on a busy CPU), and only the running usage on each chunk says how many it carried.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: `stream_options` for a timed stream: the final usage, and the running usage on every chunk (vLLM's
#: `continuous_usage_stats`), which counts the tokens a merged chunk carried.
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


@dataclass
class StreamRecord:
    """What one streamed response delivered. Times are seconds since the request was sent."""

    token_times: list[float] = field(default_factory=list)
    """Arrival time of every generated token: a chunk that carried n tokens (by the running usage) adds its time n
    times; without running usage, each chunk with a choice counts as one token."""
    text: str = ""
    finish_reason: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    done: bool = False
    """The `data: [DONE]` sentinel arrived: the stream ended normally."""
    error: str | None = None
    """An error object sent inside the stream (vLLM does this for errors after the headers went out)."""
    _partial: bytes = field(default=b"", repr=False)
    """The start of a line whose end has not arrived yet (`feed_bytes`)."""

    def feed_bytes(self, chunk: bytes, at: float) -> None:
        """Take raw body bytes as they arrived (any cut: a line split across chunks is fed once whole)."""
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            self.feed(line, at)

    def feed(self, line: bytes | str, at: float) -> None:
        """Take one line of the body, received `at` seconds after the request was sent."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, comments (": ping") and other SSE fields carry no tokens
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"malformed SSE data: {data[:80]!r}"
            return
        if "error" in event:
            err = event["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        choices = event.get("choices") or []
        for choice in choices:
            delta = choice.get("delta") or {}
            self.text += choice.get("text") or delta.get("content") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        running = usage.get("completion_tokens") if usage else None
        if choices:
            # A chunk whose running count did not grow (a role-only chat delta) carried no token.
            new = max(running - len(self.token_times), 0) if isinstance(running, int) else len(choices)
            self.token_times.extend([at] * new)
        if usage:
            self.usage_prompt_tokens = usage.get("prompt_tokens")
            self.usage_completion_tokens = running

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None
