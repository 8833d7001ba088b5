"""Fixtures the router's tests share."""

from __future__ import annotations

import pytest

from pdlab.model import resolve
from tests.router_processes import MODEL


@pytest.fixture(scope="module")
def model_dir() -> str:
    """The test model's directory (made if missing): the router's tokenizer."""
    return resolve(MODEL)
