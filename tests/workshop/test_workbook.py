"""Student copies and answers (pdlab.workshop.workbook), on a small notebook written here, executed by a real kernel."""

from __future__ import annotations

import textwrap
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from pdlab.workshop import workbook

NOTEBOOK = textwrap.dedent('''\
    # ---
    # jupyter:
    #   jupytext:
    #     formats: ipynb,py:percent
    #     text_representation:
    #       extension: .py
    #       format_name: percent
    #   kernelspec:
    #     display_name: Python 3 (ipykernel)
    #     language: python
    #     name: python3
    # ---

    # %% [markdown]
    # # 01 · A demo
    #
    # **Learning objectives.** Add one.

    # %%
    x = 41

    # %% [markdown]
    # ## Exercises
    #
    # 1. Add one to `x`. What do you get?
    # 2. Why 41? Think about it
    #    for a while.
    ''')

ANSWERS = textwrap.dedent('''\
    # %% [markdown]
    # Answers to notebook 01.

    # %% [markdown]
    # ## Exercise 1
    # You get 42, the answer.

    # %%
    print("answer:", x + 1)

    # %% [markdown]
    # ## Exercise 2
    # Because 41 + 1 is 42.
    ''')


@pytest.fixture
def notebooks(tmp_path: Path) -> Path:
    (tmp_path / "01-demo.py").write_text(NOTEBOOK)
    (tmp_path / "answers").mkdir()
    (tmp_path / "answers" / "01-demo.py").write_text(ANSWERS)
    return tmp_path


def test_exercises_and_answers_are_read_by_number(notebooks: Path) -> None:
    path = workbook.find_notebook("1", notebooks)
    assert workbook.exercises(path) == {1: "Add one to `x`. What do you get?", 2: "Why 41? Think about it for a while."}
    answers = workbook.answers(path)
    assert sorted(answers) == [1, 2]
    assert answers[1].explanation == "You get 42, the answer." and answers[1].code == ['print("answer:", x + 1)']
    assert answers[2].code == []
    workbook.check_answered(path)


def test_a_missing_answer_is_named(notebooks: Path) -> None:
    path = notebooks / "01-demo.py"
    path.write_text(NOTEBOOK + "# 3. A third one.\n")
    with pytest.raises(workbook.WorkbookError, match=r"no answer to exercise\(s\) \[3\]"):
        workbook.check_answered(path)


def test_the_student_copy_has_an_empty_cell_per_exercise_and_no_answers(notebooks: Path) -> None:
    copy = workbook.student_copy(notebooks / "01-demo.py")
    tagged = [c for c in copy.cells if any(t.startswith("exercise-") for t in c.metadata.get("tags", []))]
    assert [c.metadata["tags"] for c in tagged] == [["exercise-1"], ["exercise-2"]]
    assert all(c.cell_type == "code" and c.source == "" for c in tagged)
    text = "\n".join(c.source for c in copy.cells)
    assert "Exercise 1.** Add one" in text and "workbook.answer(\"01\", N)" in text
    assert "42" not in text, "the student copy must not show the answers"
    assert "jupytext" not in copy.metadata, "a student copy must not pair with (and overwrite) a .py source"


def test_student_copies_keep_the_learners_work(notebooks: Path) -> None:
    first = workbook.write_student_copies(notebooks)
    target = notebooks / "student" / "01-demo.ipynb"
    assert first == {target: "written"}
    work = nbformat.read(target, as_version=4)
    work.cells[-1].source = "x + 1  # mine"
    nbformat.write(work, target)
    assert workbook.write_student_copies(notebooks) == {target: "kept"}
    assert "# mine" in target.read_text()
    assert workbook.write_student_copies(notebooks, force=True) == {target: "written"}
    assert "# mine" not in target.read_text()


def test_answers_run_after_the_notebook_in_its_kernel(notebooks: Path) -> None:
    """What the notebook tests execute: the notebook, then every answer, tagged by exercise."""
    nb = workbook.with_answers(notebooks / "01-demo.py")
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    outputs = {tag: "".join(o.get("text", "") for o in c.get("outputs", []))
               for c in nb.cells for tag in c.metadata.get("tags", []) if c.cell_type == "code"}
    assert outputs == {"answer-1": "answer: 42\n"}


def test_an_answer_is_shown_on_request(notebooks: Path) -> None:
    shown = workbook.answer_markdown(notebooks / "01-demo.py", 1)
    assert shown.startswith("**Exercise 1.** Add one") and "You get 42" in shown and "```python" in shown
    with pytest.raises(workbook.WorkbookError, match="no exercise 5"):
        workbook.answer_markdown(notebooks / "01-demo.py", 5)


def test_without_an_answers_file_the_copy_does_not_offer_answers(notebooks: Path) -> None:
    (notebooks / "answers" / "01-demo.py").unlink()
    text = "\n".join(c.source for c in workbook.student_copy(notebooks / "01-demo.py").cells)
    assert "Exercise 2.** Why 41?" in text and "workbook.answer" not in text


def test_a_notebook_off_the_pattern_gets_no_copy_and_the_others_do(notebooks: Path) -> None:
    (notebooks / "02-odd.py").write_text(NOTEBOOK.replace("## Exercises", "## Further work"))
    done = workbook.write_student_copies(notebooks)
    assert done[notebooks / "student" / "01-demo.ipynb"] == "written"
    assert done[notebooks / "student" / "02-odd.ipynb"].startswith("not written: 02-odd.py: the last cell")


def test_every_course_notebook_has_a_student_copy(tmp_path: Path) -> None:
    """The repository's own notebooks follow the pattern (what `make lab` writes copies of)."""
    import shutil

    for notebook in workbook.reference_notebooks():
        shutil.copy(notebook, tmp_path / notebook.name)
    done = workbook.write_student_copies(tmp_path)
    assert len(done) >= 9 and set(done.values()) == {"written"}, done
