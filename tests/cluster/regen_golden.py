"""Regenerate tests/golden/cluster/<lab>/<target>/ from the shipped cluster labs (labs/hyperpod-*.yaml).

    PYTHONPATH=src python tests/cluster/regen_golden.py

Review the diff before committing: the golden files are what tests/cluster/test_cluster.py compares renders against.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pdlab.cluster.plan import load_plan
from pdlab.cluster.render import TARGETS, render, write

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "golden" / "cluster"


def cluster_labs() -> list[Path]:
    return sorted((ROOT / "labs").glob("hyperpod-*.yaml"))


def main() -> int:
    shutil.rmtree(GOLDEN, ignore_errors=True)
    for lab in cluster_labs():
        plan = load_plan(lab)
        for target in TARGETS:
            rel = lab.relative_to(ROOT)
            paths = write(render(plan, target, source=str(rel)), GOLDEN / plan.lab.name / target)
            print(f"{rel} {target}: {len(paths)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
