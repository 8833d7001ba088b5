"""StreamRecord on the byte lines of vLLM-style SSE bodies (the stand-in server tests cover live streams)."""

from __future__ import annotations

import json

from pdlab.sse import StreamRecord


def event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}".encode()


def test_completion_stream_times_each_token_and_reads_usage():
    record = StreamRecord()
    lines = [
        (event({"choices": [{"index": 0, "text": "a", "finish_reason": None}]}), 0.5),
        (b"", 0.5),
        (b": keep-alive comment", 0.6),
        (event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}), 0.7),
        (event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2}}), 0.7),
        (b"data: [DONE]", 0.8),
    ]
    for line, at in lines:
        record.feed(line, at)
    assert record.token_times == [0.5, 0.7]
    assert record.text == "ab"
    assert (record.usage_prompt_tokens, record.usage_completion_tokens) == (12, 2)
    assert record.complete


def test_chat_deltas_and_missing_done_is_incomplete():
    record = StreamRecord()
    record.feed(event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}}]}), 0.1)
    assert record.text == "hi"
    assert not record.complete


def test_error_inside_stream_is_kept():
    record = StreamRecord()
    record.feed(event({"error": {"message": "KV transfer failed", "type": "internal_server_error"}}), 0.2)
    record.feed("data: [DONE]", 0.3)
    assert record.error == "KV transfer failed"
    assert not record.complete


def test_a_chunk_carrying_two_tokens_counts_both_by_the_running_usage():
    """vLLM merges a lagging stream's deltas into one chunk; its running usage (continuous_usage_stats) says so."""
    record = StreamRecord()
    for text, running, at in [("a", 1, 0.5), ("bc", 3, 0.9), ("d", 4, 1.0)]:
        usage = {"prompt_tokens": 12, "completion_tokens": running}
        record.feed(event({"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": usage}), at)
    record.feed(event({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4}}), 1.0)
    assert record.token_times == [0.5, 0.9, 0.9, 1.0]
    assert record.usage_completion_tokens == 4


def test_a_chat_role_chunk_carries_no_token():
    record = StreamRecord()
    usage = {"prompt_tokens": 5, "completion_tokens": 0}
    record.feed(event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": usage}), 0.4)
    usage = {"prompt_tokens": 5, "completion_tokens": 1}
    record.feed(event({"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": usage}), 0.5)
    assert record.token_times == [0.5]


def test_raw_chunks_cut_anywhere_give_the_same_record():
    body = b"".join(line + b"\n\n" for line in (
        event({"choices": [{"index": 0, "text": "é", "finish_reason": None}]}),
        event({"choices": [{"index": 0, "text": "b", "finish_reason": "stop"}]}),
        b"data: [DONE]"))
    whole = StreamRecord()
    whole.feed_bytes(body, 1.0)
    for cut in range(1, len(body)):
        record = StreamRecord()
        record.feed_bytes(body[:cut], 1.0)
        record.feed_bytes(body[cut:], 1.0)
        assert record == whole
    assert whole.complete and whole.text == "éb" and len(whole.token_times) == 2
