"""A spec's fields as command-line options, and back: one home for each option's name, type, default and help.

As vLLM derives its command line from `EngineArgs`, a pdlab process started by a launcher (the router) takes the
options its spec classes declare: `--field-name` for each field, the field's type, its default, and the first
paragraph of its docstring as help. `spec_argv` writes a spec back as those options (what a launcher or a cluster
renderer puts on the command line), and `spec_from_options` validates parsed options into the spec, naming the
option in errors. A field marked `json_schema_extra={"cli": False}` (a secret) never becomes an option.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal

import typer
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from pdlab.config.base import ConfigError, validate


def option_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def cli_fields(cls: type[BaseModel]) -> dict[str, FieldInfo]:
    """The fields of `cls` that are command-line options (all but those marked `cli: False`)."""
    return {name: info for name, info in cls.model_fields.items()
            if not (isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("cli") is False)}


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type without `| None`, whether None is allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation, False


def _help(info: FieldInfo) -> str:
    text = (info.description or "").split("\n\n")[0]
    return " ".join(text.split())


def _parameter(name: str, info: FieldInfo) -> inspect.Parameter:
    kind, optional = _unwrap(info.annotation)
    origin = typing.get_origin(kind)
    flag = option_name(name)
    default: Any = ... if info.is_required() else info.default
    if kind is bool:
        annotation: Any = bool | None if optional else bool
        flags = [f"{flag}/--no-{flag[2:]}"]
    elif origin is list:
        annotation = list[str] | None
        default = ... if info.is_required() else None  # typer's lists: None when the option is not given
        flags = [flag]
    elif origin is Literal or kind in (int, float, str):  # typer offers a Literal's values as choices
        annotation = kind | None if optional else kind
        flags = [flag]
    else:
        raise TypeError(f"{name}: no command-line form for {info.annotation!r}")
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                             default=typer.Option(default, *flags, help=_help(info)))


def spec_options(callback: Callable[..., Any], *classes: type[BaseModel],
                 extra: Iterable[inspect.Parameter] = ()) -> Callable[..., Any]:
    """`callback(**options)` as a typer command whose options are the fields of `classes` (plus `extra`)."""
    params = [_parameter(name, info) for cls in classes for name, info in cli_fields(cls).items()]
    params += list(extra)

    def command(**options: Any) -> Any:
        return callback(**options)

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = callback.__doc__
    command.__name__ = callback.__name__
    return command


def spec_from_options(cls: type[BaseModel], options: dict[str, Any], source: str = "command-line options") -> Any:
    """Validate the options that belong to `cls` (as parsed by a `spec_options` command); errors name the option."""
    data = {name: options[name] for name in cli_fields(cls) if options.get(name) is not None}
    try:
        return validate(cls, data, source=source)
    except ConfigError as error:
        problems = [(option_name(where.split(".")[0]) + where[len(where.split(".")[0]):], why)
                    for where, why in error.problems]
        raise ConfigError(source, problems) from None


def spec_argv(spec: BaseModel, skip: Iterable[str] = ()) -> list[str]:
    """`spec` as command-line options: every option field whose value differs from its default (a launcher and a
    cluster renderer write the same), lists as repeated options. Fields in `skip` are left out."""
    argv: list[str] = []
    skipped = set(skip)
    for name, info in cli_fields(type(spec)).items():
        value = getattr(spec, name)
        if name in skipped or (not info.is_required() and value == info.default):
            continue
        if isinstance(value, SecretStr):
            raise TypeError(f"{name}: a secret never goes on a command line")
        flag = option_name(name)
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            for item in value:
                argv += [flag, str(item)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
