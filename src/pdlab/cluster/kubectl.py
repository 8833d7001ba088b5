"""Apply, delete and inspect rendered manifests with kubectl (the cluster's own client; pdlab holds no
credentials). Commands are built here and run by the CLI, or printed with --dry-run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

INSTALL_HINT = ("kubectl is not on PATH. Install it (https://kubernetes.io/docs/tasks/tools/, or on EKS "
                "`aws eks update-kubeconfig --name CLUSTER` after installing it) and point it at your cluster, or "
                "use --dry-run to see the commands.")


class KubectlMissing(RuntimeError):
    """kubectl is needed and not installed."""

    def __init__(self) -> None:
        super().__init__(INSTALL_HINT)


def kubectl_path() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise KubectlMissing
    return path


def apply_command(manifest_dir: Path) -> list[str]:
    return ["kubectl", "apply", "-f", str(manifest_dir)]


def delete_command(manifest_dir: Path) -> list[str]:
    return ["kubectl", "delete", "--ignore-not-found", "-f", str(manifest_dir)]


def status_command(namespace: str, endpoint_name: str, hyperpod: bool) -> list[str]:
    kinds = "inferenceendpointconfigs,deployments,pods" if hyperpod else "deployments,services,pods"
    selector = [] if hyperpod else ["-l", f"app.kubernetes.io/instance={endpoint_name}"]
    return ["kubectl", "get", kinds, "-n", namespace, *selector, "-o", "wide"]


def run(argv: list[str]) -> int:
    """Run a kubectl command with the real kubectl binary; returns its exit code."""
    completed = subprocess.run([kubectl_path(), *argv[1:]], check=False)
    return completed.returncode
