"""Shared machinery for pdlab's typed specs: strict models, YAML loading and readable errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class Spec(BaseModel):
    """Base of every pdlab spec: unknown keys are errors (a typo must not be silently ignored), and each
    field's docstring becomes its description, so the classes double as the lab-spec reference."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ConfigError(ValueError):
    """A spec that does not validate. The message names each bad field by its path (e.g. `instances.0.role`)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s) in the spec"]
        lines += [f"  - {where}: {why}" for where, why in problems]
        super().__init__("\n".join(lines))

    @classmethod
    def from_validation(cls, source: str, error: ValidationError) -> ConfigError:
        problems = []
        for item in error.errors():
            where = ".".join(str(part) for part in item["loc"]) or "(top level)"
            problems.append((where, item["msg"]))
        return cls(source, problems)


SpecT = TypeVar("SpecT", bound=BaseModel)


def validate(cls: type[SpecT], data: Any, source: str = "spec") -> SpecT:
    """Validate plain data into `cls`, raising ConfigError that names each wrong field."""
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError.from_validation(source, error) from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(str(path), [("(file)", "no such file")])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(str(path), [("(yaml)", str(error))]) from None
    return {} if data is None else data


def load_yaml(path: str | Path, cls: type[SpecT]) -> SpecT:
    """Read a YAML file and validate it into `cls`."""
    return validate(cls, read_yaml(path), source=str(path))
