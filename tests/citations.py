"""Figures quoted in prose, and the recorded results they come from.

The convention (docs/dev/citing-figures.md tells authors how to write it):

    The KV transfer of a 3,000-token prompt moved 50.3 MB<!-- cite data/results/transfer/20261202-030654.json:
    -, trials.0.bytes / 1e6 -->.

A `<!-- cite PATH: EXPR, EXPR, ...; PATH2: EXPR -->` comment covers the numbers written before it in the same block
(a paragraph, a list item, a table row), back to the previous comment in that block; they are matched one by one,
in order, with its expressions. An expression is a key path into the JSON or YAML file
(`summary.idle.xfer_ms_median`, `trials.0.bytes`, `"Llama-3.1-70B".num_layers` for a key with dots; `*` matches
every key or item), arithmetic with spaces around the operators (`a / 1000`, `x * 100`), and `min`, `max`,
`median`, `mean`, `sum`, `len`, `round` over paths with `*`. `{a,b}` expands like a shell brace
(`scenarios.{colocated,disaggregated}.p99` is two expressions, in that order). `-` skips one number that is not a
figure (the 3,000 above is the prompt's length, a setting; a label's "5x the median"; a notebook's number).

A number matches when the file's value rounds to it at the precision written (`9.7` matches 9.66, `1,250` matches
1249.6); a number written `~N` or "about N" matches within 10%. `<!-- stated: why -->` covers numbers that are
requirements or definitions, not measurements (the reason is required).

A figure-like number (one with a unit of time, size, rate, a percentage or a ratio, or any number in a table's data
row) that no comment covers is an uncited figure. Code spans and blocks, link targets and the Exercises section
(whose numbers are settings to try, not results) are not read.
"""

from __future__ import annotations

import ast
import itertools
import json
import re
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

COMMENT = re.compile(r"<!--(.*?)-->", re.S)
#: A number as prose writes it: thousands separators, decimals; not glued to a word before it (p99, H200, x0.25,
#: Llama-3.1) and not a version (0.32.0).
NUMBER = re.compile(r"(?<![\w.\-/])(?<![A-Za-z]-)(~|≈)?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\d.]*\.\d)(?![,.]?\d)")
UNITS = (r"ms|µs|us|s|sec|seconds?|min|minutes?|h|hours?|[KMGT]i?B|kB|[KMGT]b/s|[KMG]bit/s|[KMGT]B/s|"
         r"(?:T|G|M)?FLOP/s|tokens?/s|req/s|requests?/s|%|x|×")
UNIT_AFTER = re.compile(rf"\s?(?:{UNITS})(?![A-Za-z0-9])")
GLUED_WORD = re.compile(rf"(?!(?:{UNITS})(?![A-Za-z0-9]))[A-Za-z]")
APPROXIMATE_WORDS = re.compile(r"(?:about|around|roughly|nearly|almost|approximately|some)\s+$", re.I)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK_TARGET = re.compile(r"\]\([^)]*\)")
FUNCTIONS = {"min": min, "max": max, "median": statistics.median, "mean": statistics.fmean, "sum": sum, "len": len,
             "round": round, "abs": abs}
PATH_TOKEN = re.compile(r'(?<![\w."])((?:"[^"]*"|[A-Za-z_][\w@\-]*)(?:\.(?:"[^"]*"|\*|[\w@\-]+))*)')
KEY_PART = re.compile(r'"([^"]*)"|([^.]+)')


class CitationError(ValueError):
    pass


@dataclass(frozen=True)
class Figure:
    """A number in prose: where, as written, its value and whether it is written as approximate."""

    source: str
    line: int
    text: str
    value: float
    decimals: int
    approximate: bool
    figure_like: bool

    def where(self) -> str:
        return f"{self.source}:{self.line}: {self.text!r}"

    def matches(self, value: float) -> bool:
        if self.approximate:
            return abs(value - self.value) <= 0.1 * abs(value) + 0.5 * 10 ** -self.decimals
        return abs(value - self.value) <= 0.5 * 10 ** -self.decimals + 1e-9 * abs(value)


@dataclass(frozen=True)
class Citation:
    source: str
    line: int
    stated: str | None
    """The reason, for a `stated` comment."""
    entries: tuple[tuple[str, str], ...]
    """(file, expression) per number covered; expression `-` skips one."""


@dataclass
class Segment:
    figures: list[Figure]
    citation: Citation | None


# --- reading markdown -------------------------------------------------------------------------------------------
def markdown_of_notebook(text: str) -> list[tuple[int, str]]:
    """The markdown cells of a jupytext percent-format notebook, as (line number, line) with `# ` removed; a blank
    line separates cells."""
    out: list[tuple[int, str]] = []
    in_markdown = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("# %%"):
            in_markdown = "[markdown]" in line
            out.append((number, ""))
            continue
        if in_markdown:
            out.append((number, line[2:] if line.startswith("# ") else line.lstrip("#")))
    return out


#: Blocks generated from a record by code, with a test of their own (README's demo table: pdlab.report.readme and
#: its test): (opening marker, closing marker). Their lines are not read here.
GENERATED = (("<!-- headline:", "<!-- /headline -->"), ("<!-- demo figures", "<!-- end of demo figures -->"))


def markdown_lines(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    lines = markdown_of_notebook(text) if path.suffix == ".py" else list(enumerate(text.splitlines(), 1))
    out, closing = [], None
    for number, line in lines:
        if closing is None:
            closing = next((end for start, end in GENERATED if line.lstrip().startswith(start)), None)
            out.append((number, "" if closing else line))
        else:
            if closing in line:
                closing = None
            out.append((number, ""))
    return out


def blocks(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Paragraphs, list items and table rows (each row its own block); fenced code and the Exercises section
    left out."""
    out: list[list[tuple[int, str]]] = []
    current: list[tuple[int, str]] = []
    fenced = exercises = in_comment = False

    def close() -> None:
        nonlocal current
        if current:
            out.append(current)
        current = []

    for number, line in lines:
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            close()
            continue
        if fenced:
            continue
        if stripped.startswith("#"):
            close()
            exercises = stripped.lstrip("#").strip().lower().startswith("exercises")
            if not exercises:
                out.append([(number, line)])
            continue
        if exercises:
            continue
        if not stripped and not in_comment:
            close()
            continue
        starts_item = re.match(r"(?:[-*+]|\d+\.)\s", stripped) or stripped.startswith("|")
        if starts_item and not in_comment:
            close()
        current.append((number, line))
        in_comment = line.count("<!--") > line.count("-->") if not in_comment else "-->" not in line
        if stripped.startswith("|") and not in_comment:
            close()
    close()
    return out


def _table_data_row(text: str) -> bool:
    return text.lstrip().startswith("|") and not re.fullmatch(r"[\s|:\-]+", text)


def _numeric_cell(text: str, index: int) -> bool:
    """Whether the table cell around `index` holds only numbers (with units and separators): a table of results."""
    start = text.rfind("|", 0, index) + 1
    end = text.find("|", index)
    cell = text[start:end if end >= 0 else len(text)]
    rest = UNIT_AFTER.sub(" ", NUMBER.sub(" ", cell))
    return not re.sub(r"[\s/,;()~≈\-–]|\b(?:and|to|or)\b", "", rest)


def _figures(source: str, pieces: list[tuple[int, str]], table_row: bool) -> list[Figure]:
    figures = []
    for line, text in pieces:
        text = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", text))
        for m in NUMBER.finditer(text):
            after = text[m.end():]
            if GLUED_WORD.match(after):
                continue  # 1P1D, 70B, 3rd: part of a name
            digits = m.group(2).replace(",", "") + (m.group(3) or "")
            approximate = bool(m.group(1)) or bool(APPROXIMATE_WORDS.search(text[:m.start()]))
            figure_like = bool(UNIT_AFTER.match(after)) or (table_row and _numeric_cell(text, m.start()))
            unit = UNIT_AFTER.match(after)
            written = m.group(0) + (unit.group(0) if unit else "")
            figures.append(Figure(source, line, written, float(digits), len(m.group(3) or ".") - 1, approximate,
                                  figure_like))
    return figures


def parse_comment(source: str, line: int, body: str) -> Citation | None:
    body = " ".join(body.split())
    if body.startswith("stated:"):
        reason = body.removeprefix("stated:").strip()
        if not reason:
            raise CitationError(f"{source}:{line}: `<!-- stated: ... -->` needs a reason")
        return Citation(source, line, reason, ())
    if not body.startswith("cite "):
        return None
    entries: list[tuple[str, str]] = []
    for group in _split_top(body.removeprefix("cite ").strip(), ";"):
        path, sep, exprs = group.partition(": ")
        if not sep:
            raise CitationError(f"{source}:{line}: want `cite PATH: EXPR, ...`, got {group!r}")
        for expr in _split_top(exprs, ","):
            entries += [(path.strip(), e) for e in expand_braces(expr.strip())]
    return Citation(source, line, None, tuple(entries))


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside (), {} and []."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "({[" and 1 or 0
        depth -= ch in ")}]" and 1 or 0
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def expand_braces(expr: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", expr)
    if not m:
        return [expr]
    return [e for option in m.group(1).split(",")
            for e in expand_braces(expr[:m.start()] + option.strip() + expr[m.end():])]


def segments(path: Path, root: Path) -> list[Segment]:
    """The numbers of a markdown file (or a notebook's markdown cells), grouped by the comment that covers them."""
    source = str(path.relative_to(root))
    out: list[Segment] = []
    for block in blocks(markdown_lines(path)):
        table_row = _table_data_row(block[0][1])
        pending: list[Figure] = []
        text = "\n".join(t for _, t in block)
        ends = list(itertools.accumulate(len(t) + 1 for _, t in block))
        pos = 0
        # a comment written inside a code span is an example, not a citation
        for m in COMMENT.finditer(CODE_SPAN.sub(lambda span: " " * len(span.group()), text)):
            pending += _figures(source, _pieces(block, ends, text, pos, m.start()), table_row)
            citation = parse_comment(source, _line_at(block, ends, m.start()), m.group(1))
            pos = m.end()
            if citation is None:
                continue
            out.append(Segment(pending, citation))
            pending = []
        pending += _figures(source, _pieces(block, ends, text, pos, len(text)), table_row)
        if pending:
            out.append(Segment(pending, None))
    return out


def _line_at(block: list[tuple[int, str]], ends: list[int], index: int) -> int:
    """The file line of character `index` of a block's joined text (`ends`: each line's end offset)."""
    return block[next((i for i, end in enumerate(ends) if index < end), len(block) - 1)][0]


def _pieces(block: list[tuple[int, str]], ends: list[int], text: str, start: int, end: int
            ) -> list[tuple[int, str]]:
    """The text from `start` to `end` of a block, cut into (file line, text) pieces."""
    pieces, pos = [], start
    for part in text[start:end].split("\n"):
        pieces.append((_line_at(block, ends, pos), part))
        pos += len(part) + 1
    return pieces


# --- reading results --------------------------------------------------------------------------------------------
@cache
def load_data(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def lookup(data: Any, key: str) -> Any:
    """A dotted key path (a key with dots in it in double quotes: `"Llama-3.1-70B".num_layers`); `*` gives a list of
    every match."""
    values = [data]
    starred = False
    for quoted, plain in KEY_PART.findall(key):
        part = quoted or plain
        found = []
        for value in values:
            if part == "*":
                starred = True
                found += list(value.values()) if isinstance(value, dict) else list(value)
            elif isinstance(value, dict) and part in value:
                found.append(value[part])
            elif isinstance(value, list) and re.fullmatch(r"-?\d+", part) and -len(value) <= int(part) < len(value):
                found.append(value[int(part)])
            else:
                raise CitationError(f"no key {part!r} in {key!r}")
        values = found
    return values if starred else values[0]


def evaluate(expr: str, data: Any) -> float:
    names: dict[str, Any] = {}

    def name_for(m: re.Match) -> str:
        token = m.group(1)
        if token in FUNCTIONS and expr[m.end():].lstrip().startswith("("):
            return token
        name = f"_v{len(names)}"
        names[name] = lookup(data, token)
        return name

    code = PATH_TOKEN.sub(name_for, expr)
    tree = ast.parse(code, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name, ast.Load, ast.Call, ast.Add,
               ast.Sub, ast.Mult, ast.Div, ast.USub, ast.Pow)
    for node in ast.walk(tree):
        if not isinstance(node, allowed):
            raise CitationError(f"{expr!r}: {type(node).__name__} is not allowed in a citation")
    value = eval(compile(tree, "<cite>", "eval"), {"__builtins__": {}}, {**FUNCTIONS, **names})  # noqa: S307
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CitationError(f"{expr!r} is {value!r}, not a number")
    return float(value)


# --- checking ---------------------------------------------------------------------------------------------------
def problems(paths: list[Path], root: Path, uncited: bool = True) -> tuple[list[str], int]:
    """Every mismatch, bad citation and (with `uncited`) uncited figure in `paths`, and how many numbers were
    checked."""
    found: list[str] = []
    checked = 0
    for path in paths:
        try:
            segs = segments(path, root)
        except CitationError as error:
            found.append(str(error))
            continue
        for seg in segs:
            cit = seg.citation
            if cit is None:
                found += [f"{f.where()}: uncited figure" for f in seg.figures if f.figure_like and uncited]
                continue
            if cit.stated is not None:
                continue
            if len(cit.entries) != len(seg.figures):
                written = ", ".join(f.text for f in seg.figures) or "none"
                found.append(f"{cit.source}:{cit.line}: the citation has {len(cit.entries)} expressions for "
                             f"{len(seg.figures)} numbers before it ({written})")
                continue
            for figure, (file, expr) in zip(seg.figures, cit.entries, strict=True):
                if expr == "-":
                    continue
                target = root / file
                if not target.is_file():
                    found.append(f"{figure.where()}: cited file {file} does not exist")
                    continue
                try:
                    value = evaluate(expr, load_data(target))
                except (CitationError, SyntaxError, TypeError, ValueError, ZeroDivisionError) as error:
                    found.append(f"{figure.where()}: {file}: {expr}: {error}")
                    continue
                checked += 1
                if not figure.matches(value):
                    found.append(f"{figure.where()}: {file}: {expr} is {value:.6g}")
    return found, checked
