"""Synthetic traces in Mooncake's format (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), for
workloads whose point is shared prefixes: many questions about a few long documents, as in RAG or multi-turn
chat. Replayed with a `kind: trace` workload, equal leading `hash_ids` become equal leading prompt text, so
prefix- and KV-aware routing have something to find.

    rows = shared_prefix_trace(documents=6, requests=300, rate=0.5, seed=0)
    write_trace(rows, "data/traces/shared-prefix.jsonl")

`conversation_turns` picks the multi-turn conversations out of a recorded trace (Mooncake's conversation trace).
"""

from __future__ import annotations

import json
import random
from pathlib import Path


def shared_prefix_trace(documents: int = 6, requests: int = 300, rate: float = 0.5, document_blocks: int = 6,
                        question_blocks: int = 1, output_length: int = 64, block_tokens: int = 512,
                        seed: int = 0) -> list[dict]:
    """`requests` Poisson arrivals at `rate` per second, each asking one of `documents` documents (chosen
    uniformly): the prompt is the document's `document_blocks` shared blocks followed by `question_blocks` blocks
    of its own. Lengths are in tokens of `block_tokens`-token blocks, as in Mooncake's traces."""
    if min(documents, requests, document_blocks, question_blocks) < 1 or rate <= 0:
        raise ValueError("documents, requests, document_blocks and question_blocks must be >= 1, rate > 0")
    rng = random.Random(seed)
    doc_ids = [list(range(d * document_blocks, (d + 1) * document_blocks)) for d in range(documents)]
    next_id = documents * document_blocks
    rows, clock = [], 0.0
    for _ in range(requests):
        clock += rng.expovariate(rate)
        doc = rng.randrange(documents)
        own = list(range(next_id, next_id + question_blocks))
        next_id += question_blocks
        rows.append({"timestamp": round(clock * 1000), "input_length": (document_blocks + question_blocks) *
                     block_tokens, "output_length": output_length, "hash_ids": doc_ids[doc] + own})
    return rows


def conversation_turns(rows: list[dict], conversations: int, min_turns: int = 3, span_s: float = 90.0,
                       min_shared_blocks: int = 2) -> list[dict]:
    """The multi-turn conversations of a Mooncake-format trace, for labs about prefix reuse: a request whose first
    `min_shared_blocks` or more blocks all appeared before continues the conversation of the request that first
    had its last shared block. Keeps the first `conversations` conversations (in trace order) with at least
    `min_turns` turns, all their turns in trace order, re-timed evenly over `span_s` seconds (the trace's own
    follow-ups come minutes apart). Lengths and `hash_ids` are unchanged."""
    first_with: dict[int, int] = {}
    root_of: list[int] = []
    for i, row in enumerate(rows):
        blocks = row.get("hash_ids") or []
        shared = 0
        while shared < len(blocks) and blocks[shared] in first_with:
            shared += 1
        root_of.append(root_of[first_with[blocks[shared - 1]]] if shared >= min_shared_blocks else i)
        for block in blocks:
            first_with.setdefault(block, i)
    turns: dict[int, list[int]] = {}
    for i, root in enumerate(root_of):
        turns.setdefault(root, []).append(i)
    kept_roots = [root for root in sorted(turns) if len(turns[root]) >= min_turns][:conversations]
    kept = sorted(i for root in kept_roots for i in turns[root])
    step_ms = span_s * 1000 / max(1, len(kept))
    return [{**rows[i], "timestamp": round(n * step_ms)} for n, i in enumerate(kept)]


def write_trace(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
