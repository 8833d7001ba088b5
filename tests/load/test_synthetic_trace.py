"""Synthetic shared-prefix traces: Mooncake's format, deterministic, and the prefixes really are shared."""

from __future__ import annotations

from pdlab.load.schedule import read_trace
from pdlab.load.synthetic import conversation_turns, shared_prefix_trace, write_trace
from pdlab.settings import data_dir


def test_same_seed_same_trace_and_mooncake_format(tmp_path):
    rows = shared_prefix_trace(documents=3, requests=50, rate=2.0, seed=7)
    assert rows == shared_prefix_trace(documents=3, requests=50, rate=2.0, seed=7)
    assert rows != shared_prefix_trace(documents=3, requests=50, rate=2.0, seed=8)
    assert read_trace(write_trace(rows, tmp_path / "t.jsonl")) == rows
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)


def test_documents_share_their_blocks_and_questions_do_not():
    rows = shared_prefix_trace(documents=2, requests=40, document_blocks=4, question_blocks=1, seed=1)
    firsts = {tuple(r["hash_ids"][:4]) for r in rows}
    assert len(firsts) == 2  # two documents, each shared by many requests
    lasts = [r["hash_ids"][-1] for r in rows]
    assert len(set(lasts)) == len(rows)  # every question is its own
    assert all(r["input_length"] == 5 * 512 for r in rows)


def test_shipped_shared_prefix_trace_is_the_generators_output():
    shipped = read_trace(data_dir() / "traces" / "shared-prefix.jsonl")
    assert shipped == shared_prefix_trace(documents=6, requests=300, rate=0.5, seed=0)


def test_conversation_turns_groups_requests_by_their_shared_leading_blocks():
    """Block 0 (a system prompt every request starts with) alone does not join two conversations; two leading
    blocks seen before do. The kept conversations' turns keep their order and are re-timed evenly."""
    rows = [{"timestamp": t, "input_length": 512 * len(ids), "output_length": 8, "hash_ids": ids}
            for t, ids in enumerate([[0, 1, 2], [0, 5, 6], [0, 1, 2, 3], [0, 5, 6, 7], [0, 1, 2, 3, 4], [0, 9]])]
    assert [r["hash_ids"] for r in conversation_turns(rows, conversations=1, min_turns=3, span_s=3)] == [
        [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]
    two = conversation_turns(rows, conversations=2, min_turns=2, span_s=5)
    assert [r["hash_ids"][-1] for r in two] == [2, 6, 3, 7, 4]
    assert [r["timestamp"] for r in two] == [0, 1000, 2000, 3000, 4000]


def test_shipped_conversation_trace_is_twelve_conversations_of_three_turns_or_more():
    shipped = read_trace(data_dir() / "traces" / "mooncake-conversation-turns.jsonl")
    assert len(shipped) == 58
    assert conversation_turns(shipped, conversations=12, min_turns=3, span_s=120) == shipped
    assert conversation_turns(shipped, conversations=13, min_turns=3, span_s=120) == shipped  # no 13th
