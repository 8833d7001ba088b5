"""README's head-of-line table and the demo's verdict, generated from a recorded run (never typed by hand).

README.md holds the table between two markers that name the record it comes from:

    <!-- headline: data/results/hol-blocking/<run>/summary.json -->
    | short requests | colocated | ... |

    The verdict it printed:

    - colocated: short requests' ITL p99 ...
    <!-- /headline -->

`python -m pdlab.report.readme [RECORD]` rewrites that block from RECORD (default: the record the marker names);
a test checks the block still equals what the record gives.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from pdlab.report.verdict import PARTS, verdict

#: The rows of README's table: (label, path into a scenario summary, unit).
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("short ITL p99", ("short", "itl_ms", "p99"), "ms"),
    ("short TTFT p99", ("short", "ttft_ms", "p99"), "ms"),
    ("short requests that stalled", ("short", "stalled", "share"), "%"),
    ("short worst gap, p99 over requests", ("short", "worst_gap_ms", "p99"), "ms"),
    ("short ITL p50", ("short", "itl_ms", "p50"), "ms"),
    ("long TTFT p50", ("long", "ttft_ms", "p50"), "ms"),
    ("long TTFT p99", ("long", "ttft_ms", "p99"), "ms"),
]

MARKER = re.compile(r"<!-- headline: (?P<record>\S+) -->\n(?P<table>.*?)<!-- /headline -->", re.S)


def _get(block: dict | None, path: tuple[str, ...]) -> Any:
    for key in path:
        block = block.get(key) if isinstance(block, dict) else None
    return block


def _cell(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{value:.0%}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def headline_markdown(summary: dict) -> str:
    """The table: the demo's scenarios side by side with the short requests alone, the figures people read first
    on top."""
    scenarios = summary.get("scenarios") or {}
    names = [n for n in PARTS if n in scenarios] + sorted(n for n in scenarios if n not in PARTS)
    blocks = [scenarios[n] for n in names] + ([summary["baseline"]] if summary.get("baseline") else [])
    heads = [PARTS.get(n, n.replace("_", " ")) for n in names] + (["alone"] if summary.get("baseline") else [])
    lines = ["| | " + " | ".join(heads) + " |", "| --- |" + " --- |" * len(heads)]
    for label, path, unit in ROWS:
        cells = [_cell(_get(block, path), unit) for block in blocks]
        if any(cell != "-" for cell in cells):
            lines.append(f"| {label}{' (ms)' if unit == 'ms' else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def verdict_markdown(summary: dict) -> str:
    """The verdict `pdlab demo` printed at the end of that run, as a list (the same sentences, from the same
    summary)."""
    return "".join(f"- {line}\n" for line in verdict(summary))


def render(readme_text: str, root: Path, record: str | None = None) -> str:
    """`readme_text` with its headline block regenerated from `record` (a summary.json path relative to `root`;
    default: the one the marker names)."""
    match = MARKER.search(readme_text)
    if match is None:
        raise ValueError("README has no <!-- headline: RECORD --> ... <!-- /headline --> block")
    source = record or match.group("record")
    summary = json.loads((root / source).read_text())
    block = (f"<!-- headline: {source} -->\n{headline_markdown(summary)}\nThe verdict it printed:\n\n"
             f"{verdict_markdown(summary)}<!-- /headline -->")
    return readme_text[:match.start()] + block + readme_text[match.end():]


def main(argv: list[str]) -> int:
    import argparse

    from pdlab.settings import repo_root

    parser = argparse.ArgumentParser(prog="python -m pdlab.report.readme",
                                     description="Regenerate README's demo table and verdict from a recorded run.")
    parser.add_argument("record", nargs="?", help="a recorded run (its folder or summary.json) under "
                        "data/results/hol-blocking/; default: the record README names")
    args = parser.parse_args(argv)
    root = repo_root()
    if root is None:
        print("run from a pdlab source checkout", file=sys.stderr)
        return 2
    readme = root / "README.md"
    record = args.record
    if record is not None and Path(record).is_dir():
        record = str(Path(record) / "summary.json")
    if record is not None:
        record = str(Path(record).resolve().relative_to(root))
    readme.write_text(render(readme.read_text(), root, record))
    print(f"README.md: headline table regenerated from {record or 'the record it names'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
