"""Synthetic shared-prefix traces: Mooncake's format, deterministic, and the prefixes really are shared."""

from __future__ import annotations

from pdlab.load.schedule import read_trace
from pdlab.load.synthetic import shared_prefix_trace, write_trace
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
