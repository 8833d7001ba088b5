"""Student copies of the course notebooks, and the answers kept apart from them.

A reference notebook (`notebooks/NN-topic.py`) ends with a Markdown cell `## Exercises`: a numbered list. Its
answers live in `notebooks/answers/NN-topic.py`, a jupytext percent-format file with one section per exercise:

    # %% [markdown]
    # ## Exercise 1
    # What you should see, and why.

    # %%
    code that shows it, using the notebook's own variables (it runs after the notebook, in the same kernel)

A student copy (`notebooks/student/NN-topic.ipynb`, made by `pdlab workshop student-copies`, which `make lab` runs)
is the reference notebook with each exercise in a cell of its own followed by an empty code cell to fill; the
answers are not in it. `answer("NN", n)` shows exercise n's answer in the notebook, on request; with `load=True` it
also puts the answer's code into a new cell below, to run.

`with_answers(path)` is the reference notebook with every answer's cells appended after the exercises, each
tagged `answer-N`: what the notebook tests execute, so that every answer runs in CI like the notebooks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import jupytext
import nbformat

from pdlab.settings import repo_root

#: `## Exercise 3` (a Markdown heading) starts exercise 3's section of an answers file.
EXERCISE_HEADING = re.compile(r"^#{1,4}\s*Exercise\s+(\d+)\b", re.I | re.M)
#: A numbered item of the Exercises cell: `3. text` at the start of a line.
EXERCISE_ITEM = re.compile(r"^(\d+)\.\s+", re.M)
STUDENT_DIR = "student"
ANSWERS_DIR = "answers"


class WorkbookError(ValueError):
    """A notebook or answers file that does not follow the pattern; the message names the file."""


@dataclass
class Answer:
    number: int
    explanation: str
    """Markdown: what the learner should see and why."""
    code: list[str] = field(default_factory=list)
    """The answer's code cells, in order."""


def notebooks_dir() -> Path:
    root = repo_root()
    if root is None:
        raise FileNotFoundError("the notebooks are only available from a source checkout")
    return root / "notebooks"


def reference_notebooks(directory: Path | None = None) -> list[Path]:
    return sorted((directory or notebooks_dir()).glob("[0-9][0-9]-*.py"))


def find_notebook(name: str, directory: Path | None = None) -> Path:
    """A reference notebook by its number (`"03"`, `3`) or its stem (`"03-disaggregate"`)."""
    key = f"{int(name):02d}" if str(name).isdigit() else str(name)
    matches = [p for p in reference_notebooks(directory) if p.stem == key or p.stem.split("-", 1)[0] == key]
    if len(matches) != 1:
        raise WorkbookError(f"no single notebook named {name!r} under {directory or notebooks_dir()}")
    return matches[0]


def answers_path(notebook: Path) -> Path:
    return notebook.parent / ANSWERS_DIR / notebook.name


def exercises(notebook: Path) -> dict[int, str]:
    """The exercises of a reference notebook, by number: the items of its last cell, `## Exercises`."""
    cells = jupytext.read(notebook).cells
    last = cells[-1] if cells else None
    if last is None or last.cell_type != "markdown" or "## Exercises" not in last.source:
        raise WorkbookError(f"{notebook.name}: the last cell is not a Markdown `## Exercises` cell")
    body = last.source.split("## Exercises", 1)[1]
    items = list(EXERCISE_ITEM.finditer(body))
    found: dict[int, str] = {}
    for i, item in enumerate(items):
        end = items[i + 1].start() if i + 1 < len(items) else len(body)
        text = body[item.end():end]
        found[int(item.group(1))] = " ".join(line.strip() for line in text.strip().splitlines())
    if list(found) != list(range(1, len(found) + 1)):
        raise WorkbookError(f"{notebook.name}: exercises are numbered {list(found)}, want 1..{len(found)}")
    return found


def answers(notebook: Path) -> dict[int, Answer]:
    """The answers file of a reference notebook, parsed: one Answer per `## Exercise N` section."""
    path = answers_path(notebook)
    if not path.exists():
        raise WorkbookError(f"{notebook.name}: no answers file {path}")
    found: dict[int, Answer] = {}
    current: Answer | None = None
    for cell in jupytext.read(path).cells:
        heading = EXERCISE_HEADING.search(cell.source) if cell.cell_type == "markdown" else None
        if heading:
            number = int(heading.group(1))
            if number in found:
                raise WorkbookError(f"{path.name}: exercise {number} answered twice")
            current = found[number] = Answer(number, EXERCISE_HEADING.sub("", cell.source, count=1).strip())
        elif current is None:
            continue  # a preamble before the first exercise
        elif cell.cell_type == "markdown":
            current.explanation += "\n\n" + cell.source
        elif cell.source.strip():
            current.code.append(cell.source)
    return found


def check_answered(notebook: Path) -> None:
    """Raise WorkbookError unless every exercise has an answer (with an explanation) and every answer an exercise."""
    asked, answered = exercises(notebook), answers(notebook)
    if missing := sorted(set(asked) - set(answered)):
        raise WorkbookError(f"{notebook.name}: no answer to exercise(s) {missing}")
    if extra := sorted(set(answered) - set(asked)):
        raise WorkbookError(f"{answers_path(notebook).name}: answers to exercises the notebook does not ask: {extra}")
    if empty := [n for n, a in answered.items() if not a.explanation.strip()]:
        raise WorkbookError(f"{answers_path(notebook).name}: exercise(s) {empty} have no explanation")


def _code_cell(source: str, tags: list[str]) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell(source, metadata={"tags": tags})


def with_answers(notebook: Path) -> nbformat.NotebookNode:
    """The reference notebook with every answer's cells after its exercises (code cells tagged `answer-N`)."""
    check_answered(notebook)
    nb = jupytext.read(notebook)
    for number, answer in sorted(answers(notebook).items()):
        nb.cells.append(nbformat.v4.new_markdown_cell(f"### Answer {number}\n\n{answer.explanation}",
                                                      metadata={"tags": [f"answer-{number}"]}))
        nb.cells += [_code_cell(code, [f"answer-{number}"]) for code in answer.code]
    return nb


def student_copy(notebook: Path) -> nbformat.NotebookNode:
    """The reference notebook with its exercises one per cell, each followed by an empty code cell (tagged
    `exercise-N`) to fill; no answers, and no jupytext pairing (saving it writes only the .ipynb)."""
    asked = exercises(notebook)
    nb = jupytext.read(notebook)
    number = notebook.stem.split("-", 1)[0]
    intro = nb.cells[-1].source.split("## Exercises", 1)[0]
    how = "Each exercise has a cell below it for your answer."
    if answers_path(notebook).exists():
        how += (f" To compare with the reference answer, run `workbook.answer(\"{number}\", N)` in a cell (after "
                f"`from pdlab.workshop import workbook`); `workbook.answer(\"{number}\", N, load=True)` also puts "
                f"its code in a new cell.")
    nb.cells[-1] = nbformat.v4.new_markdown_cell(f"{intro}## Exercises\n\n{how}")
    for n, text in asked.items():
        nb.cells.append(nbformat.v4.new_markdown_cell(f"**Exercise {n}.** {text}"))
        nb.cells.append(_code_cell("", [f"exercise-{n}"]))
    nb.metadata.pop("jupytext", None)
    return nb


def write_student_copies(directory: Path | None = None, force: bool = False) -> dict[Path, str]:
    """Write `notebooks/student/NN-topic.ipynb` for every reference notebook; a copy that exists is the learner's
    work and is kept unless `force`. Returns each copy's path and what happened (`written`, `kept`, or why it was
    not written: a notebook whose exercises do not follow the pattern gets no copy, the others still do, so that
    `make lab` opens)."""
    directory = directory or notebooks_dir()
    out_dir = directory / STUDENT_DIR
    out_dir.mkdir(exist_ok=True)
    done = {}
    for notebook in reference_notebooks(directory):
        target = out_dir / f"{notebook.stem}.ipynb"
        if target.exists() and not force:
            done[target] = "kept"
            continue
        try:
            copy = student_copy(notebook)
        except WorkbookError as error:
            done[target] = f"not written: {error}"
            continue
        nbformat.write(copy, target)
        done[target] = "written"
    return done


def answer_markdown(notebook: str | Path, number: int) -> str:
    """Exercise `number` of `notebook` and its reference answer, as Markdown."""
    path = notebook if isinstance(notebook, Path) else find_notebook(str(notebook))
    asked, answered = exercises(path), answers(path)
    if number not in answered:
        raise WorkbookError(f"{path.stem} has no exercise {number}; its exercises are {sorted(asked)}")
    answer = answered[number]
    code = "".join(f"\n\n```python\n{source.rstrip()}\n```" for source in answer.code)
    return f"**Exercise {number}.** {asked.get(number, '')}\n\n**Answer.** {answer.explanation}{code}"


def answer(notebook: str | Path, number: int, load: bool = False) -> None:
    """Show exercise `number`'s reference answer in the notebook; with `load`, also put its code in a new cell
    below (as IPython's `%load` does), to run there."""
    from IPython import get_ipython
    from IPython.display import Markdown, display

    path = notebook if isinstance(notebook, Path) else find_notebook(str(notebook))
    display(Markdown(answer_markdown(path, number)))
    if load:
        shell = get_ipython()
        if shell is None:
            raise RuntimeError("load=True works in a notebook (an IPython kernel)")
        shell.set_next_input("\n\n".join(answers(path)[number].code), replace=False)
