"""Render a cluster lab for one target and write the files."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

from pdlab.cluster import hyperpod, k8s, script
from pdlab.cluster.plan import ClusterPlan
from pdlab.config import ConfigError

Target = Literal["hyperpod", "k8s", "script"]
TARGETS: tuple[Target, ...] = get_args(Target)


def render(plan: ClusterPlan, target: Target, source: str = "spec") -> dict[str, str]:
    """File name -> text for `target`; ConfigError (naming the field) when the spec cannot be expressed there."""
    if target == "hyperpod":
        return hyperpod.render(plan, source)
    if target == "k8s":
        _huggingface_only(plan, target, source)
        return k8s.render(plan)
    if target == "script":
        _huggingface_only(plan, target, source)
        return script.render(plan)
    raise ValueError(f"unknown target {target!r}; targets: {TARGETS}")


def _huggingface_only(plan: ClusterPlan, target: Target, source: str) -> None:
    kind = plan.cluster.model_source.kind
    if kind != "huggingface":
        raise ConfigError(source, [("cluster.model_source.kind", f"`{kind}` sources are mounted by HyperPod's "
                                    f"operator; the {target} target downloads from the Hugging Face Hub")])


def write(files: dict[str, str], out_dir: Path) -> list[Path]:
    """Write rendered files under `out_dir` (created), scripts executable; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in sorted(files.items()):
        path = out_dir / name
        path.write_text(text)
        if name.endswith(".sh"):
            path.chmod(0o755)
        paths.append(path)
    return paths
