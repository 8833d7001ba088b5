"""The HyperPod Inference Operator's CRD (data/hyperpod/), as a strict JSON Schema for rendered objects."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from pdlab.settings import data_dir

CRD_FILE = Path("hyperpod") / "inferenceendpointconfigs.crd.yaml"


def crd_schema(version: str = "v1", crd_path: Path | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of `version`, made strict: the API server prunes unknown fields silently, so a misspelt
    field would vanish on apply; here every object without `additionalProperties` (or preserve-unknown-fields)
    rejects keys it does not declare."""
    # 450 kB of YAML: libyaml's loader reads it ten times faster than the pure-Python one.
    crd = yaml.load((crd_path or data_dir() / CRD_FILE).read_text(), Loader=yaml.CSafeLoader)
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return _strict(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    raise KeyError(f"CRD has no version {version!r}")


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


def problems(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Each way `obj` breaks the schema, as `path.to.field: message`; empty when it conforms."""
    validator = Draft202012Validator(schema)
    out = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        out.append(f"{where}: {error.message}")
    return out


def field_docs(schema: dict[str, Any], path: str) -> dict[str, str]:
    """What the operator's schema says of each field under `path` (dotted, e.g. `spec.pdSpec`): field name ->
    its description (one line), for reading a rendered object beside the operator's own documentation."""
    node = schema
    for part in path.split("."):
        try:
            node = node["properties"][part]
        except KeyError:
            raise KeyError(f"{path}: the CRD has no field {part!r} there") from None
    return {name: " ".join(str(field.get("description", "")).split())
            for name, field in node.get("properties", {}).items()}
