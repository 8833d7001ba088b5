"""Synthetic traces in Mooncake's format (`timestamp` ms, `input_length`, `output_length`, `hash_ids`), for
workloads whose point is shared prefixes: many questions about a few long documents, as in RAG or multi-turn
chat. Replayed with a `kind: trace` workload, equal leading `hash_ids` become equal leading prompt text, so
prefix- and KV-aware routing have something to find.

    rows = shared_prefix_trace(documents=6, requests=300, rate=0.5, seed=0)
    write_trace(rows, "data/traces/shared-prefix.jsonl")
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


def write_trace(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
