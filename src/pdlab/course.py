"""Helpers the course notebooks share: the quick-mode switch, "check" cells, and teaching-only display helpers.
The measurements and figures themselves live in the library modules the notebooks call (pdlab.phases, ...)."""

from __future__ import annotations

import os
from typing import TypeVar

from pdlab.environment import Environment

#: Set to 1 to run every notebook with small parameters (CI, a first pass on a slow laptop).
QUICK_ENV = "PDLAB_QUICK"

T = TypeVar("T")


class CheckFailed(AssertionError):
    """A learner's measurement did not show the effect a notebook teaches; the message says what to try."""


def quick() -> bool:
    """Whether the notebooks should use small parameters: `PDLAB_QUICK` set to 1/true/yes/on."""
    value = os.environ.get(QUICK_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{QUICK_ENV}={value!r}: use 1 (quick) or 0 (full)")


def choose(full: T, quick_value: T) -> T:
    """`quick_value` in quick mode, else `full`: one line per knob in a notebook's parameter cell."""
    return quick_value if quick() else full


def check(condition: bool, effect: str, hint: str) -> None:
    """A notebook's check cell: pass quietly with a one-line confirmation, or raise CheckFailed saying which effect
    the measurement did not show and what to try (re-run on a quieter machine, larger sizes, ...)."""
    if not condition:
        raise CheckFailed(f"Your measurement does not show the expected effect: {effect}.\nWhat to try: {hint}")
    print(f"check passed: {effect}")


def environment_table(env: Environment) -> str:
    """The set-up check as a Markdown table (missing packages in bold), for `IPython.display.Markdown`."""
    lines = ["| what | value |", "| --- | --- |"]
    for what, value in env.rows():
        shown = f"**{value}**" if value in ("MISSING", "not made") else value
        lines.append(f"| {what} | {shown} |")
    return "\n".join(lines)

