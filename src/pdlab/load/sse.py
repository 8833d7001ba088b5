"""Reading an OpenAI-style server-sent-event stream (vLLM's `/v1/completions` and `/v1/chat/completions` with
`stream: true`) and timing it: when each token arrived, what usage the server reported, whether it finished.

Pure: feed it the lines of the body as they arrive, with the time each arrived.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class StreamRecord:
    """What one streamed response delivered. Times are seconds since the request was sent."""

    token_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried a choice (one generated token per chunk in vLLM)."""
    text: str = ""
    finish_reason: str | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    done: bool = False
    """The `data: [DONE]` sentinel arrived: the stream ended normally."""
    error: str | None = None
    """An error object sent inside the stream (vLLM does this for errors after the headers went out)."""

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
        for choice in event.get("choices") or []:
            self.token_times.append(at)
            delta = choice.get("delta") or {}
            self.text += choice.get("text") or delta.get("content") or ""
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            self.usage_prompt_tokens = usage.get("prompt_tokens")
            self.usage_completion_tokens = usage.get("completion_tokens")

    @property
    def complete(self) -> bool:
        return self.done and self.error is None and self.finish_reason is not None
