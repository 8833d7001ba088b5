"""The demo's verdict in words: what a learner can repeat after a head-of-line run, built from its summary.json.

    for line in verdict(summary):
        print(line)

A scenario plays a part by its name: `colocated` (the default scheduler), `colocated_chunked` (chunked prefill
tuned), `disaggregated` (prefill and decode apart, NIXL), and any other `disaggregated_*` (another KV transport;
`disaggregated_lmcache`, LMCache's push, is set against NIXL's pull); `baseline` is the short requests alone.
Missing parts are left out of the sentences, never invented.
"""

from __future__ import annotations

from typing import Any

#: The scenario names a verdict speaks of, in the order it speaks of them, with the words it uses for each.
PARTS = {
    "colocated": "colocated",
    "colocated_chunked": "chunked prefill",
    "disaggregated": "disaggregated",
    "disaggregated_lmcache": "disaggregated, LMCache's push",
}


def _get(block: dict | None, *path: str) -> Any:
    node: Any = block
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _times(value: float | None, base: float | None) -> str:
    return f"{value / base:.1f}x" if value is not None and base else "-"


def _share(block: dict | None) -> str:
    share = _get(block, "short", "stalled", "share")
    return "-" if share is None else f"{share:.0%}"


def verdict(summary: dict) -> list[str]:
    """Sentences that say what the run showed: the short requests' freezes and first tokens in each scenario
    against the short requests alone, and what the long prompts paid for disaggregation. Built from the numbers a
    learner reads first (p99 ITL, p99 TTFT) and the per-request figures (share stalled, worst gap)."""
    scenarios = summary.get("scenarios") or {}
    alone = summary.get("baseline")
    lines: list[str] = []
    base_itl = _get(alone, "short", "itl_ms", "p99")
    base_ttft = _get(alone, "short", "ttft_ms", "p99")

    parts = [name for name in PARTS if name in scenarios] + sorted(
        name for name in scenarios if name.startswith("disaggregated_") and name not in PARTS)
    for name in parts:
        block = scenarios[name]
        words = PARTS.get(name, name.replace("_", " "))
        itl, ttft = _get(block, "short", "itl_ms", "p99"), _get(block, "short", "ttft_ms", "p99")
        lines.append(
            f"{words}: short requests' ITL p99 {_ms(itl)} ({_times(itl, base_itl)} alone), TTFT p99 {_ms(ttft)} "
            f"({_times(ttft, base_ttft)} alone); {_share(block)} of them stalled at least once, the worst gap "
            f"{_ms(_get(block, 'short', 'worst_gap_ms', 'p99'))} (p99 over requests).")
    if alone is not None:
        lines.append(f"alone (no long prompts): ITL p99 {_ms(base_itl)}, TTFT p99 {_ms(base_ttft)}.")

    colocated, split = scenarios.get("colocated"), scenarios.get("disaggregated")
    if colocated is not None and split is not None:
        lines.append(_price(colocated, split, summary))
    pushed = scenarios.get("disaggregated_lmcache")
    if split is not None and pushed is not None:
        lines.append(_push_pull(split, pushed))
    return lines


def _push_pull(pulled: dict, pushed: dict) -> str:
    """NIXL's pull against LMCache's push: how long after prefill's answer the long prompts' first token came, and
    their TTFT."""
    after = [_get(block, "by_path", "disaggregated", "after_prefill_ms", "p50") for block in (pushed, pulled)]
    ttft = [_get(block, "long", "ttft_ms", stat) for stat in ("p50", "p99") for block in (pushed, pulled)]
    return (f"push against pull: the long prompts' first token came {_ms(after[0])} after prefill's answer with "
            f"LMCache's push, {_ms(after[1])} with NIXL's pull (medians); their TTFT p50 {_ms(ttft[0])} vs "
            f"{_ms(ttft[1])}, p99 {_ms(ttft[2])} vs {_ms(ttft[3])}.")


def _price(colocated: dict, split: dict, summary: dict) -> str:
    """What the long prompts paid for disaggregation, and why."""
    before, after = _get(colocated, "long", "ttft_ms", "p50"), _get(split, "long", "ttft_ms", "p50")
    if before is None or after is None:
        return "long prompts: no completed long prompt to compare."
    kv = _get(summary, "kv_transfer", "disaggregated") or {}
    transfer = f", plus the KV transfer (mean {kv['mean_xfer_ms']:.0f} ms)" if kv.get("transfers") else ""
    change = (f"waited {after / before:.1f}x longer" if after >= before else f"waited {before / after:.1f}x less")
    return (f"the price: long prompts {change} for their first token disaggregated (TTFT p50 {_ms(after)} vs "
            f"{_ms(before)} colocated; p99 {_ms(_get(split, 'long', 'ttft_ms', 'p99'))} vs "
            f"{_ms(_get(colocated, 'long', 'ttft_ms', 'p99'))}): one prefill core instead of two{transfer}.")
